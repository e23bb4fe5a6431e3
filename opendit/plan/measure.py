"""What the planner knows of a run's model, from real tensors: parameter counts by block (the model built on the
meta device, no storage, so a 14B model fits a laptop) and the bytes autograd saves for backward, by block.

Activations are measured, not derived from formulas: a forward of the family's model with only the first two
blocks of each block list, on the meta device at two small latent sizes, records every tensor autograd saves
(each storage once, the weights excluded) and in which block; the bytes are then fitted as a + b x latent area
per block and read at the run's size. Only the token count changes between the two sizes (same widths, same
text length), and with attention counted as FlashAttention / SDPA's flash kernels keep it (q, k, v, output, an
fp32 log-sum-exp per row; never an L x L matrix; the CPU's SDPA picks its flash kernel too) everything a block
saves is linear in its tokens. The meta device runs no arithmetic, so the measurement takes a second for any
model. Blocks after the second of a list are taken to save what the second saves (the first may differ: its
input comes from the embedding, in the compute dtype).
"""
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from opendit.booster import parallelize as par
from opendit.booster.precision import cast_forward_io
from opendit.lora.run import adapt_model

SMALL_SIDES = (8, 16)  # latent sides of the two measured sizes (multiples of every registered patch size)


@dataclass
class BlockActs:
    """Bytes for a micro-batch of one sample: `kept` saved inside the block (its own input included when it saves
    it), `inputs` the block's tensor arguments (what a checkpointed block keeps)."""
    kept: float
    inputs: float


@dataclass
class ModelFacts:
    """Parameter counts of the run's model (LoRA adapters included) and its measured activations at batch 1."""
    params: int  # every parameter
    trainable: int
    frozen_bytes: int  # bytes of the frozen parameters as stored (a LoRA run's base)
    blocks: list[int]  # parameters per block, forward order over every block list
    block_trainable: list[int]
    largest: int  # the largest trainable tensor of a block: it sizes the offloaded optimizer's GPU working set
    shapes: list[tuple[int, ...]]  # trainable parameter shapes, for the optimizer's state bytes
    root_acts: float  # bytes saved outside the blocks
    acts: list[BlockActs]  # per block, forward order
    flops: float  # training FLOPs per sample (the family's count), for the cost model


class _FlashLike(torch.autograd.Function):
    """Attention as the flash kernels keep it for backward: q, k, v, the output and an fp32 log-sum-exp [B, H, Nq]."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out, torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device))
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, None, None


def _flash_like(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
    return _FlashLike.apply(query, key, value)  # SDPA's own argument names: diffusers passes them by keyword


def saved_bytes(model: nn.Module, inputs: dict) -> tuple[float, list[BlockActs]]:
    """(root bytes, per block BlockActs) autograd saves in one forward of `model(**inputs)`."""
    blocks = list(par.iter_blocks(model))
    owner, kept, ins, seen = [None], [0] * len(blocks), [0] * len(blocks), set()
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    root = [0]

    def enter(i):
        def hook(_module, args, kwargs):
            owner.append(i)
            ins[i] = sum(a.untyped_storage().nbytes() for a in (*args, *kwargs.values())
                         if torch.is_tensor(a) and (a.is_floating_point() or a.is_complex()))
        return hook

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in seen and key not in weights:
            seen.add(key)
            size = t.untyped_storage().nbytes()
            if owner[-1] is None:
                root[0] += size
            else:
                kept[owner[-1]] += size
        return t

    def leave(*_):
        owner.pop()

    handles = [h for i, b in enumerate(blocks) for h in (b.register_forward_pre_hook(enter(i), with_kwargs=True),
                                                         b.register_forward_hook(leave))]
    sdpa, F.scaled_dot_product_attention = F.scaled_dot_product_attention, _flash_like
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**inputs)
    finally:
        F.scaled_dot_product_attention = sdpa
        for h in handles:
            h.remove()
    return root[0], [BlockActs(k, i) for k, i in zip(kept, ins)]


def _two_per_list(model: nn.Module) -> list[int]:
    """Keep the first two blocks of each block list (in place); -> each list's full length."""
    lengths = []
    for name in model._block_lists:
        blocks = getattr(model, name)
        lengths.append(len(blocks))
        setattr(model, name, nn.ModuleList(list(blocks)[:2]))
    return lengths


def measure_acts(family, cfg, latent_shape, dtype: torch.dtype) -> tuple[float, list[BlockActs]]:
    """Root and per-block activation bytes at batch 1 for the run's latent shape (see the module docstring); a
    latent side of at most 16 is measured as it is."""
    side = latent_shape[-1]
    factor = cfg.image_size // side  # pixels per latent row: the VAE's downsampling (1 in pixel space)
    points = []
    for small in (SMALL_SIDES if side > SMALL_SIDES[-1] else (side,)):
        small_cfg = dataclasses.replace(cfg, image_size=small * factor)
        shape = family.memory_probe(small_cfg, torch.device("meta")).latent_shape
        with torch.device("meta"):
            model = family.memory_model(small_cfg, shape).to(dtype)
            if cfg.lora_rank:  # frozen Linears keep no input for a weight gradient: measure with the adapters
                adapt_model(model, family, small_cfg, dtype)
        lengths = _two_per_list(model)
        if dtype != torch.float32:
            cast_forward_io(model, dtype)  # bf16 weights take fp32 inputs as the ddp plugin feeds them
        model.train()
        root, acts = saved_bytes(model, family.memory_inputs(small_cfg, model, shape, 1, torch.device("meta")))
        points.append((shape[-1] * shape[-2], root, acts))
    root, acts = _fit(points, latent_shape[-1] * latent_shape[-2])
    return root, _expand(acts, lengths)


def _fit(points, area: float) -> tuple[float, list[BlockActs]]:
    """Each number as a + b x area through the measured points (one point: taken as it is)."""
    if len(points) == 1:
        return points[0][1], points[0][2]
    (a1, r1, b1), (a2, r2, b2) = points
    at = lambda y1, y2: y1 + (y2 - y1) * (area - a1) / (a2 - a1)  # noqa: E731
    return at(r1, r2), [BlockActs(at(x.kept, y.kept), at(x.inputs, y.inputs)) for x, y in zip(b1, b2)]


def _expand(acts: list[BlockActs], lengths: list[int]) -> list[BlockActs]:
    """Two measured blocks per list -> every block: the second stands for the rest of its list."""
    out, at = [], 0
    for n in lengths:
        mine = acts[at:at + min(n, 2)]
        out += mine + [mine[-1]] * (n - len(mine))
        at += len(mine)
    return out


def model_facts(family, cfg, latent_shape, compute: torch.dtype) -> ModelFacts:
    """The run's model on the meta device (with its LoRA adapters) and its activations measured in `compute`."""
    with torch.device("meta"):
        model = family.memory_model(cfg, latent_shape)
        if cfg.lora_rank:
            adapt_model(model, family, cfg, compute)
    blocks = list(par.iter_blocks(model))
    trainable = [p for p in model.parameters() if p.requires_grad]
    root, acts = measure_acts(family, cfg, latent_shape, compute)
    return ModelFacts(
        params=sum(p.numel() for p in model.parameters()), trainable=sum(p.numel() for p in trainable),
        frozen_bytes=sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad),
        blocks=[sum(p.numel() for p in b.parameters()) for b in blocks],
        block_trainable=[sum(p.numel() for p in b.parameters() if p.requires_grad) for b in blocks],
        largest=max((p.numel() for b in blocks for p in b.parameters() if p.requires_grad), default=0),
        shapes=[tuple(p.shape) for p in trainable], root_acts=root, acts=acts,
        flops=family.train_flops_per_sample(model))
