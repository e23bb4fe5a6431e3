"""The conformance table at two ranks (one spawn for every family of the kind), on each family's debug model with a
random base (a diffusers folder of it as --init_weights; diffusers zero-initialises output layers, which would leave
LoRA nothing to change): LoRA under FSDP with activation checkpointing trains the LoRA losses under DDP; with a
parallel plan, sequence parallelism at 2 ranks (FSDP, checkpointed, full fine-tune) trains what one process does
(both ranks see the same samples). The editing models (EDITING) train on pairs there too, their references split
with the image tokens. Full fine-tunes under every plugin: test_booster_dist.py and the families' own."""
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


# editing rows: a model that takes references, trained on the edit-digits pairs (reference tokens in the split)
EDITING = {"flux1-kontext-debug-diffusers": "flux1", "flux2-klein-debug": "flux2", "flux3-debug": "flux3",
           "qwen-image-edit-debug": "qwenimage"}


def edit_vae(model: str, folder) -> dict:
    """The options of an editing row whose model cannot edit in pixel space: a tiny VAE of its class at 64 px (FLUX.3
    normalises by its VAE's statistics; Qwen-Image-Edit hands references to its VAE at about 1024 x 1024)."""
    from tests.families.test_editing_qwen import save_tiny_qwen_vae_16x
    from tests.test_flux2_family import save_tiny_flux2_vae
    writers = {"flux3-debug": save_tiny_flux2_vae, "qwen-image-edit-debug": save_tiny_qwen_vae_16x}
    return dict(vae=writers[model](folder / "vae"), image_size=64, batch_size=2) if model in writers else {}


@pytest.fixture(scope="module")
def losses(tmp_path_factory):
    """{row: {run: losses}} of 2 steps at 2 ranks, all in one spawn ("one": one process, for SP); a row is a family,
    or an editing model of EDITING."""
    from opendit.families.wrapped.tiny_text import write_text_encoder
    root, configs, names = tmp_path_factory.mktemp("ranks"), [], []
    rows = {family: (family, DEBUG[family], None) for family in DEBUG}
    rows |= {model: (family, model, "edit_digits") for model, family in EDITING.items()}
    found = {row: {} for row in rows}
    for row, (family, model, dataset) in rows.items():
        fam, folder = FAMILIES[family], root / row.replace("/", "_")
        words = dataset or ("moving_digits" if "moving_digits" in fam.datasets else "digits")
        options = run_options(family, dict(text_encoder=write_text_encoder(model, folder / "text", words)))
        options |= dict(model=model, dataset=dataset, **edit_vae(model, folder)) if dataset else {}
        cfg = fam.resolve_config(cfglib.TrainConfig(**options, outputs="unused"))
        torch.manual_seed(0)
        built = fam.build_model(cfg, fam.latent_shape(cfg, fam.load_encoders(cfg, torch.device("cpu"), True)))
        with torch.no_grad():
            for p in built.parameters():
                p.add_(torch.randn_like(p), alpha=0.05)
        built.save_pretrained(folder / "base")
        runs = {**RUNS, "sp2": SP} if has_plan(family) else RUNS
        base = dict(init_weights=str(folder / "base"), ema_decay=0.0)
        for run, extra in runs.items():
            configs.append(cfglib.TrainConfig(**{**options, **extra, **base}, max_steps=2, ckpt_every=100,
                                              outputs=str(folder / run)))
            names.append((row, run))
        if has_plan(family):
            found[row]["one"] = run_trainer(cfglib.TrainConfig(**{**options, **base}, max_steps=2, ckpt_every=100,
                                                               outputs=str(folder / "one")))[1]
    for (row, run), losses_of_run in zip(names, run_distributed(train_each, 2, configs)[0]):
        found[row][run] = losses_of_run
    return found


@pytest.mark.slow
@pytest.mark.parametrize("family", [*DEBUG, *EDITING])
def test_lora_under_fsdp_with_checkpointing_equals_ddp_at_two_ranks(losses, family):
    found = losses[family]
    np.testing.assert_allclose(found["fsdp-lora-checkpointed"], found["ddp-lora"], rtol=1e-4, err_msg=family)
    assert all(np.isfinite(found["ddp-lora"])), family


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in DEBUG if has_plan(f)] + [m for m, f in EDITING.items() if has_plan(f)])
def test_sequence_parallel_training_at_two_ranks_equals_one_process(losses, family):
    np.testing.assert_allclose(losses[family]["sp2"], losses[family]["one"], rtol=1e-5, err_msg=family)
