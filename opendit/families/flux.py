"""FLUX.1 as a model family: flux-dev / flux-schnell (the official architecture; the published weights load)
and flux-debug (tiny, for CPUs) on captioned images, rectified flow, T5 token embeddings + the pooled CLIP
vector, FLUX's 16-channel autoencoder (or pixel space for the demo), Euler sampling on FLUX's shifted schedule.

Data: the captioned digits demo, a folder of images with .txt captions beside them, a CSV / JSONL of
path,caption, or a cache from preprocess.py --family flux (VAE posteriors, T5 embeddings, CLIP vectors: training
on it loads no encoder at all). Text dropout for classifier-free guidance replaces each encoder's output by the
empty caption's, independently (p = --text_dropout_prob each).
"""
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from opendit.data import build_dataset
from opendit.diffusion.flow import RectifiedFlow, euler_sample, flux_schedule
from opendit.encoders.text import load_t5_encoder, load_text_encoder, t5_encoder_dim, text_encoder_dim
from opendit.encoders.vae import FLUX_VAE_SCALE, FLUX_VAE_SHIFT, decode, encode, load_vae, scale_latents
from opendit.families.base import ModelSpec
from opendit.families.image import ImageDiffusionFamily
from opendit.families.writers import ImageWriter
from opendit.models.flux import FLUX_CONFIGS, Flux, image_ids, pack_latents, text_ids, unpack_latents

FLUX_MODELS = {name: ModelSpec(name, "flux", Flux, arch) for name, arch in FLUX_CONFIGS.items()}
T5_MAX_LENGTH = {"flux-dev": 512, "flux-schnell": 256, "flux-debug": 16}
SAMPLING_STEPS = {"flux-schnell": 4}  # the others: 50, FLUX.1-dev's default
TIME_SHIFT = {"flux-schnell": False}  # schnell samples on the plain linear schedule


@dataclass
class FluxEncoders:
    vae: torch.nn.Module | None  # None: pixel space, or training on a cache
    t5: object | None  # opendit.encoders.text.T5TextEncoder; None when training on a cache
    clip: object | None  # opendit.encoders.text.CLIPTextEncoder (pooled vector)
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


def encoder_dtype(device) -> torch.dtype:
    """bf16 on GPUs (FLUX's setting: T5-XXL is 9.5 GB in bf16); fp32 on CPUs, where bf16 matmuls are slow."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


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
            return scale_latents(mean + std * torch.randn(mean.shape, device=device, dtype=mean.dtype), scale,
                                 self.vae_shift)
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

    def loss(self, model, x, cond: dict) -> torch.Tensor:
        """x [B, C, h, w] latents; t from the configured distribution with FLUX's shift for this resolution."""
        return self.losses(model, x, cond)[0].mean()

    def losses(self, model, x, cond: dict, t_frac: torch.Tensor | None = None,
               noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-sample loss [B] in fp32, t [B]). t_frac and noise None: drawn from the global RNG (training);
        given: used as they are (validation: t is the noise level itself, no shift)."""
        b, _, h, w = x.shape
        if t_frac is None:
            t = self.flow.sample_t(b, x.device, image_seq_len=(h // 2) * (w // 2),
                                   distribution=self.cfg.timestep_sampling)
        else:
            t = t_frac.to(x.device, torch.float32)
        if noise is None:
            noise = torch.randn(x.shape, device=x.device, dtype=x.dtype)
        pred = model(**flux_inputs(pack_latents(self.flow.noisy(x, t, noise)), h, w, cond["txt"], cond["y"], t,
                                   self.cfg.guidance if self.guidance_embed else None))
        return self.flow.mse_per_sample(unpack_latents(pred.float(), h, w), self.flow.target(x, noise)), t


def flux_inputs(img, h: int, w: int, txt, y, t, guidance: float | None) -> dict:
    """The official forward's keyword arguments for packed latents img [B, h/2 * w/2, 4C] of an h x w latent."""
    b = img.shape[0]
    return dict(img=img, img_ids=image_ids(b, h, w, img.device), txt=txt, txt_ids=text_ids(b, txt.shape[1], img.device),
                timesteps=t, y=y, guidance=None if guidance is None else torch.full((b,), float(guidance),
                                                                                  device=img.device))


@dataclass
class FluxSampler:
    timesteps: list[float]  # from 1 (noise) to 0 (data)
    guidance: float | None  # the guidance embedding's value (models that have one)
    progress: bool = False  # a progress bar over the steps (sample.py sets it on rank 0)


class FluxFamily(ImageDiffusionFamily):
    name = "flux"
    models = FLUX_MODELS
    datasets = ("captioned_digits", "captions", "latents")
    samplers = ("euler",)
    class_conditional = False
    cache_keys = ("t5", "clip", "t5_max_length")
    default_vae_scale = FLUX_VAE_SCALE
    default_cfg_scale = 1.0

    def patch_size(self, cfg) -> int:
        return 2  # FLUX packs 2x2 latent patches into one token

    def default_sampling_steps(self, cfg) -> int:
        return SAMPLING_STEPS.get(cfg.model, 50)

    # ---- configuration and data ---------------------------------------------------------------------------
    def _defaults(self, cfg):
        cfg = super()._defaults(cfg)
        return dataclasses.replace(cfg, num_classes=0,
                                   t5_max_length=cfg.t5_max_length or T5_MAX_LENGTH.get(cfg.model, 512))

    def load_encoders(self, cfg, device, training: bool) -> FluxEncoders:
        if training and cfg.dataset == "latents":  # everything is in the cache
            return FluxEncoders(vae=None, t5=None, clip=None)
        for flag in ("t5", "clip"):
            if str(getattr(cfg, flag)).lower() == "none":
                raise ValueError(f"{cfg.model} needs --{flag} <local folder> (a FLUX pipeline folder works for both: "
                                 f"its text_encoder/ is CLIP, its text_encoder_2/ T5); the demo makes tiny ones: "
                                 f"RECIPE=digits bash train_flux.sh")
        dtype = encoder_dtype(device)
        t5 = load_t5_encoder(cfg.t5, device, cfg.t5_max_length, dtype)
        if training:
            t5 = shard_for_plugin(t5, cfg.plugin)
        return FluxEncoders(vae=load_vae(cfg.vae, device), t5=t5, clip=load_text_encoder(cfg.clip, device, dtype=dtype))

    def load_data(self, cfg, encoders: FluxEncoders):
        if cfg.dataset == "latents":
            dataset = build_dataset("latents", cfg.data_path, cfg.image_size, seed=cfg.global_seed)
            if not dataset.embeddings:
                raise ValueError(f"latent cache {cfg.data_path!r} holds no text embeddings (not written with "
                                 f"preprocess.py --family flux); rebuild it with --family flux --t5 ... --clip ...")
            encoders.empty = dataset.empty_embeddings()
        else:
            channels = 3 if encoders.vae is not None else self.pixel_channels(cfg)
            dataset = build_dataset(cfg.dataset, cfg.data_path, cfg.image_size, channels=channels)
        return dataset, dataclasses.replace(cfg, num_classes=0)

    # ---- model ---------------------------------------------------------------------------------------------
    def build_model(self, cfg, latent_shape):
        channels, h, w = latent_shape
        model = self.models[cfg.model].build(in_channels=4 * channels, out_channels=4 * channels,
                                             context_in_dim=t5_encoder_dim(cfg.t5),
                                             vec_in_dim=text_encoder_dim(cfg.clip))
        model.num_tokens = (cfg.t5_max_length, (h // 2) * (w // 2))  # (text, image) per sample, for the FLOP count
        return model

    def train_flops_per_sample(self, model) -> float:
        from opendit.perf import flux_forward_macs

        return 3 * 2 * float(flux_forward_macs(model, *model.num_tokens))

    def objective(self, cfg, encoders: FluxEncoders) -> FlowObjective:
        return FlowObjective(encoders, cfg, FLUX_CONFIGS[cfg.model]["guidance_embed"], FLUX_VAE_SHIFT)

    # ---- sampling ------------------------------------------------------------------------------------------
    def recognize_checkpoint(self, path: str):
        """An official FLUX.1 transformer .safetensors (flux1-dev / flux1-schnell): the model from its keys."""
        if Path(path).suffix != ".safetensors":
            return None
        from safetensors import safe_open

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

    def sampling_config(self, settings: dict, flags: dict):
        missing = [k for k in ("vae", "t5", "clip") if {**settings, **flags}.get(k) is None]
        if missing:
            raise ValueError(f"the checkpoint does not name its encoders: pass {' '.join('--' + k for k in missing)} "
                             f"(local folders; a FLUX.1 repository folder holds vae/, text_encoder/ and "
                             f"text_encoder_2/: --vae DIR/vae --t5 DIR --clip DIR)")
        return super().sampling_config(settings, flags)

    def conditions(self, sample_cfg, cfg) -> list:
        if sample_cfg.class_labels:
            raise ValueError(f"--class_labels: {cfg.model} is conditioned on captions; pass --prompts")
        prompts = list(sample_cfg.prompts)
        if sample_cfg.prompts_file:
            lines = Path(sample_cfg.prompts_file).read_text(encoding="utf-8").splitlines()
            prompts += [line.strip() for line in lines if line.strip()]
        if not prompts:
            raise ValueError(f"{cfg.model} samples from captions: pass --prompts \"...\" or --prompts_file")
        return prompts

    def make_sampler(self, sample_cfg, cfg) -> FluxSampler:
        sample_cfg = self.sample_defaults(sample_cfg, cfg)
        size = cfg.image_size // (8 if cfg.vae.lower() != "none" else 1)  # FLUX's autoencoder downsamples 8x
        timesteps = flux_schedule(sample_cfg.num_sampling_steps, (size // 2) ** 2,
                                  shift=TIME_SHIFT.get(cfg.model, True))
        guidance = sample_cfg.guidance if FLUX_CONFIGS[cfg.model]["guidance_embed"] else None
        return FluxSampler(timesteps, guidance)

    @torch.no_grad()
    def sample_latents(self, loaded, sampler: FluxSampler, indices, conditions, sample_cfg, device) -> torch.Tensor:
        """Latents [n, C, h, w] for global indices: Euler steps on the schedule; noise from (seed, first index)."""
        sample_cfg = self.sample_defaults(sample_cfg, loaded.cfg)
        model, enc = loaded.model, loaded.encoders
        gen = torch.Generator().manual_seed(sample_cfg.seed * 1_000_003 + indices.start)
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

        return unpack_latents(euler_sample(velocity, pack_latents(z), sampler.timesteps, sampler.progress), h, w)

    @torch.no_grad()
    def sample_batch(self, loaded, sampler, indices, conditions, sample_cfg, device) -> np.ndarray:
        out = self.sample_latents(loaded, sampler, indices, conditions, sample_cfg, device)
        vae = loaded.encoders.vae
        images = decode(vae, out, scale=loaded.cfg.vae_scale, shift=FLUX_VAE_SHIFT) if vae is not None else \
            out.clamp(-1, 1)
        return ((images + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()

    def writer(self, out_dir, sample_cfg, cfg) -> ImageWriter:
        return ImageWriter(Path(out_dir), npz=sample_cfg.npz)

    # ---- caching -------------------------------------------------------------------------------------------
    def resolve_cache_config(self, cfg):
        if cfg.model is not None and cfg.model not in self.models:
            raise ValueError(f"--model {cfg.model} is not a FLUX model; valid: {', '.join(self.models)}")
        return dataclasses.replace(cfg, t5_max_length=cfg.t5_max_length or T5_MAX_LENGTH.get(cfg.model, 512))

    def cache_encoders(self, cfg, device) -> FluxEncoders:
        return self.load_encoders(cfg, device, training=False)

    def cache_source(self, cfg, encoders):
        """(image [3, H, W] in [-1, 1], label (the digit, or 0), caption) per item, no random flips."""
        if cfg.dataset == "latents":
            raise ValueError("--dataset latents is already a cache; encode captioned_digits or a captions folder")
        return _Labelled(build_dataset(cfg.dataset, cfg.data_path, cfg.image_size, channels=3))

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


class _Labelled(torch.utils.data.Dataset):
    """(image, caption) items -> (image, label, caption), the layout preprocess.py stores (label: the digit of
    the captioned digits, else 0)."""

    def __init__(self, dataset):
        self.dataset, self.labels = dataset, getattr(dataset, "labels", None)
        self.num_classes = 0

    @property
    def _bad(self):  # indices the dataset replaced because their file was unreadable
        return getattr(self.dataset, "_bad", ())

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        image, caption = self.dataset[i]
        return image, int(self.labels[i]) if self.labels is not None else 0, caption


def shard_for_plugin(t5, plugin: str):
    """Under the FSDP plugins (zero3, fsdp, hsdp) each rank holds a shard of T5's blocks (T5-XXL: 9.5 GB in
    bf16); CLIP (0.25 GB) stays replicated. Forward-only: no gradients, the blocks reshard after use."""
    import torch.distributed as dist

    if plugin not in ("zero3", "fsdp", "hsdp") or not dist.is_initialized() or dist.get_world_size() == 1:
        return t5
    from torch.distributed.fsdp import fully_shard

    for block in t5.model.encoder.block:
        fully_shard(block)
    fully_shard(t5.model)
    return t5
