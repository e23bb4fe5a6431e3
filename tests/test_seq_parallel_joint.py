"""Sequence parallelism for an attention layer that is not DiT's: a FLUX-style joint text + image attention.

The layer (defined here) has two token streams, each with its own qkv and output projection and its own q/k
RMSNorm over Dh, concatenated for one attention, with RoPE angles per token of the whole joint sequence. Under
SP it uses only the public stages: split per stream, to_heads per stream, norms and RoPE in the head-parallel
layout, attend with both segments' lengths, gather per stream. Text and image lengths (5, 9) are divisible by
neither P = 2 nor 4, so each segment is padded separately. Tolerances as in test_seq_parallel_dist.py.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from opendit.kernels import apply_rope, rms_norm
from opendit.kernels.attention import attention
from opendit.parallel import CommCounter, SequenceParallel, comm_bytes_per_layer
from tests.distributed import run_distributed
from tests.test_seq_parallel_dist import GRAD_TOL, KINDS, OUT_TOL

B, D, H, N_TXT, N_IMG = 2, 32, 4, 5, 9


class JointAttention(nn.Module):
    """FLUX double-stream attention: txt [B, Nt, D] and img [B, Ni, D] attend jointly over [txt, img]."""

    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.ModuleDict({s: nn.Linear(dim, 3 * dim) for s in ("txt", "img")})  # rows (3, H, Dh)
        self.proj = nn.ModuleDict({s: nn.Linear(dim, dim) for s in ("txt", "img")})
        # q and k RMSNorm weights per stream, [Dh]; not all ones so that their gradients are checked
        self.norm = nn.ParameterDict({f"{s}_{qk}": nn.Parameter(1 + 0.1 * torch.randn(self.head_dim))
                                      for s in ("txt", "img") for qk in "qk"})
        self.sequence_parallel = None

    def _heads(self, x, stream):
        """x [B, n, D] -> q, k, v [B, h, L, Dh] with this stream's q/k norm (h = H, L = n without SP)."""
        sp, lin = self.sequence_parallel, self.qkv[stream]
        if sp is None:
            qkv = lin(x).view(*x.shape[:2], 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        else:
            qkv = sp.to_heads(x, lin.weight, lin.bias, self.num_heads)  # [3, B, H/P, padded(N), Dh]
        return rms_norm(qkv[0], self.norm[f"{stream}_q"]), rms_norm(qkv[1], self.norm[f"{stream}_k"]), qkv[2]

    def forward(self, txt, img, cos, sin, seq_lens):
        """cos, sin [L, Dh/2]: the angles of the (padded, under SP) joint sequence; seq_lens: (N_txt, N_img)."""
        (qt, kt, vt), (qi, ki, vi) = self._heads(txt, "txt"), self._heads(img, "img")
        q, k, v = (torch.cat(pair, dim=2) for pair in ((qt, qi), (kt, ki), (vt, vi)))  # [B, h, L, Dh]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        sp = self.sequence_parallel
        if sp is None:
            out = attention(q, k, v)
        else:
            out = sp.attend(q, k, v, "sdpa", seq_lens=seq_lens)  # [B, H, n_txt + n_img, Dh], local tokens
        out = out.transpose(1, 2).flatten(2)
        nt = txt.shape[1]
        return self.proj["txt"](out[:, :nt]), self.proj["img"](out[:, nt:])


def _joint_case(group, kind):
    """Unsplit vs split forward/backward of one layer; the same (replicated) loss on every rank."""
    torch.manual_seed(0)
    layer = JointAttention(D, H)
    txt, img = torch.randn(B, N_TXT, D, requires_grad=True), torch.randn(B, N_IMG, D, requires_grad=True)
    angles = torch.randn(N_TXT + N_IMG, D // H // 2) * 3  # any per-token angles: a misplaced token shows
    cos, sin = angles.cos(), angles.sin()
    dt, di = torch.randn(B, N_TXT, D), torch.randn(B, N_IMG, D)
    lens = (N_TXT, N_IMG)

    ot, oi = layer(txt, img, cos, sin, lens)
    ((ot * dt).sum() + (oi * di).sum()).backward()
    ref = {"txt_out": ot.detach(), "img_out": oi.detach(), "txt": txt.grad, "img": img.grad,
           **{n: p.grad.clone() for n, p in layer.named_parameters()}}

    layer.zero_grad()
    counter = CommCounter()
    sp = layer.sequence_parallel = SequenceParallel(group, kind, counter)
    txt_s, img_s = txt.detach().clone().requires_grad_(), img.detach().clone().requires_grad_()
    ot, oi = layer(sp.split(txt_s), sp.split(img_s), sp.pad_full(cos, lens, dim=0), sp.pad_full(sin, lens, dim=0),
                   lens)
    ot, oi = sp.gather(ot, seq_len=N_TXT), sp.gather(oi, seq_len=N_IMG)
    ((ot * dt).sum() + (oi * di).sum()).backward()
    got = {"txt_out": ot.detach(), "img_out": oi.detach(), "txt": txt_s.grad, "img": img_s.grad,
           **{n: p.grad.clone() for n, p in layer.named_parameters()}}
    for n, g in got.items():
        if not n.endswith("_out"):
            dist.all_reduce(g, group=group)  # the SUM over the group; the test checks SUM / P == unsplit
    return got, ref, dict(counter.bytes)


def _worker(rank, world_size):
    return {kind: _joint_case(dist.group.WORLD, kind) for kind in KINDS}


@pytest.mark.slow
@pytest.mark.parametrize("P", [2, 4])
def test_joint_attention_with_qk_norm_and_rope_equals_unsplit(P):
    results = run_distributed(_worker, P)
    for rank, res in enumerate(results):
        for kind, (got, ref, sent) in res.items():
            where = f"joint attention {kind} P={P} rank {rank}"
            assert got.keys() == ref.keys()
            for n in ("txt_out", "img_out"):
                torch.testing.assert_close(got[n], ref[n], **OUT_TOL, msg=lambda m: f"{where} {n}: {m}")
            for n in ref:
                if not n.endswith("_out"):
                    # Every rank's loss is the whole loss: the group's SUM is P times the unsplit gradient.
                    torch.testing.assert_close(got[n] / P, ref[n], **GRAD_TOL,
                                               msg=lambda m: f"{where} grad {n}: {m}")
            # Bytes of the layer (fwd + bwd; the boundary gathers are counted apart): each stream padded alone.
            layer_bytes = sum(v for k, v in sent.items() if k.startswith(kind))
            assert layer_bytes == comm_bytes_per_layer(kind, P, [N_TXT, N_IMG], D, B), (where, sent)
