"""FastSeq's overlapped all-gather + projection: y = linear(all_gather(x), w, b), for any group size P.

Forward, P-1 ring steps: each rank sends the chunk it holds to the next rank and receives the previous rank's
chunk asynchronously, while it projects the chunk it holds. Only the last chunk's projection is not hidden.
Backward mirrors it with a ring reduce-scatter: the partial input gradient of chunk c (from this rank's heads)
travels the ring, each rank adding its own part while the next partial is computed, and ends at rank c.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from opendit.parallel.comm import _count, _nbytes


def _ring_peers(group):
    P, r = dist.get_world_size(group), dist.get_rank(group)
    # P2POp wants global ranks.
    return P, r, dist.get_global_rank(group, (r + 1) % P), dist.get_global_rank(group, (r - 1) % P)


def _exchange(send: torch.Tensor, nxt: int, prv: int, group):
    """Start sending `send` to nxt and receiving a same-shaped tensor from prv; returns (recv, works)."""
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
    return recv, dist.batch_isend_irecv(ops)


def _wait(works):
    for w in works:
        w.wait()


class _RingGatherLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, counter, site):
        """x [B, n, D] (this rank's chunk), weight [O, D], bias [O] -> y [B, n*P, O] over the whole sequence."""
        P, r, nxt, prv = _ring_peers(group)
        x = x.contiguous()
        chunks, outs = [None] * P, [None] * P
        cur, src = x, r  # src: the rank whose chunk `cur` is
        for step in range(P):
            if step < P - 1:
                recv, works = _exchange(cur, nxt, prv, group)
                _count(counter, f"{site}.ring_all_gather.fwd", _nbytes(cur))
            outs[src] = F.linear(cur, weight, bias)  # overlaps the exchange
            chunks[src] = cur
            if step < P - 1:
                _wait(works)
                cur, src = recv, (src - 1) % P
        ctx.save_for_backward(torch.cat(chunks, dim=1), weight)
        ctx.args = (group, counter, site, bias is not None)
        return torch.cat(outs, dim=1)

    @staticmethod
    def backward(ctx, dy):
        """dy [B, n*P, O] -> dx [B, n, D] (summed over ranks), dweight [O, D], dbias [O]."""
        x_full, weight = ctx.saved_tensors
        group, counter, site, has_bias = ctx.args
        P, r, nxt, prv = _ring_peers(group)
        n = x_full.shape[1] // P
        dy = dy.contiguous()
        dys = dy.split(n, dim=1)
        dw = torch.zeros_like(weight, dtype=torch.float32)  # P chunk terms: accumulate in fp32 under bf16

        def partial(c):  # this rank's heads' share of d(loss)/d(chunk c), plus its weight-grad term
            dw.add_((dys[c].flatten(0, 1).t() @ x_full[:, c * n:(c + 1) * n].flatten(0, 1)).float())
            return dys[c] @ weight

        # The accumulator for chunk c starts at rank c+1 and hops forward, ending at rank c after P-1 hops:
        # at step s rank r works on chunk r-1-s, the one its previous rank worked on at step s-1.
        acc = partial((r - 1) % P)
        for step in range(1, P):
            recv, works = _exchange(acc, nxt, prv, group)
            _count(counter, f"{site}.ring_reduce_scatter.bwd", _nbytes(acc))
            mine = partial((r - 1 - step) % P)  # overlaps the exchange
            _wait(works)
            acc = recv + mine
        db = dy.sum(dim=(0, 1)) if has_bias else None
        return acc, dw.to(weight.dtype), db, None, None, None


def ring_gather_linear(x, weight, bias, group, counter=None, site: str = "fastseq"):
    """linear(all_gather(x, dim=1), weight, bias) with the gather hidden behind the projection (see module doc)."""
    return _RingGatherLinear.apply(x, weight, bias, group, counter, site)
