"""adaLN-Zero transformer blocks shared by the DiT-style families (image DiT, video DiT) and the DiT size table.
Parameter names match the official DiT release."""
from itertools import islice

import torch.nn as nn

from opendit import kernels
from opendit.models.layers import Attention, Mlp
from opendit.models.step_cache import BlockLoop

# (depth, hidden, heads) by size name: the DiT paper's four, plus Ti (DeiT-Tiny widths) for CPU demos. The video
# DiTs (VDiT, Latte) use the same widths; Latte's depth counts its spatial and temporal blocks together.
DIT_SIZES = {"Ti": (12, 192, 3), "S": (12, 384, 6), "B": (12, 768, 12), "L": (24, 1024, 16), "XL": (28, 1152, 16)}

# Layers applied once per sample (to the condition vector c [B, D] or a pooled text embedding) rather than to every
# token, by the names the DiT-style models (DiT, VDiT, Latte) give them; FLOP counts take one row for these.
PER_SAMPLE_LAYERS = ("t_embedder", "adaLN_modulation", "text_embedder")


def is_per_sample_layer(name: str) -> bool:
    """Whether the module called `name` (a state_dict path) sits in a per-sample layer (PER_SAMPLE_LAYERS)."""
    return any(part.startswith(PER_SAMPLE_LAYERS) for part in name.split("."))


class AdaLNNorm(nn.Module):
    """LayerNorm without affine, then modulation: LN(x) * (1 + scale) + shift, scale and shift per sample [B, D]
    or per token [B, N, D]."""

    kernel_switches = {"use_modulate_kernel": ("modulate",), "use_layernorm_kernel": ("layernorm",)}

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.use_modulate_kernel = False
        self.use_layernorm_kernel = False

    def forward(self, x, shift, scale):
        if self.use_modulate_kernel:
            return kernels.layernorm_modulate(x, shift, scale, eps=self.eps, use_kernel=True)
        x = kernels.layer_norm(x, eps=self.eps, use_kernel=self.use_layernorm_kernel)
        if scale.dim() == 2:  # per sample
            scale, shift = scale.unsqueeze(1), shift.unsqueeze(1)
        return x * (1 + scale) + shift


class AdaLNZeroBlock(nn.Module):
    """DiT's block: attention and MLP, each behind an adaLN-modulated norm and a gated residual."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm1 = AdaLNNorm()
        self.attn = Attention(hidden_size, num_heads, qkv_bias=True)
        self.norm2 = AdaLNNorm()
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size, bias=True))

    def forward(self, x, c):
        """x [B, N, D] tokens (N may be this rank's chunk under sequence parallelism); c [B, D] condition."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        fused = self.norm1.use_modulate_kernel
        x = kernels.gated_residual(x, gate_msa, self.attn(self.norm1(x, shift_msa, scale_msa)), use_kernel=fused)
        x = kernels.gated_residual(x, gate_mlp, self.mlp(self.norm2(x, shift_mlp, scale_mlp)), use_kernel=fused)
        return x

    def modulated_input(self, x, c):
        """What attention reads, LN(x) * (1 + scale_msa) + shift_msa [B, N, D]: TeaCache's signal."""
        shift_msa, scale_msa = self.adaLN_modulation(c).chunk(6, dim=1)[:2]
        return self.norm1(x, shift_msa, scale_msa)

    def zero_init(self) -> None:
        """adaLN-Zero: the block starts as the identity."""
        nn.init.zeros_(self.adaLN_modulation[-1].weight)
        nn.init.zeros_(self.adaLN_modulation[-1].bias)


def adaln_block_loop(blocks: nn.ModuleList, c, sp) -> BlockLoop:
    """DiT's and VDiT's loop for opendit.models.step_cache: tokens [B, N, D] (this rank's chunk under sequence
    parallelism, whose group the caches all-reduce over) through blocks[start:stop], each modulated by c [B, D]."""
    def run(tokens, start=0, stop=None):
        for block in islice(blocks, start, stop):
            tokens = block(tokens, c)
        return tokens
    return BlockLoop(run, len(blocks), len(c), lambda tokens: blocks[0].modulated_input(tokens, c),
                     group=None if sp is None else sp.group)


class FinalLayer(nn.Module):
    """adaLN-modulated norm, then a linear map from tokens to patches of out_channels ([B, N, p*p*C])."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int):
        super().__init__()
        self.norm_final = AdaLNNorm()
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(self.norm_final(x, shift, scale))

    def zero_init(self) -> None:
        for layer in (self.adaLN_modulation[-1], self.linear):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
