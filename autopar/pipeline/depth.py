"""Depth-independent pricing: the layout search prices a stack of L alike layers from three of them.

Capture traces a stack of L alike layers three deep and stamps layer 1 out L - 3 times
(`autopar/capture/stamp.py`, node for node exact). In a plan whose middle layers take one plan
(every solve of the search is tiled: `solver._solve_tiled`), the full graph's cost is a function of the
three-layer graph (`capture(..., shallow=True)`) with layer 1 counted L - 2 times (`weighted`):
  * a node of layer 1 (time, and each memory category) weighs L - 2, every other node 1;
  * an edge into layer 1 from inside layer 1 or from the shared nodes outside the stack weighs L - 2;
  * an edge into layer 1 from layer 0 (the layer before it) or layer 2 (the layer after it, in backward)
    happens once as drawn; the other L - 3 middle layers read that value from a middle layer, so an edge
    from layer 1's node in the same place carries L - 3 times its matrix (a node reading its own place
    adds that diagonal to its time);
  * every other edge happens once (layer 1 -> layer 2 is layer L - 2 -> layer L - 1).
"The same place" and "layer 1" are stamping's own (`stamp.check_stack`, run again on the canonicalized
graph). Layers 0 and 2 may take other plans than layer 1: the prices stay the full graph's.
Its units (`layer_profile.unit_names`) are <pre>, the stack's layers 0, 1, 2 and <post>; `unfold` turns
its unit profile into the full stack's (layer 1's seconds and bytes over L - 2, once per middle layer;
the bytes a cut after it sends as priced), and `full_choice` maps a plan of it onto the full graph's
CostProblem (unit by unit, node by node), where the final plan is built. A shallow problem is used only
where `matches` holds: its layer 1 exactly the unit `layer_costs` files as layer 1, and the full graph's
layer units (the whole batch's capture, which the search holds anyway) its own, op for op; elsewhere
the search prices the full graph, as before. tests/test_depth.py compares the two, field by field.
What it saves: a Llama-3-70B micro-batch graph has ~23,000 cost nodes for 80 layers, ~1,000 for three;
the search's CostProblems, their memory rows, recompute expansions and unit profiles shrink with it
(the layer quotient of the solver and the reshard prices were already depth-independent).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from autopar.capture import stamp
from autopar.graph import PHASE, ROLE
from autopar.pipeline.layer_profile import unit_names
from autopar.pipeline.stages import LayerCost
from autopar.planning.costgraph import CostEdge, CostGraph, CostNode
from autopar.planning.problem import CostProblem

TRACED = stamp.TRACED    # layers in a shallow graph


def stack_of(captured) -> tuple[str, int] | None:
    """(stack path, its layer count) of a shallow capture; None for a full one."""
    if not captured.shallow:
        return None
    (path, count), = captured.shallow.items()
    return path, count


def unit_signatures(prob: CostProblem) -> dict[str, tuple]:
    """Per unit, its nodes' (op, target or a placeholder's role, phase) in graph order."""
    names, unit = unit_names(prob)
    out: dict[str, list] = {n: [] for n in names}
    for node, u in zip(prob.nodes, unit):
        out[names[u]].append(_what(node))
    return {k: tuple(v) for k, v in out.items()}


def _what(node) -> tuple:
    return node.op, node.meta.get(ROLE) if node.op == "placeholder" else str(node.target), node.meta.get(PHASE)


def _places(prob: CostProblem, stack: str, count: int) -> dict[int, tuple[int, int]]:
    """Cost-graph node of a traced layer -> (its layer, layer 1's node in the same place), by capture's
    stamping checks (`stamp.check_stack`: StampError where the layers are not alike node for node)."""
    loss = prob.gm.graph.output_node().args[0][0]
    places = stamp.check_stack(prob.gm, stamp.LayerStack(stack, count), loss)
    return {prob.index[n]: (layer, prob.index[t]) for n, (layer, t) in places.items()
            if n in prob.index and t in prob.index}


def matches(shallow: CostProblem, full_units: dict[str, tuple], stack: str, count: int) -> str:
    """"" when `shallow` (a shallow capture's CostProblem) stands for the full graph whose unit
    signatures (`unit_signatures`, of any batch size) are `full_units`; else why not: its three layers
    alike node for node, its layer 1 exactly the unit `layer_costs` files as layer 1, and the full
    graph's layer units its own op for op (every middle layer's the unit of layer 1)."""
    try:
        places = _places(shallow, stack, count)
    except stamp.StampError as e:
        return f"the traced layers are not alike after canonicalize: {e}"
    names, unit = unit_names(shallow)
    middle = names.index(f"{stack}.1") if f"{stack}.1" in names else -1
    if {i for i, (layer, _) in places.items() if layer == 1} != {i for i, u in enumerate(unit) if u == middle}:
        return f"unit {stack}.1 is not the traced layer 1"
    mine = unit_signatures(shallow)
    want = {"<pre>": "<pre>", "<post>": "<post>", f"{stack}.0": f"{stack}.0", f"{stack}.{count - 1}": f"{stack}.2",
            **{f"{stack}.{i}": f"{stack}.1" for i in range(1, count - 1)}}
    if set(full_units) != set(want) or set(mine) != set(want.values()):
        return "the units differ from the full graph's"
    # <pre> and <post> are the same nodes in both graphs (stamping adds layers only); the whole batch's
    # may differ from a micro-batch's there (a batch of one drops a few views), never inside a layer
    bad = [u for u, s in want.items() if u not in ("<pre>", "<post>") and full_units[u] != mine[s]]
    return f"units {bad[:3]} differ from the full graph's" if bad else ""


def weighted(prob: CostProblem, stack: str, count: int) -> CostProblem:
    """The CostProblem of the full stack of `count` layers for plans whose middle layers are alike
    (module docstring), from the three-layer `prob` (`matches` it first): node arrays, edges and cost
    graph reweighted, synthetic middle-to-middle edges appended (to `edges` and the cost graph alike).
    `derived["depth"]` = (stack, count), `derived["multiplicity"]`: how many layers each node stands
    for (what `layer_profile` and `recompute.expand` multiply the terms they price from shapes by)."""
    places = _places(prob, stack, count)
    mid = {i for i, (layer, _) in places.items() if layer == 1}
    w = count - 2
    scaled: dict[int, np.ndarray] = {}   # identical arrays stay shared (solver and builder key on ids)

    def times(a):
        if id(a) not in scaled:
            scaled[id(a)] = (np.asarray(a, dtype=float) * w, a)   # the source kept: its id stays unique
        return scaled[id(a)][0]

    compute = [times(c) if i in mid else c for i, c in enumerate(prob.compute)]
    local = [times(c) if i in mid else c for i, c in enumerate(prob.local_comm)]
    memory = [{k: times(v) for k, v in m.items()} if i in mid else m for i, m in enumerate(prob.memory)]
    nodes = [CostNode(nd.name, times(nd.time), times(nd.memory)) if i in mid else nd
             for i, nd in enumerate(prob.cg.nodes)]
    infos, edges, more_edges = list(prob.edges), [], []
    for e, ce in zip(prob.edges, prob.cg.edges):
        if e.dst not in mid:
            edges.append(ce)
            continue
        layer, src = places.get(e.src, (1, e.src))
        if layer == 1:              # from layer 1 itself or from outside the stack: every middle layer
            edges.append(CostEdge(ce.src, ce.dst, times(ce.time)))
            continue
        edges.append(ce)            # from layer 0 or 2: once; the other middle layers read layer 1's node
        assert len(prob.strategies[src]) == len(prob.strategies[e.src]), "alike layers' nodes differ in strategies"
        more = np.asarray(ce.time, dtype=float) * (w - 1)
        if src == e.dst:            # a node reading its own place in the layer before
            nd = nodes[src]
            nodes[src] = CostNode(nd.name, nd.time + np.diag(more), nd.memory)
            continue
        infos.append(dataclasses.replace(e, src=src))   # after every drawn edge, in both lists
        more_edges.append(CostEdge(src, e.dst, more))
    cg = CostGraph(nodes, edges + more_edges, prob.cg.memory_budget, prob.cg.memory_offset, prob.cg.layer_groups)
    mult = np.ones(len(prob.nodes))
    mult[sorted(mid)] = w
    return dataclasses.replace(prob, edges=infos, compute=compute, local_comm=local, memory=memory, cg=cg,
                               solver_cache={}, derived={**prob.derived, "depth": (stack, count),
                                                         "multiplicity": mult})


def depth_of(prob: CostProblem) -> tuple[str, int] | None:
    """(stack, layer count) of a `weighted` CostProblem; None for a full one."""
    return prob.derived.get("depth")


def unfold(layers: list[LayerCost], stack: str, count: int) -> list[LayerCost]:
    """A `weighted` problem's unit profile -> the full stack's: layer 1 (which counts count - 2 times)
    split into layers 1 .. count - 2, each with 1 / (count - 2) of its seconds and bytes and the
    boundary it sends, layer 2 renamed the last layer."""
    w = count - 2
    out = []
    for lc in layers:
        if lc.name == f"{stack}.1":
            one = dataclasses.replace(lc, forward=lc.forward / w, backward=lc.backward / w,
                                      state_bytes=lc.state_bytes / w, activation_bytes=lc.activation_bytes / w,
                                      per_step=lc.per_step / w, weight=lc.weight / w,
                                      carried_bytes=lc.carried_bytes / w)
            out.extend(dataclasses.replace(one, name=f"{stack}.{i}") for i in range(1, count - 1))
        elif lc.name == f"{stack}.2":
            out.append(dataclasses.replace(lc, name=f"{stack}.{count - 1}"))
        else:
            out.append(lc)
    return out


def full_choice(shallow: CostProblem, full: CostProblem, choice: np.ndarray) -> np.ndarray | None:
    """The plan `choice` of a `weighted` problem on the full graph's CostProblem (same mesh and recipe):
    each unit's nodes take the strategies of the shallow unit they stand for, position by position.
    None when the two do not line up (strategy lists differ): the caller solves the full graph."""
    stack, count = depth_of(shallow)
    snames, sunit = unit_names(shallow)
    fnames, funit = unit_names(full)
    by_unit: dict[int, list[int]] = {}
    for i, u in enumerate(sunit):
        by_unit.setdefault(u, []).append(i)
    stands = {"<pre>": "<pre>", "<post>": "<post>", f"{stack}.0": f"{stack}.0", f"{stack}.{count - 1}": f"{stack}.2"}
    out = np.zeros(len(full.nodes), dtype=np.int64)
    seen: dict[int, int] = {}
    for i, u in enumerate(funit):
        if u < 0:
            continue
        name = fnames[u]
        src = snames.index(stands.get(name, f"{stack}.1"))
        k = seen[u] = seen.get(u, -1) + 1
        members = by_unit.get(src, [])
        if k >= len(members):
            return None
        j = members[k]
        if len(full.strategies[i]) != len(shallow.strategies[j]) or _what(full.nodes[i]) != _what(shallow.nodes[j]):
            return None
        out[i] = choice[j]
    return out
