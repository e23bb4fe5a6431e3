"""Video DiT (OpenDiT's VDiT): DiT's adaLN-Zero blocks with full attention over all T'·H'·W' tokens of a clip.

Input x [B, C, T, H, W] (the Conv3d layout), t [B]; output [B, C_out, T, H, W]. A 3-D patch embedding
(Conv3d, patch (pt, ph, pw)), fixed sin-cos positions split into a 2-D spatial table [1, S, D] and a 1-D
temporal one [1, T', D] (S = H'·W', T' = T/pt), summed per token as OpenDiT does. The stored tables are those of
input_size; a clip of another size (any T, H, W divisible by the patch) gets the sin-cos tables of its own grid.
`VideoDiTBase` holds what Latte (latte.py) shares: conditioning, classifier-free guidance, weight init.
"""
import math
from functools import partial

import torch
import torch.nn as nn

from opendit.models.blocks import AdaLNZeroBlock, FinalLayer, adaln_block_loop
from opendit.models.layers import Attention, LabelEmbedder, PatchEmbed3D, TimestepEmbedder
from opendit.models.pos_embed import GridTables, sincos_2d, sincos_temporal
from opendit.models.step_cache import run_blocks
from opendit.parallel import ParallelPlan


class VideoDiTBase(nn.Module):
    """What VDiT and Latte share. Conditioning c [B, D] = t_embedder(t) + one of
      - y_embedder(y): class labels [B] (num_classes > 0, text_dim None), dropped to the null class with
        probability class_dropout_prob while training (as DiT);
      - text_embedder(text): a pooled text embedding [B, text_dim] (text_dim set; the caller drops captions
        for guidance);
      - nothing (num_classes 0, text_dim None): unconditional.
    A subclass creates x_embedder, calls _add_conditioning, then its tables and blocks, then
    initialize_weights()."""

    _block_lists = ("blocks",)
    sequence_parallel = None  # the hook while tokens are split (opendit.parallel.enable_sequence_parallel)
    step_cache = None  # an opendit.models.step_cache cache while sampling with one (sample.py --cache)

    def _add_conditioning(self, input_size, patch_size, in_channels, hidden_size, num_classes, class_dropout_prob,
                          learn_sigma, text_dim):
        self.input_size = tuple(input_size)
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.learn_sigma = learn_sigma
        self.hidden_size = hidden_size
        self.text_dim = text_dim
        self.num_classes = 0 if text_dim else num_classes
        self.t_embedder = TimestepEmbedder(hidden_size)
        # sin-cos tables of grids other than input_size's (outside the state dict): [h*w, D] and [T', D]
        self.spatial_tables = GridTables(partial(sincos_2d, hidden_size))
        self.temporal_tables = GridTables(partial(sincos_temporal, hidden_size))
        if text_dim:
            self.text_embedder = nn.Linear(text_dim, hidden_size)
        elif num_classes > 0:
            self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)

    def condition(self, t, y=None, text=None):
        """t [B], y [B] labels or text [B, text_dim] (whichever the model was built for) -> c [B, D]."""
        c = self.t_embedder(t)
        if self.text_dim:
            if text is None or y is not None:
                raise ValueError(f"{type(self).__name__} was built with text_dim={self.text_dim}: pass text "
                                 f"[B, {self.text_dim}] (a pooled text embedding) and no y")
            return c + self.text_embedder(text)
        if self.num_classes:
            if y is None or text is not None:
                raise ValueError(f"{type(self).__name__} was built with num_classes={self.num_classes}: pass y "
                                 f"[B] labels (the null class {self.num_classes} for unconditional) and no text")
            return c + self.y_embedder(y, self.training)
        if y is not None or text is not None:
            raise ValueError(f"{type(self).__name__} is unconditional (num_classes=0, text_dim=None): pass neither "
                             f"y nor text, or build it with num_classes / text_dim")
        return c

    def check_input(self, x) -> tuple[int, int, int]:
        """x [B, in_channels, T, H, W], T, H, W multiples of the patch -> the patch grid (T', H', W')."""
        patch = self.patch_size if isinstance(self.patch_size, tuple) else (1, self.patch_size, self.patch_size)
        if x.dim() != 5 or x.shape[1] != self.in_channels or any(s % p for s, p in zip(x.shape[2:], patch)):
            raise ValueError(f"{type(self).__name__} takes x [B, {self.in_channels}, T, H, W] with T, H, W "
                             f"multiples of its patch {patch} (pt, ph, pw), got {tuple(x.shape)}")
        return tuple(s // p for s, p in zip(x.shape[2:], patch))

    def spatial_table(self, h: int, w: int, stored: torch.Tensor, dtype, device) -> torch.Tensor:
        """[1, h*w, D]: the stored table when (h, w) is input_size's grid, else the h x w sin-cos table."""
        if (h, w) == tuple(self.grid[-2:]):  # the stored grid: VDiT's (T', H', W'), Latte's (H', W')
            return stored.to(dtype)
        return self.spatial_tables.get(h, w, device=device, dtype=dtype).unsqueeze(0)

    def temporal_table(self, frames: int, stored: torch.Tensor, dtype, device) -> torch.Tensor:
        """[1, frames, D]: the stored table when it has that many frames, else the sin-cos table of frames."""
        if frames == stored.shape[1]:
            return stored.to(dtype)
        return self.temporal_tables.get(frames, device=device, dtype=dtype).unsqueeze(0)

    def init_pos_tables(self):
        """Fill the fixed sin-cos tables (subclass)."""
        raise NotImplementedError

    def initialize_weights(self):
        """DiT's init: xavier Linears, the patch conv as a Linear, N(0, 0.02) label table and timestep MLP,
        sin-cos tables, adaLN-Zero (every block and the final layer start as the identity / zero)."""
        def _basic_init(module):
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

        self.apply(_basic_init)
        self.init_pos_tables()
        w = self.x_embedder.proj.weight.data
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)
        if hasattr(self, "y_embedder"):
            nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        for block in self.blocks:
            block.zero_init()
        self.final_layer.zero_init()

    def forward_with_cfg(self, x, t, cfg_scale: float, y=None, text=None, cfg_channels: int | None = None):
        """Classifier-free guidance. x holds [cond half; uncond half] (the second half's y is the null class, its
        text the empty caption's embedding). Guidance acts on the eps channels (the first `cfg_channels`,
        default all in_channels); the conditional half's learned-variance channels are kept, as DiT does."""
        half = x[: len(x) // 2]
        out = self(torch.cat([half, half]), t, y=y, text=text)  # __call__: input/output hooks (dtype casts) run
        n = self.in_channels if cfg_channels is None else cfg_channels
        eps, rest = out[:, :n], out[:, n:]
        cond_eps, uncond_eps = eps.chunk(2)
        half_eps = uncond_eps + cfg_scale * (cond_eps - uncond_eps)
        return torch.cat([torch.cat([half_eps, half_eps]), rest], dim=1)


class VDiT(VideoDiTBase):
    """OpenDiT's VDiT. Sequence parallel: FastSeq or Ulysses over all T'·S tokens."""

    parallel_plan = ParallelPlan(attention=(Attention,), split=("video tokens (all frames' patches)",),
                                 replicated=("condition c",))

    def __init__(self, input_size=(16, 32, 32), patch_size=(1, 2, 2), in_channels=4, hidden_size=1152, depth=28,
                 num_heads=16, mlp_ratio=4.0, class_dropout_prob=0.1, num_classes=1000, learn_sigma=True,
                 text_dim=None):
        super().__init__()
        input_size, patch_size = tuple(input_size), tuple(patch_size)
        if len(input_size) != 3 or len(patch_size) != 3 or any(s % p for s, p in zip(input_size, patch_size)):
            raise ValueError(f"VDiT input_size {input_size} (T, H, W) must be divisible by patch_size {patch_size} "
                             f"(pt, ph, pw) in every dimension; pad the latents or pick another patch")
        self.grid = tuple(s // p for s, p in zip(input_size, patch_size))  # (T', H', W')
        self.x_embedder = PatchEmbed3D(patch_size, in_channels, hidden_size)
        self._add_conditioning(input_size, patch_size, in_channels, hidden_size, num_classes, class_dropout_prob,
                               learn_sigma, text_dim)
        frames, h, w = self.grid
        # Frozen parameters (not buffers), as OpenDiT stores them.
        self.pos_embed_spatial = nn.Parameter(torch.zeros(1, h * w, hidden_size), requires_grad=False)
        self.pos_embed_temporal = nn.Parameter(torch.zeros(1, frames, hidden_size), requires_grad=False)
        self.blocks = nn.ModuleList([AdaLNZeroBlock(hidden_size, num_heads, mlp_ratio) for _ in range(depth)])
        # FinalLayer(patch 1) emits pt*ph*pw*C_out values per token.
        self.final_layer = FinalLayer(hidden_size, 1, math.prod(patch_size) * self.out_channels)
        self.initialize_weights()

    def init_pos_tables(self):
        D, (frames, h, w) = self.hidden_size, self.grid
        self.pos_embed_spatial.data.copy_(sincos_2d(D, h, w).unsqueeze(0))
        self.pos_embed_temporal.data.copy_(sincos_temporal(D, frames).unsqueeze(0))

    def attention_sequences(self):
        """Per attention layer, in block order: (sequences per sample, tokens per sequence). For perf.py."""
        frames, h, w = self.grid
        return [(1, frames * h * w)] * len(self.blocks)

    def pab_attention(self):
        """(attention layer, PAB kind) of every block: full attention over T'·S tokens counts as spatial, the kind
        recomputed most often."""
        return [(block.attn, "spatial") for block in self.blocks]

    def embed(self, x):
        """x [B, C, T, H, W] -> tokens [B, T'·S, D] with spatial + temporal positions, (t, s) order."""
        B, (frames, h, w) = x.shape[0], self.check_input(x)
        tokens = self.x_embedder(x).view(B, frames, h * w, -1)  # "b (t s) d -> b t s d"
        spatial = self.spatial_table(h, w, self.pos_embed_spatial, tokens.dtype, x.device)
        temporal = self.temporal_table(frames, self.pos_embed_temporal, tokens.dtype, x.device)
        tokens = tokens + spatial.unsqueeze(1)  # [1, 1, S, D]: every frame
        tokens = tokens + temporal.unsqueeze(2)  # [1, T', 1, D]: every position
        return tokens.flatten(1, 2)

    def unpatchify(self, x, grid: tuple[int, int, int]):
        """[B, T'·S, pt*ph*pw*C] of a (T', H', W') patch grid -> [B, C, T, H, W]."""
        (frames, h, w), (pt, ph, pw) = grid, self.patch_size
        x = x.reshape(x.shape[0], frames, h, w, pt, ph, pw, self.out_channels)
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)  # [B, C, T', pt, H', ph, W', pw]
        return x.reshape(x.shape[0], self.out_channels, frames * pt, h * ph, w * pw)

    def forward(self, x, t, y=None, text=None):
        """x [B, C, T, H, W], t [B], y [B] or text [B, text_dim] -> [B, C_out, T, H, W]."""
        tokens, c = self.embed(x), self.condition(t, y, text)
        sp = self.sequence_parallel
        if sp is not None:
            tokens = sp.split(tokens)  # [B, N, D] -> this rank's [B, ceil(N/P), D]
        tokens = run_blocks(self.step_cache, adaln_block_loop(self.blocks, c, sp), tokens)
        out = self.final_layer(tokens, c)
        if sp is not None:
            out = sp.gather(out)  # -> [B, N, pt*ph*pw*C] on every rank
        return self.unpatchify(out, self.check_input(x))
