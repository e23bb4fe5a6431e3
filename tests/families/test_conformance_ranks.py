"""The conformance table at two ranks (one spawn for every family of the kind), on each family's debug model with a
random base (a diffusers folder of it as --init_weights; diffusers zero-initialises output layers, which would leave
LoRA nothing to change): LoRA under FSDP with activation checkpointing trains the LoRA losses under DDP; with a
parallel plan, sequence parallelism at 2 ranks (FSDP, checkpointed, full fine-tune) trains what one process does
(both ranks see the same samples). Full fine-tunes under every plugin: test_booster_dist.py and the families' own."""
import numpy as np
import pytest
import torch

from opendit import config as cfglib
from opendit.families import FAMILIES
from tests.distributed import run_distributed, train_each
from tests.families.test_conformance import DEBUG, run_options
from tests.test_train import run_trainer

RUNS = {"ddp-lora": dict(lora_rank=4), "fsdp-lora-checkpointed": dict(plugin="fsdp", grad_checkpoint=1, lora_rank=4)}
SP = dict(sequence_parallel_size=2, plugin="fsdp", grad_checkpoint=1)


def has_plan(family: str) -> bool:
    return FAMILIES[family].glue.parallel_plan is not None


@pytest.fixture(scope="module")
def losses(tmp_path_factory):
    """{family: {run: losses}} of 2 steps at 2 ranks, all in one spawn ("one": one process, for SP)."""
    from opendit.families.wrapped.tiny_text import write_text_encoder
    root, configs, names, found = tmp_path_factory.mktemp("ranks"), [], [], {f: {} for f in DEBUG}
    for family in DEBUG:
        words = "moving_digits" if "moving_digits" in FAMILIES[family].datasets else "digits"
        options = run_options(family, dict(text_encoder=write_text_encoder(DEBUG[family], root / family / "text",
                                                                           words)))
        fam = FAMILIES[family]
        cfg = fam.resolve_config(cfglib.TrainConfig(**options, outputs="unused"))
        torch.manual_seed(0)
        model = fam.build_model(cfg, fam.latent_shape(cfg, fam.load_encoders(cfg, torch.device("cpu"), True)))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.05)
        model.save_pretrained(root / family / "base")
        runs = {**RUNS, "sp2": SP} if has_plan(family) else RUNS
        base = dict(init_weights=str(root / family / "base"), ema_decay=0.0)
        for run, extra in runs.items():
            configs.append(cfglib.TrainConfig(**{**options, **extra, **base}, max_steps=2, ckpt_every=100,
                                              outputs=str(root / family / run)))
            names.append((family, run))
        if has_plan(family):
            found[family]["one"] = run_trainer(cfglib.TrainConfig(**{**options, **base}, max_steps=2, ckpt_every=100,
                                                                  outputs=str(root / family / "one")))[1]
    for (family, run), losses_of_run in zip(names, run_distributed(train_each, 2, configs)[0]):
        found[family][run] = losses_of_run
    return found


@pytest.mark.slow
@pytest.mark.parametrize("family", DEBUG)
def test_lora_under_fsdp_with_checkpointing_equals_ddp_at_two_ranks(losses, family):
    found = losses[family]
    np.testing.assert_allclose(found["fsdp-lora-checkpointed"], found["ddp-lora"], rtol=1e-4, err_msg=family)
    assert all(np.isfinite(found["ddp-lora"])), family


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in DEBUG if has_plan(f)])
def test_sequence_parallel_training_at_two_ranks_equals_one_process(losses, family):
    np.testing.assert_allclose(losses[family]["sp2"], losses[family]["one"], rtol=1e-5, err_msg=family)
