"""The default layout search is complete and its bounds are true (issue 27): planning only, meta models
on H100-priced meshes, no processes.

- the same N devices as (N / 8) x 8 plan whatever N as one axis plans, as fast or faster;
- feasibility is monotone in the device count (strong scaling: more devices never stop fitting), also
  past the devices a batch splits over (SPMD on another (N / k) x k grid, `autopar.pipeline.regrid`);
- InfeasiblePlanError.min_memory_per_device is at most every forced plan's memory (recipes, recompute
  settings, stage counts): a lower bound over the search space.
"""
from __future__ import annotations

import dataclasses
import warnings

import pytest

import autopar
from autopar._testing import models
from autopar.errors import InfeasiblePlanError

GB = 1e9


def _gpt():
    return models.meta_gpt(n_layer=2, n_embd=128, n_head=4, batch=64, seq=128)


def _plan(case, mesh, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(case.model, case.example_inputs, mesh=mesh, **{"baselines": False, **kw})


def _try(case, mesh, **kw):
    try:
        return _plan(case, mesh, **kw)
    except InfeasiblePlanError as e:
        return e


def _mesh(n: int, two_d: bool) -> autopar.Mesh:
    shape = (n // 8, 8) if two_d else (n,)
    return autopar.Mesh(shape, hardware="h100", devices_per_node=8)


@pytest.mark.parametrize("budget", [None, 0.3 * GB, 0.005 * GB])
@pytest.mark.parametrize("n", [16])   # 64 holds too (planned in ~3 minutes on two cores: too slow here)
def test_nodes_by_gpus_plans_whatever_one_axis_plans(n, budget):
    case = _gpt()
    flat, grid = _try(case, _mesh(n, False), memory_budget=budget), _try(case, _mesh(n, True), memory_budget=budget)
    if isinstance(flat, InfeasiblePlanError):
        if isinstance(grid, InfeasiblePlanError):   # both infeasible: the same lower bound
            assert grid.min_memory_per_device <= flat.min_memory_per_device * (1 + 1e-9)
        return
    assert not isinstance(grid, InfeasiblePlanError), f"{n} devices fit as one axis but not as {n // 8} x 8: {grid}"
    assert grid.predicted_step_time <= flat.predicted_step_time * (1 + 1e-9)
    assert budget is None or grid.memory_per_device <= budget


def test_feasibility_is_monotone_in_the_device_count():
    """Strong scaling of a batch of 64 from 8 to 1,024 devices (H100 preset), one budget: once a count
    fits, every larger one does."""
    case = _gpt()
    fits = []
    for n in (8, 16, 32, 64, 128, 256, 512, 1024):
        got = _try(case, _mesh(n, False), memory_budget=0.3 * GB)
        fits.append((n, not isinstance(got, InfeasiblePlanError)))
    first = next((i for i, (_, ok) in enumerate(fits) if ok), len(fits))
    assert all(ok for _, ok in fits[first:]), fits


def test_the_reported_minimum_is_a_lower_bound_over_forced_plans():
    case = _gpt()
    mesh = _mesh(16, True)
    with pytest.raises(InfeasiblePlanError) as info:
        _plan(case, mesh, memory_budget=0.005 * GB)
    bound = info.value.min_memory_per_device
    assert 0 < bound and "MB" in str(info.value) and "B per" not in str(info.value).replace("MB per", "")
    forced = [dict(strategy=s, num_stages=None, recompute=r) for s in ("dp", "zero3", "tp", "auto")
              for r in ("none", "all")]
    forced += [dict(num_stages=p, num_microbatches=m) for p in (2, 4) for m in (4, 8)]
    for kw in forced:
        p = _plan(case, mesh if kw.get("num_stages") is None else _mesh(16, False), **kw)
        assert p.memory_per_device >= bound * (1 - 1e-9), (kw, p.memory_per_device, bound)


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_the_infeasible_message_suggests_bf16_only_to_an_fp32_call(precision):
    """8 MB: over the state sharded 16 ways (6.97 MB), under every candidate: the search's own message."""
    with pytest.raises(InfeasiblePlanError) as info:
        _plan(_gpt(), _mesh(16, False), memory_budget=0.008 * GB, mixed_precision=precision, time_limit=5)
    assert "SPMD and pipelined layouts" in str(info.value)
    assert ("mixed_precision='bf16'" in str(info.value)) == (precision is None)


@pytest.mark.parametrize("two_d", [False, True])
def test_more_devices_than_the_batch_splits_over_still_fit(two_d):
    """The counter-example of issue 27: under 10 MB a batch of 64 fits on 64 devices (a pipeline, forced
    here as the search finds it: the search itself takes minutes on two cores) but no pipeline splits
    it over 1,024 and SPMD on (1024,) has no axis to split activations over: the search refused
    Mesh((1024,)). Now it plans SPMD on another grid of the same 1,024 devices (every device used, honest
    links); Mesh((128, 8)) fits as it is.
    A short solver time limit keeps the test fast: the solver's fallback plan must still fit."""
    case, budget = _gpt(), 0.01 * GB
    pipe = autopar.Mesh((2, 8, 4), ("pp", "dp", "tp"), hardware="h100", devices_per_node=8)
    small = _plan(case, pipe, memory_budget=budget, num_microbatches=8, schedule="1f1b", time_limit=5)
    assert small.memory_per_device <= budget and len(small.stages) == 2
    big = _plan(case, _mesh(1024, two_d), memory_budget=budget, time_limit=5)
    assert big.mesh.size == 1024 and big.memory_per_device <= budget
    assert big.feasible and (two_d or tuple(big.mesh.shape) != (1024,)), big.mesh


def test_a_deferred_mesh_stops_only_where_no_plan_of_it_can_beat_the_cutoff():
    """`spmd.plan_captured(cutoff=c)` (the default search's first pass over a mesh of several axes):
    where the fastest plan without the memory row needs more than the budget, it stops before the row's
    solves iff that plan's time, a bound of every plan with the row or with recompute, is >= c; below
    c it plans exactly as without a cutoff; where that plan fits, no cutoff stops it."""
    from autopar.capture.canonicalize import canonicalize
    from autopar.capture.trace import capture
    from autopar.planning import spmd
    case = _gpt()
    captured = capture(case.model, case.example_inputs)
    canonicalize(captured.gm)
    mesh = autopar.Mesh((2, 4), hardware="h100", devices_per_node=4)

    def plan(budget, cutoff=None):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return spmd.plan_captured(captured, case.model, case.example_inputs, mesh=mesh, memory_budget=budget,
                                      baselines=False, cutoff=cutoff)
    free = plan(None)
    assert plan(free.memory_per_device * 1.01, cutoff=0.0).predicted_step_time == free.predicted_step_time
    budget = 0.85 * free.memory_per_device   # the fastest plan no longer fits; a plan with recompute does (>= 231 MB)
    with pytest.raises(spmd.PlanCutoff) as stopped:
        plan(budget, cutoff=0.0)
    bound = stopped.value.bound
    planned = plan(budget)
    assert planned.memory_per_device <= budget and bound <= planned.predicted_step_time * (1 + 1e-9)
    with pytest.raises(spmd.PlanCutoff):
        plan(budget, cutoff=bound)
    late = plan(budget, cutoff=bound * (1 + 1e-6))
    assert (late.predicted_step_time, late.memory_per_device) == (planned.predicted_step_time, planned.memory_per_device)


def test_the_default_search_solves_a_deferred_mesh_that_can_win(monkeypatch):
    """Solved after the pipeline search or before it (auto.DEFER = None), the 2-D mesh whose fastest plan
    needs more than the budget gives the same plan and recipes when it is the best (GPT 2 layers on 2 x 8
    at 150 MB: its bound 1.46 ms is below every pipeline found). Solved late, it goes on from where its
    cutoff stopped: its CostProblem is built and its recipes solved once (Llama-3-70B on 64 x 8 H100s:
    22 CPU s of recipes and a 1 s build saved)."""
    from autopar.pipeline import auto
    from autopar.planning import spmd
    case = _gpt()
    calls = []
    real = spmd.solve_baselines

    def counted(prob, captured, mesh, time_limit):
        calls.append(tuple(mesh.shape))
        return real(prob, captured, mesh, time_limit)
    monkeypatch.setattr(spmd, "solve_baselines", counted)
    late = _plan(case, _mesh(16, True), memory_budget=0.15 * GB, baselines=True)
    assert calls == [(2, 8)]   # the caller's mesh: cut, then resumed
    monkeypatch.setattr(auto, "DEFER", None)
    first = _plan(case, _mesh(16, True), memory_budget=0.15 * GB, baselines=True)
    assert late.mesh.shape == first.mesh.shape == (2, 8) and late.stages == first.stages == ()
    assert late.predicted_step_time == first.predicted_step_time and late.memory_per_device == first.memory_per_device
    recipes = ("dp", "zero1", "zero2", "zero3", "tp")
    assert {r: late.baselines[r] for r in recipes} == {r: first.baselines[r] for r in recipes}


def test_without_any_spmd_plan_the_most_promising_deferred_mesh_is_solved_before_the_pipelines(monkeypatch):
    """When every SPMD shape either has no plan or waits (its fastest plan needs more than the budget),
    the pipeline search would have no incumbent and price every candidate until one fits (Llama-3.1-405B
    on 256 x 8 H100s: 63 groups of 30-70 CPU s). The waiting mesh of least bound is solved first, and
    its step is the search's incumbent (here the 1-D shape is made to fail: GPT 2 layers on 2 x 8 at 150 MB)."""
    from autopar.pipeline import auto
    from autopar.planning import spmd
    real_plan, real_bb = spmd.solve_captured, auto.branch_and_bound
    incumbents = []

    def no_flat(captured, model, inputs, *, mesh, **kw):
        if mesh.ndim == 1:
            raise InfeasiblePlanError("made to fail", min_memory_per_device=1e12, budget=0.15 * GB)
        return real_plan(captured, model, inputs, mesh=mesh, **kw)

    def seen(prof, jobs, budget, strategy, keep, incumbent=float("inf"), **kw):
        incumbents.append(incumbent)
        return real_bb(prof, jobs, budget, strategy, keep, incumbent=incumbent, **kw)
    monkeypatch.setattr(spmd, "solve_captured", no_flat)
    monkeypatch.setattr(auto, "branch_and_bound", seen)
    got = _plan(_gpt(), _mesh(16, True), memory_budget=0.15 * GB, baselines=True)
    assert len(incumbents) == 1 and incumbents[0] < float("inf")
    assert got.memory_per_device <= 0.15 * GB and got.predicted_step_time <= incumbents[0]


def test_a_deferred_mesh_that_cannot_win_is_not_solved_and_the_table_says_so(monkeypatch):
    """When the deferred mesh's bound is no faster than the best plan found, its memory-row solves never
    run: the plan is another candidate's, and its table carries the mesh's bound and why (the bound is
    inflated 100x here: small models rarely have a pipeline faster than their SPMD optimum without a row)."""
    from autopar.inspection.summary import baseline_rows
    from autopar.planning import spmd
    real = spmd.budget_free

    def inflated(prob, *a, **kw):
        sol = real(prob, *a, **kw)
        return dataclasses.replace(sol, time=sol.time * 100, lower_bound=sol.lower_bound * 100) if prob.mesh.ndim > 1 else sol
    monkeypatch.setattr(spmd, "budget_free", inflated)
    case = _gpt()
    got = _plan(case, _mesh(16, True), memory_budget=0.15 * GB, baselines=True)
    row = got.baselines["spmd (2, 8)"]
    assert row["bound"] > got.predicted_step_time and not row["feasible"] and "not solved" in row["reason"]
    assert (got.stages or got.mesh.shape != (2, 8)) and got.memory_per_device <= 0.15 * GB   # not the SPMD (2, 8)
    assert any(r[0] == "spmd (2, 8)" and r[1].startswith(">= ") for r in baseline_rows(got))
    assert {"dp", "zero1", "zero2", "zero3", "tp"} <= set(got.baselines)   # the caller's recipes, priced before the cut


def test_a_one_axis_caller_plans_every_shape_of_its_devices():
    """The default search prices the SPMD plan on the grids (N / t) x t of the devices too, not only the
    caller's shape: a 4-device MLP on `Mesh((4,))` plans as 2 x 2 where the cost model prices that faster
    (the same column/row split, its collectives per axis), and `num_stages=None` keeps the mesh as given."""
    case = models.meta_mlp(128, 1024)
    mesh = autopar.Mesh((4,), hardware="a100")
    auto, given = _plan(case, mesh, baselines=True), _plan(case, mesh, num_stages=None)
    assert given.mesh.shape == (4,) and auto.stages == ()
    assert auto.predicted_step_time <= given.predicted_step_time * (1 + 1e-9)
    assert auto.mesh.shape == (2, 2) and auto.predicted_step_time < given.predicted_step_time
    assert auto.baselines["spmd (4,)"]["time"] == pytest.approx(given.predicted_step_time)
    assert {"dp", "tp", "zero1", "zero2", "zero3"} <= set(auto.baselines)   # the recipes on the caller's mesh


def test_the_fast_search_prices_pipelines_where_one_axis_needs_recompute():
    """search="fast" searches pipelines when the 1-D SPMD plan fits only with activation recompute (a
    stage holds 1 / pp of the layers), though its step is within FAST_RATIO of the pipeline bound: a
    6-layer GPT on 8 H100s under 85% of its budget-free memory recomputes 3 layers on one axis."""
    case = models.meta_gpt(n_layer=6, n_embd=128, n_head=4, batch=64, seq=128)
    mesh = autopar.Mesh((8,), hardware="h100", devices_per_node=8)
    free = _plan(case, mesh)   # without a budget the ratio rule prices no pipeline (1-D step 1.34x their bound)
    assert not free.solver["search"]["pipelines_searched"] and free.stages == ()
    budget = 0.85 * free.memory_per_device
    one_axis = _plan(case, mesh, num_stages=None, memory_budget=budget)
    assert one_axis.recompute
    got = _plan(case, mesh, memory_budget=budget)
    assert got.solver["search"]["pipelines_searched"] and got.solver["search"]["priced"] > 0
    assert got.predicted_step_time <= one_axis.predicted_step_time and got.memory_per_device <= budget


def test_where_the_ratio_rule_searches_no_pipeline_the_fast_search_still_prices_some(monkeypatch):
    """search="fast" where its ratio rule searches no pipeline, for a model that fills devices: every
    pipeline when there are at most SMALL_SEARCH candidates, else a probe (`auto.probe_jobs`: one
    micro-batch count on 1-D sub-meshes). A 16-layer GPT of GPT-2 1.5B's width on 8 H100s in bf16 under
    20 GB: SPMD 4 x 2 is within FAST_RATIO of the pipeline bound, yet pp8 zero bubble (the probe) is ~6%
    faster, and the full search no slower; without either the default call returns the SPMD plan. A toy
    model is searched neither way."""
    from autopar.pipeline import auto
    case = models.meta_gpt(n_layer=16, n_embd=1600, n_head=25, batch=8, seq=1024)
    mesh = autopar.Mesh((8,), hardware="h100", devices_per_node=8)
    kw = dict(mixed_precision="bf16", memory_budget=20 * GB)
    full = _plan(case, mesh, **kw)
    assert full.solver["search"]["pipelines_searched"] and full.solver["search"]["pipeline_candidates"] <= 80
    monkeypatch.setattr(auto, "SMALL_SEARCH", 0)
    got = _plan(case, mesh, **kw)
    search = got.solver["search"]
    assert not search["pipelines_searched"] and search["probed"] > 0 and got.stages
    assert got.memory_per_device <= 20 * GB and full.predicted_step_time <= got.predicted_step_time
    monkeypatch.setattr(auto, "probe_jobs", lambda jobs: [])
    spmd = _plan(case, mesh, **kw)
    assert spmd.stages == () and got.predicted_step_time < spmd.predicted_step_time
    monkeypatch.setattr(auto, "SMALL_SEARCH", 80)
    toy = _plan(_gpt(), mesh)   # its SPMD plan holds far under PROBE_MEMORY_SHARE of an H100
    assert toy.solver["search"]["probed"] == 0 and not toy.solver["search"]["pipelines_searched"]
    assert toy.stages == ()


def test_the_fast_probe_prices_one_microbatch_count_on_one_axis_sub_meshes():
    """`auto.probe_jobs`: pipelines only (pp > 1), of the most micro-batches up to PROBE_MICROBATCHES (one
    capture), on sub-meshes with one axis (dp or tp = 1)."""
    from autopar.pipeline.auto import PROBE_MICROBATCHES, probe_jobs
    s = ("1f1b",)
    jobs = [(1, 4, 2, 2, s), (2, 4, 1, 4, s), (2, 2, 2, 8, s), (2, 1, 4, 8, s), (4, 2, 1, 8, s), (4, 2, 1, 16, s),
            (8, 1, 1, 8, s), (8, 1, 1, 32, s)]
    assert PROBE_MICROBATCHES == 8
    assert probe_jobs(jobs) == [(2, 1, 4, 8, s), (4, 2, 1, 8, s), (8, 1, 1, 8, s)]
    assert probe_jobs([(2, 4, 1, 16, s)]) == [] and probe_jobs([(1, 8, 1, 2, s)]) == []
    assert probe_jobs([(2, 4, 1, 2, s), (2, 4, 1, 4, s)]) == [(2, 4, 1, 4, s)]


def test_a_one_axis_plan_that_needs_recompute_waits_for_the_other_layouts(monkeypatch):
    """Where no plan of the devices as one axis fits without recompute, its recompute MIPs wait like a
    2-D mesh's memory row: solved only if its budget-free bound can beat the best plan found (Llama-3-70B
    x 64 H100s: 19 CPU s saved for a plan 7x slower than the pipeline). A GPT on 8 H100s, 2 nodes of 4,
    at 280 MB: the 2 x 4 grid with recompute beats the one-axis bound, so the one-axis recompute solve
    never runs; run alone, that plan exists and is slower than the bound, so nothing better was skipped."""
    from autopar.planning import recompute as recompute_mod
    solved = []
    real = recompute_mod.solve_recompute

    def counted(prob, *args, **kw):
        solved.append(tuple(prob.mesh.shape))
        return real(prob, *args, **kw)
    monkeypatch.setattr(recompute_mod, "solve_recompute", counted)
    case = models.meta_gpt(n_layer=4, n_embd=256, n_head=4, batch=64, seq=128)
    mesh = autopar.Mesh((8,), hardware="h100", devices_per_node=4)
    got = _plan(case, mesh, memory_budget=0.28 * GB, baselines=True)
    row = got.baselines["spmd (8,)"]
    assert (8,) not in solved and not row["feasible"] and "not solved" in row["reason"]
    assert got.memory_per_device <= 0.28 * GB and got.predicted_step_time < row["bound"]
    alone = _plan(case, mesh, memory_budget=0.28 * GB, num_stages=None)
    assert (8,) in solved and alone.recompute and alone.memory_per_device <= 0.28 * GB
    assert alone.predicted_step_time >= row["bound"] * (1 - 1e-9)


def test_only_the_plan_kept_is_assembled(monkeypatch):
    """The default call solves the SPMD plan of every shape of the devices (16 as 2 x 8, 16, 8 x 2, 4 x 4) and
    keeps one: only that one's Plan is assembled (collectives, per-node choices, candidates table: ~0.5 CPU s
    per shape on Llama-3-8B's full graph); the others are rows of its table, with their solved step."""
    from autopar.planning import spmd
    assembled = []
    real = spmd.assemble_plan
    monkeypatch.setattr(spmd, "assemble_plan", lambda *a: assembled.append(a[2]) or real(*a))
    got = _plan(_gpt(), _mesh(16, True), baselines=True)
    rows = {k: v for k, v in got.baselines.items() if k.startswith("spmd ") and v["feasible"]}
    assert assembled == [got.mesh] and len(rows) >= 2
    for name, row in rows.items():   # each row's step is its own shape's plan, as planned alone
        shape = tuple(int(x) for x in name.removeprefix("spmd (").rstrip(")").split(",") if x.strip())
        alone = _plan(_gpt(), autopar.Mesh(shape, hardware="h100", devices_per_node=8), num_stages=None)
        assert row["time"] == pytest.approx(alone.predicted_step_time, rel=1e-9)
