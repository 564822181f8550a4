"""The ILP of `autopar.planning.solver` (its docstring writes the model out): for OR-tools' pywraplp
backends (CP-SAT, SCIP, CBC) and, from numpy arrays, for HiGHS through highspy.

One function per constraint family, each restating its formula; every constraint is named, so an
infeasible model says which family failed. `build_model` assembles them, `run_model` solves.
HiGHS's model is built from arrays instead (`_arrays`: the same rows): its LP relaxation, which HiGHS
solves first and which answers most solves (`integral_relaxation`), and its MIP
(`highs_mip`).
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import highspy
import numpy as np
from ortools.linear_solver import pywraplp
from scipy.sparse import csc_array

from autopar.errors import SolverError
from autopar.planning.dp_oracle import lagrangian, problem_order, solve_unconstrained
from autopar.planning.simplify import SolverProblem, compact_within

# BENCHMARK (benchmarks/solver_backends.py, 5 s limit, 2 shared cores; 25 ops/layer, 4-16 strategies):
# - no memory row: variable elimination ("dp") is exact and fastest: 0.01 / 0.03 / 0.21 s at
#   102 / 402 / 1,202 nodes, vs 0.02 / 0.07 / 0.42 s for the best ILP (HiGHS, CP-SAT): 2-3x.
# - memory row (2026-12-04, HiGHS through highspy: `highs_mip`): 102 nodes: HiGHS 1.65 s optimal,
#   CP-SAT tuned 3.6 s deterministic, 0.45 s as its free portfolio (deterministic=False); 402 nodes,
#   none proven in 5 s: HiGHS gap 5.8e-4, deterministic CP-SAT 3.5e-3 (its portfolio 0 in 4 s);
#   1,202 nodes: HiGHS 1.7e-4, CP-SAT 0.31. (pywraplp's HiGHS, used before, returned no incumbent at a
#   time limit and crashed on SetHint.)
# Winner for "auto": DP, then Lagrangian bisection, then HiGHS; CP-SAT tuned, warm-started from the
# Lagrangian incumbent, below 50k pair variables with deterministic=False (`solver._MIP_BACKEND`).
BACKENDS = {"highs": "HIGHS", "scip": "SCIP", "cbc": "CBC", "cpsat": "CP_SAT",
            "cpsat_default": "CP_SAT", "dp": None, "auto": "CP_SAT"}
_CPSAT_PARAMS = {
    "cpsat": "num_workers: 2 extra_subsolvers: 'max_lp' cp_model_probing_level: 0 random_seed: 0",
    "cpsat_default": "num_workers: 2 random_seed: 0",
}


_INTEGRAL = 1e-9   # an LP value this close to 0 or 1 is integral
_TIGHT = {"primal_feasibility_tolerance": 1e-9, "dual_feasibility_tolerance": 1e-9}   # `_cost_scale`
DIVE_STEPS = 20    # LPs `integral_relaxation`'s dive solves at most (Llama's layer quotients: 1-14)...
DIVE_SHARE = 0.25  # ... in at most this share of the time left to the solve's deadline


@dataclass
class _Model:
    solver: pywraplp.Solver
    integer: bool
    x: dict[int, dict[int, object]] = field(default_factory=dict)
    e: dict[tuple[int, int], dict[tuple[int, int], object]] = field(default_factory=dict)
    scale: float = 1.0


def _coef(m: _Model, value: float) -> float:
    return float(round(value * m.scale)) if m.integer else float(value)


def make_variables(m: _Model, p: SolverProblem) -> None:
    """x[i,s] for every allowed strategy; e[u,v,s,t] for every finite pair of allowed strategies."""
    var = m.solver.BoolVar if m.integer else functools.partial(m.solver.NumVar, 0.0, 1.0)
    for i, c in p.time.items():
        m.x[i] = {s: m.solver.BoolVar(f"x[{i},{s}]") for s in np.flatnonzero(np.isfinite(c)).tolist()}
    for (u, v), r in p.edges.items():
        xu, xv = m.x[u], m.x[v]
        m.e[u, v] = {(s, t): var(f"e[{u},{v},{s},{t}]") for s, t in np.argwhere(np.isfinite(r)).tolist()
                     if s in xu and t in xv}


def add_one_strategy(m: _Model, p: SolverProblem) -> None:
    """one_strategy[i]: Σ_s x[i,s] = 1."""
    for i, xs in m.x.items():
        row = m.solver.Constraint(1, 1, f"one_strategy[{p.names[i]}]")
        for x in xs.values():
            row.SetCoefficient(x, 1)


def add_edge_consistency(m: _Model, p: SolverProblem) -> None:
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


def add_forbidden_pairs(m: _Model, p: SolverProblem) -> None:
    """forbidden_pairs[u,v,s]: x[u,s] = 0 when every pair (s, t) of edge (u, v) is forbidden."""
    for (u, v), es in m.e.items():
        for end, node in ((0, u), (1, v)):
            used = {pair[end] for pair in es}
            for s, x in m.x[node].items():
                if s not in used:
                    m.solver.Constraint(0, 0, f"forbidden_pairs[{u},{v},{node}:{s}]").SetCoefficient(x, 1)


def add_memory_budget(m: _Model, p: SolverProblem) -> None:
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


def set_objective(m: _Model, p: SolverProblem) -> None:
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


def build_model(p: SolverProblem, backend: str) -> _Model:
    """The ILP above for a simplified problem, one function per constraint family."""
    solver = pywraplp.Solver.CreateSolver(BACKENDS[backend])
    if solver is None:
        raise SolverError(f"backend {backend!r} is not available in this OR-tools build")
    solver.SuppressOutput()  # HiGHS otherwise prints its banner to stdout, into the user's output
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


def run_model(m: _Model, p: SolverProblem, backend: str, seconds: float, hint: dict[int, int] | None,
              deterministic: bool, gap: float) -> tuple[dict[int, int] | None, str, float]:
    """Solve the model by a pywraplp backend (HiGHS runs through `highs_mip`); (assignment or None,
    "optimal"|"feasible"|"infeasible"|"unknown", bound)."""
    assert backend != "highs", "HiGHS runs through highs_mip"
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
    if hint is not None:
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


def integral_relaxation(p: SolverProblem, gap: float, deadline: float = math.inf
                        ) -> tuple[dict[int, int], str, float] | None:
    """Solve the LP relaxation (x continuous, costs scaled by `_cost_scale`); when its optimum is
    integral it is the ILP's optimum (the LP's value bounds every integer plan from below, and this plan
    attains it), found without HiGHS's MIP machinery: presolve, root cuts and heuristics cost 2-15x the
    LP on these models even when the LP is already integral, as it is without a memory row (the marginal
    polytope of these tree-like graphs) and often with one. When it is fractional, the best plan on the
    LP's support (`_support_plan`) is taken if within `gap` of the LP's value; else a dive looks for one:
    the fractional node whose largest share is largest is fixed to that strategy and the LP re-solved
    (warm, a few hundredths of a second each), the support's plan tried at each step, up to DIVE_STEPS
    LPs, an integral one, or DIVE_SHARE of the time to `deadline` (`time.monotonic()`; the MIP gets the
    rest). None when no plan within `gap` of the root LP's value turns up: the MIP runs.
    HiGHS's MIP finds such plans late, by sub-MIP heuristics after its root cuts: on Llama-3-70B x 512
    H100s (fp32; 64 x 8, 155k columns, a memory row, gap 0.5%) three of its pipeline search's MIPs took
    24-36 CPU s each, where the dive's plans, 0.19-0.41% over the LP, took 0.8-1.1 s."""
    k = _cost_scale(p)
    arrays = _arrays(p, k)
    highs = None if arrays is None else _highs(arrays, {"presolve": "off", **_TIGHT})
    if highs is None:
        return None
    bound, best, best_time = None, None, math.inf
    start = time.monotonic()
    for _ in range(DIVE_STEPS):
        if bound is not None and time.monotonic() - start > DIVE_SHARE * (deadline - start):
            return None
        if highs.run() == highspy.HighsStatus.kError or highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None   # the root LP not proven, or a fixing left no plan under the row: the MIP decides
        value = highs.getInfo().objective_function_value / k + p.time_offset
        bound = value if bound is None else bound
        x = np.asarray(highs.getSolution().col_value)
        values = {i: {int(s): float(x[first + j]) for j, s in enumerate(allowed)}
                  for i, (allowed, first) in arrays.xs.items()}
        fractional = {i: d for i, d in values.items() if any(min(v, 1.0 - v) > _INTEGRAL for v in d.values())}
        found = _support_plan(p, values, gap) if fractional else arrays.choice(x)
        if found is not None:
            t, memory = p.evaluate(found)
            if t < best_time and (p.budget is None or memory <= p.budget):
                best, best_time = found, t
        if best is not None and best_time - bound <= gap * abs(best_time):
            return best, "optimal", min(bound, best_time)
        if not fractional:
            return None
        i = max(fractional, key=lambda n: max(fractional[n].values()))
        keep = max(fractional[i], key=fractional[i].get)
        allowed, first = arrays.xs[i]
        cols = (first + np.flatnonzero(allowed != keep)).astype(np.int32)
        highs.changeColsBounds(len(cols), cols, np.zeros(len(cols)), np.zeros(len(cols)))
    return None


@dataclass(frozen=True)
class _Arrays:
    """`build_model`'s model as arrays: min c.x subject to row_lower <= matrix x <= row_upper,
    0 <= x <= col_upper; the x[i,s] columns first (node i's allowed strategies from column `xs[i][1]`),
    then each edge's finite pairs (`pairs[(u, v)]`: first column, u's and v's positions in their allowed
    strategies)."""
    c: np.ndarray
    matrix: csc_array
    row_lower: np.ndarray
    row_upper: np.ndarray
    col_upper: np.ndarray
    xs: dict[int, tuple[np.ndarray, int]]
    pairs: dict[tuple[int, int], tuple[int, np.ndarray, np.ndarray]]

    @property
    def num_x(self) -> int:
        return sum(len(allowed) for allowed, _ in self.xs.values())

    def choice(self, x: np.ndarray) -> dict[int, int]:
        """The strategy of each node in a solution (its largest x)."""
        return {i: int(allowed[np.argmax(x[first:first + len(allowed)])]) for i, (allowed, first) in self.xs.items()}


def _arrays(p: SolverProblem, cost_scale: float = 1.0, budget: bool = True) -> _Arrays | None:
    """`build_model`'s rows and columns for p from numpy arrays (p's memory row unless `budget=False`,
    in bytes over the largest coefficient); every cost times `cost_scale`. None when a node has no
    allowed strategy."""
    xs: dict[int, tuple[np.ndarray, int]] = {}   # node -> (allowed strategies, first column)
    costs, ncols = [], 0
    for i, t in p.time.items():
        allowed = np.flatnonzero(np.isfinite(t))
        if not len(allowed):
            return None
        xs[i] = (allowed, ncols)
        costs.append(t[allowed])
        ncols += len(allowed)
    upper = [np.ones(ncols)]
    rows, cols = [], []
    nrows = 0
    for i, (allowed, first) in xs.items():   # one_strategy[i]: Σ_s x[i,s] = 1
        rows.append(np.full(len(allowed), nrows))
        cols.append(np.arange(first, first + len(allowed)))
        nrows += 1
    ones_rows = nrows
    pairs = {}
    for (u, v), r in p.edges.items():        # edge_consistency, forbidden_pairs
        sub = r[np.ix_(xs[u][0], xs[v][0])]
        a, b = np.nonzero(np.isfinite(sub))
        pairs[u, v] = (ncols, a, b)
        columns = np.arange(ncols, ncols + len(a))
        costs.append(sub[a, b])
        upper.append(np.ones(len(a)))
        ncols += len(a)
        for end, node in ((a, u), (b, v)):   # Σ e[u,v,s,·] - x[u,s] = 0 for each s some pair uses
            used, row_of = np.unique(end, return_inverse=True)
            rows += [nrows + row_of, nrows + np.arange(len(used))]
            cols += [columns, xs[node][1] + used]
            nrows += len(used)
            unused = np.setdiff1d(np.arange(len(xs[node][0])), used)
            upper[0][xs[node][1] + unused] = 0.0   # x[node,s] = 0 where every pair with s is forbidden
    vals = [np.ones(len(cols[k])) if k < ones_rows or (k - ones_rows) % 2 == 0 else -np.ones(len(cols[k]))
            for k in range(len(cols))]
    rows, cols, vals = np.concatenate(rows), np.concatenate(cols), np.concatenate(vals)
    row_lower = np.zeros(nrows)
    row_lower[:ones_rows] = 1.0
    row_upper = row_lower.copy()
    if budget and p.budget is not None:   # one more row: the memory budget
        unit = max([float(np.abs(mem).max()) for mem in p.memory.values()] + [1.0])
        mem_cols = np.concatenate([first + np.arange(len(allowed)) for allowed, first in xs.values()])
        mem_vals = np.concatenate([p.memory[i][allowed] / unit for i, (allowed, _) in xs.items()])
        rows, cols = np.concatenate([rows, np.full(len(mem_cols), nrows)]), np.concatenate([cols, mem_cols])
        vals = np.concatenate([vals, mem_vals])
        row_lower = np.append(row_lower, -np.inf)
        row_upper = np.append(row_upper, (p.budget - p.memory_offset) / unit)
        nrows += 1
    matrix = csc_array((vals, (rows, cols)), shape=(nrows, ncols))
    return _Arrays(np.concatenate(costs) * cost_scale, matrix, row_lower, row_upper, np.concatenate(upper), xs, pairs)


def solve_lp(p: SolverProblem, cost_scale: float = 1.0, tight: bool = False, budget: bool = True,
             presolve: bool = True) -> tuple[float, dict[int, dict[int, float]]] | None:
    """The LP relaxation of `build_model`'s model (every x and e in [0, 1]; p's memory row unless
    `budget=False`), built from arrays (`_arrays`) and solved by HiGHS (`_highs_lp`): (objective
    without p.time_offset, {i: {s: x[i,s]}}), or None when HiGHS proves no optimum. pywraplp builds the
    same model one coefficient at a time: 1.3 CPU s a model on Llama-3.1-405B's 2-D sub-meshes (~20% of
    its search), this a few hundredths. `cost_scale` multiplies every cost (the objective is returned
    unscaled); `tight`: feasibility tolerances 1e-9; `presolve`: HiGHS's (`_solve_lp_scaled` skips it: see there)."""
    arrays = _arrays(p, cost_scale, budget)
    if arrays is None:
        return None
    options = {"presolve": "on" if presolve else "off", **(_TIGHT if tight else {})}
    solved = _highs_lp(arrays, options)
    if solved is None:
        return None
    fun, x = solved
    values = {i: {int(s): float(x[first + k]) for k, s in enumerate(allowed)}
              for i, (allowed, first) in arrays.xs.items()}
    return fun / cost_scale, values


def _highs(arrays: _Arrays, options: dict, integral: bool = False):
    """A HiGHS instance (highspy) holding `arrays`' model, every x[i,s] integral if `integral`; None when
    HiGHS refuses it. The bare binding class: `highspy.Highs()` prints HiGHS's banner to stdout the first
    time one is made, into the caller's output. The model goes in as arrays (`passModel`'s pointer form):
    filling a `HighsLp` converts each array element by element, 36 ms of a 2-D quotient's ~250 ms LP
    (Llama-3-70B, ~170k columns) against 4 ms."""
    highs = highspy._Highs()
    for name, value in {"output_flag": False, "threads": 1, **options}.items():
        highs.setOptionValue(name, value)
    c, matrix = arrays.c, arrays.matrix
    integrality = np.zeros(len(c), dtype=np.int32)   # HighsVarType: 0 continuous, 1 integer
    if integral:   # the edge pairs stay continuous: integral once x is (the solver module's docstring)
        integrality[:arrays.num_x] = int(highspy.HighsVarType.kInteger)
    status = highs.passModel(
        len(c), matrix.shape[0], matrix.nnz, int(highspy.MatrixFormat.kColwise), int(highspy.ObjSense.kMinimize),
        0.0, np.ascontiguousarray(c, dtype=np.float64), np.zeros(len(c)),
        np.ascontiguousarray(arrays.col_upper, dtype=np.float64), np.ascontiguousarray(arrays.row_lower, dtype=np.float64),
        np.ascontiguousarray(arrays.row_upper, dtype=np.float64), matrix.indptr.astype(np.int32),
        matrix.indices.astype(np.int32), np.ascontiguousarray(matrix.data, dtype=np.float64), integrality)
    return None if status == highspy.HighsStatus.kError else highs


def _highs_lp(arrays: _Arrays, options: dict) -> tuple[float, np.ndarray] | None:
    """min c.x of `arrays` by HiGHS's simplex: (objective, x), or None without a proven optimum. scipy's
    linprog runs the same HiGHS but walks every column in Python afterwards (its bound multipliers):
    0.25 CPU s of a 0.75 s LP on Llama-3-70B's 2-D quotients (~150k columns)."""
    highs = _highs(arrays, options)
    if highs is None or highs.run() == highspy.HighsStatus.kError:
        return None
    if highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    return float(highs.getInfo().objective_function_value), np.asarray(highs.getSolution().col_value)


# HiGHS's primal heuristics in its MIP (sub-MIPs RENS and RINS, root reduced-cost fixing, feasibility jump):
# off. The caller's plans (the hint; the dive's and the LP support's plans before any MIP) are what they
# look for, and on these models they cost a third of the solve: the five memory-row MIPs of bf16
# Llama-3.1-405B x 2,048 took 44.8 / 26.0 / 28.6 / 56.6 / 10.7 CPU s without them against 56.4 / 47.9 /
# 36.3 / 56.8 / 16.4 with (the same plans in three, the other two 0.12% and 0.18% slower: within the 0.5% gap)
_NO_MIP_HEURISTICS = {"mip_heuristic_run_rens": False, "mip_heuristic_run_rins": False,
                      "mip_heuristic_run_root_reduced_cost": False, "mip_heuristic_run_feasibility_jump": False}


def highs_mip(p: SolverProblem, seconds: float, hint: dict[int, int] | None, gap: float, stats: dict | None = None
              ) -> tuple[dict[int, int] | None, str, float]:
    """The ILP by HiGHS's branch and cut through highspy, from `_arrays` (x integral, costs scaled as
    `_solve_lp_scaled` scales them), without HiGHS's presolve, warm-started from `hint`: (assignment or
    None, "optimal"|"feasible"|"infeasible"|"unknown", proven lower bound). HiGHS's presolve shrinks these
    models little and its restarts repeat the root: on Llama-3-70B x 512 H100s in bf16 (64 x 8, 73k and
    123k columns, a memory row) the two MIPs took 17 and 36 CPU s through pywraplp (HiGHS 1.12, presolve
    and restarts on) and 4.0 and 9.1 CPU s so, the same plans proven within 1e-4 (the root's cuts and one
    branching close the LP's 2.3% gap). highspy also reports the proven dual bound, which pywraplp does not.
    `stats` gains the model's variable count and HiGHS's branch-and-bound node count."""
    k = _cost_scale(p)
    arrays = _arrays(p, k)
    if arrays is None:
        return None, "infeasible", -math.inf
    options = {"presolve": "off", "mip_rel_gap": float(gap), "random_seed": 0, **_NO_MIP_HEURISTICS}
    if math.isfinite(seconds):
        options["time_limit"] = max(float(seconds), 0.01)
    highs = _highs(arrays, options, integral=True)
    if highs is None:
        return None, "unknown", -math.inf
    if hint is not None:   # a full primal point: x from the hint, each edge's pair of its ends' strategies
        x = np.zeros(len(arrays.c))
        for i, (allowed, first) in arrays.xs.items():
            x[first + np.flatnonzero(allowed == hint[i])] = 1.0
        for (u, v), (first, a, b) in arrays.pairs.items():
            x[first + np.flatnonzero((arrays.xs[u][0][a] == hint[u]) & (arrays.xs[v][0][b] == hint[v]))] = 1.0
        solution = highspy.HighsSolution()
        solution.col_value = x
        solution.value_valid = True
        highs.setSolution(solution)
    if highs.run() == highspy.HighsStatus.kError:
        return None, "unknown", -math.inf
    status, info = highs.getModelStatus(), highs.getInfo()
    if stats is not None:
        stats.update(ilp_variables=len(arrays.c), mip_nodes=int(info.mip_node_count))
    if status == highspy.HighsModelStatus.kInfeasible:
        return None, "infeasible", -math.inf
    if info.primal_solution_status != highspy.SolutionStatus.kSolutionStatusFeasible:   # no plan found (in time)
        return None, "unknown", -math.inf
    choice = arrays.choice(np.asarray(highs.getSolution().col_value))
    bound = info.mip_dual_bound / k + p.time_offset
    return choice, "optimal" if status == highspy.HighsModelStatus.kOptimal else "feasible", bound


def _support_plan(p: SolverProblem, values: dict[int, dict[int, float]], gap: float) -> dict[int, int] | None:
    """The fastest plan of p among the strategies its LP optimum `values` uses: the exact DP, then, if
    that plan exceeds p's memory row, the Lagrangian bisection over the same support (to `gap`: a plan
    that fits); None where the DP's tables are too large or no plan fits. On these graphs the LP is
    fractional on a few dozen nodes, each split between two strategies, so that problem is small.
    Measured on Llama-3-70B's 2-D sub-meshes (dp x tp, 127 nodes, 130-180k variables, no memory row): 27
    and 58 fractional nodes, the support's plan 0.06% and 0.37% over the LP in under 0.01 s, where
    HiGHS's MIP took 6 and 13 CPU s more."""
    support = {}
    for i, d in values.items():
        support[i] = np.zeros(len(p.time[i]), dtype=bool)
        support[i][[k for k, v in d.items() if v > _INTEGRAL]] = True
    compacted = compact_within(p, support, p.budget)
    if compacted is None:
        return None
    q, keep = compacted
    order = problem_order(q)
    out = solve_unconstrained(q, order=order) if order is not None else None
    if out is None:
        return None
    found = out[0]
    if p.budget is not None and q.evaluate(found)[1] > p.budget:
        lr = lagrangian(q, p.budget, found, order=order, tol=gap)
        if lr is None or lr.choice is None:
            return None
        found = lr.choice
    choice = {i: int(keep[i][k]) for i, k in found.items()}
    return choice if math.isfinite(p.evaluate(choice)[0]) else None


def _solve_lp_scaled(p: SolverProblem, budget: bool = True):
    """`solve_lp` with costs scaled to a median coefficient of 1 and tolerances 1e-9 (`_cost_scale`),
    without HiGHS's presolve: p is `simplify`'s reduction already, and the presolve cost more than it
    saved (Llama-3-70B's 2-D layer quotients, 133k-228k columns: 0.27 / 0.49 CPU s without it against
    0.75 / 1.2 s with it, the same optimum to 1e-14)."""
    return solve_lp(p, cost_scale=_cost_scale(p), tight=True, budget=budget, presolve=False)


def _cost_scale(p: SolverProblem) -> float:
    """The factor that brings p's median positive cost to 1. HiGHS's optimality tolerances are absolute (1e-7 on
    reduced costs by default), and in seconds they let a vertex above the optimum pass as optimal (a GPT block on
    2 x 4 devices: 5e-5 over the ILP's optimum, so a "bound" exceeded a plan); scaled so and solved to 1e-9
    (`_TIGHT`), the same graph gives the optimum to 1e-15."""
    costs = [c[np.isfinite(c)].ravel() for c in (*p.time.values(), *p.edges.values())]
    finite = np.concatenate(costs) if costs else np.zeros(0)
    positive = finite[finite > 0]
    return 1.0 / float(np.median(positive)) if positive.size else 1.0
