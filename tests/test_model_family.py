"""The model-family seam: a family defined in tests/ (tests/toy_family.py, unconditional) trains, checkpoints,
resumes and samples through the real Trainer and sample.py; every registered family's model meets the contract;
registry and contract errors are clear. (Through the entry scripts under OPENDIT_FAMILIES: test_text_family.py.)"""
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

import tests.text_family  # noqa: F401  (registers the "shapes" family)
import tests.toy_family  # noqa: F401  (registers the "toy" family)
from opendit import config as cfglib
from opendit.families import FAMILIES, ModelFamily, ModelSpec, check_model_contract, family_of, register_family
from opendit.kernels import set_kernels
from opendit.parallel import enable_sequence_parallel
from tests.test_train import ROOT, run_trainer, tiny_cfg

sys.path.insert(0, str(ROOT))
import sample  # noqa: E402  (the entry script, run in-process)


def toy_cfg(outputs, **kw):
    return tiny_cfg(outputs, model="Toy-S", **kw)


def test_toy_family_trains_resumes_and_samples_through_the_real_entry_points(tmp_path):
    trainer, full = run_trainer(toy_cfg(tmp_path / "a", max_steps=6, ckpt_every=3))
    assert trainer.family.name == "toy" and type(trainer.model).__name__ == "ToyDiT"
    assert all(np.isfinite(full))
    run_trainer(toy_cfg(tmp_path / "b", max_steps=3, ckpt_every=3))
    _, resumed = run_trainer(toy_cfg(tmp_path / "b", max_steps=6, ckpt_every=3, load="latest"))
    assert resumed == full[3:]  # exact in fp32: the seam carries data, RNG and checkpoint state like DiT's
    run = tmp_path / "b" / "000-Toy-S"
    assert cfglib.load_yaml(cfglib.TrainConfig, run / "config.yaml").model == "Toy-S"

    out = tmp_path / "samples"
    sample.main(cfglib.SampleConfig(ckpt="latest", outputs=str(tmp_path / "b"), num_samples=4, batch_size=3,
                                    num_sampling_steps=4, out=str(out), npz=True))
    images = np.load(out / "samples.npz")["arr_0"]
    assert images.shape == (4, 8, 8, 3) and images.dtype == np.uint8 and images.std() > 0
    assert np.array_equal(np.asarray(Image.open(out / "images" / "000003.png").convert("RGB")), images[3])
    assert (out / "grid.png").is_file()


def test_unconditional_family_refuses_class_labels(tmp_path):
    run_trainer(toy_cfg(tmp_path, max_steps=1))
    with pytest.raises(SystemExit, match="unconditional"):
        sample.main(cfglib.SampleConfig(ckpt="latest", outputs=str(tmp_path), class_labels=[1],
                                        out=str(tmp_path / "s")))


def test_registry_lookups_and_errors():
    assert family_of("DiT-XL/2").name == "dit" and family_of("Toy-S").name == "toy"
    with pytest.raises(ValueError, match="unknown model 'Nope'; valid names: .*DiT-S/2.*Toy-S"):
        family_of("Nope")

    class Clash(ModelFamily):
        name = "clash"
        models = {"DiT-S/2": ModelSpec("DiT-S/2", "clash", torch.nn.Linear)}
    with pytest.raises(ValueError, match="already belong to family 'dit'"):
        register_family(Clash())
    assert "clash" not in FAMILIES


def smallest(family) -> str:
    def size(arch):  # width x depth, in the names of the opendit models, Wan's official config or diffusers'
        width = arch.get("hidden_size") or arch.get("dim") or arch["num_attention_heads"] * arch["attention_head_dim"]
        return width * (arch.get("depth") or arch.get("num_layers") or arch["n_layers"])
    return min(family.models, key=lambda n: size(family.models[n].arch))


# pixel sizes a model needs beyond 16 (Sana: multiples of 32)
IMAGE_SIZE = {"sana": 32}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_model_meets_the_contract(name, tmp_path):
    """The smallest model of each registered family, built through its family on its first built-in dataset,
    answers what shared code calls: block lists (for the booster), set_kernels (the attention backend switch
    keeps the loss), enable_sequence_parallel(None); its forward runs through the family's own objective."""
    from torch.utils.data import default_collate

    from opendit.booster.parallelize import iter_blocks
    from opendit.families.wan.tiny_umt5 import save_tiny_umt5
    from opendit.families.wrapped.tiny_text import write_text_encoder
    from tests.families.test_flux import tiny_text_encoders

    family = FAMILIES[name]
    t5, clip = tiny_text_encoders(tmp_path, words="all")
    umt5 = save_tiny_umt5(tmp_path / "umt5", words="all", max_length=16)
    # the diffusers kind's models: the tiny text encoder their debug model names
    debug = next((m for m, spec in family.models.items() if "tiny_text" in spec.constants), None)
    text = None if debug is None else write_text_encoder(debug, tmp_path / "text", words="all")
    dataset_name = next(n for n, spec in family.datasets.items() if spec.built_in)
    cfg = family.resolve_config(cfglib.TrainConfig(model=debug or smallest(family), dataset=dataset_name,
                                                   image_size=IMAGE_SIZE.get(name, 16), clip=clip, t5=t5, umt5=umt5,
                                                   text_encoder=text or "none", num_frames=2, t5_max_length=16))
    encoders = family.load_encoders(cfg, torch.device("cpu"), training=True)
    dataset, cfg = family.load_data(cfg, encoders)
    torch.manual_seed(0)
    model = family.build_model(cfg, family.latent_shape(cfg, encoders, dataset)).eval()
    check_model_contract(model, cfg.model)
    assert len(list(iter_blocks(model))) >= 2
    objective = family.objective(cfg, encoders)
    batch = default_collate([dataset[i] for i in range(2)])
    x, cond = objective.prepare(batch, torch.device("cpu"), train=False)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    fixed = dict(t_frac=torch.tensor([0.3, 0.7]), noise=noise)
    with torch.no_grad():
        sdpa = objective.losses(model, x, cond, **fixed)[0]
        set_kernels(model, attn_backend="math")
        math = objective.losses(model, x, cond, **fixed)[0]
        set_kernels(model)
    torch.testing.assert_close(math, sdpa, rtol=1e-5, atol=1e-6)
    assert sdpa.shape == (2,) and torch.isfinite(sdpa).all()
    if model.parallel_plan is not None:  # diffusers' transformers bring no opendit plan (sequence_parallel_size 1)
        assert enable_sequence_parallel(model, None) is None


def test_model_contract_check_names_what_is_missing():
    with pytest.raises(TypeError, match=r"missing \['_block_lists', 'parallel_plan'\]"):
        check_model_contract(torch.nn.Linear(2, 2), "Linear")


def test_shared_layers_import_without_dit():
    code = ("import sys, opendit.models.layers, opendit.models.blocks, opendit.models.pos_embed, opendit.parallel; "
            "bad = [m for m in sys.modules if m in ('opendit.families.dit.model', 'opendit.families')]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_booster_wraps_the_blocks_a_family_declares(tmp_path):
    """ToyDiT keeps its blocks in .layers: sharding and activation checkpointing follow _block_lists."""
    from torch.distributed.fsdp import FSDPModule

    trainer, losses = run_trainer(toy_cfg(tmp_path, plugin="zero2", grad_checkpoint=1, max_steps=2))
    assert all(isinstance(layer, FSDPModule) for layer in trainer.model.layers) and all(np.isfinite(losses))


def test_an_official_dit_pt_is_named_and_sized_from_its_shapes(tmp_path):
    """DiT-XL-2-512x512.pt needs no --image_size: the model, classes, sigma and size come from the shapes."""
    from opendit.families import build_model
    from opendit.families.dit.family import DiTFamily

    model = build_model("DiT-S/4", input_size=64, num_classes=1000)
    torch.save(model.state_dict(), tmp_path / "DiT-S-4-512x512.pt")
    settings, state = DiTFamily().recognize_checkpoint(str(tmp_path / "DiT-S-4-512x512.pt"))
    assert state is None and settings["model"] == "DiT-S/4" and settings["image_size"] == 512
    assert settings["num_classes"] == 1000 and settings["learn_sigma"]
    assert settings["vae"] == "stabilityai/sd-vae-ft-ema"
    torch.save({"temp_embed": torch.zeros(1), "pos_embed": torch.zeros(1)}, tmp_path / "latte.pt")
    assert DiTFamily().recognize_checkpoint(str(tmp_path / "latte.pt")) is None  # not a DiT: the video family's
