"""Exact graph simplification before the ILP, and the working `SolverProblem` form of a `CostGraph`.

Every reduction here keeps the optimum (zero loss) and records how to restore the nodes it removes:

- parallel edges are summed; an edge whose matrix is separable, R[i, j] = a[i] + b[j], moves into
  the two node costs and disappears (an all-zero edge is the common case);
- arc consistency: strategy i of u is forbidden (time inf) when every pair (i, j) on some edge is;
- a node with one allowed strategy folds its edges into its neighbours' node costs;
- a leaf v with neighbour u folds into u: c_u[i] += min_j (R_uv[i, j] + c_v[j]);
- a node v with exactly two neighbours u, w becomes one edge
  M[i, k] = min_j (R_uv[i, j] + c_v[j] + R_vw[j, k]), keeping the argmin to restore v.

The memory caveat: with a memory row, choosing the time-argmin j for v is only safe if that j also
uses the least memory among v's allowed strategies for the same neighbour choices (then no other j
can be better on either count). Leaves fold the argmin's memory into u's memory vector; chain
eliminations need the argmin's memory to be the same constant for every (i, k), which moves into
`memory_offset`. A node failing the check stays for the ILP. With no budget, memory is ignored.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from autopar.errors import InputError
from autopar.planning.costgraph import CostEdge, CostGraph, CostNode

INF = np.inf


@dataclass
class SolverProblem:
    """A mutable cost graph keyed by original node index; edges stored once with u < v."""

    names: list[str]
    time: dict[int, np.ndarray]
    memory: dict[int, np.ndarray]
    edges: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    adj: dict[int, set[int]] = field(default_factory=dict)
    budget: float | None = None
    time_offset: float = 0.0
    memory_offset: float = 0.0

    def edge(self, u: int, v: int) -> np.ndarray:
        """The edge matrix oriented with u's strategies as rows."""
        return self.edges[(u, v)] if u < v else self.edges[(v, u)].T

    def add_edge(self, u: int, v: int, mat: np.ndarray) -> None:
        assert u != v
        key, mat = ((u, v), mat) if u < v else ((v, u), mat.T)
        if key in self.edges:
            self.edges[key] = self.edges[key] + mat
        else:
            self.edges[key] = np.array(mat, dtype=float)
            self.adj[u].add(v)
            self.adj[v].add(u)

    def drop_edge(self, u: int, v: int) -> None:
        self.edges.pop((min(u, v), max(u, v)))
        self.adj[u].discard(v)
        self.adj[v].discard(u)

    def remove_node(self, v: int) -> None:
        for w in list(self.adj[v]):
            self.drop_edge(v, w)
        del self.adj[v], self.time[v], self.memory[v]

    def copy(self) -> SolverProblem:
        return SolverProblem(list(self.names), {i: t.copy() for i, t in self.time.items()},
                       {i: m.copy() for i, m in self.memory.items()},
                       {k: e.copy() for k, e in self.edges.items()},
                       {i: set(a) for i, a in self.adj.items()},
                       self.budget, self.time_offset, self.memory_offset)

    def evaluate(self, choice: dict[int, int] | np.ndarray) -> tuple[float, float]:
        """(time, memory) of an assignment of the nodes still in this problem."""
        t = self.time_offset + sum(float(c[choice[i]]) for i, c in self.time.items())
        t += sum(float(e[choice[u], choice[v]]) for (u, v), e in self.edges.items())
        m = self.memory_offset + sum(float(c[choice[i]]) for i, c in self.memory.items())
        return t, m


def from_costgraph(cg: CostGraph, fixed: dict[int, list[int]] | None = None) -> SolverProblem:
    """Copy a CostGraph into a SolverProblem: parallel edges summed, `fixed` strategies outside set to inf."""
    n = len(cg.nodes)
    p = SolverProblem([nd.name for nd in cg.nodes], {}, {}, budget=cg.memory_budget,
                memory_offset=float(cg.memory_offset))
    for i, nd in enumerate(cg.nodes):
        t = np.asarray(nd.time, dtype=float).copy()
        m = np.asarray(nd.memory, dtype=float)
        if t.ndim != 1 or t.shape != m.shape or len(t) == 0:
            raise InputError(f"node {nd.name!r}: time and memory must be equal-length 1-D arrays")
        p.time[i], p.memory[i], p.adj[i] = t, m.copy(), set()
    for i, allowed in (fixed or {}).items():
        mask = np.ones(len(p.time[i]), dtype=bool)
        mask[list(allowed)] = False
        p.time[i][mask] = INF
    for e in cg.edges:
        if not (0 <= e.src < n and 0 <= e.dst < n) or e.src == e.dst:
            raise InputError(f"edge ({e.src}, {e.dst}) does not join two distinct nodes")
        mat = np.asarray(e.time, dtype=float)
        if mat.shape != (len(p.time[e.src]), len(p.time[e.dst])):
            raise InputError(f"edge ({e.src}, {e.dst}) matrix has shape {mat.shape}")
        p.add_edge(e.src, e.dst, mat)
    return p


def drop_separable_edges(p: SolverProblem) -> None:
    """Move edges with R[i, j] = a[i] + b[j] (all finite) into node costs; all-zero edges vanish."""
    for (u, v), r in list(p.edges.items()):
        if not np.isfinite(r).all():
            continue
        a, b = r[:, 0] - r[0, 0], r[0, :]
        if np.array_equal(r, a[:, None] + b[None, :]):
            p.time[u] = p.time[u] + a
            p.time[v] = p.time[v] + b
            p.drop_edge(u, v)


def arc_consistency(p: SolverProblem) -> None:
    """Forbid strategy i of u when no allowed strategy j of a neighbour v has R_uv[i, j] finite.
    An edge without inf forbids nothing while v keeps an allowed strategy; only the others are read."""
    finite = {k: bool(np.isfinite(e).all()) for k, e in p.edges.items()}
    queue, queued = deque(sorted(p.time)), set(p.time)
    while queue:
        v = queue.popleft()
        queued.discard(v)
        alive = bool(np.isfinite(p.time[v]).any())
        for u in sorted(p.adj[v]):
            if alive and finite[(u, v) if u < v else (v, u)]:
                continue
            best = (p.edge(u, v) + p.time[v][None, :]).min(axis=1)
            newly = np.isinf(best) & np.isfinite(p.time[u])
            if newly.any():
                p.time[u][newly] = INF
                if u not in queued:
                    queue.append(u)
                    queued.add(u)


# Restore records: ("fixed", v, j) | ("leaf", v, u, best[i]) | ("chain", v, u, w, best[i, k]).
Record = tuple


def _argmin(total: np.ndarray, mem: np.ndarray, use_memory: bool) -> tuple[np.ndarray, np.ndarray, bool]:
    """Time-argmin over the last axis (ties -> least memory); and whether it is memory-safe."""
    tmin = total.min(axis=-1)
    is_min = total == tmin[..., None]
    best = np.where(is_min, mem, INF).argmin(axis=-1)
    if not use_memory:
        return best, tmin, True
    least = np.where(np.isfinite(total), mem, INF).min(axis=-1)
    safe = bool(np.all((mem[best] <= least) | np.isinf(tmin)))
    return best, tmin, safe


def _eliminate(p: SolverProblem, v: int, use_memory: bool) -> Record | None:
    """Apply the first applicable reduction to node v; return its restore record or None."""
    tv, mv, nbrs = p.time[v], p.memory[v], sorted(p.adj[v])
    finite = np.flatnonzero(np.isfinite(tv))
    if len(finite) == 1:
        j = int(finite[0])
        for u in nbrs:
            p.time[u] = p.time[u] + p.edge(u, v)[:, j]
        p.time_offset += float(tv[j])
        p.memory_offset += float(mv[j])
        return ("fixed", v, j)
    if len(nbrs) == 0:
        best, tmin, safe = _argmin(tv, mv, use_memory)
        if not safe:
            return None
        p.time_offset += float(tmin)
        p.memory_offset += float(mv[best])
        return ("fixed", v, int(best))
    if len(nbrs) == 1:
        u = nbrs[0]
        best, tmin, safe = _argmin(p.edge(u, v) + tv[None, :], mv, use_memory)
        if not safe:
            return None
        p.time[u] = p.time[u] + tmin
        p.memory[u] = p.memory[u] + mv[best]
        return ("leaf", v, u, best)
    if len(nbrs) == 2:
        u, w = nbrs
        total = p.edge(u, v)[:, None, :] + tv[None, None, :] + p.edge(w, v)[None, :, :]
        best, tmin, safe = _argmin(total, mv, use_memory)
        mem_used = mv[best][np.isfinite(tmin)]
        if not safe or (use_memory and len(mem_used) and np.ptp(mem_used) != 0):
            return None
        p.memory_offset += float(mem_used[0]) if len(mem_used) else 0.0
        p.add_edge(u, w, tmin)
        return ("chain", v, u, w, best)
    return None


def simplify(p: SolverProblem, use_memory: bool | None = None) -> list[Record]:
    """Reduce p in place until no rule applies; return the restore records (apply with `restore`)."""
    use_memory = p.budget is not None if use_memory is None else use_memory
    if not use_memory:
        for i in p.memory:
            p.memory[i] = np.zeros_like(p.memory[i])
    drop_separable_edges(p)
    arc_consistency(p)
    records: list[Record] = []
    queue, queued = deque(sorted(p.time)), set(p.time)
    while queue:
        v = queue.popleft()
        queued.discard(v)
        if v not in p.time:
            continue
        nbrs = set(p.adj[v])
        rec = _eliminate(p, v, use_memory)
        if rec is None:
            continue
        records.append(rec)
        p.remove_node(v)
        for u in sorted(nbrs):
            if u not in queued:
                queue.append(u)
                queued.add(u)
    return records


def restore(records: list[Record], choice: dict[int, int]) -> dict[int, int]:
    """Extend an assignment of the reduced problem to the nodes that `simplify` removed."""
    for rec in reversed(records):
        if rec[0] == "fixed":
            choice[rec[1]] = rec[2]
        elif rec[0] == "leaf":
            choice[rec[1]] = int(rec[3][choice[rec[2]]])
        else:
            choice[rec[1]] = int(rec[4][choice[rec[2]], choice[rec[3]]])
    return choice


def quotient_layers(cg: CostGraph) -> tuple[CostGraph, np.ndarray]:
    """Collapse each class of identical layers onto its first layer; rep[i] = quotient index of i.

    A tiled plan gives position j the same strategy in every layer of its class, so summing costs
    over the members of each position is exact for tiled plans: node time and memory add up (the
    memory row becomes L x per-layer memory), an edge (u, v) becomes an edge (rep u, rep v) with its
    matrix added, and an edge between two members of the same position (the boundary edge of
    consecutive layers, weighted L-1 in total) adds its diagonal to that node's time.
    """
    owner = np.arange(len(cg.nodes))
    for cls in cg.layer_groups:
        first = cls[0]
        for layer in cls[1:]:
            if len(layer) != len(first):
                raise InputError("layer_groups: layers of one class must have the same length")
            for j, i in enumerate(layer):
                if cg.nodes[i].num_strategies != cg.nodes[first[j]].num_strategies or owner[i] != i:
                    raise InputError(f"layer_groups: node {cg.nodes[i].name!r} cannot tile "
                                     f"{cg.nodes[first[j]].name!r}")
                owner[i] = first[j]
    kept = np.flatnonzero(owner == np.arange(len(cg.nodes)))
    index = np.full(len(cg.nodes), -1)
    index[kept] = np.arange(len(kept))
    rep = index[owner]
    times = [np.zeros(cg.nodes[i].num_strategies) for i in kept]
    mems = [np.zeros(cg.nodes[i].num_strategies) for i in kept]
    for i, nd in enumerate(cg.nodes):
        times[rep[i]] = times[rep[i]] + np.asarray(nd.time, dtype=float)
        mems[rep[i]] = mems[rep[i]] + np.asarray(nd.memory, dtype=float)
    edges: dict[tuple[int, int], np.ndarray] = {}
    for e in cg.edges:
        u, v, mat = int(rep[e.src]), int(rep[e.dst]), np.asarray(e.time, dtype=float)
        if u == v:
            times[u] = times[u] + np.diag(mat)
            continue
        key, mat = ((u, v), mat) if u < v else ((v, u), mat.T)
        edges[key] = edges[key] + mat if key in edges else mat
    q = CostGraph([CostNode(cg.nodes[i].name, times[k], mems[k]) for k, i in enumerate(kept)],
                  [CostEdge(u, v, m) for (u, v), m in edges.items()],
                  cg.memory_budget, cg.memory_offset)
    return q, rep


def _take(m: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """m[np.ix_(rows, cols)], without np.ix_'s Python overhead (it shows in profiles)."""
    return m.take(rows, axis=0).take(cols, axis=1)


def _dominated(p: SolverProblem, v: int, keep: dict[int, np.ndarray], use_memory: bool) -> np.ndarray:
    """Mask over keep[v]: strategy b is dropped when some a has time, memory (if it counts) and every
    incident edge row <= b's; of equal strategies the one of least memory is kept (then the first).
    Swapping b for a in any plan then never costs more, so an optimum survives (iterating is exact
    for the same reason). The memory tie-break makes a budget-free optimum one that the same graph
    under a memory row keeps too (there memory counts, and a tie of more memory is dominated), so
    `solver._Memo` recalls it instead of solving the time optimum again."""
    k = keep[v]
    cols = [p.time[v][k][:, None]]
    if use_memory:
        cols.append(p.memory[v][k][:, None])
    cols += [_take(p.edge(v, u), k, keep[u]) for u in sorted(p.adj[v])]
    f = np.concatenate(cols, axis=1)
    le = np.ones((len(k), len(k)), dtype=bool)   # le[a, b]: f[a] <= f[b] everywhere
    for start in range(0, f.shape[1], 256):    # chunks bound the (k, k, chunk) temporary
        blk = f[:, start:start + 256]
        le &= (blk[:, None, :] <= blk[None, :, :]).all(axis=2)
    mem, idx = p.memory[v][k], np.arange(len(k))
    preferred = (mem[:, None] < mem[None, :]) | ((mem[:, None] == mem[None, :]) & (idx[:, None] < idx[None, :]))
    beats = le & (~le.T | preferred)             # a strictly better, or equal and of less memory / earlier
    np.fill_diagonal(beats, False)
    return beats.any(axis=0)


def compact(p: SolverProblem) -> tuple[SolverProblem, dict[int, np.ndarray]] | None:
    """Drop forbidden strategies (arc consistency) and dominated ones, to a fixpoint; exact.

    Returns the smaller problem and keep[i] (original index of each kept strategy of node i), or None
    when some node has no allowed strategy left (no plan exists). On 2-D meshes nodes carry up to
    ~64 per-axis products, most of them dominated; pruning them keeps the DP tables small."""
    q = p.copy()
    arc_consistency(q)
    keep = {i: np.flatnonzero(np.isfinite(t)) for i, t in q.time.items()}
    if any(len(k) == 0 for k in keep.values()):
        return None
    use_memory = p.budget is not None
    todo = set(q.time)
    while todo:
        nxt: set[int] = set()
        for v in sorted(todo):
            if len(keep[v]) > 1:
                dom = _dominated(q, v, keep, use_memory)
                if dom.any():
                    keep[v] = keep[v][~dom]
                    nxt.update(q.adj[v])
        todo = nxt
    out = SolverProblem(list(p.names), {i: q.time[i][k] for i, k in keep.items()},
                  {i: q.memory[i][k] for i, k in keep.items()},
                  {(u, v): _take(m, keep[u], keep[v]) for (u, v), m in q.edges.items()},
                  {i: set(a) for i, a in q.adj.items()}, p.budget, p.time_offset, p.memory_offset)
    return out, keep


def compact_within(p: SolverProblem, within: dict[int, np.ndarray], budget: float | None
                   ) -> tuple[SolverProblem, dict[int, np.ndarray]] | None:
    """`compact` of p under the memory row `budget` with only the strategies `within` allowed (a bool
    mask per node; a node left out keeps all of its own): keep[i] in p's indices, or None."""
    time = {i: np.where(within[i], t, np.inf) if i in within else t for i, t in p.time.items()}
    return compact(SolverProblem(p.names, time, p.memory, p.edges, p.adj, budget, p.time_offset, p.memory_offset))
