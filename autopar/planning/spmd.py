"""SPMD planning (no pipeline stages): captured graph -> Plan. One straight list of named steps.

`autopar.plan` (autopar/api.py) dispatches here, or to `autopar.pipeline` for pipelined plans, which
reuses these steps per stage: `solve_baselines`, `solve_requested`, `assemble_plan`.
"""
from __future__ import annotations

import hashlib
import warnings

import numpy as np

from autopar.capture import precision
from autopar.capture.canonicalize import canonicalize
from autopar.capture.trace import capture
from autopar.costmodel.memory import format_bytes, parse_bytes
from autopar.debug import PhaseTimer, log
from autopar.errors import InfeasiblePlanError, InputError, SolverTimeLimitWarning
from autopar.graph import VAL
from autopar.mesh import Mesh
from autopar.plan import Plan
from autopar.planning import assemble
from autopar.planning import recompute as recompute_mod
from autopar.planning.problem import ProblemBuilder, model_flops
from autopar.planning.solver import solve
from autopar.sharding import recipes

BASELINES = ("dp", "zero1", "zero2", "zero3", "tp")
DEFAULT_TIME_LIMIT = 60.0  # seconds per solve: with a memory row CP-SAT may otherwise run long


def plan_spmd(model, example_inputs, *, mesh, strategy="auto", memory_budget=None, optimizer: str = "adamw",
              loss_fn=None, time_limit=None, example_kwargs=None, baselines: bool = True, mixed_precision=None,
              recompute=None) -> Plan:
    """An SPMD plan (no pipeline stages): capture `model`'s training step, then `plan_captured`.
    The options are `autopar.plan`'s (autopar/api.py)."""
    policy = precision.as_policy(mixed_precision)
    timer = PhaseTimer()
    with timer("capture"):        # torch.export + joint trace on fake tensors
        captured = capture(model, example_inputs, example_kwargs=example_kwargs, loss_fn=loss_fn,
                           mixed_precision=policy)
    with timer("canonicalize"):   # addmm split, per-phase parameter views
        canonicalize(captured.gm)
    return plan_captured(captured, model, example_inputs, mesh=mesh, strategy=strategy, memory_budget=memory_budget,
                         optimizer=optimizer, time_limit=time_limit, baselines=baselines, timer=timer,
                         recompute=recompute)


class PlanCutoff(Exception):
    """`plan_captured(cutoff=c)` stopped before its memory-row solves: no plan of the mesh is faster than
    `bound` seconds (the proven bound of the time optimum without the row: a row and recompute only add
    time), and bound >= c. `state` (the CostProblem, its recipes' table and solutions) lets
    `plan_captured(resume=...)` go on where this stopped, without building or solving them again."""

    def __init__(self, bound: float, state: tuple = ()):
        super().__init__(f"no plan is faster than {bound:.4g} s")
        self.bound = bound
        self.state = state


def plan_captured(captured, model, example_inputs, **options) -> Plan:
    """The planning steps after capture (the runtime calls this with the graph it already has): the Plan
    of `solve_captured` (same options)."""
    return solve_captured(captured, model, example_inputs, **options).plan()


def solve_captured(captured, model, example_inputs, *, mesh, strategy="auto", memory_budget=None, optimizer="adamw",
                   time_limit=None, baselines: bool = True, timer=None, recompute=None,
                   cutoff: float | None = None, resume: PlanCutoff | None = None,
                   ceiling: float | None = None, graph_facts: dict | None = None) -> Solved:
    """The SPMD plan of a captured graph, solved (`Solved`: its Plan assembled on demand).
    `cutoff` (seconds; strategy "auto" under a budget): when the fastest plan without the memory row
    does not fit, and is not faster than `cutoff`, raise PlanCutoff instead of solving under the row
    (with recompute, the costly part: Llama-3-70B on 8 x 8 H100s, 60-100 s of HiGHS). The bound is
    over tiled layer plans, as the solver's plans are (`solver.solve`'s dedup_layers). `resume`: that
    PlanCutoff, to plan on from its CostProblem (the budget-free optimum in its solver cache) and recipes.
    `ceiling` (seconds; the layout search's best plan so far): a plan slower than it is of no use, so the
    recipes whose fastest plan without the memory row is slower do not warm-start the recompute solve
    (`_recipe_hints`). `graph_facts`: a store of what depends on the graph alone, shared by the builds of one
    capture on several meshes (`ProblemBuilder.share_graph_facts`)."""
    mesh = mesh if isinstance(mesh, Mesh) else Mesh(mesh)
    budget = parse_bytes(memory_budget) if memory_budget is not None else None
    wanted = recipes.normalize(strategy, mesh)
    check_batch_divides(wanted, mesh, example_inputs)
    time_limit = DEFAULT_TIME_LIMIT if time_limit is None else time_limit
    timer = timer if timer is not None else PhaseTimer()
    if resume is not None:
        prob, table, solutions = resume.state
    else:
        with timer("strategies+costs"):  # candidate placements per op, priced in seconds and bytes
            builder = ProblemBuilder(captured, mesh, optimizer)
            if graph_facts is not None:
                builder.share_graph_facts(graph_facts)
            prob = builder.build()
            prob.cg.memory_budget = budget
            log(2, f"cost graph: {len(prob.cg.nodes)} nodes, {len(prob.cg.edges)} edges, "
                   f"{sum(len(s) for s in prob.strategies)} strategies, {len(prob.cg.layer_groups)} layer classes")
        with timer("baselines"):      # the textbook recipes under the same cost model
            table, solutions = solve_baselines(prob, captured, mesh, time_limit) if baselines else ({}, {})
    with timer("solve"):          # the ILP over everything, warm-started from the best recipe
        if cutoff is not None and budget is not None and all(r == "auto" for r in wanted):
            free = budget_free(prob, time_limit)   # kept in prob.solver_cache: the solves below recall it
            if free.memory > budget and free.lower_bound >= cutoff:   # a bound, not the plan: a limit may stop it
                raise PlanCutoff(free.lower_bound, (prob, table, solutions))
        try:
            sol, reason, rc = _solve_with_recompute(prob, captured, mesh, wanted, solutions, time_limit, recompute,
                                                    ceiling)
        except InfeasiblePlanError as e:
            e.baselines = table   # what each recipe needs: the layout search lists them beside its plan
            raise
    return Solved(prob, captured, mesh, strategy, wanted, budget, sol, reason, table, timer, model, example_inputs, rc)


class Solved:
    """A solved SPMD plan before its Plan is assembled (`solve_captured`): the step, memory, gap, recompute
    and recipe table of the Plan that `plan()` assembles. The layout search solves several shapes of the
    same devices and keeps one; assembling a Plan (its collectives, per-node choices and candidates
    table: ~0.5 CPU s per mesh on Llama-3-8B's full graph) is paid for that one only."""

    def __init__(self, prob, captured, mesh, strategy, wanted, budget, sol, reason, table, timer, model, inputs, rc):
        self._args = (prob, captured, mesh, strategy, wanted, budget, sol, reason, table, timer, model, inputs)
        self._rc = rc
        tot = assemble.totals(prob, sol.choice)
        self.mesh, self.feasible, self.gap, self.baselines = mesh, not reason, sol.gap, table
        self.recompute = rc.paths if rc is not None else ()
        # as `assemble.with_recompute` adds them to the Plan
        self.predicted_step_time = tot["step"] + (rc.compute + rc.comm if rc is not None else 0.0)
        self.memory_per_device = sum(tot["memory"].values()) + (rc.activations if rc is not None else 0.0)

    def plan(self) -> Plan:
        prob, sol = self._args[0], self._args[6]
        return assemble.with_recompute(assemble_plan(*self._args), prob, sol.choice, self._rc)


DATA_PARALLEL = ("dp", "zero1", "zero2", "zero3")


def check_batch_divides(wanted: tuple[str, ...], mesh: Mesh, example_inputs) -> None:
    """A data-parallel recipe splits the batch (dim 0 of the first input) over its axes: it must divide."""
    ways = int(np.prod([n for r, n in zip(wanted, mesh.shape) if r in DATA_PARALLEL]))
    first = next((t for t in _tensors(example_inputs) if t.dim() > 0), None)
    if first is not None and ways > 1:
        batch = int(first.shape[0])
        if batch % ways:
            axes = [a for a, r in zip(mesh.axis_names, wanted) if r in DATA_PARALLEL]
            raise InputError(
                f"the batch ({batch}) does not divide over the {ways} data-parallel ranks of mesh axes {axes} "
                f"that strategy {'/'.join(wanted)} splits it across: use a global batch that is a multiple of "
                f"{ways}, or strategy='auto' (which may split something else)")


def _tensors(inputs) -> list:
    items = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
    out = []
    for x in items:
        out.extend(x.values() if isinstance(x, dict) else [x])
    return [x for x in out if hasattr(x, "shape") and hasattr(x, "dim")]


def restricted_choices(prob, captured, mesh, names, propagated=None) -> dict[int, list[int]] | None:
    """node index -> the strategies recipe `names` (one per mesh axis) allows, or None for auto.
    Kept on the CostProblem (the baselines and recompute's recipe hints both ask: a walk over every
    node, ~2 s for Llama-3-70B); the lists are shared, callers never change them."""
    key = (tuple(names), id(captured.gm), tuple(mesh.shape))
    if key not in prob.restrictions:
        prob.restrictions[key] = _restricted_choices(prob, captured, mesh, names, propagated)
    return prob.restrictions[key]


def _restricted_choices(prob, captured, mesh, names, propagated=None) -> dict[int, list[int]] | None:
    allowed = recipes.restriction(captured.gm, names, tuple(mesh.shape), propagated, prob.signatures)
    if allowed is None:
        return None
    fixed, indices = {}, {}  # indices: (id of list, id of its filtered list) -> kept positions
    for i, (node, strats) in enumerate(zip(prob.nodes, prob.strategies)):
        keep = allowed(node, strats)  # identical layers get the same list back (recipes memoize)
        if len(keep) < len(strats):
            key = (id(strats), id(keep))
            if key not in indices:
                ids = {id(s): k for k, s in enumerate(strats)}
                indices[key] = (sorted(ids[id(s)] for s in keep), strats, keep)  # lists held: ids stay unique
            fixed[i] = indices[key][0]
    return fixed


def solve_problem(prob, **kw):
    """The solver on a CostProblem's whole cost graph; identical layers are solved once and tiled. The
    solves of one plan share `prob.solver_cache` (the layer quotient is built once)."""
    return solve(prob.cg, dedup_layers=bool(prob.cg.layer_groups), cache=prob.solver_cache, **kw)


def solve_baselines(prob, captured, mesh, time_limit):
    """Solve each forced recipe: its time and memory, or why it is infeasible."""
    table, solutions, propagated = {}, {}, {}
    for name in BASELINES:
        names = (name,) * mesh.ndim
        fixed = restricted_choices(prob, captured, mesh, names, propagated)
        try:
            sol = solve_problem(prob, fixed=fixed, time_limit=time_limit)
        except InfeasiblePlanError as e:
            table[name] = {"feasible": False, "time": None, "memory": e.min_memory_per_device,
                           "reason": f"needs {format_bytes(e.min_memory_per_device)} per device"}
            continue
        solutions[name] = (sol, fixed)
        table[name] = {"feasible": True, "time": sol.time + mesh.hardware.runtime_overhead, "memory": sol.memory,
                       "reason": ""}   # a plan's step: the solver's seconds + the per-step overhead (assemble.totals)
    return table, solutions


def budget_free(prob, time_limit=None, fixed=None):
    """The fastest plan of `prob` without its memory row (the row put back after)."""
    budget, prob.cg.memory_budget = prob.cg.memory_budget, None
    try:
        return solve_problem(prob, fixed=fixed, time_limit=time_limit)
    finally:
        prob.cg.memory_budget = budget


def solve_requested(prob, captured, mesh, wanted, solutions, time_limit):
    if all(r == "auto" for r in wanted):
        best = min((s for s, _ in solutions.values()), key=lambda s: s.time, default=None)
        sol = solve_problem(prob, time_limit=time_limit, hint=best.choice if best is not None else None)
        if best is not None and best.time < sol.time:  # never worse than a recipe it contains
            sol = best
        return sol, ""
    if len(set(wanted)) == 1 and wanted[0] in solutions:  # already solved as a baseline
        return solutions[wanted[0]][0], ""
    fixed = restricted_choices(prob, captured, mesh, wanted)
    try:
        return solve_problem(prob, fixed=fixed, time_limit=time_limit), ""
    except InfeasiblePlanError as e:
        budget, sol = prob.cg.memory_budget, budget_free(prob, time_limit, fixed)
        reason = (f"strategy {'/'.join(wanted)} needs at least {format_bytes(e.min_memory_per_device)} per device; "
                  f"the budget is {format_bytes(budget)} (over by {format_bytes(e.min_memory_per_device - budget)})")
        return sol, reason


def _solve_with_recompute(prob, captured, mesh, wanted, solutions, time_limit, recompute, ceiling=None):
    """(solution, infeasible reason, RecomputeDecision or None). Activation recompute enters when
    asked for, or ("auto") only when no plan fits the budget without it."""
    mode = recompute_mod.normalize(recompute, list(recompute_mod.layer_nodes(prob.gm)))
    if mode in ("auto", "none"):
        try:
            sol, reason = solve_requested(prob, captured, mesh, wanted, solutions, time_limit)
        except InfeasiblePlanError:
            if mode == "none" or not recompute_mod.recomputable(prob.gm):
                raise
        else:
            if mode == "none" or not reason or not recompute_mod.recomputable(prob.gm):
                return sol, reason, None
    fixed = None if all(r == "auto" for r in wanted) else restricted_choices(prob, captured, mesh, wanted)
    try:
        sol, rc = recompute_mod.solve_recompute(prob, mode, fixed=fixed, time_limit=time_limit,
                                                recipes=_recipe_hints(prob, captured, mesh, fixed, mode, time_limit,
                                                                      ceiling))
    except InfeasiblePlanError:
        if fixed is None or mode != "auto":
            raise
        return (*solve_requested(prob, captured, mesh, wanted, solutions, time_limit), None)
    return sol, "", rc


def _recipe_hints(prob, captured, mesh, fixed, mode, time_limit=None, ceiling=None) -> list[dict[int, list[int]]]:
    """The textbook recipes' restrictions, for an unrestricted solve that decides recompute itself:
    their plans with recompute warm-start it and bound it (auto is never slower than a recipe that
    fits). On a 2-D mesh the unrestricted ILP may not improve on its least-memory fallback within
    the time limit while a recipe with recompute fits easily (a 16-layer Llama on (2, 8) at 80 GB).
    `ceiling`: a recipe whose fastest plan without the memory row (its proven bound) is slower is left
    out: its plans with recompute, only slower still, cannot be the plan the caller keeps (Llama-7B on 8
    H100s in bf16 under 40 GB: tensor parallelism over both axes of 4 x 2, ~70 CPU s of HiGHS for a
    3.97 s plan, where the layout search had found 673.5 ms)."""
    if fixed is not None or mode != "auto":
        return []
    propagated: dict = {}
    hints = (restricted_choices(prob, captured, mesh, (name,) * mesh.ndim, propagated) for name in BASELINES)
    overhead = mesh.hardware.runtime_overhead   # a plan's step: the solver's seconds + this (assemble.totals)
    return [h for h in hints if h is not None
            and (ceiling is None or budget_free(prob, time_limit, h).lower_bound + overhead <= ceiling)]


def fingerprint(captured, mesh) -> str:
    h = hashlib.sha256()
    for node in captured.gm.graph.nodes:
        v = node.meta.get(VAL)
        shape = tuple(v.shape) if hasattr(v, "shape") else None
        h.update(f"{node.op}|{node.target}|{shape}|{getattr(v, 'dtype', None)}|{node.meta.get('autopar_name', '')}\n"
                 .encode())
    h.update(mesh.fingerprint().encode())
    return h.hexdigest()


def assemble_plan(prob, captured, mesh, strategy, wanted, budget, sol, reason, baselines, timer, model, inputs) -> Plan:
    tot = assemble.totals(prob, sol.choice)
    if sol.status == "feasible":
        warnings.warn(f"autopar: the solver stopped at its time limit; the plan is within {sol.gap:.1%} of optimal",
                      SolverTimeLimitWarning, stacklevel=3)
    timer["total"] = sum(timer.values())
    return Plan(
        mesh=mesh, strategy=strategy, recipes=wanted, feasible=not reason,
        predicted_step_time=tot["step"], predicted_compute_time=tot["compute"], predicted_comm_time=tot["comm"],
        memory_per_device=sum(tot["memory"].values()), memory_breakdown=tot["memory"], memory_budget=budget,
        collectives=tuple(assemble.collectives(prob, sol.choice, captured)), gap=sol.gap,
        params=assemble.param_placements(prob, sol.choice), nodes=assemble.node_choices(prob, sol.choice),
        fingerprint=fingerprint(captured, mesh), infeasible_reason=reason, baselines=baselines,
        solver={"backend": sol.backend, "status": sol.status, "seconds": sol.solve_seconds,
                **{k: v for k, v in sol.stats.items() if isinstance(v, (int, float, str))}},
        timings=dict(timer), candidates=assemble.candidates(prob, sol.choice, budget),
        model={"name": type(model).__name__, "parameters": int(sum(np.prod(s) for s in captured.param_shapes.values())),
               "inputs": [list(t.shape) for t in inputs if hasattr(t, "shape")], "tied": captured.tied,
               "flops": model_flops(captured.gm)},
        mixed_precision=captured.mixed_precision.to_json() if captured.mixed_precision is not None else None,
    )
