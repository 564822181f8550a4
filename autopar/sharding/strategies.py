"""Per-node candidate strategies on the whole mesh: products of per-axis rules that shard evenly.

`NodeStrategy.outs[i]` is the spec (one placement per mesh axis) of output i; `ins[j]` the spec the
node requires of its j-th tensor input (node.all_input_nodes order). Placeholders get strategies from
`autopar.planning.problem` (parameters carry master/gradient/optimizer choices there); getitem nodes have none:
they select an output of their producer.
"""
from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.errors import UnsupportedOpWarning
from autopar.graph import is_getitem, val_of
from autopar.placement import R, divides, is_partial, kind, spec_str
from autopar.sharding.rules import AxisStrategy, OpCall, find_rule


@dataclass(frozen=True)
class NodeStrategy:
    outs: tuple   # per output: Spec or None (non-tensor output)
    ins: tuple    # per tensor input: Spec

    def __str__(self) -> str:
        outs = ",".join(spec_str(o) for o in self.outs if o is not None)
        ins = ",".join(spec_str(i) for i in self.ins)
        return f"{outs} <- {ins}"


class StrategyEnumerator:
    """Enumerates strategies per node, caching by op signature (identical layers repeat signatures)."""

    def __init__(self, axis_sizes: tuple[int, ...]):
        self.axis_sizes = tuple(axis_sizes)
        self._cache: dict[str, list[NodeStrategy]] = {}
        self.unsupported: dict[str, int] = {}
        self.cache_hits = 0
        # node -> its op signature (target, argument shapes/dtypes/values, outputs): two nodes with the
        # same signature compute the same thing, so costs may be memoized on it too
        self.signature: dict[fx.Node, str] = {}

    def __call__(self, node: fx.Node) -> list[NodeStrategy]:
        call = OpCall(node, val_of)
        key = repr((node.target, call.args, call.kwargs, call.outs, self.axis_sizes, call.strided))
        self.signature[node] = key
        if key in self._cache:
            self.cache_hits += 1
            return self._cache[key]
        self._cache[key] = result = self._enumerate(call)
        return result

    def like(self, node: fx.Node, template: fx.Node) -> list[NodeStrategy]:
        """`self(node)` for a node known to make the same call as `template` (a stamped copy of it:
        `autopar.capture.stamp`; the caller checks the op and shapes): the template's signature and
        strategy list, without building the call's signature again (what `__call__` spends its time on)."""
        if template not in self.signature:
            self(template)
        key = self.signature[node] = self.signature[template]
        self.cache_hits += 1
        name = str(node.target)
        if name in self.unsupported:
            self.unsupported[name] += 1
        return self._cache[key]

    def _axis_strategies(self, call: OpCall) -> list[AxisStrategy]:
        rule = find_rule(call.target)
        replicate = AxisStrategy(tuple(R if o is not None else None for o in call.outs), (R,) * call.num_inputs)
        if rule is None:
            name = str(call.target)
            if name not in self.unsupported:
                warnings.warn(f"autopar: no sharding rule for {name}; it runs replicated (correct, maybe "
                              "slower). Please report the op.", UnsupportedOpWarning, stacklevel=3)
            self.unsupported[name] = self.unsupported.get(name, 0) + 1
            return [replicate]
        found = rule(call)
        # a rule may rule Replicate out (a forced layout: sharding/rules/moe.py); it stays the fallback below
        seen, out = set(), [] if getattr(found, "exclusive", False) else [replicate]
        seen.update(out)
        for s in found:
            s = AxisStrategy(tuple(p if o is not None else None for p, o in zip(s.outs, call.outs)), s.ins)
            if s not in seen:
                seen.add(s)
                out.append(s)
        return out

    def _enumerate(self, call: OpCall) -> list[NodeStrategy]:
        per_axis = self._axis_strategies(call)
        in_shapes = [(tuple(int(x) for x in val_of(n).shape), val_of(n).dtype)
                     if isinstance(val_of(n), torch.Tensor) else (None, None) for n in call.inputs]
        # a strategy whose own split on one axis does not fit fits in no combination (a dim cut on several
        # axes must divide by each cut): the product runs over those that do, and a combination that cuts
        # no tensor's dim on two axes fits as each of its axes does (`divides`, `_partial_ok`): only those
        # that do are checked whole
        cut = [self._cut_dims(a, call, in_shapes) for a in per_axis]
        usable = [[(a, dims) for a, dims in zip(per_axis, cut) if self._fits(*self._on_axis(a, i, call), in_shapes)]
                  for i in range(len(self.axis_sizes))]
        result = []
        for pairs in itertools.product(*usable):
            combo = [a for a, _ in pairs]
            outs = tuple(None if call.outs[i] is None else tuple(a.outs[i] for a in combo)
                         for i in range(len(call.outs)))
            ins = tuple(tuple(a.ins[j] for a in combo) for j in range(call.num_inputs))
            if (len(pairs) == 1 or not _cut_twice([dims for _, dims in pairs])
                    or self._fits(outs, call.outs, ins, in_shapes)):
                result.append(NodeStrategy(outs, ins))
        if not result:  # an exclusive rule whose splits do not divide: run replicated
            result.append(NodeStrategy(tuple(None if o is None else (R,) * len(self.axis_sizes) for o in call.outs),
                                       ((R,) * len(self.axis_sizes),) * call.num_inputs))
        return result

    @staticmethod
    def _cut_dims(a: AxisStrategy, call: OpCall, in_shapes) -> tuple[int, ...]:
        """Per tensor `_fits` checks (outputs, then inputs with a shape), the dim `a` shards; -1 for none."""
        specs = [p for p, o in zip(a.outs, call.outs) if o is not None] + \
            [p for p, (shape, _) in zip(a.ins, in_shapes) if shape is not None]
        return tuple(p.dim if kind(p) == "S" else -1 for p in specs)

    def _on_axis(self, a: AxisStrategy, i: int, call: OpCall) -> tuple:
        """`_fits`'s first three arguments for the strategy that places every tensor as `a` on axis i and
        replicates it on the others."""
        def alone(p):
            return tuple(p if j == i else R for j in range(len(self.axis_sizes)))
        outs = tuple(None if o is None else alone(a.outs[k]) for k, o in enumerate(call.outs))
        return outs, call.outs, tuple(alone(p) for p in a.ins)

    def _fits(self, outs, out_infos, ins, in_shapes) -> bool:
        for spec, info in zip(outs, out_infos):
            if spec is None:
                continue
            if not divides(spec, info.shape, self.axis_sizes):
                return False
            if not _partial_ok(info.dtype, spec):
                return False
        for spec, (shape, dtype) in zip(ins, in_shapes):
            if shape is None:
                continue
            if not divides(spec, shape, self.axis_sizes):
                return False
            if not _partial_ok(dtype, spec):
                return False
        return True


def _cut_twice(dims: list[tuple[int, ...]]) -> bool:
    """Whether two axes' strategies (`_cut_dims` each) shard one tensor's same dim."""
    for per_tensor in zip(*dims):
        cut = [d for d in per_tensor if d >= 0]
        if len(cut) != len(set(cut)):
            return True
    return False


def _partial_ok(dtype: torch.dtype, spec) -> bool:
    """Float tensors may be any Partial; integer ones only sums (exact); bools never."""
    if dtype.is_floating_point:
        return True
    if dtype == torch.bool:
        return not any(is_partial(p) for p in spec)
    return all(p.reduce_op == "sum" for p in spec if is_partial(p))


def _producer(node: fx.Node) -> tuple[fx.Node, int]:
    if is_getitem(node):
        return node.args[0], int(node.args[1])
    return node, 0


def prune_partials(nodes: list[fx.Node], strategies: list[list[NodeStrategy]]) -> list[list[NodeStrategy]]:
    """Drop strategies whose Partial placements can only carry a Partial made for free (exact).

    A Partial on mesh axis a is *genuine* when it comes from split work: an op with a Shard input on
    axis a (a contraction split, a reduction over a sharded dim, a layer-norm backward, an
    accumulate into a Partial buffer), or a Partial input whose producer can output a genuine
    Partial of that kind. Strategies with a Shard input on axis a are always kept. Any other
    Partial was made from a Replicate value (R -> P is free) or by a factory; replacing it by
    Replicate on axis a, at every node of such a chain at once, keeps the compute and memory (P and R
    both hold the whole tensor, neither splits work) and never raises a reshard cost (R -> x is free,
    P -> x is not), so an optimal plan survives. `nodes` must be in graph (topological) order.

    The answer depends only on the strategy list and on what each input's producer can emit, so it is
    computed once per (list, emitted kinds): identical layers share both, and share the result list.
    """
    kinds: dict[fx.Node, tuple[frozenset, ...]] = {}  # node -> per output: {(axis, reduce_op)} it can emit
    memo: dict[tuple, tuple[list, tuple, list]] = {}
    out = []
    for node, strats in zip(nodes, strategies):
        emitted = tuple(_emitted(kinds, *_producer(a)) for a in node.all_input_nodes)
        key = (id(strats), emitted)
        if key not in memo:
            keep = [s for s in strats if _genuine(s, emitted)] or strats[:1]
            # holding `strats` keeps its id unique while the memo lives
            memo[key] = (keep if len(keep) < len(strats) else strats, _partial_kinds(keep), strats)
        kept, kinds[node], _ = memo[key]
        out.append(kept)
    return out


def _emitted(kinds: dict, producer: fx.Node, out: int) -> frozenset:
    per_output = kinds.get(producer, ())
    return per_output[out] if out < len(per_output) else frozenset()


def _partial_kinds(keep: list[NodeStrategy]) -> tuple[frozenset, ...]:
    """Per output: the (axis, reduce_op) pairs some kept strategy emits as a Partial."""
    num_outs = max((len(s.outs) for s in keep), default=0)
    return tuple(frozenset((a, p.reduce_op) for s in keep if s.outs[i] is not None
                           for a, p in enumerate(s.outs[i]) if kind(p) == "P") for i in range(num_outs))


def _genuine(s: NodeStrategy, emitted: tuple[frozenset, ...]) -> bool:
    axes = {a for spec in (*s.outs, *s.ins) if spec is not None for a, p in enumerate(spec) if kind(p) == "P"}
    for a in axes:
        if any(kind(spec[a]) == "S" for spec in s.ins):
            continue  # split work (a contraction, a reduction, an accumulate into a Partial buffer)
        if not any((a, spec[a].reduce_op) in emitted[j] for j, spec in enumerate(s.ins) if kind(spec[a]) == "P"):
            return False
    return True
