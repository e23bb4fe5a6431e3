"""Wan as a model family: Wan2.1-T2V-1.3B / -14B, Wan2.2-TI2V-5B and the two experts of Wan2.2-T2V-A14B /
-I2V-A14B (the official architecture; the published weights and diffusers' Wan folders load), and Wan-debug,
Wan2.2-debug, Wan2.2-I2V-debug (tiny, for CPUs) on captioned clips, flow matching as Wan is trained
(objective.py; image-to-video in first_frame.py), UMT5 token embeddings through cross-attention, Wan's causal 3-D
VAEs (or pixel space for the demo), sampling with diffusers' UniPC in its flow mode (Wan's default) or flow Euler,
one expert at a time for A14B (experts.py).

Data: the moving-digits demo (captioned "the digit 3 moving up and left"; here the digit is half the frame and
never touches a wall, so the caption's direction holds in every frame, and a grey border marks the canvas's edge,
which a model with only relative positions needs to learn where the digit goes), a CSV of path,caption, or a cache from
preprocess.py --family wan (Wan-VAE posteriors and UMT5 embeddings: training on it loads no encoder). Caption
dropout for classifier-free guidance replaces a caption's embedding by the empty caption's.

What the model's forward takes: the official forward(x, t, context, seq_len) (lists of [C, F, H, W] latents and
[L_i, D] UMT5 embeddings, t [B] in 0..1000), or batched tensors x [B, C, F, H, W], context [B, text_len, D]
zero-padded -> velocity [B, C, F, H, W] (what training and sampling here call).
"""
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from opendit.booster import shard_frozen
from opendit.data import CLIP_STREAMS, LATENTS, MOVING_DIGITS, VIDEO_CSV, dataset_map, distinct_captions
from opendit.diffusion.flow import TIMESTEP_SAMPLINGS, cfg_velocity, euler_sample, shift_times
from opendit.diffusion.sampling import progress_interval
from opendit.encoders.text import FixedEmbeddings, encoder_dtype
from opendit.checkpoint.folders import read_config
from opendit.families.base import MemoryProbe, ModelSpec, NegativePromptOption, preview_prompts, prompt_conditions
from opendit.families.clips import ClipCacheOptions, ClipFamily, ClipSampleOptions, ClipTrainOptions
from opendit.families.latent import LatentImageFamily, is_none
from opendit.families.wan.experts import ExpertPair, Experts, expert_folders
from opendit.families.wan.first_frame import (condition_kind, condition_video, i2v_inputs, load_first_frame,
                                              ti2v_timesteps, with_first_frame)
from opendit.families.wan.model import WAN22_CONFIGS, WAN_CONFIGS, WanModel
from opendit.images import image_paths
from opendit.families.wan.objective import WanEncoders, WanFlowObjective
from opendit.families.wan.text import UMT5_SOURCE, load_umt5_encoder, umt5_encoder_dim
from opendit.families.wan.vae import VAE_PARAMS, load_wan_vae, wan_decode, wan_factors, wan_latent_shape, wan_posterior
from opendit.families.wan.weights import WAN_WEIGHTS
from opendit.options import opt
from opendit.perf import matmul_macs
from opendit.seeding import sampling_generator

# What each model implies beyond its architecture: the time shift of its training and sampling schedule, the
# sampling steps and guidance scale of Wan's generate.py, the frame rate of its videos and its VAE's latent
# channels (16: Wan2.1's VAE, 8x in space; 48: Wan2.2's, 16x). An A14B release is two experts of one architecture:
# the high-noise one denoises t >= boundary (guidance cfg_scale), the low-noise one the rest (cfg_scale_low).
_WAN21 = dict(flow_shift=5.0, sampling_steps=50, cfg_scale=5.0, fps=16, vae_channels=16)
_DEBUG = dict(flow_shift=1.0, sampling_steps=20, cfg_scale=8.0, fps=4)
WAN_CONSTANTS = {"Wan2.1-T2V-1.3B": _WAN21, "Wan2.1-T2V-14B": _WAN21, "Wan-debug": dict(_DEBUG, vae_channels=16),
                 "Wan2.2-T2V-A14B": dict(_WAN21, flow_shift=12.0, sampling_steps=40, cfg_scale=4.0, cfg_scale_low=3.0,
                                         boundary=0.875),
                 "Wan2.2-I2V-A14B": dict(_WAN21, sampling_steps=40, cfg_scale=3.5, cfg_scale_low=3.5, boundary=0.9),
                 "Wan2.2-TI2V-5B": dict(flow_shift=5.0, sampling_steps=50, cfg_scale=5.0, fps=24, vae_channels=48),
                 "Wan2.2-debug": dict(_DEBUG, vae_channels=48),
                 "Wan2.2-I2V-debug": dict(_DEBUG, vae_channels=16, cfg_scale_low=8.0, boundary=0.9)}
WAN_MODELS = {name: ModelSpec(name, "wan", WanModel, arch, WAN_CONSTANTS[name])
              for name, arch in {**WAN_CONFIGS, **WAN22_CONFIGS}.items() if name in WAN_CONSTANTS}
I2V_PROB = {"i2v": 1.0, "ti2v": 0.2}  # TI2V: the share the official training helper (utils.masks_like) conditions
EXPERTS = ("none", "high", "low", "both")
UMT5_HELP = "a local UMT5 encoder folder (UMT5EncoderModel + tokenizer, or a Wan diffusers folder with text_encoder/)"
SHIFT_HELP = "time shift s of the flow schedule, t -> s t / (1 + (s - 1) t); default: the model's (Wan2.1 5)"
SAMPLERS = ("unipc", "euler")


@dataclass(frozen=True)
class WanTrainOptions(ClipTrainOptions):
    umt5: str = opt("none", UMT5_HELP + ", required")
    flow_shift: float | None = opt(None, SHIFT_HELP, check="positive")
    timestep_sampling: str = opt("logit_normal", "training t ~ sigmoid(N(0, 1)) or uniform, then the time shift",
                                 TIMESTEP_SAMPLINGS)
    caption_dropout_prob: float = opt(0.1, "a caption's embedding is replaced by the empty caption's this often "
                                           "(for classifier-free guidance)", check="prob")
    i2v_prob: float | None = opt(None, "the share of clips trained image-to-video, conditioned on their own first "
                                       "frame (Wan2.2 TI2V and I2V models); default: I2V 1, TI2V 0.2 (the official "
                                       "training helper's)", check="prob")
    expert: str = opt("none", "a two-expert Wan2.2 A14B model: train its high-noise expert (t >= the boundary) or its "
                              "low-noise one (t below it) from that expert's weights, or both in one run (each "
                              "micro-batch one expert's, as likely as its share of the training times)", EXPERTS)
    expert_boundary: float | None = opt(None, "the t that splits the experts; default: the release's (T2V 0.875, I2V "
                                              "0.9)", check="prob")


@dataclass(frozen=True)
class WanSampleOptions(ClipSampleOptions, NegativePromptOption):
    umt5: str | None = opt(None, "UMT5 encoder folder; default: the checkpoint's", from_checkpoint=True)
    image: str | None = opt(None, "image-to-video (Wan2.2 TI2V and I2V models): the first frame, an image file for "
                                  "every prompt or a folder with one per prompt (in name order)")
    low_noise_ckpt: str | None = opt(None, "a two-expert Wan2.2 A14B model: the low-noise expert's checkpoint (--ckpt "
                                           "is the high-noise one's); default: the A14B folder's own low-noise expert")
    cfg_scale_low: float | None = opt(None, "the low-noise expert's guidance scale; default: the release's (T2V 3, "
                                            "I2V 3.5)")
    flow_shift: float | None = opt(None, SHIFT_HELP, check="positive")


@dataclass(frozen=True)
class WanCacheOptions(ClipCacheOptions):
    umt5: str = opt("none", "the UMT5 encoder folder whose token embeddings to cache")


def wan_forward_macs(model: nn.Module, video_tokens: int) -> int:
    """Multiply-accumulates of one forward pass for ONE clip of video_tokens patches: a Linear of the text path
    (text_embedding, cross-attention k and v) costs text_len * in * out, of the time path (time_embedding,
    time_projection) in * out, any other video_tokens * in * out (the patch conv: video_tokens * weight.numel());
    per block, self-attention 2 N^2 dim and cross-attention 2 N text_len dim."""
    text = model.text_len

    def rows_of(name: str) -> int:
        if name.startswith("time_"):
            return 1
        if name.startswith("text_embedding") or name.endswith(("cross_attn.k", "cross_attn.v")):
            return text
        return video_tokens
    attention = 2 * video_tokens * (video_tokens + text) * model.dim
    return matmul_macs(model, rows_of) + len(model.blocks) * attention


@dataclass
class WanSampler:
    name: str  # "unipc" or "euler"
    steps: int
    shift: float
    progress: bool = False  # a progress bar over the steps (sample.py sets it on rank 0)


def unipc_sample(velocity_fn, x: torch.Tensor, steps: int, shift: float, progress: bool = False) -> torch.Tensor:
    """Wan's default sampler: diffusers' UniPCMultistepScheduler in flow-prediction mode with flow sigmas shifted by
    `shift` (what WanPipeline and Wan's FlowUniPCMultistepScheduler run); velocity_fn(x, t [B] in [0, 1])."""
    from diffusers import UniPCMultistepScheduler  # lazy: diffusers is slow to import

    scheduler = UniPCMultistepScheduler(num_train_timesteps=1000, prediction_type="flow_prediction",
                                        use_flow_sigmas=True, flow_shift=shift)
    scheduler.set_timesteps(steps, device=x.device)
    x = x.float()
    for t in tqdm(scheduler.timesteps, desc="sampling", disable=not progress, mininterval=progress_interval()):
        t_vec = torch.full((x.shape[0],), float(t) / 1000, dtype=torch.float32, device=x.device)
        x = scheduler.step(velocity_fn(x, t_vec).float(), t, x).prev_sample
    return x


class WanFamily(ClipFamily, LatentImageFamily):
    name = "wan"
    title, weight_formats = "Wan2.1, Wan2.2", "official and diffusers folders"
    models = WAN_MODELS
    lora_targets = r"blocks\.\d+\.((self|cross)_attn\.[qkvo]|ffn\.[02])"  # attention and MLP Linears
    datasets = dataset_map(MOVING_DIGITS, VIDEO_CSV, LATENTS, *CLIP_STREAMS)
    samplers = SAMPLERS
    defaults_help = {"fps": "Wan: the model's (Wan2.1 16, Wan-debug 4)", "cfg_scale": "Wan2.1 5, Wan-debug 3",
                     "num_sampling_steps": "Wan2.1 50, Wan-debug 20",
                     "sampler": "Wan: unipc (default) or euler", "vae_scale": "Wan 1: its VAE normalises per channel"}
    cache_keys = (*ClipFamily.cache_keys, "umt5")
    encoder_folders = ("umt5", "vae")
    encoder_folders_hint = ("a Wan diffusers folder holds text_encoder/ + tokenizer/ and vae/: --umt5 DIR --vae "
                            "DIR/vae; --vae none for a pixel-space model")
    weights = WAN_WEIGHTS
    checkpoint_formats = ("an official Wan2.1 T2V folder or diffusion_pytorch_model*.safetensors",
                          "a diffusers Wan folder (transformer/)")
    train_options = WanTrainOptions
    sample_options = WanSampleOptions
    cache_options = WanCacheOptions
    cache_thresholds = {"teacache": 0.2, "fbcache": 0.2}  # benchmarks/README.md: Wan2.2 I2V digits, <= 2 points lost
    default_vae_scale = 1.0  # Wan's latents are normalised per channel by the VAE's own mean and std instead

    def patch_size(self, cfg) -> int:
        return self.models[cfg.model].arch["patch_size"][-1]

    def constant(self, model: str | None, key: str):
        spec = self.models.get(model) if model is not None else None
        return (spec or self.models["Wan2.1-T2V-1.3B"]).constants[key]

    def default_sampling_steps(self, cfg: WanTrainOptions) -> int:
        return self.constant(cfg.model, "sampling_steps")

    def sample_defaults(self, sample_cfg: WanSampleOptions, cfg: WanTrainOptions) -> dict:
        constants = self.models[cfg.model].constants
        return {**super().sample_defaults(sample_cfg, cfg), "cfg_scale": constants["cfg_scale"],
                "cfg_scale_low": constants.get("cfg_scale_low", constants["cfg_scale"]), "fps": constants["fps"],
                "flow_shift": cfg.flow_shift}

    # ---- configuration and data ---------------------------------------------------------------------------
    def fill_defaults(self, cfg):
        cfg = super().fill_defaults(cfg)
        kind, boundary = self.image_condition(cfg.model), self.models[cfg.model].constants.get("boundary")
        if cfg.i2v_prob and kind is None:
            raise ValueError(f"--i2v_prob {cfg.i2v_prob}: {cfg.model} is text-to-video only; image-to-video trains "
                             f"{', '.join(n for n in self.models if self.image_condition(n))}")
        if cfg.expert != "none" and boundary is None:
            raise ValueError(f"--expert {cfg.expert}: {cfg.model} is one model, not two experts; the two-expert models "
                             f"are {', '.join(n for n, s in self.models.items() if 'boundary' in s.constants)}")
        if cfg.expert == "both" and (cfg.lora_rank or cfg.blocks_to_swap):
            raise ValueError(f"--expert both with --{'lora_rank' if cfg.lora_rank else 'blocks_to_swap'}: it trains "
                             f"one expert per run; train the high-noise expert with --expert high and the low-noise "
                             f"one with --expert low")
        init_weights, two = cfg.init_weights, expert_folders(cfg.init_weights) if cfg.init_weights else None
        if two is not None:
            if cfg.expert == "none":
                raise ValueError(f"--init_weights {cfg.init_weights} holds two experts ({two['high'].name}/ for high "
                                 f"noise, {two['low'].name}/ for low): train one per run with --expert high or "
                                 f"--expert low, or both in one run with --expert both")
            boundary = two["boundary"] or boundary
            if cfg.expert != "both":  # one expert, from its own folder
                init_weights = str(two[cfg.expert])
        return dataclasses.replace(cfg, num_classes=0, init_weights=init_weights,
                                   flow_shift=cfg.flow_shift or self.constant(cfg.model, "flow_shift"),
                                   i2v_prob=I2V_PROB.get(kind, 0.0) if cfg.i2v_prob is None else cfg.i2v_prob,
                                   expert_boundary=cfg.expert_boundary or boundary)

    def image_condition(self, model: str) -> str | None:
        """"i2v" or "ti2v" for a model that takes a first frame (first_frame.py), else None."""
        return condition_kind(self.models[model].arch.get("model_type", "t2v"))

    def input_channels(self, model: str, channels: int) -> int:
        """The model's in_dim for latents of `channels`: an i2v model also takes 4 mask channels and the
        conditioning clip's latent."""
        return 2 * channels + 4 if self.image_condition(model) == "i2v" else channels

    def text_len(self, cfg) -> int:
        return self.models[cfg.model].arch["text_len"]

    def load_encoders(self, cfg: WanTrainOptions | WanCacheOptions, device, training: bool) -> WanEncoders:
        if training and self.dataset_spec(cfg).cache:  # everything is in the cache
            return WanEncoders(vae=None, text=None)
        if is_none(cfg.umt5):
            raise ValueError(f"{cfg.model} needs --umt5 <local folder> (a Wan diffusers folder holds it in "
                             f"text_encoder/ + tokenizer/); the demo makes a tiny one: RECIPE=wan_digits bash "
                             f"train_video.sh")
        text = load_umt5_encoder(cfg.umt5, device, self.text_len(cfg), encoder_dtype(device))
        if training:  # UMT5-XXL is sharded like the model's weights under the plugins that keep them sharded
            shard_frozen(text.model, text.model.encoder.block, cfg.plugin)
        return WanEncoders(vae=load_wan_vae(cfg.vae, device), text=text)

    def dataset_options(self, cfg: WanTrainOptions, encoders, spec) -> dict:
        if spec.cache:
            return {"seed": cfg.global_seed}
        return self.source_options(cfg, spec, channels=self.source_channels(cfg, encoders), seed=cfg.global_seed)

    def load_data(self, cfg: WanTrainOptions, encoders: WanEncoders):
        dataset, cfg = super().load_data(cfg, encoders)
        if self.dataset_spec(cfg).cache:
            if "umt5" not in dataset.embeddings:
                raise ValueError(f"latent cache {cfg.data_path!r} holds no UMT5 embeddings (not written with "
                                 f"preprocess.py --family wan); rebuild it with --family wan --umt5 ...")
            encoders.empty = dataset.extra("empty_umt5")
            if self.image_condition(cfg.model) == "i2v" and "first_frame" not in dataset.embeddings:
                raise ValueError(f"latent cache {cfg.data_path!r} holds no first-frame latents, which {cfg.model} "
                                 f"trains on; rebuild it with preprocess.py --family wan --model {cfg.model}")
        elif getattr(dataset, "kind", "caption") != "caption":
            raise ValueError(f"--dataset {cfg.dataset} {cfg.data_path or ''} has labels, not captions; Wan trains on "
                             f"captioned clips: a CSV with the header path,caption")
        return dataset, cfg

    # ---- model ---------------------------------------------------------------------------------------------
    def size_step(self, cfg, encoders) -> int:
        return (1 if encoders.vae is None else wan_factors(encoders.vae)[2]) * self.patch_size(cfg)

    def latent_shape(self, cfg: WanTrainOptions | WanCacheOptions, encoders, dataset=None,
                     data_channels=None) -> tuple[int, int, int, int]:
        """(C, T', h, w): from a cache, else from the frames, size and VAE (pixel space: the data's channels)."""
        cached = getattr(dataset, "latent_shape", None)
        if cached is not None:
            shape = tuple(cached)
        elif encoders.vae is not None:
            shape = wan_latent_shape(encoders.vae, cfg.num_frames, cfg.image_size, cfg.image_size)
        else:
            channels = getattr(dataset, "channels", None) or data_channels or self.pixel_channels(cfg)
            shape = (channels, cfg.num_frames, cfg.image_size, cfg.image_size)
        return self.check_patches(cfg, shape)

    def check_patches(self, cfg, shape):
        pt, ph, pw = self.models[cfg.model].arch["patch_size"]
        if shape[1] % pt or shape[2] % ph or shape[3] % pw:
            raise ValueError(f"{cfg.model} patches {pt}x{ph}x{pw} (frames x height x width) of its input, which "
                             f"does not divide {shape[1]}x{shape[2]}x{shape[3]}; change --num_frames / --image_size")
        return tuple(shape)

    def build_model(self, cfg: WanTrainOptions, latent_shape):
        return self._model(cfg, latent_shape, umt5_encoder_dim(cfg.umt5))

    def _model(self, cfg, latent_shape, text_dim: int | None = None):
        """The run's model (--expert both: an ExpertPair of two) for latents of latent_shape; text_dim: its UMT5's
        (None: the architecture's, UMT5-XXL's)."""
        channels = latent_shape[0]
        text = {} if text_dim is None else {"text_dim": text_dim}

        def expert():
            return self.models[cfg.model].build(in_dim=self.input_channels(cfg.model, channels), out_dim=channels,
                                                **text)
        model = ExpertPair(expert(), expert(), cfg.expert_boundary) if cfg.expert == "both" else expert()
        pt, ph, pw = model.patch_size
        model.num_tokens = latent_shape[1] // pt * (latent_shape[2] // ph) * (latent_shape[3] // pw)  # for FLOPs
        return model

    def train_flops_per_sample(self, model) -> float:
        """One expert's FLOPs (both experts in a run: each micro-batch runs one)."""
        expert = model.high if isinstance(model, ExpertPair) else model
        return 3 * 2 * float(wan_forward_macs(expert, model.num_tokens))

    def memory_probe(self, cfg: WanTrainOptions, device) -> MemoryProbe:
        """The model's VAE geometry (Wan2.1's: 16 channels, 4x in time, 8x in space; Wan2.2's: 48, 4x, 16x), the
        VAE's fp32 bytes (diffusers' AutoencoderKLWan) and UMT5-XXL's encoder, unless --vae none (pixel space, no
        encoders)."""
        if is_none(cfg.vae):
            return MemoryProbe(self.latent_shape(cfg, WanEncoders(vae=None, text=None)))
        z_dim = self.constant(cfg.model, "vae_channels")
        geometry = {"z_dim": z_dim, "scale_factor_spatial": 16 if z_dim == 48 else 8}
        shape = self.check_patches(cfg, wan_latent_shape(geometry, cfg.num_frames, cfg.image_size, cfg.image_size))
        return MemoryProbe(shape, {"UMT5-XXL encoder": encoder_dtype(device).itemsize * UMT5_SOURCE.params,
                                   "Wan VAE": 4 * VAE_PARAMS[z_dim]})

    def memory_model(self, cfg: WanTrainOptions, latent_shape):
        """build_model's model with UMT5-XXL's 4096-wide tokens (the architecture's text_dim)."""
        return self._model(cfg, latent_shape)

    def memory_inputs(self, cfg: WanTrainOptions, model, latent_shape, batch, device) -> dict:
        """x [B, C, F, H, W], t [B] in 0..1000 and UMT5 tokens [B, text_len, text_dim] (i2v: y, its mask and
        conditioning latent): the batched forward."""
        inputs = dict(x=torch.randn(batch, *latent_shape, device=device), t=torch.rand(batch, device=device) * 1000,
                      context=torch.randn(batch, model.text_len, model.text_dim, device=device))
        if model.model_type == "i2v":
            inputs["y"] = torch.randn(batch, model.in_dim - latent_shape[0], *latent_shape[1:], device=device)
        if isinstance(model, ExpertPair):  # a training micro-batch runs one expert
            inputs["expert"] = "high"
        return inputs

    def objective(self, cfg: WanTrainOptions, encoders: WanEncoders) -> WanFlowObjective:
        boundary = cfg.expert_boundary
        t_range = {"high": (boundary, 1.0), "low": (0.0, boundary)}.get(cfg.expert, (0.0, 1.0))
        return WanFlowObjective(encoders, cfg.flow_shift, cfg.timestep_sampling, cfg.caption_dropout_prob,
                                image=self.image_condition(cfg.model), image_prob=cfg.i2v_prob,
                                patch_size=self.models[cfg.model].arch["patch_size"], t_range=t_range,
                                boundary=boundary if cfg.expert == "both" else None, seed=cfg.global_seed)

    def load_weights(self, path: str) -> dict[str, torch.Tensor]:
        """A two-expert A14B folder: both experts', as an ExpertPair's (keys high.* and low.*)."""
        two = expert_folders(path)
        load = super().load_weights
        if two is None:
            return load(path)
        return {f"{side}.{k}": v for side in ("high", "low") for k, v in load(str(two[side])).items()}

    # ---- sampling ------------------------------------------------------------------------------------------
    def recognize_checkpoint(self, path: str):
        """An official Wan2.1 T2V or Wan2.2 folder (TI2V-5B, or an A14B release's two experts), or a diffusers Wan
        folder: the model from its config; a pipeline folder also names its VAE and UMT5."""
        p = Path(path)
        two = expert_folders(p)
        kind, config = wan_folder(two["high"] if two else p)
        if kind is None:
            return None
        found = (config.get("dim"), config.get("num_layers"), config.get("in_dim", 16))
        fits = [n for n, s in WAN_MODELS.items() if (s.arch["dim"], s.arch["num_layers"], s.arch.get("in_dim", 16))
                == found]  # Wan2.2-T2V-A14B's experts are Wan2.1-T2V-14B's shape: two of them say A14B
        name = next((n for n in fits if ("boundary" in WAN_MODELS[n].constants) == (two is not None)),
                    fits[0] if fits else None)
        settings = dict(dataset="video_csv", image_size=480, num_frames=81, num_classes=0)
        if two is not None:  # both experts, as --expert both trains them
            settings["expert"] = "both"
            if two["boundary"]:
                settings["expert_boundary"] = two["boundary"]
        if (p / "vae").is_dir():
            settings["vae"] = str(p / "vae")
        if (p / "text_encoder").is_dir():
            settings["umt5"] = str(p)
        return ({**settings, "model": name} if name else settings), None

    def sampling_parts(self, model):
        """Both experts of one checkpoint (an A14B folder, an --expert both run): the high-noise one samples first,
        the low-noise one is its companion."""
        return (model.high, {"low_noise": model.low}) if isinstance(model, ExpertPair) else (model, {})

    def companion_checkpoints(self, cfg: WanTrainOptions, sample_cfg: WanSampleOptions, weights: str) -> dict[str, str]:
        """A two-expert model's low-noise expert when --ckpt holds one expert: --low_noise_ckpt, else the high-noise
        expert's sibling folder in an A14B folder. None for a run trained on the whole schedule (one model samples
        all of it) or a checkpoint of both (sampling_parts)."""
        if "boundary" not in self.models[cfg.model].constants:
            if sample_cfg.low_noise_ckpt:
                raise ValueError(f"--low_noise_ckpt: {cfg.model} is one model, not two experts")
            return {}
        if cfg.expert == "both" and sample_cfg.low_noise_ckpt:
            raise ValueError(f"--low_noise_ckpt: --ckpt {weights} holds both experts; for another low-noise expert "
                             f"pass --ckpt the high-noise one's folder (an A14B folder's high_noise_model/)")
        if sample_cfg.low_noise_ckpt:
            return {"low_noise": sample_cfg.low_noise_ckpt}
        beside = expert_folders(Path(weights).parent)
        if beside is not None and Path(weights) == beside["high"]:
            return {"low_noise": str(beside["low"])}
        if cfg.expert == "both" or (beside is None and cfg.expert == "none"):
            return {}
        raise ValueError(f"{cfg.model} samples with two experts and --ckpt {weights} is one of them: --ckpt the "
                         f"high-noise expert's checkpoint (or the A14B folder) and --low_noise_ckpt the low-noise "
                         f"one's")

    def conditions(self, sample_cfg: WanSampleOptions, cfg: WanTrainOptions) -> list:
        """The prompts; checks --image against the model and their count."""
        prompts, kind = prompt_conditions(sample_cfg, cfg.model), self.image_condition(cfg.model)
        if sample_cfg.image is None:
            if kind == "i2v":
                raise ValueError(f"{cfg.model} is image-to-video: pass --image with the first frame (an image file, or "
                                 f"a folder with one per prompt)")
            return prompts
        if kind is None:
            raise ValueError(f"--image {sample_cfg.image}: {cfg.model} is text-to-video only; image-to-video samples "
                             f"{', '.join(n for n in self.models if self.image_condition(n))}")
        paths = image_paths(sample_cfg.image)
        if len(paths) > 1 and len(paths) != len(prompts):
            raise ValueError(f"--image {sample_cfg.image} holds {len(paths)} images for {len(prompts)} prompts: give "
                             f"one image per prompt, or a single image file for all")
        return prompts

    def make_sampler(self, sample_cfg: WanSampleOptions, cfg: WanTrainOptions) -> WanSampler:
        return WanSampler(sample_cfg.sampler, sample_cfg.num_sampling_steps, sample_cfg.flow_shift)

    def sample_shape(self, loaded, sample_cfg) -> tuple[int, ...]:
        """(C, T', h, w) of --num_frames clips of --height x --width pixels (defaults: the trained ones); RoPE
        positions come from the grid, so any whole patches work."""
        cfg, vae = loaded.cfg, loaded.encoders.vae
        height, width = self.sample_size(loaded, sample_cfg)
        frames = sample_cfg.num_frames or cfg.num_frames
        shape = wan_latent_shape(vae, frames, height, width) if vae is not None else \
            (loaded.latent_shape[0], frames, height, width)
        return self.check_patches(cfg, shape)

    @torch.no_grad()
    def sample_latents(self, loaded, sampler: WanSampler, indices, conditions, sample_cfg, device) -> torch.Tensor:
        """Latents [n, C, T', h, w] for global indices; noise from (seed, first index). With --image, TI2V's first
        latent frame is the image's and its tokens see t = 0 at every step; I2V's model takes the mask and the
        conditioning clip's latent, for the guided and the unguided pass alike."""
        enc, n = loaded.encoders, len(indices)
        experts = Experts(loaded, sample_cfg, device)
        z = torch.randn(n, *loaded.latent_shape, generator=sampling_generator(sample_cfg.seed, indices.start))
        context = enc.encode([conditions[i % len(conditions)] for i in indices], device)
        if experts.guided:  # [cond; uncond] in one pass, the second half with the negative prompt
            context = torch.cat([context, enc.encode([sample_cfg.negative_prompt], device).expand_as(context)])
        kind, first = self.image_condition(loaded.cfg.model), self.first_frames(loaded, sample_cfg, indices, conditions)
        first = None if first is None else first.to(device)
        given = torch.full((n,), first is not None, device=device)
        grid = tuple(s // p for s, p in zip(z.shape[2:], self.models[loaded.cfg.model].arch["patch_size"]))
        y = y_pair = None
        if kind == "i2v":  # no image (a training preview): the channels of a dropped image, zeros
            y = i2v_inputs(torch.zeros_like(z, device=device) if first is None else first, given)
            y_pair = torch.cat([y, y])

        def velocity(x, t):
            model, scale = experts.at(float(t[0]))
            if kind == "ti2v" and first is not None:
                x, t = with_first_frame(x, first, given), ti2v_timesteps(t, given, grid)
            if scale <= 1.0:
                return model(x, t * 1000, context[:n], y=y).float()
            out = model(torch.cat([x, x]), torch.cat([t, t]) * 1000, context, y=y_pair).float()
            return cfg_velocity(out[:n], out[n:], scale)

        z = z.to(device)
        if sampler.name == "euler":
            times = shift_times(torch.linspace(1, 0, sampler.steps + 1), sampler.shift)
            z = euler_sample(velocity, z, times, sampler.progress)
        else:
            z = unipc_sample(velocity, z, sampler.steps, sampler.shift, sampler.progress)
        return with_first_frame(z, first, given) if kind == "ti2v" and first is not None else z

    def first_frames(self, loaded, sample_cfg, indices, conditions) -> torch.Tensor | None:
        """--image as the model takes it, for samples `indices` (sample i: prompt i's image): TI2V the image's
        latent [n, C, 1, h, w], I2V the conditioning clip's latent [n, C, T', h, w]; None without --image."""
        cfg, vae, kind = loaded.cfg, loaded.encoders.vae, self.image_condition(loaded.cfg.model)
        if sample_cfg.image is None:
            return None
        paths = image_paths(sample_cfg.image)
        height, width = self.sample_size(loaded, sample_cfg)
        channels = 3 if vae is not None else loaded.latent_shape[0]
        images = torch.stack([load_first_frame(paths[i % len(conditions) % len(paths)], height, width, channels)
                              for i in indices])
        video = images[:, :, None] if kind == "ti2v" else condition_video(images, sample_cfg.num_frames or
                                                                          cfg.num_frames)
        return video if vae is None else wan_posterior(vae, video.to(next(vae.parameters()).device))[0].cpu()

    def decode(self, loaded, latents: torch.Tensor) -> torch.Tensor:
        vae = loaded.encoders.vae
        return latents.clamp(-1, 1) if vae is None else wan_decode(vae, latents, loaded.vae_decode)

    def sampling_encoders(self, cfg: WanTrainOptions, encoders: WanEncoders, device) -> WanEncoders:
        """Trained on a cache: the VAE to decode (the previews' prompts are already embedded)."""
        if encoders.vae is None and not is_none(cfg.vae):
            return dataclasses.replace(encoders, vae=load_wan_vae(cfg.vae, device))
        return encoders

    # ---- previews ------------------------------------------------------------------------------------------
    def preview_settings(self, cfg: WanTrainOptions) -> dict:
        return {"num_sampling_steps": min(self.default_sampling_steps(cfg), 20), "sampler": "unipc"}

    def preview_conditions(self, cfg: WanTrainOptions, dataset, rows: int) -> list:
        return preview_prompts(dataset, rows, cfg.model)

    def preview_encoders(self, cfg: WanTrainOptions, encoders: WanEncoders, conditions: list, dataset) -> WanEncoders:
        """The prompts' and the empty caption's UMT5 embeddings: encoded now, or read from a cache."""
        if encoders.text is not None:
            return dataclasses.replace(encoders, text=FixedEmbeddings.encode(encoders.text, [*conditions, ""]))
        index = {c: i for i, c in distinct_captions(dataset, len(conditions) * 4)}
        table = {c: dataset[index[c]][3].float() for c in conditions}  # ((mean, std), label, caption, umt5)
        empty = encoders.empty if encoders.empty is not None else dataset.extra("empty_umt5")
        return dataclasses.replace(encoders, text=FixedEmbeddings({**table, "": empty.float().cpu()}))

    # ---- caching -------------------------------------------------------------------------------------------
    def resolve_cache_config(self, cfg: WanCacheOptions):
        if cfg.model is not None and cfg.model not in self.models:
            raise ValueError(f"--model {cfg.model} is not a Wan model; valid: {', '.join(self.models)}")
        if cfg.model is None:
            raise ValueError("--model is required with --family wan: its text length sets the UMT5 tokens per "
                             f"caption; one of {', '.join(self.models)}")
        return super().resolve_cache_config(cfg)

    def cache_encoders(self, cfg: WanCacheOptions, device) -> WanEncoders:
        if is_none(cfg.umt5):
            raise ValueError("--umt5 is required with --family wan (a local UMT5 folder, or a Wan diffusers folder)")
        return WanEncoders(vae=load_wan_vae(cfg.vae, device),
                           text=load_umt5_encoder(cfg.umt5, device, self.text_len(cfg)),
                           first_frame=self.image_condition(cfg.model) == "i2v")

    def cache_source(self, cfg: WanCacheOptions, encoders):
        """(clip [3, T, H, W] in [-1, 1], label, caption) per item: one fixed clip per video."""
        spec = self.dataset_spec(cfg)
        dataset = spec(cfg.data_path, cfg.image_size, **self.source_options(cfg, spec, channels=3, seed=0))
        if cfg.buckets:
            self.use_buckets(dataset, cfg, encoders)
        return dataset

    @torch.no_grad()
    def cache_encode(self, encoders: WanEncoders, x, captions=None) -> dict:
        mean, std = wan_posterior(encoders.vae, x)
        out = {"mean": mean.cpu(), "std": std.cpu()}
        if captions is not None:
            out["umt5"] = encoders.encode(list(captions), "cpu")
        if encoders.first_frame:  # an i2v model's condition: the clip's first frame, then black, encoded
            out["first_frame"] = wan_posterior(encoders.vae, condition_video(x[:, :, 0], x.shape[2]))[0].cpu()
        return out

    def cache_extras(self, encoders: WanEncoders) -> dict:
        """The empty caption's embedding, stored once per cache (caption dropout while training)."""
        return {"empty_umt5": encoders.empty_embedding("cpu")}


def wan_folder(path: Path) -> tuple[str | None, dict]:
    """("diffusers", our config) for a diffusers Wan transformer folder or a pipeline folder holding transformer/;
    ("official", its config.json) for an official Wan2.1 folder (config.json + diffusion_pytorch_model*.safetensors);
    (None, {}) otherwise."""
    folder = WAN_WEIGHTS.diffusers_folder(path)
    if folder is not None:
        return "diffusers", WAN_WEIGHTS.arch_from_diffusers(read_config(folder))
    if WAN_WEIGHTS.is_official_folder(path):
        return "official", read_config(path)
    return None, {}
