"""Block swap: keep the weights of the last N blocks on the host and stream each to the device one block
ahead of use, in forward and in backward.

Any model that names its repeated blocks in a class attribute `_block_lists` (nn.ModuleList attribute
names, e.g. ("blocks",) for DiT or ("double_blocks", "single_blocks") for FLUX) can be swapped; blocks
are ordered as listed. Mechanism, per swapped block i:
- forward: the pre-hook of the block before it prefetches i (side stream, pinned host memory); i's pre-hook
  waits for the copy and points each parameter's .data at the device copy; i's post-hook points .data
  back at the host copy, freeing the device copy.
- autograd would keep the device copy alive through saved tensors (a Linear saves weight.t()), so while
  a swapped block runs forward, saved tensors that alias its weights are packed as references and
  rebuilt from whatever device copy is current when backward unpacks them.
- backward: an identity node on each block's output fires before that block's backward: it fetches i,
  prefetches the previous swapped block, and evicts blocks whose backward is finished (those after i).
  If an optimizer changed a weight on the device meanwhile (fused backward: the parameter's version
  counter moved), the host copy is refreshed; gradients are moved to the host beside their weights.
Activation checkpointing composes: under an outer saved-tensor hook (non-reentrant checkpoint) nothing
is packed here, and a recomputing forward (inside backward) neither evicts nor re-wraps.
On a machine without CUDA the device copies are plain clones, so the swapping is still observable.
"""
import torch

from .offload import pinned_empty_like


class _Tap(torch.autograd.Function):
    """Identity on tensors whose backward calls `fn` (once all their gradients have arrived)."""

    @staticmethod
    def forward(ctx, fn, *xs):
        ctx.fn = fn
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.fn()
        return (None, *grads)


def _tap(fn, out):
    if isinstance(out, torch.Tensor):
        return _Tap.apply(fn, out)[0] if out.requires_grad else out
    if isinstance(out, (tuple, list)):
        idx = [k for k, x in enumerate(out) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not idx:
            return out
        tapped, items = _Tap.apply(fn, *(out[k] for k in idx)), list(out)
        for k, t in zip(idx, tapped):
            items[k] = t
        return type(out)(items)
    return out


def _in_backward():
    return torch._C._current_graph_task_id() != -1


def _outer_saved_tensor_hooks():
    """The innermost active saved-tensor hooks (e.g. non-reentrant checkpointing's), or None."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False)
    except TypeError:  # older signature without the ignore_is_tracing flag
        return torch._C._autograd._top_saved_tensors_default_hooks()


class BlockSwap:
    def __init__(self, model, num_blocks: int, device=None, offload_device="cpu"):
        names = getattr(model, "_block_lists", None)
        if not names:
            raise ValueError(f"{type(model).__name__} has no `_block_lists` class attribute naming its "
                             "nn.ModuleList(s) of blocks; add e.g. _block_lists = ('blocks',)")
        self.blocks = [b for name in names for b in getattr(model, name)]
        if not 0 <= num_blocks <= len(self.blocks):
            raise ValueError(f"num_blocks={num_blocks} must be between 0 and the model's {len(self.blocks)} blocks")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.offload_device = torch.device(offload_device)
        self.swapped = list(range(len(self.blocks) - num_blocks, len(self.blocks)))
        self._slots = {i: list(self.blocks[i].parameters()) + list(self.blocks[i].buffers()) for i in self.swapped}
        skip = {id(t) for ts in self._slots.values() for t in ts}
        for t in list(model.parameters()) + list(model.buffers()):
            if id(t) not in skip:
                t.data = t.data.to(self.device)
        self._host = {i: [self._host_copy(t.data) for t in ts] for i, ts in self._slots.items()}
        for i, ts in self._slots.items():
            for t, h in zip(ts, self._host[i]):
                t.data = h
        self._resident = {}  # i -> version counters of its tensors when fetched
        self._pending = {}  # i -> (ready event or None, device copies)
        self._written = {}  # i -> event after the last device->host refresh
        self._aliases = {}  # device storage pointer -> (block, slot)
        self._ctx, self._callback_queued, self._side = {}, False, None
        self._handles = []
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(lambda m, a, i=i: self._pre(i)))
            self._handles.append(block.register_forward_hook(lambda m, a, o, i=i: self._post(i, o)))

    def _host_copy(self, t):
        if self.offload_device.type == "cpu" and torch.cuda.is_available():
            out = pinned_empty_like(t)
            out.copy_(t)
            return out
        return t.to(self.offload_device, copy=True)

    def _cuda(self):
        return self.device.type == "cuda"

    # ---- moving one block ----------------------------------------------------------------------
    def _prefetch(self, i):
        if i in self._resident or i in self._pending:
            return
        if not self._cuda():
            self._pending[i] = (None, [h.to(self.device, copy=True) for h in self._host[i]])
            return
        self._side = self._side or torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._side):
            if i in self._written:
                self._side.wait_event(self._written.pop(i))
            dev = [h.to(self.device, non_blocking=True) for h in self._host[i]]
            ready = torch.cuda.Event()
            ready.record(self._side)
        self._pending[i] = (ready, dev)

    def _fetch(self, i):
        if i in self._resident:
            return
        self._prefetch(i)
        ready, dev = self._pending.pop(i)
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
            for d in dev:
                d.record_stream(torch.cuda.current_stream(self.device))
        for k, (t, d) in enumerate(zip(self._slots[i], dev)):
            t.data = d
            if t.grad is not None and t.grad.device != self.device:
                t.grad = t.grad.to(self.device)  # gradient accumulation continues on the device
            self._aliases[d.untyped_storage().data_ptr()] = (i, k)
        self._resident[i] = [t._version for t in self._slots[i]]

    def _evict(self, i, write_back):
        versions = self._resident.pop(i)
        for t, h, v in zip(self._slots[i], self._host[i], versions):
            self._aliases.pop(t.data.untyped_storage().data_ptr(), None)
            if write_back and t._version != v:  # changed on the device (a fused optimizer step)
                h.copy_(t.data, non_blocking=self._cuda())
            t.data = h
            if t.grad is not None and t.grad.device != self.offload_device:
                t.grad = t.grad.to(self.offload_device)
        if write_back and self._cuda():
            self._written[i] = torch.cuda.Event()
            self._written[i].record(torch.cuda.current_stream(self.device))

    # ---- hooks ---------------------------------------------------------------------------------
    def _pre(self, i):
        if i in self._slots:
            self._fetch(i)
        if _in_backward():
            return  # recompute under activation checkpointing: the block is already resident
        later = [j for j in self.swapped if j > i]
        if later:
            self._prefetch(later[0])
        no_outer = _outer_saved_tensor_hooks() is None
        if i in self._slots and torch.is_grad_enabled() and no_outer:
            self._ctx[i] = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._ctx[i].__enter__()

    def _post(self, i, output):
        ctx = self._ctx.pop(i, None)
        if ctx is not None:
            ctx.__exit__(None, None, None)
        if _in_backward():
            return output
        if torch.is_grad_enabled():
            output = _tap(lambda: self._backward_pre(i), output)
        if i in self._slots:
            self._evict(i, write_back=False)
        return output

    def _backward_pre(self, i):
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        for j in [j for j in self._resident if j > i]:  # gradient has flowed past block j: its backward is done
            self._evict(j, write_back=True)
        if i in self._slots:
            self._fetch(i)
        earlier = [j for j in self.swapped if j < i]
        if earlier:
            self._prefetch(earlier[-1])

    def _end_backward(self):
        self._callback_queued = False
        for j in list(self._resident):
            self._evict(j, write_back=True)

    def _pack(self, t):
        ref = self._aliases.get(t.untyped_storage().data_ptr())
        if ref is None or t.dtype != self._slots[ref[0]][ref[1]].dtype:
            return t
        return ref, t.size(), t.stride(), t.storage_offset()

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        (i, k), size, stride, offset = packed
        self._fetch(i)
        return self._slots[i][k].data.as_strided(size, stride, offset)

    def remove(self):
        for h in self._handles:
            h.remove()
