"""Forced strategies: the textbook recipes (dp, zero1/2/3, tp) as restrictions of the search space.

A recipe names, per mesh axis, what that axis may do:
    dp / zero1 / zero2 / zero3   activations split along the batch (the placement the batch split
                                 propagates to each op: Shard(batch dim), Partial for weight
                                 gradients, Replicate for parameter-only values); parameters in mode
                                 dp / zero1 / zero2 / shard(ZeRO dim) on that axis. A reduction of
                                 the inputs alone (a loss's count of non-ignored targets) and the
                                 inputs it reads may also be whole: every rank has the whole batch,
                                 so it counts them itself instead of all-reducing mid-step.
                                 Values built from no placeholder (factories such as SiLU backward's
                                 constant 1 or the causal mask, and ops on them only) are not
                                 restricted: every rank builds the part its placement holds, so
                                 the solver may build its batch share, as data parallelism does,
                                 instead of the whole batch on every rank.
    tp                           inputs replicated, no op split along the batch; weight matrices
                                 shard and read as shards, never gathered whole (the solver picks
                                 Megatron's column/row splits); vectors dp or shard.
    auto                         no restriction.
The solver still prices and chooses within the restriction, so recipes and auto share one model.
"""
from __future__ import annotations

from typing import Callable

import torch.fx as fx

from autopar.errors import InputError
from autopar.graph import ROLE, is_getitem, is_view_like, val_of
from autopar.placement import P, R, S, is_partial, is_shard
from autopar.sharding.params import ParamStrategy, zero_dim
from autopar.sharding.rules import OpCall
from autopar.sharding.strategies import StrategyEnumerator

RECIPES = ("auto", "dp", "zero1", "zero2", "zero3", "tp")
PARAM_MODE = {"dp": "dp", "zero1": "zero1", "zero2": "zero2", "zero3": "shard"}


def normalize(strategy, mesh) -> tuple[str, ...]:
    """One recipe name per mesh axis from "auto" | "dp" | ... | {axis_name: recipe}."""
    if isinstance(strategy, str):
        if strategy not in RECIPES:
            raise InputError(f"unknown strategy {strategy!r}; choose one of {', '.join(RECIPES)} "
                             "or a dict {axis_name: strategy}")
        return (strategy,) * mesh.ndim
    if isinstance(strategy, dict):
        out = ["auto"] * mesh.ndim
        for axis, name in strategy.items():
            if axis not in mesh.axis_names and not (isinstance(axis, int) and -mesh.ndim <= axis < mesh.ndim):
                raise InputError(f"strategy names mesh axis {axis!r}, but the mesh axes are {mesh.axis_names}")
            out[mesh.axis_index(axis)] = normalize(name, type("M", (), {"ndim": 1})())[0]
        return tuple(out)
    raise InputError(f"strategy must be a recipe name or a dict {{axis_name: recipe}}, got {type(strategy).__name__}")


def batch_propagation(gm: fx.GraphModule, n: int = 2, signatures: dict | None = None) -> dict[fx.Node, object]:
    """The 1-D placement each value takes when the user inputs are split along dim 0.

    Parameters and buffers start Replicate; each op takes the rule strategy that accepts its inputs'
    placements (a Replicate input may be sliced to a Shard for free) preferring Shard, then Partial,
    then Replicate outputs. Multi-output ops map to the tuple of output placements. A value computed
    from the inputs alone is Replicate where the split would make it Partial: every rank has the whole
    batch, so it computes the sum (a loss's count of targets) itself instead of all-reducing it.
    The choice depends only on the op's signature (`StrategyEnumerator.signature`, computed here when
    `signatures` lacks the node) and its inputs' placements, so it is made once per such pair.
    """
    enum = StrategyEnumerator((n,))
    memo: dict[tuple, object] = {}
    place: dict[fx.Node, object] = {}
    whole = _inputs_only(gm)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            v = val_of(node)
            batchy = node.meta.get(ROLE) == "input" and v.ndim > 0 and v.shape[0] % n == 0
            place[node] = S(0) if batchy else R
        elif is_getitem(node):
            outs = place[node.args[0]]
            place[node] = outs[node.args[1]] if isinstance(outs, tuple) else outs
        elif node.op == "call_function" and val_of(node) is not None:
            have = [place.get(a, R) for a in node.all_input_nodes]
            sig = signatures.get(node) if signatures is not None else None
            key = (sig if sig is not None else _signature(node), isinstance(val_of(node), (tuple, list)), tuple(have))
            if key not in memo:
                memo[key] = _best(enum, node, have)
            place[node] = memo[key]
            if node in whole:  # a reduction of the inputs alone (a count of targets): computed whole
                place[node] = whole_not_partial(place[node])
    return place


def whole_not_partial(outs):
    """A placement (or tuple of them) with Partial replaced by Replicate."""
    if isinstance(outs, tuple):
        return tuple(R if p is not None and is_partial(p) else p for p in outs)
    return R if is_partial(outs) else outs


def _signature(node: fx.Node) -> str:
    call = OpCall(node, val_of)
    return repr((node.target, call.args, call.kwargs, call.outs))


def _rank(outs) -> int:
    ps = [p for p in outs if p is not None]
    return 2 if any(is_shard(p) for p in ps) else 1 if any(is_partial(p) for p in ps) else 0


def _best(enum: StrategyEnumerator, node: fx.Node, have: list):
    call = OpCall(node, val_of)
    fits = [s for s in enum._axis_strategies(call)
            if all(want == got or (got == R and (is_shard(want) or want == P)) for want, got in zip(s.ins, have))]
    fits = [s for s in fits if enum._fits(tuple((p,) if p is not None else None for p in s.outs), call.outs,
                                        tuple((p,) for p in s.ins), _in_info(call))]
    if not fits or not have:  # factories (no tensor inputs) stay replicated
        return R if not call.multi else tuple(R if o is not None else None for o in call.outs)
    # exact input matches first (a free slice of a Replicate input is a last resort), then
    # Shard > Partial > Replicate outputs; max keeps the first among equals: deterministic. From replicated
    # inputs only, a Partial output comes last: e.g. SiLU's backward builds its constant 1 with
    # full_like(empty_permuted(...)); as Partial(avg) it met the sharded sigmoid in a `sub` that no strategy
    # fits, so every data-parallel recipe all-reduced a whole-batch [batch, seq, ffn] tensor twice per layer.
    replicated = all(g == R for g in have)
    best = max(fits, key=lambda s: (sum(w == g for w, g in zip(s.ins, have)),
                                    -1 if replicated and _rank(s.outs) == 1 else _rank(s.outs)))
    return best.outs if call.multi else best.outs[0]


def _in_info(call: OpCall):
    return [(tuple(int(x) for x in val_of(n).shape), val_of(n).dtype) if hasattr(val_of(n), "shape")
            else (None, None) for n in call.inputs]


def restriction(gm: fx.GraphModule, recipes: tuple[str, ...], axis_sizes: tuple[int, ...],
                propagated: dict | None = None, signatures: dict | None = None) -> Callable | None:
    """A filter `allowed(node, strategies) -> strategies` implementing the recipes, or None for auto.
    `propagated` (axis size -> `batch_propagation` result) lets several recipes share one walk;
    `signatures` (node -> op signature, see `batch_propagation`) saves recomputing them."""
    if all(r == "auto" for r in recipes):
        return None
    propagated = {} if propagated is None else propagated
    for axis, r in enumerate(recipes):
        if r != "auto" and axis_sizes[axis] not in propagated:
            propagated[axis_sizes[axis]] = batch_propagation(gm, axis_sizes[axis], signatures)
    batch = {axis: propagated[axis_sizes[axis]] for axis, r in enumerate(recipes) if r != "auto"}
    weights = {axis: _weight_views(gm, axis_sizes[axis]) for axis, r in enumerate(recipes) if r == "tp"}
    inputs_only = _inputs_only(gm)
    whole = {axis: _computed_whole(inputs_only, batch[axis]) for axis in batch}
    built = _constants(gm)

    def ok(node: fx.Node, strat, axis: int, recipe: str) -> bool:
        outs = strat.outs
        if node in built and recipe != "tp":  # every rank builds its own part: the solver picks which
            return True
        if not is_getitem(node) and node not in batch[axis]:  # a graph constant: whole on every rank
            return all(o is None or o[axis] == R for o in outs)
        want = batch[axis][node] if not is_getitem(node) else None
        if isinstance(strat, ParamStrategy):
            mode = strat.modes[axis]
            if recipe == "tp":  # Megatron: weight matrices are split; vectors may stay whole
                return mode == "shard" if node in weights[axis] else mode in ("dp", "shard")
            wanted = PARAM_MODE[recipe]
            if wanted == "shard":
                dz = zero_dim(tuple(val_of(node).shape), axis_sizes[axis])
                return (mode == "shard" and outs[0][axis] == S(dz)) if dz is not None else mode == "dp"
            return mode == wanted or (mode == "dp" and wanted != "dp" and not _zero_ok(node, axis_sizes[axis]))
        got = tuple(o[axis] if o is not None else None for o in outs)
        want = want if isinstance(want, tuple) else (want,)
        if recipe == "tp":
            return all(not (w is not None and is_shard(w) and g == w) for g, w in zip(got, want)) and \
                (node.op != "placeholder" or got[0] == R) and \
                all(is_shard(spec[axis]) for a, spec in zip(node.all_input_nodes, strat.ins) if a in weights[axis])
        return got == want or (node in whole[axis] and _whole(got))

    memo: dict[tuple, tuple[list, list]] = {}

    def allowed(node: fx.Node, strategies: list) -> list:
        # identical layers share one strategy list: filter it once per batch placement (and, for
        # parameters and inputs, whose filter reads the shape, once per shape; under tp, once per
        # pattern of which inputs are weight matrices or their views)
        key = (id(strategies), tuple(batch[a].get(node) for a, r in enumerate(recipes) if r != "auto"),
               tuple(val_of(node).shape) if node.op == "placeholder" else None,
               tuple(tuple(a in w for a in node.all_input_nodes) for w in weights.values()),
               tuple(node in w for w in whole.values()), node in built)
        if key in memo:
            return memo[key][1]
        keep = [s for s in strategies if all(ok(node, s, a, r) for a, r in enumerate(recipes) if r != "auto")]
        keep = keep or strategies[:1]  # nothing matches: the all-Replicate strategy (always first)
        memo[key] = (strategies, keep)  # holding `strategies` keeps its id unique
        return keep

    return allowed


def _is_tp_weight(node: fx.Node, n: int) -> bool:
    """A parameter the tp recipe shards on an axis of size n: a matrix with a dim n divides."""
    shape = tuple(val_of(node).shape)
    return node.meta.get(ROLE) == "param" and len(shape) >= 2 and any(d % n == 0 for d in shape)


def _weight_views(gm: fx.GraphModule, n: int) -> set[fx.Node]:
    """The tp recipe's weight matrices on an axis of size n and their views, casts and copies: what
    Megatron reads as a shard. Its ops must take these sharded on that axis; gathering a weight whole
    would be ZeRO-3, not tensor parallelism."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if _is_tp_weight(node, n):
                out.add(node)
        elif is_view_like(node) and node.all_input_nodes and node.all_input_nodes[0] in out:
            out.add(node)
    return out


def _inputs_only(gm: fx.GraphModule) -> set[fx.Node]:
    """The user inputs and the values computed from them alone (no parameter, buffer or gradient
    among their ancestors): every rank holds the whole batch, so these may be computed whole."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.meta.get(ROLE) == "input":
                out.add(node)
        elif node.op == "call_function" and node.all_input_nodes and all(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _constants(gm: fx.GraphModule) -> set[fx.Node]:
    """The values computed from no placeholder: factories (`empty_permuted`, `full`, `arange`) and the ops
    that read only such values. A batch recipe leaves their placement to the solver: held Replicate, each
    of them is built whole-batch on every rank (a [batch, seq, ffn] SiLU constant per layer: Llama-3-70B
    width x 512 H100s, zero3: 575 of its 849 ms of compute)."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and all(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _computed_whole(inputs_only: set[fx.Node], place: dict) -> set[fx.Node]:
    """What a batch recipe may compute whole (Replicate): the reductions of the inputs alone
    (`inputs_only`) that `batch_propagation` made whole (a Replicate value from a split one, such as a
    count of targets) and the input values they read. Nothing else: an input no such reduction reads
    stays split, so no rank holds (or moves to its device) more of the batch than its share."""
    out: set[fx.Node] = set()
    stack = [n for n in inputs_only if n.op == "call_function" and _whole(place.get(n))
             and any(is_shard(place.get(a)) for a in n.all_input_nodes if not isinstance(place.get(a), tuple))]
    while stack:
        node = stack.pop()
        if node not in out:
            out.add(node)
            stack.extend(a for a in node.all_input_nodes if a in inputs_only)
    return out


def _whole(p) -> bool:
    return all(q is None or q == R for q in p) if isinstance(p, tuple) else p == R


def _zero_ok(node: fx.Node, n: int) -> bool:
    return zero_dim(tuple(val_of(node).shape), n) is not None
