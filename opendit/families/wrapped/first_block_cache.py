"""sample.py --cache fbcache for the diffusers-transformer kind: diffusers' own First Block Cache (its hooks on the
blocks its TransformerBlockRegistry knows), on for one pipeline call: every denoising evaluation runs the first
block; while the relative mean change of its residual since the last full evaluation stays at or below the
threshold, the other blocks are skipped and their last residual reused.

Pipelines with true CFG name a cache context per branch ("cond", "uncond"), so each keeps its own state; for one
that names none the whole call runs in one context. The hooks are added before the call and removed after it:
every batch starts fresh, as without the cache. Models whose blocks diffusers' hook cannot run are refused with
the reason (_unsupported).
"""
import inspect
from contextlib import contextmanager

DEFAULT_THRESHOLD = 0.05  # diffusers' FirstBlockCacheConfig default


@contextmanager
def first_block_cache(model, threshold: float | None):
    """`model` (a diffusers transformer) with diffusers' First Block Cache at `threshold` inside; None: as it is."""
    if threshold is None:
        yield
        return
    from diffusers.hooks import FirstBlockCacheConfig, HookRegistry, apply_first_block_cache
    from diffusers.hooks.first_block_cache import _FBC_BLOCK_HOOK, _FBC_LEADER_BLOCK_HOOK
    from diffusers.models.cache_utils import CacheMixin

    why = _unsupported(model)
    if why:
        raise ValueError(f"--cache fbcache: diffusers' First Block Cache cannot run {type(model).__name__}: {why}; "
                         f"leave --cache out")
    try:
        apply_first_block_cache(model, FirstBlockCacheConfig(threshold=threshold))
        # the hooks stale the list of hooked modules an earlier cache_context kept (as diffusers' enable_cache says)
        HookRegistry.check_if_exists_or_initialize(model).invalidate_child_registries_cache()
        with CacheMixin.cache_context(model, "sample"):  # a pipeline's own contexts replace it while they last
            yield
    finally:
        registry = HookRegistry.check_if_exists_or_initialize(model)
        for name in (_FBC_LEADER_BLOCK_HOOK, _FBC_BLOCK_HOOK):
            registry.remove_hook(name, recurse=True)
        registry.invalidate_child_registries_cache()


def _unsupported(model) -> str:
    """Why diffusers' hooks cannot run the model's blocks ("" if they can): a block class diffusers has no metadata
    for (HunyuanVideo-1.5), or whose input it cannot find (Z-Image's blocks name theirs x), or a first block
    returning text and image tokens apart while the last returns the joint sequence (FLUX.2's double and single
    blocks: diffusers 0.42's tail hook then subtracts a pair from a tensor)."""
    import torch.nn as nn
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
    from diffusers.hooks._helpers import TransformerBlockRegistry

    blocks = [block for name, child in model.named_children()
              if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, nn.ModuleList) for block in child]
    if not blocks:
        return "it has no block list diffusers' hooks look for"
    try:
        head, tail = (TransformerBlockRegistry.get(type(b)) for b in (blocks[0], blocks[-1]))
    except ValueError:
        return f"diffusers has no metadata for its {type(blocks[0]).__name__} blocks"
    if any("hidden_states" not in inspect.signature(type(b).forward).parameters for b in (blocks[0], blocks[-1])):
        return f"its {type(blocks[0]).__name__} blocks take no hidden_states argument, which diffusers' hook reads"
    if (head.return_encoder_hidden_states_index is None) != (tail.return_encoder_hidden_states_index is None):
        return ("its first block returns text and image tokens apart and its last one the joint sequence, which "
                "diffusers' hook cannot subtract")
    return ""
