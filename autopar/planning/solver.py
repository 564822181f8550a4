r"""Choose one strategy per node of a `CostGraph`: exact DP where it suffices, an ILP otherwise.

The model (after exact simplification, see `autopar.planning.simplify`), for nodes i with strategies s,
edges (u, v) with matrices R_uv, node times c_i, node memory m_i:

    minimise    Σ_i Σ_s c_i[s] x[i,s]  +  Σ_(u,v) Σ_(s,t) R_uv[s,t] e[u,v,s,t]      (seconds)
    subject to
      one_strategy[i]:         Σ_s x[i,s] = 1                                  for every node i
      edge_consistency[u,v,s]: Σ_t e[u,v,s,t] = x[u,s]                         for every edge, s
      edge_consistency[u,v,t]: Σ_s e[u,v,s,t] = x[v,t]                         for every edge, t
      forbidden_pairs:         e[u,v,s,t] absent when R_uv[s,t] = inf, x[i,s] absent when
                               c_i[s] = inf; a row of an edge with no finite entry
                               forbidden_pairs[u,v,s]: x[u,s] = 0
      memory_budget:           memory_offset + Σ_i Σ_s m_i[s] x[i,s] <= memory_budget
      x[i,s] ∈ {0,1},  e[u,v,s,t] ∈ [0,1]   (integral once x is: the edge rows form a transport
                                             polytope between two unit vectors)

CP-SAT needs integers: objective coefficients are rounded to multiples of q = max|coef| / 2^30
(each chosen term errs by at most q/2, so the objective by at most (#nodes + #edges) q / 2), memory
to whole bytes rounded up (never admits an over-budget plan). Every reported objective and memory
is recomputed exactly in floating point from the original graph by `evaluate`.

`solve` first drops forbidden and dominated strategies (`simplify.compact`, exact), then solves the
problem without the memory row exactly (variable elimination; HiGHS when the elimination tables are
too large, as on 2-D meshes, where nodes carry up to ~64 strategies, which the elimination order,
found from the graph's shape alone, tells before any work); if that plan fits, it is optimal.
Otherwise it proves feasibility with `min_memory` (or raises `InfeasiblePlanError`; when even the
per-node memory minima exceed the budget it goes there first), runs a Lagrangian bisection for a
feasible incumbent and a lower bound, then the ILP warm-started from the incumbent. A time limit
never leaves it without a plan: the incumbent, the hint or the minimum-memory plan is returned.

HiGHS first solves the LP relaxation (`autopar.planning.ilp.integral_relaxation`): an integral LP optimum is the ILP's
optimum, taken without branching (without a memory row it is integral on every transformer graph
measured: Llama-70B on 32 x 8, 347k variables, 22 s as a MIP, 6 s as an LP, same plan). Where it is
fractional without a memory row (Llama-3-70B's micro-batch graphs on dp x tp sub-meshes: a few dozen
nodes split between two strategies), the DP's best plan on the LP's support is taken when it lies
within `mip_gap` of the LP's value (`ilp._support_plan`); otherwise a dive (fractional nodes fixed
one at a time, the LP re-solved warm) looks for such a plan, and failing that the MIP (`ilp.highs_mip`:
HiGHS's branch and cut without its presolve) runs, stopping at the relative gap `mip_gap`, whose
proven bound is reported.

Determinism: the DP, HiGHS/SCIP/CBC (one thread) and CP-SAT solved to optimality repeat byte for
byte; under a time limit with deterministic=True CP-SAT runs `interleave_search` and stops on
`max_deterministic_time` = half the remaining limit (the wall clock is only a safety net), while
HiGHS stops on the clock: a solve its time limit stops may return another plan on another run (pass
backend="cpsat" where that matters; the planner broadcasts rank 0's plan, so ranks always agree).
Backend choice, measured by benchmarks/solver_backends.py: see BENCHMARK in `autopar.planning.ilp`.

Activation recompute (`autopar.planning.recompute`) adds a binary r_l per layer, linearized with the x[i,s]
of the layer's nodes; it is written as extra strategies (s, r) and a two-strategy node per layer,
so this model, the DP, the Lagrangian and layer tiling solve it unchanged (the formulation is in
that module's docstring).
"""
from __future__ import annotations

import math
import time as _time

import numpy as np

from autopar.costmodel.memory import format_bytes
from autopar.errors import InfeasiblePlanError, InputError, SolverError
from autopar.planning.costgraph import CostEdge, CostGraph, CostNode, Solution
from autopar.planning.dp_oracle import brute_force, lagrangian, problem_order, solve_unconstrained
from autopar.planning.ilp import BACKENDS, build_model, highs_mip, integral_relaxation, run_model
from autopar.planning.simplify import (
    SolverProblem,
    compact,
    compact_within,
    from_costgraph,
    quotient_layers,
    restore,
    simplify,
)

__all__ = ["solve", "min_memory", "evaluate", "restrict", "brute_force", "BACKENDS"]

# The ILP itself (variables, constraint families, backends) lives in `autopar.planning.ilp`.
# "auto"'s ILP: HiGHS (`ilp.highs_mip`), except with deterministic=False up to _HIGHS_ABOVE edge-pair
# variables, where CP-SAT's free portfolio wins (see BENCHMARK in autopar.planning.ilp). Deterministic
# CP-SAT lost to HiGHS through highspy at every size benchmarks/solver_backends.py measures (102 nodes
# under a memory row: 1.65 against 3.60 s, both optimal; 402 nodes at the 5 s limit: gap 5.8e-4
# against 3.5e-3), and on Llama-3-70B over a 64 x 8 H100 mesh (tiled: 143 nodes, 98,796 variables,
# memory row, 2 cores) HiGHS took 20 s through pywraplp to CP-SAT's 50 s, the same plan.
_MIP_BACKEND = "cpsat"
_HIGHS_ABOVE = 50_000


def _mip(p: SolverProblem, backend: str, deadline: float, hint: dict[int, int] | None,
         deterministic: bool, stats: dict, gap: float) -> tuple[dict[int, int] | None, str, float]:
    """Simplify exactly, solve the ILP of what is left, restore the eliminated nodes."""
    q = p.copy()
    records = simplify(q)
    stats.update(simplified_nodes=len(q.time), simplified_edges=len(q.edges))
    if not q.time:
        choice = restore(records, {})
        return choice, "optimal", p.evaluate(choice)[0]
    if backend in ("auto", "dp"):
        backend = _MIP_BACKEND if not deterministic and _pair_variables(q) <= _HIGHS_ABOVE else "highs"
    stats.update(mip_backend=backend)
    qhint = {i: hint[i] for i in q.time} if hint is not None else None
    if backend == "highs":   # the LP first; the MIP (from the same arrays) only where it must run
        relaxed = integral_relaxation(q, gap, deadline)
        if relaxed is not None:
            return restore(records, relaxed[0]), relaxed[1], relaxed[2]
        choice, status, bound = highs_mip(q, deadline - _time.monotonic(), qhint, gap, stats)
    else:
        m = build_model(q, backend)
        stats.update(ilp_variables=m.solver.NumVariables())
        choice, status, bound = run_model(m, q, backend, deadline - _time.monotonic(), qhint, deterministic, gap)
    return (restore(records, choice) if choice is not None else None), status, bound


class _Memo:
    """Budget-free results of `_search` kept in a caller's cache, in original strategy indices (the
    strategies `compact` keeps depend on the budget): recalled when every strategy is still kept."""

    def __init__(self, store: dict | None, keep: dict[int, np.ndarray]):
        self.store, self.keep = store, keep

    def get(self, name: str, compute) -> tuple[dict[int, int], float] | None:
        if self.store is not None and name in self.store:
            found = self.store[name]
            pos = {i: np.flatnonzero(k == found[0][i]) for i, k in self.keep.items()}
            if all(len(w) for w in pos.values()):
                return {i: int(w[0]) for i, w in pos.items()}, found[1]
        out = compute()
        if self.store is not None and out is not None:   # None (not proven in time) is tried again
            self.store[name] = ({i: int(self.keep[i][c]) for i, c in out[0].items()}, out[1])
        return out


def _time_optimum(p: SolverProblem, order: list[int] | None, deadline: float, stats: dict, gap: float
                  ) -> tuple[dict[int, int], float] | None:
    """min time without the memory row: the DP, or HiGHS when its tables are too large."""
    if order is not None:
        return solve_unconstrained(p, order=order)
    return _unconstrained_mip(p, deadline, stats, gap)


def _time_within(p: SolverProblem, within: dict[int, np.ndarray], deadline: float, stats: dict, gap: float
                 ) -> tuple[dict[int, int], float] | None:
    """`_time_optimum` of p solved on the strategies `within` only (the others forbidden, then the
    smaller problem compacted without its memory row): the same optimum when `within` holds one, on a
    problem that may be a fraction of p's size (recompute's r = 0 half: `solve`'s time_within)."""
    compacted = compact_within(p, within, None)
    if compacted is None:
        return None
    r, keep = compacted
    out = _time_optimum(r, problem_order(r), deadline, stats, gap)
    if out is None:
        return None
    return {i: int(keep[i][k]) for i, k in out[0].items()}, out[1]


def _pair_variables(p: SolverProblem) -> int:
    return int(sum(np.isfinite(r).sum() for r in p.edges.values()))


def _unconstrained_mip(p: SolverProblem, deadline: float, stats: dict, gap: float) -> tuple[dict[int, int], float] | None:
    """min time without the memory row by HiGHS (fastest without the row, see BENCHMARK): the
    exact relaxation `_search` starts from when the DP tables are too large; None if not proven."""
    q = p.copy()
    q.budget = None
    choice, status, bound = _mip(q, "highs", deadline, None, True, stats, gap)
    if choice is None or status != "optimal":
        return None
    return choice, min(bound, q.evaluate(choice)[0])


def _least_memory(p: SolverProblem, order: list[int] | None = None) -> tuple[dict[int, int], float]:
    """Exact minimum of memory_offset + Σ memory over assignments that avoid every inf.
    `order`: `problem_order(p)` if known (the problem solved here has p's shape).
    Each node on its least-memory allowed strategy attains `_memory_floor`, a lower bound: when that
    assignment crosses no forbidden pair it is the minimum, found without the DP or an ILP."""
    pick = {i: int(np.argmin(np.where(np.isfinite(t), p.memory[i], np.inf))) for i, t in p.time.items()}
    if all(np.isfinite(t[pick[i]]) for i, t in p.time.items()) and \
            all(np.isfinite(e[pick[u], pick[v]]) for (u, v), e in p.edges.items()):
        return pick, p.memory_offset + sum(float(m[pick[i]]) for i, m in p.memory.items())
    r = SolverProblem(p.names, {i: np.where(np.isfinite(t), p.memory[i], np.inf) for i, t in p.time.items()},
                {i: np.zeros_like(t) for i, t in p.time.items()},
                {k: np.where(np.isfinite(e), 0.0, np.inf) for k, e in p.edges.items()},
                p.adj, None, p.memory_offset, 0.0)
    out = solve_unconstrained(r, order=order if order is not None else problem_order(r))
    if out is None:
        choice, status, _ = _mip(r, "highs", math.inf, None, True, {}, 1e-9)
        out = (choice, r.evaluate(choice)[0]) if choice is not None else ({}, math.inf)
    return out


def _memory_floor(p: SolverProblem) -> float:
    """memory_offset + Σ_i min over i's allowed strategies: no plan uses less (edges ignored)."""
    return p.memory_offset + sum(float(m[np.isfinite(p.time[i])].min(initial=math.inf)) for i, m in p.memory.items())


def _raise_infeasible(p: SolverProblem, least: float) -> None:
    if not math.isfinite(least):
        raise InfeasiblePlanError("no plan exists: every assignment uses a forbidden strategy pair "
                                  "(constraint families forbidden_pairs / edge_consistency)",
                                  min_memory_per_device=math.inf, budget=p.budget)
    raise InfeasiblePlanError(
        f"no plan fits the memory budget of {format_bytes(p.budget)} per device: the smallest plan needs "
        f"{format_bytes(least)} (constraint family memory_budget); raise memory_budget, use more devices, "
        f"or shrink the batch",
        min_memory_per_device=least, budget=p.budget)


def _fits(p: SolverProblem, choice: dict[int, int] | None) -> bool:
    if choice is None:
        return False
    t, mem = p.evaluate(choice)
    return math.isfinite(t) and (p.budget is None or mem <= p.budget)


def _search(p: SolverProblem, backend: str, deadline: float, hint: dict[int, int] | None,
            deterministic: bool, stats: dict, gap: float, memo: _Memo | None = None,
            within: dict[int, np.ndarray] | None = None) -> tuple[dict[int, int], str, float, str]:
    """The solve strategy of the module docstring; returns (assignment, status, bound, backend).
    `memo` recalls the two budget-free relaxations (time optimum, least memory) from an earlier
    solve of the same graph and `fixed` under another budget. `within`: p's strategies (a mask per
    node) among which a time optimum without the memory row lies (`solve`'s time_within)."""
    memo = memo or _Memo(None, {})
    bound, candidates, out, exact = -math.inf, [hint] if _fits(p, hint) else [], None, "dp"
    order = problem_order(p)  # None: the DP's tables would be too large (found before any work)
    if backend in ("auto", "dp"):
        if order is None and backend == "dp":
            raise SolverError("backend 'dp': the elimination tables are too large for this graph")
        if p.budget is not None and _memory_floor(p) > p.budget:  # nothing fits: skip the time optimum
            least = memo.get("least", lambda: _least_memory(p, order))[1]
            if not math.isfinite(least) or least > p.budget:
                _raise_infeasible(p, least)
        out = memo.get("time", lambda: _time_optimum(p, order, deadline, stats, gap) if within is None
                       else _time_within(p, within, deadline, stats, gap))
        exact = "dp" if order is not None else "highs"
        if out is not None:
            if _fits(p, out[0]):
                return out[0], "optimal", out[1], exact
            if not math.isfinite(out[1]):
                _raise_infeasible(p, math.inf)
            bound = out[1]
    least_choice, least = memo.get("least", lambda: _least_memory(p, order))
    if not math.isfinite(least) or (p.budget is not None and least > p.budget):
        _raise_infeasible(p, least)
    candidates.append(least_choice)
    if backend in ("auto", "dp") and out is not None:
        lr = lagrangian(p, p.budget, out[0], deadline=deadline, tol=gap, order=order)
        if lr is not None and lr.choice is not None:
            candidates.append(lr.choice)
            bound = max(bound, lr.lower_bound)
        stats["lagrange_iterations"] = lr.iterations if lr is not None else 0
    best = min(candidates, key=lambda c: p.evaluate(c)[0])
    best_t = p.evaluate(best)[0]
    if best_t - bound <= gap * abs(best_t) or backend == "dp":
        return best, "optimal" if best_t - bound <= gap * abs(best_t) else "feasible", bound, "dp"
    choice, status, mip_bound = _mip(p, backend, deadline, best, deterministic, stats, gap)
    used = stats.get("mip_backend", backend)   # "auto" picks HiGHS or CP-SAT (_MIP_BACKEND)
    if status == "infeasible":
        raise SolverError(f"{used}: ILP infeasible although plan {best} fits (numerical trouble)")
    if _fits(p, choice) and p.evaluate(choice)[0] <= best_t:
        best, best_t = choice, p.evaluate(choice)[0]
    bound = max(bound, mip_bound)
    if (status == "optimal" and best is choice) or best_t - bound <= gap * abs(best_t):
        return best, "optimal", bound, used
    return best, "fallback" if choice is None and best is least_choice else "feasible", bound, used


def evaluate(cg: CostGraph, choice: np.ndarray) -> tuple[float, float]:
    """(time in seconds, memory in bytes per device) of an assignment of the original graph."""
    t = sum(float(nd.time[choice[i]]) for i, nd in enumerate(cg.nodes))
    t += sum(float(e.time[choice[e.src], choice[e.dst]]) for e in cg.edges)
    mem = cg.memory_offset + sum(float(nd.memory[choice[i]]) for i, nd in enumerate(cg.nodes))
    return t, mem


def min_memory(cg: CostGraph) -> float:
    """The smallest memory_offset + Σ memory over assignments with no forbidden (inf) pair."""
    return _least_memory(from_costgraph(cg))[1]


def restrict(cg: CostGraph, allowed: dict[int, list[int]]) -> tuple[CostGraph, list[np.ndarray]]:
    """Keep only `allowed` strategies of some nodes; maps[i][k] = original index of new strategy k."""
    maps = [np.array(sorted(allowed[i])) if i in allowed else np.arange(nd.num_strategies)
            for i, nd in enumerate(cg.nodes)]
    nodes = [CostNode(nd.name, np.asarray(nd.time)[maps[i]], np.asarray(nd.memory)[maps[i]])
             for i, nd in enumerate(cg.nodes)]
    edges = [CostEdge(e.src, e.dst, np.asarray(e.time)[np.ix_(maps[e.src], maps[e.dst])]) for e in cg.edges]
    return CostGraph(nodes, edges, cg.memory_budget, cg.memory_offset, cg.layer_groups), maps


def solve(cg: CostGraph, *, time_limit: float | None = None, backend: str = "auto",
          hint: np.ndarray | None = None, deterministic: bool = True,
          fixed: dict[int, list[int]] | None = None, dedup_layers: bool = False,
          mip_gap: float = 1e-4, cache: dict | None = None,
          time_within: dict[int, list[int]] | None = None) -> Solution:
    """Pick one strategy per node minimising total seconds under the memory budget.

    `fixed` maps a node to the strategy indices it may use; `dedup_layers` solves one layer per
    class of `cg.layer_groups` and tiles it (see `quotient_layers`; the bound is then over tiled
    plans). "optimal" means proven within the relative `mip_gap` (time - bound <= mip_gap * time, the
    plan's time: HiGHS's definition); `lower_bound` holds the proven bound. Raises InfeasiblePlanError
    (with the minimum memory) when no plan fits.
    `cache`: a dict kept by a caller that solves the same `cg` several times (other `fixed`, hint or
    memory budget, but the same nodes, edges and layers): work that depends on those only is reused
    (the layer quotient; the time optimum without the memory row and the least memory, per `fixed`).
    `time_within` maps nodes to strategy indices among which the caller knows an optimum *without the
    memory row* lies (recompute: every layer's r = 0 half, `autopar.planning.recompute`): that
    relaxation is solved on those strategies only. Everything else sees every strategy, so the result
    is the same; a wrong `time_within` gives a wrong bound, never an over-budget plan.
    """
    if backend not in BACKENDS:
        raise InputError(f"unknown solver backend {backend!r}; choose one of {sorted(BACKENDS)}")
    start = _time.monotonic()
    deadline = start + time_limit if time_limit is not None else math.inf
    if dedup_layers and cg.layer_groups:
        return _solve_tiled(cg, time_limit=time_limit, backend=backend, hint=hint,
                            deterministic=deterministic, fixed=fixed, mip_gap=mip_gap, cache=cache,
                            time_within=time_within)
    if hint is not None and len(hint) != len(cg.nodes):
        raise InputError(f"hint has {len(hint)} entries for {len(cg.nodes)} nodes")
    full = from_costgraph(cg, fixed)
    compacted = compact(full)
    if compacted is None:
        _raise_infeasible(full, math.inf)
    p, keep = compacted
    stats = {"nodes": len(cg.nodes), "edges": len(cg.edges), "strategies": sum(len(t) for t in full.time.values()),
             "kept_strategies": sum(len(k) for k in keep.values())}
    store = None if cache is None else cache.setdefault(("relaxations", _fixed_key(fixed), cg.memory_offset), {})
    memo = _Memo(store, keep)
    within = None if time_within is None else {i: np.isin(keep[i], time_within[i]) for i in time_within}
    choice_d, status, bound, used = _search(p, backend, deadline, _compact_hint(hint, keep), deterministic, stats,
                                            mip_gap, memo, within)
    choice = np.array([keep[i][choice_d[i]] for i in range(len(cg.nodes))], dtype=np.int64)
    if hint is not None and status != "optimal" and _fits(full, dict(enumerate(hint))) \
            and full.evaluate(dict(enumerate(hint)))[0] < full.evaluate(dict(enumerate(choice)))[0]:
        choice = np.asarray(hint, dtype=np.int64)   # a pruned-away hint still serves as the fallback
    t, mem = evaluate(cg, choice)
    bound = min(bound, t)
    return Solution(choice, t, mem, bound, status, used, _time.monotonic() - start, stats)


def _fixed_key(fixed: dict[int, list[int]] | None) -> tuple:
    return tuple(sorted((i, tuple(int(s) for s in a)) for i, a in (fixed or {}).items()))


def _compact_hint(hint: np.ndarray | None, keep: dict[int, np.ndarray]) -> dict[int, int] | None:
    """The hint in compacted indices, or None when dominance pruned one of its strategies."""
    if hint is None:
        return None
    pos = {i: np.flatnonzero(k == int(hint[i])) for i, k in keep.items()}
    return {i: int(w[0]) for i, w in pos.items()} if all(len(w) for w in pos.values()) else None


def _quotient(cg: CostGraph, cache: dict | None) -> tuple[CostGraph, np.ndarray, np.ndarray]:
    """`quotient_layers(cg)` (computed once per cache), with cg's current budget and offset; and
    the first member of each quotient node."""
    if cache is None or "quotient" not in cache:
        q, rep = quotient_layers(cg)
        found = (q, rep, np.unique(rep, return_index=True)[1])
        if cache is None:
            return found
        cache["quotient"] = found
    q, rep, first = cache["quotient"]
    return CostGraph(q.nodes, q.edges, cg.memory_budget, cg.memory_offset), rep, first


def _node_memory_floor(cg: CostGraph, fixed: dict[int, list[int]] | None) -> float:
    """memory_offset + Σ_i min memory over i's allowed finite-time strategies (`_memory_floor` of the
    full graph without building its SolverProblem): no plan, tiled or not, needs less."""
    total = cg.memory_offset
    fixed = fixed or {}
    least: dict[tuple[int, int, int], float] = {}   # identical layers share their arrays (and lists)
    for i, nd in enumerate(cg.nodes):
        allowed = fixed.get(i)
        key = (id(nd.memory), id(nd.time), id(allowed))
        if key not in least:
            mem, ok = np.asarray(nd.memory, float), np.isfinite(np.asarray(nd.time, float))
            if allowed is not None:
                mask = np.zeros(len(mem), dtype=bool)
                mask[list(allowed)] = True
                ok = ok & mask
            least[key] = float(mem[ok].min(initial=math.inf))
        total += least[key]
    return total


def _quotient_fixed(fixed: dict[int, list[int]] | None, rep: np.ndarray) -> dict[int, list[int]]:
    """The strategies each quotient node may use: those every member of it may use."""
    qfixed: dict[int, list[int]] = {}
    seen: dict[tuple[int, int], None] = {}  # (quotient node, id of list): intersected already
    for i, allowed in (fixed or {}).items():
        r = int(rep[i])
        if (r, id(allowed)) in seen:  # identical layers often share one list: intersecting again is a no-op
            continue
        seen[r, id(allowed)] = None
        prev = set(qfixed.get(r, allowed))
        qfixed[r] = sorted(prev & set(allowed))
    return qfixed


def _solve_tiled(cg: CostGraph, *, hint: np.ndarray | None, fixed: dict[int, list[int]] | None,
                 cache: dict | None = None, time_within: dict[int, list[int]] | None = None, **kw) -> Solution:
    """Solve the layer quotient, tile its plan; fall back to the full graph if no tiled plan fits,
    unless the least tiled memory already equals the full graph's per-node floor (then no plan fits:
    this skips a full-graph solve per infeasible memory row of the pipeline search)."""
    start = _time.monotonic()
    q, rep, first = _quotient(cg, cache)
    qfixed = _quotient_fixed(fixed, rep)
    inner = None if cache is None else cache.setdefault("quotient_solves", {})   # the quotient's relaxations
    try:
        qwithin = None if time_within is None else _quotient_fixed(time_within, rep)
        sq = solve(q, hint=None if hint is None else np.asarray(hint)[first], fixed=qfixed, cache=inner,
                   time_within=qwithin, **kw)
    except InfeasiblePlanError as e:
        least = e.min_memory_per_device
        if least is not None and math.isfinite(least) and least <= _node_memory_floor(cg, fixed) * (1 + 1e-12):
            raise   # no plan of the full graph needs less than its node floor: untiled plans fit no better
        return solve(cg, hint=hint, fixed=fixed, cache=cache, time_within=time_within, **kw)
    choice = sq.choice[rep]
    t, mem = evaluate(cg, choice)
    stats = {**sq.stats, "tiled": True, "nodes": len(cg.nodes), "quotient_nodes": len(q.nodes)}
    bound = min(sq.lower_bound, t)
    return Solution(choice, t, mem, bound, sq.status, sq.backend, _time.monotonic() - start, stats)
