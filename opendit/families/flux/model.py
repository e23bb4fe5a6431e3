"""FLUX.1 (Black Forest Labs): a rectified-flow transformer over 2x2-packed latent tokens and T5 text tokens.

The math and the state_dict (keys and shapes) equal the official `flux/model.py` + `flux/modules/layers.py`, so
flux1-dev.safetensors and flux1-schnell.safetensors load with strict=True (tests/data/flux1-*_state_dict.tsv).

    img [B, L_img, in_channels] --img_in--> image tokens     txt [B, L_txt, context_in_dim] --txt_in--> text tokens
    vec [B, D] = time_in(t) (+ guidance_in(g)) + vector_in(y)       modulates every block (adaLN)
    pe  [B, L_txt + L_img, Dh/2] complex: RoPE angles of the joint [txt, img] sequence from its 3-axis ids
    double_blocks: two streams, each with its own weights, attending jointly over [txt, img]
    single_blocks: one stream over the concatenated [txt, img]; one fused linear1 gives qkv and the MLP input
    final_layer on the image tokens -> [B, L_img, out_channels]

`pe` is complex64 (cos + i sin) rather than two real tables: FSDP's mixed-precision policy casts every real
floating input of a sharded block to the compute dtype, which would round the angles to bf16; the official code
keeps them fp32, and so does this. Under autocast / bf16 the q/k norms and RoPE still compute in fp32.

Kernel switches (opendit.kernels.set_kernels; each layer's `kernel_switches`): modulate=True runs the fused
LayerNorm + modulation and gated-residual Triton kernels; layernorm=True the LayerNorm kernel (when not fused with
modulation). Either switch also turns on the q/k RMSNorm and RoPE kernels. Attention always goes through
opendit.kernels.attention (`attn_backend`).

Sequence parallelism (`parallel_plan`, applied by opendit.parallel.enable_sequence_parallel): each stream's tokens
are split over the P ranks (sp.split per stream, each padded alone). Double blocks: to_heads per stream, that
stream's q/k norm, the two head-parallel tensors concatenated [txt padded; img padded], RoPE with the equally padded
angles, attend with (L_txt, L_img). Single blocks keep the two segments per rank, x = [txt chunk; img chunk]: the
qkv rows of linear1 go through to_heads once per segment (so the head-parallel layout is again [txt padded; img
padded] and every token keeps its RoPE angle), the MLP rows of linear1 run locally on the chunk, and attend returns
[txt chunk; img chunk] again. The image chunks are gathered after the final layer, so every rank returns the whole
output. Weight gradients follow opendit.parallel: the group MEAN equals the unsplit gradient.

Initialisation (for training from scratch; pretrained weights replace it): xavier-uniform linears with zero
biases, N(0, 0.02) timestep / guidance embedders, RMSNorm scales one, and adaLN-Zero: every modulation output
(img_mod, txt_mod, modulation) and the final layer are zero, so each block starts as the identity and a fresh
model predicts zero.
"""
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from opendit import kernels
from opendit.kernels.attention import attention
from opendit.models.blocks import AdaLNNorm, FinalLayer
from opendit.models.layers import linear_weight
from opendit.models.layers import timestep_embedding as _sinusoidal
from opendit.models.step_cache import BlockLoop, run_blocks
from opendit.parallel import ParallelPlan
from opendit.parallel.plan import padded_len

_FLUX_BASE = dict(in_channels=64, vec_in_dim=768, context_in_dim=4096, hidden_size=3072, mlp_ratio=4.0, num_heads=24,
                  depth=19, depth_single_blocks=38, axes_dim=(16, 56, 56), theta=10000, qkv_bias=True)
# Constructor kwargs. flux-debug leaves the run-dependent widths (in_channels, vec_in_dim, context_in_dim) to the
# caller's kwargs.
FLUX_CONFIGS = {
    "flux-dev": dict(_FLUX_BASE, guidance_embed=True),
    "flux-schnell": dict(_FLUX_BASE, guidance_embed=False),
    "flux-debug": dict(hidden_size=64, num_heads=4, depth=2, depth_single_blocks=2, axes_dim=(4, 6, 6), mlp_ratio=4.0,
                       theta=10000, qkv_bias=True, guidance_embed=True),
}


# ---------------------------------------------------------------------------------------- inputs and positions
def pack_latents(z: torch.Tensor) -> torch.Tensor:
    """Latents [B, C, H, W] -> tokens [B, (H/2)*(W/2), 4C]; official `b c (h ph) (w pw) -> b (h w) (c ph pw)`."""
    B, C, H, W = z.shape
    if H % 2 or W % 2:
        raise ValueError(f"pack_latents: latent size {H}x{W} must be even (FLUX packs 2x2 patches); crop or pad it")
    return z.view(B, C, H // 2, 2, W // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, (H // 2) * (W // 2), 4 * C)


def unpack_latents(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Tokens [B, (height/2)*(width/2), 4C] -> latents [B, C, height, width]: the inverse of pack_latents.

    height, width are the LATENT size (the official `unpack` takes the pixel size, 8x larger)."""
    B, L, C4 = x.shape
    h, w = height // 2, width // 2
    if height % 2 or width % 2 or L != h * w or C4 % 4:
        raise ValueError(f"unpack_latents: {L} tokens of width {C4} do not pack a {height}x{width} latent "
                         f"(needs even sizes, (height/2)*(width/2) = {h * w} tokens and a width divisible by 4)")
    return x.view(B, h, w, C4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, C4 // 4, height, width)


def image_ids(batch: int, h: int, w: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Position ids of the packed tokens of an h x w latent: [B, (h/2)*(w/2), 3] = (0, row, col), as prepare()."""
    rows = torch.arange(h // 2, device=device, dtype=dtype)[:, None].expand(h // 2, w // 2)
    cols = torch.arange(w // 2, device=device, dtype=dtype)[None, :].expand(h // 2, w // 2)
    ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(1, -1, 3)
    return ids.expand(batch, -1, -1).clone()


def text_ids(batch: int, length: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Position ids of text tokens: zeros [B, length, 3] (text gets no rotation)."""
    return torch.zeros(batch, length, 3, device=device, dtype=dtype)


def flux_timestep_embedding(t: torch.Tensor, dim: int = 256, max_period: int = 10000,
                            time_factor: float = 1000.0) -> torch.Tensor:
    """The official timestep_embedding: sinusoidal features (cos, sin) of time_factor * t, in t's dtype when t is
    floating (timesteps in [0, 1] -> 0..1000; the guidance strength likewise)."""
    t = time_factor * t
    emb = _sinusoidal(t, dim, max_period)
    return emb.to(t.dtype) if t.is_floating_point() else emb


def rope_freqs(ids: torch.Tensor, axes_dim, theta: int = 10000) -> torch.Tensor:
    """Ids [..., L, n_axes] -> RoPE as complex64 [..., L, sum(axes_dim)/2] = cos + i sin of each pair's angle.

    The official EmbedND/rope: axis a's pairs rotate by ids[..., a] * theta^(-2j/d_a), j < d_a/2, computed in
    float64 and rounded to fp32; the axes' pairs are concatenated in order. Pair i of a head rotates
    (x[2i], x[2i+1]) (opendit.kernels.apply_rope's interleaved layout)."""
    if ids.shape[-1] != len(axes_dim):
        raise ValueError(f"position ids have {ids.shape[-1]} axes but axes_dim {tuple(axes_dim)} has {len(axes_dim)}")
    angles = []
    for a, d in enumerate(axes_dim):
        omega = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=ids.device) / d)
        angles.append(ids[..., a].to(torch.float64)[..., None] * omega)
    angles = torch.cat(angles, dim=-1)
    return torch.complex(angles.cos().float(), angles.sin().float())


# ------------------------------------------------------------------------------------------------------ layers
def _joint_ids(txt_ids, img_ids):
    """txt_ids, img_ids [B or 1, L, 3] or [L, 3] -> the joint [txt, img] ids [B or 1, L_txt + L_img, 3]."""
    txt_ids, img_ids = (i if i.dim() == 3 else i[None] for i in (txt_ids, img_ids))
    b = max(txt_ids.shape[0], img_ids.shape[0])
    return torch.cat((txt_ids.expand(b, -1, -1), img_ids.expand(b, -1, -1)), dim=1)


class MLPEmbedder(nn.Module):
    def __init__(self, in_dim: int, hidden_dim: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden_dim, bias=True)
        self.silu = nn.SiLU()
        self.out_layer = nn.Linear(hidden_dim, hidden_dim, bias=True)

    def forward(self, x):
        return self.out_layer(self.silu(self.in_layer(x.to(self.in_layer.weight.dtype))))


class RMSNorm(nn.Module):
    """RMSNorm over the head dim (eps 1e-6), fp32 math; the weight is named `scale` as in the official release."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))
        self.use_kernel = False

    kernel_switches = {"use_kernel": ("modulate", "layernorm")}  # see opendit.kernels.set_kernels

    def forward(self, x):
        return kernels.rms_norm(x, self.scale, eps=1e-6, use_kernel=self.use_kernel)


class QKNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.query_norm = RMSNorm(dim)
        self.key_norm = RMSNorm(dim)

    def forward(self, q, k, v):
        return self.query_norm(q).to(v.dtype), self.key_norm(k).to(v.dtype)


class SelfAttention(nn.Module):
    """A stream's attention weights: fused qkv (rows laid out (3, H, Dh)), q/k RMSNorm and output projection.
    The joint attention itself runs in the blocks."""

    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.norm = QKNorm(dim // num_heads)
        self.proj = nn.Linear(dim, dim)


class Modulation(nn.Module):
    """vec [B, D] -> (shift, scale, gate) (and a second triple when double), each [B, D]."""

    def __init__(self, dim: int, double: bool):
        super().__init__()
        self.is_double = double
        self.multiplier = 6 if double else 3
        self.lin = nn.Linear(dim, self.multiplier * dim, bias=True)

    def forward(self, vec):
        out = self.lin(F.silu(vec)).chunk(self.multiplier, dim=-1)
        return out[:3], (out[3:] if self.is_double else None)


def _to_heads(x, qkv: nn.Linear, num_heads: int, sp):
    """Tokens [B, n, D] through a fused qkv -> [3, B, h, L, Dh]: all heads of these tokens without SP, this rank's
    H/P heads over the stream's whole padded sequence with SP."""
    if sp is None:
        B, n, _ = x.shape
        return qkv(x).view(B, n, 3, num_heads, -1).permute(2, 0, 3, 1, 4)
    return sp.to_heads(x, linear_weight(qkv), qkv.bias, num_heads)


class _Block(nn.Module):
    """Switches and the attention shared by both block kinds."""

    kernel_switches = {"fused": ("modulate",), "rope_kernel": ("modulate", "layernorm"),
                       "attn_backend": kernels.ATTENTION_BACKEND}  # fused: the gated residuals' kernel

    def __init__(self):
        super().__init__()
        self.fused = False
        self.rope_kernel = False
        self.attn_backend = "sdpa"
        self.sequence_parallel = None  # the model's hook while sequence parallelism is on

    def _sp(self):
        sp = self.sequence_parallel
        return (None, None) if sp is None else (sp, sp.seq_lens)

    def _attention(self, q, k, v, pe):
        """q, k, v [B, h, L, Dh] of the joint sequence (padded segments under SP) -> [B, n, H*Dh], this rank's
        tokens in segment order [txt, img]. RoPE rotates q and k by pe [B or 1, L, Dh/2] (complex)."""
        cos, sin = pe.real, pe.imag
        if self.rope_kernel:  # the kernel reads contiguous tables; copy once for q and k
            cos, sin = cos.contiguous(), sin.contiguous()
        q = kernels.apply_rope(q, cos, sin, use_kernel=self.rope_kernel)
        k = kernels.apply_rope(k, cos, sin, use_kernel=self.rope_kernel)
        sp, seq_lens = self._sp()
        if sp is None:
            out = attention(q, k, v, backend=self.attn_backend)
        else:
            out = sp.attend(q, k, v, self.attn_backend, seq_lens=seq_lens)
        return out.transpose(1, 2).flatten(2)

    def _residual(self, x, gate, y):
        return kernels.gated_residual(x, gate, y, use_kernel=self.fused)


class DoubleStreamBlock(_Block):
    """Image and text streams, each with its own modulation, attention weights and MLP, one joint attention."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, qkv_bias: bool = False):
        super().__init__()
        mlp_hidden = int(hidden_size * mlp_ratio)
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        for s in ("img", "txt"):  # registration order = the official state_dict order
            self.add_module(f"{s}_mod", Modulation(hidden_size, double=True))
            self.add_module(f"{s}_norm1", AdaLNNorm())
            self.add_module(f"{s}_attn", SelfAttention(hidden_size, num_heads, qkv_bias=qkv_bias))
            self.add_module(f"{s}_norm2", AdaLNNorm())
            self.add_module(f"{s}_mlp", nn.Sequential(nn.Linear(hidden_size, mlp_hidden, bias=True),
                                                      nn.GELU(approximate="tanh"),
                                                      nn.Linear(mlp_hidden, hidden_size, bias=True)))

    def _stream_heads(self, x, mod, stream):
        """A stream's tokens -> its q, k (q/k-normed), v [B, h, L, Dh]."""
        attn = getattr(self, f"{stream}_attn")
        x = getattr(self, f"{stream}_norm1")(x, mod[0], mod[1])
        q, k, v = _to_heads(x, attn.qkv, self.num_heads, self._sp()[0])
        q, k = attn.norm(q, k, v)
        return q, k, v

    def modulated_input(self, img, vec):
        """The image stream's modulated input of attention, img_norm1 [B, n_img, D]: TeaCache's signal."""
        (shift, scale, _), _ = self.img_mod(vec)
        return self.img_norm1(img, shift, scale)

    def forward(self, img, txt, vec, pe):
        """img [B, n_img, D], txt [B, n_txt, D] (this rank's chunks under SP), vec [B, D], pe the joint RoPE."""
        img_mod1, img_mod2 = self.img_mod(vec)
        txt_mod1, txt_mod2 = self.txt_mod(vec)
        (tq, tk, tv), (iq, ik, iv) = self._stream_heads(txt, txt_mod1, "txt"), self._stream_heads(img, img_mod1, "img")
        attn = self._attention(torch.cat((tq, iq), 2), torch.cat((tk, ik), 2), torch.cat((tv, iv), 2), pe)
        txt_attn, img_attn = attn[:, :txt.shape[1]], attn[:, txt.shape[1]:]

        img = self._residual(img, img_mod1[2], self.img_attn.proj(img_attn))
        img = self._residual(img, img_mod2[2], self.img_mlp(self.img_norm2(img, img_mod2[0], img_mod2[1])))
        txt = self._residual(txt, txt_mod1[2], self.txt_attn.proj(txt_attn))
        txt = self._residual(txt, txt_mod2[2], self.txt_mlp(self.txt_norm2(txt, txt_mod2[0], txt_mod2[1])))
        return img, txt


class SingleStreamBlock(_Block):
    """Parallel attention + MLP over the joint [txt, img] sequence: linear1 -> (qkv, MLP input), linear2 over
    (attention output, GELU(MLP input))."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.num_heads = num_heads
        self.mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.linear1 = nn.Linear(hidden_size, hidden_size * 3 + self.mlp_hidden_dim)  # qkv and mlp_in
        self.linear2 = nn.Linear(hidden_size + self.mlp_hidden_dim, hidden_size)  # proj and mlp_out
        self.norm = QKNorm(hidden_size // num_heads)
        self.hidden_size = hidden_size
        self.pre_norm = AdaLNNorm()
        self.mlp_act = nn.GELU(approximate="tanh")
        self.modulation = Modulation(hidden_size, double=False)

    def forward(self, x, vec, pe):
        """x [B, n, D]: the joint sequence, or under SP this rank's [txt chunk; img chunk]; vec [B, D]."""
        (shift, scale, gate), _ = self.modulation(vec)
        x_mod = self.pre_norm(x, shift, scale)
        sp, seq_lens = self._sp()
        D, H = self.hidden_size, self.num_heads
        if sp is None:
            qkv, mlp = self.linear1(x_mod).split([3 * D, self.mlp_hidden_dim], dim=-1)
            q, k, v = qkv.unflatten(-1, (3, H, -1)).permute(2, 0, 3, 1, 4)
        else:
            # qkv rows through to_heads once per segment, so the head-parallel layout is [txt padded; img padded]
            # as the angles in pe are; the MLP rows stay local.
            w, b = linear_weight(self.linear1), self.linear1.bias
            n_txt = padded_len(seq_lens[0], sp.size) // sp.size
            segs = [sp.to_heads(part, w[:3 * D], b[:3 * D], H) for part in (x_mod[:, :n_txt], x_mod[:, n_txt:])]
            q, k, v = torch.cat(segs, dim=3)
            mlp = F.linear(x_mod, w[3 * D:], b[3 * D:])
        q, k = self.norm(q, k, v)
        attn = self._attention(q, k, v, pe)
        return self._residual(x, gate, self.linear2(torch.cat((attn, self.mlp_act(mlp)), 2)))


# ------------------------------------------------------------------------------------------------------- model
class Flux(nn.Module):
    """The FLUX.1 transformer; arguments are the official FluxParams fields (out_channels None = in_channels)."""

    _block_lists = ("double_blocks", "single_blocks")
    parallel_plan = ParallelPlan(attention=(_Block,), split=("text tokens", "image tokens"),
                                 replicated=("vector vec", "RoPE table (padded per stream)"))
    sequence_parallel = None  # the SequenceParallel hook while sequences are split
    step_cache = None  # an opendit.models.step_cache cache while sampling with one (sample.py --cache)

    def __init__(self, in_channels: int = 64, out_channels: int | None = None, vec_in_dim: int = 768,
                 context_in_dim: int = 4096, hidden_size: int = 3072, mlp_ratio: float = 4.0, num_heads: int = 24,
                 depth: int = 19, depth_single_blocks: int = 38, axes_dim=(16, 56, 56), theta: int = 10000,
                 qkv_bias: bool = True, guidance_embed: bool = True):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden size {hidden_size} is not divisible by num_heads {num_heads}")
        head_dim = hidden_size // num_heads
        if sum(axes_dim) != head_dim or any(d % 2 for d in axes_dim):
            raise ValueError(f"axes_dim {tuple(axes_dim)} must be even sizes summing to the head dim {head_dim} "
                             f"(hidden_size / num_heads)")
        self.in_channels = in_channels
        self.out_channels = in_channels if out_channels is None else out_channels
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.axes_dim, self.theta = tuple(axes_dim), theta
        self.guidance_embed = guidance_embed
        self.img_in = nn.Linear(in_channels, hidden_size, bias=True)
        self.time_in = MLPEmbedder(256, hidden_size)
        self.vector_in = MLPEmbedder(vec_in_dim, hidden_size)
        self.guidance_in = MLPEmbedder(256, hidden_size) if guidance_embed else nn.Identity()
        self.txt_in = nn.Linear(context_in_dim, hidden_size)
        self.double_blocks = nn.ModuleList([DoubleStreamBlock(hidden_size, num_heads, mlp_ratio, qkv_bias=qkv_bias)
                                            for _ in range(depth)])
        self.single_blocks = nn.ModuleList([SingleStreamBlock(hidden_size, num_heads, mlp_ratio)
                                            for _ in range(depth_single_blocks)])
        self.final_layer = FinalLayer(hidden_size, 1, self.out_channels)  # the official LastLayer
        self.initialize_weights()

    def initialize_weights(self):
        """Training from scratch: see the module docstring (adaLN-Zero)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.scale)
            elif isinstance(m, Modulation):
                nn.init.zeros_(m.lin.weight)
                nn.init.zeros_(m.lin.bias)
        for emb in (self.time_in, self.guidance_in):
            if isinstance(emb, MLPEmbedder):
                nn.init.normal_(emb.in_layer.weight, std=0.02)
                nn.init.normal_(emb.out_layer.weight, std=0.02)
        self.final_layer.zero_init()

    # --------------------------------------------------------------------------------------- forward
    def _check_inputs(self, img, img_ids, txt, txt_ids, guidance):
        if img.ndim != 3 or txt.ndim != 3:
            raise ValueError(f"img and txt must be token sequences [B, L, C]; got {tuple(img.shape)} and "
                             f"{tuple(txt.shape)} (pack latents with opendit.families.flux.model.pack_latents)")
        for name, ids, x in (("img_ids", img_ids, img), ("txt_ids", txt_ids, txt)):
            if ids.shape[-2:] != (x.shape[1], len(self.axes_dim)) or ids.shape[:-2] not in ((), (1,), (x.shape[0],)):
                raise ValueError(f"{name} has shape {tuple(ids.shape)}; expected [B, {x.shape[1]}, "
                                 f"{len(self.axes_dim)}] (or without the batch dim) for tokens {tuple(x.shape)}")
        if self.guidance_embed and guidance is None:
            raise ValueError("this FLUX model embeds the guidance strength (guidance_embed=True, e.g. FLUX.1-dev): "
                             "pass guidance [B], e.g. torch.full((B,), 3.5)")

    def forward(self, img, img_ids, txt, txt_ids, timesteps, y, guidance=None):
        """img [B, L_img, in_channels] packed latent tokens, img_ids [B, L_img, 3], txt [B, L_txt, context_in_dim],
        txt_ids [B, L_txt, 3], timesteps [B] in [0, 1], y [B, vec_in_dim] pooled text, guidance [B] (guidance-
        distilled models) -> [B, L_img, out_channels]."""
        self._check_inputs(img, img_ids, txt, txt_ids, guidance)
        n_txt, n_img = txt.shape[1], img.shape[1]
        img, txt = self.img_in(img), self.txt_in(txt)
        vec = self.time_in(flux_timestep_embedding(timesteps, 256))
        if self.guidance_embed:
            vec = vec + self.guidance_in(flux_timestep_embedding(guidance, 256))
        vec = vec + self.vector_in(y)
        ids = _joint_ids(txt_ids, img_ids)  # [b, L_txt + L_img, 3], b = B or 1
        pe = rope_freqs(ids, self.axes_dim, self.theta)
        if pe.shape[0] == 1:
            pe = pe[0]  # shared by the batch: [L, Dh/2]
        sp = self.sequence_parallel
        if sp is not None:
            sp.seq_lens = (n_txt, n_img)
            img, txt = sp.split(img), sp.split(txt)
            pe = sp.pad_full(pe, (n_txt, n_img), dim=-2)
        n = txt.shape[1]  # this rank's text tokens: the joint sequence is [txt; img]
        loop = BlockLoop(partial(self._blocks, vec=vec, pe=pe), len(self.double_blocks) + len(self.single_blocks),
                         img.shape[0], lambda state: self.double_blocks[0].modulated_input(state[0], vec),
                         out=lambda state: state[0] if isinstance(state, tuple) else state[:, n:],
                         group=None if sp is None else sp.group)
        out = self.final_layer(run_blocks(self.step_cache, loop, (img, txt)), vec)
        if sp is not None:
            out = sp.gather(out, seq_len=n_img)
        return out

    def _blocks(self, state, start=0, stop=None, *, vec, pe):
        """Blocks start..stop-1 of double_blocks + single_blocks: state (img, txt) [B, n, D] through the double
        blocks, joined to x = [txt; img] before the first single block, which the single blocks carry on."""
        n_double = len(self.double_blocks)
        for i in range(start, n_double + len(self.single_blocks) if stop is None else stop):
            if i < n_double:
                state = self.double_blocks[i](*state, vec, pe)
                continue
            if i == n_double:
                state = torch.cat((state[1], state[0]), 1)
            state = self.single_blocks[i - n_double](state, vec, pe)
        return state

    def forward_with_cfg(self, img, img_ids, txt, txt_ids, timesteps, y, guidance=None, cfg_scale: float = 1.0):
        """Classifier-free guidance on a batch [cond half; uncond half] (the halves differ in txt / y; the first
        half's img is used for both): uncond + cfg_scale * (cond - uncond), repeated for both halves."""
        if img.shape[0] % 2:
            raise ValueError(f"forward_with_cfg takes [cond half; uncond half]; got an odd batch of {img.shape[0]}")
        half = img[: img.shape[0] // 2]
        out = self(torch.cat([half, half]), img_ids, txt, txt_ids, timesteps, y, guidance)
        cond, uncond = out.chunk(2)
        guided = uncond + cfg_scale * (cond - uncond)
        return torch.cat([guided, guided])
