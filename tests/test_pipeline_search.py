"""Pipeline x data x tensor parallel search (autopar/pipeline/search.py) and the per-unit cost
profile it partitions (autopar/pipeline/layer_profile.py). Planning only: one process, meta-device models."""
from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch

import autopar
from autopar._testing import models
from autopar._testing.gpt import GPT, GPTConfig
from autopar.capture.canonicalize import canonicalize
from autopar.capture.trace import capture
from autopar.costmodel.hardware import LinkSpec, get_hardware
from autopar.errors import InfeasiblePlanError
from autopar.pipeline.layer_profile import POST, PRE, layer_costs
from autopar.pipeline.search import (
    candidate_jobs,
    microbatch_counts,
    search,
    split_inputs,
    state_floor,
    to_plan,
)
from autopar.pipeline.stages import partition, step_weight
from autopar.planning import assemble
from autopar.planning.problem import ProblemBuilder
from autopar.planning.solver import solve


def _profile(case, mesh):
    cap = capture(case.model, case.args, example_kwargs=case.kwargs or None)
    canonicalize(cap.gm)
    prob = ProblemBuilder(cap, mesh).build()
    sol = solve(prob.cg, dedup_layers=bool(prob.cg.layer_groups), cache=prob.solver_cache)
    return layer_costs(prob, sol.choice, cap), assemble.totals(prob, sol.choice)


@pytest.mark.parametrize("make,stack,hidden", [
    (lambda: models.tiny_gpt(n_layer=3), "transformer.h", 32),   # autopar/_testing/gpt.py
    (lambda: models.tiny_llama(), "model.layers", 64),
])
def test_layer_costs_units_in_order_and_sum_to_the_spmd_totals(make, stack, hidden):
    case = make()
    num_layers = sum(1 for n, _ in case.model.named_modules() if n.startswith(stack + ".") and n.count(".") ==
                     stack.count(".") + 1)
    layers, tot = _profile(case, autopar.Mesh((2,)))
    assert [x.name for x in layers] == [PRE] + [f"{stack}.{i}" for i in range(num_layers)] + [POST]
    assert sum(x.forward + x.backward + x.per_step for x in layers) == pytest.approx(tot["step"], rel=1e-9)
    assert sum(x.state_bytes + x.activation_bytes for x in layers) == pytest.approx(sum(tot["memory"].values()))
    assert sum(x.activation_bytes for x in layers) == pytest.approx(tot["memory"]["activations"])
    blocks = layers[1:-1]
    assert all(x.forward > 0 and x.backward > x.forward * 0.5 and x.state_bytes > 0 for x in blocks)
    assert all(x.per_step > 0 for x in blocks)            # optimizer update of the block's parameters
    batch, seq = case.args[0].shape
    full = batch * seq * hidden * 4                       # the residual stream, fp32
    assert all(x.boundary_bytes in (full, full / 2) or x.boundary_bytes > full for x in layers[:-2])
    assert layers[-2].boundary_bytes in (full, full / 2)  # the last block sends only the hidden state
    assert layers[-1].boundary_bytes == 0



def test_stage_plans_minimise_the_schedules_weighting_of_per_step_seconds():
    """A pipeline's step runs a stage's per-micro-batch seconds S / pp in m + pp - 1 slots and its per-step
    seconds P / pp (optimizer, ZeRO-1/2 gathers, gradient all-reduces) once: the stage SPMD plan minimises
    S + P / (pp + m - 1) (`stages.step_weight`), and gradient accumulation S + P / m. Solving S + P
    traded per-micro-batch seconds for per-step ones: Llama-3-70B (8 layers) on pp 4 x dp 16 x tp 8, m 16,
    1F1B split at 1,700 ms against 1,024 ms now (plain data x tensor parallelism: 1,025)."""
    from autopar.mesh import Mesh
    from autopar.pipeline.search import Profiler
    from autopar.pipeline.stages import step_weight
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=8, n_head=4, n_embd=256))
    x = torch.randint(0, 256, (64, 32))
    hw = get_hardware("h100")
    prof = Profiler(model, (x, x), hw, 8)
    ratios = []
    for pp, dp, tp, m in [(2, 4, 1, 8), (2, 2, 2, 8), (2, 4, 1, 16), (1, 8, 1, 4)]:
        full = Mesh((pp, dp, tp), ("pp", "dp", "tp"), hw, 8)
        r = step_weight(pp, m)
        assert r == 1 / (pp + m - 1) and step_weight(1, 1) == 1.0
        steps, objective = [], []
        for weight in (1.0, r):
            layers = prof.layers(m, dp, tp, None, step_weight=weight)
            per_mb, per_step = sum(u.forward + u.backward for u in layers), sum(u.per_step for u in layers)
            objective.append(per_mb + r * per_step)
            steps.append(partition(layers, pp, m, "1f1b", memory_budget=None, overhead=hw.runtime_overhead,
                                   p2p_time=lambda b: full.p2p_time(b, "pp") if pp > 1 else 0.0).step_time)
        assert objective[1] <= objective[0] * (1 + 1e-3), (pp, dp, tp, m, objective)   # the solver's gap aside
        assert steps[1] <= steps[0] * (1 + 1e-3), (pp, dp, tp, m, steps)
        ratios.append(steps[1] / steps[0])
    assert min(ratios) < 0.9, ratios   # 0.70-0.90 when measured


def test_forced_stages_solve_the_stage_plan_for_the_pipelines_step():
    """`plan(num_stages=p)` solves its stage plan as the search does, for S + P / (p + m - 1): its predicted
    step is the split of the search's weighted profile, below the split of the S + P plan (whose per-step
    seconds the schedule pays once, not m + p - 1 times)."""
    from autopar.pipeline.search import Profiler
    from autopar.pipeline.stages import step_weight
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=8, n_head=4, n_embd=256))
    x = torch.randint(0, 256, (64, 32))
    hw = get_hardware("h100")
    mesh = autopar.Mesh((2, 4), ("pp", "dp"), hardware=hw, devices_per_node=8)
    plan = autopar.plan(model, (x, x), mesh=mesh, num_stages=2, num_microbatches=8, schedule="1f1b")
    prof = Profiler(model, (x, x), hw, 8)
    steps = {}
    for weight in (1.0, step_weight(2, 8)):
        layers = prof.layers(8, 4, 1, None, step_weight=weight)
        steps[weight] = partition(layers, 2, 8, "1f1b", memory_budget=None, overhead=hw.runtime_overhead,
                                  p2p_time=lambda b: mesh.p2p_time(b, "pp")).step_time
    assert plan.predicted_step_time == pytest.approx(steps[step_weight(2, 8)], rel=1e-9), steps
    assert plan.predicted_step_time < 0.95 * steps[1.0], (plan.predicted_step_time, steps)


def test_split_inputs_cuts_every_batch_tensor():
    ids = torch.zeros(8, 4, dtype=torch.long)
    args = split_inputs((ids, {"labels": ids, "scale": torch.ones(3)}), 4)
    assert args[0].shape == (2, 4) and args[1]["labels"].shape == (2, 4) and args[1]["scale"].shape == (3,)
    assert microbatch_counts(8, 2, 2) == [2, 4]     # m = 8 leaves a micro-batch of 1 for dp = 2
    assert microbatch_counts(8, 1, 1, [3, 4]) == [4]


def _slow_inter_node(devices_per_node: int):
    hw = get_hardware("h100")
    slow = LinkSpec(hw.inter_node.bandwidth / 100, hw.inter_node.latency * 10)
    return replace(hw, name="h100-slow-inter", inter_node=slow, devices_per_node=devices_per_node)


def test_two_nodes_slow_link_keep_tp_inside_a_node():
    """2 nodes x 4 devices, a 100x slower inter-node link: tp never crosses nodes, the axis that does
    is pp or dp, and the best candidate is the fastest one priced."""
    case = models.meta_gpt(n_layer=6, n_embd=256, n_head=4, batch=8, seq=128)
    mesh = autopar.Mesh((8,), hardware=_slow_inter_node(4), devices_per_node=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = search(case.model, case.example_inputs, mesh=mesh, memory_budget="80GB", num_microbatches=4)
    shapes = {(c.pp, c.dp, c.tp) for c in res.candidates}
    assert all(4 % tp == 0 for _, _, tp in shapes) and any(pp > 1 for pp, _, _ in shapes)
    assert res.best.step_time == min(c.step_time for c in res.candidates if c.feasible)
    table = res.baseline_table(3)
    assert len(table) == 3 and next(iter(table.values()))["time"] == res.best.step_time
    crossing = [a for a in res.mesh.axis_names if res.mesh.axis_size(a) > 1 and res.mesh.is_inter_node(a)]
    assert crossing and set(crossing) <= {"pp", "dp"}
    assert res.best.tp == 1 or not res.mesh.is_inter_node("tp")
    # the reported split is reproducible from the profile the result carries
    again = partition(res.layers, res.best.pp, res.best.num_microbatches, res.best.schedule,
                      p2p_time=lambda b: res.mesh.collective_time("send_recv", b, "pp"), memory_budget=80e9)
    assert again.step_time == pytest.approx(res.best.step_time)
    assert sum(len(s) for s in res.best.stage_modules) == len(res.layers)


def test_pipeline_stages_forced_when_requested():
    case = models.meta_gpt(n_layer=6, n_embd=128, n_head=4, batch=8, seq=64)
    mesh = autopar.Mesh((4,), hardware="h100", devices_per_node=4)
    res = search(case.model, case.example_inputs, mesh=mesh, num_stages=4, num_microbatches=8,
                 schedules=("1f1b",))
    assert {(c.pp, c.num_microbatches, c.schedule) for c in res.candidates} == {(4, 8, "1f1b")}
    split = res.best.split
    assert len(split.bounds) == 4 and split.bubble_fraction > 0
    assert res.best.memory_per_device == max(split.stage_memory)
    plan = to_plan(res, case.model)   # the pipelined Plan (autopar/pipeline/planning.py) agrees with the search
    assert plan.mesh.axis_names[0] == "pp" and len(plan.stages) == 4 and plan.num_microbatches == 8
    assert [s.modules[0] for s in plan.stages] == [m[0] for m in res.best.stage_modules]
    assert plan.predicted_step_time == pytest.approx(res.best.step_time, rel=1e-6)


def test_llama3_70b_on_8_h100_is_infeasible_with_the_minimum_memory():
    case = models.meta_llama3_70b(batch=8, seq=4096)
    with pytest.raises(InfeasiblePlanError) as info:
        search(case.model, case.example_inputs, mesh=autopar.Mesh((8,), hardware="h100"), memory_budget="80GB")
    params = sum(p.numel() for p in case.model.parameters())
    assert params > 69e9
    need = info.value.min_memory_per_device
    assert need == pytest.approx(state_floor(case.model, 8)) and need == pytest.approx(params * 16 / 8)
    assert need > 80e9 and info.value.budget == 80e9


def test_activations_over_budget_raise_with_the_least_memory_of_any_candidate():
    """State fits (so the fast check passes) but no candidate's activations do: the error carries
    the least memory the priced candidates need, and a budget of that size is feasible."""
    case = models.meta_gpt(n_layer=6, n_embd=128, n_head=4, batch=8, seq=256)
    mesh = autopar.Mesh((2,), hardware="h100", devices_per_node=2)
    tight = 1.2 * state_floor(case.model, 2)
    with pytest.raises(InfeasiblePlanError) as info:
        search(case.model, case.example_inputs, mesh=mesh, memory_budget=tight, num_microbatches=[2])
    need = info.value.min_memory_per_device
    assert need > tight
    res = search(case.model, case.example_inputs, mesh=mesh, memory_budget=need * 1.0001, num_microbatches=[2])
    assert res.best.memory_per_device <= need * 1.0001


def test_llama3_70b_on_64_h100_fits_80gb():
    """Llama-3-70B (80 layers, meta) on 8 nodes x 8 H100s: 8 stages of tp 8, 8 micro-batches (the
    full search over every pp x dp x tp runs in benchmarks/plan_quality.py)."""
    case = models.meta_llama3_70b(batch=8, seq=4096)
    mesh = autopar.Mesh((64,), hardware="h100")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = search(case.model, case.example_inputs, mesh=mesh, memory_budget="80GB", num_stages=8,
                     num_microbatches=8, schedules=("1f1b",))
    best = res.best
    assert (best.pp, best.dp * best.tp) == (8, 8) and best.feasible
    assert best.memory_per_device <= 80e9 and max(best.split.stage_memory) == best.memory_per_device
    assert len(res.layers) == 82 and sum(len(s) for s in best.stage_modules) == 82
    assert res.mesh.is_inter_node("pp") and not res.mesh.is_inter_node(res.mesh.axis_names[-1])
    # balanced by time: no stage is slower than the average plus the largest unit (what the optimal
    # contiguous split guarantees), with 1% for its point-to-point sends. The split is free among
    # splits of the same slowest stage: with a light first stage it holds fewer in-flight activations.
    units = [u.forward + u.backward for u in res.layers]
    assert max(best.split.stage_times) <= 1.01 * (sum(units) / 8 + max(units))


def test_pruned_search_finds_the_exhaustive_best_and_runners_up():
    """Branch and bound (`prune=True`, the default) skips candidates whose lower bound exceeds the
    k-th fastest found: the best k are those of pricing every candidate, every bound is below the
    time it bounds, and some candidates are skipped (else the bound would be doing nothing)."""
    from autopar.pipeline.search import Profiler
    from autopar.pipeline.stages import INTERLEAVE, step_lower_bound
    case = models.meta_gpt(n_layer=6, n_embd=128, n_head=4, batch=16, seq=128)
    mesh = autopar.Mesh((8,), hardware=_slow_inter_node(4), devices_per_node=4)
    prof = Profiler(case.model, case.example_inputs, mesh.hardware, 4)
    kw = dict(mesh=mesh, memory_budget="80GB", profiler=prof)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        every = search(case.model, case.example_inputs, prune=False, **kw)
        pruned = search(case.model, case.example_inputs, exact_top=3, **kw)
        best = search(case.model, case.example_inputs, **kw)
    top = [c for c in every.candidates if c.feasible][:3]
    assert pruned.candidates[:3] == tuple(top) and best.best == top[0]
    assert len(best.candidates) <= len(pruned.candidates) < len(every.candidates)
    two_d = []
    for c in top + [c for c in every.candidates[3:] if c.feasible]:
        ops, step = prof.one_device_seconds(c.num_microbatches)
        cheap = step_lower_bound(ops / (c.dp * c.tp), step / (c.dp * c.tp), c.pp, c.num_microbatches, c.schedule,
                                 INTERLEAVE)
        forest = prof.forest_bound(c.num_microbatches, c.dp, c.tp, None, c.pp, c.schedule)
        assert cheap <= c.step_time * (1 + 1e-9) and forest <= c.step_time * (1 + 1e-9)
        if min(c.dp, c.tp) > 1:   # the fast search's LP bound (2-D sub-meshes): between the forest and the step
            f = step_lower_bound(1.0, 0.0, c.pp, c.num_microbatches, c.schedule, INTERLEAVE)
            lp = f * prof.lp_bound(c.num_microbatches, c.dp, c.tp, None, 1 / (c.pp * f))
            assert forest <= lp * (1 + 1e-6) and lp <= c.step_time * (1 + 1e-9)
            # the ratio the search bounds with (every schedule's: the 1F1B step weight) bounds it too
            searched = f * prof.lp_bound(c.num_microbatches, c.dp, c.tp, None, step_weight(c.pp, c.num_microbatches))
            assert searched <= lp * (1 + 1e-9)
            two_d.append((forest, lp, c.step_time))
    assert two_d and any(lp > forest * 1.01 for forest, lp, _ in two_d)   # the LP adds communication


def test_the_default_search_leaves_out_gpipe_where_1f1b_dominates_it():
    """GPipe and 1F1B step by the same formula and a 1F1B stage keeps no more micro-batches in flight
    (`search.dominated_by_1f1b`): priced side by side, 1F1B fits wherever GPipe does and is never slower,
    and under a tight budget it fits where GPipe does not. So the default search (`keep_dominated=False`)
    lists GPipe only where 1F1B is not searched or cannot run (torch's Schedule1F1B needs m >= pp)."""
    from autopar.pipeline.search import Profiler
    case = models.meta_gpt(n_layer=4, n_embd=64, n_head=4, batch=16, seq=128)
    mesh = autopar.Mesh((8,), hardware=_slow_inter_node(4), devices_per_node=4)
    prof = Profiler(case.model, case.example_inputs, mesh.hardware, 4)
    only_1f1b = 0
    for budget in ("80GB", "100MB"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            every = search(case.model, case.example_inputs, mesh=mesh, memory_budget=budget, profiler=prof,
                           prune=False, num_stages=[2, 4], num_microbatches=[4, 8])
        by = {(c.pp, c.dp, c.tp, c.num_microbatches, c.schedule): c for c in every.candidates}
        pairs = [(c, by[key[:4] + ("1f1b",)]) for key, c in by.items() if key[4] == "gpipe"]
        assert len(pairs) >= 4
        for gpipe, one in pairs:
            assert one.feasible or not gpipe.feasible, (gpipe, one)
            if gpipe.feasible:
                assert one.step_time <= gpipe.step_time * (1 + 1e-9), (gpipe, one)
        only_1f1b += sum(one.feasible and not gpipe.feasible for gpipe, one in pairs)
    assert only_1f1b > 0   # the tight budget: 1F1B's fewer micro-batches in flight fit where GPipe's do not
    schedules = ("gpipe", "1f1b", "interleaved_1f1b")
    kept = candidate_jobs(prof, mesh, 16, schedules)
    lean = candidate_jobs(prof, mesh, 16, schedules, keep_dominated=False)
    assert [j[:4] for j in kept] == [j[:4] for j in lean]
    assert all("gpipe" in j[4] for j in kept if j[0] > 1) and all("gpipe" not in j[4] for j in lean)
    assert all(j[4] == ("1f1b", "interleaved_1f1b") for j in lean if j[0] > 1)
    # fewer micro-batches than stages (no 1F1B run), or no 1F1B searched: GPipe stays
    assert all("gpipe" in j[4] for j in candidate_jobs(prof, mesh, 16, schedules, num_microbatches=1,
                                                       keep_dominated=False) if j[0] > 1)
    assert all(j[4] == ("gpipe",) for j in candidate_jobs(prof, mesh, 16, ("gpipe",), keep_dominated=False)
               if j[0] > 1)


def test_profiler_graphs_and_problems_equal_a_plain_capture_and_build():
    """The Profiler captures without generating code per rewrite (lazy recompile) and shares layout
    pricing across builds on one sub-mesh: its graph is node for node a plain capture's, still runs
    as Python code, and its Problems (a second micro-batch size priced with the first's warm cache) are
    those of a fresh ProblemBuilder, bit for bit."""
    import numpy as np

    from autopar.pipeline.search import Profiler
    case = models.meta_gpt(n_layer=6, n_embd=128, n_head=4, batch=8, seq=64)
    mesh = autopar.Mesh((8,), hardware="h100", devices_per_node=4)
    prof = Profiler(case.model, case.example_inputs, mesh.hardware, 4)

    def nodes(gm):
        return [(n.op, str(n.target), repr(n.args), repr(n.kwargs), n.name, n.meta.get("phase"),
                 n.meta.get("module_path"), getattr(n.meta.get("val"), "shape", None)) for n in gm.graph.nodes]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for m in (1, 2):
            cap, inputs = prof.captured(m)
            plain = capture(case.model, inputs, cache=False)
            canonicalize(plain.gm)
            assert nodes(cap.gm) == nodes(plain.gm) and cap.gm.code == plain.gm.code
            fresh = ProblemBuilder(plain, prof.sub_mesh(2, 4)).build()
            shared = prof.problem(m, 2, 4, full=True)   # the full graph's (the search's own: tests/test_depth.py)
            assert len(shared.cg.edges) == len(fresh.cg.edges) > 0
            for a, b in zip(shared.cg.nodes, fresh.cg.nodes):
                np.testing.assert_array_equal(a.time, b.time)
                np.testing.assert_array_equal(a.memory, b.memory)
            for a, b in zip(shared.cg.edges, fresh.cg.edges):
                assert (a.src, a.dst) == (b.src, b.dst)
                np.testing.assert_array_equal(a.time, b.time)
    assert len(prof.reshards) == 1


class _TradeOffProfiler:
    """A stand-in Profiler over SPMD plans of `units` alike units, each plan (state GB, activation GB,
    seconds) per unit: `layers` returns the fastest plan whose state + w * activations meets the
    row, and raises with the least weighted memory when none does, as the solver would."""

    def __init__(self, plans: dict, units: int):
        from autopar.costmodel.hardware import get_hardware
        self.hardware, self.dpn, self.plans, self.units, self.rows = get_hardware("h100"), 8, plans, units, []

    def layers(self, m, dp, tp, row, strategy=None, act_weight=1.0, step_weight=1.0):
        from autopar.errors import InfeasiblePlanError
        from autopar.pipeline.stages import LayerCost
        self.rows.append((row, act_weight))
        weighted = {k: self.units * 1e9 * (s + act_weight * a) for k, (s, a, _) in self.plans.items()}
        fits = [k for k in self.plans if row is None or weighted[k] <= row]
        if not fits:
            raise InfeasiblePlanError("no plan fits the row", min_memory_per_device=min(weighted.values()), budget=row)
        s, a, t = self.plans[min(fits, key=lambda k: self.plans[k][2])]
        return [LayerCost(f"h.{i}", t, 2 * t, s * 1e9, a * 1e9, 0.0) for i in range(self.units)]

    def activation_floor(self, m, k):
        """No floor (`candidates._needs_recompute` never holds): its units cannot recompute anyway."""
        return 0.0

    def recomputed(self, m, dp, tp, row, strategy=None, act_weight=1.0, step_weight=1.0):
        """Its units are no model layers: none can recompute (`candidates._recomputed` then stops). The
        plan is one `layers` solved already: no row is solved again."""
        from autopar.planning.recompute import RecomputeDecision
        rows, found = list(self.rows), self.layers(m, dp, tp, row, strategy, act_weight)
        self.rows = rows
        return found, None, RecomputeDecision()


def test_price_weighs_activations_by_micro_batches_in_flight():
    """pp 2, 1F1B, m 4 (the first stage keeps 2 micro-batches, the second 1: w = 1.5), 20 GB per
    device, 8 units. "fast" meets the unweighted 40 GB row (8 x 5) but needs 27 GB on a stage; the
    weighted row picks "mid" (8 x 4.75 = 38 GB), which splits (18 GB), before any unweighted row."""
    from autopar.pipeline.candidates import price
    prof = _TradeOffProfiler({"fast": (1.0, 4.0, 1.0), "mid": (1.0, 2.5, 1.2), "lean": (1.0, 1.0, 1.5)}, 8)
    [c] = price(prof, 2, 1, 1, 4, ("1f1b",), 20e9)
    assert c.feasible and c.inner_weight == 1.5 and max(c.split.stage_memory) <= 20e9, c
    assert c.step_time < price(_TradeOffProfiler({"lean": (1.0, 1.0, 1.5)}, 8), 2, 1, 1, 4, ("1f1b",), 20e9)[0].step_time
    assert [w for row, w in prof.rows if row is not None] == [1.5]


class _RecomputingProfiler(_TradeOffProfiler):
    """The plans of `_TradeOffProfiler` on units that recompute (activations to a tenth, 1.3x the
    seconds), and an activation floor no plan without recompute fits under (`_needs_recompute`)."""

    def activation_floor(self, m, k):
        return float("inf")

    def recomputed(self, m, dp, tp, row, strategy=None, act_weight=1.0, step_weight=1.0):
        import dataclasses

        from autopar.planning.recompute import RecomputeDecision
        found = super().recomputed(m, dp, tp, row, strategy, act_weight, step_weight)[0]
        paths = tuple(x.name for x in found[:-1])
        return ([dataclasses.replace(x, backward=x.backward + 0.3 * (x.forward + x.backward),
                                     activation_bytes=x.activation_bytes / 10) if x.name in paths else x
                 for x in found], None, RecomputeDecision(paths))


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_a_split_recomputes_only_the_layers_its_devices_need(schedule):
    """`candidates.fewest_recomputed`: of a split priced with every layer but the last recomputing, as few
    layers recompute as each device's budget allows (bounds kept). Eight alike layers, pp 2, m 4, 20 GB:
    against every subset of the seven that can recompute, on the same bounds, it reaches the least step
    of those that fit, and the split it returns is the mixed profile's, priced as `partition` prices."""
    import itertools

    from autopar.pipeline.candidates import fewest_recomputed
    from autopar.pipeline.stages import INTERLEAVE, LayerCost, priced_split
    v = INTERLEAVE if schedule == "interleaved_1f1b" else 1
    plain = [LayerCost(f"h.{i}", 1.0, 2.0, 1e9, 4e9, 1e6) for i in range(8)]
    rc = [replace(x, backward=3.0, activation_bytes=0.4e9) for x in plain[:-1]] + plain[-1:]

    def reprice(layers, bounds):
        return priced_split(layers, bounds, 2, 4, schedule, p2p_time=lambda b: 1e-3, v=v)
    split = partition(rc, 2, 4, schedule, p2p_time=lambda b: 1e-3, memory_budget=20e9, v=v)
    layers, got, names = fewest_recomputed(plain, rc, split, 20e9, 2, 4, schedule, v, reprice)
    assert got.bounds == split.bounds and max(got.stage_memory) <= 20e9
    assert got == reprice(layers, split.bounds)
    assert [x.name for x in layers if x in rc[:-1] and x not in plain] == list(names)
    best = min(s.step_time for s in (reprice([rc[i] if i in on else x for i, x in enumerate(plain)], split.bounds)
                                     for k in range(8) for on in itertools.combinations(range(7), k))
               if max(s.stage_memory) <= 20e9)
    assert got.step_time == pytest.approx(best) and got.step_time < split.step_time
    assert 0 < len(names) < 7


def test_price_solves_no_memory_row_where_only_recompute_fits_and_a_budget_free_plan_does():
    """pp 2, 1F1B, m 4, 9.5 GB per device: no plan splits without recompute (the leanest needs 10 GB on a
    stage), as `_needs_recompute` proves, so every row's plan would be priced recomputed, loosest first.
    The budget-free plan ("fast") splits so (5 units on the first stage: 5 x (1 + 2 x 0.4) = 9 GB), so it
    is the candidate and no memory row is solved for it (on Llama-3.1-405B x 2,048, 7 MIPs of ~59 CPU s):
    the same candidate as solving the rows first, which then recomputes it anyway."""
    from unittest import mock

    from autopar.pipeline import candidates
    plans = {"fast": (1.0, 4.0, 1.0), "mid": (1.0, 2.5, 1.2), "lean": (1.0, 1.0, 1.5)}
    prof = _RecomputingProfiler(plans, 8)
    [c] = candidates.price(prof, 2, 1, 1, 4, ("1f1b",), 9.5e9)
    assert c.feasible and c.inner_budget is None and c.recompute == tuple(f"h.{i}" for i in range(7)), c
    assert all(row is None for row, _ in prof.rows), prof.rows
    every = _RecomputingProfiler(plans, 8)
    with mock.patch.object(candidates, "_needs_recompute", lambda *a: False):   # the rows first, as before
        [d] = candidates.price(every, 2, 1, 1, 4, ("1f1b",), 9.5e9)
    assert any(row is not None for row, _ in every.rows)
    assert (d.step_time, d.memory_per_device, d.recompute, d.inner_budget) == \
        (c.step_time, c.memory_per_device, c.recompute, c.inner_budget)


def test_price_skips_the_rows_of_a_recompute_only_candidate_by_its_recomputed_budget_free_split():
    """pp 2, 1F1B, m 4, 8 GB per device: only recompute fits (`_needs_recompute`), and no budget-free plan
    splits even recomputed, so the rows are solved unless the fast cutoff skips them. The cutoff is
    tested on the plan the rows would be priced as, recomputed: the budget-free plan splits at 60 s as it
    is and at 77.1 s recomputed, so under a best found of 65 s no memory row is solved (on Llama-3.1-405B
    x 2,048, MIPs of 30-50 CPU s each for candidates that lose), while under 80 s they are."""
    from autopar.pipeline import candidates
    plans = {"fast": (1.0, 4.0, 1.0), "mid": (1.0, 2.5, 1.2), "lean": (1.0, 1.0, 1.5)}
    prof = _RecomputingProfiler(plans, 8)
    [c] = candidates.price(prof, 2, 1, 1, 4, ("1f1b",), 8e9, cutoff=65.0)
    assert not c.feasible and c.reason.startswith(candidates.SKIPPED) and "recomputed" in c.reason, c
    assert all(row is None for row, _ in prof.rows), prof.rows
    looser = _RecomputingProfiler(plans, 8)
    [d] = candidates.price(looser, 2, 1, 1, 4, ("1f1b",), 8e9, cutoff=80.0)
    assert d.feasible and d.recompute and d.inner_budget is not None, d


def test_price_retries_a_weighted_row_above_its_floor():
    """12 units, activations only, 8 GB per device: the unweighted 16 GB row picks "wide" (12 x 1.3 GB),
    which needs 10.4 GB on a stage; no plan meets the weighted row (least: "lean", 12 x 1.5 = 18 GB),
    but the split that gives the first stage (2 micro-batches in flight) 4 units and the second 8
    holds 8 GB on each, so the row is retried at FLOOR_SLACK x 18 GB, and that plan splits."""
    from autopar.pipeline.candidates import FLOOR_SLACK, price
    prof = _TradeOffProfiler({"fast": (0.0, 3.0, 1.0), "wide": (0.0, 1.3, 1.3), "lean": (0.0, 1.0, 1.5)}, 12)
    [c] = price(prof, 2, 1, 1, 4, ("1f1b",), 8e9)
    assert c.feasible and c.inner_weight == 1.5 and c.inner_budget == pytest.approx(18e9 * FLOOR_SLACK), c
    assert max(c.split.stage_memory) <= 8e9 and list(c.split.bounds) == [0, 4]


@pytest.mark.parametrize("schedule, budget, weighted", [("gpipe", 8e9, [(16e9, 4.0)]), ("1f1b", 5e9, [])])
def test_price_stops_where_no_split_can_fit(schedule, budget, weighted):
    """The plans of the test above. GPipe keeps m = 4 micro-batches on every stage (w = 4): the least
    weighted memory, 12 x 4 GB = 48 GB, exceeds pp x budget = 16 GB, so no split fits and the row is
    not retried at its floor. 1F1B at 5 GB: no plan meets even the unweighted 10 GB row (least: 12 x
    1 GB), and every stage keeps at least one micro-batch, so no weighted row is tried. Both
    candidates are infeasible."""
    from autopar.pipeline.candidates import price
    prof = _TradeOffProfiler({"fast": (0.0, 3.0, 1.0), "wide": (0.0, 1.3, 1.3), "lean": (0.0, 1.0, 1.5)}, 12)
    [c] = price(prof, 2, 1, 1, 4, (schedule,), budget)
    assert not c.feasible
    assert [r for r in prof.rows if r[1] != 1.0] == weighted, prof.rows
    if weighted:   # nothing is solved after the weighted row that proves no split fits (its tighter rows neither)
        assert prof.rows[-1] == weighted[-1], prof.rows


def test_a_fast_search_solves_no_memory_rows_for_a_candidate_no_faster_than_the_best():
    """`price`'s cutoff (search="fast"): the plans of the weighted-row test above, whose budget-free
    plan ("fast") does not split under 20 GB. With that plan's split without a budget at SKIP_MARGIN
    times the cutoff, no memory row is solved and the candidate comes back skipped, its reason saying
    why; with a cutoff above that, the candidate is priced exactly as without one (the weighted row's plan)."""
    from autopar.pipeline.candidates import SKIP_MARGIN, SKIPPED, price
    plans = {"fast": (1.0, 4.0, 1.0), "mid": (1.0, 2.5, 1.2), "lean": (1.0, 1.0, 1.5)}
    exact = price(_TradeOffProfiler(plans, 8), 2, 1, 1, 4, ("1f1b",), 20e9)
    hw = get_hardware("h100")
    full = autopar.Mesh((2, 1, 1), ("pp", "dp", "tp"), hw, 8)
    free = partition(_TradeOffProfiler(plans, 8).layers(4, 1, 1, None), 2, 4, "1f1b",
                     p2p_time=lambda nbytes: full.p2p_time(nbytes, "pp"), overhead=hw.runtime_overhead).step_time
    assert free < exact[0].step_time
    prof = _TradeOffProfiler(plans, 8)
    [c] = price(prof, 2, 1, 1, 4, ("1f1b",), 20e9, cutoff=free / SKIP_MARGIN)
    assert not c.feasible and c.reason.startswith(SKIPPED) and prof.rows == [(None, 1.0)], (c, prof.rows)
    assert price(_TradeOffProfiler(plans, 8), 2, 1, 1, 4, ("1f1b",), 20e9, cutoff=free / SKIP_MARGIN * 1.01) == exact


def _llama_under_12mb(devices: int):
    """(case, mesh, Profiler, budget): a 4-layer Llama (batch 16 x 256) on `devices` H100s, 4 per node, under
    12 MB per device, where a pipeline fits only with recompute."""
    from autopar.pipeline.search import Profiler
    case = models.tiny_llama(batch=16, seq=256, n_layer=4)
    mesh = autopar.Mesh((devices,), hardware="h100", devices_per_node=4)
    return case, mesh, Profiler(case.model, case.args, mesh.hardware, 4, example_kwargs=case.kwargs), 12e6


def test_the_lp_bound_of_a_recompute_only_candidate_adds_its_least_rerun():
    """The fast search bounds a 2-D group's candidates by its budget-free tiled solve's proven bound
    (`Profiler.lp_bound`, over tiled plans); a candidate only recompute can fit runs a tiled plan's seconds
    plus the re-run of the layers it recomputes, at least `Profiler.rerun_seconds_bound` of its excess, so
    `candidates.branch_and_bound` adds that to the LP. The sum stays below every such candidate's priced step
    (a 4-layer Llama, pp2 x dp2 x tp2 under 12 MB: only recompute fits)."""
    from autopar.pipeline.candidates import _excess, _needs_recompute
    from autopar.pipeline.stages import INTERLEAVE, step_lower_bound
    case, mesh, prof, budget = _llama_under_12mb(8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        every = search(case.model, case.args, mesh=mesh, memory_budget=budget, profiler=prof, prune=False,
                       accumulate=False, meshes=[(2, 2, 2)], num_microbatches=[2, 4])
    reruns = []
    for c in every.candidates:
        pp, k, m, s = c.pp, c.dp * c.tp, c.num_microbatches, c.schedule
        if not (c.feasible and _needs_recompute(prof, pp, k, m, s, budget)):
            continue
        f = step_lower_bound(1.0, 0.0, pp, m, s, INTERLEAVE)
        rerun = prof.rerun_seconds_bound(m, k, _excess(prof, pp, k, m, s, budget))
        lp = prof.lp_bound(m, c.dp, c.tp, None, 1 / (pp * f))
        assert c.recompute and rerun >= 0 and f * (lp + rerun) <= c.step_time * (1 + 1e-9), c
        reruns.append(rerun)
    assert reruns and max(reruns) > 0


def test_a_candidate_only_recompute_can_fit_is_bounded_with_its_rerun():
    """`candidates._needs_recompute`: where one micro-batch's saved activations (at least the whole batch's on
    one device over m k) exceed the budget on the fullest device whatever the split, only full recompute can
    make the candidate fit, and its bound adds the re-run forward ops that freeing the excess takes at least
    (`Profiler.rerun_seconds_bound`: the candidate may recompute fewer layers than all, `fewest_recomputed`).
    A 4-layer Llama, pp2 x dp2, 2 micro-batches, 1F1B: the floor is below what the budget-free plan holds,
    the stronger bound is at most full recompute's and below the step priced with recompute, and the
    pruned search finds the best of all."""
    from autopar.pipeline.candidates import _excess, _needs_recompute, price
    from autopar.pipeline.stages import INTERLEAVE, step_lower_bound
    case, mesh, prof, budget = _llama_under_12mb(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        [free] = price(prof, 2, 2, 1, 2, ("1f1b",), None)
        [fit] = price(prof, 2, 2, 1, 2, ("1f1b",), budget)
        every = search(case.model, case.args, mesh=mesh, memory_budget=budget, profiler=prof, prune=False,
                       accumulate=False)
        best = search(case.model, case.args, mesh=mesh, memory_budget=budget, profiler=prof, accumulate=False)
    floor = prof.activation_floor(2, 2) / (1 / 2 + 1 / 1)   # 1F1B, pp 2, m 2: 2 and 1 micro-batches in flight
    assert budget < floor <= free.memory_per_device
    assert _needs_recompute(prof, 2, 2, 2, "1f1b", budget) and not _needs_recompute(prof, 2, 2, 2, "1f1b", floor)
    ops, step = prof.seconds_bound(2, 2)
    plain = step_lower_bound(ops, step, 2, 2, "1f1b", INTERLEAVE)
    excess = _excess(prof, 2, 2, 2, "1f1b", budget)
    strong = step_lower_bound(ops + prof.rerun_seconds_bound(2, 2, excess), step, 2, 2, "1f1b", INTERLEAVE)
    full = step_lower_bound(ops + prof.rerun_seconds_bound(2, 2), step, 2, 2, "1f1b", INTERLEAVE)
    assert excess > 0 and prof.rerun_seconds_bound(2, 2, 0.0) == 0.0
    assert fit.feasible and fit.recompute and plain < strong <= full and strong <= fit.step_time
    assert best.best == every.best and len(best.candidates) < len(every.candidates)
