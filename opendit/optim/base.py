"""LeanOptimizer: per-parameter updates with placed, compressed states and master weights.

A subclass names its states (`state_names`) and implements `_update(w, g, s, group, step, st)`: fp32
math on the master `w`, the fp32 gradient `g` and decoded fp32 states `s` (all shaped like the local
parameter), in place. Everything else lives here: decoding/encoding (formats.py), moving states between
host and device (offload.py), master weights (master.py), per-tensor clipping, and state_dict.

DTensor parameters (FSDP2 shards) are updated through their local shard; states exist for the local
shard only. Every state part has the shard's dim 0 as its dim 0, so state_dict() wraps parts as DTensors
with the parameter's placements and Distributed Checkpoint can save and reshard them.
"""
import torch

from opendit.distributed import local_tensor

from .formats import U16Format, detect_format, make_format, part_key
from .master import MasterWeights
from .offload import StatePlacement, pinned_empty_like

SCALAR_KEYS = ("step", "mu_product")
FORMAT_OPTIONS = ("state_dtype", "u16_block", "u16_power", "small_numel", "master_weights")


class LeanOptimizer(torch.optim.Optimizer):
    state_names: tuple = ()

    def __init__(self, params, defaults, *, state_device="gpu", seed=0):
        super().__init__(params, defaults)
        self.placement = StatePlacement(state_device)
        self.master = MasterWeights(defaults["master_weights"], seed)
        self.fused_backward = False  # set by fused_backward.attach_fused_backward
        self._index = {}
        for group in self.param_groups:
            for p in group["params"]:
                self.master.check(local_tensor(p))

    # ---- formats and storage -------------------------------------------------------------------
    def _format(self, p, group):
        return make_format(group["state_dtype"], global_numel=p.numel(), ndim=p.dim(),
                           u16_block=group["u16_block"], u16_power=group["u16_power"],
                           small_numel=group["small_numel"])

    def _host(self, st):
        return {k: v for k, v in st.items() if k not in SCALAR_KEYS}

    def _init_state(self, p, group):
        local = local_tensor(p)
        self.master.check(local)  # again here: a booster may have rebound the groups since __init__
        host_dev, pin = self.placement.host_device(local.device), self.placement.pin(local.device)
        st = {"step": torch.zeros((), dtype=torch.float32)}
        st.update(self._init_scalars())
        fmt = self._format(p, group)
        for name in self.state_names:
            for part, t in fmt.empty(local.shape, host_dev, pin).items():
                st[part_key(name, part)] = t
        for k, t in self.master.init_parts(local).items():
            st[k] = self._to_host(t, host_dev, pin)
        self.state[p] = st
        return st

    @staticmethod
    def _to_host(t, host_dev, pin):
        if not pin:
            return t.to(host_dev, copy=True)
        out = pinned_empty_like(t)
        out.copy_(t)
        return out

    def _init_scalars(self):
        return {}

    @torch.no_grad()
    def init_states(self):
        """Allocate every parameter's states now (they are otherwise created at its first update), e.g. to
        measure memory up front. Returns the number of parameters initialized."""
        fresh = [(p, g) for g in self.param_groups for p in g["params"] if p not in self.state]
        for p, group in fresh:
            self._init_state(p, group)
        return len(fresh)

    # ---- the update ----------------------------------------------------------------------------
    def prefetch(self, p):
        st = self.state.get(p)
        if st:
            self.placement.prefetch(id(p), self._host(st), local_tensor(p).device)

    @torch.no_grad()
    def update_param(self, p, group):
        """Decode p's states, apply one update from p.grad, encode them back. Used by step() and hooks."""
        local, grad = local_tensor(p), local_tensor(p.grad)
        st = self.state.get(p) or self._init_state(p, group)
        host = self._host(st)
        parts = self.placement.fetch(id(p), host, local.device)
        fmt = self._format(p, group)
        states = {n: fmt.decode({q: parts[part_key(n, q)] for q in fmt.parts}) for n in self.state_names}
        w32 = self.master.gather(local, parts)
        g32 = self._clipped(p, grad.float(), group)
        step = int(st["step"].item()) + 1
        st["step"].fill_(step)
        self._update(w32, g32, states, group, step, st)
        for n in self.state_names:
            fmt.encode(states[n], {q: parts[part_key(n, q)] for q in fmt.parts})
        self.master.scatter(w32, local, parts, (self._param_index(p), step))
        self.placement.write_back(host, parts)

    def _param_index(self, p):
        # Rebuilt on a miss: a booster may rebind the groups to sharded parameters after construction.
        if id(p) not in self._index:
            self._index = {id(q): i for i, q in enumerate(q for g in self.param_groups for q in g["params"])}
        return self._index[id(p)]

    def _clipped(self, p, g32, group):
        """Per-tensor clipping to group['per_tensor_clip'] (the norm of the whole tensor, across shards)."""
        max_norm = group.get("per_tensor_clip")
        if not max_norm:
            return g32
        norm = torch.linalg.vector_norm(p.grad, dtype=torch.float32)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        # A tensor factor, not a Python branch: no device->host sync per parameter.
        return g32 * (max_norm / (norm.to(g32.device) + 1e-6)).clamp(max=1.0)

    def multi_tensor_ready(self) -> bool:
        """True when step() updates many parameters per kernel call (AdamW with fp32 states on the device)."""
        return False

    def _update(self, w, g, s, group, step, st):
        raise NotImplementedError(f"{type(self).__name__} must implement _update")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.fused_backward:
            return loss  # every parameter was updated in its post-accumulate-grad hook
        work = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if work:
            self.prefetch(work[0][0])
        for i, (p, group) in enumerate(work):
            if i + 1 < len(work):
                self.prefetch(work[i + 1][0])  # arrives while p updates
            self.update_param(p, group)
        return loss

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self):
        self.placement.synchronize()
        index, groups, state = {}, [], {}
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = [index.setdefault(id(p), len(index)) for p in g["params"]]
            groups.append(packed)
            for p in g["params"]:
                if p in self.state:
                    state[index[id(p)]] = {k: self._wrap(p, k, v) for k, v in self.state[p].items()}
        return {"state": state, "param_groups": groups}

    @staticmethod
    def _wrap(p, key, v):
        if key in SCALAR_KEYS or not hasattr(p, "device_mesh"):
            return v
        from torch.distributed.tensor import DTensor, Replicate, Shard
        if any(not isinstance(pl, Replicate) and pl != Shard(0) for pl in p.placements):
            raise ValueError(f"optimizer states can be checkpointed for parameters sharded on dim 0 only "
                             f"(FSDP2); got placements {p.placements}")
        shape = (p.shape[0],) + tuple(v.shape[1:])
        return DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())

    def load_state_dict(self, state_dict):
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(saved_groups, self.param_groups)):
            raise ValueError("the optimizer state_dict has different param groups or group sizes than this "
                             "optimizer; build the optimizer over the same parameters in the same order")
        self.placement.synchronize()
        self.state.clear()
        for group, saved_group in zip(self.param_groups, saved_groups):
            for p, pid in zip(group["params"], saved_group["params"]):
                if pid in state_dict["state"]:
                    self._load_param(p, group, saved_group, state_dict["state"][pid])
            for k, v in saved_group.items():  # saved hyper-parameters win; the storage format stays ours
                if k != "params" and k not in FORMAT_OPTIONS:
                    group[k] = v

    @torch.no_grad()
    def _load_param(self, p, group, saved_group, saved):
        saved = {k: local_tensor(v) for k, v in saved.items()}
        local = local_tensor(p)
        st = self._init_state(p, group)
        for k in SCALAR_KEYS:
            if k in st:
                st[k].copy_(saved[k])
        fmt = self._format(p, group)
        for n in self.state_names:
            suffixes = {k[len(n) + 1:] if k != n else "" for k in saved if k == n or k.startswith(n + ".")}
            sfmt = detect_format(suffixes, saved_group.get("u16_block", 256), saved_group.get("u16_power", 3.0))
            src = {q: saved[part_key(n, q)].to(local.device) for q in sfmt.parts}
            dst = {q: st[part_key(n, q)] for q in fmt.parts}
            if type(sfmt) is type(fmt) and (not isinstance(fmt, U16Format) or (
                    sfmt.block, sfmt.power) == (fmt.block, fmt.power)):
                for q in fmt.parts:  # same format: copy the bits, so resume is exact
                    dst[q].copy_(src[q])
            else:  # another format: decode, re-encode (lossy by the new format's error)
                tmp = {q: t.to(local.device) for q, t in dst.items()}
                fmt.encode(sfmt.decode(src), tmp)
                for q in fmt.parts:
                    dst[q].copy_(tmp[q])
        self._load_master(local, st, saved)

    def _load_master(self, local, st, saved):
        have = {k for k in ("master", "master_lo") if k in saved}
        want = {k for k in ("master", "master_lo") if k in st}
        if have == want:
            for k in want:
                st[k].copy_(saved[k])
            return
        # The master mode changed: rebuild the fp32 master from what was saved, then re-split it.
        w32 = self.master.gather(local, {k: saved[k].to(local.device) for k in have})
        parts = {k: st[k].to(local.device) for k in want}
        if "master" in parts:
            parts["master"].copy_(w32)
        self.master.scatter(w32.clone(), local, parts, (0, 0))
        for k in want:
            st[k].copy_(parts[k])
