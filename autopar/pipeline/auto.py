"""The default layout search (`autopar.plan` without `num_stages`): SPMD plans and every pipeline that could beat them.

One capture of the whole batch (under the mixed-precision policy, with `example_kwargs`), then:
  1. pp = 1: the SPMD plan on the caller's mesh, exactly `autopar.planning.spmd.plan_captured`
     (recompute decided by the solver, the textbook recipes as its baselines); on a mesh of several
     axes also the SPMD plan on its 1-D flattening (the same devices, hardware and devices per node),
     so that every layout `Mesh((N,))` plans is a candidate of `Mesh((N // k, k))` too, priced with
     the same links: the 2-D plan is never slower than the 1-D one, and never infeasible where it fits.
  2. pp >= 2: the pipeline candidates of `autopar.pipeline.search` (pp x dp x tp with tp inside a
     node, micro-batch counts, the runtime's schedules), by branch and bound with the fastest SPMD
     plan's step as the incumbent: a candidate is priced (its micro-batch graph captured, its stage
     SPMD problem solved) only if a lower bound of its step is below the best found so far. The bound
     needs no further capture (`Profiler.one_device_seconds`: the whole batch's one-device seconds
     over m), so a model that SPMD already serves at near-linear scaling costs nothing more.
     The branch and bound is anytime: once a plan fits, pipelines are priced best bound first for
     `search_seconds` (default as long as the SPMD candidates took); the candidates left then are
     counted in `plan.solver["search"]` ("exact": False when any was left).
  3. The fastest feasible candidate is the plan. A pipelined one is built from the very solution the
     search priced (`Profiler.solution`, `stages.partition`'s split): its predicted step and memory
     are the search's.
When nothing fits, InfeasiblePlanError.min_memory_per_device is a lower bound over the whole space:
the least of the SPMD solver's bound (with recompute) and, for pipelines, the model's state sharded
over every device (no split of any stage count holds less). The message also names the least
memory a candidate needed.
"""
from __future__ import annotations

import dataclasses
import time

from autopar.capture import precision
from autopar.capture.canonicalize import canonicalize
from autopar.capture.trace import capture
from autopar.costmodel.memory import format_bytes, parse_bytes
from autopar.debug import PhaseTimer, log
from autopar.errors import InfeasiblePlanError, InputError
from autopar.mesh import Mesh
from autopar.pipeline import planning as pipelined
from autopar.pipeline.candidates import Candidate, branch_and_bound
from autopar.pipeline.layer_profile import layer_costs
from autopar.pipeline.search import Profiler, batch_size, candidate_jobs, state_floor
from autopar.pipeline.stages import INTERLEAVE
from autopar.plan import Plan
from autopar.planning import spmd
from autopar.sharding import recipes


def plan_auto(model, example_inputs, *, mesh: Mesh, memory_budget=None, optimizer: str = "adamw", loss_fn=None,
              time_limit=None, example_kwargs=None, baselines: bool = True, mixed_precision=None, recompute=None,
              num_microbatches=None, schedule=None, pipelines: bool = True, search_seconds: float | None = None) -> Plan:
    """`autopar.plan`'s default: the fastest of the SPMD plans and the pipelined layouts (module docstring).
    `pipelines=False` prices the SPMD candidates only. `search_seconds`: how long pipeline candidates
    may be priced once a plan fits (default: as long as the SPMD candidates took, so the default
    search at most about doubles an SPMD plan's time; float("inf"): until the branch and bound
    completes, the exact search)."""
    budget = parse_bytes(memory_budget) if memory_budget is not None else None
    if schedule is not None and schedule not in pipelined.SCHEDULES:
        raise InputError(f"unknown pipeline schedule {schedule!r}; valid: {pipelined.SCHEDULES}")
    policy = precision.as_policy(mixed_precision)
    timer = PhaseTimer()
    with timer("capture"):
        captured = capture(model, example_inputs, example_kwargs=example_kwargs, loss_fn=loss_fn,
                           mixed_precision=policy)
    with timer("canonicalize"):
        canonicalize(captured.gm)
    prof = Profiler(model, example_inputs, mesh.hardware, mesh.devices_per_node, optimizer, loss_fn, time_limit,
                    policy, example_kwargs)
    prof.captures[1] = (captured, tuple(example_inputs))   # the whole batch: the bounds' graph
    pipelines = pipelines and mesh.size > 1 and recompute in (None, "auto", "none") and _splits_batch(example_inputs)
    plans, floors, unexplored = [], [], []
    start = time.perf_counter()
    for k, spmd_mesh in enumerate(_spmd_meshes(mesh)):
        phases = PhaseTimer()
        try:
            plans.append(spmd.plan_captured(captured, model, example_inputs, mesh=spmd_mesh,
                                            memory_budget=memory_budget, optimizer=optimizer, time_limit=time_limit,
                                            baselines=baselines and k == 0, timer=phases, recompute=recompute))
        except InfeasiblePlanError as e:
            floors.append(e)
        for name, seconds in phases.items():
            if name != "total":
                timer[name] = timer.get(name, 0.0) + seconds
    spmd_seconds = time.perf_counter() - start
    fits = [p for p in plans if p.feasible]
    best = min(fits, key=lambda p: p.predicted_step_time, default=None)
    incumbent = best.predicted_step_time if best is not None else float("inf")
    found: list[Candidate] = []
    jobs: list[tuple] = []
    if pipelines:
        with timer("search"):
            schedules = (schedule,) if schedule else pipelined.SCHEDULES
            jobs = candidate_jobs(prof, mesh, batch_size(example_inputs), schedules, num_microbatches,
                                  [p for p in range(2, mesh.size + 1)], accumulate=False)
            allowance = search_seconds if search_seconds is not None else spmd_seconds
            # a first pricing captures a micro-batch graph and solves it: about a capture and an SPMD plan
            estimate = timer.get("capture", 0.0) + spmd_seconds / len(plans + floors)
            if best is not None and allowance < estimate:   # not one pricing fits the allowance
                unexplored = [job for job in jobs for _ in job[4]]
            else:
                found = branch_and_bound(prof, jobs, budget, None, keep=1, incumbent=incumbent,
                                         deadline=time.perf_counter() + allowance, unexplored=unexplored,
                                         estimate=estimate)
            log(1, f"layout search: {sum(len(j[4]) for j in jobs)} pipeline candidates, {len(found)} priced, "
                   f"{len(unexplored)} left unexplored after {allowance:.3g} s (incumbent {incumbent:.4g} s)")
    piped = min((c for c in found if c.feasible), key=lambda c: c.step_time, default=None)
    if piped is not None and piped.step_time < incumbent:
        with timer("stages"):
            best = pipelined_plan(prof, piped, model, budget, timer)
    if best is None:
        raise _infeasible(model, mesh, budget, optimizer, plans, floors, found, pipelines)
    timer["total"] = sum(v for k, v in timer.items() if k != "total")
    table = dict(best.baselines)
    for p in plans:
        if p is not best and p.feasible:
            table[f"spmd {p.mesh.shape}"] = {"feasible": True, "time": p.predicted_step_time,
                                              "memory": p.memory_per_device, "reason": ""}
    for c in sorted((c for c in found if c.feasible and c is not piped), key=lambda c: c.step_time)[:3]:
        table[_label(c)] = {"feasible": True, "time": c.step_time, "memory": c.memory_per_device, "reason": ""}
    if piped is not None and best.stages == ():
        table[_label(piped)] = {"feasible": True, "time": piped.step_time, "memory": piped.memory_per_device,
                                "reason": ""}
    search = {"pipeline_candidates": sum(len(j[4]) for j in jobs) if pipelines else 0, "priced": len(found),
              "unexplored": len(unexplored), "exact": not unexplored}
    return dataclasses.replace(best, baselines=table if baselines else best.baselines, timings=dict(timer),
                               solver={**best.solver, "search": search})


def pipelined_plan(prof: Profiler, best: Candidate, model, budget, timer) -> Plan:
    """The pipelined Plan of a priced candidate, from the solution and split the search priced."""
    m, sub = best.num_microbatches, prof.sub_mesh(best.dp, best.tp)
    cap, inputs = prof.captured(m)
    prob = prof.problem(m, best.dp, best.tp)
    sol = prof.solution(m, best.dp, best.tp, best.inner_budget, None, best.inner_weight)
    wanted = recipes.normalize("auto", sub)
    one_stage = spmd.assemble_plan(prob, cap, sub, "auto", wanted, None, sol, "", {}, timer, model, inputs)
    layers = layer_costs(prob, sol.choice, cap)
    full = Mesh((best.pp, *sub.shape), ("pp", *sub.axis_names), prof.hardware, prof.dpn)
    v = INTERLEAVE if best.schedule == "interleaved_1f1b" else 1
    return pipelined.widen(one_stage, full, layers, best.split, m, best.schedule, budget, cap, v)


def _spmd_meshes(mesh: Mesh) -> list[Mesh]:
    """The caller's mesh, then (several axes) its 1-D flattening: the same devices and links."""
    if mesh.ndim == 1:
        return [mesh]
    return [mesh, Mesh((mesh.size,), hardware=mesh.hardware, devices_per_node=mesh.devices_per_node)]


def _splits_batch(example_inputs) -> bool:
    try:
        return batch_size(example_inputs) > 1
    except InputError:
        return False


def _label(c: Candidate) -> str:
    return f"pp{c.pp} dp{c.dp} tp{c.tp} m{c.num_microbatches} {c.schedule}"


def _infeasible(model, mesh, budget, optimizer, plans, floors, found, pipelines) -> InfeasiblePlanError:
    """No candidate fits: a lower bound over the whole space, and the least memory a candidate needed."""
    spmd_floor = min([e.min_memory_per_device for e in floors if e.min_memory_per_device is not None]
                     + [p.memory_per_device for p in plans], default=0.0)
    bound = min(spmd_floor, state_floor(model, mesh.size, optimizer)) if pipelines else spmd_floor
    least = min([spmd_floor] + [c.memory_per_device for c in found if not c.feasible])
    where = "SPMD or pipelined " if pipelines else "SPMD "
    return InfeasiblePlanError(
        f"no {where}plan of {mesh.size} devices fits {format_bytes(budget)} per device: the smallest plan needs "
        f"{format_bytes(bound)} or more (a lower bound over every recipe, recompute setting and stage count; "
        f"the least a priced candidate needed is {format_bytes(least)}); raise memory_budget, use more "
        f"devices, or pass mixed_precision='bf16'",
        min_memory_per_device=bound, budget=budget)
