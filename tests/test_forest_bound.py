"""The spanning-forest lower bound (autopar/planning/forest_bound.py) against brute force on small random
cost graphs: exact on a tree, a lower bound with cycles, weighted terms included."""
from __future__ import annotations

import numpy as np
import pytest

from autopar.planning.costgraph import CostEdge, CostGraph, CostNode
from autopar.planning.forest_bound import forest_lower_bound
from autopar.planning.solver import brute_force


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
