"""Depth-independent pricing (autopar/pipeline/depth.py): the layout search prices a stack of L alike
layers from the three-layer graph, and those prices are the full graph's.

For meta models (a hand-written GPT in fp32, a transformers Llama in bf16), on several sub-meshes and
micro-batch counts, under the pipeline's step weighting and with full recompute: the shallow problem's
plan, mapped onto the full graph (`depth.full_choice`), has the same objective and memory there, and its
unit profile unfolded (`search.unit_costs`) equals the full graph's unit profile field by field.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import autopar
from autopar._testing import models
from autopar.capture import cache as capture_cache
from autopar.capture import precision as precision_mod
from autopar.capture.trace import capture
from autopar.graph import MODULE_PATH, NAME, PHASE, ROLE, VAL
from autopar.pipeline import depth
from autopar.pipeline.layer_profile import layer_costs
from autopar.pipeline.search import Profiler, search, unit_costs
from autopar.planning import recompute as rcm
from autopar.planning import spmd
from autopar.planning.solver import evaluate

REL = 1e-9
FIELDS = ("forward", "backward", "state_bytes", "activation_bytes", "boundary_bytes", "per_step")


def _same_units(mine, theirs) -> None:
    assert [u.name for u in mine] == [u.name for u in theirs]
    for a, b in zip(mine, theirs):
        for f in FIELDS:
            assert getattr(a, f) == pytest.approx(getattr(b, f), rel=REL, abs=1e-18), (a.name, f)


CASES = {   # (model, precision, (micro-batches, dp, tp) to price)
    "gpt-fp32": (lambda: models.meta_gpt(n_layer=7, n_embd=256, n_head=4, batch=16, seq=128), None,
                 ((2, 2, 4), (4, 1, 8), (16, 8, 1))),
    "llama-bf16": (lambda: models.meta_llama3_8b(num_layers=6, batch=8, seq=256), "bf16", ((2, 2, 4), (8, 1, 8))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_shallow_problem_prices_the_full_graph(name):
    build, precision, grids = CASES[name]
    case = build()
    hw = autopar.Mesh((8,), hardware="h100").hardware
    prof = Profiler(case.model, case.example_inputs, hw, 8, mixed_precision=precision)
    layers = len(case.model.transformer.h) if hasattr(case.model, "transformer") else len(case.model.model.layers)
    for m, dp, tp in grids:   # m = batch: micro-batches of one, whose <pre> differs from the whole batch's
        shallow = prof.problem(m, dp, tp)
        assert prof.depth_notes[m] == "" and depth.depth_of(shallow)[1] == layers
        assert len(shallow.nodes) < len(prof.problem(m, dp, tp, full=True).nodes)
        full = prof.problem(m, dp, tp, full=True)
        for act_weight, step_weight in ((1.0, 1.0), (3.0, 0.25)):
            view = prof.weighted(m, dp, tp, act_weight=act_weight, step_weight=step_weight)
            fview = prof.weighted(m, dp, tp, act_weight=act_weight, step_weight=step_weight, full=True)
            sol = spmd.solve_problem(view, mip_gap=1e-9)
            choice = depth.full_choice(shallow, full, sol.choice)
            assert choice is not None
            (t, mem), (ft, fmem) = evaluate(view.cg, sol.choice), evaluate(fview.cg, choice)
            assert t == pytest.approx(ft, rel=REL) and mem == pytest.approx(fmem, rel=REL)
            if (m, act_weight) == (2, 1.0):   # the full graph's own optimum is the same (tiled: the same space)
                assert spmd.solve_problem(fview, mip_gap=1e-9).time == pytest.approx(t, rel=1e-6)
            _same_units(unit_costs(shallow, sol.choice), layer_costs(full, choice))
            ex, fex = rcm.expand(shallow), rcm.expand(full)
            _, rc = rcm.with_layers(ex, shallow, sol, rcm.recomputable(shallow.gm))
            fsol = type(sol)(choice, ft, fmem, ft, "optimal", "test", 0.0)
            _, frc = rcm.with_layers(fex, full, fsol, rcm.recomputable(full.gm))
            assert len(rc.paths) == 2 and len(frc.paths) == layers - 1   # every layer but the last
            _same_units(unit_costs(shallow, sol.choice, rc.paths, ex),
                        layer_costs(full, choice, recompute=frc.paths, expanded=fex))


def test_the_search_returns_the_full_graphs_plan_of_what_it_priced():
    """`Profiler.full_solution`: the best candidate's plan on the full graph has the unit profile the
    search priced, and the search with and without the shallow graph picks an equally fast layout."""
    case = models.meta_gpt(n_layer=6, n_embd=256, n_head=4, batch=16, seq=128)
    mesh = autopar.Mesh((2, 8), hardware="h100", devices_per_node=8)
    found = {}
    for shallow in (True, False):
        prof = Profiler(case.model, case.example_inputs, mesh.hardware, 8, shallow=shallow)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = search(case.model, case.example_inputs, mesh=mesh, memory_budget="1GB", profiler=prof,
                            meshes=[(2, 4, 2), (4, 2, 2), (2, 1, 8)])
        best = result.best
        found[shallow] = best.step_time
        args = (best.num_microbatches, best.dp, best.tp, best.inner_budget, None, best.inner_weight,
                best.inner_step_weight)
        assert (depth.depth_of(prof.problem(*args[:3])) is not None) == shallow
        full, units, sol, _ = prof.full_solution(*args, recompute=best.recompute)
        assert depth.depth_of(full) is None   # the plan is built on the full graph
        _same_units(units, result.layers)     # with the unit profile the search priced
        if shallow:   # from the very solution the search priced, mapped
            mapped = depth.full_choice(prof.problem(*args[:3]), full, prof.solution(*args).choice)
            assert np.array_equal(sol.choice, mapped)
            # the plan's solver line counts the full graph and says what the search priced
            assert (sol.stats["nodes"], sol.stats["shallow_nodes"]) == \
                (len(full.cg.nodes), len(prof.problem(*args[:3]).cg.nodes))
    assert found[True] == pytest.approx(found[False], rel=5e-3)


def test_a_graph_that_does_not_line_up_is_priced_in_full():
    case = models.meta_gpt(n_layer=6, n_embd=256, n_head=4, batch=16, seq=128)
    prof = Profiler(case.model, case.example_inputs, autopar.Mesh((8,), hardware="h100").hardware, 8)
    prof.full_units()
    stack = next(iter(prof.shallow_captured(2).shallow))
    prof.floors["units"] = {**prof.floors["units"], f"{stack}.3": ()}   # as if one middle layer differed
    prob = prof.problem(2, 2, 4)
    assert depth.depth_of(prob) is None and "differ" in prof.depth_notes[2]
    assert len(prob.nodes) == len(prof.problem(2, 2, 4, full=True).nodes)


def test_shallow_capture_needs_one_stack_of_alike_layers():
    short = models.meta_gpt(n_layer=3, n_embd=64, n_head=2, batch=2, seq=16)   # below stamping's 5 layers
    assert capture(short.model, short.example_inputs, shallow=True).shallow == {}
    deep = models.meta_gpt(n_layer=6, n_embd=64, n_head=2, batch=2, seq=16)
    cap = capture(deep.model, deep.example_inputs, shallow=True)
    (path, count), = cap.shallow.items()
    assert count == 6 and cap.stamped == {}
    full = capture(deep.model, deep.example_inputs)
    assert full.shallow == {} and full.stamped == {path: 6}
    assert len(cap.gm.graph.nodes) < len(full.gm.graph.nodes)


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_a_full_capture_after_a_shallow_one_is_stamped_out_from_it(precision):
    """The search's final plan captures the full graph of a micro-batch size it priced shallow: the cache
    stamps that out from the shallow trace instead of tracing again, and the graph is a fresh trace's."""
    case = models.meta_llama3_8b(num_layers=6, batch=4, seq=64)
    policy = precision_mod.as_policy(precision)
    capture_cache.clear_capture_cache()
    shallow = capture(case.model, case.example_inputs, mixed_precision=policy, shallow=True)
    assert shallow.shallow == {"model.layers": 6} and not shallow.stamped
    derived = capture(case.model, case.example_inputs, mixed_precision=policy)
    assert capture_cache.capture_cache_stats() == {"hits": 0, "misses": 1, "derived": 1}
    traced = capture(case.model, case.example_inputs, mixed_precision=policy, cache=False)
    assert derived.gm.code == traced.gm.code
    for a, b in zip(derived.gm.graph.nodes, traced.gm.graph.nodes, strict=True):
        assert (a.name, a.op, a.target) == (b.name, b.op, b.target)
        for key in (PHASE, MODULE_PATH, ROLE, NAME):
            assert a.meta.get(key) == b.meta.get(key), (a.name, key)
        va, vb = a.meta.get(VAL), b.meta.get(VAL)
        if isinstance(va, torch.Tensor):
            assert (va.shape, va.dtype, va.stride()) == (vb.shape, vb.dtype, vb.stride()), a.name
    for field in ("param_names", "tied", "buffer_names", "input_names", "grad_param_names", "unused_params",
                  "param_shapes", "param_dtypes", "stamped", "shallow", "mixed_precision"):
        assert getattr(derived, field) == getattr(traced, field), field
    assert derived.stamped == {"model.layers": 6}
    again = capture(case.model, case.example_inputs, mixed_precision=policy)   # now a plain hit
    assert again.gm.code == traced.gm.code and capture_cache.capture_cache_stats()["hits"] == 1
