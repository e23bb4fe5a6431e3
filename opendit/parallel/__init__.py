"""Sequence parallelism (FastSeq, Ulysses) as autograd ops over a given process group.

`SequenceParallel(group, kind)` is the object a model shares with its attention layers (DiT:
`model.enable_sequence_parallel(group, kind)`): split/gather at the model's boundaries, to_heads/attend around
each attention's head-parallel middle (any layer: joint streams, q/k norm, RoPE). `validate_sp` checks flags
before any work starts; `CommCounter` tallies the bytes each collective sends; `comm_bytes_per_layer` is the
analytic volume.
See docs/sequence_parallel.md.
"""
from opendit.parallel.attention import SequenceParallel
from opendit.parallel.comm import CommCounter, all_to_all, broadcast_from_first, gather_seq
from opendit.parallel.plan import KINDS, comm_bytes_per_layer, default_sp_kind, padded_len, validate_sp
from opendit.parallel.ring import ring_gather_linear

__all__ = ["SequenceParallel", "CommCounter", "all_to_all", "broadcast_from_first", "gather_seq",
           "ring_gather_linear", "KINDS", "comm_bytes_per_layer", "default_sp_kind", "padded_len", "validate_sp"]
