"""FLUX.3 through diffusers' own Flux3Transformer2DModel and its modular pipeline: what is special to it (the command
line, exact resume, the FLOP count: test_conformance.py). Prompts are the pipeline's own text-encoder step's; the
declared settings are its blocks' defaults; the loss is the recipe's through diffusers' forward, and the reference-image
branch is frozen (every other parameter gets a gradient); sampled images equal Flux3ModularPipeline's own bitwise,
called with prompt strings (a tiny AutoencoderKLFlux2); BFL's single-file layout converts onto the registered models."""
import numpy as np
import pytest
import torch

from opendit import config as cfglib
from tests.families.parts import debug_parts

CAPTIONS = ["a handwritten one", "the digit seven seven seven"]


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    from tests.test_flux2_family import save_tiny_flux2_vae
    root = tmp_path_factory.mktemp("flux3")
    return debug_parts("flux3-debug", root, save_tiny_flux2_vae(root / "vae"), batch_size=2)


def _pipeline(enc, model=None, with_text: bool = True):
    """Flux3ModularPipeline as diffusers builds it: FLUX.3's blocks without the prompt upsampler (its docstring's
    way to encode prompts as given), given the components."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux3AutoBlocks, Flux3ModularPipeline
    from transformers import AutoProcessor

    from opendit.families.wrapped.flux3 import SCHEDULER
    blocks = Flux3AutoBlocks()
    blocks.sub_blocks.pop("prompt_upsampler")
    pipe = Flux3ModularPipeline(blocks=blocks)
    pipe.update_components(text_encoder=enc.text.model, tokenizer=AutoProcessor.from_pretrained(
        enc.text.tokenizer.name_or_path), vae=enc.vae, scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        **({} if model is None else {"transformer": model}))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_the_declared_settings_are_the_pipelines():
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3PrepareLatentsStep, Flux3SetTimestepsStep
    from diffusers.modular_pipelines.flux3.denoise import Flux3LoopDenoiser
    from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

    from opendit.families.wrapped.flux3 import IMAGE_ROPE_SCALE, MODEL, SCHEDULER, TEXT_LAYERS
    assert SCHEDULER["shift"] == Flux3SetTimestepsStep().shift and IMAGE_ROPE_SCALE == \
        Flux3PrepareLatentsStep().image_rope_scale
    text_step = Flux3TextEncoderStep()
    assert TEXT_LAYERS == next(p.default for p in text_step.inputs if p.name == "text_encoder_out_layers")
    release = MODEL.models["flux3"].constants
    assert release["text_layers"] == TEXT_LAYERS and release["cfg_scale"] == Flux3LoopDenoiser().guidance_scale
    assert release["max_sequence_length"] % text_step.pad_multiple == 0  # a window the pipeline forms itself
    assert MODEL.models["flux3"].arch["joint_attention_dim"] == 8 * 2560  # 8 layers of Qwen3-VL-4B


def test_prompts_are_the_pipelines_own_encoding(parts):
    from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep
    family, cfg, enc, model = parts
    cond = enc.encode(CAPTIONS, "cpu")
    assert cond["embeds"].shape == (2, 16, 48)
    pipe = _pipeline(enc)
    for i, caption in enumerate(CAPTIONS):  # the text-encoder step takes one prompt per call
        theirs = Flux3TextEncoderStep().init_pipeline()
        theirs.update_components(text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer)
        embeds = theirs(prompt=caption, max_sequence_length=16, text_encoder_out_layers=(1, 2, 3),
                        output="prompt_embeds")
        assert torch.equal(cond["embeds"][i:i + 1], embeds)


def test_the_loss_is_the_recipes_and_the_reference_branch_is_frozen(parts):
    from opendit.families.wrapped.glue import pack
    family, cfg, enc, model = parts
    objective = family.objective(cfg, enc)
    x, cond = objective.prepare((torch.rand(2, 3, 16, 16) * 2 - 1, CAPTIONS), torch.device("cpu"), train=False)
    assert x.shape == (2, 16, 4, 4)  # 4 latent channels in 2x2 patches; 16 px / the 2x VAE / 2
    t, noise = torch.tensor([0.3, 0.8]), torch.randn_like(x)
    losses, _ = objective.losses(model, x, cond, t_frac=t, noise=noise)

    # by hand: the image's position ids (0, h / 2, w / 2, 0) row by row, the text's (0, 0, 0, l); timestep sigma
    rows, cols = torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="ij")
    img_ids = torch.stack([torch.zeros(16), rows.flatten() / 2, cols.flatten() / 2, torch.zeros(16)], 1)
    txt_ids = torch.stack([torch.zeros(16)] * 3 + [torch.arange(16.0)], 1)
    x_t = (1 - t[:, None, None, None]) * x + t[:, None, None, None] * noise
    pred = model(hidden_states=pack(x_t), encoder_hidden_states=cond["embeds"], timestep=t, img_ids=img_ids,
                 txt_ids=txt_ids, return_dict=False)[0]
    torch.testing.assert_close(losses, ((pred - pack(noise - x)) ** 2).mean((1, 2)), rtol=1e-6, atol=1e-7)

    losses.sum().backward()
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(".image_cond." in n for n in frozen)
    assert all(p.grad is not None for n, p in model.named_parameters() if n not in frozen)
    model.zero_grad(set_to_none=True)


def test_samples_equal_the_pipelines_own_images_from_prompt_strings(parts):
    """One prompt at a time, as the pipeline takes prompt strings (a batch of two differs from two batches of one
    in the last bit of a few matmuls)."""
    from diffusers import ClassifierFreeGuidance

    from opendit.families import LoadedModel
    from opendit.seeding import sampling_generator
    family, cfg, enc, model = parts
    loaded = LoadedModel(family, model, enc, cfg, (16, 4, 4), "random")
    sample_cfg = cfglib.SampleConfig(prompts=CAPTIONS, cfg_scale=3.0, num_sampling_steps=3, seed=5)
    pipe = _pipeline(enc, model)
    pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=3.0))
    for i, caption in enumerate(CAPTIONS):
        ours = family.sample_batch(loaded, family.make_sampler(sample_cfg, cfg), range(2 + i, 3 + i), CAPTIONS,
                                   sample_cfg, torch.device("cpu"))
        noise = torch.randn(1, 16, 4, 4, generator=sampling_generator(5, 2 + i))
        theirs = pipe(prompt=caption, latents=noise, height=16, width=16, num_inference_steps=3,
                      max_sequence_length=16, text_encoder_out_layers=(1, 2, 3), output="images", output_type="pil")
        assert ours.shape == (1, 16, 16, 3)
        np.testing.assert_array_equal(ours[0], np.asarray(theirs[0]))


def _official_name(key: str) -> str:
    """A diffusers key of Flux3Transformer2DModel in BFL's layout: the inverse of the renames of diffusers'
    convert_flux3_transformer_checkpoint_to_diffusers."""
    whole = {"timestep_embedder.linear_1.weight": "time_in.in_layer.weight",
             "timestep_embedder.linear_2.weight": "time_in.out_layer.weight",
             "proj_out.weight": "final_layer.image.linear.weight",
             "norm_out.linear.weight": "final_layer.image.adaLN_modulation.1.weight"}
    if key in whole:
        return whole[key]
    inner = {"attn.to_q.weight": "q_proj.weight", "attn.to_k.weight": "k_proj.weight",
             "attn.to_v.weight": "v_proj.weight", "attn.to_out.0.weight": "attn_out.weight",
             "attn.norm_q.weight": "norm.query_norm.scale", "attn.norm_k.weight": "norm.key_norm.scale",
             "ff.linear_in.weight": "mlp_in.weight", "ff.linear_out.weight": "mlp_out.weight"}
    for ours, theirs in inner.items():
        if key.endswith(ours):
            key = key[:-len(ours)] + theirs
    key = key.replace(".linear.weight", ".lin.weight")
    for ours, theirs in {"x_embedders.": "emb_in.", "context_embedder.": "txt_in.", "mode_blocks.":
                         "content_mode_blocks.", "single_transformer_blocks.": "single_blocks."}.items():
        if key.startswith(ours):
            return theirs + key[len(ours):]
    return key


def test_the_official_layout_converts_onto_the_registered_models(parts, tmp_path):
    """BFL's layout (the converter's names) of the registered release model, on meta: exactly its tensors; of the
    debug model, as a file: load_weights recognises it and gives the model's own weights back (the output
    modulation's shift and scale halves swapped back)."""
    from safetensors.torch import save_file
    family, cfg, enc, model = parts
    with torch.device("meta"):
        release = family.models["flux3"].build(in_channels=128)
    official = {_official_name(k): v for k, v in release.state_dict().items()}
    assert "early_stream_modulations.image.lin.weight" in official and len(official) == len(release.state_dict())
    converted = family.glue.convert_official(official)
    assert {k: v.shape for k, v in converted.items()} == {k: v.shape for k, v in release.state_dict().items()}

    state = model.state_dict()
    norm_out = state["norm_out.linear.weight"]
    swapped = torch.cat(norm_out.chunk(2)[::-1])  # BFL's adaLN rows: shift, then scale
    save_file({_official_name(k): (swapped if k == "norm_out.linear.weight" else v).contiguous()
               for k, v in state.items()}, tmp_path / "flux3-debug.safetensors")
    loaded = family.load_weights(str(tmp_path / "flux3-debug.safetensors"))
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], v) for k, v in state.items())
