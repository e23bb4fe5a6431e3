"""FLUX.2 [klein] through diffusers' own Flux2Transformer2DModel under opendit's stack: what is special to it (the
command line, exact resume: tests/families/test_conformance.py): the training
loss is the recipe's, computed through the pipeline's own packing; sampled images equal Flux2KleinPipeline's own
bitwise (tiny AutoencoderKLFlux2, prompts encoded by the pipeline); the plugins, activation checkpointing and LoRA
at two ranks equal the plain run; a LoRA file opendit writes loads into diffusers'
pipeline and samples what opendit's LoRA checkpoint does (tests/test_wrapped_lora.py)."""
import json

import numpy as np
import pytest
import torch

from opendit import config as cfglib
from tests.distributed import run_distributed, train_each
from tests.run_each import sample_each, sample_here, run_here
from tests.test_train import run_trainer


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from opendit.families.wrapped.flux2 import save_tiny_qwen3
    return save_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


def save_tiny_flux2_vae(folder):
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                             block_out_channels=(8, 8), layers_per_block=1, latent_channels=4, norm_num_groups=8,
                             sample_size=16)
    vae.bn.running_mean.normal_()  # statistics a trained VAE would have, so normalising is no identity
    vae.bn.running_var.uniform_(0.5, 2.0)
    vae.save_pretrained(folder)
    return str(folder)


def flux2_cfg(outputs, qwen, **kw):
    base = dict(model="flux2-klein-debug", dataset="captioned_digits", image_size=8, vae="none", text_encoder=qwen,
                batch_size=4, max_steps=3, log_every=1, ckpt_every=100, num_workers=0, outputs=str(outputs), lr=1e-3,
                ema_decay=0.9)
    return cfglib.TrainConfig(**{**base, **kw})


@pytest.mark.slow
def test_sequence_and_cfg_parallel_sampling_write_what_one_process_does(tmp_path, qwen):
    run_trainer(flux2_cfg(tmp_path, qwen, max_steps=1))
    common = ["--ckpt", "latest", "--outputs", tmp_path, "--prompts", "a one", "a two", "a three", "--num_samples", "3",
              "--num_sampling_steps", "3", "--cfg_scale", "2", "--npz"]
    sample_here(*common, "--out", tmp_path / "one")
    sample_each([[*common, "--sequence_parallel_size", "2", "--out", tmp_path / "sp2"],
                 [*common, "--cfg_parallel", "--out", tmp_path / "cfg2"]], nproc=2)  # one torchrun launch
    one, sp2, cfg2 = (np.load(tmp_path / d / "samples.npz")["arr_0"] for d in ("one", "sp2", "cfg2"))
    np.testing.assert_array_equal(one, sp2)
    np.testing.assert_array_equal(one, cfg2)


def _family_parts(qwen, vae_folder):
    from opendit.families import get_family
    family = get_family("flux2")
    cfg = family.resolve_config(flux2_cfg("unused", qwen, vae=vae_folder, image_size=16))
    encoders = family.load_encoders(cfg, torch.device("cpu"), training=True)
    torch.manual_seed(0)
    model = family.build_model(cfg, family.latent_shape(cfg, encoders)).eval()
    return family, cfg, encoders, model


def test_latents_and_loss_follow_the_pipeline_and_the_recipe(tmp_path, qwen):
    from diffusers import Flux2KleinPipeline
    family, cfg, enc, model = _family_parts(qwen, save_tiny_flux2_vae(tmp_path / "vae"))
    images = torch.rand(2, 3, 16, 16) * 2 - 1
    # the VAE's mode through the glue = the pipeline's own encoding of a conditioning image
    mode = enc.vae.encode(images).latent_dist.mode()
    np.testing.assert_array_equal(family.glue.to_model_space(enc.vae, mode).detach(), Flux2KleinPipeline(
        enc.vae, enc.vae, None, None, model)._encode_vae_image(images, None).detach())
    x, cond = family.objective(cfg, enc).prepare((images, ["a one", "a two"]), torch.device("cpu"), train=False)
    assert x.shape == (2, 16, 4, 4)  # 4 latent channels in 2x2 patches; 16 px / the 2x VAE / 2
    t, noise = torch.tensor([0.3, 0.8]), torch.randn_like(x)
    losses, _ = family.objective(cfg, enc).losses(model, x, cond, t_frac=t, noise=noise)
    # by hand: the pipeline's packing and ids, diffusers' forward, x_t = (1 - t) x + t noise, target noise - x
    x_t = (1 - t[:, None, None, None]) * x + t[:, None, None, None] * noise
    pred = model(hidden_states=Flux2KleinPipeline._pack_latents(x_t), encoder_hidden_states=cond["embeds"], timestep=t,
                 img_ids=Flux2KleinPipeline._prepare_latent_ids(x_t),
                 txt_ids=Flux2KleinPipeline._prepare_text_ids(cond["embeds"]), return_dict=False)[0]
    target = Flux2KleinPipeline._pack_latents(noise - x)
    torch.testing.assert_close(losses, ((pred - target) ** 2).mean((1, 2)), rtol=1e-6, atol=1e-7)


def test_samples_equal_the_pipelines_own_images(tmp_path, qwen):
    from diffusers import Flux2KleinPipeline
    from opendit.families import LoadedModel
    from opendit.families.wrapped.flux2 import SCHEDULER
    from diffusers import FlowMatchEulerDiscreteScheduler
    from opendit.seeding import sampling_generator
    family, cfg, enc, model = _family_parts(qwen, save_tiny_flux2_vae(tmp_path / "vae"))
    loaded = LoadedModel(family, model, enc, cfg, (16, 4, 4), "random")
    sample_cfg = cfglib.SampleConfig(prompts=["a handwritten one", "the digit seven"], cfg_scale=2.5,
                                     num_sampling_steps=3, seed=5)
    ours = family.sample_batch(loaded, family.make_sampler(sample_cfg, cfg), range(2, 5), sample_cfg.prompts,
                               sample_cfg, torch.device("cpu"))
    pipe = Flux2KleinPipeline(FlowMatchEulerDiscreteScheduler(**SCHEDULER), enc.vae, enc.text.model,
                              enc.text.tokenizer, model)
    noise = torch.randn(3, 16, 4, 4, generator=sampling_generator(5, 2))
    theirs = pipe(prompt=["a handwritten one", "the digit seven", "a handwritten one"], latents=noise, height=16,
                  width=16, num_inference_steps=3, guidance_scale=2.5, max_sequence_length=16,
                  text_encoder_out_layers=(1, 2, 3), output_type="pil").images
    assert ours.shape == (3, 16, 16, 3)
    np.testing.assert_array_equal(ours, np.stack([np.asarray(im) for im in theirs]))


@pytest.mark.slow
def test_plugins_checkpointing_and_lora_at_two_ranks_equal_the_plain_run(tmp_path, qwen):
    base = tmp_path / "base"
    run_trainer(flux2_cfg(base, qwen, max_steps=2))
    base_ckpt = str(base / "000-flux2-klein-debug" / "checkpoints" / "step-000002" / "ema.safetensors")
    lora = dict(lora_rank=4, init_weights=base_ckpt, ema_decay=0.0)
    names = ["ddp", "zero2", "fsdp", "fsdp-checkpointed", "ddp-lora", "fsdp-lora", "sp2", "sp2-fsdp-checkpointed",
             "sp2-lora"]
    flags = [{}, dict(plugin="zero2"), dict(plugin="fsdp"), dict(plugin="fsdp", grad_checkpoint=1), lora,
             dict(plugin="fsdp", **lora), dict(sequence_parallel_size=2),
             dict(sequence_parallel_size=2, plugin="fsdp", grad_checkpoint=1), dict(sequence_parallel_size=2, **lora)]
    cases = [flux2_cfg(tmp_path / n, qwen, **kw) for n, kw in zip(names, flags)]
    losses = dict(zip(names, run_distributed(train_each, 2, cases)[0]))
    for name in ("zero2", "fsdp", "fsdp-checkpointed"):
        np.testing.assert_allclose(losses[name], losses["ddp"], rtol=1e-4, err_msg=name)
    np.testing.assert_allclose(losses["fsdp-lora"], losses["ddp-lora"], rtol=1e-4)
    assert losses["ddp-lora"] != losses["ddp"]  # the LoRA runs started from the trained base
    # sequence parallelism (diffusers' context-parallel plan): both ranks see the same 4 samples, as one process does
    _, one = run_trainer(flux2_cfg(tmp_path / "one", qwen))
    _, one_lora = run_trainer(flux2_cfg(tmp_path / "one-lora", qwen, **lora))
    for name in ("sp2", "sp2-fsdp-checkpointed"):
        np.testing.assert_allclose(losses[name], one, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(losses["sp2-lora"], one_lora, rtol=1e-5)


@pytest.mark.slow
def test_compiled_blocks_validation_and_the_ema_run_as_the_plain_path(tmp_path, qwen):
    """--compile (torch.compile per diffusers block, inductor on the CPU) trains the plain run's losses; --val_every
    logs the validation loss by noise level; the EMA is exported beside the checkpoint."""
    import json

    flags = dict(max_steps=4, val_every=2, val_samples=8)
    _, plain = run_trainer(flux2_cfg(tmp_path / "plain", qwen, **flags))
    _, compiled = run_trainer(flux2_cfg(tmp_path / "compiled", qwen, compile=True, **flags))
    np.testing.assert_allclose(compiled, plain, rtol=1e-5)
    run = next((tmp_path / "compiled").glob("000-*"))
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    val = [r for r in records if r.get("kind") == "val"]
    assert [r["step"] for r in val] == [2, 4] and all(np.isfinite(r["val_loss"]) for r in val)
    assert (run / "checkpoints" / "step-000004" / "ema.safetensors").is_file()


def test_the_official_flux2_dev_layout_converts_onto_diffusers_model():
    """BFL's flux2-dev.safetensors (its 299 keys and shapes, on meta) through the converter the kind uses: every
    tensor of the registered flux2-dev (Flux2Transformer2DModel at the release's configuration), none left over."""
    from opendit.families import get_family
    from tests.test_flux_model import _read_tsv

    official = {k: torch.empty(shape, device="meta") for k, shape in _read_tsv("flux2-dev_state_dict.tsv")}
    assert len(official) == 299 and sum(t.numel() for t in official.values()) == 32_223_281_152
    family = get_family("flux2")
    converted = family.glue.convert_official(official)
    with torch.device("meta"):
        model = family.models["flux2-dev"].build(in_channels=128)  # the registered model
    assert {k: tuple(v.shape) for k, v in converted.items()} == {k: tuple(v.shape)
                                                                 for k, v in model.state_dict().items()}
    assert model._block_lists == ("transformer_blocks", "single_transformer_blocks")


def test_a_diffusers_pipeline_folder_trains_and_samples(tmp_path, qwen):
    """What a user downloads (transformer/, vae/, text_encoder/ with its tokenizer, scheduler/): --init_weights and
    --ckpt take the folder; sampling it names the model, VAE, text encoder and scheduler from it."""
    import shutil

    from diffusers import FlowMatchEulerDiscreteScheduler

    from opendit.families import get_family
    from opendit.families.wrapped.flux2 import SCHEDULER

    pipe = tmp_path / "FLUX.2-klein-debug"
    family = get_family("flux2")
    torch.manual_seed(0)
    model = family.models["flux2-klein-debug"].build(in_channels=16)
    model.save_pretrained(pipe / "transformer")
    save_tiny_flux2_vae(pipe / "vae")
    shutil.copytree(qwen, pipe / "text_encoder")
    FlowMatchEulerDiscreteScheduler(**dict(SCHEDULER, shift=2.0)).save_pretrained(pipe / "scheduler")
    assert family.load_weights(str(pipe)).keys() == model.state_dict().keys()
    settings, _ = family.recognize_checkpoint(str(pipe))
    assert settings == dict(model="flux2-klein-debug", dataset="captions", image_size=1024, vae=str(pipe / "vae"),
                            text_encoder=str(pipe), scheduler=str(pipe))
    out = tmp_path / "samples"
    sample_here("--ckpt", pipe, "--prompts", "a handwritten one", "--image_size", "16",
        "--num_sampling_steps", "2", "--npz", "--out", out)
    assert np.load(out / "samples.npz")["arr_0"].shape == (1, 16, 16, 3)
    run_here("train.py", "--model", "flux2-klein-debug", "--init_weights", pipe, "--vae", pipe, "--text_encoder", pipe,
        "--dataset", "captioned_digits", "--image_size", "16", "--batch_size", "2", "--max_steps", "1", "--num_workers",
        "0", "--outputs", tmp_path / "runs")
    other = tmp_path / "other"
    shutil.copytree(pipe / "transformer", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "_class_name": "FluxTransformer2DModel"}))
    with pytest.raises(ValueError, match="holds a FluxTransformer2DModel, not the Flux2Transformer2DModel"):
        family.load_weights(str(other))


@pytest.mark.parametrize("kw", [
    dict(optimizer_offload=True, fused_backward=True, blocks_to_swap=2),
    dict(optimizer_offload=True, optimizer_state_dtype="u16", master_weights="bf16_exact", mixed_precision="bf16",
         fused_backward=True),
], ids=["offload-fused-block_swap", "u16-bf16_exact-fused"])
def test_lean_options_run_and_resume_exactly(tmp_path, qwen, kw):
    _, plain = run_trainer(flux2_cfg(tmp_path / "p", qwen, max_steps=4))
    _, full = run_trainer(flux2_cfg(tmp_path / "a", qwen, max_steps=4, ckpt_every=2, **kw))
    run_trainer(flux2_cfg(tmp_path / "b", qwen, max_steps=2, ckpt_every=2, **kw))
    _, resumed = run_trainer(flux2_cfg(tmp_path / "b", qwen, max_steps=4, ckpt_every=2, load="latest", **kw))
    assert resumed == full[2:]
    # bf16 weights and compressed states: close to plain AdamW in fp32; swapped and fused: the same arithmetic
    assert full == pytest.approx(plain, rel=0.01 if "mixed_precision" in kw else 1e-5)


def test_options_the_pipeline_does_not_reach_are_refused_not_ignored():
    from opendit.families import get_family
    family = get_family("flux2")
    cfg = cfglib.TrainConfig(model="flux2-klein-debug")
    with pytest.raises(ValueError, match="--cache teacache, --vae_tiling: flux2-klein-debug samples "
                                         "and decodes through its diffusers pipeline \\(Flux2KleinPipeline\\)"):
        family.make_sampler(cfglib.SampleConfig(cache="teacache", vae_tiling=True), cfg)
    with pytest.raises(ValueError, match="--cache fbcache with --sequence_parallel_size"):
        family.make_sampler(cfglib.SampleConfig(cache="fbcache", sequence_parallel_size=2), cfg)
    with pytest.raises(ValueError, match="--cache fbcache with --cfg_parallel"):
        family.make_sampler(cfglib.SampleConfig(cache="fbcache", cfg_parallel=True), cfg)
    dev = cfglib.TrainConfig(model="flux2-dev-debug")
    with pytest.raises(ValueError, match="--cfg_parallel: flux2-dev-debug has no pair of guidance calls to "
                                         "split .it is guidance-distilled"):
        family.make_sampler(cfglib.SampleConfig(cfg_parallel=True), dev)


def test_the_demo_recipe_runs(tmp_path, qwen):
    """README's line: RECIPE=digits bash train_diffusers.sh (its flags, a step of it; the tiny Qwen3 given)."""
    import os
    import subprocess

    from tests.test_train import ROOT
    out = subprocess.run(["bash", "train_diffusers.sh", "--max_steps", "1", "--batch_size", "4", "--outputs",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "RECIPE": "digits", "ENC": qwen, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "000-flux2-klein-debug" / "checkpoints" / "step-000001").is_dir()
