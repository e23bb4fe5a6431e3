"""Sequence parallelism (FastSeq, Ulysses, DSP) as autograd ops over a given process group.

A model class declares its `parallel_plan` (a `ParallelPlan`: the methods it implements, the attention layers
that attend across the split, what is split and what stays whole); `enable_sequence_parallel(model, group, kind)`
applies it, handing one hook to the model and those layers. `SequenceParallel` (FastSeq, Ulysses): split/gather
at the model's boundaries, to_heads/attend around each attention's head-parallel middle (any layer: joint
streams, q/k norm, RoPE). `DynamicSequenceParallel` is DSP for spatial-temporal models (Latte): frames split for
spatial blocks, positions for temporal ones.
`validate_sp` checks flags before any work starts; `CommCounter` tallies the bytes each collective sends;
`comm_bytes_per_layer`, `dsp_comm_bytes_per_block` and `gather_comm_bytes` are the analytic volumes.
See docs/sequence_parallel.md. CFG parallelism (sampling: guidance's two batch halves on two rank groups):
`enable_cfg_parallel`, `validate_cfg_parallel`, `sampling_mesh` (docs/sampling.md).
"""
from opendit.parallel.attention import SequenceParallel
from opendit.parallel.cfg import enable_cfg_parallel, sampling_mesh, validate_cfg_parallel
from opendit.parallel.comm import CommCounter, all_to_all, broadcast_from_first, gather_seq, pad_dim
from opendit.parallel.dsp import DynamicSequenceParallel
from opendit.parallel.model_plan import ParallelPlan, enable_sequence_parallel, plan_of
from opendit.parallel.plan import (HEAD_KINDS, KINDS, comm_bytes_per_layer, default_sp_kind, dsp_comm_bytes_per_block,
                                   gather_comm_bytes, padded_len, validate_sp)
from opendit.parallel.ring import ring_gather_linear

__all__ = ["SequenceParallel", "DynamicSequenceParallel", "ParallelPlan", "enable_sequence_parallel", "plan_of",
           "CommCounter", "all_to_all", "broadcast_from_first", "gather_seq", "pad_dim", "ring_gather_linear",
           "HEAD_KINDS", "KINDS", "comm_bytes_per_layer", "default_sp_kind", "dsp_comm_bytes_per_block",
           "gather_comm_bytes", "padded_len", "validate_sp", "enable_cfg_parallel", "sampling_mesh",
           "validate_cfg_parallel"]
