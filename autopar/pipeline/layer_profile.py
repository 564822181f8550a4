"""Per-unit cost profile of a solved SPMD problem: the input of pipeline stage partitioning.

A pipelined plan runs the micro-batch graph, planned by the SPMD planner on the sub-mesh of the
non-pipeline axes, cut between units that cannot be split: everything before the layer stack
("<pre>": embeddings, rotary tables), one unit per layer of the stack, everything after ("<post>":
final norm, head, loss). For the chosen strategy of every node this module sums, per unit:
    forward / backward   the node's compute + node-local collectives, plus the resharding on its
                         input edges, by the phase of the consuming node (per micro-batch)
    weight               the part of backward that only parameter gradients need (zero-bubble's W:
                         ops whose values never reach an earlier unit's backward, and ZeRO gradient
                         reduce-scatters); the rest is B, the activation gradient's way back
    per_step             what runs once per step whatever the micro-batch count: the optimizer
                         update, ZeRO-1/2 parameter gathers (each stage's gather program, run once
                         before the schedule: passes/split_stages.py), gradient all-reduces (the
                         pipelined runtime defers them to the step's end, passes/defer_grad_reductions.py);
                         a gradient's other collectives (ZeRO reduce-scatters) run in every
                         micro-batch's backward and count under backward, and so do ZeRO-3 gathers
                         (edges into forward and backward ops: each micro-batch's programs re-gather)
    shared               a parameter several units read (a tied embedding), listed at each reader
                         with its state and per-step seconds: a stage holding a later reader but
                         not the first keeps its own copy (autopar/pipeline/stages.py adds it)
    state_bytes          params + gathered params + grads + optimizer state of its parameters
    activation_bytes     the outputs its forward ops keep for backward (problem.saved_values)
    carried_bytes        the values its W ops read from B ops (zero bubble holds them from B to W)
    boundary_bytes       forward values made at or before this unit and read by a later unit,
                         local bytes under their chosen placement (what a stage cut here sends)
so the units' sums equal the SPMD plan's totals (assemble.totals): time and memory.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.fx as fx

from autopar.graph import PHASE, ROLE, layer_of, nbytes_of, node_path, producer_of, val_of
from autopar.pipeline.stages import LayerCost
from autopar.placement import local_fraction
from autopar.planning.costgraph import CostEdge, CostGraph, CostNode
from autopar.planning.problem import CostProblem
from autopar.planning.recompute import expand

PRE, POST = "<pre>", "<post>"
STATE = ("params", "gathered_params", "grads", "optimizer")


def layer_stack(prob: CostProblem) -> str:
    """The module container with the most numbered layers (e.g. "model.layers"), or "" if none."""
    counts: dict[str, set[int]] = {}
    for node in prob.nodes:
        key = layer_of(node_path(node))
        if key is not None:
            counts.setdefault(key[0], set()).add(key[1])
    return max(counts, key=lambda c: len(counts[c]), default="")


def unit_names(prob: CostProblem) -> tuple[list[str], list[int]]:
    """Unit names in execution order and the unit index of every cost-graph node (computed once per
    CostProblem: they depend on its nodes only, and every memory row of a pipeline group asks)."""
    if "units" not in prob.derived:
        stack = layer_stack(prob)
        layers = sorted({k[1] for k in (layer_of(node_path(n)) for n in prob.nodes) if k and k[0] == stack})
        names = [PRE] + [f"{stack}.{i}" for i in layers] + [POST]
        position = {i: j + 1 for j, i in enumerate(layers)}
        prob.derived["units"] = (tuple(names), tuple(_assign(prob, stack, position, len(names) - 1)))
    names, unit = prob.derived["units"]
    return list(names), list(unit)


def _stack_unit(node: fx.Node, stack: str, position: dict[int, int]) -> int | None:
    key = layer_of(node_path(node))
    return position[key[1]] if key is not None and key[0] == stack else None


def _assign(prob: CostProblem, stack: str, position: dict[int, int], post: int) -> list[int]:
    """Forward ops outside the stack: <pre> before the first stack op, <post> after. Backward ops
    outside it: the unit of the forward module they differentiate if it has a path, else the unit of
    the last stack op seen (backward runs the units in reverse: <post> first, <pre> last).
    Inputs and parameters: the unit of their first consumer."""
    unit = [-1] * len(prob.nodes)
    by_path: dict[str, int] = {}
    seen_stack, current = False, post
    for i, node in enumerate(prob.nodes):
        if node.op == "placeholder":
            continue
        u = _stack_unit(node, stack, position)
        if node.meta.get(PHASE) == "forward":
            seen_stack |= u is not None
            u = u if u is not None else (post if seen_stack else 0)
            by_path.setdefault(node_path(node), u)
        elif u is None:
            u = by_path.get(node_path(node)) if node_path(node) else None
            u = current if u is None else u
        else:
            current = u
        unit[i] = u
    for i, node in enumerate(prob.nodes):
        if node.op == "placeholder":
            users = [prob.index[producer_of(u)[0]] for u in node.users if producer_of(u)[0] in prob.index]
            unit[i] = min((unit[j] for j in users if unit[j] >= 0), default=0)
    return unit


def layer_costs(prob: CostProblem, choice: np.ndarray, captured=None, recompute: tuple[str, ...] = (),
                expanded=None) -> list[LayerCost]:
    """One LayerCost per unit of the solved problem (see the module docstring), in execution order.
    `captured` is accepted for the callers' symmetry; the CostProblem already holds the graph.
    `recompute`: the layers whose forward re-runs in backward (`autopar.planning.recompute`): each keeps
    its recompute activation bytes, and its backward adds the re-run ops and their repeated input
    reshards (the expanded cost graph's terms under the same strategies; `expanded`: `recompute.expand(prob)`
    if the caller has it)."""
    names, unit = unit_names(prob)
    n = len(names)
    fwd, bwd, step, wgt = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
    state, act = np.zeros(n), np.zeros(n)
    extra_time, extra_act, extra_edge = _recompute_terms(prob, choice, recompute, expanded)
    weight_only = _weight_only(prob, unit)
    for i, node in enumerate(prob.nodes):
        k, u = choice[i], unit[i]
        t = float(prob.compute[i][k] + prob.local_comm[i][k])
        if node.op == "placeholder":
            step[u] += t
        elif node.meta.get(PHASE) == "forward":
            fwd[u] += t
        else:
            bwd[u] += t
            wgt[u] += t if weight_only[i] else 0.0
        bwd[u] += extra_time[i]   # a re-run forward op runs in backward
        state[u] += sum(float(prob.memory[i][c][k]) for c in STATE)
        act[u] += float(prob.memory[i]["activations"][k]) + extra_act[i]
    for j, (e, ce) in enumerate(zip(prob.edges, prob.cg.edges)):
        t, u = float(ce.time[choice[e.src], choice[e.dst]]), unit[e.dst]
        bwd[u] += extra_edge[j]
        if e.kind == "grad":   # a ZeRO gradient's reduce-scatter: with the parameter gradient (W)
            once = _all_reduce_seconds(prob, e, choice) * multiplicity(prob, e.dst)
            step[unit[e.src]] += once
            bwd[unit[e.dst]] += max(0.0, t - once)
            wgt[unit[e.dst]] += max(0.0, t - once)
        elif prob.nodes[e.dst].meta.get(PHASE) == "forward":
            fwd[u] += t
        else:
            bwd[u] += t
            wgt[u] += t if weight_only[e.dst] else 0.0
    boundary = _boundaries(prob, choice, unit, n)
    shared = _shared(prob, choice, unit)
    carried = _carried(prob, choice, unit, weight_only, n)
    used = set(unit)
    return [LayerCost(names[u], float(fwd[u]), float(bwd[u]), float(state[u]), float(act[u]), float(boundary[u]),
                      per_step=float(step[u]), shared=tuple(shared.get(u, ())), weight=float(wgt[u]),
                      carried_bytes=float(carried[u]))
            for u in range(n) if u in used]


def _carried(prob: CostProblem, choice: np.ndarray, unit: list[int], weight_only: list[bool], n: int) -> np.ndarray:
    """Per unit: local bytes per micro-batch of the values B ops make and the unit's W ops read (zero
    bubble's carried gradients, `LayerCost.carried_bytes`: a linear's output gradient, which B passes on
    and W multiplies into the weight gradient), and of the parameter gradients B ops make themselves (a
    layer norm's backward computes its weight's gradient with the input's: W returns it), each value once
    per unit, at its producer's placement."""
    out, seen = np.zeros(n), set()
    axes = tuple(prob.mesh.shape)
    for e in prob.edges:
        if e.kind == "grad":   # (parameter, gradient): made by a B op, handed to W to return
            made, out_index, reader = e.dst, e.out, e.dst
        elif weight_only[e.dst]:
            made, out_index, reader = e.src, e.out, e.dst
        else:
            continue
        src = prob.nodes[made]
        if src.op == "placeholder" or src.meta.get(PHASE) == "forward" or weight_only[made]:
            continue   # a parameter, a saved activation (counted as such) or a value W makes itself
        key = (made, out_index, unit[reader])
        if key not in seen:
            seen.add(key)
            val = val_of(src)
            val = val[out_index] if isinstance(val, (tuple, list)) else val
            spec = prob.strategies[made][choice[made]].outs[out_index]
            out[unit[reader]] += nbytes_of(val) * local_fraction(spec, axes) * multiplicity(prob, made)
    return out


def _weight_only(prob: CostProblem, unit: list[int]) -> list[bool]:
    """Per node: a backward op whose value never reaches an earlier unit's backward (it feeds parameter
    gradients only: zero-bubble's W, passes/split_weight_grads.py); an op on the way of the activation
    gradient to earlier units is B. A re-run forward op (recompute) counts as B. The sum of a tied
    parameter's contributions from several units is no way back: each contribution stays in its own
    stage's W (passes/split_stages.py), so a later unit's part (a tied lm_head's) is W there. Computed
    once per problem."""
    if "weight_only" not in prob.derived:
        out = next((n for n in reversed(prob.nodes[0].graph.nodes) if n.op == "output"), None) if prob.nodes else None
        summed = {n for n in (out.all_input_nodes if out is not None else ())
                  if n.target is torch.ops.aten.add.Tensor}   # a parameter gradient summed from contributions
        users: list[list[int]] = [[] for _ in prob.nodes]
        for e in prob.edges:
            if e.kind == "data" and prob.nodes[e.dst] not in summed:
                users[e.src].append(e.dst)
        reach = list(unit)   # the earliest unit a node's value reaches through backward ops
        for i in range(len(prob.nodes) - 1, -1, -1):
            for j in users[i]:
                if prob.nodes[j].meta.get(PHASE) != "forward":
                    reach[i] = min(reach[i], reach[j])
        prob.derived["weight_only"] = tuple(
            node.op != "placeholder" and node.meta.get(PHASE) != "forward" and reach[i] >= unit[i]
            for i, node in enumerate(prob.nodes))
    return list(prob.derived["weight_only"])


def _shared(prob: CostProblem, choice: np.ndarray, unit: list[int]) -> dict[int, list[tuple]]:
    """unit -> (name, state bytes, per-step seconds) of each parameter or buffer that several units read
    (a tied embedding), listed at every reader (`LayerCost.shared`; counted above in the first reader's
    unit): what a stage reading it without that unit adds, its own copy's state and per-step costs (ZeRO-1/2
    gather, optimizer update, the gradient all-reduce)."""
    once = {e.src: 0.0 for e in prob.edges if e.kind == "grad"}
    for e in prob.edges:
        if e.kind == "grad":
            once[e.src] += _all_reduce_seconds(prob, e, choice) * multiplicity(prob, e.dst)
    out: dict[int, list[tuple]] = {}
    for i, node in enumerate(prob.nodes):
        if node.op != "placeholder" or node.meta.get(ROLE) not in ("param", "buffer"):
            continue
        readers = {unit[prob.index[producer_of(u)[0]]] for u in node.users if producer_of(u)[0] in prob.index}
        readers.discard(-1)
        if len(readers) < 2:
            continue
        k = choice[i]
        state = sum(float(prob.memory[i][c][k]) for c in STATE)
        seconds = float(prob.compute[i][k] + prob.local_comm[i][k]) + once.get(i, 0.0)
        for u in sorted(readers):
            out.setdefault(u, []).append((node.name, state, seconds))
    return out


def _recompute_terms(prob: CostProblem, choice: np.ndarray, paths: tuple[str, ...], ex=None):
    """Per node: seconds its re-run adds and the change of its kept bytes; per edge: seconds its
    repeated reshard adds, when `paths` recompute. Read off `recompute.expand`'s cost graph at the
    strategies `choice` with those layers' recompute variables set (zeros when `paths` is empty)."""
    more_time, more_act, more_edge = np.zeros(len(prob.nodes)), np.zeros(len(prob.nodes)), np.zeros(len(prob.edges))
    if not paths:
        return more_time, more_act, more_edge
    ex = expand(prob) if ex is None else ex
    unknown = [p for p in paths if p not in ex.hubs]
    assert not unknown, f"layers {unknown} cannot recompute"
    echoice = np.array([int(k) for k in choice], dtype=np.int64)
    for path in paths:
        for i in ex.doubled[path]:
            echoice[i] = choice[i] + ex.sizes[i]
    for i in range(len(prob.nodes)):
        before, after = prob.cg.nodes[i], ex.cg.nodes[i]
        more_time[i] = float(after.time[echoice[i]] - before.time[choice[i]])
        more_act[i] = float(after.memory[echoice[i]] - before.memory[choice[i]])
    for j, (e, before) in enumerate(zip(prob.edges, prob.cg.edges)):
        after = ex.cg.edges[j].time[echoice[e.src], echoice[e.dst]]
        more_edge[j] = float(after - before.time[choice[e.src], choice[e.dst]])
    return more_time, more_act, more_edge


def all_reduce_matrix(prob: CostProblem, e) -> np.ndarray:
    """`_all_reduce_seconds` of gradient edge `e` for every (parameter strategy, producer strategy): the
    part of its cost-graph matrix that runs once per step, priced once per unique (master, gradient) spec
    pair and spread as `ProblemBuilder._edge_matrix` spreads its reshard prices."""
    masters = prob.reshard.unique([s.master for s in prob.strategies[e.src]])
    grads = prob.reshard.unique([d.outs[e.out] for d in prob.strategies[e.dst]])
    small = np.array([[_all_reduce_share(prob, g, mst, e.nbytes) for g in grads[0]] for mst in masters[0]])
    return small[np.ix_(masters[2], grads[2])]


def step_weighted(prob: CostProblem, act_weight: float = 1.0, step_weight: float = 1.0) -> CostProblem:
    """A view of `prob` (everything shared but its cost graph and solver cache) whose cost graph counts each
    node's activation bytes `act_weight` times (micro-batches in flight: a memory row over a pipeline's
    stages) and its per-step seconds `step_weight` times (a parameter's optimizer update and ZeRO-1/2
    gather, a gradient's all-reduce: what `layer_costs` files per step), so that a solve of the view
    minimises a pipeline's step formula (`stages.step_weight`) while `layer_costs(prob, ...)` prices its
    solution unweighted. `prob` itself when both weights are 1; the view's cost graph has no memory row."""
    if act_weight == 1.0 and step_weight == 1.0:
        return prob
    nodes = []
    for n, nd, mem in zip(prob.nodes, prob.cg.nodes, prob.memory):
        assert len(mem["activations"]) == len(nd.memory), "cost-graph node and CostProblem memory disagree"
        time = nd.time * step_weight if n.op == "placeholder" else nd.time
        nodes.append(CostNode(nd.name, time, np.asarray(nd.memory) + (act_weight - 1.0) * mem["activations"]))
    edges, once = list(prob.cg.edges), {}   # identical layers' gradient edges share one matrix
    for j, e in enumerate(prob.edges) if step_weight != 1.0 else ():
        if e.kind == "grad":
            same = (id(prob.strategies[e.src]), id(prob.strategies[e.dst]), e.out, e.nbytes, id(edges[j].time))
            if same not in once:
                once[same] = edges[j].time - (1.0 - step_weight) * multiplicity(prob, e.dst) * all_reduce_matrix(prob, e)
            edges[j] = CostEdge(e.src, e.dst, once[same])
    cg = CostGraph(nodes, edges, None, prob.cg.memory_offset, prob.cg.layer_groups)   # no memory row: callers set it
    return dataclasses.replace(prob, cg=cg, solver_cache={})


def multiplicity(prob: CostProblem, i: int) -> float:
    """How many layers node i stands for: 1, or L - 2 for the middle layer of a shallow graph's
    problem (`autopar.pipeline.depth.weighted`), whose arrays count it so; terms priced from shapes
    here (a gradient's all-reduce share) are multiplied by it."""
    mult = prob.derived.get("multiplicity")
    return 1.0 if mult is None else float(mult[i])


def _all_reduce_seconds(prob: CostProblem, e, choice: np.ndarray) -> float:
    """The all-reduce steps' share of a gradient edge's (bucketed) seconds at `choice`."""
    grad_spec = prob.strategies[e.dst][choice[e.dst]].outs[e.out]
    return _all_reduce_share(prob, grad_spec, prob.strategies[e.src][choice[e.src]].master, e.nbytes)


def _all_reduce_share(prob: CostProblem, grad_spec, master, nbytes: float) -> float:
    """The all-reduce steps of resharding a gradient `grad_spec` -> `master` (bucketed): the same terms as
    `ReshardCost.time`, which prices the edge."""
    return prob.reshard.all_reduce_time(grad_spec, master, nbytes)


def _boundaries(prob: CostProblem, choice: np.ndarray, unit: list[int], n: int) -> np.ndarray:
    """bytes[u]: forward values produced in units <= u and read by forward ops of units > u (a value
    read by several later units, like Llama's rotary tables, crosses every cut up to its last reader)."""
    last: dict[tuple[int, int], int] = {}     # (producer, output) -> last unit reading it
    nbytes: dict[tuple[int, int], float] = {}
    axis_sizes = tuple(prob.mesh.shape)
    for e in prob.edges:
        src, dst = prob.nodes[e.src], prob.nodes[e.dst]
        if e.kind != "data" or src.op == "placeholder" or dst.meta.get(PHASE) != "forward":
            continue  # inputs reach every stage from the data loader; backward values stay inside
        if unit[e.dst] > unit[e.src]:
            key = (e.src, e.out)
            last[key] = max(last.get(key, 0), unit[e.dst])
            spec = prob.strategies[e.src][choice[e.src]].outs[e.out]
            nbytes[key] = e.nbytes * local_fraction(spec, axis_sizes)
    out = np.zeros(n)
    for (src, o), hi in last.items():
        out[unit[src]:hi] += nbytes[(src, o)]
    return out
