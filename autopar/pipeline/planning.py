"""Forced pipelined plans: `plan(..., num_stages=p)` -> a Plan whose mesh has a leading "pp" axis.

Steps (`plan_pipelined_captured`, after the micro-batch graph is captured):
  1. the mesh: a 1-D mesh of N devices becomes Mesh((p, N // p), ("pp", <its axis>)) on the same
     hardware; a mesh with a "pp" axis (first) is used as is; the sub-mesh is every other axis;
  2. the SPMD planner on the MICRO-BATCH graph (inputs split along dim 0 into m micro-batches) and
     the sub-mesh: one strategy per op, shared by every stage, solved for the pipeline's step (S + P /
     (p + m - 1) for S the per-micro-batch seconds, P the per-step ones: `stages.step_weight`, as the
     search solves its stage plans; `layer_profile.step_weighted`) and priced unweighted;
  3. per-unit costs of that solution (`autopar.pipeline.layer_profile`: "<pre>", each layer of the stack,
     "<post>") and the exact contiguous split into p stages (`autopar.pipeline.stages.partition`) for the
     schedule and the memory budget;
  4. the Plan: every spec widened with "R" on the pp axis, one StagePlan per stage (its units, its
     global ranks, time per micro-batch, memory), the schedule's step time.

Collectives: `Plan.collectives` lists those of the micro-batch graph, each once. At run time a
gradient all-reduce runs once per step, after the schedule's last backward (the runtime defers it,
passes/defer_grad_reductions.py); every other collective runs in the stage programs, once per
micro-batch (activation resharding, ZeRO gradient reduce-scatters, the loss's), a tied parameter's
gradient collectives on each stage that holds it. A ZeRO-1/2 parameter gather runs once per step, in
the stage's gather program before the schedule (passes/split_stages.py), as it is priced; a ZeRO-3
gather runs in every micro-batch's forward and backward (what saves its memory), as it is priced too.

Composes with: mixed precision (the micro-batch graph captured under the policy, as SPMD plans
capture the batch; `Plan.mixed_precision`), activation recompute and memory rows (`_solve_stages`:
the SPMD solve re-run under memory rows, recompute only when no split fits without it; the chosen
layers' costs in the unit profile), any recipe on the sub-mesh (ZeRO, tensor + sequence parallel).

Defaults: schedule "1f1b"; num_microbatches = num_stages (the least that keeps every stage busy in
the steady state; more micro-batches shrink the bubble (p-1)/(m+p-1) but each is smaller).

Interleaved 1F1B (`schedule="interleaved_1f1b"`, `virtual_stages=v`, default
`stages.INTERLEAVE` = 2; `v` in autopar/pipeline/stages.py): the units are split into p*v chunks and
device d holds chunks d, d+p, ... (torch's "loop" placement). `Plan.stages` then lists one StagePlan per
chunk (its index is the chunk's, its ranks its device's, its memory the chunk's share of the device);
`chunks_per_device(plan)` reads v back. The schedule runs whole rounds of p micro-batches: m % p == 0.
Zero bubble V (`schedule="zero_bubble_v"`: torch's ScheduleZBVZeroBubble) splits the units into 2p chunks
placed in a V: device d holds chunks d and 2p - 1 - d (the first and the last on device 0, which runs the
loss), any micro-batch count.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from autopar.capture import precision
from autopar.costmodel.memory import parse_bytes
from autopar.debug import PhaseTimer
from autopar.errors import InfeasiblePlanError, InputError, MeshError
from autopar.mesh import Mesh
from autopar.pipeline.layer_profile import layer_costs, step_weighted
from autopar.pipeline.stages import (
    INTERLEAVE,
    INTERLEAVED,
    SCHEDULES,
    V_SHAPED,
    ZERO_BUBBLE,
    chunk_device,
    chunk_in_flight,
    chunk_memory,
    partition,
    step_weight,
)
from autopar.plan import NodeChoice, ParamPlacement, Plan, StagePlan
from autopar.planning import assemble, spmd
from autopar.planning import recompute as recompute_mod
from autopar.planning.problem import ProblemBuilder
from autopar.planning.solver import evaluate
from autopar.sharding import recipes

PP = "pp"
DEFAULT_SCHEDULE = "1f1b"


def pipeline_mesh(mesh: Mesh, num_stages: int | None) -> Mesh:
    """The mesh of a pipelined plan: "pp" first. A mesh with a "pp" axis is used as is."""
    if PP in mesh.axis_names:
        if mesh.axis_names[0] != PP:
            raise MeshError(f"the pipeline axis 'pp' must be the first axis of the mesh, got {mesh}")
        if num_stages not in (None, mesh.shape[0]):
            raise MeshError(f"num_stages={num_stages} but the mesh's pp axis has {mesh.shape[0]} devices")
        return mesh if mesh.ndim > 1 else Mesh((mesh.shape[0], 1), (PP, "dp"), mesh.hardware, mesh.devices_per_node)
    if not isinstance(num_stages, int) or num_stages < 2:
        raise InputError(f"num_stages must be an int >= 2 for a pipelined plan, got {num_stages!r}")
    if mesh.ndim != 1:
        raise MeshError(f"num_stages={num_stages} widens a 1-D mesh; {mesh} has {mesh.ndim} axes: "
                        "name one of them 'pp' (first) instead")
    if mesh.size % num_stages:
        raise MeshError(f"{mesh.size} devices do not split into {num_stages} pipeline stages")
    return Mesh((num_stages, mesh.size // num_stages), (PP, mesh.axis_names[0]), mesh.hardware,
                mesh.devices_per_node)


def sub_mesh(mesh: Mesh) -> Mesh:
    """The mesh of one stage: every axis but "pp" (the SPMD planner's mesh)."""
    return Mesh(mesh.shape[1:], mesh.axis_names[1:], mesh.hardware, mesh.devices_per_node)


def schedule_options(num_stages, num_microbatches, schedule, virtual_stages=None) -> tuple[int, str, int]:
    """(micro-batch count, schedule name, chunks per device) with the documented defaults; refuses
    unknown schedules and micro-batch counts the interleaved schedule cannot run."""
    schedule = DEFAULT_SCHEDULE if schedule is None else schedule
    if schedule not in SCHEDULES:
        raise InputError(f"schedule={schedule!r}: one of {SCHEDULES}")
    m = num_stages if num_microbatches is None else num_microbatches
    if not isinstance(m, int) or m < 1:
        raise InputError(f"num_microbatches must be a positive int, got {m!r}")
    if schedule in V_SHAPED:   # torch's ZB-V: two chunks per device, any micro-batch count
        if virtual_stages not in (None, 2):
            raise InputError(f"schedule='{schedule}' runs exactly two chunks per device (torch's "
                             f"ScheduleZBVZeroBubble); virtual_stages={virtual_stages!r}: drop it or pass 2")
        return m, schedule, 2
    if schedule not in INTERLEAVED:
        if virtual_stages not in (None, 1):
            raise InputError(f"virtual_stages={virtual_stages!r} applies to the interleaved schedules only: "
                             f"{INTERLEAVED}")
        rounds = max(1, m // num_stages)
        if schedule == ZERO_BUBBLE and m % rounds:
            raise InputError(f"schedule='{ZERO_BUBBLE}' runs rounds of equal size (torch's "
                             f"ScheduleInterleavedZeroBubble: {rounds} rounds for {m} micro-batches on {num_stages} "
                             f"stages) and num_microbatches={m} is not a multiple of {rounds}: pass a multiple of "
                             f"{num_stages}")
        return m, schedule, 1
    v = INTERLEAVE if virtual_stages is None else virtual_stages
    if not isinstance(v, int) or v < 1:
        raise InputError(f"virtual_stages (chunks per device) must be a positive int, got {v!r}")
    if m % num_stages:
        near = sorted({num_stages * max(1, m // num_stages), num_stages * (m // num_stages + 1)})
        raise InputError(f"schedule='{schedule}' runs whole rounds of {num_stages} micro-batches (one per "
                         f"stage); num_microbatches={m} is not a multiple of {num_stages}: pass num_microbatches="
                         + " or ".join(map(str, near)))
    return m, schedule, v


def chunks_per_device(plan: Plan) -> int:
    """v: how many chunks (virtual stages) each pipeline device holds (1 unless interleaved)."""
    return max(1, len(plan.stages) // plan.mesh.shape[0]) if plan.stages else 1


def microbatch(example_inputs: tuple, m: int) -> tuple:
    """The first of m equal micro-batches: every tensor split along dim 0 (a trailing dict too)."""
    def cut(x):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        if x.shape[0] % m:
            raise InputError(f"the batch dimension ({x.shape[0]}) of an input of shape {tuple(x.shape)} does not "
                             f"divide into {m} micro-batches; use a batch that is a multiple of {m}")
        return x.narrow(0, 0, x.shape[0] // m)
    return tuple({k: cut(v) for k, v in x.items()} if isinstance(x, dict) else cut(x) for x in example_inputs)


def plan_pipelined(model, example_inputs, *, mesh, num_stages=None, num_microbatches=None, schedule=None,
                   virtual_stages=None, example_kwargs=None, loss_fn=None, strategy="auto", memory_budget=None,
                   optimizer: str = "adamw", time_limit=None, baselines: bool = False, mixed_precision=None,
                   recompute=None) -> Plan:
    """`autopar.plan` for a forced pipeline: capture the micro-batch graph (under the precision
    policy, as `autopar.planning.spmd` captures the whole batch), then plan it."""
    from autopar.capture.canonicalize import canonicalize
    from autopar.capture.trace import capture
    mesh = pipeline_mesh(mesh if isinstance(mesh, Mesh) else Mesh(mesh), num_stages)
    m, schedule, v = schedule_options(mesh.shape[0], num_microbatches, schedule, virtual_stages)
    micro = microbatch(tuple(example_inputs), m)
    micro_kwargs = microbatch((example_kwargs,), m)[0] if example_kwargs else example_kwargs
    captured = capture(model, micro, example_kwargs=micro_kwargs, loss_fn=loss_fn,
                       mixed_precision=precision.as_policy(mixed_precision))
    canonicalize(captured.gm)
    return plan_pipelined_captured(captured, model, micro, mesh=mesh, num_microbatches=m, schedule=schedule,
                                   virtual_stages=v, strategy=strategy, memory_budget=memory_budget,
                                   optimizer=optimizer, time_limit=time_limit, baselines=baselines,
                                   recompute=recompute)


def plan_pipelined_captured(captured, model, micro_inputs, *, mesh: Mesh, num_microbatches: int, schedule: str,
                            strategy="auto", memory_budget=None, optimizer: str = "adamw", time_limit=None,
                            baselines: bool = False, timer=None, virtual_stages: int | None = None,
                            mixed_precision=None, recompute=None) -> Plan:
    """A pipelined Plan for the captured MICRO-BATCH graph on `mesh` (axis 0 "pp"). The search
    (autopar.pipeline.search) calls this once it has chosen p, m and the schedule; `virtual_stages`
    (interleaved only) defaults to stages.INTERLEAVE, as the search prices it. The precision policy is
    the capture's (`captured.mixed_precision`): `mixed_precision`, if given, must be the one it was
    captured with; `recompute` as in `autopar.plan` (`_solve_stages`)."""
    assert mesh.axis_names[0] == PP, mesh
    if mixed_precision is not None and precision.as_policy(mixed_precision) != captured.mixed_precision:
        raise InputError(f"mixed_precision={mixed_precision!r}, but the micro-batch graph was captured with "
                         f"{captured.mixed_precision or 'fp32 (no mixed precision)'}: capture it with the same policy")
    _, _, v = schedule_options(mesh.shape[0], num_microbatches, schedule, virtual_stages)
    sub = sub_mesh(mesh)
    budget = parse_bytes(memory_budget) if memory_budget is not None else None
    wanted = recipes.normalize(strategy, sub)
    spmd.check_batch_divides(wanted, sub, micro_inputs)
    time_limit = spmd.DEFAULT_TIME_LIMIT if time_limit is None else time_limit
    timer = timer if timer is not None else PhaseTimer()
    with timer("strategies+costs"):   # one stage's SPMD problem on the sub-mesh
        prob = ProblemBuilder(captured, sub, optimizer).build()
    with timer("baselines"):
        table, solutions = spmd.solve_baselines(prob, captured, sub, time_limit) if baselines else ({}, {})
    split_fn = _Splitter(mesh, num_microbatches, schedule, budget, v)
    with timer("solve"):              # per-op strategies and recompute, then the exact split into p*v chunks
        sol, reason, rc, layers, split = _solve_stages(prob, captured, sub, wanted, solutions, time_limit,
                                                       recompute, split_fn)
    one_stage = spmd.assemble_plan(prob, captured, sub, strategy, wanted, None, sol, reason, table, timer, model,
                                   micro_inputs)
    one_stage = assemble.with_recompute(one_stage, prob, sol.choice, rc)
    return widen(one_stage, mesh, layers, split, num_microbatches, schedule, budget, captured, v)


class _Splitter:
    """`stages.partition` of unit costs for one pipeline (p stages x v chunks, m micro-batches, a
    schedule, the budget), and the in-flight micro-batches of each chunk that its memory counts."""

    def __init__(self, mesh: Mesh, m: int, schedule: str, budget: float | None, v: int):
        self.p, self.m, self.schedule, self.budget, self.v = mesh.shape[0], m, schedule, budget, v
        self.p2p = lambda nbytes: mesh.p2p_time(nbytes, PP)  # noqa: E731
        self.overhead = mesh.hardware.runtime_overhead
        self.counts = [chunk_in_flight(schedule, self.p, m, k, v) for k in range(self.p * v)]

    def __call__(self, layers):
        return partition(layers, self.p, self.m, self.schedule, p2p_time=self.p2p, memory_budget=self.budget,
                         v=self.v, overhead=self.overhead)


ROW_RETRIES = 8   # memory rows tried before the pipeline is called infeasible


def _solve_stages(prob, captured, sub: Mesh, wanted, solutions, time_limit, recompute, split_fn: _Splitter):
    """(solution, infeasible reason, RecomputeDecision or None, unit costs, split).

    First the SPMD solve without a memory row (the stage split enforces the budget). Only if no split
    fits, the solve is repeated under memory rows on the micro-batch graph (`_row_search`), where the
    solver trades time for memory (sequence parallelism, ZeRO, other placements); and only if that
    finds no split either, with recompute None/"auto", strategies and activation recompute are solved
    together under such rows (`autopar.planning.recompute`; "none" never recomputes). The layers it
    recomputes show up in the unit costs (less activation memory, the re-run forward in backward),
    which the split then prices. recompute "all" / a list of layer paths: forced, no row.
    Every solve minimises the pipeline's step (`step_weighted` by `stages.step_weight`: a solution's
    `time` is that objective); `layer_costs` prices its choice unweighted. A baseline recipe warm-starts
    the auto solve, and the solution is never worse than the recipe, both under the weighted objective."""
    mode = recompute_mod.normalize(recompute, list(recompute_mod.layer_nodes(prob.gm)))
    fixed = None if all(r == "auto" for r in wanted) else spmd.restricted_choices(prob, captured, sub, wanted)
    view = step_weighted(prob, step_weight=step_weight(split_fn.p, split_fn.m))
    if mode not in ("auto", "none"):
        sol, rc = recompute_mod.solve_recompute(view, mode, fixed=fixed, time_limit=time_limit)
        layers = layer_costs(prob, sol.choice, captured, recompute=rc.paths)
        return sol, "", rc, layers, split_fn(layers)
    if view is not prob:   # the recipes' solutions under the objective solved here
        solutions = {name: (dataclasses.replace(s, time=evaluate(view.cg, s.choice)[0]), *rest)
                     for name, (s, *rest) in solutions.items()}
    sol, reason = spmd.solve_requested(view, captured, sub, wanted, solutions, time_limit)
    layers = layer_costs(prob, sol.choice, captured)
    try:
        return sol, reason, None, layers, split_fn(layers)
    except InfeasiblePlanError as e:
        if split_fn.budget is None:
            raise
        error = e
    tries = [False] + ([True] if mode == "auto" and recompute_mod.recomputable(prob.gm) else [])
    for recompute_too in tries:
        found = _row_search(prob, view, captured, fixed, time_limit, split_fn, recompute_too, error,
                            sum(x.state_bytes for x in layers))
        if not isinstance(found, InfeasiblePlanError):
            return found
        error = found if found.min_memory_per_device < error.min_memory_per_device else error
    raise error


def _row_search(prob, view, captured, fixed, time_limit, split_fn: _Splitter, recompute_too: bool,
                error: InfeasiblePlanError, state: float):
    """The first split within the budget of SPMD solutions under tightening memory rows, as
    `_solve_stages` returns it, or the split's InfeasiblePlanError with the least memory seen. Rows:
    R = (p B + (c - 1) S) / c at first (S the state bytes, c the mean in-flight micro-batches per
    stage, so that S + c A <= p B), then lowered by the fullest stage's excess over its in-flight
    count, doubled at every miss, down to the least memory any plan keeps."""
    budget, c = split_fn.budget, float(np.mean(split_fn.counts))
    row = (split_fn.p * budget + (c - 1) * state) / c
    step, floor = max(error.min_memory_per_device - budget, 0.01 * budget) / max(split_fn.counts), None
    for _ in range(ROW_RETRIES):
        try:
            sol, rc = _solve_row(view, fixed, time_limit, row, recompute_too)
        except InfeasiblePlanError as e:
            if floor is not None:
                break   # even the least memory a plan keeps does not split within the budget
            floor = row = e.min_memory_per_device   # no plan keeps less: try exactly that once
            continue
        layers = layer_costs(prob, sol.choice, captured, recompute=rc.paths if rc else ())
        try:
            split = split_fn(layers)
        except InfeasiblePlanError as e:
            error = e if e.min_memory_per_device < error.min_memory_per_device else error
        else:
            return _fewer_recomputed(prob, view, captured, sol, rc, layers, split, split_fn, time_limit)
        if floor is not None and row <= floor:
            break
        row, step = max(row - step, floor or 0.0), 2 * step   # the excess, doubled while it does not suffice
    return error


def _fewer_recomputed(prob, view, captured, sol, rc, layers, split, split_fn: _Splitter, time_limit):
    """The found plan with the recompute the split does not need dropped: the row counts activations
    as if every stage kept the same in-flight share, and recomputes the lowest layers first, so a stage
    with room may recompute layers it need not (GPipe keeps as many micro-batches on every stage). Drops
    one layer at a time, the highest first, while the split still fits and is no slower."""
    if rc is None:
        return sol, "", rc, layers, split
    ex, on = recompute_mod.expand(prob), list(rc.paths)
    for path in reversed(rc.paths):
        fewer = tuple(p for p in on if p != path)
        costs = layer_costs(prob, sol.choice, captured, recompute=fewer, expanded=ex)
        try:
            found = split_fn(costs)
        except InfeasiblePlanError:
            continue
        if found.step_time <= split.step_time:
            on, layers, split = list(fewer), costs, found
    if tuple(on) == rc.paths:
        return sol, "", rc, layers, split
    if not on:
        return sol, "", None, layers, split
    every = {i: [int(k)] for i, k in enumerate(sol.choice)}   # the same strategies, these layers
    sol, rc = recompute_mod.solve_recompute(view, tuple(on), fixed=every, time_limit=time_limit)
    return sol, "", rc, layers, split


def _solve_row(prob, fixed, time_limit, row: float, recompute_too: bool):
    """(solution, RecomputeDecision or None) of the micro-batch problem (`prob`: the weighted view
    `_solve_stages` solves) under the memory row `row`."""
    prob.cg.memory_budget = row
    try:
        if recompute_too:
            sol, rc = recompute_mod.solve_recompute(prob, "auto", fixed=fixed, time_limit=time_limit)
            return sol, rc if rc.paths else None
        return spmd.solve_problem(prob, fixed=fixed, time_limit=time_limit), None
    finally:
        prob.cg.memory_budget = None


def widen(one_stage: Plan, mesh: Mesh, layers, split, m: int, schedule: str, budget, captured,
          virtual_stages: int = 1) -> Plan:
    """The SPMD plan of one stage -> the pipelined plan: "R" on the pp axis everywhere, stages (one per
    chunk when interleaved: chunk k on device k % p, or in a V: `stages.chunk_device`), step time."""
    p, per_stage, chunks = mesh.shape[0], int(np.prod(mesh.shape[1:])), mesh.shape[0] * virtual_stages
    bounds = list(split.bounds) + [len(layers)]
    memory = (split.stage_memory if virtual_stages == 1 else
              chunk_memory(layers, bounds[:-1], schedule, p, m, virtual_stages))
    device = [chunk_device(schedule, p, k) for k in range(chunks)]
    stages = tuple(StagePlan(index=k, modules=tuple(l.name for l in layers[bounds[k]:bounds[k + 1]]),
                             ranks=tuple(range(device[k] * per_stage, (device[k] + 1) * per_stage)),
                             predicted_time=float(split.stage_times[k]), memory=float(memory[k]))
                   for k in range(chunks))
    R = ("R",)
    params = {n: ParamPlacement(v.name, v.shape, R + tuple(v.use), R + tuple(v.master), R + tuple(v.grad),
                                ("dp",) + tuple(v.modes), (False,) + tuple(v.read_sharded) if v.read_sharded else ())
              for n, v in one_stage.params.items()}
    nodes = {n: NodeChoice(tuple(None if o is None else R + tuple(o) for o in v.outs),
                           tuple(None if i is None else R + tuple(i) for i in v.ins), v.module, v.phase)
             for n, v in one_stage.nodes.items()}
    fullest = int(np.argmax(split.stage_memory))   # a device: its chunks (`stages.chunk_device`)
    share = sum(l.state_bytes for k in range(chunks) if device[k] == fullest
                for l in layers[bounds[k]:bounds[k + 1]]) / max(
        sum(l.state_bytes for l in layers), 1.0)
    state = {k: v * share for k, v in one_stage.memory_breakdown.items() if k != "activations"}
    breakdown = {**state, "activations": max(0.0, float(split.stage_memory[fullest]) - sum(state.values()))}
    # a device's mean busy time (its chunks' micro-batches and its per-step work: gradient sync, optimizer):
    # the step less the schedule's bubble and the runtime's per-step overhead (`stages.partition`)
    busy = (1.0 - split.bubble_fraction) * (float(split.step_time) - mesh.hardware.runtime_overhead)
    compute_share = one_stage.predicted_compute_time / max(
        one_stage.predicted_compute_time + one_stage.predicted_comm_time, 1e-30)
    reason = one_stage.infeasible_reason or ("" if budget is None or max(split.stage_memory) <= budget else
                                        "the fullest stage exceeds the memory budget")
    return dataclasses.replace(
        one_stage, mesh=mesh, recipes=(PP,) + tuple(one_stage.recipes), params=params, nodes=nodes, stages=stages,
        model={**one_stage.model, "flops": one_stage.model.get("flops", 0.0) * m},   # m micro-batches a step
        schedule=schedule, num_microbatches=m, predicted_step_time=float(split.step_time),
        predicted_compute_time=busy * compute_share, predicted_comm_time=busy * (1 - compute_share),
        memory_per_device=float(max(split.stage_memory)), memory_breakdown=breakdown, memory_budget=budget,
        feasible=not reason, infeasible_reason=reason, fingerprint=spmd.fingerprint(captured, mesh),
        solver={**one_stage.solver, "bubble_fraction": float(split.bubble_fraction)})


def stage_plan(plan: Plan) -> Plan:
    """The pipelined plan as the SPMD plan of one stage (the pp axis dropped): what the passes read."""
    params = {n: ParamPlacement(v.name, v.shape, v.use[1:], v.master[1:], v.grad[1:], v.modes[1:], v.read_sharded[1:])
              for n, v in plan.params.items()}
    nodes = {n: NodeChoice(tuple(None if o is None else tuple(o[1:]) for o in v.outs),
                           tuple(None if i is None else tuple(i[1:]) for i in v.ins), v.module, v.phase)
             for n, v in plan.nodes.items()}
    return dataclasses.replace(plan, mesh=sub_mesh(plan.mesh), recipes=plan.recipes[1:], params=params,
                               nodes=nodes, stages=(), schedule=None, num_microbatches=1)
