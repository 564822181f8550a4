"""A lower bound of a cost graph's weighted optimum over tiled layer plans: the LP relaxation of its layer quotient.

    min over tiled x of  sum_i w_i c_i[x_i] + sum_(u,v) w_uv R_uv[x_u, x_v]
        >=  LP( the same objective on `simplify.quotient_layers`, dominated strategies dropped )

The quotient is exact for tiled plans (identical layers take one strategy per position),
`simplify.compact`'s dominance pruning keeps an optimum and `simplify.simplify`'s eliminations keep
the integer optimum (the MIP solves the same reduced problem), so the LP of what is left bounds every
tiled plan from below; the memory row is relaxed away, so the bound holds for any budget. The
eliminations shrink Llama-3-70B's quotient from 419 to 127 nodes and its LP 2.7-3.3x (7.0 -> 2.1 CPU s
on dp 4 x tp 4, the same bound to 1e-7). The weights let
`autopar.pipeline` price the pipeline step formula (per-micro-batch terms times the schedule's factor,
per-step terms divided by the stages), as `forest_bound` does. It is tighter than the spanning-forest
bound, which drops every edge outside a forest (the LP keeps them all; on a forest it is exact, so it
never falls below that bound), and costs one LP: 1.5-2.1 CPU s on Llama-3-70B's 2-D sub-meshes
(130k-230k variables before the eliminations) against 20-60 s for the MIP it can save.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from autopar.planning.costgraph import CostEdge, CostGraph, CostNode
from autopar.planning.ilp import relaxation_bound
from autopar.planning.simplify import compact, from_costgraph, quotient_layers, simplify

# The LP's optimum carries the solver's feasibility tolerance: shave this fraction off it to be safe
_SLACK = 1e-7


def lp_lower_bound(cg: CostGraph, node_weight: Sequence[float], edge_weight: Sequence[float],
                   stop_above: float | None = None) -> float:
    """A lower bound of sum_i node_weight[i] * time_i + sum_k edge_weight[k] * time_k over tiled plans
    of cg (all plans when cg has no layer_groups); weights >= 0. `stop_above`: the LP may stop as soon as
    its dual proves a bound above this (`ilp.relaxation_bound`): a caller that only asks "does the bound
    exceed x?" gets the same answer, sooner (a third to a fifth of the LP where the optimum is 1.5-3x x).
    A result <= stop_above is the LP's optimum (shaved); one above it may be any bound above it."""
    nodes = [CostNode(nd.name, w * np.asarray(nd.time, float), nd.memory) for nd, w in zip(cg.nodes, node_weight)]
    edges = [CostEdge(e.src, e.dst, w * np.asarray(e.time, float)) for e, w in zip(cg.edges, edge_weight)]
    weighted = CostGraph(nodes, edges, None, cg.memory_offset, cg.layer_groups)
    if cg.layer_groups:
        weighted = quotient_layers(weighted)[0]
    compacted = compact(from_costgraph(weighted))
    if compacted is None:   # no finite plan at all
        return float("inf")
    reduced = compacted[0]
    simplify(reduced)   # exact eliminations: the same integer optimum, an LP a third the size, never looser
    # a bound it stops at lies above `stop_above` still once shaved (so a result <= stop_above is the optimum's)
    stop = None if stop_above is None else stop_above + 4 * _SLACK * abs(stop_above)
    bound = relaxation_bound(reduced, stop)
    return bound - _SLACK * abs(bound)
