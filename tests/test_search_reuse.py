"""The default layout search reuses work across layouts (issue 27, "Fast"): each reuse path is compared
against the full path it replaces on a small meta-device model. Planning only: one process."""
from __future__ import annotations

import numpy as np

import autopar
from autopar._testing import models
from autopar.mesh import Mesh
from autopar.pipeline.layer_profile import unit_names
from autopar.pipeline.search import Profiler
from autopar.planning.problem import ProblemBuilder


def _case():
    return models.meta_gpt(n_layer=4, n_embd=128, n_head=4, batch=8, seq=64)


def test_one_device_bound_from_node_costs_equals_a_full_build():
    """`Profiler.seconds_bound` reads node costs only (`ProblemBuilder.build_nodes`): its bounds and unit
    count are those of a full build's CostProblem (edges and the loss's all-reduce included) bit for bit."""
    case = _case()
    hw = autopar.Mesh((8,), hardware="h100").hardware
    prof = Profiler(case.model, case.example_inputs, hw, 4)
    cap, _ = prof.captured(1)
    full = ProblemBuilder(cap, Mesh((1,), ("dp",), hw, 4)).build()
    seconds = np.array([float(np.min(c + lc)) for c, lc in zip(full.compute, full.local_comm)])
    param = np.array([n.op == "placeholder" for n in full.nodes])
    launch = np.minimum(seconds, np.where(param, hw.param_step_overhead, hw.op_overhead))
    for m, k in ((1, 1), (2, 4), (8, 8)):
        per, once = np.maximum(seconds / (m * k), launch), np.maximum(seconds / k, launch)
        assert prof.seconds_bound(m, k) == (float(per[~param].sum()), float(once[param].sum()))
    assert prof.num_units() == len(set(unit_names(full)[1])) == 6   # <pre>, 4 layers, <post>


def _expanded(mesh_shape):
    from autopar.capture.canonicalize import canonicalize
    from autopar.capture.trace import capture
    from autopar.planning.recompute import expand
    case = models.meta_gpt(n_layer=4, n_embd=64, n_head=4, batch=8, seq=32)
    cap = capture(case.model, case.example_inputs)
    canonicalize(cap.gm)
    prob = ProblemBuilder(cap, Mesh(mesh_shape, hardware="h100", devices_per_node=4)).build()
    return expand(prob)


def test_recompute_time_optimum_on_the_kept_half_gives_the_full_solve():
    """`solve(..., time_within=kept_half(ex))` solves the budget-free relaxation on the r = 0 half only:
    with and without a memory row that forces some recompute, the plan's seconds are the full solve's
    (within the MIPs' gaps), and the half's lower bound holds for the full solve's plan. (Without the row
    the full solve's own claimed bound, HiGHS on twice the strategies, was seen 2e-4 above the half's plan.)"""
    from autopar.planning.recompute import kept_half
    from autopar.planning.solver import evaluate, min_memory, solve
    ex = _expanded((2, 2))
    free = solve(ex.cg, dedup_layers=True)
    least = min_memory(ex.cg)
    assert least < free.memory
    for budget in (None, least * 1.3):   # 1.3 x the least memory: the plan recomputes every layer it can (so it did
        # at 1.02 x, where each of the two memory-row MIPs took ~55 s; the budget-free plan holds 2.05 x)
        ex.cg.memory_budget = budget
        full = solve(ex.cg, dedup_layers=True)
        half = solve(ex.cg, dedup_layers=True, time_within=kept_half(ex))
        # the full solve's plan is a plan of the same problem: a bound from a wrong relaxation would exceed it
        assert half.lower_bound <= full.time * (1 + 1e-9)
        assert np.isclose(half.time, full.time, rtol=5e-4), (budget, half.time, full.time)   # the MIP gaps
        assert budget is None or evaluate(ex.cg, half.choice)[1] <= budget
    assert any(half.choice[h] == 1 for h in ex.hubs.values())   # the row recomputes


def test_refine_deltas_equal_whole_graph_evaluations():
    """`recompute._deltas` (the terms one layer's recompute changes) equals evaluating the whole
    expanded graph with and without that layer recomputed."""
    from autopar.planning.recompute import _deltas, _layer_choice
    from autopar.planning.solver import evaluate, solve
    ex = _expanded((4,))
    base = _layer_choice(ex, solve(ex.cg, dedup_layers=True).choice, set())
    paths = sorted(ex.hubs)
    assert len(paths) == 3   # 4 layers, the last never recomputes
    t0, m0 = evaluate(ex.cg, base)
    for path, (dt, dm) in zip(paths, _deltas(ex, base, paths)):
        t1, m1 = evaluate(ex.cg, _layer_choice(ex, base, {path}))
        assert dt > 0 and dm < 0
        assert np.isclose(dt, t1 - t0, rtol=1e-9, atol=1e-15) and np.isclose(dm, m1 - m0, rtol=1e-9)
