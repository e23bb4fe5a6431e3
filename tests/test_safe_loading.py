"""Resuming never unpickles code: trainer.pt and the per-rank files hold tensors and plain values only and are
read with torch.load(weights_only=True), DCP's .metadata through an unpickler that admits only its own classes,
and DCP's non-tensor values must pass weights_only=True; a planted pickle is refused and its payload never runs."""
import os
import pickle

import pytest

from tests.test_train import run_trainer, tiny_cfg


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling this would create the marker file
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("victim", ["trainer.pt", os.path.join("ranks", "rank-00000.pt"), ".metadata"])
def test_a_planted_pickle_is_refused_and_never_runs(tmp_path, victim):
    run_trainer(tiny_cfg(tmp_path, max_steps=1))
    step = next((tmp_path / "000-DiT-debug" / "checkpoints").glob("step-*"))
    marker = tmp_path / "payload_ran"
    with open(step / victim, "wb") as f:
        pickle.dump({"step": Payload(str(marker))}, f)
    with pytest.raises(ValueError, match="refusing to unpickle"):
        run_trainer(tiny_cfg(tmp_path, max_steps=2, load="latest"))
    assert not marker.exists()
