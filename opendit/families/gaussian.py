"""What the Gaussian-diffusion families (image DiT, video DiT, a test's toy model) share on top of latent images:
IDDPM training (DiffusionObjective), DDPM / DDIM sampling with classifier-free guidance on class labels, the null
class of an unconditional batch half, and reading an official DiT-layout `.pt` (DiT, Latte) by its shapes. A
family built on it adds its registry, how its model is built from the latent shape, and its FLOP count.
"""
import dataclasses
from dataclasses import dataclass

import torch

from opendit.diffusion import SAMPLERS, GaussianSampler
from opendit.diffusion.objective import DiffusionObjective
from opendit.families.latent import LatentImageFamily, is_none
from opendit.options import opt
from opendit.seeding import sampling_generator


@dataclass(frozen=True)
class GaussianTrainOptions:
    learn_sigma: bool = opt(True, "the model also predicts the variance (DiT's IDDPM hybrid loss); false: fixed "
                                  "variance, MSE only")
    class_dropout_prob: float = opt(0.1, "labels replaced by the null class (captions by the empty one) this "
                                         "often, for classifier-free guidance", check="prob")


@dataclass(frozen=True)
class GaussianSampleOptions:
    learn_sigma: bool | None = opt(None, "default: the checkpoint's", from_checkpoint=True)
    ddim_eta: float = opt(0.0, "DDIM noise; 0: deterministic", check="nonneg")


def official_shapes(state: dict) -> dict:
    """What an official DiT-layout state dict (DiT's or Latte's release) tells by its tensor shapes: depth
    (attention layers), hidden size, patch, the latent side, input channels, classes (label-embedding rows - 1;
    0 without one: an unconditional release) and whether the model learns its variance."""
    hidden, patch = state["pos_embed"].shape[-1], state["x_embedder.proj.weight"].shape[-1]
    in_channels = state["x_embedder.proj.weight"].shape[1]
    labels = state.get("y_embedder.embedding_table.weight")
    return dict(depth=sum(1 for k in state if k.endswith(".attn.qkv.weight")), hidden_size=hidden, patch_size=patch,
                latent_side=int(state["pos_embed"].shape[1] ** 0.5) * patch, in_channels=in_channels,
                num_classes=labels.shape[0] - 1 if labels is not None else 0,
                learn_sigma=state["final_layer.linear.weight"].shape[0] == 2 * in_channels * patch * patch)


class GaussianDiffusionFamily(LatentImageFamily):
    samplers = SAMPLERS
    class_conditional = True  # False: no labels reach the model, no guidance
    train_options = GaussianTrainOptions
    sample_options = GaussianSampleOptions
    # the attention and MLP Linears of the adaLN-Zero blocks (opendit.models.blocks) DiT, VDiT and Latte share
    lora_targets = r"blocks\.\d+\.(attn\.(qkv|proj)|mlp\.fc[12])"

    @property
    def sampling_needs(self) -> tuple[str, ...]:
        return ("image_size",) + (("num_classes",) if self.class_conditional else ())

    # ---- configuration and data ---------------------------------------------------------------------------
    def dataset_options(self, cfg: GaussianTrainOptions, encoders, spec) -> dict:
        if spec.cache:
            return {"seed": cfg.global_seed}
        return {"channels": 3} if encoders.vae is not None and spec.channels != 3 else {}  # grey digits -> RGB

    def data_settings(self, cfg, dataset):
        """The class count: the data's when not given; fewer than the data has is an error."""
        found = dataset.num_classes
        if cfg.num_classes is None:
            return dataclasses.replace(cfg, num_classes=found)
        if self.class_conditional and cfg.num_classes < found:
            raise ValueError(f"--num_classes {cfg.num_classes} is fewer than the {found} classes of --dataset "
                             f"{cfg.dataset}; leave it out (the data's count is used) or pass at least {found}")
        return cfg

    def objective(self, cfg: GaussianTrainOptions, encoders) -> DiffusionObjective:
        return DiffusionObjective(encoders.vae, cfg.vae_scale, cfg.learn_sigma, labels=self.class_conditional)

    def memory_inputs(self, cfg: GaussianTrainOptions, model, latent_shape, batch, device) -> dict:
        """x [B, *latent], t [B] and labels y [B] or a pooled text vector [B, text_dim] (video with --clip)."""
        kw = dict(x=torch.randn(batch, *latent_shape, device=device), t=torch.randint(0, 1000, (batch,), device=device))
        if getattr(model, "text_dim", None):
            kw["text"] = torch.randn(batch, model.text_dim, device=device)
        elif getattr(model, "num_classes", 0):
            kw["y"] = torch.randint(0, model.num_classes, (batch,), device=device)
        return kw

    # ---- sampling ------------------------------------------------------------------------------------------
    def conditions(self, sample_cfg: GaussianSampleOptions, cfg: GaussianTrainOptions) -> list:
        if not self.class_conditional:
            if sample_cfg.class_labels:
                raise ValueError(f"--class_labels: {cfg.model} is unconditional; leave them out")
            return [None]
        labels = sample_cfg.class_labels or list(range(cfg.num_classes))
        bad = [c for c in labels if not 0 <= c < cfg.num_classes]
        if bad:
            raise ValueError(f"--class_labels {bad} out of range 0..{cfg.num_classes - 1}")
        return labels

    def make_sampler(self, sample_cfg: GaussianSampleOptions, cfg: GaussianTrainOptions) -> GaussianSampler:
        # pixel-space models know their data lies in [-1, 1]: clamping x_0 keeps an early model from diverging
        return GaussianSampler(sample_cfg.sampler, sample_cfg.num_sampling_steps, cfg.learn_sigma,
                               eta=sample_cfg.ddim_eta, clip_denoised=is_none(cfg.vae))

    @torch.no_grad()
    def sample_latents(self, loaded, sampler, indices, conditions, sample_cfg, device) -> torch.Tensor:
        """The sampler's output for global indices: float32 [n, *latent_shape] on device. Noise comes from a
        generator seeded by (seed, first index), so a batch is the same on any rank."""
        model = loaded.model
        gen = sampling_generator(sample_cfg.seed, indices.start)
        n = len(indices)
        z = torch.randn(n, *loaded.latent_shape, generator=gen).to(device)
        kwargs = self.condition_inputs(loaded, [conditions[i % len(conditions)] for i in indices], device)
        net = model  # model(...), not model.forward: input/output hooks (dtype casts) must run
        if kwargs and sample_cfg.cfg_scale > 1.0:  # [cond; uncond] halves, the second with the null condition
            null = self.null_inputs(loaded, n, device)
            z = torch.cat([z, z])
            kwargs = {**{k: torch.cat([v, null[k]]) for k, v in kwargs.items()}, "cfg_scale": sample_cfg.cfg_scale}
            net = model.forward_with_cfg

        def fn(x, t, **kw):  # the sampler's math stays fp32 whatever the model's dtype
            return net(x, t, **kw).float()
        return sampler(fn, z, kwargs, device=device, generator=gen)[:n].float()

    def condition_inputs(self, loaded, picked: list, device) -> dict:
        """The model's keyword inputs for one condition per sample ({} when unconditional)."""
        if not self.class_conditional:
            return {}
        return {"y": torch.tensor(picked, device=device)}

    def null_inputs(self, loaded, n: int, device) -> dict:
        """The unconditional inputs of classifier-free guidance: the null class."""
        return {"y": torch.full((n,), loaded.cfg.num_classes, device=device)}

    # ---- previews ------------------------------------------------------------------------------------------
    def preview_settings(self, cfg: GaussianTrainOptions) -> dict:
        return {"sampler": "ddim", "num_sampling_steps": 50, "ddim_eta": 0.0}  # deterministic, quick

    def preview_conditions(self, cfg: GaussianTrainOptions, dataset, rows: int) -> list:
        if self.class_conditional and cfg.num_classes:
            return list(range(min(rows, cfg.num_classes)))
        return [None]

    # ---- caching -------------------------------------------------------------------------------------------
    def cache_dataset_options(self, cfg, spec) -> dict:
        return {"channels": 3} if spec.channels != 3 else {"random_flip": False}  # grey digits become RGB
