"""FLUX.1 as a model family: flux-dev / flux-schnell (the official architecture; the published weights load)
and flux-debug (tiny, for CPUs) on captioned images, rectified flow, T5 token embeddings + the pooled CLIP
vector, FLUX's 16-channel autoencoder (or pixel space for the demo), Euler sampling on FLUX's shifted schedule.

Data: the captioned digits demo, a folder of images with .txt captions beside them, a CSV / JSONL of
path,caption, or a cache from preprocess.py --family flux (VAE posteriors, T5 embeddings, CLIP vectors: training
on it loads no encoder at all). Text dropout for classifier-free guidance replaces each encoder's output by the
empty caption's, independently (p = --text_dropout_prob each).

What the model's forward takes (the official arguments): forward(img [B, L, 4C] 2x2-packed latent tokens,
img_ids [B, L, 3], txt [B, L_txt, D_t5], txt_ids [B, L_txt, 3], timesteps [B] in [0, 1], y [B, D_clip] pooled
CLIP, guidance [B] or None) -> velocity tokens [B, L, 4C]; forward_with_cfg(..., cfg_scale) on [cond; uncond].
"""
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from opendit.booster import shard_frozen
from opendit.data import CAPTIONED_DIGITS, CAPTIONED_STREAMS, CAPTIONS, LATENTS, dataset_map, distinct_captions
from opendit.data.captions import LabelledCaptions
from opendit.diffusion.flow import TIMESTEP_SAMPLINGS, RectifiedFlow, euler_sample, flux_schedule
from opendit.encoders.text import (CLIP_SOURCE, T5_SOURCE, FixedEmbeddings, encoder_dtype, load_t5_encoder,
                                   load_text_encoder, t5_encoder_dim, text_encoder_dim)
from opendit.encoders.vae import encode, load_vae, posterior_sample, scale_latents
from opendit.families.base import ModelSpec, NegativePromptOption, preview_prompts, prompt_conditions
from opendit.families.flux.model import FLUX_CONFIGS, Flux, image_ids, pack_latents, text_ids, unpack_latents
from opendit.families.flux.weights import FLUX_WEIGHTS
from opendit.families.latent import LatentImageFamily, is_none
from opendit.options import opt
from opendit.perf import matmul_macs
from opendit.seeding import sampling_generator

# What each model implies beyond its architecture: T5 tokens per caption, default sampling steps, and whether
# its sampling schedule shifts with the resolution (schnell samples on the plain linear schedule in 4 steps).
FLUX_CONSTANTS = {"flux-dev": dict(t5_max_length=512, sampling_steps=50, time_shift=True),
                  "flux-schnell": dict(t5_max_length=256, sampling_steps=4, time_shift=False),
                  "flux-debug": dict(t5_max_length=16, sampling_steps=50, time_shift=True)}
FLUX_MODELS = {name: ModelSpec(name, "flux", Flux, arch, FLUX_CONSTANTS[name]) for name, arch in FLUX_CONFIGS.items()}

T5_HELP = "a local T5 encoder folder (T5EncoderModel + tokenizer, or a pipeline folder with text_encoder_2/)"
CLIP_HELP = "the pooled-vector CLIP-L text encoder folder (or a pipeline folder with text_encoder/), required"
T5_LENGTH_HELP = "T5 tokens per caption; default: a cache's, else the model's (flux-dev 512, flux-schnell 256, " \
                 "flux-debug 16)"

# FLUX's autoencoder (black-forest-labs/flux AutoEncoderParams scale_factor / shift_factor; diffusers' FLUX.1 vae
# config: scaling_factor / shift_factor): 16 latent channels, z = (sample - 0.1159) * 0.3611
FLUX_VAE_SCALE = 0.3611
FLUX_VAE_SHIFT = 0.1159


@dataclass(frozen=True)
class FluxTrainOptions:
    clip: str = opt("none", CLIP_HELP)
    t5: str = opt("none", T5_HELP + ", required")
    t5_max_length: int | None = opt(None, T5_LENGTH_HELP, check="positive")
    text_dropout_prob: float = opt(0.447, "each text encoder's output is replaced by the empty caption's this often, "
                                          "independently (0.447: about 20%% of samples see neither)", check="prob")
    timestep_sampling: str = opt("logit_normal", "training t ~ sigmoid(N(0, 1)) or uniform, then FLUX's "
                                                 "resolution-dependent shift", TIMESTEP_SAMPLINGS)
    guidance: float = opt(1.0, "models with a guidance embedding (flux-dev, flux-debug): the value it sees while "
                               "training")


@dataclass(frozen=True)
class FluxSampleOptions(NegativePromptOption):
    clip: str | None = opt(None, "CLIP text encoder folder; default: the checkpoint's", from_checkpoint=True)
    t5: str | None = opt(None, "T5 encoder folder; default: the checkpoint's", from_checkpoint=True)
    guidance: float = opt(3.5, "models with a guidance embedding (flux-dev): the guidance they are given")


@dataclass(frozen=True)
class FluxCacheOptions:
    clip: str = opt("none", "the CLIP text encoder folder whose pooled vectors to cache")
    t5: str = opt("none", "the T5 encoder folder whose token embeddings to cache")
    t5_max_length: int | None = opt(None, "T5 tokens per caption; default: the model's (see --model)",
                                    check="positive")


@dataclass
class FluxEncoders:
    vae: torch.nn.Module | None  # None: pixel space, or training on a cache
    t5: object | None  # an opendit.encoders.text.TokenTextEncoder (or FixedEmbeddings); None when training on a cache
    clip: object | None  # opendit.encoders.text.CLIPTextEncoder (pooled vector), or FixedEmbeddings
    empty: tuple[torch.Tensor, torch.Tensor] | None = None  # (T5 [L, D], CLIP [D]) of the empty caption

    def encode(self, captions: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
        """captions -> (T5 tokens [B, L, D], pooled CLIP [B, D]) float32 on device."""
        return self.t5(captions).float().to(device), self.clip(captions).float().to(device)

    def empty_embeddings(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.empty is None:
            t5, clip = self.encode([""], "cpu")
            self.empty = (t5[0], clip[0])
        self.empty = tuple(e.to(device) for e in self.empty)  # kept there: later steps copy nothing
        return self.empty


def empty_embeddings(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """(T5 [L, D], CLIP [D]) of the empty caption, stored once in a FLUX latent cache: what text dropout uses."""
    return cache.extra("empty_t5"), cache.extra("empty_clip")


class FlowObjective:
    """Rectified flow on (packed) latents. A batch is (images [B, C, H, W] in [-1, 1], captions) or a cached one
    ((mean, std) [B, C, h, w], labels, captions, T5 [B, L, D], CLIP [B, D]). Latents are (z - shift) * scale of
    one posterior sample (drawn as mean + std * randn, so the cache equals encoding on the fly)."""

    def __init__(self, encoders: FluxEncoders, cfg, guidance_embed: bool, vae_shift: float):
        self.encoders, self.cfg, self.guidance_embed, self.vae_shift = encoders, cfg, guidance_embed, vae_shift
        self.flow = RectifiedFlow()

    def _latents(self, x, device):
        vae, scale = self.encoders.vae, self.cfg.vae_scale
        if isinstance(x, (list, tuple)):  # a cached posterior: one sample, drawn as encode() draws it
            mean, std = (t.to(device, non_blocking=True) for t in x)
            return scale_latents(posterior_sample(mean, std), scale, self.vae_shift)
        x = x.to(device, non_blocking=True)
        return x if vae is None else encode(vae, x, scale=scale, shift=self.vae_shift)

    def prepare(self, batch, device, train: bool = True):
        if len(batch) == 5:  # cached: (mean, std), labels, captions, T5, CLIP
            txt, vec = batch[3].to(device).float(), batch[4].to(device).float()
        else:
            txt, vec = self.encoders.encode(list(batch[1]), device)
        x = self._latents(batch[0], device)
        empty_txt, empty_vec = self.encoders.empty_embeddings(device)
        p = self.cfg.text_dropout_prob if train else 0.0
        drop_txt = (torch.rand(len(txt)) < p).to(device)  # the global RNG: the same on every SP rank
        drop_vec = (torch.rand(len(vec)) < p).to(device)
        txt = torch.where(drop_txt[:, None, None], empty_txt, txt)
        vec = torch.where(drop_vec[:, None], empty_vec, vec)
        return x, {"txt": txt, "y": vec}

    def losses(self, model, x, cond: dict, t_frac: torch.Tensor | None = None,
               noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-sample loss [B] in fp32, t [B]). t_frac and noise None: drawn from the global RNG (training; t
        from the configured distribution with FLUX's shift for this resolution); given: used as they are
        (validation: t is the noise level itself, no shift)."""
        b, _, h, w = x.shape
        if t_frac is None:
            t = self.flow.sample_t(b, x.device, image_seq_len=(h // 2) * (w // 2),
                                   distribution=self.cfg.timestep_sampling)
        else:
            t = t_frac.to(x.device, torch.float32)
        guidance = self.cfg.guidance if self.guidance_embed else None

        def velocity(x_t, t):
            pred = model(**flux_inputs(pack_latents(x_t), h, w, cond["txt"], cond["y"], t, guidance))
            return unpack_latents(pred, h, w)
        return self.flow.losses(velocity, x, t, noise), t


def flux_inputs(img, h: int, w: int, txt, y, t, guidance: float | None) -> dict:
    """The official forward's keyword arguments for packed latents img [B, h/2 * w/2, 4C] of an h x w latent."""
    b = img.shape[0]
    return dict(img=img, img_ids=image_ids(b, h, w, img.device), txt=txt, txt_ids=text_ids(b, txt.shape[1], img.device),
                timesteps=t, y=y, guidance=None if guidance is None else torch.full((b,), float(guidance),
                                                                                  device=img.device))


def flux_forward_macs(model: nn.Module, txt_tokens: int, img_tokens: int) -> int:
    """Multiply-accumulates of one FLUX forward pass for ONE sample of txt_tokens T5 tokens and img_tokens
    packed latent tokens, from its layers: a Linear of a text-stream module (txt_in, txt_attn, txt_mlp) costs
    txt_tokens * in * out, of an image-stream one (img_in, img_attn, img_mlp, final_layer.linear) img_tokens *
    in * out, of a single block (linear1, linear2: the joint sequence) (txt + img) * in * out, and a per-sample
    one (time / guidance / vector embedders, modulations) in * out; each of the depth + depth_single_blocks
    joint attentions 2 * L^2 * hidden with L = txt + img."""
    joint = txt_tokens + img_tokens

    def rows_of(name: str) -> int:
        if "_mod." in name or "modulation" in name or name.split(".")[0] in ("time_in", "vector_in", "guidance_in"):
            return 1
        if name.startswith("single_blocks."):
            return joint
        if name.startswith("txt_in") or ".txt_" in name:
            return txt_tokens
        return img_tokens  # img_in, the image stream, final_layer.linear
    attentions = len(model.double_blocks) + len(model.single_blocks)
    return matmul_macs(model, rows_of) + attentions * 2 * joint * joint * model.hidden_size


@dataclass
class FluxSampler:
    steps: int
    time_shift: bool  # the schedule shifts with the image's token count (flux_schedule)
    guidance: float | None  # the guidance embedding's value (models that have one)
    progress: bool = False  # a progress bar over the steps (sample.py sets it on rank 0)


class FluxFamily(LatentImageFamily):
    name = "flux"
    title, weight_formats = "FLUX.1", "official `flux1-*.safetensors`, diffusers folders"
    models = FLUX_MODELS
    # attention and MLP Linears of both streams and of the single blocks
    lora_targets = r"double_blocks\.\d+\.(img|txt)_(attn\.(qkv|proj)|mlp\.[02])|single_blocks\.\d+\.linear[12]"
    datasets = dataset_map(CAPTIONED_DIGITS, CAPTIONS, LATENTS, *CAPTIONED_STREAMS)
    samplers = ("euler",)
    defaults_help = {"cfg_scale": "FLUX 1: its guidance embedding instead, see --guidance",
                     "num_sampling_steps": "flux-schnell 4, other FLUX 50", "sampler": "FLUX: euler",
                     "vae_scale": "FLUX: its VAE's 0.3611, shifted by 0.1159"}
    cache_keys = ("t5", "clip", "t5_max_length")
    encoder_folders = ("vae", "t5", "clip")
    encoder_folders_hint = ("a FLUX.1 repository folder holds vae/, text_encoder/ and text_encoder_2/: --vae DIR/vae "
                            "--t5 DIR --clip DIR")
    checkpoint_formats = ("an official flux1-dev / flux1-schnell .safetensors",)
    weights = FLUX_WEIGHTS
    train_options = FluxTrainOptions
    sample_options = FluxSampleOptions
    cache_options = FluxCacheOptions
    default_vae_scale = FLUX_VAE_SCALE
    vae_shift = FLUX_VAE_SHIFT
    vae_channels, vae_params = 16, 83_819_683  # FLUX's autoencoder (diffusers' AutoencoderKL, 16 channels)
    default_cfg_scale = 1.0  # the guidance embedding guides; true CFG is opt-in
    cache_thresholds = {"teacache": 0.15, "fbcache": 0.24}  # benchmarks/README.md: FLUX digits, >= 2x, none lost

    def patch_size(self, cfg) -> int:
        return 2  # FLUX packs 2x2 latent patches into one token

    def constant(self, model: str | None, key: str):
        spec = self.models.get(model) if model is not None else None
        return spec.constants[key] if spec is not None else FLUX_CONSTANTS["flux-dev"][key]

    def default_sampling_steps(self, cfg: FluxTrainOptions) -> int:
        return self.constant(cfg.model, "sampling_steps")

    # ---- configuration and data ---------------------------------------------------------------------------
    def fill_defaults(self, cfg):
        return dataclasses.replace(super().fill_defaults(cfg), num_classes=0,
                                   t5_max_length=cfg.t5_max_length or self.constant(cfg.model, "t5_max_length"))

    def load_encoders(self, cfg: FluxTrainOptions | FluxCacheOptions, device, training: bool) -> FluxEncoders:
        if training and self.dataset_spec(cfg).cache:  # everything is in the cache
            return FluxEncoders(vae=None, t5=None, clip=None)
        for flag in ("t5", "clip"):
            if is_none(getattr(cfg, flag)):
                raise ValueError(f"{cfg.model} needs --{flag} <local folder> (a FLUX pipeline folder works for both: "
                                 f"its text_encoder/ is CLIP, its text_encoder_2/ T5); the demo makes tiny ones: "
                                 f"RECIPE=digits bash train_flux.sh")
        dtype = encoder_dtype(device)
        t5 = load_t5_encoder(cfg.t5, device, cfg.t5_max_length, dtype)
        if training:  # T5-XXL is sharded like the model's weights under the plugins that keep them sharded
            shard_frozen(t5.model, t5.model.encoder.block, cfg.plugin)
        return FluxEncoders(vae=load_vae(cfg.vae, device), t5=t5, clip=load_text_encoder(cfg.clip, device, dtype=dtype))

    def dataset_options(self, cfg: FluxTrainOptions, encoders, spec) -> dict:
        if spec.cache:
            return {"seed": cfg.global_seed}
        return {"channels": self.source_channels(cfg, encoders)}

    def load_data(self, cfg: FluxTrainOptions, encoders: FluxEncoders):
        dataset, cfg = super().load_data(cfg, encoders)
        if self.dataset_spec(cfg).cache:
            if not dataset.embeddings:
                raise ValueError(f"latent cache {cfg.data_path!r} holds no text embeddings (not written with "
                                 f"preprocess.py --family flux); rebuild it with --family flux --t5 ... --clip ...")
            encoders.empty = empty_embeddings(dataset)
        return dataset, dataclasses.replace(cfg, num_classes=0)

    # ---- model ---------------------------------------------------------------------------------------------
    def build_model(self, cfg: FluxTrainOptions, latent_shape):
        channels, h, w = latent_shape
        model = self.models[cfg.model].build(in_channels=4 * channels, out_channels=4 * channels,
                                             context_in_dim=t5_encoder_dim(cfg.t5),
                                             vec_in_dim=text_encoder_dim(cfg.clip))
        model.num_tokens = (cfg.t5_max_length, (h // 2) * (w // 2))  # (text, image) per sample, for the FLOP count
        return model

    def train_flops_per_sample(self, model) -> float:
        return 3 * 2 * float(flux_forward_macs(model, *model.num_tokens))

    def text_encoder_bytes(self, cfg: FluxTrainOptions, device) -> dict:
        size = encoder_dtype(device).itemsize
        return {"T5-XXL encoder": size * T5_SOURCE.params,
                "CLIP-L text": size * CLIP_SOURCE.params}

    def memory_model(self, cfg: FluxTrainOptions, latent_shape):
        """build_model's model with T5-XXL's 4096-wide tokens and CLIP-L's 768-wide vector (the constructor's)."""
        channels, h, w = latent_shape
        model = self.models[cfg.model].build(in_channels=4 * channels, out_channels=4 * channels)
        model.num_tokens = (cfg.t5_max_length, (h // 2) * (w // 2))
        return model

    def memory_inputs(self, cfg: FluxTrainOptions, model, latent_shape, batch, device) -> dict:
        """The official forward's arguments: packed latents, --t5_max_length T5 tokens, the pooled CLIP vector."""
        _, h, w = latent_shape
        txt = torch.randn(batch, cfg.t5_max_length, model.txt_in.in_features, device=device)
        y = torch.randn(batch, model.vector_in.in_layer.in_features, device=device)
        img = pack_latents(torch.randn(batch, *latent_shape, device=device))
        return flux_inputs(img, h, w, txt, y, torch.rand(batch, device=device),
                           cfg.guidance if model.guidance_embed else None)

    def objective(self, cfg: FluxTrainOptions, encoders: FluxEncoders) -> FlowObjective:
        return FlowObjective(encoders, cfg, self.models[cfg.model].arch["guidance_embed"], self.vae_shift)

    # ---- sampling ------------------------------------------------------------------------------------------
    def recognize_checkpoint(self, path: str):
        """An official FLUX.1 transformer .safetensors (flux1-dev / flux1-schnell): the model from its keys."""
        if Path(path).suffix != ".safetensors":
            return None
        with safe_open(path, "pt") as f:
            keys = set(f.keys())
            if "double_blocks.0.img_attn.qkv.weight" not in keys:
                return None
            hidden = f.get_slice("img_in.weight").get_shape()[0]
        name = next((n for n, a in FLUX_CONFIGS.items() if a["hidden_size"] == hidden
                     and a["guidance_embed"] == ("guidance_in.in_layer.weight" in keys)
                     and a["depth"] == len({k.split(".")[1] for k in keys if k.startswith("double_blocks.")})), None)
        settings = dict(dataset="captions", image_size=1024, num_classes=0)  # the VAE, T5 and CLIP: from flags
        return ({**settings, "model": name} if name else settings), None

    def conditions(self, sample_cfg: FluxSampleOptions, cfg: FluxTrainOptions) -> list:
        return prompt_conditions(sample_cfg, cfg.model)

    def make_sampler(self, sample_cfg: FluxSampleOptions, cfg: FluxTrainOptions) -> FluxSampler:
        guidance = sample_cfg.guidance if self.models[cfg.model].arch["guidance_embed"] else None
        return FluxSampler(sample_cfg.num_sampling_steps, self.constant(cfg.model, "time_shift"), guidance)

    @torch.no_grad()
    def sample_latents(self, loaded, sampler: FluxSampler, indices, conditions, sample_cfg, device) -> torch.Tensor:
        """Latents [n, C, h, w] for global indices: Euler steps on the schedule; noise from (seed, first index)."""
        model, enc = loaded.model, loaded.encoders
        gen = sampling_generator(sample_cfg.seed, indices.start)
        n, (c, h, w) = len(indices), loaded.latent_shape
        z = torch.randn(n, c, h, w, generator=gen).to(device)
        txt, vec = enc.encode([conditions[i % len(conditions)] for i in indices], device)
        guided = sample_cfg.cfg_scale > 1.0
        if guided:  # true classifier-free guidance: [cond; uncond] halves, the second with the negative prompt
            neg_txt, neg_vec = enc.encode([sample_cfg.negative_prompt], device)
            txt, vec = torch.cat([txt, neg_txt.expand_as(txt)]), torch.cat([vec, neg_vec.expand_as(vec)])

        def velocity(x, t):
            x = torch.cat([x, x]) if guided else x
            kw = flux_inputs(x, h, w, txt, vec, torch.cat([t, t]) if guided else t, sampler.guidance)
            out = model.forward_with_cfg(**kw, cfg_scale=sample_cfg.cfg_scale) if guided else model(**kw)
            return out[:n].float()

        # the schedule of this latent's (h/2)*(w/2) tokens: sampling at another size shifts it as FLUX does
        timesteps = flux_schedule(sampler.steps, (h // 2) * (w // 2), shift=sampler.time_shift)
        return unpack_latents(euler_sample(velocity, pack_latents(z), timesteps, sampler.progress), h, w)

    # ---- previews ------------------------------------------------------------------------------------------
    def preview_conditions(self, cfg: FluxTrainOptions, dataset, rows: int) -> list:
        return preview_prompts(dataset, rows, cfg.model)

    def preview_encoders(self, cfg: FluxTrainOptions, encoders: FluxEncoders, conditions: list,
                         dataset) -> FluxEncoders:
        """The prompts' (and the empty caption's) T5 and CLIP embeddings: encoded now, or read from a cache."""
        captions = [*conditions, ""]
        if encoders.t5 is not None and encoders.clip is not None:
            t5, clip = FixedEmbeddings.encode(encoders.t5, captions), FixedEmbeddings.encode(encoders.clip, captions)
        else:  # a cache: the embeddings stored with each prompt's first item, and the empty caption's
            index = {c: i for i, c in distinct_captions(dataset, len(conditions) * 4)}
            items = {c: dataset[index[c]] for c in conditions}  # ((mean, std), label, caption, t5, clip)
            empty = encoders.empty if encoders.empty is not None else empty_embeddings(dataset)
            t5 = FixedEmbeddings({**{c: item[3].float() for c, item in items.items()}, "": empty[0].float().cpu()})
            clip = FixedEmbeddings({**{c: item[4].float() for c, item in items.items()}, "": empty[1].float().cpu()})
        return FluxEncoders(vae=encoders.vae, t5=t5, clip=clip)

    # ---- caching -------------------------------------------------------------------------------------------
    def resolve_cache_config(self, cfg: FluxCacheOptions):
        if cfg.model is not None and cfg.model not in self.models:
            raise ValueError(f"--model {cfg.model} is not a FLUX model; valid: {', '.join(self.models)}")
        cfg = super().resolve_cache_config(cfg)
        return dataclasses.replace(cfg, t5_max_length=cfg.t5_max_length or self.constant(cfg.model, "t5_max_length"))

    def cache_encoders(self, cfg: FluxCacheOptions, device) -> FluxEncoders:
        return self.load_encoders(cfg, device, training=False)

    def cache_dataset_options(self, cfg: FluxCacheOptions, spec) -> dict:
        return {"channels": 3}

    def cache_source(self, cfg: FluxCacheOptions, encoders):
        """(image [3, H, W] in [-1, 1], label (the digit, or 0), caption) per item, no random flips."""
        return LabelledCaptions(super().cache_source(cfg, encoders))

    @torch.no_grad()
    def cache_encode(self, encoders: FluxEncoders, x, captions=None) -> dict:
        out = super().cache_encode(encoders, x)  # the VAE posterior's mean and std
        if captions is not None:
            t5, clip = encoders.encode(list(captions), "cpu")
            out.update(t5=t5, clip=clip)
        return out

    def cache_extras(self, encoders: FluxEncoders) -> dict:
        """Arrays stored once per cache: the empty caption's embeddings (text dropout while training)."""
        t5, clip = encoders.empty_embeddings("cpu")
        return {"empty_t5": t5, "empty_clip": clip}
