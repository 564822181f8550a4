"""Compare solver backends on synthetic transformer-like cost graphs; prints seconds and objectives.

Each layer has 25 ops in a chain with residual skips (op 0 -> 12, 12 -> 24, and the next layer's
op 0 -> 12 reads the stream from op 24), q/k/v fan-out (2 -> 4, 2 -> 6), 4-16 strategies per op,
edge matrices that are free on "matching" placements and cost 0.1-5 ms otherwise (2% forbidden),
and memory that varies with the strategy on 40% of the ops. The budget sits halfway between the
minimum memory and the memory of the unconstrained optimum, so the row binds.

    python benchmarks/solver_backends.py            # < 2 minutes on 2 shared cores
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from autopar.errors import SolverError
from autopar.planning.costgraph import CostEdge, CostGraph, CostNode
from autopar.planning.solver import min_memory, solve

OPS = 25
SKIPS = [(0, 12), (12, 24), (2, 4), (2, 6)]


def transformer_graph(num_layers: int, seed: int = 0, with_budget: bool = False) -> CostGraph:
    """A stem node, `num_layers` identical layers of OPS ops, and a head node."""
    rng = np.random.default_rng(seed)
    ks = rng.integers(4, 17, size=OPS)
    node_t = [rng.uniform(1e-4, 1e-2, k) for k in ks]
    node_m = [rng.uniform(0.05, 1.0) * 1e9 / 2.0 ** rng.integers(0, 4, k) if rng.random() < 0.4
              else np.zeros(k) for k in ks]

    def reshard(ka: int, kb: int) -> np.ndarray:
        r = rng.uniform(1e-4, 5e-3, (ka, kb))
        period = min(ka, kb)
        r[np.arange(ka)[:, None] % period == np.arange(kb)[None, :] % period] = 0.0
        r[rng.random((ka, kb)) < 0.02] = np.inf
        return r

    intra = {(j, j + 1): reshard(ks[j], ks[j + 1]) for j in range(OPS - 1)}
    intra.update({(a, b): reshard(ks[a], ks[b]) for a, b in SKIPS})
    boundary, skip_in = reshard(ks[-1], ks[0]), reshard(ks[-1], ks[12])
    nodes = [CostNode("stem", rng.uniform(1e-4, 1e-3, 4), np.zeros(4))]
    edges, layers = [], []
    for layer in range(num_layers):
        base = len(nodes)
        nodes += [CostNode(f"l{layer}.op{j}", node_t[j], node_m[j]) for j in range(OPS)]
        layers.append(list(range(base, base + OPS)))
        edges += [CostEdge(base + a, base + b, r) for (a, b), r in intra.items()]
        if layer == 0:
            edges.append(CostEdge(0, base, np.zeros((4, ks[0]))))
        else:
            edges += [CostEdge(base - 1, base, boundary), CostEdge(base - 1, base + 12, skip_in)]
    nodes.append(CostNode("head", rng.uniform(1e-4, 1e-3, 4), np.zeros(4)))
    edges.append(CostEdge(len(nodes) - 2, len(nodes) - 1, reshard(ks[-1], 4)))
    cg = CostGraph(nodes, edges, None, 2e9, [layers])
    if with_budget:
        free = solve(cg)
        least = min_memory(cg)
        cg.memory_budget = least + 0.5 * (free.memory - least)
    return cg


def run(cg: CostGraph, backend: str, limit: float, **kw) -> str:
    try:
        sol = solve(cg, backend=backend.removesuffix("+nondet"), time_limit=limit,
                    deterministic=not backend.endswith("+nondet"), **kw)
    except SolverError as err:
        return f"{'-':>8} {'-':>12} {'-':>9}  {str(err)[:40]}"
    nodes = sol.stats.get("simplified_nodes", "-")
    return f"{sol.solve_seconds:8.2f} {sol.time:12.6f} {sol.gap:9.2e}  {sol.status} ({sol.backend}, ilp nodes {nodes})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=float, default=5.0, help="time limit per solve, seconds")
    ap.add_argument("--full", action="store_true", help="also run slow backends on the largest graph")
    args = ap.parse_args(argv)
    backends = ["auto", "auto+nondet", "dp", "highs", "cpsat", "cpsat+nondet", "cpsat_default",
                "scip", "cbc"]
    print(f"{'layers':>6} {'nodes':>6} {'budget':>6} {'backend':>14} {'seconds':>8} {'objective':>12} "
          f"{'gap':>9}  status")
    for num_layers in (4, 16, 48):  # 102, 402, 1202 nodes
        for with_budget in (False, True):
            cg = transformer_graph(num_layers, with_budget=with_budget)
            slow_ok = num_layers <= 16 or args.full
            for backend in backends:
                if backend in ("cpsat_default", "scip", "cbc", "highs") and not slow_ok:
                    continue
                line = run(cg, backend, args.limit)
                print(f"{num_layers:6d} {len(cg.nodes):6d} {str(with_budget):>6} {backend:>14} {line}",
                      flush=True)
    for with_budget in (False, True):
        cg = transformer_graph(80, with_budget=with_budget)
        for dedup in (True, False):
            t0 = time.monotonic()
            sol = solve(cg, time_limit=args.limit, dedup_layers=dedup)
            print(f"80-layer graph ({len(cg.nodes)} nodes, budget {with_budget}), dedup_layers={dedup}: "
                  f"{time.monotonic() - t0:.2f} s, objective {sol.time:.6f}, {sol.status}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
