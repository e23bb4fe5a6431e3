"""Latte (Ma et al. 2024, github.com/Vchitect/Latte models/latte.py): a video DiT whose blocks alternate spatial
attention (within each frame) and temporal attention (across frames at each spatial position).

Input x [B, C, T, H, W] (the official model takes [B, F, C, H, W]), t [B]; output [B, C_out, T, H, W]. Per-frame
2-D patches (Conv2d), a fixed 2-D sin-cos table pos_embed [1, S, D] added to every frame, a fixed 1-D table
temp_embed [1, T, D] added after the FIRST spatial block only, the condition c [B, D] repeated per frame for
spatial blocks and the final layer and per position for temporal blocks. state_dict keys and shapes equal the
official class-conditional checkpoints (tests/data/latte_xl2_ucf101_state_dict.tsv). The stored tables are those of
input_size; a clip of another frame count or size (H, W divisible by the patch) gets the sin-cos tables of its own.

Sequence parallel: DSP (opendit.parallel.dsp) -- spatial blocks on this rank's frames, one all-to-all to the
position split before each temporal block and one back after, the output frames gathered at the end.
"""
from functools import partial

import torch
import torch.nn as nn

from opendit.models.blocks import AdaLNZeroBlock, FinalLayer
from opendit.models.layers import PatchEmbed
from opendit.models.pos_embed import sincos_2d, sincos_temporal
from opendit.models.step_cache import BlockLoop, run_blocks
from opendit.families.video.vdit import VideoDiTBase
from opendit.parallel import ParallelPlan


class Latte(VideoDiTBase):
    """blocks[2k] is spatial, blocks[2k+1] temporal; depth counts both, so it must be even (28 for XL)."""

    parallel_plan = ParallelPlan(kinds=("dsp",), split=("frames (spatial blocks)", "positions (temporal blocks)"),
                                 replicated=("condition c",))

    def __init__(self, input_size=(16, 32, 32), patch_size=2, in_channels=4, hidden_size=1152, depth=28,
                 num_heads=16, mlp_ratio=4.0, class_dropout_prob=0.1, num_classes=1000, learn_sigma=True,
                 text_dim=None):
        super().__init__()
        frames, H, W = input_size = tuple(input_size)
        if H % patch_size or W % patch_size:
            raise ValueError(f"Latte input_size {input_size} (T, H, W): H and W must be divisible by patch_size "
                             f"{patch_size}; pad the latents or pick another patch")
        if depth % 2:
            raise ValueError(f"Latte depth {depth} must be even: blocks alternate spatial and temporal in pairs")
        self.grid = (H // patch_size, W // patch_size)  # (H', W'), S = H'·W' positions per frame
        self.x_embedder = PatchEmbed(patch_size, in_channels, hidden_size)
        self._add_conditioning(input_size, patch_size, in_channels, hidden_size, num_classes, class_dropout_prob,
                               learn_sigma, text_dim)
        # Frozen parameters (not buffers): the official checkpoints store them.
        self.pos_embed = nn.Parameter(torch.zeros(1, self.grid[0] * self.grid[1], hidden_size), requires_grad=False)
        self.temp_embed = nn.Parameter(torch.zeros(1, frames, hidden_size), requires_grad=False)
        self.blocks = nn.ModuleList([AdaLNZeroBlock(hidden_size, num_heads, mlp_ratio) for _ in range(depth)])
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        self.initialize_weights()

    def init_pos_tables(self):
        self.pos_embed.data.copy_(sincos_2d(self.hidden_size, *self.grid).unsqueeze(0))
        self.temp_embed.data.copy_(sincos_temporal(self.hidden_size, self.input_size[0]).unsqueeze(0))

    def attention_sequences(self):
        """Per attention layer, in block order: (sequences per sample, tokens per sequence). For perf.py."""
        frames, S = self.input_size[0], self.grid[0] * self.grid[1]
        return [(frames, S) if i % 2 == 0 else (S, frames) for i in range(len(self.blocks))]

    def pab_attention(self):
        """(attention layer, PAB kind) of every block: spatial blocks[2k], temporal blocks[2k+1]."""
        return [(block.attn, "temporal" if i % 2 else "spatial") for i, block in enumerate(self.blocks)]

    def unpatchify(self, x, h: int, w: int):
        """[B, T, S, p*p*C] of an h x w patch grid (S = h*w) -> [B, C, T, h*p, w*p]."""
        p, c = self.patch_size, self.out_channels
        x = x.reshape(*x.shape[:2], h, w, p, p, c).permute(0, 6, 1, 2, 4, 3, 5)  # [B, C, T, H', p, W', p]
        return x.reshape(x.shape[0], c, x.shape[2], h * p, w * p)

    def _pairs(self, tokens, start=0, stop=None, *, c, c_frame, dims):
        """Block pairs start..stop-1 (pair k: spatial blocks[2k], then temporal blocks[2k+1]) on this rank's frames'
        tokens [B*n_frames, S, D]; c [B, D], c_frame [B*n_frames, D], dims (B, n_frames, S, T)."""
        (B, n_frames, S, T), dsp = dims, self.sequence_parallel
        for i in range(2 * start, len(self.blocks) if stop is None else 2 * stop, 2):
            tokens = self.blocks[i](tokens, c_frame).view(B, n_frames, S, -1)  # spatial: attention within a frame
            if dsp is not None:
                tokens = dsp.to_positions(tokens)  # [B, T, S/P (padded), D]: all real frames, split positions
            per_pos = tokens.transpose(1, 2)  # [B, S', T, D]; S' = S, or S/P (padded) under DSP
            if i == 0:
                per_pos = per_pos + self.temporal_table(T, self.temp_embed, per_pos.dtype, tokens.device)  # [1, T, D]
            n_pos = per_pos.shape[1]
            per_pos = self.blocks[i + 1](per_pos.reshape(B * n_pos, per_pos.shape[2], -1),
                                         c.repeat_interleave(n_pos, dim=0))  # temporal: across frames
            tokens = per_pos.view(B, n_pos, -1, per_pos.shape[-1]).transpose(1, 2)  # [B, T, S', D]
            if dsp is not None:
                tokens = dsp.to_frames(tokens)  # [B, T/P, S, D]
            tokens = tokens.reshape(B * n_frames, S, -1)
        return tokens

    def forward(self, x, t, y=None, text=None):
        """x [B, C, T, H, W], t [B], y [B] or text [B, text_dim] -> [B, C_out, T, H, W]."""
        (T, h, w), B = self.check_input(x), x.shape[0]  # (frames, patch grid), S = h*w positions per frame
        S = h * w
        c = self.condition(t, y, text)  # [B, D]
        dsp = self.sequence_parallel
        frames = x.transpose(1, 2)  # [B, T, C, H, W]
        if dsp is not None:
            frames = dsp.split_frames(frames)  # this rank's [B, T/P (padded), C, H, W]
        n_frames = frames.shape[1]  # frames held here: T, or T/P under DSP
        tokens = self.x_embedder(frames.flatten(0, 1))  # [B*n_frames, S, D]
        tokens = tokens + self.spatial_table(h, w, self.pos_embed, tokens.dtype, x.device)
        c_frame = c.repeat_interleave(n_frames, dim=0)  # [B*n_frames, D]: each frame gets its sample's c
        loop = BlockLoop(partial(self._pairs, c=c, c_frame=c_frame, dims=(B, n_frames, S, T)), len(self.blocks) // 2,
                         B, lambda tokens: self.blocks[0].modulated_input(tokens, c_frame),
                         group=None if dsp is None else dsp.group, blocks_per_unit=2)
        tokens = run_blocks(self.step_cache, loop, tokens)
        out = self.final_layer(tokens, c_frame).view(B, n_frames, S, -1)  # [B, n_frames, S, p*p*C]
        if dsp is not None:
            out = dsp.gather_frames(out)  # [B, T, S, p*p*C] on every rank
        return self.unpatchify(out, h, w)
