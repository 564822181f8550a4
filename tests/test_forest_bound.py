"""The spanning-forest lower bound (autopar/planning/forest_bound.py) against brute force on small random cost
graphs: exact on a tree, lower bounds with cycles, weighted terms included; the bound of a budget-free tiled
solve (the fast pipeline search's `Profiler.lp_bound`) lies between the forest bound and the best tiled plan."""
from __future__ import annotations

import numpy as np
import pytest

from autopar.planning.costgraph import CostEdge, CostGraph, CostNode
from autopar.planning.forest_bound import forest_lower_bound
from autopar.planning.simplify import quotient_layers
from autopar.planning.solver import brute_force, solve


def _graph(rng, n: int, pairs) -> CostGraph:
    k = [int(rng.integers(2, 4)) for _ in range(n)]
    nodes = [CostNode(f"n{i}", rng.uniform(0, 1, k[i]), np.zeros(k[i])) for i in range(n)]
    edges = []
    for a, b in pairs:
        mat = rng.uniform(0, 2, (k[a], k[b]))
        mat[rng.uniform(size=mat.shape) < 0.2] = np.inf   # forbidden pairs
        mat[0, 0] = 0.0                                     # keep a finite plan
        edges.append(CostEdge(a, b, mat))
    return CostGraph(nodes, edges)


@pytest.mark.parametrize("seed", range(6))
def test_forest_bound_is_exact_on_a_tree_and_below_the_optimum_with_cycles(seed):
    rng = np.random.default_rng(seed)
    tree = [(i, int(rng.integers(0, i))) for i in range(1, 7)]
    cg = _graph(rng, 7, tree)
    ones = [1.0] * 7, [1.0] * len(cg.edges)
    assert forest_lower_bound(cg, *ones) == pytest.approx(brute_force(cg).time)
    cyclic = _graph(rng, 7, tree + [(0, 6), (2, 5), (1, 3)])
    opt = brute_force(cyclic).time
    bound = forest_lower_bound(cyclic, [1.0] * 7, [1.0] * len(cyclic.edges))
    assert bound <= opt + 1e-12 and bound > 0
    # weighted: the bound of 2 * nodes + 0.5 * edges is below that objective at the optimum's choice
    w_nodes, w_edges = [2.0] * 7, [0.5] * len(cyclic.edges)
    choice = brute_force(CostGraph([CostNode(nd.name, 2 * nd.time, nd.memory) for nd in cyclic.nodes],
                                   [CostEdge(e.src, e.dst, 0.5 * e.time) for e in cyclic.edges])).time
    assert forest_lower_bound(cyclic, w_nodes, w_edges) <= choice + 1e-12


def _weighted(cg: CostGraph, w_nodes, w_edges) -> CostGraph:
    return CostGraph([CostNode(nd.name, w * nd.time, nd.memory) for nd, w in zip(cg.nodes, w_nodes)],
                     [CostEdge(e.src, e.dst, w * e.time) for e, w in zip(cg.edges, w_edges)],
                     None, cg.memory_offset, cg.layer_groups)


@pytest.mark.parametrize("seed", range(6))
def test_the_tiled_solve_bound_lies_between_the_forest_bound_and_the_best_tiled_plan(seed):
    """Three identical layers of three nodes (a chain inside, a skip edge across, a boundary edge
    between consecutive layers) under weighted terms: forest <= the budget-free tiled solve's proven bound
    <= the best tiled plan (brute force on the exact quotient). The best untiled plan is below the tiled
    one and, on these random layers, often below that bound too: it bounds tiled plans only (the search
    prices those)."""
    rng = np.random.default_rng(seed)
    k = [3, 2, 3]
    times = [rng.uniform(0, 2, n) for n in k]
    inner = {(a, b): rng.uniform(0, 2, (k[a], k[b])) for a, b in ((0, 1), (1, 2), (0, 2))}
    nodes = [CostNode(f"l{j}.n{i}", times[i], np.zeros(k[i])) for j in range(3) for i in range(3)]
    edges = [CostEdge(3 * j + a, 3 * j + b, mat) for j in range(3) for (a, b), mat in inner.items()]
    boundary = rng.uniform(0, 2, (k[2], k[0]))
    edges += [CostEdge(3 * j + 2, 3 * j + 3, boundary) for j in range(2)]
    cg = CostGraph(nodes, edges, None, 0.0, [[[0, 1, 2], [3, 4, 5], [6, 7, 8]]])
    w_nodes = [float(w) for w in rng.choice([0.25, 1.0, 3.0], len(nodes))]
    w_edges = [float(w) for w in rng.choice([0.25, 1.0, 3.0], len(edges))]
    weighted = _weighted(cg, w_nodes, w_edges)
    bound = solve(weighted, dedup_layers=True).lower_bound
    tiled = brute_force(quotient_layers(weighted)[0]).time
    untiled = brute_force(weighted).time
    assert forest_lower_bound(cg, w_nodes, w_edges) <= bound * (1 + 1e-6) + 1e-9
    assert bound <= tiled + 1e-9 and untiled <= tiled + 1e-9
