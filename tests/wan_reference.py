"""An independent transcription of the official Wan2.1 WanModel forward (wan/modules/model.py, t2v) and of Wan2.2's
(Wan-Video/Wan2.2 wan/modules/model.py: t expanded to one timestep per token, per-token modulation, the i2v
conditioning channels y joined to x), used ONLY as the parity reference of opendit.families.wan.model: plain
functions over a state_dict, per-sample loops, float64 RoPE through complex numbers, captions zero-padded to
text_len, padded video keys masked with an explicit mask in plain torch math (the official flash_attention's
k_lens)."""
import math

import torch
import torch.nn.functional as F


def _linear(sd, name, x):
    return F.linear(x, sd[f"{name}.weight"], sd[f"{name}.bias"])


def sinusoidal_embedding_1d(dim, position):
    half = dim // 2
    position = position.type(torch.float64)
    sinusoid = torch.outer(position, torch.pow(10000, -torch.arange(half).to(position).div(half)))
    return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1)


def rope_params(max_seq_len, dim, theta=10000):
    freqs = torch.outer(torch.arange(max_seq_len),
                        1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float64).div(dim)))
    return torch.polar(torch.ones_like(freqs), freqs)


def rope_apply(x, grid_sizes, freqs):
    """x [B, L, n, d]; each sample's first f*h*w tokens rotated, the rest (padding) left as they are."""
    n, c = x.size(2), x.size(3) // 2
    freqs = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    output = []
    for i, (f, h, w) in enumerate(grid_sizes.tolist()):
        seq_len = f * h * w
        x_i = torch.view_as_complex(x[i, :seq_len].to(torch.float64).reshape(seq_len, n, -1, 2))
        freqs_i = torch.cat([freqs[0][:f].view(f, 1, 1, -1).expand(f, h, w, -1),
                             freqs[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
                             freqs[2][:w].view(1, 1, w, -1).expand(f, h, w, -1)], dim=-1).reshape(seq_len, 1, -1)
        x_i = torch.view_as_real(x_i * freqs_i).flatten(2)
        output.append(torch.cat([x_i, x[i, seq_len:]]))
    return torch.stack(output).float()


def rms_norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)).type_as(x) * weight


def layer_norm(x, eps, weight=None, bias=None):
    return F.layer_norm(x.float(), x.shape[-1:], weight, bias, eps).type_as(x)


def attention(q, k, v, k_lens=None):
    """q [B, Lq, n, d], k, v [B, Lk, n, d]; keys at positions >= k_lens[b] are masked -> [B, Lq, n, d]."""
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if k_lens is not None:
        keep = torch.arange(k.shape[2])[None, :] < k_lens[:, None]  # [B, Lk]
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def reference_forward(sd, cfg, x, t, context, seq_len, y=None, wan22=False):
    """sd: the official state_dict; cfg: the official config (dim, num_heads, ...); x a list of [C, F, H, W],
    t [B] (Wan2.2: or [B, seq_len]), context a list of [L_i, text_dim], y (Wan2.2 i2v) a list of [C_y, F, H, W]
    -> a list of [out_dim, F, H, W] float32. wan22: Wan2.2's forward."""
    if y is not None:
        x = [torch.cat([u, v], dim=0) for u, v in zip(x, y)]
    dim, n, eps = cfg["dim"], cfg["num_heads"], cfg["eps"]
    d = dim // n
    patch = tuple(cfg["patch_size"])
    freqs = torch.cat([rope_params(1024, d - 4 * (d // 6)), rope_params(1024, 2 * (d // 6)),
                       rope_params(1024, 2 * (d // 6))], dim=1)

    x = [F.conv3d(u.unsqueeze(0), sd["patch_embedding.weight"], sd["patch_embedding.bias"], stride=patch) for u in x]
    grid_sizes = torch.stack([torch.tensor(u.shape[2:], dtype=torch.long) for u in x])
    x = [u.flatten(2).transpose(1, 2) for u in x]
    seq_lens = torch.tensor([u.size(1) for u in x], dtype=torch.long)
    assert seq_lens.max() <= seq_len
    x = torch.cat([torch.cat([u, u.new_zeros(1, seq_len - u.size(1), u.size(2))], dim=1) for u in x])

    if wan22:  # one timestep per token
        if t.dim() == 1:  # the official t.expand(t.size(0), seq_len) of its one-sample t [1], per sample
            t = t[:, None].expand(t.size(0), seq_len)
        bt = t.size(0)
        sinusoid = sinusoidal_embedding_1d(cfg["freq_dim"], t.flatten()).unflatten(0, (bt, seq_len)).float()
        e = _linear(sd, "time_embedding.2", F.silu(_linear(sd, "time_embedding.0", sinusoid)))
        e0 = _linear(sd, "time_projection.1", F.silu(e)).unflatten(2, (6, dim))
    else:
        e = _linear(sd, "time_embedding.2", F.silu(_linear(sd, "time_embedding.0",
                                                           sinusoidal_embedding_1d(cfg["freq_dim"], t).float())))
        e0 = _linear(sd, "time_projection.1", F.silu(e)).unflatten(1, (6, dim))

    context = torch.stack([torch.cat([u, u.new_zeros(cfg["text_len"] - u.size(0), u.size(1))]) for u in context])
    context = _linear(sd, "text_embedding.2", F.gelu(_linear(sd, "text_embedding.0", context), approximate="tanh"))

    for i in range(cfg["num_layers"]):
        p = f"blocks.{i}."
        if wan22:
            m = [c.squeeze(2) for c in (sd[p + "modulation"].unsqueeze(0) + e0).chunk(6, dim=2)]
        else:
            m = (sd[p + "modulation"] + e0).chunk(6, dim=1)
        b, s = x.shape[:2]
        h = layer_norm(x, eps).float() * (1 + m[1]) + m[0]
        q = rms_norm(_linear(sd, p + "self_attn.q", h), sd[p + "self_attn.norm_q.weight"], eps).view(b, s, n, d)
        k = rms_norm(_linear(sd, p + "self_attn.k", h), sd[p + "self_attn.norm_k.weight"], eps).view(b, s, n, d)
        v = _linear(sd, p + "self_attn.v", h).view(b, s, n, d)
        y = attention(rope_apply(q, grid_sizes, freqs), rope_apply(k, grid_sizes, freqs), v, k_lens=seq_lens)
        y = _linear(sd, p + "self_attn.o", y.flatten(2))
        x = x + y * m[2]

        h = layer_norm(x, eps, sd[p + "norm3.weight"], sd[p + "norm3.bias"]) if cfg["cross_attn_norm"] else x
        q = rms_norm(_linear(sd, p + "cross_attn.q", h), sd[p + "cross_attn.norm_q.weight"], eps).view(b, -1, n, d)
        k = rms_norm(_linear(sd, p + "cross_attn.k", context), sd[p + "cross_attn.norm_k.weight"], eps)
        v = _linear(sd, p + "cross_attn.v", context).view(b, -1, n, d)
        x = x + _linear(sd, p + "cross_attn.o", attention(q, k.view(b, -1, n, d), v).flatten(2))

        h = layer_norm(x, eps).float() * (1 + m[4]) + m[3]
        y = _linear(sd, p + "ffn.2", F.gelu(_linear(sd, p + "ffn.0", h), approximate="tanh"))
        x = x + y * m[5]

    if wan22:
        m = [c.squeeze(2) for c in (sd["head.modulation"].unsqueeze(0) + e.unsqueeze(2)).chunk(2, dim=2)]
    else:
        m = (sd["head.modulation"] + e.unsqueeze(1)).chunk(2, dim=1)
    x = _linear(sd, "head.head", layer_norm(x, eps) * (1 + m[1]) + m[0])

    out = []
    for u, v in zip(x, grid_sizes.tolist()):
        u = u[:math.prod(v)].view(*v, *patch, cfg["out_dim"])
        u = torch.einsum("fhwpqrc->cfphqwr", u)
        out.append(u.reshape(cfg["out_dim"], *[i * j for i, j in zip(v, patch)]).float())
    return out
