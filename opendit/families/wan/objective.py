"""What Wan trains on: its encoders (UMT5 and the VAE, or a cache's stand-ins) and its flow-matching objective,
with Wan2.2's image-to-video conditioning (first_frame.py) and one expert's share of the schedule."""
from dataclasses import dataclass

import torch
import torch.nn as nn

from opendit.diffusion.flow import RectifiedFlow, shift_times
from opendit.diffusion.sampling import randn
from opendit.encoders.vae import posterior_sample
from opendit.families.wan.first_frame import condition_video, i2v_inputs, ti2v_timesteps, with_first_frame
from opendit.families.wan.vae import wan_posterior
from opendit.seeding import mix_seed


@dataclass
class WanEncoders:
    vae: nn.Module | None  # None: pixel space, or training on a cache
    text: object | None  # UMT5 (a TokenTextEncoder, or FixedEmbeddings); None when training on a cache
    empty: torch.Tensor | None = None  # the empty caption's embedding [L, D]
    first_frame: bool = False  # caching for an i2v model: also the latent of each clip's conditioning clip

    def encode(self, captions: list[str], device) -> torch.Tensor:
        """captions -> UMT5 embeddings [B, L, D] float32 on device, zero after each caption's tokens."""
        return self.text(captions).float().to(device)

    def empty_embedding(self, device) -> torch.Tensor:
        if self.empty is None:
            self.empty = self.encode([""], "cpu")[0]
        self.empty = self.empty.to(device)  # kept there: later steps copy nothing
        return self.empty


class WanFlowObjective:
    """Flow matching as Wan is trained: x_t = (1 - t) x0 + t eps, the model (fed 1000 t) predicts eps - x0, MSE in
    fp32; t drawn from --timestep_sampling and shifted by --flow_shift, within t_range (one expert's share of the
    schedule). A batch is (clips [B, C, T, H, W] in
    [-1, 1], labels, captions) or a cached one ((mean, std) [B, z, T', h, w], labels, captions, UMT5 [B, L, D][,
    the i2v conditioning clip's latent]); a latent is mean + std * randn of the normalised posterior either way, so
    a cache trains as encoding on the fly does.

    Image-to-video (image "i2v" or "ti2v", first_frame.py): a share image_prob of the clips (all in validation when
    it is above 0) is conditioned on its own first frame; ti2v's loss leaves out the given first latent frame.

    Both experts of a two-expert model in training (boundary given, the model an ExpertPair): each micro-batch is
    one expert's (next_expert), its times drawn on that expert's side of the boundary."""

    def __init__(self, encoders: WanEncoders, shift: float, timestep_sampling: str, dropout: float,
                 image: str | None = None, image_prob: float = 0.0, patch_size=(1, 2, 2), t_range=(0.0, 1.0),
                 boundary: float | None = None, seed: int = 0):
        self.encoders, self.shift, self.dropout = encoders, shift, dropout
        self.image, self.image_prob, self.patch_size, self.t_range = image, image_prob, patch_size, tuple(t_range)
        self.flow = RectifiedFlow(timestep_sampling, shift=False)
        self.boundary, self.seed, self.step, self.micro = boundary, seed, 0, 0

    def begin_step(self, step: int) -> None:
        """The Trainer starts training step `step` (its micro-batches follow)."""
        self.step, self.micro = step, 0

    def next_expert(self) -> str:
        """With both experts: the next training micro-batch's, "high" or "low", as likely as a training time on its
        side of the boundary; drawn from (seed, step, micro-batch) alone, so every rank (a sharded plugin gathers
        one expert) and a resumed run draw the same."""
        generator = torch.Generator().manual_seed(mix_seed(self.seed, self.step, self.micro))
        self.micro += 1
        t = shift_times(self.flow.sample_t(1, generator=generator), self.shift)
        return "high" if float(t) >= self.boundary else "low"

    def _latents(self, x, device):
        if isinstance(x, (list, tuple)):
            mean, std = (t.to(device, non_blocking=True) for t in x)
        elif self.encoders.vae is not None:
            mean, std = wan_posterior(self.encoders.vae, x.to(device, non_blocking=True))
        else:
            return x.to(device, non_blocking=True)
        return posterior_sample(mean, std)

    def first_latent(self, batch, device) -> torch.Tensor:
        """The i2v conditioning clip's latent [B, C, T', h, w]: cached, or encoded from each clip's first frame."""
        if len(batch) == 5:
            return batch[4].to(device).float()
        clips = batch[0].to(device, non_blocking=True)
        video = condition_video(clips[:, :, 0], clips.shape[2])
        return video if self.encoders.vae is None else wan_posterior(self.encoders.vae, video)[0]

    def prepare(self, batch, device, train: bool = True):
        context = batch[3].to(device).float() if len(batch) >= 4 else self.encoders.encode(list(batch[2]), device)
        cond = {}
        if self.image:  # drawn before x: same on every SP rank, and no draw at all for text-to-video
            conditioned = torch.rand(len(context)) < self.image_prob if train else \
                torch.full((len(context),), self.image_prob > 0)
            cond = {"y": i2v_inputs(self.first_latent(batch, device), conditioned)} if self.image == "i2v" else \
                {"first": conditioned.to(device)}
        x = self._latents(batch[0], device)
        drop = (torch.rand(len(context)) < (self.dropout if train else 0.0)).to(device)  # same on SP ranks
        context = torch.where(drop[:, None, None], self.encoders.empty_embedding(device), context)
        return x, {"context": context, **cond}

    def sample_t(self, batch: int, device, t_range=None) -> torch.Tensor:
        """Shifted training times [B]; an expert's are drawn until B fall in its t_range (default: the
        objective's; the distribution's shape kept within the range, as musubi-tuner's
        --preserve_distribution_shape)."""
        low, high = t_range or self.t_range
        kept = []
        for _ in range(10_000):
            t = shift_times(self.flow.sample_t(batch, device), self.shift)
            if (low, high) == (0.0, 1.0):
                return t
            kept.append(t[(t >= low) & (t <= high)])
            if sum(map(len, kept)) >= batch:
                return torch.cat(kept)[:batch]
        raise ValueError(f"training times in [{low}, {high}] almost never occur under --timestep_sampling and "
                         f"--flow_shift {self.shift}; move --expert_boundary")

    def losses(self, model, x, cond: dict, t_frac=None, noise=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-sample loss [B] fp32, t [B]); t_frac / noise given: used as they are (validation, no shift)."""
        route = {}  # both experts: the micro-batch's
        if t_frac is not None:
            t = t_frac.to(x.device, torch.float32)
        elif self.boundary is None:
            t = self.sample_t(x.shape[0], x.device)
        else:
            route["expert"] = self.next_expert()
            side = (self.boundary, 1.0) if route["expert"] == "high" else (0.0, self.boundary)
            t = self.sample_t(x.shape[0], x.device, side)
        if "first" not in cond:  # text-to-video, or i2v (its condition rides in y)
            return self.flow.losses(lambda x_t, t: model(x_t, t * 1000, cond["context"], y=cond.get("y"), **route),
                                    x, t, noise), t
        if noise is None:
            noise = randn(x.shape, None, x.device, x.dtype)
        first = cond["first"]
        x_t = with_first_frame(self.flow.noisy(x, t, noise), x[:, :, :1], first)
        grid = tuple(s // p for s, p in zip(x.shape[2:], self.patch_size))
        pred = model(x_t, ti2v_timesteps(t, first, grid) * 1000, cond["context"], **route).float()
        weight = torch.ones_like(pred[:1, :1]).expand(len(x), 1, *pred.shape[2:]).clone()
        weight[first, :, 0] = 0  # the given frame is no prediction
        error = (pred - self.flow.target(x, noise)).pow(2) * weight
        return error.flatten(1).sum(1) / (weight.flatten(1).sum(1) * pred.shape[1]), t
