"""Wan2.1/2.2 (native) beyond the conformance table (which trains Wan-debug on the captioned moving digits through a
tiny local UMT5 from the command line, resumes it exactly and samples it): sample.py writes MP4s with both samplers,
a negative prompt, and other frame counts and sizes than trained; Wan2.2's image-to-video and expert runs resume
exactly; a cache from preprocess.py --family wan (tiny Wan VAE, UMT5 embeddings) trains like encoding on the fly and
loads no encoder; the plugins, sequence parallelism and the lean optimizer options run Wan-debug like the plain path;
a diffusers Wan folder and an official one sample."""
import json

import av
import numpy as np
import pytest
import torch

from opendit import config as cfglib
from tests.distributed import run_distributed, train_each
from tests.run_each import cli, losses_of, run_here, sample_here
from tests.test_train import run_trainer

RUN = "000-Wan-debug"


@pytest.fixture(scope="module")
def umt5(tmp_path_factory):
    from opendit.families.wan.tiny_umt5 import save_tiny_umt5

    return save_tiny_umt5(tmp_path_factory.mktemp("wan_encoders") / "umt5", max_length=16)


@pytest.fixture(scope="module")
def wan_vae(tmp_path_factory):
    from opendit.families.wan.vae import save_tiny_wan_vae

    return save_tiny_wan_vae(tmp_path_factory.mktemp("wan_vae") / "vae")


def wan_cfg(outputs, umt5, **kw):
    base = dict(model="Wan-debug", dataset="moving_digits", image_size=8, num_frames=3, umt5=umt5, batch_size=4,
                max_steps=3, log_every=1, ckpt_every=100, num_workers=0, outputs=str(outputs), lr=1e-3,
                ema_decay=0.9)
    return cfglib.TrainConfig(**{**base, **kw})


def _cli_common(umt5):
    return ["--model", "Wan-debug", "--dataset", "moving_digits", "--image_size", "8", "--num_frames", "3",
            "--umt5", umt5, "--batch_size", "4", "--max_steps", "3", "--log_every", "1", "--num_workers", "0"]


def test_demo_trains_and_samples_mp4s_from_the_command_line(tmp_path, umt5):
    run_here("train.py", *_cli_common(umt5), "--max_steps", "2", "--outputs", tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the digit 3 moving left\n\nthe digit 7 moving up\n")
    for sampler, launch in (("unipc", cli), ("euler", run_here)):  # the second in this process (the same main)
        out = tmp_path / sampler
        launch("sample.py", "--ckpt", "latest", "--outputs", tmp_path, "--prompts", "the digit 1 moving down",
            "--prompts_file", prompts, "--num_sampling_steps", "3", "--sampler", sampler, "--cfg_scale", "2",
            "--negative_prompt", "the digit 0", "--npz", "--out", out)
        clips = np.load(out / "samples.npz")["arr_0"]
        assert clips.shape == (3, 3, 8, 8, 3) and clips.dtype == np.uint8  # one per prompt (blank line skipped)
        with av.open(str(out / "videos" / "000001.mp4")) as container:
            assert len(list(container.decode(video=0))) == 3
    out = tmp_path / "longer"  # other frame counts and sizes than trained
    sample_here("--ckpt", "latest", "--outputs", tmp_path, "--prompts", "the digit 1 moving down",
        "--num_frames", "5", "--height", "8", "--width", "16", "--num_sampling_steps", "2", "--npz", "--out", out)
    assert np.load(out / "samples.npz")["arr_0"].shape == (1, 5, 8, 16, 3)


@pytest.mark.parametrize("kw", [dict(model="Wan2.2-debug", i2v_prob=0.5),
                                dict(model="Wan2.2-I2V-debug", expert="high"),
                                dict(model="Wan2.2-I2V-debug", expert="both", expert_boundary=0.6)],
                         ids=["ti2v", "i2v-expert", "i2v-both-experts"])
def test_resumed_losses_equal_uninterrupted(tmp_path, umt5, kw):
    """Wan2.2's image-to-video draws (which clips take their first frame), one expert's times, and which expert each
    step of a run of both trains (Wan2.1's plain run: the conformance table)."""
    _, full = run_trainer(wan_cfg(tmp_path / "a", umt5, max_steps=4, ckpt_every=2, **kw))
    run_trainer(wan_cfg(tmp_path / "b", umt5, max_steps=2, ckpt_every=2, **kw))
    _, resumed = run_trainer(wan_cfg(tmp_path / "b", umt5, max_steps=4, ckpt_every=2, load="latest", **kw))
    assert resumed == full[2:]
    assert all(np.isfinite(full))


def test_loss_falls_and_caption_dropout_uses_the_empty_caption(tmp_path, umt5):
    trainer, losses = run_trainer(wan_cfg(tmp_path, umt5, max_steps=30, log_every=10, lr=2e-3, batch_size=8))
    assert losses[-1] < 0.8 * losses[0], losses
    enc = trainer.encoders
    torch.manual_seed(0)
    caption = "the digit 7 moving up"
    _, cond = trainer.objective.prepare((torch.zeros(64, 1, 3, 8, 8), torch.zeros(64), [caption] * 64),
                                        torch.device("cpu"))
    empty, full = enc.empty_embedding("cpu"), enc.encode([caption], "cpu")[0]
    dropped = torch.tensor([torch.equal(c, empty) for c in cond["context"]])
    assert all(torch.equal(c, full) for c, d in zip(cond["context"], dropped) if not d)
    assert 0.02 < dropped.float().mean() < 0.25  # p = 0.1


def test_moving_digits_for_wan_move_as_their_captions_say(tmp_path, umt5):
    trainer, _ = run_trainer(wan_cfg(tmp_path, umt5, max_steps=1, image_size=16, num_frames=5))
    ds = trainer.dataset
    assert ds.digit_size == 8 and not ds.bounce and ds.border
    clip = ds[0][0]  # [1, T, S, S]: the 1 px mid-grey border in every frame
    assert torch.all(clip[0, :, [0, -1], :].abs() < 0.01) and torch.all(clip[0, :, :, [0, -1]].abs() < 0.01)
    for i in range(20):
        words, _, (vx, vy) = ds.motion(i)
        x0, y0 = ds.digit_position(i, 0)
        x4, y4 = ds.digit_position(i, 4)
        assert (x4 - x0, y4 - y0) == (4 * vx, 4 * vy)  # no bounce: the caption's direction in every frame


def test_a_missing_text_encoder_is_a_clear_error(tmp_path, umt5):
    with pytest.raises(ValueError, match="--umt5"):
        run_trainer(wan_cfg(tmp_path, "none"))
    with pytest.raises(FileNotFoundError, match="--umt5"):
        run_trainer(wan_cfg(tmp_path, str(tmp_path / "nowhere")))


def test_cached_latents_and_embeddings_train_like_on_the_fly(tmp_path, umt5, wan_vae):
    run_here("preprocess.py", "--family", "wan", "--model", "Wan-debug", "--dataset", "moving_digits", "--image_size",
        "32", "--num_frames", "5", "--vae", wan_vae, "--umt5", umt5, "--out", tmp_path / "cache", "--batch_size", "64",
        "--num_workers", "0")
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert manifest["latent_shape"] == [16, 2, 4, 4] and manifest["embeddings"] == ["umt5"]
    assert manifest["extras"] == ["empty_umt5"] and manifest["num_frames"] == 5
    common = dict(image_size=32, num_frames=5, max_steps=3)
    cached, fly = tmp_path / "c", tmp_path / "f"
    trainer, _ = run_trainer(wan_cfg(cached, "none", dataset="latents", data_path=str(tmp_path / "cache"), **common))
    assert trainer.encoders.vae is None and trainer.encoders.text is None  # the cache loads no encoder
    assert trainer.cfg.umt5 == umt5 and trainer.cfg.vae == wan_vae  # for sampling later
    run_trainer(wan_cfg(fly, umt5, vae=wan_vae, **common))
    np.testing.assert_allclose(losses_of(cached / RUN), losses_of(fly / RUN), rtol=1e-5)
    out = tmp_path / "samples"  # the cache's run samples through the VAE and UMT5 it names
    sample_here("--ckpt", "latest", "--outputs", cached, "--prompts", "the digit 1 moving down",
        "--num_sampling_steps", "2", "--npz", "--out", out)
    assert np.load(out / "samples.npz")["arr_0"].shape == (1, 5, 32, 32, 3)


@pytest.mark.parametrize("kw", [
    dict(grad_checkpoint=1),
    dict(optimizer_offload=True, optimizer_state_dtype="u16", master_weights="bf16_exact", mixed_precision="bf16",
         fused_backward=True),
    dict(optimizer_offload=True, fused_backward=True, blocks_to_swap=1),
], ids=["grad_checkpoint", "u16-offload-bf16_exact-fused", "fused-block_swap"])
def test_lean_options_run_wan_and_resume_exactly(tmp_path, umt5, kw):
    _, plain = run_trainer(wan_cfg(tmp_path / "p", umt5, max_steps=4))
    _, full = run_trainer(wan_cfg(tmp_path / "a", umt5, max_steps=4, ckpt_every=2, **kw))
    run_trainer(wan_cfg(tmp_path / "b", umt5, max_steps=2, ckpt_every=2, **kw))
    _, resumed = run_trainer(wan_cfg(tmp_path / "b", umt5, max_steps=4, ckpt_every=2, load="latest", **kw))
    assert resumed == full[2:]
    if "mixed_precision" in kw:  # bf16 weights and compressed states: close to plain AdamW in fp32, not equal
        assert full == pytest.approx(plain, rel=0.05)
    else:  # the same arithmetic, rearranged (checkpointed, offloaded, fused, swapped)
        assert full == pytest.approx(plain, rel=1e-5)


def test_flops_per_sample_from_its_layers():
    from opendit.families.wan.family import wan_forward_macs
    from opendit.families.wan.model import WAN_CONFIGS, WanModel

    with torch.device("meta"):
        model = WanModel(**WAN_CONFIGS["Wan2.1-T2V-1.3B"])
    D, F, L, N = 1536, 8960, 512, 21 * 30 * 52  # 81 frames at 480x832: 21 x 60 x 104 latents, 1x2x2 patches
    block = N * (4 * D * D + 2 * D * D + 2 * D * F) + L * 2 * D * D + 2 * N * (N + L) * D
    root = N * 16 * 4 * D + L * (4096 * D + D * D) + 256 * D + D * D + D * 6 * D + N * D * 64
    assert wan_forward_macs(model, N) == 30 * block + root


def test_sample_defaults_follow_the_model():
    from opendit.families import get_family
    from opendit.inference import complete_sample_config

    family = get_family("wan")
    for model, shift in (("Wan2.1-T2V-1.3B", 5.0), ("Wan-debug", 1.0)):
        cfg = family.fill_defaults(cfglib.TrainConfig(model=model, dataset="moving_digits"))
        resolved = complete_sample_config(family, cfglib.SampleConfig(), cfg)
        constants = family.models[model].constants
        assert (resolved.sampler, resolved.num_sampling_steps, resolved.cfg_scale, resolved.fps,
                resolved.flow_shift) == ("unipc", constants["sampling_steps"], constants["cfg_scale"],
                                         constants["fps"], shift)
    video = complete_sample_config(get_family("video"), cfglib.SampleConfig(), cfglib.TrainConfig(model="Latte-XL/2"))
    assert video.fps == 8


@pytest.mark.slow
def test_two_process_runs_equal_ddp(tmp_path, umt5):
    """zero2, fsdp, hsdp and gemini at 2 ranks equal 2-rank ddp; sequence parallelism at 2 ranks (both ranks see the
    same 4 samples) equals one process. The whole matrix runs in one spawned group."""
    names = ["ddp", "zero2", "fsdp", "hsdp", "gemini", "sp2"]
    flags = [{}, dict(plugin="zero2"), dict(plugin="fsdp"), dict(plugin="hsdp", dp_replicate=2), dict(plugin="gemini"),
             dict(sequence_parallel_size=2)]
    cases = [wan_cfg(tmp_path / n, umt5, **kw) for n, kw in zip(names, flags)]
    losses = dict(zip(names, run_distributed(train_each, 2, cases)[0]))
    _, one = run_trainer(wan_cfg(tmp_path / "one", umt5))
    for name in names[1:-1]:
        np.testing.assert_allclose(losses[name], losses["ddp"], rtol=1e-4, err_msg=name)
    np.testing.assert_allclose(losses["sp2"], one, rtol=1e-4)


@pytest.mark.slow
def test_both_experts_train_alike_under_the_plugins_and_sequence_parallel(tmp_path, umt5):
    """--expert both at 2 ranks: FSDP (one expert gathered per micro-batch, the other's gradients None) as DDP
    (unused parameters expected), and sequence parallelism as one process."""
    both = dict(model="Wan2.2-I2V-debug", expert="both", expert_boundary=0.6)
    names, flags = ["ddp", "fsdp", "sp2"], [{}, dict(plugin="fsdp"), dict(sequence_parallel_size=2)]
    cases = [wan_cfg(tmp_path / n, umt5, **both, **kw) for n, kw in zip(names, flags)]
    losses = dict(zip(names, run_distributed(train_each, 2, cases)[0]))
    _, one = run_trainer(wan_cfg(tmp_path / "one", umt5, **both))
    np.testing.assert_allclose(losses["fsdp"], losses["ddp"], rtol=1e-4)
    np.testing.assert_allclose(losses["sp2"], one, rtol=1e-4)


@pytest.mark.slow
def test_two_process_sampling_writes_what_one_process_does(tmp_path, umt5):
    run_trainer(wan_cfg(tmp_path, umt5, max_steps=1))
    common = ["--ckpt", "latest", "--outputs", tmp_path, "--prompts", "the digit 1 moving up",
              "the digit 2 moving left", "--num_samples", "5", "--batch_size", "2", "--num_sampling_steps", "3",
              "--npz"]
    sample_here(*common, "--out", tmp_path / "one")
    cli("sample.py", *common, "--out", tmp_path / "two", nproc=2)
    one, two = (np.load(tmp_path / d / "samples.npz")["arr_0"] for d in ("one", "two"))
    np.testing.assert_array_equal(one, two)


def tiny_wan_pipeline(folder, umt5_root, wan_vae) -> str:
    """A diffusers Wan pipeline folder laid out as Wan-AI/Wan2.1-T2V-1.3B-Diffusers: transformer/ (a random
    Wan-debug converted to WanTransformer3DModel), vae/ (the tiny Wan VAE), text_encoder/ + tokenizer/."""
    import shutil

    from diffusers import WanTransformer3DModel

    from opendit.families.wan.tiny_umt5 import save_tiny_umt5
    from opendit.families.wan.weights import WAN_WEIGHTS
    from opendit.families.wan.model import WAN_CONFIGS, WanModel

    torch.manual_seed(0)
    ours = WanModel(**WAN_CONFIGS["Wan-debug"])
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.05)
    theirs = WanTransformer3DModel(**WAN_WEIGHTS.arch_to_diffusers(WAN_CONFIGS["Wan-debug"]))
    theirs.load_state_dict(WAN_WEIGHTS.to_diffusers(ours.state_dict()), strict=True)
    theirs.save_pretrained(folder / "transformer")
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))  # as the hub's folders
    shutil.copytree(wan_vae, folder / "vae")
    save_tiny_umt5(umt5_root, pipeline=True)
    for sub in ("text_encoder", "tokenizer"):
        shutil.copytree(umt5_root / sub, folder / sub)
    return str(folder), ours


def test_a_diffusers_wan_folder_samples_and_fine_tunes(tmp_path, wan_vae):
    pipe, ours = tiny_wan_pipeline(tmp_path / "pipe", tmp_path / "umt5", wan_vae)
    out = tmp_path / "samples"  # the folder names the model, its VAE and its text encoder
    sample_here("--ckpt", pipe, "--prompts", "the digit 1 moving down", "--num_frames", "5", "--height", "32",
        "--width", "64", "--num_sampling_steps", "2", "--npz", "--out", out)
    assert np.load(out / "samples.npz")["arr_0"].shape == (1, 5, 32, 64, 3)
    # fine-tuning starts from the folder's weights
    from opendit.training.loop import Trainer

    try:
        trainer = Trainer(wan_cfg(tmp_path / "ft", pipe, init_weights=pipe, vae=f"{pipe}/vae", image_size=32,
                                  num_frames=5, max_steps=1))
        state = trainer.booster.unwrap(trainer.model).state_dict()
        assert state.keys() == ours.state_dict().keys()
        assert all(torch.equal(state[k], v) for k, v in ours.state_dict().items())
        assert np.isfinite(trainer.train()).all()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_an_official_wan_folder_samples_once_its_encoders_are_named(tmp_path, umt5, wan_vae):
    """An official release folder (config.json with the official fields + diffusion_pytorch_model.safetensors, as
    Wan-AI/Wan2.1-T2V-1.3B ships its transformer) names its model from the config; UMT5 and the VAE from flags."""
    import sys

    from safetensors.torch import save_file

    from opendit.families.wan.model import WAN_CONFIGS, WanModel
    from tests.test_train import ROOT

    folder = tmp_path / "Wan2.1-T2V-debug"
    folder.mkdir()
    torch.manual_seed(0)
    state = WanModel(**WAN_CONFIGS["Wan-debug"]).state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "diffusion_pytorch_model.safetensors"))
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in WAN_CONFIGS["Wan-debug"].items()}
    (folder / "config.json").write_text(json.dumps({"_class_name": "WanModel", **config}))
    sys.path.insert(0, str(ROOT))
    import sample

    base = dict(ckpt=str(folder), prompts=["the digit 1 moving down"], num_frames=5, image_size=32,
                num_sampling_steps=2, npz=True)
    with pytest.raises(ValueError, match="--umt5 --vae"):
        sample.main(cfglib.SampleConfig(**base, out=str(tmp_path / "x")))
    sample.main(cfglib.SampleConfig(**base, umt5=umt5, vae=wan_vae, out=str(tmp_path / "s")))
    assert np.load(tmp_path / "s" / "samples.npz")["arr_0"].shape == (1, 5, 32, 32, 3)
