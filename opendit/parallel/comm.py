"""Differentiable collectives over a given process group, and a byte counter for them.

Every op's backward is the exact adjoint (transpose) of its forward: all-gather <-> reduce-scatter,
all-to-all <-> the reverse all-to-all. Autograd on rank r then yields d(sum of all ranks' losses)/d(rank r's
copy of a weight), which is what makes the plain DP x SP gradient average exact (docs/sequence_parallel.md).

Byte accounting: `CommCounter` records, per call site, the bytes this rank sends under the bandwidth-optimal
algorithm of each collective (ring all-gather / reduce-scatter: (P-1)/P of the full tensor; all-to-all:
(P-1)/P of the local tensor; point-to-point: the tensor). It counts at the call, it does not sniff the wire.
"""
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F

# torch 2.13 renamed the *_tensor collectives to *_single; 2.11 only has the old names. Same signatures.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommCounter:
    """Bytes sent by this rank, keyed by "<site>.<op>.<fwd|bwd>". Pass it to the SP ops; sum with `total()`."""

    def __init__(self):
        self.bytes = defaultdict(int)
        self.calls = defaultdict(int)

    def add(self, key: str, nbytes: int):
        self.bytes[key] += int(nbytes)
        self.calls[key] += 1

    def total(self, contains: str = "") -> int:
        return sum(v for k, v in self.bytes.items() if contains in k)

    def reset(self):
        self.bytes.clear()
        self.calls.clear()


def pad_dim(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Zero-pad dim `dim` of t up to `length` (sequence parallelism pads sequences to a multiple of P)."""
    pad = length - t.shape[dim]
    if not pad:
        return t
    return F.pad(t, [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, pad])


def _count(counter, key, nbytes):
    if counter is not None:
        counter.add(key, nbytes)


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


# ----------------------------------------------------------------------------------------------- all-to-all
def _all_to_all(x, group, scatter_dim, gather_dim, counter, key):
    """Split x in P blocks along scatter_dim, send block i to rank i, concatenate the received blocks along
    gather_dim in rank order. x [..., S, ..., G, ...] -> [..., S/P, ..., G*P, ...]."""
    P = dist.get_world_size(group)
    if x.shape[scatter_dim] % P:
        raise ValueError(f"all_to_all: dim {scatter_dim} of shape {tuple(x.shape)} is not divisible by the "
                         f"group size {P}")
    send = torch.stack(x.chunk(P, dim=scatter_dim)).contiguous()  # [P, *block]: block i goes to rank i
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    _count(counter, key, _nbytes(send) * (P - 1) // P)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim, counter, site):
        ctx.args = (group, scatter_dim, gather_dim, counter, site)
        return _all_to_all(x, group, scatter_dim, gather_dim, counter, f"{site}.all_to_all.fwd")

    @staticmethod
    def backward(ctx, grad):
        group, scatter_dim, gather_dim, counter, site = ctx.args
        # The adjoint of an all-to-all is the all-to-all with the two dims swapped.
        return _all_to_all(grad, group, gather_dim, scatter_dim, counter, f"{site}.all_to_all.bwd"), \
            None, None, None, None, None


def all_to_all(x, group, scatter_dim: int, gather_dim: int, counter=None, site: str = "sp"):
    """Differentiable all-to-all: dim `scatter_dim` is split over the ranks, dim `gather_dim` is gathered."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim, counter, site)


# --------------------------------------------------------------------------- all-gather / reduce-scatter
def _all_gather(x, group, dim, counter, key):
    """x [..., n, ...] on every rank -> [..., n*P, ...] with rank r's block at [r*n, (r+1)*n)."""
    P = dist.get_world_size(group)
    x = x.contiguous()
    # Blocks stacked along a new leading dim, passed as [P*x0, ...]: the one layout every backend takes.
    out = torch.empty((P * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    _count(counter, key, _nbytes(x) * (P - 1))
    return torch.cat(out.view(P, *x.shape).unbind(0), dim=dim)


def _reduce_scatter(x, group, dim, counter, key):
    """x [..., n*P, ...] -> sum over ranks of block r, [..., n, ...] on rank r."""
    P = dist.get_world_size(group)
    send = torch.stack(x.chunk(P, dim=dim)).contiguous()  # [P, *block]
    out = torch.empty_like(send[0])
    _reduce_scatter_single(out, send.flatten(0, 1), group=group)
    _count(counter, key, _nbytes(out) * (P - 1))
    return out


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, counter, site):
        ctx.args = (group, dim, counter, site)
        return _all_gather(x, group, dim, counter, f"{site}.all_gather.fwd")

    @staticmethod
    def backward(ctx, grad):
        group, dim, counter, site = ctx.args
        return _reduce_scatter(grad, group, dim, counter, f"{site}.reduce_scatter.bwd"), None, None, None, None


def gather_seq(x, group, dim: int = 1, counter=None, site: str = "sp"):
    """Differentiable all-gather along `dim` (backward: reduce-scatter, its adjoint)."""
    return _GatherSeq.apply(x, group, dim, counter, site)


def broadcast_from_first(x: torch.Tensor, group) -> torch.Tensor:
    """In place: every rank of `group` gets group rank 0's x (e.g. the noise of a sample split over SP ranks)."""
    dist.broadcast(x, src=dist.get_global_rank(group, 0), group=group)
    return x
