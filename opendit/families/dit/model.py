"""Class-conditional DiT (Peebles & Xie, 2023) with adaLN-Zero blocks.

state_dict keys and shapes equal the official release, so DiT-XL-2-256x256.pt loads with strict=True.
"""
from functools import partial

import torch
import torch.nn as nn

from opendit.models.blocks import AdaLNZeroBlock, FinalLayer, adaln_block_loop
from opendit.models.layers import Attention, LabelEmbedder, PatchEmbed, TimestepEmbedder
from opendit.models.pos_embed import GridTables, sincos_2d
from opendit.models.step_cache import run_blocks
from opendit.parallel import ParallelPlan

class DiT(nn.Module):
    # Attribute names of the nn.ModuleLists holding repeated blocks; the booster wraps these one by one.
    _block_lists = ("blocks",)
    parallel_plan = ParallelPlan(attention=(Attention,), split=("image tokens",), replicated=("condition c",))
    sequence_parallel = None  # the hook while tokens are split (opendit.parallel.enable_sequence_parallel)
    step_cache = None  # an opendit.models.step_cache cache while sampling with one (sample.py --cache)

    def __init__(self, input_size=32, patch_size=2, in_channels=4, hidden_size=1152, depth=28, num_heads=16,
                 mlp_ratio=4.0, class_dropout_prob=0.1, num_classes=1000, learn_sigma=True):
        super().__init__()
        if input_size % patch_size:
            raise ValueError(f"input size {input_size} is not divisible by patch size {patch_size}")
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.learn_sigma = learn_sigma
        self.patch_size = patch_size
        self.input_size = input_size
        self.num_classes = num_classes
        self.x_embedder = PatchEmbed(patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        num_patches = (input_size // patch_size) ** 2
        # A frozen parameter (not a buffer) so the key matches the official checkpoint.
        # It is the table of the square input_size grid; other grids (aspect-ratio buckets, sampling at another
        # size) get theirs from pos_tables, outside the state dict.
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, hidden_size), requires_grad=False)
        self.pos_tables = GridTables(partial(sincos_2d, hidden_size))
        self.blocks = nn.ModuleList([AdaLNZeroBlock(hidden_size, num_heads, mlp_ratio) for _ in range(depth)])
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        self.initialize_weights()

    def initialize_weights(self):
        def _basic_init(module):
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

        self.apply(_basic_init)
        grid = int(self.pos_embed.shape[1] ** 0.5)
        self.pos_embed.data.copy_(sincos_2d(self.pos_embed.shape[-1], grid).unsqueeze(0))
        w = self.x_embedder.proj.weight.data
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        for block in self.blocks:  # adaLN-Zero: every block starts as the identity
            block.zero_init()
        self.final_layer.zero_init()

    def unpatchify(self, x, h: int, w: int):
        """[B, N, p*p*C] of an h x w patch grid (N = h*w) -> [B, C, h*p, w*p]."""
        c, p = self.out_channels, self.patch_size
        x = x.reshape(x.shape[0], h, w, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(x.shape[0], c, h * p, w * p)

    def patch_grid(self, x) -> tuple[int, int]:
        """The (h, w) patch grid of x [B, C, H, W]; any H and W that are multiples of the patch size."""
        (H, W), p = x.shape[-2:], self.patch_size
        if H % p or W % p:
            raise ValueError(f"DiT input {H}x{W} is not divisible by its patch size {p}; pad or crop the latents")
        return H // p, W // p

    def pos_table(self, h: int, w: int, dtype, device) -> torch.Tensor:
        """[1, h*w, D]: the stored pos_embed for the square input_size grid (official weights), else the h x w
        sin-cos table."""
        if h == w == self.input_size // self.patch_size:
            return self.pos_embed.to(dtype)
        return self.pos_tables.get(h, w, device=device, dtype=dtype).unsqueeze(0)

    def embed(self, x, t, y):
        """x [B, C, H, W], t [B], y [B] -> tokens [B, N, D] (N = H*W/p^2) and condition [B, D]."""
        tokens = self.x_embedder(x) + self.pos_table(*self.patch_grid(x), x.dtype, x.device)
        c = self.t_embedder(t) + self.y_embedder(y, self.training)
        return tokens, c

    def forward(self, x, t, y):
        tokens, c = self.embed(x, t, y)
        sp = self.sequence_parallel
        if sp is not None:
            tokens = sp.split(tokens)  # [B, N, D] -> this rank's [B, ceil(N/P), D]
        tokens = run_blocks(self.step_cache, adaln_block_loop(self.blocks, c, sp), tokens)
        out = self.final_layer(tokens, c)
        if sp is not None:
            out = sp.gather(out)  # -> [B, N, p*p*C] on every rank
        return self.unpatchify(out, *self.patch_grid(x))

    def forward_with_cfg(self, x, t, y, cfg_scale: float, cfg_channels: int | None = None):
        """Classifier-free guidance. x holds [cond half; uncond half] (the second half's y is the null class).

        Guidance is applied to the eps channels (the first `cfg_channels`, default all in_channels; the official
        DiT sampler used 3 of 4 latent channels) and the learned-variance channels of the conditional half are kept.
        """
        half = x[: len(x) // 2]
        out = self(torch.cat([half, half]), t, y)  # through __call__: input/output hooks (dtype casts) run
        n = self.in_channels if cfg_channels is None else cfg_channels
        eps, rest = out[:, :n], out[:, n:]
        cond_eps, uncond_eps = eps.chunk(2)
        half_eps = uncond_eps + cfg_scale * (cond_eps - uncond_eps)
        return torch.cat([torch.cat([half_eps, half_eps]), rest], dim=1)
