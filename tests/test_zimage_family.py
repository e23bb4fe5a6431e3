"""Z-Image through diffusers' own ZImageTransformer2DModel under opendit's stack: what is special to it (the
command line, exact resume: tests/families/test_conformance.py): prompts are encoded by
the pipeline's own code; the loss is Z-Image's flow (model time 1 - t, target x - noise) through diffusers'
forward; sampled images equal ZImagePipeline's own bitwise (a tiny FLUX.1-style VAE); sequence and CFG parallel
sampling (opendit's plan: diffusers' class has none) write what one process does (plugins, LoRA and SP training at two
ranks: tests/families/test_conformance_ranks.py)."""
import numpy as np
import pytest
import torch

from opendit import config as cfglib
from tests.run_each import sample_each, sample_here
from tests.test_train import run_trainer


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from opendit.families.wrapped.flux2 import save_tiny_qwen3
    return save_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


def zimage_cfg(outputs, qwen, **kw):
    base = dict(model="z-image-debug", dataset="captioned_digits", image_size=8, vae="none", text_encoder=qwen,
                batch_size=4, max_steps=3, log_every=1, ckpt_every=100, num_workers=0, outputs=str(outputs), lr=1e-3,
                ema_decay=0.9)
    return cfglib.TrainConfig(**{**base, **kw})


def save_tiny_flux_vae(folder):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                  block_out_channels=(8, 8), layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=16,
                  scaling_factor=0.3611, shift_factor=0.1159).save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
def test_sequence_and_cfg_parallel_sampling_write_what_one_process_does(tmp_path, qwen):
    """Through opendit's plan (diffusers' class has none), inside ZImagePipeline's own loop: its guidance batch holds
    captions of different lengths, so the joint sequence carries a mask. --cfg_parallel splits that batch (lists of
    per-sample latents and captions) over two ranks."""
    run_trainer(zimage_cfg(tmp_path, qwen, max_steps=1))
    common = ["--ckpt", "latest", "--outputs", tmp_path, "--prompts", "a handwritten one", "the digit two", "--npz",
              "--num_sampling_steps", "3", "--cfg_scale", "2"]
    sample_here(*common, "--out", tmp_path / "one")
    sample_each([[*common, "--sequence_parallel_size", "2", "--out", tmp_path / "sp2"],
                 [*common, "--cfg_parallel", "--out", tmp_path / "cfg2"]], nproc=2)  # one torchrun launch
    one, sp2, cfg2 = (np.load(tmp_path / d / "samples.npz")["arr_0"] for d in ("one", "sp2", "cfg2"))
    np.testing.assert_array_equal(one, sp2)
    np.testing.assert_array_equal(one, cfg2)


def _parts(qwen, vae):
    from opendit.families import get_family
    family = get_family("zimage")
    cfg = family.resolve_config(zimage_cfg("unused", qwen, vae=vae, image_size=16))
    encoders = family.load_encoders(cfg, torch.device("cpu"), training=True)
    torch.manual_seed(0)
    return family, cfg, encoders, family.build_model(cfg, family.latent_shape(cfg, encoders)).eval()


def test_prompts_and_loss_follow_the_pipeline_and_its_flow(tmp_path, qwen):
    from diffusers import ZImagePipeline
    family, cfg, enc, model = _parts(qwen, save_tiny_flux_vae(tmp_path / "vae"))
    captions = ["a handwritten one", "the digit twenty two"]  # two lengths: padded and masked
    cond = enc.encode(captions, "cpu")
    pipe = ZImagePipeline(None, enc.vae, enc.text.model, enc.text.tokenizer, model)
    theirs = pipe._encode_prompt(list(captions), device="cpu", max_sequence_length=16)  # it rewrites the list
    assert [int(m.sum()) for m in cond["mask"]] == [len(e) for e in theirs] and len(theirs[0]) != len(theirs[1])
    for e, m, t in zip(cond["embeds"], cond["mask"], theirs):
        torch.testing.assert_close(e[m], t, rtol=0, atol=0)
        assert not e[~m].any()
    objective = family.objective(cfg, enc)
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    x, cond = objective.prepare((images, captions), torch.device("cpu"), train=False)
    assert x.shape == (2, 4, 8, 8)  # the model's own latents: 4 channels, 16 px / the 2x VAE
    t, noise = torch.tensor([0.3, 0.8]), torch.randn_like(x)
    losses, _ = objective.losses(model, x, cond, t_frac=t, noise=noise)
    x_t = (1 - t[:, None, None, None]) * x + t[:, None, None, None] * noise
    out = model(list(x_t.unsqueeze(2).unbind(0)), 1 - t, theirs, return_dict=False)[0]
    by_hand = ((torch.stack(out).squeeze(2) - (x - noise)) ** 2).mean((1, 2, 3))
    torch.testing.assert_close(losses, by_hand, rtol=1e-6, atol=1e-7)


def test_samples_equal_the_pipelines_own_images(tmp_path, qwen):
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    from opendit.families import LoadedModel
    from opendit.families.wrapped.zimage import SCHEDULER
    from opendit.seeding import sampling_generator
    family, cfg, enc, model = _parts(qwen, save_tiny_flux_vae(tmp_path / "vae"))
    loaded = LoadedModel(family, model, enc, cfg, (4, 8, 8), "random")
    sample_cfg = cfglib.SampleConfig(prompts=["a handwritten one", "the digit seven"], cfg_scale=3.0,
                                     num_sampling_steps=3, seed=5)
    ours = family.sample_batch(loaded, family.make_sampler(sample_cfg, cfg), range(2, 5), sample_cfg.prompts,
                               sample_cfg, torch.device("cpu"))
    pipe = ZImagePipeline(FlowMatchEulerDiscreteScheduler(**SCHEDULER), enc.vae, enc.text.model, enc.text.tokenizer,
                          model)
    noise = torch.randn(3, 4, 8, 8, generator=sampling_generator(5, 2))
    theirs = pipe(prompt=["a handwritten one", "the digit seven", "a handwritten one"], negative_prompt=[""] * 3,
                  latents=noise, height=16, width=16, num_inference_steps=3, guidance_scale=2.0,
                  max_sequence_length=16, output_type="pil").images
    assert ours.shape == (3, 16, 16, 3)
    np.testing.assert_array_equal(ours, np.stack([np.asarray(im) for im in theirs]))
