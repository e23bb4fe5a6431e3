"""Resuming never unpickles code: trainer.pt and the per-rank files hold tensors and plain values only and are
read with torch.load(weights_only=True), DCP's .metadata through an unpickler that admits only its own classes,
and DCP's values inside .distcp files (non-tensor entries through SafeLoadPlanner, tensor entries through
torch.load(weights_only=True)) must pass weights_only=True; a planted pickle is refused and its payload never
runs, whether or not the attacker also rewrote manifest.json (which is an integrity check, not a signature)."""
import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from opendit.checkpoint import manifest as integrity
from opendit.checkpoint import load_weights
from opendit.checkpoint.safe_read import SafeReader
from tests.test_train import run_trainer, tiny_cfg


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling this would create the marker file
        return (open, (self.marker, "w"))


def trained_step(tmp_path):
    run_trainer(tiny_cfg(tmp_path, max_steps=1))
    return next((tmp_path / "000-DiT-debug" / "checkpoints").glob("step-*"))


def reseal(step, name):
    """What an attacker who can plant a file can also do: record the planted file in manifest.json."""
    integrity._VERIFIED.clear()
    integrity.record_files(str(step), [name])


def plant_in_distcp(step, marker, kind: str) -> str:
    """Overwrite one entry of the .distcp file, at its offset and length from .metadata's storage_data, with
    the payload's pickle (zero-padded): a non-tensor value ("bytes": an optimizer param-group value, read
    through SafeLoadPlanner.load_bytes) or a tensor ("tensor": an EMA weight, read by DCP's torch.load).
    Returns the planted fqn."""
    metadata = SafeReader(str(step)).read_metadata()
    want = BytesStorageMetadata if kind == "bytes" else TensorStorageMetadata
    index, info = next((i, s) for i, s in metadata.storage_data.items()
                       if isinstance(metadata.state_dict_metadata[i.fqn], want)
                       and i.fqn.startswith("optim." if kind == "bytes" else "ema."))
    payload = pickle.dumps(Payload(str(marker)), protocol=2)
    assert len(payload) <= info.length
    with open(step / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(payload.ljust(info.length, b"\0"))
    # control: torch's own non-tensor loading (weights_only=False) would run it
    with open(step / info.relative_path, "rb") as f:
        f.seek(info.offset)
        with pytest.raises(RuntimeError, match="magic number"):  # raised after the payload ran
            torch.load(io.BytesIO(f.read(info.length)), weights_only=False)
    assert marker.exists(), "the planted entry does not run code under a plain torch.load; the test is blind"
    marker.unlink()
    return index.fqn


@pytest.mark.parametrize("victim", ["trainer.pt", os.path.join("ranks", "rank-00000.pt"), ".metadata"])
@pytest.mark.parametrize("resealed", [True, False])
def test_a_planted_pickle_is_refused_and_never_runs(tmp_path, victim, resealed):
    step = trained_step(tmp_path)
    marker = tmp_path / "payload_ran"
    with open(step / victim, "wb") as f:
        pickle.dump({"step": Payload(str(marker))}, f)
    if resealed:
        reseal(step, victim)
    with pytest.raises(ValueError, match="refusing to unpickle" if resealed else "failed verification"):
        run_trainer(tiny_cfg(tmp_path, max_steps=2, load=str(step)))
    if resealed:
        with pytest.raises(ValueError, match="refusing to unpickle"):
            run_trainer(tiny_cfg(tmp_path, max_steps=2, load="latest"))
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["bytes", "tensor"])
def test_a_planted_pickle_inside_a_distcp_file_is_refused_and_never_runs(tmp_path, kind):
    step = trained_step(tmp_path)
    marker = tmp_path / "payload_ran"
    fqn = plant_in_distcp(step, marker, kind)
    with pytest.raises(ValueError, match="__0_0.distcp.*failed verification|failed verification.*__0_0.distcp"):
        run_trainer(tiny_cfg(tmp_path, max_steps=2, load=str(step)))  # the manifest notices first
    reseal(step, "__0_0.distcp")
    match = (rf"checkpoint value '{fqn}': refusing to unpickle" if kind == "bytes" else
             "a .distcp tensor entry holds objects other than tensors.*refusing to unpickle")
    with pytest.raises(ValueError, match=match):
        run_trainer(tiny_cfg(tmp_path, max_steps=2, load=str(step)))
    if kind == "tensor":  # sample.py's reading of a step folder: load_weights, through the same safe path
        with pytest.raises(ValueError, match=match):
            load_weights(str(step))
        from opendit.config import SampleConfig
        from opendit.inference import load_model

        os.remove(step / "ema.safetensors")  # without the export, sample.py reads the DCP shards
        with pytest.raises(ValueError, match=match):
            load_model(SampleConfig(ckpt=str(step)), torch.device("cpu"))
    assert not marker.exists()


def test_dcp_default_planner_would_run_a_planted_bytes_entry(tmp_path):
    """The control at the level of DCP itself: torch's DefaultLoadPlanner unpickles non-tensor values with
    weights_only=False, so SafeLoadPlanner is what keeps the planted payload from running."""
    step = trained_step(tmp_path)
    marker = tmp_path / "payload_ran"
    fqn = plant_in_distcp(step, marker, "bytes")
    state = {fqn: None}
    try:
        dcp.load(state, storage_reader=SafeReader(str(step)), planner=dcp.DefaultLoadPlanner(), no_dist=True)
    except BaseException:  # the payload's return value is no valid entry; what matters is that it ran
        pass
    ran = marker.exists()
    if ran:
        marker.unlink()
    assert ran
