"""The rule registry: for one ATen op on ONE mesh axis, the placements it can run under.

A rule receives an `OpCall` (the node's arguments with every tensor replaced by a `TInfo` that knows
its position among the node's tensor inputs and its global shape) and returns `AxisStrategy`s:

    AxisStrategy(outs=(placement of each output,), ins=(required placement of each tensor input,))

The invariant every rule promises (and `tests/test_rules.py` checks numerically): running the same op
with the same non-tensor arguments on the local shards of inputs placed as `ins` yields the local
shard of each output placed as `outs`. Partial("sum") means the local results sum to the global one.

Rules are per axis; `autopar.sharding.strategies` forms multi-axis strategies as products over axes and keeps
those whose shards divide evenly. All-Replicate is always added, so an op without a rule still runs
(replicated, with one `UnsupportedOpWarning` naming it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from autopar.placement import R
from autopar.sharding.rules.strided import node_factors


@dataclass(frozen=True)
class TInfo:
    """A tensor argument: its index among the node's tensor inputs, global shape and dtype."""
    idx: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class AxisStrategy:
    outs: tuple  # one placement per output tensor (None for a non-tensor output)
    ins: tuple   # one placement per tensor input (node.all_input_nodes order)


class OpCall:
    """A node's call with tensor arguments replaced by TInfo, as rules see it."""

    def __init__(self, node: fx.Node, val_of: Callable[[fx.Node], Any]):
        self.node = node
        self.target = node.target
        self.inputs = list(node.all_input_nodes)
        index = {n: i for i, n in enumerate(self.inputs)}

        def info(a):
            v = val_of(a)
            if isinstance(v, torch.Tensor):
                return TInfo(index[a], tuple(int(s) for s in v.shape), v.dtype)
            return v  # a non-tensor produced by another node (rare: sym ints)

        self.args = fx.node.map_arg(node.args, info)
        self.kwargs = fx.node.map_arg(node.kwargs, info)
        out = node.meta.get(VAL)
        self.multi = isinstance(out, (tuple, list))
        outs = out if self.multi else (out,)
        self.outs = tuple(
            TInfo(-1, tuple(int(s) for s in o.shape), o.dtype) if isinstance(o, torch.Tensor) else None for o in outs
        )
        # the k's of strided shards (autopar/sharding/rules/strided.py) this node may take; usually ()
        self.strided = node_factors(node, [getattr(v, "shape", None) for v in map(val_of, self.inputs)]
                                    + [o.shape for o in self.outs if o is not None])

    @property
    def out(self) -> TInfo:
        return self.outs[0]

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    def tensor_args(self) -> list[TInfo]:
        found: list[TInfo] = []
        for a in list(self.args) + list(self.kwargs.values()):
            for x in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(x, TInfo):
                    found.append(x)
        return found

    def strat(self, outs, ins: dict[int, Any] | Sequence, default=R) -> AxisStrategy:
        """Build a strategy; `ins` maps TInfo.idx -> placement (others get `default`)."""
        if isinstance(ins, dict):
            ins = tuple(ins.get(i, default) for i in range(self.num_inputs))
        outs = outs if isinstance(outs, tuple) else (outs,)
        return AxisStrategy(tuple(outs), tuple(ins))


Rule = Callable[[OpCall], list[AxisStrategy]]
RULES: dict[Any, Rule] = {}


def register(*ops):
    """Register a rule for op overload packets (aten.mm) or single overloads (aten.sum.dim_IntList)."""
    def deco(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
        return fn
    return deco


# Ops whose strategies run collectives inside the op (expert dispatch): target -> fn(node, NodeStrategy,
# axis_sizes) -> list of autopar.planning.reshard.Step. The cost model adds their time to the op's strategy and
# the plan lists them; passes/lower_collectives.py emits them.
IN_OP_COLLECTIVES: dict[Any, Callable] = {}


def register_in_op_collectives(ops, fn: Callable) -> None:
    for op in ops:
        IN_OP_COLLECTIVES[op] = fn


def in_op_collectives(node: fx.Node, strategy, axis_sizes: tuple) -> list:
    """The collectives (reshard Steps) node runs inside itself under `strategy`; usually none."""
    fn = IN_OP_COLLECTIVES.get(getattr(node, "target", None))
    return fn(node, strategy, tuple(axis_sizes)) if fn is not None else []


# Rules for whole classes of targets rather than one op: "get_attr" (a constant held by the graph)
# and torch.Tag.pointwise (any elementwise ATen op without a rule of its own).
FALLBACKS: dict[Any, Rule] = {}


def register_fallback(kind):
    """Register the rule for every target of a class: "get_attr", or an ATen tag (torch.Tag.pointwise)."""
    def deco(fn: Rule) -> Rule:
        FALLBACKS[kind] = fn
        return fn
    return deco


def find_rule(target) -> Rule | None:
    if isinstance(target, str):  # a get_attr constant, not an op
        return FALLBACKS["get_attr"]
    if target in RULES:
        return RULES[target]
    packet = getattr(target, "overloadpacket", None)
    if packet is not None and packet in RULES:
        return RULES[packet]
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return FALLBACKS[torch.Tag.pointwise]
    return None


def normalize_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


from autopar.graph import VAL
