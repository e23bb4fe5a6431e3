"""Layers shared by the DiT family. Parameter names match the official DiT release."""
import math

import torch
import torch.nn as nn

from opendit.kernels import ATTENTION_BACKEND
from opendit.kernels.attention import attention


class PatchEmbed(nn.Module):
    """[B, C, H, W] -> [B, (H/p)*(W/p), D] by a stride-p convolution."""

    def __init__(self, patch_size: int, in_channels: int, hidden_size: int):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size, bias=True)

    def forward(self, x):
        # contiguous: every block then sees the same strides, so a per-block compile does not recompile block 0, and
        # inductor (torch 2.13, CPU) fuses a transposed residual stream's bf16 add + LayerNorm wrongly (NaN)
        return self.proj(x).flatten(2).transpose(1, 2).contiguous()


class PatchEmbed3D(nn.Module):
    """[B, C, T, H, W] -> [B, (T/pt)*(H/ph)*(W/pw), D] by a stride-patch Conv3d; tokens in (t, h, w) order."""

    def __init__(self, patch_size: tuple[int, int, int], in_channels: int, hidden_size: int):
        super().__init__()
        self.patch_size = tuple(patch_size)
        self.proj = nn.Conv3d(in_channels, hidden_size, kernel_size=self.patch_size, stride=self.patch_size,
                              bias=True)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2).contiguous()  # contiguous: see PatchEmbed


def timestep_embedding(t: torch.Tensor, dim: int, max_period: int = 10000) -> torch.Tensor:
    """t [B] (may be fractional) -> [B, dim] sinusoidal features: cos first, then sin (DiT/ADM order)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.frequency_embedding_size = frequency_embedding_size
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size, bias=True),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size, bias=True),
        )

    def forward(self, t):
        t_freq = timestep_embedding(t, self.frequency_embedding_size)
        return self.mlp(t_freq.to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """Class labels -> vectors. Row `num_classes` is the null class used for classifier-free guidance."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float):
        super().__init__()
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), hidden_size)

    def token_drop(self, labels, force_drop_ids=None):
        if force_drop_ids is None:
            drop = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
        else:
            drop = force_drop_ids == 1
        return torch.where(drop, self.num_classes, labels)

    def forward(self, labels, train: bool, force_drop_ids=None):
        if (train and self.dropout_prob > 0) or force_drop_ids is not None:
            labels = self.token_drop(labels, force_drop_ids)
        return self.embedding_table(labels)


class Mlp(nn.Module):
    def __init__(self, hidden_size: int, mlp_hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, mlp_hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(mlp_hidden, hidden_size)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def linear_weight(linear: nn.Linear) -> torch.Tensor:
    """The weight a Linear applies, for code that takes it instead of calling the layer (the sequence-parallel
    projections): with LoRA adapters attached (opendit.lora), the weight with them merged in."""
    merged = getattr(linear, "merged_weight", None)
    return linear.weight if merged is None else merged()


class Attention(nn.Module):
    """Multi-head self-attention. x [B, N, D] -> [B, N, D]; the math runs in opendit.kernels.attention.

    `attn_backend` is set by the model ("sdpa", "flash", "math"); `sequence_parallel` is an optional
    opendit.parallel.SequenceParallel: when set, x is this rank's chunk of a sequence split over ranks and the
    layer runs through its two stages (to_heads, attend) around the head-parallel middle.
    """

    kernel_switches = {"attn_backend": ATTENTION_BACKEND}  # see opendit.kernels.set_kernels

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden size {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.attn_backend = "sdpa"
        self.sequence_parallel = None

    def forward(self, x):
        B, N, D = x.shape  # under SP, N is this rank's chunk
        sp = self.sequence_parallel
        if sp is None:
            qkv = self.qkv(x).view(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            out = attention(qkv[0], qkv[1], qkv[2], backend=self.attn_backend)  # [B, H, N, Dh]
        else:
            qkv = sp.to_heads(x, linear_weight(self.qkv), self.qkv.bias, self.num_heads)  # [3, B, H/P, N*P, Dh]
            out = sp.attend(qkv[0], qkv[1], qkv[2], self.attn_backend)  # [B, H, N, Dh]
        return self.proj(out.transpose(1, 2).reshape(B, N, D))
