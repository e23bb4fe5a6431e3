"""HunyuanVideo-1.5 (text-to-video) through diffusers' own HunyuanVideo15Transformer3DModel under opendit's stack:
what is special to it (the command line, exact resume: tests/families/test_conformance.py):
prompts are the pipeline's own encode_prompt (quoted text through ByT5); the
loss is the pipeline's flow through diffusers' forward with a tiny video VAE; sampled clips equal
HunyuanVideo15Pipeline's own bitwise; sequence and CFG parallel sampling (opendit's plan: diffusers' class has none)
write what one process does (plugins, LoRA and SP training at two ranks: tests/families/test_conformance_ranks.py);
a frame count the VAE cannot take is an error naming the next valid one."""
import numpy as np
import pytest
import torch

from opendit import config as cfglib
from tests.run_each import sample_each, sample_here
from tests.test_train import run_trainer


@pytest.fixture(scope="module")
def encoders_folder(tmp_path_factory):
    from opendit.families.wrapped.hunyuanvideo15 import save_tiny_text_encoders
    return save_tiny_text_encoders(tmp_path_factory.mktemp("hv15"))


def hv_cfg(outputs, encoders, **kw):
    base = dict(model="hunyuanvideo1.5-debug", dataset="moving_digits", image_size=8, num_frames=5, vae="none",
                text_encoder=encoders, batch_size=4, max_steps=3, log_every=1, ckpt_every=100, num_workers=0,
                outputs=str(outputs), lr=1e-3, ema_decay=0.9)
    return cfglib.TrainConfig(**{**base, **kw})


def save_tiny_video_vae(folder):
    from diffusers import AutoencoderKLHunyuanVideo15

    torch.manual_seed(0)
    AutoencoderKLHunyuanVideo15(block_out_channels=(8,) * 5, layers_per_block=1, latent_channels=4,
                                scaling_factor=0.7).save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
def test_sequence_and_cfg_parallel_sampling_write_what_one_process_does(tmp_path, encoders_folder):
    """diffusers' class has no context-parallel plan; opendit's splits the clip's tokens and the joint text sequence
    (odd here: its Qwen tokens get padded) inside HunyuanVideo15Pipeline's own loop. Its guider calls the model for
    each guidance branch: --cfg_parallel puts the two calls of a step on two ranks."""
    run_trainer(hv_cfg(tmp_path, encoders_folder, max_steps=1))
    common = ["--ckpt", "latest", "--outputs", tmp_path, "--prompts", "the digit 7 moving left", "the digit 3",
              "--num_sampling_steps", "3", "--cfg_scale", "2", "--npz"]
    sample_here(*common, "--out", tmp_path / "one")
    sample_each([[*common, "--sequence_parallel_size", "2", "--out", tmp_path / "sp2"],
                 [*common, "--cfg_parallel", "--out", tmp_path / "cfg2"]], nproc=2)  # one torchrun launch
    one, sp2, cfg2 = (np.load(tmp_path / d / "samples.npz")["arr_0"] for d in ("one", "sp2", "cfg2"))
    np.testing.assert_array_equal(one, sp2)
    np.testing.assert_array_equal(one, cfg2)


def _parts(encoders_folder, vae, **kw):
    from opendit.families import get_family
    family = get_family("hunyuanvideo15")
    cfg = family.resolve_config(hv_cfg("unused", encoders_folder, vae=vae, **kw))
    encoders = family.load_encoders(cfg, torch.device("cpu"), training=True)
    torch.manual_seed(0)
    return family, cfg, encoders, family.build_model(cfg, family.latent_shape(cfg, encoders)).eval()


def test_prompts_latents_and_loss_follow_the_pipeline(tmp_path, encoders_folder):
    family, cfg, enc, model = _parts(encoders_folder, save_tiny_video_vae(tmp_path / "vae"), image_size=32)
    captions = ["the digit 7 moving left", 'a sign that reads "OPEN"']
    cond = enc.encode(captions, "cpu")
    # the template's 95 tokens cropped: each prompt's own tokens (5; 7 with the quotes) and the 3 that close the
    # chat turn are kept
    assert cond["mask"].sum(1).tolist() == [5 + 3, 7 + 3]
    assert not cond["mask_2"][0].any() and cond["mask_2"][1].sum() == len('Text "OPEN". ') + 1  # ByT5 bytes + </s>
    assert cond["embeds"].shape == (2, 16, 16) and cond["embeds_2"].shape == (2, 256, 16)
    objective = family.objective(cfg, enc)
    clips = torch.rand(2, 3, 5, 32, 32) * 2 - 1
    torch.manual_seed(1)
    x, cond = objective.prepare((clips, [0, 0], captions), torch.device("cpu"), train=False)
    assert x.shape == (2, 4, 2, 2, 2)  # 4 channels; 1 + 4 frames -> 2; 32 px / 16
    torch.manual_seed(1)
    found = [enc.vae.encode(clip[None]).latent_dist for clip in clips]  # diffusers' VAE takes one clip per call
    mean, std = (torch.cat([getattr(p, k) for p in found]) for k in ("mean", "std"))
    torch.testing.assert_close(x, (mean + std * torch.randn_like(mean)) * 0.7)
    t, noise = torch.tensor([0.3, 0.8]), torch.randn_like(x)
    losses, _ = objective.losses(model, x, cond, t_frac=t, noise=noise)
    # by hand: the pipeline's model input (latents, zero conditioning latents, zero mask), time 1000 t, zero image
    # tokens; target noise - x
    x_t = (1 - t.view(2, 1, 1, 1, 1)) * x + t.view(2, 1, 1, 1, 1) * noise
    pred = model(hidden_states=torch.cat([x_t, torch.zeros(2, 5, 2, 2, 2)], 1), timestep=1000 * t,
                 encoder_hidden_states=cond["embeds"], encoder_attention_mask=cond["mask"],
                 encoder_hidden_states_2=cond["embeds_2"], encoder_attention_mask_2=cond["mask_2"],
                 image_embeds=torch.zeros(2, 729, 16), return_dict=False)[0]
    torch.testing.assert_close(losses, ((pred - (noise - x)) ** 2).mean((1, 2, 3, 4)), rtol=1e-6, atol=1e-7)


def test_samples_equal_the_pipelines_own_clips(tmp_path, encoders_folder):
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline

    from opendit.families import LoadedModel
    from opendit.families.wrapped.hunyuanvideo15 import SCHEDULER
    from opendit.seeding import sampling_generator
    family, cfg, enc, model = _parts(encoders_folder, save_tiny_video_vae(tmp_path / "vae"), image_size=32)
    loaded = LoadedModel(family, model, enc, cfg, (4, 2, 2, 2), "random")
    sample_cfg = cfglib.SampleConfig(prompts=["the digit 7 moving left", 'a sign that reads "OPEN"'], cfg_scale=3.0,
                                     num_sampling_steps=3, seed=5)
    ours = family.sample_batch(loaded, family.make_sampler(sample_cfg, cfg), range(2, 5), sample_cfg.prompts,
                               sample_cfg, torch.device("cpu"))
    mine = enc.text.pipeline
    pipe = HunyuanVideo15Pipeline(text_encoder=mine.text_encoder, tokenizer=mine.tokenizer, transformer=model,
                                  vae=enc.vae, scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
                                  text_encoder_2=mine.text_encoder_2, tokenizer_2=mine.tokenizer_2,
                                  guider=ClassifierFreeGuidance(guidance_scale=3.0))
    pipe.tokenizer_max_length, pipe.prompt_template_encode_start_idx = 16, 95  # the debug model's settings
    noise = torch.randn(3, 4, 2, 2, 2, generator=sampling_generator(5, 2))
    theirs = pipe(prompt=[sample_cfg.prompts[i % 2] for i in range(2, 5)], negative_prompt=[""] * 3, latents=noise,
                  height=32, width=32, num_frames=5, num_inference_steps=3, output_type="np").frames
    assert ours.shape == (3, 5, 32, 32, 3)
    np.testing.assert_array_equal(ours, (theirs * 255).round().astype(np.uint8))


def test_a_frame_count_the_vae_cannot_take_names_the_next_valid_one(tmp_path, encoders_folder):
    from opendit.families import get_family
    family = get_family("hunyuanvideo15")
    vae = save_tiny_video_vae(tmp_path / "vae")
    cfg = family.resolve_config(hv_cfg("unused", encoders_folder, vae=vae, num_frames=8, image_size=32))
    with pytest.raises(ValueError, match=r"--num_frames 8: .* use 1 \+ 4k frames \(e.g. 9\)"):
        family.latent_shape(cfg, family.load_encoders(cfg, torch.device("cpu"), training=False))


def test_the_video_demo_recipe_runs(tmp_path, encoders_folder):
    """docs/diffusers_models.md's line: RECIPE=video bash train_diffusers.sh (its flags, a step of it; the tiny
    encoders given)."""
    import os
    import subprocess

    from tests.test_train import ROOT
    out = subprocess.run(["bash", "train_diffusers.sh", "--max_steps", "1", "--batch_size", "2", "--image_size", "8",
                          "--outputs", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "RECIPE": "video", "ENC": encoders_folder, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "000-hunyuanvideo1.5-debug" / "checkpoints" / "step-000001").is_dir()
