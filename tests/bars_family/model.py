"""BarsDiT: a small video DiT from opendit's shared layers; full attention over all T·h·w tokens, a caption's
vector added to the timestep's. It declares its parallel plan; it writes no switch."""
import torch
import torch.nn as nn

from opendit.models.blocks import AdaLNZeroBlock, FinalLayer
from opendit.models.layers import Attention, PatchEmbed3D, TimestepEmbedder
from opendit.models.pos_embed import sincos_2d
from opendit.parallel import ParallelPlan


class BarsDiT(nn.Module):
    """x [B, C, T, h, w], t [B], text [B, text_dim] -> [B, 2C or C, T, h, w]."""
    _block_lists = ("blocks",)
    parallel_plan = ParallelPlan(attention=(Attention,), split=("video tokens",), replicated=("condition",))
    sequence_parallel = None

    def __init__(self, in_channels, depth, hidden_size, num_heads, patch_size, text_dim, learn_sigma=True):
        super().__init__()
        self.in_channels, self.patch_size, self.hidden_size = in_channels, patch_size, hidden_size
        self.out_channels = in_channels * (2 if learn_sigma else 1)
        self.x_embedder = PatchEmbed3D((1, patch_size, patch_size), in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.text_embedder = nn.Linear(text_dim, hidden_size)
        self.blocks = nn.ModuleList(AdaLNZeroBlock(hidden_size, num_heads) for _ in range(depth))
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)

    def forward(self, x, t, text):
        b, _, frames, h, w = x.shape
        g = (h // self.patch_size, w // self.patch_size)
        pos = sincos_2d(self.hidden_size, *g).to(x)  # the same table for every frame
        tokens = self.x_embedder(x) + pos.repeat(frames, 1)[None]
        c = self.t_embedder(t) + self.text_embedder(text)
        sp = self.sequence_parallel
        if sp is not None:
            tokens = sp.split(tokens)
        for block in self.blocks:
            tokens = block(tokens, c)
        out = self.final_layer(tokens, c)
        if sp is not None:
            out = sp.gather(out)
        p, co = self.patch_size, self.out_channels
        out = out.view(b, frames, *g, p, p, co)
        return torch.einsum("bthwpqc->bcthpwq", out).reshape(b, co, frames, h, w)

    def forward_with_cfg(self, x, t, text, cfg_scale: float):
        """x holds [cond half; uncond half] (the second half's text is the empty caption's)."""
        half = x[: len(x) // 2]
        out = self(torch.cat([half, half]), t, text)
        eps, rest = out[:, :self.in_channels], out[:, self.in_channels:]
        cond, uncond = eps.chunk(2)
        guided = uncond + cfg_scale * (cond - uncond)
        return torch.cat([torch.cat([guided, guided]), rest], dim=1)
