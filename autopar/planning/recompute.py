r"""Activation recompute as a solver decision: keep a layer's activations for backward, or run its
forward again in backward and keep only its inputs and outputs.

A *layer* is one numbered block of a layer stack ("transformer.h.3", keyed as `graph.layer_of`).
Recomputing layer l (`copied_nodes`) re-runs, right before their first use in backward, the forward
ops of l that backward reads directly or through other re-run ops, except l's outputs to later
layers (the checkpoints) and random ops (dropout: the original mask is kept, never redrawn).

The model. With x[i,s] the strategy variables of `autopar.planning.solver` and a binary r_l per layer,
node i of layer l keeps a0_i[s] bytes of activations when l is kept and a1_i[s] when l is
recomputed; a re-run op adds its forward seconds c_i[s] and repeats the reshards of its inputs
R_ui[s,t] (ZeRO-3 gathers, TP all-reduces). Linearized with z[i,s] = x[i,s] r_l:

    minimise    ... + Σ_l Σ_(i re-run in l) Σ_s c_i[s] z[i,s] + Σ_(u,i) Σ_(s,t) R_ui[s,t] w[u,i,s,t]
    memory row  ... + Σ_i Σ_s (a0_i[s] (x[i,s] - z[i,s]) + a1_i[s] z[i,s]) <= budget
    z[i,s] <= x[i,s],  z[i,s] <= r_l,  z[i,s] >= x[i,s] + r_l - 1   (w likewise from e and r_l)

`expand` writes this as a plain `CostGraph`, so every solver path (DP, Lagrangian, ILP, layer
tiling, brute force) honours it unchanged: node i of l gets strategies (s, r) for r in {0, 1}, i.e.
x[i,s,0] = x[i,s] - z[i,s] and x[i,s,1] = z[i,s]; a two-strategy node r_l joins every such node by
an edge that forbids (inf) a different r; input edges of a re-run op cost R (1 + r). Tiling solves
identical layers as one, hence all-or-none per class (the solver's budget-free relaxation is solved
on the r = 0 half alone, `kept_half`: without a memory row recomputing never pays); `_refine` then picks, for the chosen
strategies, the cheapest set of layers to recompute (an exact knapsack over layers, solved by
`solver.solve`), so the plan recomputes only as many layers as the budget forces, the lowest first:
their recomputed values live while the later layers' activations are already freed.

The last layer of each stack is never recomputed (`last_layers`): its backward runs first, so its
re-run values would live at the same moment as its kept ones. With that, and the lowest layers
recomputed first, the peak stays at the end of forward, which is what the memory row counts;
`transient` adds what re-run values exceed it by otherwise (a forced list of layers), and the final
plan is checked against the budget with it. Approximation (conservative): a layer output, or a value
outside every layer, that a re-run layer reads in backward counts as kept whatever that layer decides.
Measured on autopar/_testing/gpt.py (4 layers, width 64, one device): the peak of live activation bytes
(`autopar.runtime.memtrack`) is 1.03x / 1.06x / 1.09x the prediction with 0 / 2 / 3 layers recomputed.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch.fx as fx

from autopar.costmodel.memory import format_bytes
from autopar.errors import InfeasiblePlanError, InputError
from autopar.graph import MASK, PHASE, is_getitem, is_random, layer_of, nbytes_of, node_path, reads_in_backward, val_of
from autopar.placement import local_fraction
from autopar.planning.costgraph import CostEdge, CostGraph, CostNode, Solution
from autopar.planning.problem import saved_values
from autopar.planning.solver import evaluate, min_memory, restrict, solve

MODES = ("auto", "none", "all")


@dataclass(frozen=True)
class RecomputeDecision:
    """Which layers recompute, and what that adds to the plan's totals (seconds, bytes)."""
    paths: tuple[str, ...] = ()
    compute: float = 0.0        # re-run forward ops
    comm: float = 0.0           # repeated forward collectives
    activations: float = 0.0    # change of the activations kept (negative: saved)
    edges: tuple[int, ...] = ()  # indices of `CostProblem.edges` whose reshard runs again in backward


@dataclass
class Expanded:
    """The cost graph with recompute choices (`expand`), and how to read a solution of it back."""
    cg: CostGraph
    sizes: list[int]                       # strategies per node of the original graph
    hubs: dict[str, int]                   # layer path -> index of its r node
    doubled: dict[str, list[int]]          # layer path -> nodes with strategies (s, r)
    copied: dict[str, set[int]]            # layer path -> nodes whose op runs again
    repeated: dict[str, list[int]] = field(default_factory=dict)  # layer path -> edge indices repeated
    act: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # node -> kept bytes (r=0, r=1)
    last: dict[str, list[tuple[int, np.ndarray]]] = field(default_factory=dict)  # stack -> its last layer's
    #                                                     (node, kept bytes per strategy)


def normalize(mode, paths: list[str]) -> str | tuple[str, ...]:
    """None -> "auto"; "auto" | "none" | "all"; or a list of layer paths (checked against `paths`)."""
    if mode is None:
        return "auto"
    if isinstance(mode, str):
        if mode not in MODES:
            raise InputError(f"recompute={mode!r}: use one of {MODES}, None, or a list of layer paths")
        return mode
    wanted = tuple(mode)
    unknown = [p for p in wanted if p not in paths]
    if unknown:
        raise InputError(f"recompute: {unknown} are not layers of this model; layers: {paths}")
    return wanted


# ---------------------------------------------------------------------------- graph analysis
def layer_nodes(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Forward ops per layer path ("transformer.h.3"), in graph order."""
    out: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.meta.get(PHASE) == "forward":
            key = layer_of(node_path(node))
            if key is not None:
                out.setdefault(f"{key[0]}.{key[1]}", []).append(node)
    return out


def last_layers(gm: fx.GraphModule) -> set[str]:
    """The last layer of each stack: never recomputed. Its backward runs first, right after forward,
    so re-running it would hold the same values at the same moment: time spent, no peak lowered."""
    top: dict[str, int] = {}
    for path in layer_nodes(gm):
        container, _, index = path.rpartition(".")
        top[container] = max(top.get(container, -1), int(index))
    return {f"{c}.{i}" for c, i in top.items()}


def copied_nodes(nodes: list[fx.Node]) -> list[fx.Node]:
    """The ops of one layer (`nodes`, forward, graph order) that backward runs again: those that
    backward reads, and their inputs inside the layer, transitively; never a layer output (read by
    forward ops outside the layer or the graph output) nor a random op, a getitem of one, or a
    dropout mask's boolean copy (`autopar.capture.dropout_masks`: kept in 1 byte as the draw's stand-in)."""
    inside = set(nodes)
    ok: set[fx.Node] = set()
    for v in nodes:  # graph order: a getitem's producer is decided first
        if not (_is_layer_output(v, inside) or is_random(v) or v.meta.get(MASK)
                or (is_getitem(v) and v.args[0] not in ok)):
            ok.add(v)
    need = {v for v in ok if any(reads_in_backward(u) for u in v.users)}
    stack = list(need)
    while stack:
        for a in stack.pop().all_input_nodes:
            if a in ok and a not in need:
                need.add(a)
                stack.append(a)
    return [v for v in nodes if v in need]


def _by_base(saved: set[tuple[fx.Node, int]]) -> dict[fx.Node, set[int]]:
    out: dict[fx.Node, set[int]] = {}
    for base, i in saved:
        out.setdefault(base, set()).add(i)
    return out


def _bytes(node: fx.Node, strats, outputs, axis_sizes) -> np.ndarray:
    """Bytes per device, per strategy, of `outputs` of node (as `ProblemBuilder._saved_bytes`)."""
    val = val_of(node)
    outs = val if isinstance(val, (tuple, list)) else (val,)
    act = np.zeros(len(strats))
    for i in outputs:
        act += [nbytes_of(outs[i]) * local_fraction(s.outs[i], axis_sizes) for s in strats]
    return act


# ---------------------------------------------------------------------------- the expanded graph
def expand(prob) -> Expanded:
    """The CostGraph of the module docstring for a `problem.CostProblem` (its budget and offset)."""
    gm, axis_sizes = prob.gm, tuple(prob.mesh.shape)
    every_layer, last = layer_nodes(gm), last_layers(gm)
    layers = {path: nodes for path, nodes in every_layer.items() if path not in last}
    copies = {path: set(copied_nodes(nodes)) for path, nodes in layers.items()}
    kept0 = _by_base(saved_values(gm))
    kept1 = _by_base(saved_values(gm, frozenset(n for c in copies.values() for n in c)))
    nodes = [CostNode(nd.name, np.asarray(nd.time), np.asarray(nd.memory)) for nd in prob.cg.nodes]
    sizes = [nd.num_strategies for nd in nodes]
    ex = Expanded(CostGraph(nodes, [], prob.cg.memory_budget, prob.cg.memory_offset), sizes, {}, {}, {})
    layer_of_node = {}
    mult = prob.derived.get("multiplicity")   # a shallow graph's middle layer (pipeline/depth.py) counts L - 2 times
    mult = np.ones(len(nodes)) if mult is None else mult
    for path, members in layers.items():
        ex.doubled[path], ex.copied[path] = [], set()
        for i, node, a0, a1 in _doubled_nodes(prob, members, copies[path], kept0, kept1):
            a0, a1 = a0 * mult[i], a1 * mult[i]
            base = nodes[i].memory - prob.memory[i]["activations"]
            run = prob.compute[i] if node in copies[path] else np.zeros(sizes[i])
            nodes[i] = CostNode(nodes[i].name, np.concatenate([nodes[i].time, nodes[i].time + run]),
                                np.concatenate([base + a0, base + a1]))
            ex.doubled[path].append(i)
            ex.act[i], layer_of_node[i] = (a0, a1), path
            if node in copies[path]:
                ex.copied[path].add(i)
    for node, outs in kept1.items():  # values kept only because a re-run layer reads them
        i, extra = prob.index.get(node), outs - kept0.get(node, set())
        if i is not None and i not in layer_of_node and extra:
            nodes[i] = CostNode(nodes[i].name, nodes[i].time,
                                nodes[i].memory + mult[i] * _bytes(node, prob.strategies[i], extra, axis_sizes))
    for path in last:
        ex.last[path.rpartition(".")[0]] = [(prob.index[n], _bytes(n, prob.strategies[prob.index[n]], kept0[n],
                                                                   axis_sizes))
                                            for n in every_layer[path] if n in kept0 and n in prob.index]
    _edges(ex, prob, layer_of_node)
    ex.cg.layer_groups = _groups(ex, prob)
    return ex


def _doubled_nodes(prob, members: list[fx.Node], copies: set[fx.Node], kept0: dict, kept1: dict):
    """(index, node, kept bytes r=0, r=1) of the layer's cost-graph nodes that recompute changes: the
    re-run ops and the values kept for backward, except the layer's outputs (kept either way; any
    bytes a re-run layer adds to those are booked on them in `expand`)."""
    inside, axis_sizes = set(members), tuple(prob.mesh.shape)
    for node in members:
        i = prob.index.get(node)
        if i is None or not (node in copies or node in kept0 or node in kept1):
            continue
        if node not in copies and _is_layer_output(node, inside):
            continue
        strats = prob.strategies[i]
        yield (i, node, *(_bytes(node, strats, k.get(node, ()), axis_sizes) for k in (kept0, kept1)))


def _is_layer_output(node: fx.Node, inside: set) -> bool:
    """Read by a forward op outside the layer, or by the graph's output."""
    return any(u.op == "output" or (u.meta.get(PHASE) == "forward" and u not in inside) for u in node.users)


def _edges(ex: Expanded, prob, layer_of_node: dict[int, str]) -> None:
    """The original edges with doubled rows/columns (input edges of re-run ops cost twice under
    r = 1), then one r node per layer joined to its doubled nodes by a consistency edge."""
    for k, (info, e) in enumerate(zip(prob.edges, prob.cg.edges)):
        mat = np.asarray(e.time)
        if e.src in layer_of_node:
            mat = np.vstack([mat, mat])
        path = layer_of_node.get(e.dst)
        if path is not None:
            again = info.kind == "data" and e.dst in ex.copied[path]
            mat = np.hstack([mat, 2.0 * mat if again else mat])
            if again:
                ex.repeated.setdefault(path, []).append(k)
        ex.cg.edges.append(CostEdge(e.src, e.dst, mat))
    for path, members in ex.doubled.items():
        if not members:
            continue
        hub = ex.hubs[path] = len(ex.cg.nodes)
        ex.cg.nodes.append(CostNode(f"recompute[{path}]", np.zeros(2), np.zeros(2)))
        for i in members:
            k = ex.sizes[i]
            mat = np.full((2 * k, 2), np.inf)
            mat[:k, 0] = 0.0
            mat[k:, 1] = 0.0
            ex.cg.edges.append(CostEdge(i, hub, mat))


def _groups(ex: Expanded, prob) -> list[list[list[int]]]:
    """The original layer classes with each layer's r node appended; a class whose layers do not
    double the same positions (never seen) is dropped, and solved untiled."""
    out = []
    for cls in prob.cg.layer_groups:
        layers = []
        for idxs in cls:
            keys = {layer_of(node_path(prob.nodes[i])) for i in idxs} - {None}
            path = f"{min(keys)[0]}.{min(keys)[1]}" if keys else None
            if path in ex.hubs:  # the last layer of a stack has no r: it leaves the class
                layers.append(idxs + [ex.hubs[path]])
        sizes = {tuple(ex.cg.nodes[i].num_strategies for i in layer) for layer in layers}
        if len(layers) > 1 and len(sizes) == 1 and all(len(layer) == len(layers[0]) for layer in layers):
            out.append(layers)
    return out


# ---------------------------------------------------------------------------- solving
def solve_recompute(prob, mode, *, fixed: dict[int, list[int]] | None, time_limit: float | None,
                    recipes: Sequence[dict[int, list[int]]] = ()) -> tuple[Solution, RecomputeDecision]:
    """Solve strategies and recompute together; `mode`: "auto" (the solver decides), "all", or a
    tuple of layer paths (forced). `recipes`: restrictions (node -> allowed strategies, e.g. the
    textbook recipes) whose own best plans with recompute warm-start the search and bound it: the
    plan returned is never slower than any of them that fits. Raises InfeasiblePlanError whose
    `min_memory_per_device` is a lower bound of every plan with recompute (transients aside)."""
    ex = expand(prob)
    efixed = _expanded_fixed(ex, fixed)
    if mode != "auto":
        last = [p for p in mode if p not in ex.hubs] if mode != "all" else []
        if last:
            raise InputError(f"recompute: {last} cannot be recomputed: the last layer of a stack runs its backward "
                             f"first, so re-running it lowers no peak; recomputable: {sorted(ex.hubs)}")
        for path, hub in ex.hubs.items():
            efixed[hub] = [1] if mode == "all" or path in mode else [0]
    within = kept_half(ex) if mode == "auto" else None
    incumbents = [c for c in (_recipe_plan(ex, _expanded_fixed(ex, r), time_limit, within) for r in recipes)
                  if c is not None]
    hint = min(incumbents, key=lambda c: evaluate(ex.cg, c)[0]) if incumbents else None
    try:
        sol = solve(ex.cg, dedup_layers=bool(ex.cg.layer_groups), fixed=efixed or None, time_limit=time_limit,
                    hint=hint, time_within=within)
    except InfeasiblePlanError as e:
        _infeasible(ex, e.min_memory_per_device, e.budget, "")
    found = _refine(ex, sol.choice.copy()) if mode == "auto" else sol.choice.copy()
    fitting = [c for c in (found, *incumbents) if _fits(ex, c)]
    if not fitting:
        least, budget = _least_memory(ex, efixed), ex.cg.memory_budget
        if least <= budget:   # a bound under the budget: the solver stopped without a plan that fits, say so
            kept = evaluate(ex.cg, found)[1]
            raise InfeasiblePlanError(
                f"no plan with activation recompute was found under the memory budget of {format_bytes(budget)} per "
                f"device: the solver stopped ({sol.status}, {sol.backend}) at a plan that keeps {format_bytes(kept)} "
                f"plus {format_bytes(transient(ex, found))} of re-run values; no plan keeps less than "
                f"{format_bytes(least)}, so one may fit: raise time_limit or memory_budget, or use more devices",
                min_memory_per_device=least, budget=budget)
        _infeasible(ex, least, budget, ", and the re-run values of one layer on top")
    return _decode(ex, prob, sol, min(fitting, key=lambda c: evaluate(ex.cg, c)[0]))


def _expanded_fixed(ex: Expanded, fixed: dict[int, list[int]] | None) -> dict[int, list[int]]:
    """A restriction of the original graph's strategies, on the expanded graph (both r of each)."""
    return {i: list(allowed) + ([ex.sizes[i] + s for s in allowed] if i in ex.act else [])
            for i, allowed in (fixed or {}).items()}


def kept_half(ex: Expanded) -> dict[int, list[int]]:
    """`solver.solve`'s time_within for the expanded graph: every layer kept (r = 0). Without a memory
    row that half holds an optimum: setting a recomputed layer's r to 0 (its nodes (s, 1) -> (s, 0))
    keeps every edge finite and removes its re-run seconds (>= 0) and repeated reshards (>= 0). The
    budget-free relaxation then has the plain graph's size, not twice its strategies (Llama-70B on
    8 x 8 H100s: 242 s of HiGHS down to the plain graph's solve)."""
    within = {hub: [0] for hub in ex.hubs.values()}
    for members in ex.doubled.values():
        within.update((i, list(range(ex.sizes[i]))) for i in members)
    return within


def _recipe_plan(ex: Expanded, efixed: dict[int, list[int]], time_limit: float | None,
                 within: dict[int, list[int]] | None = None) -> np.ndarray | None:
    """The best plan with recompute within one restriction, refined; None if none fits."""
    try:
        sol = solve(ex.cg, dedup_layers=bool(ex.cg.layer_groups), fixed=efixed or None, time_limit=time_limit,
                    time_within=within)
    except InfeasiblePlanError:
        return None
    choice = _refine(ex, sol.choice.copy())
    return choice if _fits(ex, choice) else None


def _fits(ex: Expanded, choice: np.ndarray) -> bool:
    budget = ex.cg.memory_budget
    return budget is None or evaluate(ex.cg, choice)[1] + transient(ex, choice) <= budget


def _least_memory(ex: Expanded, efixed: dict[int, list[int]]) -> float:
    """The least memory any plan with recompute keeps (its transient aside): a lower bound."""
    return min_memory(restrict(ex.cg, efixed)[0] if efixed else ex.cg)


def _infeasible(ex: Expanded, least: float, budget: float | None, extra: str):
    raise InfeasiblePlanError(
        f"no plan fits the memory budget of {format_bytes(budget)} per device, even with activation recompute "
        f"(every layer but the last of each stack{extra}): the smallest plan needs {format_bytes(least)} "
        f"(constraint family memory_budget); raise memory_budget, use more devices, or shrink the batch",
        min_memory_per_device=least, budget=budget)


def recomputable(gm: fx.GraphModule) -> list[str]:
    """The layers recompute may choose: every layer but the last of each stack."""
    last = last_layers(gm)
    return [p for p in layer_nodes(gm) if p not in last]


def transient(ex: Expanded, choice: np.ndarray) -> float:
    """Bytes the peak exceeds the kept activations by: when backward re-runs layer l, its values
    (kept bytes r=0 minus r=1) live while the later layers of its stack have freed theirs. Only a
    stack whose top layers all recompute pays (lowest-first recompute keeps it at zero otherwise)."""
    kept = {p: _layer_bytes(ex, choice, p) for p in ex.hubs}
    worst = 0.0
    for path in ex.hubs:
        if choice[ex.hubs[path]] != 1:
            continue
        container, index = _layer_sort_key(path)
        later = sum(kept[q] for q in ex.hubs if _layer_sort_key(q)[0] == container and _layer_sort_key(q)[1] > index)
        later += sum(float(b[choice[i] % ex.sizes[i]]) for i, b in ex.last.get(container, ()))
        full = sum(float(ex.act[i][0][choice[i] % ex.sizes[i]]) for i in ex.doubled[path])
        worst = max(worst, full - kept[path] - later)
    return worst


def _layer_bytes(ex: Expanded, choice: np.ndarray, path: str) -> float:
    r = int(choice[ex.hubs[path]])
    return sum(float(ex.act[i][r][choice[i] % ex.sizes[i]]) for i in ex.doubled[path])


def _layer_choice(ex: Expanded, choice: np.ndarray, on: set[str]) -> np.ndarray:
    """`choice` with the same strategies and exactly the layers in `on` recomputed."""
    c = choice.copy()
    for path, hub in ex.hubs.items():
        r = int(path in on)
        c[hub] = r
        for i in ex.doubled[path]:
            c[i] = c[i] % ex.sizes[i] + r * ex.sizes[i]
    return c


def _refine(ex: Expanded, choice: np.ndarray) -> np.ndarray:
    """For the chosen strategies, the cheapest set of layers to recompute that fits the budget (a
    knapsack over layers, exact, re-solved with the budget lowered while `transient` overflows it);
    among identical layers the lowest recompute. Returns `choice` itself when nothing better fits."""
    paths = sorted(ex.hubs, key=_layer_sort_key)
    t0, m0 = evaluate(ex.cg, _layer_choice(ex, choice, set()))
    budget = ex.cg.memory_budget
    if budget is None or m0 <= budget:
        return _layer_choice(ex, choice, set())
    deltas = _deltas(ex, _layer_choice(ex, choice, set()), paths)
    room = budget
    for _ in range(3):
        knap = CostGraph([CostNode(p, np.array([0.0, dt]), np.array([0.0, dm]))
                          for p, (dt, dm) in zip(paths, deltas)], [], room, m0)
        try:
            y = solve(knap).choice
        except InfeasiblePlanError:
            return choice
        on = _lowest({p for p, v in zip(paths, y) if v}, paths, deltas)
        out = _layer_choice(ex, choice, on)
        over = evaluate(ex.cg, out)[1] + transient(ex, out) - budget
        if over <= 0:
            return out
        room -= over
    return choice


def _deltas(ex: Expanded, base: np.ndarray, paths: list[str]) -> list[tuple[float, float]]:
    """(seconds, bytes) that recomputing each layer alone adds to the plan `base` (no layer recomputed):
    the terms of `evaluate` that change, those of the layer's doubled nodes, its r node and their
    edges, instead of evaluating the whole graph once per layer (80 layers x 23,000 nodes for Llama-70B)."""
    touched = {i: path for path in paths for i in (*ex.doubled[path], ex.hubs[path])}
    incident: dict[str, list] = {path: [] for path in paths}
    for e in ex.cg.edges:
        for path in {touched.get(e.src), touched.get(e.dst)} - {None}:
            incident[path].append(e)
    out = []
    for path in paths:
        c = {i: int(base[i]) % ex.sizes[i] + ex.sizes[i] for i in ex.doubled[path]}
        c[ex.hubs[path]] = 1
        dt = sum(float(ex.cg.nodes[i].time[k] - ex.cg.nodes[i].time[base[i]]) for i, k in c.items())
        dm = sum(float(ex.cg.nodes[i].memory[k] - ex.cg.nodes[i].memory[base[i]]) for i, k in c.items())
        dt += sum(float(e.time[c.get(e.src, base[e.src]), c.get(e.dst, base[e.dst])] - e.time[base[e.src], base[e.dst]])
                  for e in incident[path])
        out.append((dt, dm))
    return out


def _lowest(on: set[str], paths: list[str], deltas: list[tuple]) -> set[str]:
    """As many layers of each set of equal-cost layers as `on` has, the lowest ones."""
    by_cost: dict[tuple, list[str]] = {}
    for p, d in zip(paths, deltas):
        by_cost.setdefault((round(d[0], 15), round(d[1])), []).append(p)
    lowest = set()
    for same in by_cost.values():
        lowest.update(same[:sum(p in on for p in same)])
    return lowest


def with_layers(ex: Expanded, prob, sol: Solution, paths) -> tuple[Solution, RecomputeDecision]:
    """`sol`, a plan of `prob` without recompute (strategies only), with exactly the layers `paths`
    recomputed and nothing re-solved: (its Solution with the re-run seconds, the RecomputeDecision), as
    `solve_recompute` returns them. `ex`: `expand(prob)`; paths outside its layers are left out.
    Its gap is `sol`'s, the gap of the solve that chose the strategies: `sol` may minimise another objective
    (the layout search's step weighting), whose bound is no bound of these seconds (taken as one, a pipelined
    405B plan read "optimal, gap 61%")."""
    choice = np.zeros(len(ex.cg.nodes), dtype=np.int64)
    choice[:len(ex.sizes)] = np.asarray(sol.choice)
    out, decision = _decode(ex, prob, sol, _layer_choice(ex, choice, set(paths) & set(ex.hubs)))
    return replace(out, lower_bound=out.time * (1.0 - sol.gap)), decision


def _layer_sort_key(path: str) -> tuple[str, int]:
    container, _, index = path.rpartition(".")
    return container, int(index)


def _decode(ex: Expanded, prob, sol: Solution, choice: np.ndarray) -> tuple[Solution, RecomputeDecision]:
    """The original graph's choice, and the recompute decision with its added seconds and bytes."""
    n = len(ex.sizes)
    plain = np.array([choice[i] % ex.sizes[i] for i in range(n)], dtype=np.int64)
    on = tuple(sorted((p for p, h in ex.hubs.items() if choice[h] == 1), key=_layer_sort_key))
    compute = sum(float(prob.compute[i][plain[i]]) for p in on for i in ex.copied[p])
    edges = tuple(k for p in on for k in ex.repeated.get(p, ()))
    comm = sum(float(prob.cg.edges[k].time[plain[prob.cg.edges[k].src], plain[prob.cg.edges[k].dst]]) for k in edges)
    t, mem = evaluate(ex.cg, choice)
    mem += transient(ex, choice)
    t_plain, mem_plain = evaluate(prob.cg, plain)
    assert math.isclose(t, t_plain + compute + comm, rel_tol=1e-9, abs_tol=1e-15), (t, t_plain, compute, comm)
    out = Solution(plain, t, mem, min(sol.lower_bound, t), sol.status, sol.backend, sol.solve_seconds,
                   {**sol.stats, "recompute_layers": len(on)})
    return out, RecomputeDecision(on, compute, comm, mem - mem_plain, edges)
