"""Search pipeline x data x tensor parallel meshes (3D parallelism) for the fastest plan that fits.

For N devices the search enumerates every (pp, dp, tp) with pp*dp*tp = N and tp inside one node
(`stages.mesh_factorizations`; the mesh is laid out (pp, dp, tp), tp innermost, so only pp or dp
cross the slow inter-node link), every micro-batch count m dividing the batch (by default
m in {pp, 2pp, 4pp}; m = 1 or gradient accumulation for pp = 1) with dp dividing the
micro-batch, and every schedule. Each candidate is priced in three steps:
  1. the micro-batch graph (inputs split along dim 0) is planned by the SPMD solver on the (dp, tp)
     sub-mesh: no baselines, identical layers solved once; a stack of L alike layers is priced on its
     three-layer graph with the middle layer counted L - 2 times (`autopar.pipeline.depth`: the full
     graph's prices), the chosen plan mapped onto the full graph (`Profiler.full_solution`);
  2. `layer_profile.layer_costs` turns that plan into per-unit seconds and bytes;
  3. `stages.partition` splits the units into pp stages exactly for the schedule, under the budget.
Steps 1-2 depend on (micro-batch size, dp, tp) only, not on pp or the schedule: they are cached and
reused across every pp value, which is exact. If no split fits, the SPMD plan is re-solved with a
memory row of pp * budget, then half of that, before the candidate is called infeasible
(`autopar.pipeline.candidates`, which also holds the branch and bound).
Before any capture, a model whose parameters, gradients and optimizer state exceed the budget even
sharded over all N devices is refused (InfeasiblePlanError with that floor).
Branch and bound (`candidates.branch_and_bound`, on by default) keeps the search exact while
skipping SPMD solves: a candidate is priced only if a lower bound of its step time is within the k-th
fastest found so far (k = `exact_top`). `prune=False` prices every candidate (tests compare the two).
A forced `strategy` per sub-mesh axis turns the same machinery into the hand-written recipes
(DP, ZeRO, Megatron TP, PP x DP, FSDP x TP x PP) that benchmarks/plan_quality.py compares against.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from autopar import _torch_compat as compat
from autopar.capture import precision
from autopar.capture.canonicalize import canonicalize
from autopar.capture.trace import capture
from autopar.costmodel.memory import format_bytes, optimizer_state_bytes_per_param, parse_bytes
from autopar.errors import InfeasiblePlanError, InputError
from autopar.mesh import Mesh
from autopar.pipeline import depth
from autopar.pipeline import planning as pipelined
from autopar.pipeline.candidates import Candidate, branch_and_bound, price
from autopar.pipeline.layer_profile import layer_costs, step_weighted, unit_names
from autopar.pipeline.stages import INTERLEAVE, SCHEDULES, LayerCost, mesh_factorizations, step_lower_bound
from autopar.planning import collector, spmd
from autopar.planning import recompute as recompute_mod
from autopar.planning.forest_bound import forest_lower_bound, spanning_forest
from autopar.planning.problem import ProblemBuilder
from autopar.planning.reshard import ReshardCost
from autopar.planning.solver import evaluate
from autopar.sharding import recipes

DEFAULT_SCHEDULES = SCHEDULES   # every schedule the runtime runs
PROBLEMS_KEPT = 2         # SPMD Problems a Profiler keeps for re-solving under other memory rows
# Relative gap at which the search's SPMD solves stop (the plan the search returns is solved again at
# the planner's own gap). With a memory row, a 2-D sub-mesh's ILP (Llama-70B, dp32 x tp8, ~170k
# variables) has a root LP 0.2-0.3% under its optimum; HiGHS spends 40-150 s CPU closing that last
# fraction (cuts, sub-MIPs, restarts) and ~10 s stopping within 0.5%. Every candidate's step time is
# still the exact price of the plan found; only the choice among near-equal plans may differ.
SEARCH_GAP = 5e-3


@dataclass(frozen=True)
class SearchResult:
    """The best candidate, every candidate priced (fastest feasible first) and the best's inputs."""
    best: Candidate
    candidates: tuple[Candidate, ...]
    mesh: Mesh                            # ("pp", then sub_mesh's axes): (pp, dp, tp) without size-1 dp/tp
    sub_mesh: Mesh                        # the SPMD mesh of the micro-batch graph
    layers: tuple[LayerCost, ...]         # the best candidate's unit profile
    captured: object = field(default=None, repr=False)   # the best's micro-batch graph (Captured)
    microbatch_inputs: tuple = field(default=(), repr=False)

    def runners_up(self, k: int = 5) -> list[dict]:
        return [c.as_dict() for c in self.candidates[1:k + 1]]

    def baseline_table(self, k: int = 5) -> dict[str, dict]:
        """The best k candidates in Plan.baselines' format: label -> {"feasible", "time", "memory", "reason"}."""
        return {f"pp{c.pp} dp{c.dp} tp{c.tp} m{c.num_microbatches} {c.schedule}":
                {"feasible": c.feasible, "time": c.step_time, "memory": c.memory_per_device, "reason": c.reason}
                for c in self.candidates[:k]}


def split_inputs(example_inputs, m: int, batch: int | None = None):
    """The first of m micro-batches: every tensor whose dim 0 is the batch (that of the first tensor
    unless given), sliced along dim 0."""
    batch = batch_size(example_inputs) if batch is None else batch
    if batch % m:
        raise InputError(f"{m} micro-batches do not divide the batch of {batch}")

    def cut(x):
        if isinstance(x, dict):
            return {k: cut(v) for k, v in x.items()}
        if isinstance(x, (tuple, list)):
            return type(x)(cut(v) for v in x)
        if hasattr(x, "shape") and getattr(x, "dim", lambda: 0)() > 0 and x.shape[0] == batch:
            return x[: batch // m]
        return x
    return cut(tuple(example_inputs))


def batch_size(example_inputs) -> int:
    for x in example_inputs:
        items = x.values() if isinstance(x, dict) else [x]
        for t in items:
            if hasattr(t, "shape") and t.dim() > 0:
                return int(t.shape[0])
    raise InputError("no tensor input with a batch dimension to split into micro-batches")


def microbatch_counts(batch: int, pp: int, dp: int, requested=None) -> list[int]:
    """Micro-batch counts to try: those requested, else {pp, 2pp, 4pp} (pp = 1: 1, 2, 4); each must
    divide the batch with dp dividing the micro-batch."""
    wanted = [requested] if isinstance(requested, int) else requested or [pp, 2 * pp, 4 * pp]
    return sorted({m for m in wanted if m >= 1 and batch % m == 0 and (batch // m) % dp == 0})


class Profiler:
    """Captures (per micro-batch size) and unit profiles (per size, dp, tp, memory row), cached.
    With `shallow` (the default) a model whose layers form one stack of alike layers is priced on its
    three-layer graph, the middle layer counted for all the others (`autopar.pipeline.depth`: the same
    prices as the full graph's, at a fraction of the cost); the plan the search returns is built on the
    full graph (`full_solution`)."""

    def __init__(self, model, example_inputs, hardware, devices_per_node: int, optimizer: str = "adamw",
                 loss_fn=None, time_limit: float | None = None, mixed_precision=None, example_kwargs=None,
                 shallow: bool = True):
        self.model, self.inputs, self.loss_fn = model, example_inputs, loss_fn
        self.policy, self.kwargs = precision.as_policy(mixed_precision), example_kwargs or {}
        self.hardware, self.dpn, self.optimizer, self.time_limit = hardware, devices_per_node, optimizer, time_limit
        self.captures: dict[int, tuple] = {}
        self.shallow = shallow
        self.shallow_captures: dict[int, object] = {}       # m -> the three-layer Captured, or None (full graph)
        self.depth_notes: dict[int, str] = {}               # m -> why its shallow graph is not priced ("" if it is)
        self.profiles: dict[tuple, tuple[LayerCost, ...] | InfeasiblePlanError] = {}
        self.problems: dict[tuple, object] = {}            # insertion-ordered: the oldest is dropped first
        self.floors: dict[int, tuple[float, float, int]] = {}   # (per micro-batch, per step, units)
        self.forests: dict = {}                             # the spanning forest of the last CostProblem bounded
        self.reshards: dict[tuple, ReshardCost] = {}        # layout pricing per sub-mesh, shared by every build
        self.spec_matrices: dict[tuple, dict] = {}          # ProblemBuilder's spec-pair matrices per sub-mesh, shared
        self.graph_facts: dict[int, dict] = {}              # ProblemBuilder's graph-only facts per capture (id), shared
        self.weighted_views: dict[tuple, tuple] = {}        # (CostProblem key, weights) -> (CostProblem, its `weighted` view)
        self.solutions: dict[tuple, object] = {}            # layers()'s key -> the solver's Solution (plans build from it)
        self.seeded: dict[tuple, tuple] = {}                # layers()'s key -> a budget-free profile solved elsewhere (`seed`)
        self.helper = None                                  # a weakref to a BoundWorker solving profiles ahead (`layers`)
        self.recomputes: dict[tuple, tuple] = {}            # layers()'s key -> `recomputed`'s answer
        self.expanded: tuple = (None, None)                 # (CostProblem, recompute.expand of it): the last one

    def captured(self, m: int):
        """(the full micro-batch graph of batch / m, canonicalized; its inputs)."""
        if m not in self.captures:
            self.captures[m] = self._capture(m, shallow=False)
        return self.captures[m]

    def _capture(self, m: int, shallow: bool):
        inputs, kwargs = split_inputs(self.inputs, m, batch_size(self.inputs)), {}
        if self.kwargs:
            kwargs = split_inputs((self.kwargs,), m, batch_size(self.inputs))[0]
        # the graph is costed, not run: no code generation per rewrite; tracing leaves cyclic garbage
        with compat.lazy_recompile(), collector.running():
            cap = capture(self.model, inputs, example_kwargs=kwargs or None, loss_fn=self.loss_fn,
                          stamp_layers=True, mixed_precision=self.policy, shallow=shallow)
            canonicalize(cap.gm)
        return cap, inputs

    def shallow_captured(self, m: int):
        """The three-layer graph of batch / m (`capture(shallow=True)`), or None where the model has no
        single stack of alike layers (or `shallow` is off)."""
        if m not in self.shallow_captures:
            cap = self._capture(m, shallow=True)[0] if self.shallow else None
            self.shallow_captures[m] = cap if cap is not None and cap.shallow else None
            if self.shallow_captures[m] is None:
                self.depth_notes[m] = "no single stack of alike layers" if self.shallow else "off"
        return self.shallow_captures[m]

    def sub_mesh(self, dp: int, tp: int) -> Mesh:
        axes = [(n, s) for n, s in (("dp", dp), ("tp", tp)) if s > 1] or [("dp", 1)]
        return Mesh(tuple(s for _, s in axes), tuple(n for n, _ in axes), self.hardware, self.dpn)

    def problem(self, m: int, dp: int, tp: int, strategy=None, full: bool = False):
        """The SPMD CostProblem the search prices for the micro-batch graph (batch / m) on the (dp, tp)
        sub-mesh, `strategy` forced: the shallow graph's (`depth.weighted`) where it stands for the full
        graph, else the full graph's; `full=True`: always the full graph's. Built once and kept while its
        memory rows are solved (the last PROBLEMS_KEPT)."""
        key = (m, *self._inner(dp, tp, strategy), full)
        if key not in self.problems:
            cap = None if full or self.depth_notes.get(m) else self.shallow_captured(m)
            prob = self._build(cap, dp, tp, strategy) if cap is not None else None
            if prob is not None:
                stack, count = depth.stack_of(cap)
                if m not in self.depth_notes:   # once per micro-batch size: line it up with the full graph
                    self.depth_notes[m] = depth.matches(prob, self.full_units(), stack, count)
                prob = None if self.depth_notes[m] else depth.weighted(prob, stack, count)
            if prob is None:
                prob = self._build(self.captured(m)[0], dp, tp, strategy)
            self.problems[key] = prob
            while len(self.problems) > PROBLEMS_KEPT:
                self.problems.pop(next(iter(self.problems)))
        return self.problems[key]

    def _build(self, cap, dp: int, tp: int, strategy):
        mesh = self.sub_mesh(dp, tp)
        allowed = None
        if strategy:
            wanted = recipes.normalize({a: r for a, r in strategy.items() if a in mesh.axis_names}, mesh)
            allowed = recipes.restriction(cap.gm, wanted, tuple(mesh.shape))
        return self._builder(cap, mesh).build(allowed)

    def full_units(self) -> dict[str, tuple]:
        """`depth.unit_signatures` of the full graph (the whole batch's: unit structure does not depend on it)."""
        self.one_device_seconds(1)
        return self.floors["units"]

    def _builder(self, cap, mesh: Mesh) -> ProblemBuilder:
        """A ProblemBuilder whose layout pricing (`reshard.ReshardCost`, a pure function of the mesh and
        hardware) is shared with every earlier build on the same mesh: other micro-batch sizes and
        forced recipes price the same (spec, spec, bytes) copies again."""
        builder = ProblemBuilder(cap, mesh, self.optimizer)
        key = (tuple(mesh.shape), mesh.axis_names)
        builder.reshard = self.reshards.setdefault(key, builder.reshard)
        # and so are its priced (specs, specs, bytes) matrices: a weight's edges move the same bytes at every m
        builder.share_matrices(self.spec_matrices.setdefault(key, {}))
        # and so is what depends on the capture's graph alone, which the search never changes
        builder.share_graph_facts(self.graph_facts.setdefault(id(cap), {}))
        return builder

    @staticmethod
    def _inner(dp: int, tp: int, strategy) -> tuple:
        inner = dp * tp if min(dp, tp) == 1 and strategy is None else (dp, tp)
        return inner, repr(sorted(strategy.items())) if strategy else None

    def _profile_key(self, m: int, dp: int, tp: int, budget: float | None, strategy, act_weight: float,
                     step_weight: float = 1.0) -> tuple:
        """The cache key of `layers`, `solution` and `recomputed`: without a memory row activations weigh 1."""
        return (m, *self._inner(dp, tp, strategy), budget, act_weight if budget is not None else 1.0, step_weight)

    def layers(self, m: int, dp: int, tp: int, budget: float | None, strategy=None,
               act_weight: float = 1.0, step_weight: float = 1.0) -> tuple[LayerCost, ...]:
        """The unit profile of the micro-batch graph (batch / m) planned on the (dp, tp) sub-mesh with
        `strategy` (None: auto; else {"dp": recipe, "tp": recipe} as in autopar.plan). Raises
        InfeasiblePlanError when the SPMD plan cannot fit the memory row `budget`, in which
        activations count `act_weight` times (micro-batches in flight, `candidates.price`). The solver
        minimises (per micro-batch seconds) + `step_weight` * (per step seconds), the pipeline's step
        formula over its factor on the first (`step_weight(pp, m)`); the profile prices the plan unweighted.
        A budget-free profile the `helper` (`autopar.pipeline.bound_worker`) has solved or is solving is taken from it."""
        key = self._profile_key(m, dp, tp, budget, strategy, act_weight, step_weight)
        helper = self.helper() if self.helper is not None else None
        if (budget is None and helper is not None and strategy == helper.strategy
                and key not in self.profiles and key not in self.seeded):
            helper.profile(m, dp, tp, step_weight)   # seeds it where the worker has it
        return self._profile(key, m, dp, tp, budget, strategy, step_weight)

    def _profile(self, key: tuple, m: int, dp: int, tp: int, budget: float | None, strategy, step_weight: float):
        """`layers` without its helper: the seeded profile, else the cached or solved one."""
        act_weight = key[-2]
        if key not in self.profiles and key in self.seeded:
            return self.seeded[key]
        if key not in self.profiles:
            prob = self.problem(m, dp, tp, strategy)
            view = self.weighted(m, dp, tp, strategy, act_weight, step_weight)
            view.cg.memory_budget = budget
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    sol = spmd.solve_problem(view, time_limit=self.time_limit, mip_gap=SEARCH_GAP)
                self.profiles[key] = tuple(unit_costs(prob, sol.choice))
                self.solutions[key] = sol
            except InfeasiblePlanError as e:
                self.profiles[key] = e
        found = self.profiles[key]
        if isinstance(found, InfeasiblePlanError):
            raise found
        return found

    def solution(self, m: int, dp: int, tp: int, budget: float | None, strategy=None, act_weight: float = 1.0,
                 step_weight: float = 1.0):
        """The solver's Solution behind `layers(...)` with the same arguments (solved there if not yet):
        a plan built from it is the plan the search priced (its `time` is the weighted objective); solved here where
        the profile was seeded (`seed`)."""
        key = self._profile_key(m, dp, tp, budget, strategy, act_weight, step_weight)
        self.seeded.pop(key, None)
        self._profile(key, m, dp, tp, budget, strategy, step_weight)
        return self.solutions[key]

    def seed(self, m: int, dp: int, tp: int, strategy, step_weight: float, layers: tuple[LayerCost, ...]) -> None:
        """`layers(m, dp, tp, None, strategy, step_weight=step_weight)`, solved by another process from the same
        capture and build (`autopar.pipeline.bound_worker`: a deterministic function of the model and these
        arguments): `layers` answers with it without a capture, build or solve; `solution` still solves."""
        key = self._profile_key(m, dp, tp, None, strategy, 1.0, step_weight)
        if key not in self.profiles:
            self.seeded[key] = tuple(layers)

    def recomputed(self, m: int, dp: int, tp: int, budget: float | None, strategy=None, act_weight: float = 1.0,
                   step_weight: float = 1.0):
        """The plan of `layers(...)` (same arguments) with every layer that can recompute
        (`recompute.recomputable`: all but the last of each stack) re-running its forward in backward,
        strategies unchanged (Megatron's full recompute of a plan the search solved): (unit profile,
        its Solution with the re-run seconds, the RecomputeDecision), cached. A plan built from the last
        two is the plan the profile prices (`auto.pipelined_plan`)."""
        key = self._profile_key(m, dp, tp, budget, strategy, act_weight, step_weight)
        if key not in self.recomputes:
            sol = self.solution(m, dp, tp, budget, strategy, act_weight, step_weight)
            prob = self.problem(m, dp, tp, strategy)
            if self.expanded[0] is not prob:
                self.expanded = (prob, recompute_mod.expand(prob))
            ex = self.expanded[1]
            with_rc, rc = recompute_mod.with_layers(ex, prob, sol, recompute_mod.recomputable(prob.gm))
            self.recomputes[key] = (tuple(unit_costs(prob, sol.choice, rc.paths, ex)), with_rc, rc)
        return self.recomputes[key]

    def full_solution(self, m: int, dp: int, tp: int, budget: float | None, strategy=None, act_weight: float = 1.0,
                      step_weight: float = 1.0, recompute: tuple[str, ...] = ()):
        """The plan of `layers(...)` on the full graph, the layers `recompute` names re-running their forward in
        backward (`candidates.fewest_recomputed`: those of `recomputed(...)` the stages need; all of them is
        Megatron's full recompute): (its CostProblem, unit profile, Solution, RecomputeDecision or None).
        Where the search priced the shallow graph, its choice is mapped onto the full graph
        (`depth.full_choice`, the same prices), or the full graph is solved the same way if the two do not
        line up."""
        args = (m, dp, tp, budget, strategy, act_weight, step_weight)
        target, sol = self.problem(m, dp, tp, strategy), self.solution(*args)
        if depth.depth_of(target) is not None:   # the shallow graph's plan, on the full graph
            shallow, target = target, self.problem(m, dp, tp, strategy, full=True)
            view = self.weighted(m, dp, tp, strategy, act_weight, step_weight, full=True)
            view.cg.memory_budget = budget
            choice = depth.full_choice(shallow, target, sol.choice)
            if choice is None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    sol = spmd.solve_problem(view, time_limit=self.time_limit, mip_gap=SEARCH_GAP)
            else:
                t, mem = evaluate(view.cg, choice)
                stats = {**sol.stats, "nodes": len(view.cg.nodes), "edges": len(view.cg.edges),
                         "shallow_nodes": sol.stats.get("nodes"), "shallow_layers": depth.TRACED}
                sol = dataclasses.replace(sol, choice=choice, time=t, memory=mem,
                                          lower_bound=min(sol.lower_bound, t), stats=stats)
        if not recompute:
            return target, tuple(layer_costs(target, sol.choice)), sol, None
        if self.expanded[0] is not target:
            self.expanded = (target, recompute_mod.expand(target))
        ex = self.expanded[1]
        sol, rc = recompute_mod.with_layers(ex, target, sol, recompute)
        return target, tuple(layer_costs(target, sol.choice, recompute=rc.paths, expanded=ex)), sol, rc

    def partly_recomputed(self, m: int, dp: int, tp: int, budget: float | None, strategy=None,
                          act_weight: float = 1.0, step_weight: float = 1.0,
                          names: tuple[str, ...] = ()) -> tuple[LayerCost, ...]:
        """The unit profile of `layers(...)` with the units `names` as `recomputed(...)` prices them (the
        profile `candidates.fewest_recomputed` split)."""
        args = (m, dp, tp, budget, strategy, act_weight, step_weight)
        if not names:
            return tuple(self.layers(*args))
        keep = set(names)
        return tuple(r if r.name in keep else p for p, r in zip(self.layers(*args), self.recomputed(*args)[0]))

    def weighted(self, m: int, dp: int, tp: int, strategy=None, act_weight: float = 1.0, step_weight: float = 1.0,
                 full: bool = False):
        """`layer_profile.step_weighted` of the (m, dp, tp) CostProblem: the view the solver minimises when
        activations count `act_weight` times and per-step seconds `step_weight` times; the CostProblem itself
        for weights 1. Kept while the CostProblem is (a view per weight: its solver cache holds the layer
        quotient and the least-memory relaxation, which depend on the weighted vectors)."""
        prob = self.problem(m, dp, tp, strategy, full)
        if act_weight == 1.0 and step_weight == 1.0:
            return prob
        key = ((m, *self._inner(dp, tp, strategy), full), act_weight, step_weight)
        found = self.weighted_views.get(key)
        if found is None or found[0] is not prob:
            self.weighted_views = {k: v for k, v in self.weighted_views.items()
                                   if any(v[0] is p for p in self.problems.values())}
            found = self.weighted_views[key] = (prob, step_weighted(prob, act_weight, step_weight))
        return found[1]

    def forest_bound(self, m: int, dp: int, tp: int, strategy, pp: int, schedule: str) -> float:
        """`stages.step_lower_bound`'s objective f * (per micro-batch) + (per step) / pp, bounded from below
        by the spanning-forest relaxation of the (m, dp, tp) CostProblem (`autopar.planning.forest_bound`): op nodes
        and data edges weigh f, parameters and gradient edges 1 / pp (`layer_costs` files a gradient's
        all-reduce per step, its ZeRO reduce-scatter per micro-batch: 1 / pp <= f bounds both)."""
        prob = self.problem(m, dp, tp, strategy)
        key = (m, *self._inner(dp, tp, strategy))
        if self.forests.get("key") != key:
            self.forests = {"key": key, "forest": spanning_forest(prob.cg)}
        f, once = (step_lower_bound(*unit, pp, m, schedule, INTERLEAVE) for unit in ((1.0, 0.0), (0.0, 1.0)))
        return forest_lower_bound(prob.cg, *_step_weights(prob, f, once), self.forests["forest"])

    def lp_bound(self, m: int, dp: int, tp: int, strategy, ratio: float) -> float:
        """min over tiled plans of the (m, dp, tp) CostProblem of (per micro-batch seconds) + ratio *
        (per step seconds), bounded from below: the proven bound of its budget-free solve (`solution`, no memory
        row: its root LP, the relaxation of the layer quotient after exact eliminations, is integral as a rule,
        and then it is that plan's objective), shaved by 1e-7 for the LP's tolerances. For a candidate with step
        factor f (`stages.step_lower_bound`) and pp stages, f * lp_bound(ratio) bounds its tiled plans' step
        whenever ratio <= 1 / (f * pp); with ratio = `stages.step_weight(pp, m)`, which holds for every
        schedule, the solve is the very one `candidates.price` starts from, so a group that is priced pays
        its LP once (before, a separate LP bound at each group's own ratio, then this solve: on bf16
        Llama-3-70B x 64 H100s, 51 solves and 19 LPs, 17.8 CPU s, became 60 solves, 15.2 s). inf where no
        plan exists."""
        try:
            bound = self.solution(m, dp, tp, None, strategy, 1.0, ratio).lower_bound
        except InfeasiblePlanError:
            return float("inf")
        return bound - 1e-7 * abs(bound)

    def one_device_seconds(self, m: int) -> tuple[float, float]:
        """(per micro-batch, per step) seconds on one device bounding every layout of m micro-batches
        (`seconds_bound` on one device)."""
        return self.seconds_bound(m, 1)

    def seconds_bound(self, m: int, k: int) -> tuple[float, float]:
        """(per micro-batch, per step) seconds that no plan of m micro-batches on k devices per stage
        beats, summed over the stages: each op costs at least max(t / (m k), c) for t its seconds on one
        device with the whole batch and c its per-launch part (`hw.op_overhead`; `param_step_overhead` for a
        parameter's step: every rank pays it whatever the sharding): its roofline term max(F / (eta P), M / W, E / T) grows at most linearly
        with the batch and falls at most k-fold on k devices. Per step, each parameter's optimizer
        update likewise costs at least max(t / k, c). One capture, the whole batch's, serves every m."""
        if 1 not in self.floors:
            cap, _ = self.captured(1)
            # node costs only: on one device no edge reshards, and the loss needs no all-reduce
            prob = self._builder(cap, Mesh((1,), ("dp",), self.hardware, self.dpn)).build_nodes()
            seconds = np.array([float(np.min(c + lc)) for c, lc in zip(prob.compute, prob.local_comm)])
            param = np.array([n.op == "placeholder" for n in prob.nodes], dtype=bool)
            hw = prob.mesh.hardware   # a parameter's step pays param_step_overhead, an op op_overhead
            launch = np.minimum(seconds, np.where(param, hw.param_step_overhead, hw.op_overhead))
            # what full recompute re-runs (`recomputed`: `recompute.copied_nodes` of every recomputable layer)
            layers, rerun, layer_of = recompute_mod.layer_nodes(cap.gm), set(), {}
            for j, path in enumerate(recompute_mod.recomputable(cap.gm)):
                copied = recompute_mod.copied_nodes(layers[path])
                rerun.update(copied)
                layer_of.update({n: j for n in [*layers[path], *copied]})
            acts = np.array([float(np.min(mem["activations"])) for mem in prob.memory])
            self.floors[1] = (seconds, launch, param, len(set(unit_names(prob)[1])),
                              np.array([n in rerun for n in prob.nodes], dtype=bool), float(acts.sum()), acts,
                              np.array([layer_of.get(n, -1) for n in prob.nodes], dtype=np.int64))
            self.floors["units"] = depth.unit_signatures(prob)
        seconds, launch, param = self.floors[1][:3]
        per = np.maximum(seconds / (m * k), launch)
        once = np.maximum(seconds / k, launch)
        return float(per[~param].sum()), float(once[param].sum())

    def rerun_seconds_bound(self, m: int, k: int, freed: float | None = None) -> float:
        """Per micro-batch seconds that re-run forward ops cost at least, m micro-batches on k devices per
        stage, each re-run op max(t / (m k), c) (`seconds_bound`). Where recompute must free `freed` bytes
        of one micro-batch's saved activations (summed over the stages, as `activation_floor` counts them):
        a plan keeps at least the floor share of every op of the layers it does not recompute, so the
        layers it recomputes must cover `freed` in floor shares; the least re-run seconds of such a set of
        layers, relaxed to a fractional knapsack (each layer: its ops' floor shares against its re-run
        ops' seconds), bounds every plan's. `freed=None`: full recompute (`recomputed`), every re-run op."""
        self.one_device_seconds(1)
        seconds, launch, rerun, acts, layer = (self.floors[1][i] for i in (0, 1, 4, 6, 7))
        cost = np.where(rerun, np.maximum(seconds / (m * k), launch), 0.0)
        if freed is None:
            return float(cost[rerun].sum())
        if freed <= 0.0:
            return 0.0
        mine = layer >= 0
        c = np.bincount(layer[mine], weights=cost[mine])          # per recomputable layer
        b = np.bincount(layer[mine], weights=acts[mine] / (m * k))
        if b.sum() < freed:   # not even full recompute frees that much: no plan fits
            return float(cost[rerun].sum())
        order = np.argsort(np.where(b > 0, c / np.maximum(b, 1e-300), np.inf), kind="stable")
        c, b = c[order], b[order]
        before = np.r_[0.0, np.cumsum(b)[:-1]]
        take = np.clip((freed - before) / np.maximum(b, 1e-300), 0.0, 1.0)   # cheapest per byte first
        return float((take * c).sum())

    def activation_floor(self, m: int, k: int) -> float:
        """Bytes per device that one micro-batch's saved activations (of m, on k devices per stage) take
        at least, summed over the stages: the whole batch's on one device over m k (a saved value grows
        at most linearly with the batch and is split at most k ways)."""
        self.one_device_seconds(1)
        return self.floors[1][5] / (m * k)

    def num_units(self, m: int = 1) -> int:
        """How many units (`layer_costs`) the model's graph has: the same for every micro-batch
        size and sub-mesh (the units are the model's modules)."""
        self.one_device_seconds(1)
        return self.floors[1][3]


def unit_costs(prob, choice, recompute: tuple[str, ...] = (), expanded=None) -> list[LayerCost]:
    """`layer_costs` of a plan of `prob`, the full stack's units where `prob` is a shallow graph's
    (`depth.unfold`)."""
    layers = layer_costs(prob, choice, recompute=recompute, expanded=expanded)
    found = depth.depth_of(prob)
    return layers if found is None else depth.unfold(layers, *found)


def _step_weights(prob, per_microbatch: float, per_step: float) -> tuple[list[float], list[float]]:
    """Node and edge weights of `prob` pricing the step formula's terms: parameters and gradient edges
    (paid once per step, `layer_costs`) weigh `per_step`, every other node and edge `per_microbatch`."""
    return ([per_step if n.op == "placeholder" else per_microbatch for n in prob.nodes],
            [per_step if e.kind == "grad" else per_microbatch for e in prob.edges])


def search(model, example_inputs, *, mesh: Mesh, memory_budget=None, schedules=DEFAULT_SCHEDULES,
           num_microbatches=None, num_stages=None, optimizer: str = "adamw", loss_fn=None,
           time_limit: float | None = None, meshes=None, strategy=None, profiler: Profiler | None = None,
           accumulate: bool = True, prune: bool = True, exact_top: int = 1) -> SearchResult:
    """The fastest (pp, dp, tp, micro-batches, schedule) for `mesh.size` devices of `mesh.hardware`
    under `memory_budget` bytes per device (int or "80GB"). `num_microbatches` / `num_stages` (an
    int or a list) and `meshes` (a list of (pp, dp, tp)) restrict the search; `strategy` forces the
    SPMD recipe per sub-mesh axis ({"dp": "zero3", "tp": "tp"}: hand-written 3D recipes); a
    `profiler` from an earlier search of the same model and hardware reuses its captures and plans.
    `accumulate=False` leaves out gradient accumulation (one stage, several micro-batches).
    `prune` (branch and bound, see `candidates.branch_and_bound`) skips candidates that provably
    cannot be among the `exact_top` fastest; `prune=False` prices every one (the result's best is the same).
    Raises InfeasiblePlanError with the least memory any candidate needs when none fits."""
    for s in schedules:
        if s not in SCHEDULES:
            raise InputError(f"unknown pipeline schedule {s!r}; valid: {SCHEDULES}")
    budget = parse_bytes(memory_budget) if memory_budget is not None else None
    _check_state_fits(model, mesh.size, budget, optimizer)
    prof = profiler or Profiler(model, example_inputs, mesh.hardware, mesh.devices_per_node, optimizer, loss_fn,
                                time_limit)
    batch = batch_size(example_inputs)
    jobs = candidate_jobs(prof, mesh, batch, schedules, num_microbatches, num_stages, meshes, strategy, accumulate)
    found = branch_and_bound(prof, jobs, budget, strategy, exact_top) if prune else \
        [c for job in jobs for c in price(prof, *job, budget, strategy)]
    if not found:
        raise InputError(f"no (pp, dp, tp, micro-batch) candidate for {mesh.size} devices and batch {batch}: "
                         "the batch must divide into micro-batches that the data-parallel axis can split")
    rank = {(pp, dp, tp, m, s): i for i, (pp, dp, tp, m, names) in enumerate(jobs) for s in names}
    found.sort(key=lambda c: (not c.feasible, c.step_time if c.feasible else c.memory_per_device,
                              rank[c.pp, c.dp, c.tp, c.num_microbatches, c.schedule]))
    best = found[0]
    if not best.feasible:
        need = min(c.memory_per_device for c in found)
        raise InfeasiblePlanError(
            f"no pipeline x data x tensor parallel plan of {mesh.size} devices fits {format_bytes(budget)} per "
            f"device; the least any needs is {format_bytes(need)}", min_memory_per_device=need, budget=budget)
    cap, inputs = prof.captured(best.num_microbatches)
    sub = prof.sub_mesh(best.dp, best.tp)
    full = Mesh((best.pp, *sub.shape), ("pp", *sub.axis_names), mesh.hardware, mesh.devices_per_node)
    args = (best.num_microbatches, best.dp, best.tp, best.inner_budget, strategy, best.inner_weight,
            best.inner_step_weight)
    layers = prof.partly_recomputed(*args, names=best.recompute)
    return SearchResult(best, tuple(found), full, sub, layers, cap, inputs)


def candidate_jobs(prof: Profiler, mesh: Mesh, batch: int, schedules, num_microbatches=None, num_stages=None,
                   meshes=None, strategy=None, accumulate: bool = True, keep_dominated: bool = True) -> list[tuple]:
    """(pp, dp, tp, m, schedules) to price for `mesh.size` devices, in enumeration order (`search`'s
    restrictions); no more stages than the model has units. `keep_dominated=False` leaves out GPipe where
    1F1B of the same (pp, dp, tp, m) is priced too (`dominated_by_1f1b`)."""
    stages_wanted = [num_stages] if isinstance(num_stages, int) else num_stages
    jobs = []
    seen = set()
    for pp, dp, tp in mesh_factorizations(mesh.size, mesh.devices_per_node):
        # a 1-D sub-mesh is the same whichever name it carries (auto splits what it likes): price it once
        inner = (pp, dp * tp) if min(dp, tp) == 1 and strategy is None else (pp, dp, tp)
        if (stages_wanted and pp not in stages_wanted) or (meshes and (pp, dp, tp) not in meshes) or inner in seen:
            continue
        seen.add(inner)
        for m in microbatch_counts(batch, pp, dp, num_microbatches):
            if pp == 1 and m > 1 and not accumulate:
                continue
            names = schedules if pp > 1 else ("1f1b",)   # one stage: every schedule is accumulation
            if not keep_dominated and dominated_by_1f1b(pp, m, names):
                names = tuple(s for s in names if s != "gpipe")
            jobs.append((pp, dp, tp, m, tuple(names)))
    if jobs:   # a stage holds whole units: `price` finds no split into more stages than units
        units = prof.num_units()
        jobs = [job for job in jobs if job[0] <= units]
    return jobs


def dominated_by_1f1b(pp: int, m: int, schedules) -> bool:
    """GPipe of (pp, dp, tp, m) can beat no 1F1B plan of the same candidate: both step as sum t + (m - 1) max t
    (`stages.schedule_step_time`) and a GPipe stage keeps m micro-batches in flight, a 1F1B stage min(m, pp -
    stage) (`stages.in_flight`), so every GPipe plan (SPMD profile and split) is a 1F1B plan as fast in no
    more memory. Where both are searched and 1F1B runs (torch's Schedule1F1B needs m >= pp), pricing GPipe
    adds only solves: on Llama-3.1-405B x 2,048 (bf16, 80 GB) its memory rows took 86 of the search's 300
    CPU s (one 52 s) and none fitted."""
    return pp > 1 and m >= pp and "gpipe" in schedules and "1f1b" in schedules


def state_floor(model, world: int, optimizer: str = "adamw") -> float:
    """Bytes per device of parameters + gradients + optimizer state sharded evenly over every device:
    no plan of `world` devices needs less (activations come on top)."""
    opt = optimizer_state_bytes_per_param(optimizer, torch.float32)
    total = 0.0
    for p in model.parameters():  # tied parameters are listed once
        total += p.numel() * (p.element_size() + ((p.element_size() + opt) if p.requires_grad else 0.0))
    return total / world


def _check_state_fits(model, world: int, budget: float | None, optimizer: str) -> None:
    """Fail fast (before any capture) when even fully sharded state exceeds the budget."""
    floor = state_floor(model, world, optimizer)
    if budget is not None and floor > budget:
        raise InfeasiblePlanError(
            f"the model's parameters, gradients and {optimizer} state need {format_bytes(floor)} per device even "
            f"sharded over all {world} devices; the budget is {format_bytes(budget)}: use more devices",
            min_memory_per_device=floor, budget=budget)


def to_plan(result: SearchResult, model, *, memory_budget=None, optimizer: str = "adamw", time_limit=None):
    """The Plan of the search's best candidate: the SPMD plan when it has one stage and one
    micro-batch, else `pipelined.plan_pipelined_captured` on the (pp, ...) mesh."""
    best = result.best
    if best.pp == 1 and best.num_microbatches == 1:
        return spmd.plan_captured(result.captured, model, result.microbatch_inputs, mesh=result.sub_mesh,
                                  memory_budget=memory_budget, optimizer=optimizer, time_limit=time_limit,
                                  baselines=False)
    if best.schedule not in pipelined.SCHEDULES:
        raise InputError(f"schedule {best.schedule!r} has no runtime yet (runtime schedules: "
                         f"{pipelined.SCHEDULES}); search with schedules={pipelined.SCHEDULES}")
    return pipelined.plan_pipelined_captured(
        result.captured, model, result.microbatch_inputs, mesh=result.mesh, num_microbatches=best.num_microbatches,
        schedule=best.schedule, memory_budget=memory_budget, optimizer=optimizer, time_limit=time_limit)
