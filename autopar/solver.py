r"""Choose one strategy per node of a `CostGraph`: exact DP where it suffices, an ILP otherwise.

The model (after exact simplification, see `autopar.simplify`), for nodes i with strategies s,
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
too large, as on 2-D meshes, where nodes carry up to ~64 strategies); if that plan fits, it is optimal. Otherwise it proves feasibility with `min_memory` (or raises
`InfeasiblePlanError`), runs a Lagrangian bisection for a feasible incumbent and a lower bound, then
the ILP warm-started from the incumbent. A time limit never leaves it without a plan: the
incumbent, the hint or the minimum-memory plan is returned.

Determinism: the DP, HiGHS/SCIP/CBC (one thread) and CP-SAT solved to optimality repeat byte for
byte; under a time limit with deterministic=True CP-SAT runs `interleave_search` and stops on
`max_deterministic_time` = half the remaining limit (the wall clock is only a safety net).
Backend choice, measured by benchmarks/solver_backends.py: see BENCHMARK below.
"""
from __future__ import annotations

import math
import time as _time
from dataclasses import dataclass, field

import numpy as np
from ortools.linear_solver import pywraplp

from .costgraph import CostEdge, CostGraph, CostNode, Solution
from .dp_oracle import brute_force, lagrangian, solve_unconstrained
from .errors import InfeasiblePlanError, InputError, SolverError
from .simplify import Problem, compact, from_costgraph, quotient_layers, restore, simplify

__all__ = ["solve", "min_memory", "evaluate", "restrict", "brute_force", "BACKENDS"]

# BENCHMARK (benchmarks/solver_backends.py, 5 s limit, 2 shared cores; 25 ops/layer, 4-16 strategies):
# - no memory row: variable elimination ("dp") is exact and fastest: 0.01 / 0.03 / 0.21 s at
#   102 / 402 / 1,202 nodes, vs 0.02 / 0.07 / 0.42 s for the best ILP (HiGHS, CP-SAT): 2-3x.
# - memory row, 102 nodes: CP-SAT tuned + Lagrangian hint 0.58 s optimal (non-deterministic
#   portfolio), HiGHS 1.4 s, SCIP 2.7 s, CBC 4.2 s, CP-SAT default 2.5 s at 23% gap. At 402 nodes
#   none proves optimality in 5 s: auto 0.2-0.35% gap, CBC 0.4%, SCIP/CP-SAT alone 18-100%, and
#   pywraplp's HiGHS returns no incumbent at a time limit (ortools 9.15), and SetHint crashes it.
# Winner for "auto": DP, then Lagrangian bisection, then CP-SAT tuned warm-started from the
# Lagrangian incumbent. Deterministic mode uses interleave_search + a deterministic time limit
# (slower: 5 s vs 0.6 s at 102 nodes); with deterministic=False the free portfolio runs.
BACKENDS = {"highs": "HIGHS", "scip": "SCIP", "cbc": "CBC", "cpsat": "CP_SAT",
            "cpsat_default": "CP_SAT", "dp": None, "auto": "CP_SAT"}
_CPSAT_PARAMS = {
    "cpsat": "num_workers: 2 extra_subsolvers: 'max_lp' cp_model_probing_level: 0 random_seed: 0",
    "cpsat_default": "num_workers: 2 random_seed: 0",
}
_MIP_BACKEND = "cpsat"     # the ILP used by "auto" (see BENCHMARK)


@dataclass
class _Model:
    solver: pywraplp.Solver
    integer: bool
    x: dict[int, dict[int, object]] = field(default_factory=dict)
    e: dict[tuple[int, int], dict[tuple[int, int], object]] = field(default_factory=dict)
    scale: float = 1.0


def _coef(m: _Model, value: float) -> float:
    return float(round(value * m.scale)) if m.integer else float(value)


def make_variables(m: _Model, p: Problem) -> None:
    """x[i,s] for every allowed strategy; e[u,v,s,t] for every finite pair of allowed strategies."""
    var = m.solver.BoolVar if m.integer else (lambda name: m.solver.NumVar(0.0, 1.0, name))
    for i, c in p.time.items():
        m.x[i] = {int(s): m.solver.BoolVar(f"x[{i},{s}]") for s in np.flatnonzero(np.isfinite(c))}
    for (u, v), r in p.edges.items():
        pairs = np.argwhere(np.isfinite(r))
        m.e[u, v] = {(int(s), int(t)): var(f"e[{u},{v},{s},{t}]") for s, t in pairs
                     if s in m.x[u] and t in m.x[v]}


def add_one_strategy(m: _Model, p: Problem) -> None:
    """one_strategy[i]: Σ_s x[i,s] = 1."""
    for i, xs in m.x.items():
        row = m.solver.Constraint(1, 1, f"one_strategy[{p.names[i]}]")
        for x in xs.values():
            row.SetCoefficient(x, 1)


def add_edge_consistency(m: _Model, p: Problem) -> None:
    """edge_consistency: Σ_t e[u,v,s,t] = x[u,s] and Σ_s e[u,v,s,t] = x[v,t] (rows with some e)."""
    for (u, v), es in m.e.items():
        for end, node in ((0, u), (1, v)):
            rows: dict[int, list] = {}
            for pair, var in es.items():
                rows.setdefault(pair[end], []).append(var)
            for s, vars_ in rows.items():
                row = m.solver.Constraint(0, 0, f"edge_consistency[{u},{v},{'st'[end]}={s}]")
                row.SetCoefficient(m.x[node][s], -1)
                for var in vars_:
                    row.SetCoefficient(var, 1)


def add_forbidden_pairs(m: _Model, p: Problem) -> None:
    """forbidden_pairs[u,v,s]: x[u,s] = 0 when every pair (s, t) of edge (u, v) is forbidden."""
    for (u, v), es in m.e.items():
        for end, node in ((0, u), (1, v)):
            used = {pair[end] for pair in es}
            for s, x in m.x[node].items():
                if s not in used:
                    m.solver.Constraint(0, 0, f"forbidden_pairs[{u},{v},{node}:{s}]").SetCoefficient(x, 1)


def add_memory_budget(m: _Model, p: Problem) -> None:
    """memory_budget: Σ_i Σ_s m_i[s] x[i,s] <= budget - memory_offset (bytes; scaled for LP solvers)."""
    rhs = p.budget - p.memory_offset
    if m.integer:
        unit, rhs = 1.0, math.floor(rhs)
    else:
        unit = max([float(np.abs(mem).max()) for mem in p.memory.values()] + [1.0])
    row = m.solver.Constraint(-m.solver.infinity(), rhs / unit, "memory_budget")
    for i, xs in m.x.items():
        for s, x in xs.items():
            row.SetCoefficient(x, math.ceil(p.memory[i][s]) if m.integer else p.memory[i][s] / unit)


def set_objective(m: _Model, p: Problem) -> None:
    """minimise Σ c_i[s] x[i,s] + Σ R_uv[s,t] e[u,v,s,t] (the constant time_offset added after)."""
    obj = m.solver.Objective()
    for i, xs in m.x.items():
        for s, x in xs.items():
            obj.SetCoefficient(x, _coef(m, p.time[i][s]))
    for (u, v), es in m.e.items():
        r = p.edges[u, v]
        for (s, t), var in es.items():
            obj.SetCoefficient(var, _coef(m, r[s, t]))
    obj.SetMinimization()


def build_model(p: Problem, backend: str) -> _Model:
    """The ILP above for a simplified problem, one function per constraint family."""
    solver = pywraplp.Solver.CreateSolver(BACKENDS[backend])
    if solver is None:
        raise SolverError(f"backend {backend!r} is not available in this OR-tools build")
    solver.SuppressOutput()  # HiGHS otherwise prints its banner to stdout, into the user's output
    if backend == "highs":
        solver.SetSolverSpecificParametersAsString("output_flag=false\n")
    m = _Model(solver, integer=backend.startswith("cpsat"))
    finite = [np.abs(c[np.isfinite(c)]).max(initial=0.0) for c in (*p.time.values(), *p.edges.values())]
    m.scale = 2.0 ** 30 / max(max(finite, default=0.0), 1e-30)
    make_variables(m, p)
    add_one_strategy(m, p)
    add_forbidden_pairs(m, p)
    add_edge_consistency(m, p)
    if p.budget is not None:
        add_memory_budget(m, p)
    set_objective(m, p)
    return m


def _run_model(m: _Model, p: Problem, backend: str, seconds: float, hint: dict[int, int] | None,
               deterministic: bool, gap: float) -> tuple[dict[int, int] | None, str, float]:
    """Solve the model; (assignment or None, "optimal"|"feasible"|"infeasible"|"unknown", bound)."""
    s = m.solver
    if math.isfinite(seconds):
        s.SetTimeLimit(max(int(seconds * 1000), 10))
    if m.integer:
        extra = f" relative_gap_limit: {gap}"
        if deterministic and math.isfinite(seconds):  # stop on work done, not on the clock
            extra += f" interleave_search: true max_deterministic_time: {0.5 * seconds}"
        s.SetSolverSpecificParametersAsString(_CPSAT_PARAMS[backend] + extra)
    else:
        s.SetNumThreads(1)
    if hint is not None and backend not in ("highs", "auto", "dp"):  # SetHint crashes HiGHS 1.12
        xs = [(x, float(hint[i] == k)) for i, d in m.x.items() for k, x in d.items()]
        es = [(e, float(hint[u] == a and hint[v] == b)) for (u, v), d in m.e.items()
              for (a, b), e in d.items()]
        s.SetHint([v for v, _ in xs + es], [w for _, w in xs + es])
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, gap)
    status = s.Solve(params)
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return None, "infeasible" if status == pywraplp.Solver.INFEASIBLE else "unknown", -math.inf
    choice = {i: max(d, key=lambda k: d[k].solution_value()) for i, d in m.x.items()}
    bound = s.Objective().BestBound() / (m.scale if m.integer else 1.0) + p.time_offset
    return choice, "optimal" if status == pywraplp.Solver.OPTIMAL else "feasible", bound


def _mip(p: Problem, backend: str, deadline: float, hint: dict[int, int] | None,
         deterministic: bool, stats: dict, gap: float) -> tuple[dict[int, int] | None, str, float]:
    """Simplify exactly, solve the ILP of what is left, restore the eliminated nodes."""
    q = p.copy()
    records = simplify(q)
    stats.update(simplified_nodes=len(q.time), simplified_edges=len(q.edges))
    if not q.time:
        choice = restore(records, {})
        return choice, "optimal", p.evaluate(choice)[0]
    backend = _MIP_BACKEND if backend in ("auto", "dp") else backend
    m = build_model(q, backend)
    stats["ilp_variables"] = m.solver.NumVariables()
    qhint = {i: hint[i] for i in q.time} if hint is not None else None
    seconds = deadline - _time.monotonic()
    choice, status, bound = _run_model(m, q, backend, seconds, qhint, deterministic, gap)
    return (restore(records, choice) if choice is not None else None), status, bound


def _unconstrained_mip(p: Problem, deadline: float, stats: dict, gap: float) -> tuple[dict[int, int], float] | None:
    """min time without the memory row by HiGHS (fastest without the row, see BENCHMARK): the
    exact relaxation `_search` starts from when the DP tables are too large; None if not proven."""
    q = p.copy()
    q.budget = None
    choice, status, bound = _mip(q, "highs", deadline, None, True, stats, gap)
    if choice is None or status != "optimal":
        return None
    return choice, min(bound, q.evaluate(choice)[0])


def _least_memory(p: Problem) -> tuple[dict[int, int], float]:
    """Exact minimum of memory_offset + Σ memory over assignments that avoid every inf."""
    r = Problem(p.names, {i: np.where(np.isfinite(t), p.memory[i], np.inf) for i, t in p.time.items()},
                {i: np.zeros_like(t) for i, t in p.time.items()},
                {k: np.where(np.isfinite(e), 0.0, np.inf) for k, e in p.edges.items()},
                p.adj, None, p.memory_offset, 0.0)
    out = solve_unconstrained(r)
    if out is None:
        choice, status, _ = _mip(r, "highs", math.inf, None, True, {}, 1e-9)
        out = (choice, r.evaluate(choice)[0]) if choice is not None else ({}, math.inf)
    return out


def _raise_infeasible(p: Problem, least: float) -> None:
    if not math.isfinite(least):
        raise InfeasiblePlanError("no plan exists: every assignment uses a forbidden strategy pair "
                                  "(constraint families forbidden_pairs / edge_consistency)",
                                  min_memory_per_device=math.inf, budget=p.budget)
    raise InfeasiblePlanError(
        f"no plan fits the memory budget of {p.budget / 1e9:.3f} GB per device: the smallest plan "
        f"needs {least / 1e9:.3f} GB (constraint family memory_budget)",
        min_memory_per_device=least, budget=p.budget)


def _fits(p: Problem, choice: dict[int, int] | None) -> bool:
    if choice is None:
        return False
    t, mem = p.evaluate(choice)
    return math.isfinite(t) and (p.budget is None or mem <= p.budget)


def _search(p: Problem, backend: str, deadline: float, hint: dict[int, int] | None,
            deterministic: bool, stats: dict, gap: float) -> tuple[dict[int, int], str, float, str]:
    """The solve strategy of the module docstring; returns (assignment, status, bound, backend)."""
    bound, candidates, out, exact = -math.inf, [hint] if _fits(p, hint) else [], None, "dp"
    if backend in ("auto", "dp"):
        out = solve_unconstrained(p)
        if out is None and backend == "dp":
            raise SolverError("backend 'dp': the elimination tables are too large for this graph")
        if out is None:  # treewidth too high for the DP (2-D meshes): the same relaxation by ILP
            out, exact = _unconstrained_mip(p, deadline, stats, gap), "highs"
        if out is not None:
            if _fits(p, out[0]):
                return out[0], "optimal", out[1], exact
            if not math.isfinite(out[1]):
                _raise_infeasible(p, math.inf)
            bound = out[1]
    least_choice, least = _least_memory(p)
    if not math.isfinite(least) or (p.budget is not None and least > p.budget):
        _raise_infeasible(p, least)
    candidates.append(least_choice)
    if backend in ("auto", "dp") and out is not None:
        lr = lagrangian(p, p.budget, out[0], deadline=deadline, tol=gap)
        if lr is not None and lr.choice is not None:
            candidates.append(lr.choice)
            bound = max(bound, lr.lower_bound)
        stats["lagrange_iterations"] = lr.iterations if lr is not None else 0
    best = min(candidates, key=lambda c: p.evaluate(c)[0])
    best_t = p.evaluate(best)[0]
    if best_t - bound <= gap * abs(best_t) or backend == "dp":
        return best, "optimal" if best_t - bound <= gap * abs(best_t) else "feasible", bound, "dp"
    choice, status, mip_bound = _mip(p, backend, deadline, best, deterministic, stats, gap)
    used = _MIP_BACKEND if backend == "auto" else backend
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
          mip_gap: float = 1e-4) -> Solution:
    """Pick one strategy per node minimising total seconds under the memory budget.

    `fixed` maps a node to the strategy indices it may use; `dedup_layers` solves one layer per
    class of `cg.layer_groups` and tiles it (see `quotient_layers`; the bound is then over tiled
    plans). "optimal" means proven within the relative `mip_gap`; `lower_bound` holds the proven
    bound. Raises InfeasiblePlanError (with the minimum memory) when no plan fits.
    """
    if backend not in BACKENDS:
        raise InputError(f"unknown solver backend {backend!r}; choose one of {sorted(BACKENDS)}")
    start = _time.monotonic()
    deadline = start + time_limit if time_limit is not None else math.inf
    if dedup_layers and cg.layer_groups:
        return _solve_tiled(cg, time_limit=time_limit, backend=backend, hint=hint,
                            deterministic=deterministic, fixed=fixed, mip_gap=mip_gap)
    if hint is not None and len(hint) != len(cg.nodes):
        raise InputError(f"hint has {len(hint)} entries for {len(cg.nodes)} nodes")
    full = from_costgraph(cg, fixed)
    compacted = compact(full)
    if compacted is None:
        _raise_infeasible(full, math.inf)
    p, keep = compacted
    stats = {"nodes": len(cg.nodes), "edges": len(cg.edges), "strategies": sum(len(t) for t in full.time.values()),
             "kept_strategies": sum(len(k) for k in keep.values())}
    choice_d, status, bound, used = _search(p, backend, deadline, _compact_hint(hint, keep), deterministic, stats,
                                            mip_gap)
    choice = np.array([keep[i][choice_d[i]] for i in range(len(cg.nodes))], dtype=np.int64)
    if hint is not None and status != "optimal" and _fits(full, dict(enumerate(hint))) \
            and full.evaluate(dict(enumerate(hint)))[0] < full.evaluate(dict(enumerate(choice)))[0]:
        choice = np.asarray(hint, dtype=np.int64)   # a pruned-away hint still serves as the fallback
    t, mem = evaluate(cg, choice)
    bound = min(bound, t)
    return Solution(choice, t, mem, bound, status, used, _time.monotonic() - start, stats)


def _compact_hint(hint: np.ndarray | None, keep: dict[int, np.ndarray]) -> dict[int, int] | None:
    """The hint in compacted indices, or None when dominance pruned one of its strategies."""
    if hint is None:
        return None
    pos = {i: np.flatnonzero(k == int(hint[i])) for i, k in keep.items()}
    return {i: int(w[0]) for i, w in pos.items()} if all(len(w) for w in pos.values()) else None


def _solve_tiled(cg: CostGraph, *, hint: np.ndarray | None, fixed: dict[int, list[int]] | None,
                 **kw) -> Solution:
    """Solve the layer quotient, tile its plan; fall back to the full graph if no tiled plan fits."""
    start = _time.monotonic()
    q, rep = quotient_layers(cg)
    first = np.unique(rep, return_index=True)[1]
    qfixed: dict[int, list[int]] = {}
    for i, allowed in (fixed or {}).items():
        prev = set(qfixed.get(int(rep[i]), allowed))
        qfixed[int(rep[i])] = sorted(prev & set(allowed))
    try:
        sq = solve(q, hint=None if hint is None else np.asarray(hint)[first], fixed=qfixed, **kw)
    except InfeasiblePlanError:
        return solve(cg, hint=hint, fixed=fixed, **kw)
    choice = sq.choice[rep]
    t, mem = evaluate(cg, choice)
    stats = {**sq.stats, "tiled": True, "nodes": len(cg.nodes), "quotient_nodes": len(q.nodes)}
    bound = min(sq.lower_bound, t)
    return Solution(choice, t, mem, bound, sq.status, sq.backend, _time.monotonic() - start, stats)
