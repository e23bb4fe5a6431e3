"""Wan2.1 / Wan2.2 transformer (the Wan team's WanModel, Apache-2.0): a DiT over 3-D patches of video latents
that cross-attends to umT5 text embeddings.

The math and the state_dict (keys and shapes) equal the official `wan/modules/model.py` WanModel of Wan2.1
(model_type "t2v") and of Wan2.2 ("t2v", "i2v", "ti2v"), so the released Wan2.1-T2V-1.3B / -14B, Wan2.2-TI2V-5B
and each expert of Wan2.2-T2V-A14B / -I2V-A14B load with strict=True (tests/data/wan2*_state_dict.tsv;
weights.WanWeights reads the single and the sharded safetensors). Constructor arguments are the official config's.
Wan2.2 adds two inputs: timesteps per token (t [B, L]: the time embedding and every modulation are then per
token, as TI2V's clean first frame needs) and, for "i2v", the conditioning channels y (mask + first-frame latent)
concatenated to x before the patch embedding.

    x [C, F, H, W] per sample --patch_embedding (Conv3d, stride patch_size)--> tokens [L, dim], L = f*h*w
    t [B] in 0..1000 --float64 sinusoid--> time_embedding --> e [B, dim] --time_projection--> e0 [B, 6, dim]
    context [L_i, text_dim] per caption, zero-padded to text_len --text_embedding--> [B, text_len, dim]
    blocks: self-attention (q/k RMSNorm over all of dim, 3-axis RoPE), cross-attention to the text, FFN; the
            self-attention and FFN behind adaLN modulated by e0 + the block's `modulation`
    head:   adaLN (e + head.modulation) -> Linear -> patches [L, prod(patch_size) * out_dim] -> unpatchify

Two forwards run the same blocks: the official one on lists (samples of different sizes, padded to seq_len
tokens whose padding is masked out as keys) and a batched one on tensors for training (one size, no padding).
Cross-attention attends every one of the text_len positions, as released: a caption's padding positions are
attended as text_embedding(0).

Precision, as released: the modulation, norms and residual stream are fp32 (the stream turns fp32 at the first
gated residual), RoPE is applied in float64, and every Linear runs in its weights' dtype (or under autocast). The
RoPE table is complex128, which FSDP's mixed-precision input cast leaves alone (it casts real floats only).

Kernel switches (opendit.kernels.set_kernels; each layer's `kernel_switches`): modulate=True runs the fused
LayerNorm + modulation (norm1, norm2, the head) and the gated residuals; layernorm=True the LayerNorm kernel where
not fused (and in the affine cross-attention norm3); either switch runs the q/k RMSNorm kernel (not FastSeq's
group-wide one, below). RoPE has no kernel here: the fp32 one would not be the official float64 math (torch.compile
leaves its complex ops to eager kernels, with a warning). Attention goes through opendit.kernels.attention
(`attn_backend`); the padding mask of the list forward makes "flash" fall back to SDPA for those calls.

Sequence parallelism (`parallel_plan`, applied by opendit.parallel.enable_sequence_parallel): the video tokens are
split over the P ranks after the patch embedding and gathered after the head; cross-attention (local queries, the
whole text) and everything else is per token. Self-attention: Ulysses projects q, k, v of its chunk, applies the
full-width q/k RMSNorm and the RoPE of its chunk's positions in the sequence layout, then one all-to-all to
head-parallel; FastSeq projects this rank's heads over the whole sequence (sp.to_heads) and normalises them with the
sum of squares over all heads (each rank's share all-gathered, [B, L] per norm), then applies RoPE there. The list
forward with padded samples is not supported under SP (use the tensor forward). Weight gradients follow
opendit.parallel: the group MEAN equals the unsplit gradient.

Initialisation: the official init_weights (xavier-uniform linears with zero biases, the patch embedding xavier on
its flattened weight, N(0, 0.02) text and time embeddings, a zero head) and N(0, 1/dim) modulations.
"""
import math
from functools import partial
from itertools import islice

import torch
import torch.nn as nn

from opendit import kernels
from opendit.kernels.attention import attention
from opendit.models.blocks import AdaLNNorm
from opendit.models.layers import linear_weight
from opendit.models.step_cache import BlockLoop, run_blocks
from opendit.parallel import ParallelPlan, all_to_all, gather_seq, pad_dim

_WAN_BASE = dict(model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=16, freq_dim=256, text_dim=4096,
                 out_dim=16, window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6)
# Constructor kwargs: the official Wan2.1 configs, and a CPU-sized one for tests and demos.
WAN_CONFIGS = {
    "Wan2.1-T2V-1.3B": dict(_WAN_BASE, dim=1536, ffn_dim=8960, num_heads=12, num_layers=30),
    "Wan2.1-T2V-14B": dict(_WAN_BASE, dim=5120, ffn_dim=13824, num_heads=40, num_layers=40),
    "Wan-debug": dict(_WAN_BASE, patch_size=(1, 4, 4), dim=128, ffn_dim=512, freq_dim=64, num_heads=4, num_layers=4,
                      text_len=16, text_dim=32),
}
# Wan2.2's releases: each A14B expert is Wan2.1-14B's architecture (I2V: 36 input channels = 16 noisy latent + 4
# mask + 16 first-frame latent); TI2V-5B works on the Wan2.2 VAE's 48 channels.
WAN22_CONFIGS = {
    "Wan2.2-T2V-A14B": dict(WAN_CONFIGS["Wan2.1-T2V-14B"]),
    "Wan2.2-I2V-A14B": dict(WAN_CONFIGS["Wan2.1-T2V-14B"], model_type="i2v", in_dim=36),
    "Wan2.2-TI2V-5B": dict(_WAN_BASE, model_type="ti2v", in_dim=48, out_dim=48, dim=3072, ffn_dim=14336,
                           num_heads=24, num_layers=30),
    "Wan2.2-debug": dict(WAN_CONFIGS["Wan-debug"], model_type="ti2v", patch_size=(1, 2, 2), in_dim=48, out_dim=48),
    "Wan2.2-I2V-debug": dict(WAN_CONFIGS["Wan-debug"], model_type="i2v", in_dim=36),
}
MODEL_TYPES = ("t2v", "i2v", "ti2v")


def modulation(table: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A modulation table [1, k, dim] plus e per sample [B, k, dim] or per token [B, n, k, dim], in fp32 -> its k
    rows, each [B, dim] or [B, n, dim]."""
    if e.dim() == table.dim():
        return (table.float() + e.float()).unbind(1)
    return (table.float().unsqueeze(1) + e.float()).unbind(2)


# ------------------------------------------------------------------------------------------- embeddings
def sinusoidal_embedding(dim: int, t: torch.Tensor) -> torch.Tensor:
    """Timesteps t [N] -> [N, dim] float64: cat(cos, sin) of t * 10000^(-j / half), j < half = dim / 2."""
    half = dim // 2
    t = t.to(torch.float64)
    sinusoid = torch.outer(t, torch.pow(10000, -torch.arange(half, dtype=torch.float64, device=t.device).div(half)))
    return torch.cat([sinusoid.cos(), sinusoid.sin()], dim=1)


def rope_freqs(grid, head_dim: int, theta: float = 10000, device=None) -> torch.Tensor:
    """RoPE of the tokens of a (f, h, w) patch grid, in token order -> complex128 [f*h*w, head_dim / 2].

    A head's head_dim / 2 pairs are split c - 2(c//3), c//3, c//3 (c = head_dim / 2) over the frame, row and
    column axes; pair j of an axis with d_a real dims rotates by position * theta^(-2j / d_a) (float64), the
    official 1024-position tables' rows."""
    d = head_dim
    tables = []
    for n, dim in zip(grid, (d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6))):
        omega = 1.0 / torch.pow(theta, torch.arange(0, dim, 2, dtype=torch.float64, device=device).div(dim))
        angles = torch.outer(torch.arange(n, dtype=torch.float64, device=device), omega)
        tables.append(torch.polar(torch.ones_like(angles), angles))
    f, h, w = grid
    ft, fh, fw = tables
    return torch.cat([ft[:, None, None].expand(f, h, w, -1), fh[None, :, None].expand(f, h, w, -1),
                      fw[None, None].expand(f, h, w, -1)], dim=-1).reshape(f * h * w, -1)


def rope_apply(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [B, L, H, Dh]: each adjacent pair (x[2j], x[2j+1]) of every head, as the complex number x[2j] + i x[2j+1],
    times freqs [L, Dh/2] (shared by the batch) or [B, L, Dh/2] (complex128), in float64; returned in x's dtype."""
    xc = torch.view_as_complex(x.to(torch.float64).unflatten(-1, (-1, 2)))
    return torch.view_as_real(xc * freqs.unsqueeze(-2)).flatten(-2).type_as(x)


# ----------------------------------------------------------------------------------------------- layers
class WanRMSNorm(nn.Module):
    """RMSNorm over the last dim (all heads of q or k): x * rsqrt(mean(x^2) + eps) * weight in fp32, returned in
    x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.use_kernel = False

    kernel_switches = {"use_kernel": ("modulate", "layernorm")}  # see opendit.kernels.set_kernels

    def forward(self, x):
        return kernels.rms_norm(x, self.weight, self.eps, use_kernel=self.use_kernel)


class WanLayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32, returned in x's dtype (with an affine: the cross-attention's norm3)."""

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = False):
        super().__init__(dim, eps=eps, elementwise_affine=elementwise_affine)
        self.use_kernel = False

    kernel_switches = {"use_kernel": ("layernorm",)}

    def forward(self, x):
        w, b = (None, None) if self.weight is None else (self.weight.float(), self.bias.float())
        return kernels.layer_norm(x.float(), w, b, self.eps, use_kernel=self.use_kernel).type_as(x)


class WanSelfAttention(nn.Module):
    """q, k, v, o Linear(dim, dim) with biases; norm_q / norm_k RMSNorm over all of dim, before the head split."""

    kernel_switches = {"attn_backend": kernels.ATTENTION_BACKEND}

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = True, eps: float = 1e-6):
        super().__init__()
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = WanRMSNorm(dim, eps) if qk_norm else nn.Identity()
        self.norm_k = WanRMSNorm(dim, eps) if qk_norm else nn.Identity()
        self.attn_backend = "sdpa"
        self.sequence_parallel = None  # the model's SequenceParallel hook while tokens are split

    def forward(self, x, freqs, mask=None):
        """x [B, n, dim] (this rank's chunk under SP); freqs the RoPE of x's tokens [n, Dh/2] or [B, n, Dh/2]
        (FastSeq: of the whole padded sequence); mask bool [B, 1, 1, n] (True: a real key) or None -> [B, n, dim]."""
        sp = self.sequence_parallel
        x = x.to(self.q.weight.dtype)
        if sp is not None and sp.kind == "fastseq":
            return self.o(sp.attend(*self._fastseq_heads(x, freqs, sp), self.attn_backend).transpose(1, 2).flatten(2))
        q, k, v = (t.unflatten(-1, (self.num_heads, self.head_dim))
                   for t in (self.norm_q(self.q(x)), self.norm_k(self.k(x)), self.v(x)))  # [B, n, H, Dh]
        q, k = rope_apply(q, freqs), rope_apply(k, freqs)
        if sp is None:
            out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, self.attn_backend)
        else:  # Ulysses: sequence-split, all heads -> this rank's heads, all tokens
            qkv = all_to_all(torch.stack((q, k, v), 2), sp.group, scatter_dim=3, gather_dim=1, counter=sp.counter,
                             site="ulysses")
            out = sp.attend(*qkv.permute(2, 0, 3, 1, 4), self.attn_backend)
        return self.o(out.transpose(1, 2).flatten(2))

    def _fastseq_heads(self, x, freqs, sp):
        """FastSeq: this rank's chunk [B, n, dim] -> q, k (normed, rotated), v [B, H/P, nP, Dh]."""
        weight = torch.cat([linear_weight(self.q), linear_weight(self.k), linear_weight(self.v)])
        bias = torch.cat([self.q.bias, self.k.bias, self.v.bias])
        q, k, v = sp.to_heads(x, weight, bias, self.num_heads)
        q, k = (rope_apply(self._group_norm(t, norm, sp).transpose(1, 2), freqs).transpose(1, 2)
                for t, norm in ((q, self.norm_q), (k, self.norm_k)))
        return q, k, v

    def _group_norm(self, x, norm, sp):
        """The full-width RMSNorm of x [B, h, L, Dh], this rank's h heads: the sum of squares over all heads is
        this rank's share summed over the group."""
        if isinstance(norm, nn.Identity):
            return x
        h, xf = x.shape[1], x.float()
        ss = gather_seq(xf.pow(2).sum((1, 3))[None], sp.group, dim=0, counter=sp.counter, site="qk_norm").sum(0)
        weight = norm.weight.view(-1, self.head_dim)[sp.rank * h:(sp.rank + 1) * h].float()
        return (xf * torch.rsqrt(ss / self.dim + norm.eps)[:, None, :, None] * weight[:, None]).to(x.dtype)


class WanCrossAttention(WanSelfAttention):
    """Video tokens attend to every text position: no mask, no RoPE, no communication under SP."""

    def forward(self, x, context):
        """x [B, n, dim] video tokens, context [B, text_len, dim] embedded text -> [B, n, dim]."""
        x, context = x.to(self.q.weight.dtype), context.to(self.q.weight.dtype)
        q, k, v = (t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
                   for t in (self.norm_q(self.q(x)), self.norm_k(self.k(context)), self.v(context)))
        return self.o(attention(q, k, v, backend=self.attn_backend).transpose(1, 2).flatten(2))


class WanAttentionBlock(nn.Module):
    """adaLN self-attention, cross-attention behind norm3, adaLN FFN; `modulation` [1, 6, dim] is added to e0."""

    def __init__(self, dim: int, ffn_dim: int, num_heads: int, qk_norm: bool = True, cross_attn_norm: bool = True,
                 eps: float = 1e-6):
        super().__init__()
        self.norm1 = AdaLNNorm(eps)
        self.self_attn = WanSelfAttention(dim, num_heads, qk_norm, eps)
        self.norm3 = WanLayerNorm(dim, eps, elementwise_affine=True) if cross_attn_norm else nn.Identity()
        self.cross_attn = WanCrossAttention(dim, num_heads, qk_norm, eps)
        self.norm2 = AdaLNNorm(eps)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim))
        self.modulation = nn.Parameter(torch.empty(1, 6, dim))

    def forward(self, x, e0, freqs, context, mask=None):
        """x [B, n, dim], e0 [B, 6, dim] (or per token [B, n, 6, dim]), context [B, text_len, dim]; freqs, mask as
        WanSelfAttention's."""
        shift1, scale1, gate1, shift2, scale2, gate2 = modulation(self.modulation, e0)
        fused = self.norm1.use_modulate_kernel
        y = self.self_attn(self.norm1(x.float(), shift1, scale1), freqs, mask)
        x = kernels.gated_residual(x, gate1, y, use_kernel=fused)
        x = x + self.cross_attn(self.norm3(x), context)
        y = self.ffn(self.norm2(x.float(), shift2, scale2).to(self.ffn[0].weight.dtype))
        return kernels.gated_residual(x, gate2, y, use_kernel=fused)

    def modulated_input(self, x, e0):
        """What self-attention reads, norm1 modulated by e0 -> [B, n, dim] fp32: TeaCache's signal."""
        shift1, scale1 = modulation(self.modulation, e0)[:2]
        return self.norm1(x.float(), shift1, scale1)


class Head(nn.Module):
    """adaLN (e + modulation [1, 2, dim]) then Linear(dim, prod(patch_size) * out_dim)."""

    def __init__(self, dim: int, out_dim: int, patch_size, eps: float = 1e-6):
        super().__init__()
        self.norm = AdaLNNorm(eps)
        self.head = nn.Linear(dim, math.prod(patch_size) * out_dim)
        self.modulation = nn.Parameter(torch.empty(1, 2, dim))

    def forward(self, x, e):
        """x [B, n, dim], e [B, dim] (or per token [B, n, dim]) -> [B, n, prod(patch_size) * out_dim]."""
        shift, scale = modulation(self.modulation, e.unsqueeze(-2))
        return self.head(self.norm(x.float(), shift, scale).to(self.head.weight.dtype))


# ------------------------------------------------------------------------------------------------ model
class WanModel(nn.Module):
    """The Wan transformer; arguments are the official config's (WAN_CONFIGS and WAN22_CONFIGS hold the releases')."""

    _block_lists = ("blocks",)
    parallel_plan = ParallelPlan(attention=(WanSelfAttention,), split=("video tokens", "their RoPE angles"),
                                 replicated=("text context", "time embedding"), heads="num_heads")
    sequence_parallel = None  # the SequenceParallel hook while tokens are split
    step_cache = None  # an opendit.models.step_cache cache while sampling with one (sample.py --cache)

    def __init__(self, model_type: str = "t2v", patch_size=(1, 2, 2), text_len: int = 512, in_dim: int = 16,
                 dim: int = 2048, ffn_dim: int = 8192, freq_dim: int = 256, text_dim: int = 4096, out_dim: int = 16,
                 num_heads: int = 16, num_layers: int = 32, window_size=(-1, -1), qk_norm: bool = True,
                 cross_attn_norm: bool = True, eps: float = 1e-6):
        super().__init__()
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; valid: {', '.join(MODEL_TYPES)} (Wan2.2's "
                             f"speech-to-video 's2v' adds audio inputs opendit does not have)")
        if tuple(window_size) != (-1, -1):
            raise ValueError(f"window_size {tuple(window_size)} is not supported: only global attention (-1, -1), "
                             f"as every released Wan2.1 model uses")
        if dim % num_heads or (dim // num_heads) % 2:
            raise ValueError(f"dim {dim} must split into {num_heads} heads of an even size (RoPE rotates pairs)")
        self.model_type = model_type
        self.patch_size, self.text_len, self.in_dim, self.out_dim = tuple(patch_size), text_len, in_dim, out_dim
        self.dim, self.freq_dim, self.text_dim, self.num_heads = dim, freq_dim, text_dim, num_heads
        self.patch_embedding = nn.Conv3d(in_dim, dim, kernel_size=self.patch_size, stride=self.patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim))
        self.time_embedding = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim * 6))
        self.blocks = nn.ModuleList([WanAttentionBlock(dim, ffn_dim, num_heads, qk_norm, cross_attn_norm, eps)
                                     for _ in range(num_layers)])
        self.head = Head(dim, out_dim, self.patch_size, eps)
        self.init_weights()

    def init_weights(self):
        """The official init_weights, and N(0, 1/dim) modulations (the official constructor's randn / sqrt(dim))."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, (WanAttentionBlock, Head)):
                nn.init.normal_(m.modulation, std=self.dim ** -0.5)
        nn.init.xavier_uniform_(self.patch_embedding.weight.flatten(1))
        for layer in (*self.text_embedding, *self.time_embedding):
            if isinstance(layer, nn.Linear):
                nn.init.normal_(layer.weight, std=0.02)
        nn.init.zeros_(self.head.head.weight)

    # --------------------------------------------------------------------------------------- forward
    def forward(self, x, t, context, seq_len: int | None = None, y=None):
        """The official forward on lists, or the batched one on tensors.

        Lists: x [C, F, H, W] latents (sizes may differ), t [B] in 0..1000 (or per token [B, seq_len]), context
        [L_i, text_dim] umT5 outputs (L_i <= text_len, zero-padded here), seq_len >= every sample's f*h*w tokens,
        y (i2v) [C_y, F, H, W] each -> [out_dim, F, H, W] each.
        Tensors: x [B, C, F, H, W], t [B] (or per token [B, f*h*w]), context [B, text_len, text_dim] already
        zero-padded past each caption's tokens (umT5's outputs at padding tokens are not zeros), y (i2v) [B, C_y, F,
        H, W] -> [B, out_dim, F, H, W].
        y, the i2v model's conditioning channels (mask and first-frame latent), joins x's channels before the patch
        embedding (C + C_y = in_dim). Outputs are fp32.
        """
        if (y is None) == (self.model_type == "i2v"):
            wants = "y, the conditioning channels (mask + first-frame latent)" if y is None else \
                "no y (only an i2v model has conditioning channels)"
            raise ValueError(f"the {self.model_type} model takes {wants}")
        if torch.is_tensor(x):
            return self._forward_batch(x if y is None else torch.cat([x, y], 1), t, context)
        return self._forward_list(x if y is None else [torch.cat([u, v]) for u, v in zip(x, y)], t, context, seq_len)

    def _forward_batch(self, x, t, context):
        B = x.shape[0]
        if x.ndim != 5 or t.shape[:1] != (B,) or t.ndim > 2 or tuple(context.shape) != (B, self.text_len,
                                                                                        self.text_dim):
            raise ValueError(f"the tensor forward takes x [B, C, F, H, W], t [B] (or per token [B, f*h*w]) and "
                             f"context [B, text_len={self.text_len}, text_dim={self.text_dim}]; got {tuple(x.shape)}, "
                             f"{tuple(t.shape)}, {tuple(context.shape)} (zero-pad each caption's embedding to "
                             f"text_len)")
        tokens, grid = self._embed(x)
        freqs = rope_freqs(grid, self.dim // self.num_heads, device=x.device)
        out = self._transformer(tokens, t, context, freqs)
        return self._unpatchify(out, grid).float()

    def _forward_list(self, x, t, context, seq_len):
        if len(context) != len(x) or t.shape[:1] != (len(x),) or t.ndim > 2:
            raise ValueError(f"{len(x)} latents need {len(x)} captions and t of shape [{len(x)}] (or per token "
                             f"[{len(x)}, seq_len]); got {len(context)} captions and t {tuple(t.shape)}")
        embedded = [self._embed(u[None]) for u in x]
        lens = [tokens.shape[1] for tokens, _ in embedded]
        if seq_len is None or seq_len < max(lens):
            raise ValueError(f"seq_len {seq_len} is below the largest sample's {max(lens)} tokens (f*h*w of its "
                             f"patch grid); pass seq_len >= {max(lens)}")
        for c in context:
            if c.ndim != 2 or c.shape[0] > self.text_len or c.shape[1] != self.text_dim:
                raise ValueError(f"a caption's embedding has shape {tuple(c.shape)}; expected [L <= text_len="
                                 f"{self.text_len}, text_dim={self.text_dim}] (truncate long captions to text_len)")
        tokens = torch.cat([pad_dim(u, seq_len, 1) for u, _ in embedded])
        head_dim = self.dim // self.num_heads
        freqs = torch.stack([pad_dim(rope_freqs(g, head_dim, device=tokens.device), seq_len, 0) for _, g in embedded])
        mask = None
        if min(lens) < seq_len:  # padded tokens are no keys
            mask = torch.arange(seq_len, device=tokens.device) < torch.tensor(lens, device=tokens.device)[:, None]
            mask = mask[:, None, None, :]
        context = torch.stack([pad_dim(c, self.text_len, 0) for c in context])
        out = self._transformer(tokens, t, context, freqs, mask)
        return [self._unpatchify(o[None, :n], g)[0].float() for o, n, (_, g) in zip(out, lens, embedded)]

    def _embed(self, x):
        """Latents [B, C, F, H, W] -> tokens [B, f*h*w, dim] and the patch grid (f, h, w)."""
        if x.shape[1] != self.in_dim or any(s % p for s, p in zip(x.shape[2:], self.patch_size)):
            raise ValueError(f"latents of shape {tuple(x.shape[1:])} do not fit the model: expected [in_dim="
                             f"{self.in_dim}, F, H, W] with F, H, W multiples of patch_size {self.patch_size}")
        x = self.patch_embedding(x.to(self.patch_embedding.weight.dtype))
        return x.flatten(2).transpose(1, 2).contiguous(), tuple(x.shape[2:])  # contiguous: see PatchEmbed

    def _transformer(self, x, t, context, freqs, mask=None):
        """Tokens x [B, L, dim], t [B] (or per token [B, L]), context [B, text_len, text_dim], freqs [L, Dh/2] or
        [B, L, Dh/2], mask [B, 1, 1, L] or None -> patches [B, L, prod(patch_size) * out_dim]."""
        if t.ndim == 2 and t.shape[1] != x.shape[1]:
            raise ValueError(f"per-token timesteps t {tuple(t.shape)} must have one per token: [B, {x.shape[1]}]")
        sinusoid = sinusoidal_embedding(self.freq_dim, t.flatten()).to(self.time_embedding[0].weight.dtype)
        e = self.time_embedding(sinusoid).unflatten(0, t.shape)  # [B, dim], or per token [B, L, dim]
        e0 = self.time_projection(e).float().unflatten(-1, (6, self.dim))
        context = self.text_embedding(context.to(self.text_embedding[0].weight.dtype))
        sp, n = self.sequence_parallel, x.shape[1]
        if sp is not None:
            if mask is not None:
                raise ValueError("sequence parallelism does not take padded samples: pass samples of seq_len tokens "
                                 "each, or the tensor forward")
            freqs = sp.pad_full(freqs, dim=-2) if sp.kind == "fastseq" else sp.split(freqs, dim=-2)
            if t.ndim == 2:  # per-token modulation follows its tokens
                e, e0 = sp.split(e), sp.split(e0)
            x = sp.split(x)
        loop = BlockLoop(partial(self._blocks, e0=e0, freqs=freqs, context=context, mask=mask), len(self.blocks),
                         x.shape[0], lambda x: self.blocks[0].modulated_input(x, e0),
                         group=None if sp is None else sp.group)
        x = self.head(run_blocks(self.step_cache, loop, x), e)
        return x if sp is None else sp.gather(x, seq_len=n)

    def _blocks(self, x, start=0, stop=None, *, e0, freqs, context, mask):
        """Blocks start..stop-1 on tokens x [B, n, dim] (this rank's chunk under SP)."""
        for block in islice(self.blocks, start, stop):
            x = block(x, e0, freqs, context, mask)
        return x

    def pab_attention(self):
        """(attention layer, PAB kind) of every block: self-attention over all f·h·w tokens counts as spatial."""
        return [pair for block in self.blocks for pair in ((block.self_attn, "spatial"), (block.cross_attn, "cross"))]

    def _unpatchify(self, x, grid):
        """Patches [B, f*h*w, prod(patch_size) * out_dim] -> [B, out_dim, f*pt, h*ph, w*pw]."""
        (f, h, w), (pt, ph, pw) = grid, self.patch_size
        x = x.reshape(x.shape[0], f, h, w, pt, ph, pw, self.out_dim)
        return torch.einsum("bfhwpqrc->bcfphqwr", x).reshape(x.shape[0], self.out_dim, f * pt, h * ph, w * pw)
