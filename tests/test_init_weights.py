"""--init_weights: a run starts at step 0 from a file's weights (built on the meta device, filled strictly)."""
import pytest
import torch

from tests.test_train import run_trainer, tiny_cfg


def test_a_run_starts_from_the_weights_of_another(tmp_path):
    first, _ = run_trainer(tiny_cfg(tmp_path / "a", max_steps=2))
    export = next((tmp_path / "a" / "000-DiT-debug" / "checkpoints").glob("step-*")) / "ema.safetensors"
    from opendit.checkpoint import load_weights
    from opendit.training.loop import Trainer

    trainer = Trainer(tiny_cfg(tmp_path / "b", init_weights=str(export)))
    try:
        start = trainer.booster.unwrap(trainer.model).state_dict()
        for name, value in load_weights(str(export)).items():
            assert torch.equal(start[name], value), name
        assert trainer.step == 0 and all(t.device.type == "cpu" and not t.is_meta for t in start.values())
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def test_weights_of_another_model_are_a_clear_error(tmp_path):
    run_trainer(tiny_cfg(tmp_path / "a", max_steps=1))
    export = next((tmp_path / "a" / "000-DiT-debug" / "checkpoints").glob("step-*")) / "ema.safetensors"
    with pytest.raises(ValueError, match="does not fit DiT"):
        run_trainer(tiny_cfg(tmp_path / "b", model="DiT-S/2", init_weights=str(export)))
