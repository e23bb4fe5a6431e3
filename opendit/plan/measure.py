"""What the planner knows of a run's model, from real tensors: parameter counts by block (the model built on the
meta device, no storage, so a 14B model fits a laptop) and the bytes autograd saves for backward, by block.

Activations are measured, not derived from formulas: a forward of the family's model with only the first two
blocks of each block list, on the meta device at two small latent sizes, records every tensor autograd saves
(each storage once, the weights excluded) and in which block; the bytes are then fitted as a + b x latent area
per block and read at the run's size. Only the token count changes between the two sizes (same widths, same
text length), and with attention counted as FlashAttention / SDPA's flash kernels keep it (q, k, v, output, an
fp32 log-sum-exp per row; never an L x L matrix; the CPU's SDPA picks its flash kernel too) everything a block
saves is linear in its tokens, except an attention mask a model gives SDPA: the memory-efficient kernel keeps it as
an additive bias of its own shape (an L x L mask: square in the tokens, fitted so). The meta device runs no
arithmetic, so the measurement takes a second for any model. Blocks after the second of a list are taken to save
what the second saves (the first may differ: its input comes from the embedding, in the compute dtype). The inputs
themselves are real host tensors (_HostInputs): what a model or its feed reads of their values (a prompt mask's
lengths, the tokens a boolean mask selects, whether an image embedding is all zeros) it reads as in training, where
meta tensors have no values to read.
"""
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from opendit.booster import parallelize as par
from opendit.booster.precision import cast_forward_io
from opendit.lora.run import adapt_model

HOST_REAL = 2 ** 22  # elements up to which an op of host tensors alone runs for real while measuring (_HostInputs)
SMALL_SIDES = (16, 32)  # latent sides of the two measured sizes: multiples of every registered patch size, and
# large enough that a model padding its tokens to multiples of 32 pads neither


@dataclass
class BlockActs:
    """Bytes for a micro-batch of one sample: `kept` saved inside the block (its own input included when it saves
    it; its attention masks' too), `inputs` the block's tensor arguments (what a checkpointed block keeps), `masks`
    the part of `kept` that its attention masks take."""
    kept: float
    inputs: float
    masks: float = 0.0


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
    """Attention as SDPA's fused kernels keep it for backward: q, k, v, the output and an fp32 log-sum-exp [B, H, Nq];
    given a mask (the memory-efficient kernel's case: flash takes none), also the mask as an additive bias in q's
    dtype, of the mask's shape (a boolean mask is converted to one). Biases made here are noted in MASKS."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        bias = () if mask is None else (mask if mask.dtype == q.dtype else
                                        torch.empty(mask.shape, dtype=q.dtype, device=q.device),)
        MASKS.update(b.untyped_storage()._cdata for b in bias)
        ctx.save_for_backward(q, k, v, out, lse, *bias)
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, None


MASKS = set()  # storages of the attention biases _FlashLike keeps (their bytes grow with the square of the tokens)


def _flash_like(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
    return _FlashLike.apply(query, key, value, attn_mask)  # SDPA's own argument names: diffusers passes them by keyword


class _HostInputs(TorchDispatchMode):
    """A forward of meta weights on real host inputs: an op that meets a meta tensor, or a host tensor of more than
    HOST_REAL elements (an L x L attention mask: real work for no value the model reads), runs on the meta device
    (its host tensors moved there: their shapes only); an op of small host tensors alone runs for real (prompt
    masks, position ids, timesteps)."""

    def __init__(self):
        super().__init__()
        self.bases = {}  # (host storage, dtype) -> (a host tensor on it, kept alive; its meta twin)

    def meta(self, t: torch.Tensor) -> torch.Tensor:
        """t on the meta device, one storage per host storage (as views of one tensor share it on the device)."""
        if t.is_meta:
            return t
        key = (t.untyped_storage()._cdata, t.dtype)
        if key not in self.bases:
            twin = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype, device="meta")
            self.bases[key] = (t, twin)
        return self.bases[key][1].as_strided(t.shape, t.stride(), t.storage_offset())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_meta = func is torch.ops.aten._to_copy.default and kwargs.get("device") == torch.device("meta")
        if to_meta and kwargs.get("dtype") in (None, args[0].dtype):  # x.to(a meta tensor's device): a twin
            return self.meta(args[0])
        if to_meta or any(isinstance(t, torch.Tensor) and (t.is_meta or t.numel() > HOST_REAL)
                          for t in pytree.tree_leaves((args, kwargs))):
            if func in _INDEXING:  # a host boolean mask selects on the host (the meta device cannot count it)
                args = (args[0], [i for t in args[1] for i in _as_positions(t)], *args[2:])
            args, kwargs = pytree.tree_map_only(torch.Tensor, self.meta, (args, kwargs))
            if kwargs.get("device") is not None:  # a meta result (e.g. x.type_as(a host tensor)) stays meta
                kwargs["device"] = torch.device("meta")
        return func(*args, **kwargs)


_INDEXING = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default)


def _as_positions(index) -> list:
    """An index of aten.index: a host boolean mask as the positions it selects, one long tensor per dimension."""
    if index is None or index.is_meta or index.dtype != torch.bool:
        return [index]
    return list(index.nonzero().unbind(1))


def saved_bytes(model: nn.Module, inputs: dict) -> tuple[float, list[BlockActs]]:
    """(root bytes, per block BlockActs) autograd saves in one forward of `model(**inputs)`."""
    blocks = list(par.iter_blocks(model))
    owner, kept, ins, masks, seen = [None], [0] * len(blocks), [0] * len(blocks), [0] * len(blocks), set()
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
                masks[owner[-1]] += size if key in MASKS else 0
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
        MASKS.clear()
        for h in handles:
            h.remove()
    return root[0], [BlockActs(k, i, m) for k, i, m in zip(kept, ins, masks)]


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
    latent side of at most SMALL_SIDES[-1] is measured as it is."""
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
        with _HostInputs():
            root, acts = saved_bytes(model, family.memory_inputs(small_cfg, model, shape, 1, torch.device("cpu")))
        points.append((shape[-1] * shape[-2], root, acts))
    root, acts = _fit(points, latent_shape[-1] * latent_shape[-2])
    return root, _expand(acts, lengths)


def _fit(points, area: float) -> tuple[float, list[BlockActs]]:
    """Each number as a + b x area through the measured points (one point: taken as it is); attention masks as
    (a + b x area)^2: their sides are the tokens (the latent's, linear in the area, and the text's)."""
    if len(points) == 1:
        return points[0][1], points[0][2]
    (a1, r1, b1), (a2, r2, b2) = points
    at = lambda y1, y2: y1 + (y2 - y1) * (area - a1) / (a2 - a1)  # noqa: E731
    out = []
    for x, y in zip(b1, b2):
        masks = at(x.masks ** 0.5, y.masks ** 0.5) ** 2
        out.append(BlockActs(at(x.kept - x.masks, y.kept - y.masks) + masks, at(x.inputs, y.inputs), masks))
    return at(r1, r2), out


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
