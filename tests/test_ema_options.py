"""--ema_decay 0 (no EMA: checkpoints without one, sampling reads the weights) and --ema_on_host (the EMA in host
memory), through the Trainer and sample.py's loader (DiT-debug on the digits, as in test_train.py)."""
import pytest
import torch

from opendit import config as cfglib
from opendit.inference import load_model
from tests.test_train import run_trainer, tiny_cfg


def test_no_ema_saves_no_export_and_sampling_loads_the_weights(tmp_path):
    trainer, losses = run_trainer(tiny_cfg(tmp_path, max_steps=2, ema_decay=0.0))
    assert trainer.ema is None
    step = next((tmp_path / "000-DiT-debug" / "checkpoints").glob("step-*"))
    assert not (step / "ema.safetensors").exists()
    loaded = load_model(cfglib.SampleConfig(ckpt="latest", outputs=str(tmp_path)), torch.device("cpu"))
    trained = trainer.booster.unwrap(trainer.model).state_dict()
    for name, value in loaded.model.state_dict().items():
        assert torch.equal(value, trained[name]), name
    _, resumed = run_trainer(tiny_cfg(tmp_path, max_steps=3, ema_decay=0.0, load="latest"))
    assert len(resumed) == 1  # resumes without an EMA


def test_ema_on_host_equals_the_ema_beside_the_weights(tmp_path):
    on_host, _ = run_trainer(tiny_cfg(tmp_path / "h", max_steps=3, ema_on_host=True))
    beside, _ = run_trainer(tiny_cfg(tmp_path / "b", max_steps=3))
    a, b = on_host.ema.state_dict(), beside.ema.state_dict()
    assert all(t.device.type == "cpu" for t in a.values())
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_ema_on_host_needs_an_ema(tmp_path):
    with pytest.raises(ValueError, match="--ema_on_host"):
        run_trainer(tiny_cfg(tmp_path, ema_on_host=True, ema_decay=0.0))
