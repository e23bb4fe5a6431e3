"""Attention dispatch. q, k, v: [B, H, N, D] -> [B, H, N, D]."""
import torch.nn.functional as F


def attention(q, k, v, attn_mask=None, backend="sdpa"):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
