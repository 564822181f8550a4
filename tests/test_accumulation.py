"""Gradient accumulation in the default layout search: pp = 1 with m > 1 micro-batches (one stage, the
micro-batches one after another, their gradients summed, one optimizer step) is a candidate beside SPMD
and the pipelines (`autopar.pipeline.auto`), priced by `candidates.price` and built by
`auto.pipelined_plan` as a one-stage plan on a ("pp" of 1, ...) mesh, which the pipelined runtime runs.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from test_pipeline import train_pipelined

import autopar
from autopar._testing import models
from autopar._testing.dist_cases import train_reference
from autopar._testing.dist_utils import run_distributed
from autopar.debug import PhaseTimer
from autopar.pipeline.auto import pipelined_plan
from autopar.pipeline.candidates import branch_and_bound, price
from autopar.pipeline.search import Profiler

REL = 1e-9
STEPS = 3


def test_the_default_search_accumulates_where_smaller_micro_batches_on_one_stage_are_fastest():
    """Two H100s, a GPT whose activations are most of its memory, 80% of its budget-free plan's memory:
    no SPMD plan fits without recompute (recompute off here), and two micro-batches on one stage beat every
    pipeline (their bubble) and every layout of one micro-batch. The plan is the one the search priced."""
    case = models.meta_gpt(n_layer=2, n_embd=256, n_head=4, batch=32, seq=256)
    mesh = autopar.Mesh((2,), hardware="h100")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        free = autopar.plan(case.model, case.example_inputs, mesh=mesh, baselines=False, num_stages=None)
        budget = int(0.8 * free.memory_per_device)
        plan = autopar.plan(case.model, case.example_inputs, mesh=mesh, memory_budget=budget, recompute="none")
        prof = Profiler(case.model, case.example_inputs, mesh.hardware, mesh.devices_per_node)
        [priced] = price(prof, 1, 1, 2, plan.num_microbatches, ("1f1b",), budget, recompute=False)
        piped = [c for m in (2, 4) for c in price(prof, 2, 1, 1, m, ("gpipe", "1f1b"), budget, recompute=False)]
    assert len(plan.stages) == 1 and plan.mesh.shape[0] == 1 and plan.mesh.axis_names[0] == "pp", plan.mesh
    assert plan.num_microbatches == 2 and plan.memory_per_device <= budget
    assert plan.predicted_step_time == pytest.approx(priced.step_time, rel=REL)
    assert plan.memory_per_device == pytest.approx(priced.memory_per_device, rel=REL)
    assert plan.solver["search"]["pipelines_searched"] and plan.solver["search"]["priced"] >= 2, plan.solver
    rivals = [v["time"] for v in plan.baselines.values() if v.get("feasible")] + \
        [c.step_time for c in piped if c.feasible]
    assert len(rivals) >= 2 and all(plan.predicted_step_time < t for t in rivals), (plan.baselines, piped)
    assert "gradient accumulation over 2 micro-batches" in plan.summary()
    # the textbook recipes of the caller's mesh, whose SPMD plan does not fit, are listed with what they need
    assert {"dp", "zero3", "tp"} <= set(plan.baselines), plan.baselines
    assert not plan.baselines["dp"]["feasible"] and plan.baselines["dp"]["memory"] > budget


def test_fast_search_prices_accumulation_rows_after_the_rest_and_finds_the_exact_best():
    """search="fast": one-stage candidates are priced first by their budget-free plan alone; those whose
    plan does not fit so (their memory rows to solve) wait until every other candidate is priced, here
    two micro-batches after four at half the budget-free plan's memory. The fastest found is the fastest
    of pricing every candidate on its own, as the exact search does."""
    case = models.meta_gpt(n_layer=2, n_embd=256, n_head=4, batch=32, seq=256)
    mesh = autopar.Mesh((2,), hardware="h100")
    jobs = [(1, 1, 2, 2, ("1f1b",)), (1, 2, 1, 2, ("1f1b",)), (1, 1, 2, 4, ("1f1b",)), (1, 2, 1, 4, ("1f1b",)),
            (2, 1, 1, 2, ("gpipe", "1f1b")), (2, 1, 1, 4, ("gpipe", "1f1b"))]

    def profiler():
        return Profiler(case.model, case.example_inputs, mesh.hardware, mesh.devices_per_node)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        free = autopar.plan(case.model, case.example_inputs, mesh=mesh, baselines=False, num_stages=None)
        for share, waits in ((0.8, False), (0.5, True)):
            budget = share * free.memory_per_device
            found = branch_and_bound(profiler(), jobs, budget, None, keep=1, fast=True, recompute=False)
            alone = [c for pp, dp, tp, m, names in jobs for c in price(profiler(), pp, dp, tp, m, names, budget,
                                                                         recompute=False)]
            assert min(c.step_time for c in found if c.feasible) == \
                pytest.approx(min(c.step_time for c in alone if c.feasible), rel=REL), (found, alone)
            first = [i for i, c in enumerate(found) if c.pp > 1 or (c.feasible and c.inner_budget is None)]
            waited = [i for i, c in enumerate(found) if i not in first]
            assert bool(waited) == waits and all(i > j for i in waited for j in first), found
            assert all(found[i].num_microbatches == 2 for i in waited), found


def _accumulation_plan(case, mesh):
    """The plan the default search builds for gradient accumulation over 4 micro-batches on one stage of
    `mesh`'s devices (data parallel), as `auto.pipelined_plan` builds a priced candidate."""
    prof = Profiler(case.model, case.args, mesh.hardware, mesh.devices_per_node)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        [c] = price(prof, 1, mesh.size, 1, 4, ("1f1b",), None)
        plan = pipelined_plan(prof, c, case.model, None, PhaseTimer())
    assert len(plan.stages) == 1 and plan.num_microbatches == 4 and tuple(plan.mesh.shape) == (1, mesh.size)
    assert plan.predicted_step_time == pytest.approx(c.step_time, rel=REL)
    return plan


def test_an_accumulation_plan_trains_like_one_process():
    """World 2: the searched one-stage plan of 4 micro-batches trains 3 AdamW steps like one process on the
    whole batch; each rank's program reduces no gradient itself (the runtime all-reduces each once per
    step, after the 4 micro-batches), and the deferred reductions are the plan's."""
    case = models.tiny_gpt(n_layer=2, batch=8, seq=16)
    plan = _accumulation_plan(case, autopar.Mesh((2,)))
    batches = models.zoo_batches(case, STEPS)
    results = run_distributed(train_pipelined, 2, case.model, batches, STEPS, [dict(plan=plan)], timeout=600)
    ref_losses, ref_state = train_reference(case.model, batches, STEPS)
    for rank in range(2):
        got = results[rank][0]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"rank {rank} losses: {m}")
        assert autopar.Plan.from_json(got["plan"]) == plan
        assert not [c for c in got["emitted"] if c[1] == "all_reduce" and c[3].startswith("gradient")], got["emitted"]
    for key, want in ref_state.items():
        torch.testing.assert_close(results[0][0]["state"][key], want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
    reduced = {c.source for c in plan.collectives if c.reason == "gradient" and c.kind == "all_reduce"}
    assert {d[0] for d in results[0][0]["deferred"]} == reduced
