"""Exact dynamic programming (variable elimination) for the unconstrained problem, and oracles.

`variable_elimination` minimises Σ_i c_i[s_i] + Σ_(u,v) R_uv[s_u, s_v] exactly by eliminating one
node at a time (greedy smallest-table order): the node's factors are summed into one table over it
and its neighbours, minimised over the node (argmin kept), and the result becomes a new factor.
Transformer graphs have low treewidth, so the tables stay small; past `max_table` entries it gives
up (returns None) and the caller uses the ILP.

`lagrangian` handles the memory row by relaxing it: for a multiplier λ (seconds per byte) the
problem min Σ time + λ Σ memory has no row and is solved exactly above. Every λ gives a lower
bound  L(λ) = min_x [time(x) + λ (memory(x) - budget)]  on the constrained optimum, and every
assignment it returns that fits the budget is a feasible plan. Bisection on λ tightens both. The
gap may stay open (the row makes the problem a knapsack); the ILP closes it.

`brute_force` enumerates every assignment of a tiny graph: the reference for tests.
"""
from __future__ import annotations

import heapq
import itertools
import math
import time as _time
from dataclasses import dataclass

import numpy as np

from autopar.errors import InfeasiblePlanError
from autopar.planning.costgraph import CostGraph, Solution
from autopar.planning.simplify import SolverProblem, from_costgraph

Factor = tuple[tuple[int, ...], np.ndarray]


def _elim_cost(v: int, nbrs: dict[int, set[int]], size: dict[int, int]) -> int:
    return size[v] * math.prod(size[u] for u in nbrs[v])


def _combine(v: int, fids: list[int], factors: dict[int, Factor], size: dict[int, int]):
    """Sum the factors holding v over the union of their scopes; min out v (keeping the argmin)."""
    scope = tuple(sorted(set().union(*(factors[f][0] for f in fids))))
    table = np.zeros([size[s] for s in scope])
    for f in fids:
        fs, arr = factors[f]
        table = table + arr.reshape([size[s] if s in fs else 1 for s in scope])
    ax = scope.index(v)
    return scope[:ax] + scope[ax + 1:], table.min(axis=ax), table.argmin(axis=ax)


def elimination_order(sizes: dict[int, int], edges, max_table: int = 4_000_000) -> list[int] | None:
    """The greedy smallest-table order `variable_elimination` eliminates nodes in, found from the
    graph's shape alone (strategy counts, edge keys); None when a table would exceed max_table.
    No costs are read, so one order serves every cost vector on the same graph (the Lagrangian
    steps, the least-memory problem), and a graph too large for the DP is refused before any work."""
    single = {v for v, k in sizes.items() if k == 1}
    nbrs: dict[int, set[int]] = {v: set() for v in sizes}
    for u, v in edges:
        if u not in single and v not in single:  # as `_fold_single` folds them
            nbrs[u].add(v), nbrs[v].add(u)
    heap = [(_elim_cost(v, nbrs, sizes), v) for v in sizes]
    heapq.heapify(heap)
    done, order = set(), []
    while heap:
        cost, v = heapq.heappop(heap)
        if v in done:
            continue
        if cost != _elim_cost(v, nbrs, sizes):
            heapq.heappush(heap, (_elim_cost(v, nbrs, sizes), v))
            continue
        if cost > max_table or len(nbrs[v]) >= 32:  # numpy tables have at most 64 dims
            return None
        rest = nbrs.pop(v)  # the scope of v's combined factor, less v
        for a in rest:
            nbrs[a].discard(v)
            nbrs[a].update(b for b in rest if b != a)
            heapq.heappush(heap, (_elim_cost(a, nbrs, sizes), a))
        done.add(v)
        order.append(v)
    return order


def variable_elimination(unary: dict[int, np.ndarray], edges: dict[tuple[int, int], np.ndarray],
                         max_table: int = 4_000_000, order: list[int] | None = None
                         ) -> tuple[dict[int, int], float] | None:
    """Exact min-sum over a pairwise cost graph; None when an elimination table exceeds max_table.
    `order` (from `elimination_order` on the same graph shape) saves finding it again."""
    if order is None:
        order = elimination_order({v: len(c) for v, c in unary.items()}, edges, max_table)
        if order is None:
            return None
    unary, edges, constant = _fold_single(unary, edges)
    size = {v: len(c) for v, c in unary.items()}
    factors: dict[int, Factor] = {i: ((v,), c) for i, (v, c) in enumerate(unary.items())}
    holding: dict[int, set[int]] = {v: {i} for i, v in enumerate(unary)}
    for (u, v), r in edges.items():
        fid = len(factors)
        factors[fid] = ((u, v), r)
        holding[u].add(fid), holding[v].add(fid)
    trail, next_id = [], len(factors)
    for v in order:
        rest, tmin, arg = _combine(v, sorted(holding[v]), factors, size)
        for f in holding.pop(v):
            for s in factors.pop(f)[0]:
                if s != v:
                    holding[s].discard(f)
        if rest:
            factors[next_id] = (rest, tmin)
            for a in rest:
                holding[a].add(next_id)
            next_id += 1
        else:
            constant += float(tmin)
        trail.append((v, rest, arg))
    choice: dict[int, int] = {}
    for v, rest, arg in reversed(trail):
        choice[v] = int(arg[tuple(choice[a] for a in rest)])
    return choice, constant


def _fold_single(unary: dict[int, np.ndarray], edges: dict[tuple[int, int], np.ndarray]):
    """Fold every edge touching a one-strategy node into the other end's unary (or a constant):
    such nodes add no choice, but as factor scopes they would blow up the tables' dimensions."""
    single = {v for v, c in unary.items() if len(c) == 1}
    if not single:
        return unary, edges, 0.0
    unary, rest, constant = dict(unary), {}, 0.0
    for (u, v), r in edges.items():
        if u in single and v in single:
            constant += float(r[0, 0])
        elif v in single:
            unary[u] = unary[u] + r[:, 0]
        elif u in single:
            unary[v] = unary[v] + r[0, :]
        else:
            rest[u, v] = r
    return unary, rest, constant


def problem_order(p: SolverProblem) -> list[int] | None:
    """`elimination_order` of p's graph (None: too large for the DP)."""
    return elimination_order({i: len(t) for i, t in p.time.items()}, p.edges)


def solve_unconstrained(p: SolverProblem, lam: float = 0.0, order: list[int] | None = None
                        ) -> tuple[dict[int, int], float] | None:
    """Exact min of time + lam * memory over p (its budget ignored); None if the DP is too large.
    `order`: `problem_order(p)` when the caller has it (it depends on p's shape only)."""
    unary = {i: p.time[i] + lam * p.memory[i] if lam else p.time[i] for i in p.time}
    out = variable_elimination(unary, p.edges, order=order)
    if out is None:
        return None
    return out[0], out[1] + p.time_offset + lam * p.memory_offset


@dataclass
class LagrangeResult:
    choice: dict[int, int] | None     # best assignment found that fits the budget
    time: float                       # its objective (inf if none)
    lower_bound: float                # best Lagrangian bound on the constrained optimum
    iterations: int


def lagrangian(p: SolverProblem, budget: float, start: dict[int, int], *, iterations: int = 24,
               deadline: float = math.inf, tol: float = 1e-9, order: list[int] | None = None) -> LagrangeResult | None:
    """Bisect λ for min time + λ (memory - budget), from `start` (the λ = 0 optimum, over budget)."""
    order = problem_order(p) if order is None else order
    t0, m0 = p.evaluate(start)
    best, best_t, bound, lo, hi = None, math.inf, t0, 0.0, max(abs(t0), 1e-12) / max(m0, 1.0)
    for it in range(iterations + 64):
        if _time.monotonic() > deadline or (best is not None and it >= iterations):
            return LagrangeResult(best, best_t, bound, it)
        if order is None:  # the DP is too large for this graph
            return None
        lam = hi if best is None else 0.5 * (lo + hi)
        out = solve_unconstrained(p, lam, order)
        t, m = p.evaluate(out[0])
        bound = max(bound, out[1] - lam * budget)
        if m <= budget:
            hi = lam
            if t < best_t:
                best, best_t = out[0], t
            if best_t - bound <= tol * abs(best_t):
                return LagrangeResult(best, best_t, bound, it + 1)
        elif best is None:
            lo, hi = hi, hi * 4.0
        else:
            lo = lam
    return LagrangeResult(best, best_t, bound, iterations + 64)


def brute_force(cg: CostGraph) -> Solution:
    """Enumerate every assignment (tiny graphs only); the reference optimum for tests."""
    t_start = _time.monotonic()
    p = from_costgraph(cg)
    sizes = [len(p.time[i]) for i in range(len(cg.nodes))]
    assert math.prod(sizes) <= 2_000_000, "brute_force is for tiny graphs"
    combos = np.array(list(itertools.product(*[range(k) for k in sizes])), dtype=np.int64)
    times = sum((p.time[i][combos[:, i]] for i in range(len(sizes))), np.zeros(len(combos)))
    for (u, v), r in p.edges.items():
        times = times + r[combos[:, u], combos[:, v]]
    mems = cg.memory_offset + sum((p.memory[i][combos[:, i]] for i in range(len(sizes))),
                                  np.zeros(len(combos)))
    allowed = np.isfinite(times)
    ok = allowed & (mems <= cg.memory_budget if cg.memory_budget is not None else True)
    if not ok.any():
        least = float(mems[allowed].min()) if allowed.any() else math.inf
        raise InfeasiblePlanError(f"brute force: no assignment fits (min memory {least / 1e9:.3f} GB)",
                                  min_memory_per_device=least, budget=cg.memory_budget)
    k = int(np.flatnonzero(ok)[np.argmin(times[ok])])
    return Solution(combos[k].copy(), float(times[k]), float(mems[k]), float(times[k]), "optimal",
                    "brute_force", _time.monotonic() - t_start)
