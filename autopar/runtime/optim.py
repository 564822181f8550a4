"""Optimizer steps at fused-kernel speed on DTensor parameters: `pmodel.optimizer(torch.optim.AdamW, lr=...)`.

An unmodified `torch.optim.AdamW(pmodel.parameters())` steps DTensors: each of its per-tensor (or
foreach) ops goes through DTensor's dispatch and sharding propagation, 141-236 µs per parameter tensor
per step on an H200 (`autopar calibrate`). `local_shard_optimizer(cls, params, ...)` returns an instance
of the same torch.optim class (param_groups, state, zero_grad, state_dict / load_state_dict and LR
schedulers are torch's own; its state is DTensors created as the unmodified optimizer creates them, so
checkpoints and DCP interchange) whose step hands torch's foreach or fused kernel each tensor's local
shard (`DTensor._local_tensor`: the same storage) instead of the DTensor. By default it asks for the
fused kernel (CPU and CUDA, floating-point parameters), else foreach: pass `fused=` or `foreach=` to choose.

Why that is the same step: Adam, AdamW and SGD are elementwise in (parameter, gradient, states), and
every tensor of one parameter has the parameter's placements. The runtime reduces each gradient to its
parameter's master spec before p.grad sees it (the all-reduce of dp, ZeRO's reduce-scatter; a pipeline's
deferred all-reduce and micro-batch mean run in train_step, before it returns), and the states are
`zeros_like(p)`. A gradient with other placements (a hook that redistributed it) is redistributed to
its parameter's first, as DTensor would. A replicated parameter's ranks hold the same gradient and
states and take the same step.

Gradient clipping: `torch.nn.utils.clip_grad_norm_(pmodel.parameters(), ...)` stays correct on SPMD
plans (DTensor reduces the norms), at DTensor speed; on a pipelined plan it sees only this rank's stage.
`optimizer.clip_grad_norm_(max_norm)` clips on the local shards: each element counted once (on
replicated mesh axes by the coordinate-0 rank, a parameter shared by pipeline stages by its owner),
one all_reduce over the world.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from autopar import _torch_compat as compat
from autopar.errors import InputError

SUPPORTED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
FUSED_DEVICES = ("cpu", "cuda")   # device types with torch's fused Adam/AdamW/SGD kernels
_CLASSES: dict[type, type] = {}


class LocalShardSteps(compat.InitGroupHook):
    """Mixin before a torch.optim class (`local_shard_class`): steps local shards, clips them.

    torch's `_init_group` costs ~2 µs more per DTensor than per plain tensor (`p.grad`, `torch.is_complex`
    and `.is_sparse` go through the subclass's Python checks), so once every parameter of a group has a
    gradient and its states (every list item set), the group's lists of local shards are kept and reused
    (`_reuse`): a step then reads only each new gradient's local shard. `load_state_dict` and
    `add_param_group` drop what was kept; so does a group whose parameters or state-shaping options change
    (a state tensor replaced by hand in `optimizer.state` is not seen: load a state dict instead)."""

    _uncounted: frozenset = frozenset()    # ids of parameters another rank counts in the norm
    _writes_state_by_param = False         # SGD: step() stores new momentum buffers under its list's items
    _kept: dict | None = None              # id(group) -> (key, lists but the gradients, _init_group's result)

    def _key(self, group) -> tuple:
        """What the kept lists depend on, besides the gradients."""
        return (id(self.state), id(group["params"]), len(group["params"]), group.get("amsgrad"),
                group.get("momentum"), group.get("fused"), group.get("capturable"))

    def _reuse(self, group, lists):
        kept = self._kept.get(id(group)) if self._kept else None
        if kept is None or kept[0] != self._key(group):
            return None
        grads = [p.grad for p in group["params"]]
        if any(g is None for g in grads):
            return None
        lists[1][:] = compat.local_tensors(self._matched(group["params"], grads))
        for items, same in zip(lists, kept[1]):
            if same is not None:
                items[:] = same
        if self._writes_state_by_param:
            self._stepped.extend(group["params"])
        return kept[2]

    def _gathered(self, group, lists, result) -> None:
        """torch.optim's per-tensor lists of one param group, each DTensor replaced by its local shard."""
        params = lists[0]
        lists[1][:] = self._matched(params, lists[1])
        if self._writes_state_by_param:
            self._stepped.extend(params)
        for items in lists:
            items[:] = compat.local_tensors(items)
        if len(params) == len(group["params"]) and not any(t is None for items in lists for t in items):
            if self._kept is None:
                self._kept = {}
            self._kept[id(group)] = (self._key(group), [None if k == 1 else list(items) for k, items in enumerate(lists)],
                                     result)

    @staticmethod
    def _matched(params: list, grads: list) -> list:
        """The gradients, each with its parameter's placements (redistributed where a hook changed them)."""
        for i, (p, g) in enumerate(zip(params, grads)):
            if isinstance(g, DTensor):
                gp, pp = compat.dtensor_spec(g).placements, compat.dtensor_spec(p).placements
                if gp is not pp and gp != pp:   # the runtime's gradients share their parameter's tuple
                    grads[i] = g.redistribute(p.device_mesh, p.placements)
        return grads

    def step(self, closure=None):
        self._stepped = []
        loss = super().step(closure)
        for p in self._stepped:   # SGD keyed a momentum buffer by the local shard: hand a new one to p
            state = self.state.pop(compat.local_tensor(p), None) if isinstance(p, DTensor) else None
            if state and self.state[p].get("momentum_buffer") is None:
                self.state[p]["momentum_buffer"] = compat.dtensor_grad(state["momentum_buffer"],
                                                                       compat.dtensor_spec(p))
        return loss

    def load_state_dict(self, state_dict) -> None:
        self._kept = None
        super().load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        self._kept = None
        super().add_param_group(param_group)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """`torch.nn.utils.clip_grad_norm_` over this optimizer's parameters, on their local gradient shards:
        the total norm of the whole model's gradients (the same on every rank; a collective, every rank
        calls it), and every gradient scaled by min(1, max_norm / (norm + 1e-6)). Returns the norm."""
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p in params:
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        grads = [compat.local_tensor(p.grad) if isinstance(p.grad, DTensor) else p.grad for p in params]
        counted = [g for p, g in zip(params, grads) if _counted(p) and id(p) not in self._uncounted]
        norm_type = float(norm_type)
        device = self.param_groups[0]["params"][0].device   # a rank without gradients still joins the reduction
        norm = (torch.nn.utils.get_total_norm(counted, norm_type) if counted
                else torch.zeros((), device=device)).to(device=device, dtype=torch.float32)
        if dist.is_initialized():
            if math.isinf(norm_type):
                dist.all_reduce(norm, op=dist.ReduceOp.MAX)
            else:
                norm = norm ** norm_type
                dist.all_reduce(norm)
                norm = norm ** (1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite, so they "
                               "cannot be clipped; pass error_if_nonfinite=False to clip anyway")
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for same in _by_device_dtype(grads):
            compat.foreach_mul_(same, scale.to(device=same[0].device, dtype=same[0].dtype))
        return norm


def local_shard_class(cls: type) -> type:
    """`cls` (torch.optim.Adam, AdamW, SGD or a subclass) with steps on local shards (`LocalShardSteps`)."""
    if not (isinstance(cls, type) and issubclass(cls, SUPPORTED)):
        raise InputError(f"pmodel.optimizer() steps local shards with {', '.join(c.__name__ for c in SUPPORTED)} "
                         f"(or a subclass), not {cls!r}: build that one as cls(pmodel.parameters(), ...) instead "
                         "(it steps the DTensors, slower but correct)")
    if cls not in _CLASSES:
        attrs = {"_writes_state_by_param": issubclass(cls, torch.optim.SGD), "__module__": __name__,
                 "__doc__": f"{cls.__name__} stepping the local shards of DTensor parameters (autopar.runtime.optim)."}
        _CLASSES[cls] = type(f"LocalShard{cls.__name__}", (LocalShardSteps, cls), attrs)
    return _CLASSES[cls]


def local_shard_optimizer(cls: type, params, *, uncounted=(), **options) -> torch.optim.Optimizer:
    """A `cls` optimizer over `params` (parameters or param-group dicts, as torch.optim takes them) that
    steps their local shards; `options` are cls's (lr, betas, weight_decay, amsgrad, maximize, foreach,
    fused, ...). Neither `fused` nor `foreach` given: fused where torch has the kernel, else foreach.
    `uncounted`: parameters whose gradient another rank counts in `clip_grad_norm_` (a pipeline's shared
    parameters off their owner)."""
    params = list(params)
    if "fused" not in options and "foreach" not in options and not options.get("differentiable"):
        options["fused"] = _fused_supported(params)
        options["foreach"] = None if options["fused"] else True
    opt = local_shard_class(cls)(params, **options)
    opt._uncounted = frozenset(id(p) for p in uncounted)
    return opt


def _fused_supported(params: list) -> bool:
    tensors = [t for item in params for t in (item["params"] if isinstance(item, dict) else [item])]
    return all(t.device.type in FUSED_DEVICES and t.is_floating_point() for t in tensors)


def _counted(p: torch.Tensor) -> bool:
    """Whether this rank counts p's local gradient in a norm: a plain tensor yes; a DTensor when this rank
    is coordinate 0 of every mesh axis p is replicated on (each distinct element counted once)."""
    if not isinstance(p, DTensor):
        return True
    coords = p.device_mesh.get_coordinate()
    return all(c == 0 for c, pl in zip(coords, p.placements) if isinstance(pl, Replicate))


def _by_device_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


# the built-in ones by name, so an optimizer of theirs pickles like torch's
LocalShardAdam = local_shard_class(torch.optim.Adam)
LocalShardAdamW = local_shard_class(torch.optim.AdamW)
LocalShardSGD = local_shard_class(torch.optim.SGD)
