"""Qwen-Image through diffusers' own QwenImageTransformer2DModel under opendit's stack: what is special to it (the
command line, exact resume: tests/families/test_conformance.py): prompts
are encoded by the pipeline's own code (its system template's 34 tokens dropped); the loss is the recipe's through
diffusers' forward; sampled images equal QwenImagePipeline's own bitwise (a tiny causal 3-D VAE) (plugins, LoRA and SP
training at two ranks: tests/families/test_conformance_ranks.py)."""
import numpy as np
import pytest
import torch

from opendit import config as cfglib
from tests.run_each import sample_each, sample_here
from tests.test_train import run_trainer


@pytest.fixture(scope="module")
def qwen25vl(tmp_path_factory):
    from opendit.families.wrapped.qwenimage import save_tiny_qwen25vl
    return save_tiny_qwen25vl(tmp_path_factory.mktemp("qwen25vl"))


def qwen_cfg(outputs, encoder, **kw):
    base = dict(model="qwen-image-debug", dataset="captioned_digits", image_size=8, vae="none", text_encoder=encoder,
                batch_size=4, max_steps=3, log_every=1, ckpt_every=100, num_workers=0, outputs=str(outputs), lr=1e-3,
                ema_decay=0.9)
    return cfglib.TrainConfig(**{**base, **kw})


def save_tiny_qwen_vae(folder):
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[False],
                           latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 2.0, 1.0]).save_pretrained(folder)
    return str(folder)


def _parts(encoder, vae):
    from opendit.families import get_family
    family = get_family("qwenimage")
    cfg = family.resolve_config(qwen_cfg("unused", encoder, vae=vae, image_size=16))
    encoders = family.load_encoders(cfg, torch.device("cpu"), training=True)
    torch.manual_seed(0)
    return family, cfg, encoders, family.build_model(cfg, family.latent_shape(cfg, encoders)).eval()


@pytest.mark.slow
def test_sequence_and_cfg_parallel_sampling_write_what_one_process_does(tmp_path, qwen25vl):
    """QwenImagePipeline calls the model for each guidance branch: --cfg_parallel puts the two calls of a step on two
    ranks; SP splits image and text tokens (its prompts padded to different lengths, so masked)."""
    run_trainer(qwen_cfg(tmp_path, qwen25vl, max_steps=1))
    common = ["--ckpt", "latest", "--outputs", tmp_path, "--prompts", "a handwritten one", "the digit two", "--npz",
              "--num_sampling_steps", "3", "--cfg_scale", "2"]
    sample_here(*common, "--out", tmp_path / "one")
    sample_each([[*common, "--sequence_parallel_size", "2", "--out", tmp_path / "sp2"],
                 [*common, "--cfg_parallel", "--out", tmp_path / "cfg2"]], nproc=2)  # one torchrun launch
    one, sp2, cfg2 = (np.load(tmp_path / d / "samples.npz")["arr_0"] for d in ("one", "sp2", "cfg2"))
    np.testing.assert_array_equal(one, sp2)
    np.testing.assert_array_equal(one, cfg2)


def test_prompts_latents_and_loss_follow_the_pipeline_and_the_recipe(tmp_path, qwen25vl):
    from diffusers import QwenImagePipeline
    family, cfg, enc, model = _parts(qwen25vl, save_tiny_qwen_vae(tmp_path / "vae"))
    captions = ["a handwritten one", "the digit seven seven seven"]
    pipe = QwenImagePipeline(None, enc.vae, enc.text.model, enc.text.tokenizer, model)
    template = pipe.prompt_template_encode.split("{}")[0]
    assert len(enc.text.tokenizer(template).input_ids) == pipe.prompt_template_encode_start_idx == 34
    theirs, their_mask = pipe.encode_prompt(list(captions), device="cpu")
    cond = enc.encode(captions, "cpu")
    n = their_mask.shape[1]
    assert torch.equal(cond["mask"][:, :n], their_mask.bool()) and not cond["mask"][:, n:].any()
    torch.testing.assert_close(cond["embeds"][:, :n], theirs * their_mask[..., None], rtol=0, atol=0)
    objective = family.objective(cfg, enc)
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    x, cond = objective.prepare((images, captions), torch.device("cpu"), train=False)
    assert x.shape == (2, 16, 4, 4)  # 4 latent channels in 2x2 patches; 16 px / the 2x VAE / 2
    t, noise = torch.tensor([0.3, 0.8]), torch.randn_like(x)
    losses, _ = objective.losses(model, x, cond, t_frac=t, noise=noise)
    # by hand: the pipeline's packing of the latents before patching, diffusers' forward, target noise - x

    def unpatched(z):  # [B, 4C, h, w] with channels (c, dy, dx) -> [B, C, 2h, 2w]
        return z.view(2, 4, 2, 2, 4, 4).permute(0, 1, 4, 2, 5, 3).reshape(2, 4, 8, 8)
    x0, eps = unpatched(x), unpatched(noise)
    x_t = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * eps
    pred = model(hidden_states=QwenImagePipeline._pack_latents(x_t, 2, 4, 8, 8), encoder_hidden_states=cond["embeds"],
                 encoder_hidden_states_mask=cond["mask"], timestep=t, img_shapes=[[(1, 4, 4)]] * 2,
                 return_dict=False)[0]
    target = QwenImagePipeline._pack_latents(eps - x0, 2, 4, 8, 8)
    torch.testing.assert_close(losses, ((pred - target) ** 2).mean((1, 2)), rtol=1e-6, atol=1e-7)


def test_samples_equal_the_pipelines_own_images(tmp_path, qwen25vl):
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    from opendit.families import LoadedModel
    from opendit.families.wrapped.glue import pack
    from opendit.families.wrapped.qwenimage import SCHEDULER
    from opendit.seeding import sampling_generator
    family, cfg, enc, model = _parts(qwen25vl, save_tiny_qwen_vae(tmp_path / "vae"))
    loaded = LoadedModel(family, model, enc, cfg, (16, 4, 4), "random")
    sample_cfg = cfglib.SampleConfig(prompts=["a handwritten one", "the digit seven"], cfg_scale=3.0,
                                     num_sampling_steps=3, seed=5)
    ours = family.sample_batch(loaded, family.make_sampler(sample_cfg, cfg), range(2, 5), sample_cfg.prompts,
                               sample_cfg, torch.device("cpu"))
    pipe = QwenImagePipeline(FlowMatchEulerDiscreteScheduler(**SCHEDULER), enc.vae, enc.text.model,
                             enc.text.tokenizer, model)
    noise = torch.randn(3, 16, 4, 4, generator=sampling_generator(5, 2))
    theirs = pipe(prompt=["a handwritten one", "the digit seven", "a handwritten one"], negative_prompt=[""] * 3,
                  latents=pack(noise), height=16, width=16, num_inference_steps=3, true_cfg_scale=3.0,
                  max_sequence_length=32, output_type="pil").images
    assert ours.shape == (3, 16, 16, 3)
    np.testing.assert_array_equal(ours, np.stack([np.asarray(im) for im in theirs]))
