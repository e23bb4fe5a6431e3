"""LTX-2 through diffusers' LTX2VideoTransformer3DModel, trained as a text-to-video model with its audio branch frozen:
what is special to it (the command line, resume, folders and FLOPs: test_conformance.py; two ranks of sequence
parallelism against one: test_wrapped_sp.py). Its prompts are the pipeline's own Gemma encoding through its own text
connectors; the loss is the official trainer's video-only recipe through diffusers' forward, whose video prediction
does not depend on what the audio stream is fed, and exactly the frozen audio branch gets no gradient; sampled clips
equal LTX2Pipeline's own, called with prompt strings and a real (tiny) audio autoencoder and vocoder, bitwise, and at
two ranks (sequence or CFG parallel) what one process writes; the frozen branch trains under DDP, FSDP and LoRA at two
ranks, and sequence parallelism gives one process's losses; the official single file's transformer converts onto the
registered models."""
import logging

import numpy as np
import pytest
import torch

from opendit import config as cfglib
from tests.families.parts import assert_official_file_loads, debug_parts, release_converted

CAPTIONS = ["the digit 7 moving left", "the digit 3"]


def save_tiny_video_vae(folder) -> str:
    """An AutoencoderKLLTX2Video as the release's (4x4 patches, then 8x down in space and time; its compression
    stated, as the release's config states it), 8 channels, with latent statistics that are not the identity."""
    from diffusers import AutoencoderKLLTX2Video
    torch.manual_seed(0)
    vae = AutoencoderKLLTX2Video(block_out_channels=(8, 16, 32, 64), decoder_block_out_channels=(8, 16, 32),
                                 layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
                                 latent_channels=8, decoder_causal=False, spatial_compression_ratio=32,
                                 temporal_compression_ratio=8)
    vae.latents_mean.copy_(torch.linspace(-0.2, 0.2, 8))
    vae.latents_std.copy_(torch.linspace(0.5, 1.5, 8))
    vae.save_pretrained(folder)
    return str(folder)


def tiny_audio_decoders():
    """An AutoencoderKLLTX2Audio of the release's latent geometry (8 channels over 64 mel bins, 128 features) and an
    LTX2Vocoder of its mel spectrograms, both tiny and random: what the pipeline decodes audio with."""
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    torch.manual_seed(0)
    audio = AutoencoderKLLTX2Audio(base_channels=128, ch_mult=(1,), num_res_blocks=1, latent_channels=8, mel_bins=64)
    vocoder = LTX2Vocoder(in_channels=128, hidden_channels=8, upsample_kernel_sizes=[4], upsample_factors=[2],
                          resnet_kernel_sizes=[3], resnet_dilations=[[1]])
    return audio, vocoder


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ltx2")
    return debug_parts("ltx2-debug", root, save_tiny_video_vae(root / "vae"), image_size=64, num_frames=9)


def test_prompts_are_the_pipelines_gemma_states_through_its_connectors(parts):
    from diffusers import LTX2Pipeline
    family, cfg, enc, model = parts
    cond = enc.encode(CAPTIONS, "cpu")
    text = enc.text.pipeline
    pipe = LTX2Pipeline(None, None, None, text.text_encoder, text.tokenizer, text.connectors, model, None)
    embeds, mask = pipe._get_gemma_prompt_embeds(CAPTIONS, max_sequence_length=16, device="cpu")
    assert mask.sum(1).tolist() == [6, 4]  # <bos> and the words, padded on the left
    video, audio, connected = pipe.connectors(embeds, mask, padding_side="left")
    assert torch.equal(cond["embeds"], video) and torch.equal(cond["audio_embeds"], audio)
    assert torch.equal(cond["mask"], connected.bool()) and cond["mask"].all()  # the registers fill the padding


def test_the_loss_is_the_video_only_recipe_and_only_the_audio_branch_is_frozen(parts, caplog):
    from diffusers import LTX2Pipeline
    family, cfg, enc, model = parts
    with caplog.at_level(logging.INFO, logger="opendit"):
        objective = family.objective(cfg, enc)
    assert "the audio branch frozen" in caplog.text
    clips = torch.rand(2, 3, 9, 64, 64) * 2 - 1
    torch.manual_seed(1)
    x, cond = objective.prepare((clips, [0, 0], CAPTIONS), torch.device("cpu"), train=False)
    assert x.shape == (2, 8, 2, 2, 2)  # 8 channels; 1 + 8 frames -> 2; 64 px / 32
    torch.manual_seed(1)
    posterior = enc.vae.encode(clips).latent_dist
    z = posterior.mean + posterior.std * torch.randn_like(posterior.mean)
    view = (1, 8, 1, 1, 1)
    torch.testing.assert_close(x, (z - enc.vae.latents_mean.view(view)) / enc.vae.latents_std.view(view))

    t, noise = torch.tensor([0.3, 0.8]), torch.randn_like(x)
    model.zero_grad()
    losses, _ = objective.losses(model, x, cond, t_frac=t, noise=noise)
    losses.sum().backward()
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, p in model.named_parameters() if p.grad is None}
    # the audio stream, the cross-modal attention (audio_to_video, video_to_audio) and their modulations, only
    assert frozen == {n for n, _ in model.named_parameters()
                      if "audio" in n or "a2v" in n or n.startswith("av_cross_attn_")}

    # by hand: x_t = (1 - t) x + t noise packed as the pipeline packs it, time 1000 t; the video prediction with the
    # cross-modal attention off is the same whatever the audio stream gets (here a random clip's worth of it)
    x_t = (1 - t.view(2, 1, 1, 1, 1)) * x + t.view(2, 1, 1, 1, 1) * noise
    with torch.no_grad():
        out = model(hidden_states=LTX2Pipeline._pack_latents(x_t), audio_hidden_states=torch.randn(2, 9, 128),
                    encoder_hidden_states=cond["embeds"], audio_encoder_hidden_states=cond["audio_embeds"],
                    timestep=1000 * t, sigma=1000 * t, encoder_attention_mask=cond["mask"],
                    audio_encoder_attention_mask=cond["mask"], num_frames=2, height=2, width=2, fps=24.0,
                    audio_num_frames=9, isolate_modalities=True, return_dict=False)[0]
    pred = LTX2Pipeline._unpack_latents(out, 2, 2, 2)
    torch.testing.assert_close(losses.detach(), ((pred - (noise - x)) ** 2).mean((1, 2, 3, 4)), rtol=1e-6, atol=1e-7)


def test_samples_equal_the_pipelines_own_clips(parts):
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

    from opendit.families import LoadedModel
    from opendit.families.wrapped.glue import pack
    from opendit.families.wrapped.ltx2 import SCHEDULER
    from opendit.seeding import sampling_generator
    family, cfg, enc, model = parts
    loaded = LoadedModel(family, model, enc, cfg, (8, 2, 2, 2), "random")
    sample_cfg = cfglib.SampleConfig(prompts=CAPTIONS, cfg_scale=3.0, num_sampling_steps=3, seed=5)
    ours = family.sample_batch(loaded, family.make_sampler(sample_cfg, cfg), range(2, 5), CAPTIONS, sample_cfg,
                               torch.device("cpu"))
    text = enc.text.pipeline
    audio, vocoder = tiny_audio_decoders()
    pipe = LTX2Pipeline(FlowMatchEulerDiscreteScheduler(**SCHEDULER), enc.vae, audio, text.text_encoder,
                        text.tokenizer, text.connectors, model, vocoder)
    noise = torch.randn(3, 8, 2, 2, 2, generator=sampling_generator(5, 2))
    theirs = pipe(prompt=[CAPTIONS[i % 2] for i in range(2, 5)], negative_prompt=[""] * 3, latents=pack(noise),
                  height=64, width=64, num_frames=9, frame_rate=24.0, num_inference_steps=3, guidance_scale=3.0,
                  audio_guidance_scale=3.0, stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0,
                  audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0,
                  generator=torch.Generator().manual_seed(5), max_sequence_length=16, output_type="np")
    assert theirs.audio.shape[0] == 3  # the pipeline's own decodes audio too; opendit keeps the video
    assert ours.shape == (3, 9, 64, 64, 3)
    np.testing.assert_array_equal(ours, (theirs.frames * 255).round().astype(np.uint8))


@pytest.mark.slow
def test_sequence_and_cfg_parallel_sampling_write_what_one_process_does(tmp_path, parts):
    """Inside LTX2Pipeline's own loop (the audio generated with the video): opendit's plan splits the video tokens
    over two ranks, the prompt and the audio stream whole on each; --cfg_parallel puts the halves of the pipeline's
    [negative; prompt] batch on two ranks."""
    from tests.run_each import sample_each, sample_here
    from tests.test_train import run_trainer
    text = parts[1].text_encoder
    run_trainer(cfglib.TrainConfig(model="ltx2-debug", dataset="moving_digits", image_size=32, num_frames=5, vae="none",
                                   text_encoder=text, batch_size=2, max_steps=1, log_every=1, num_workers=0,
                                   outputs=str(tmp_path)))
    common = ["--ckpt", "latest", "--outputs", tmp_path, "--prompts", *CAPTIONS, "--num_sampling_steps", "2",
              "--cfg_scale", "2", "--npz"]
    sample_here(*common, "--out", tmp_path / "one")
    sample_each([[*common, "--sequence_parallel_size", "2", "--out", tmp_path / "sp2"],
                 [*common, "--cfg_parallel", "--out", tmp_path / "cfg2"]], nproc=2)  # one torchrun launch
    one, sp2, cfg2 = (np.load(tmp_path / d / "samples.npz")["arr_0"] for d in ("one", "sp2", "cfg2"))
    np.testing.assert_array_equal(one, sp2)
    np.testing.assert_array_equal(one, cfg2)


@pytest.mark.slow
def test_plugins_checkpointing_lora_and_sequence_parallelism_at_two_ranks_equal_the_plain_run(tmp_path, parts):
    """The frozen audio branch leaves no parameter without a gradient for DDP or FSDP to wait on; LoRA on the video
    stream trains; two ranks of sequence parallelism see the batch one process does and give its losses."""
    from tests.distributed import run_distributed, train_each
    from tests.test_train import run_trainer

    def config(name, **kw):
        return cfglib.TrainConfig(**{**dict(model="ltx2-debug", dataset="moving_digits", image_size=32, num_frames=2,
                                            vae="none", text_encoder=parts[1].text_encoder, batch_size=2, max_steps=2,
                                            log_every=1, ckpt_every=100, num_workers=0, lr=1e-3, ema_decay=0.9,
                                            outputs=str(tmp_path / name)), **kw})
    names = ["ddp", "fsdp-checkpointed", "ddp-lora", "sp2-fsdp"]
    base = tmp_path / "ddp" / "000-ltx2-debug" / "checkpoints" / "step-000002" / "ema.safetensors"  # run first
    flags = [{}, dict(plugin="fsdp", grad_checkpoint=1), dict(lora_rank=4, ema_decay=0.0, init_weights=str(base)),
             dict(sequence_parallel_size=2, plugin="fsdp")]
    losses = dict(zip(names, run_distributed(train_each, 2, [config(n, **kw) for n, kw in zip(names, flags)])[0]))
    np.testing.assert_allclose(losses["fsdp-checkpointed"], losses["ddp"], rtol=1e-4)
    assert losses["ddp-lora"] != losses["ddp"] and all(np.isfinite(losses["ddp-lora"]))
    _, one = run_trainer(config("one"))  # the SP pair is one data-parallel rank: the batch one process sees
    np.testing.assert_allclose(losses["sp2-fsdp"], one, rtol=1e-5)


# the inverse of convert_ltx2_transformer_to_diffusers' renames (diffusers part: official), in its order
OFFICIAL_PARTS = {"audio_proj_in": "audio_patchify_proj", "proj_in": "patchify_proj",
                  "av_cross_attn_video_scale_shift": "av_ca_video_scale_shift_adaln_single",
                  "av_cross_attn_video_a2v_gate": "av_ca_a2v_gate_adaln_single",
                  "av_cross_attn_audio_scale_shift": "av_ca_audio_scale_shift_adaln_single",
                  "av_cross_attn_audio_v2a_gate": "av_ca_v2a_gate_adaln_single",
                  "video_a2v_cross_attn_scale_shift_table": "scale_shift_table_a2v_ca_video",
                  "audio_a2v_cross_attn_scale_shift_table": "scale_shift_table_a2v_ca_audio",
                  "norm_q": "q_norm", "norm_k": "k_norm"}
OFFICIAL_PREFIXES = {"audio_time_embed.": "audio_adaln_single.", "time_embed.": "adaln_single."}


def official_layout(state: dict) -> dict:
    """A diffusers state dict in the official single file's layout (its transformer under model.diffusion_model.),
    with a key of its video text connector, which the converter drops."""
    out = {}
    for key, value in state.items():
        name = next((new + key[len(old):] for old, new in OFFICIAL_PREFIXES.items() if key.startswith(old)), key)
        if name == key:
            name = next((name.replace(old, new, 1) for old, new in OFFICIAL_PARTS.items() if old in name), name)
        out["model.diffusion_model." + name] = value
    out["model.diffusion_model.video_embeddings_connector.learnable_registers"] = torch.zeros(8, 32)
    return out


def test_the_official_single_file_converts_onto_the_registered_models(tmp_path, parts):
    family, _, _, model = parts
    assert_official_file_loads(family, model, official_layout, tmp_path / "ltx2.safetensors")
    converted, shapes = release_converted(family, "ltx2-19b", official_layout, in_channels=128)
    assert converted == shapes and sum(s.numel() for s in shapes.values()) == 18_876_174_592
