"""The solver's input: a graph of choices priced in seconds and bytes, independent of torch.

A `CostGraph` is what the planner hands the solver. Node i has `k_i` candidate strategies; choosing
strategy s at node i costs `nodes[i].time[s]` seconds and adds `nodes[i].memory[s]` bytes to the
per-device memory row. An edge (u, v) costs `edge.time[s_u, s_v]` seconds (resharding between the
producer's output placement and the consumer's required input placement); `inf` forbids the pair.
Layer groups name sets of structurally identical layers so the solver may solve one and tile it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class CostNode:
    name: str
    time: np.ndarray          # shape (k,), seconds per strategy (compute + node-local communication)
    memory: np.ndarray        # shape (k,), bytes per device this strategy adds to the memory row

    @property
    def num_strategies(self) -> int:
        return len(self.time)


@dataclass
class CostEdge:
    src: int
    dst: int
    time: np.ndarray          # shape (k_src, k_dst), seconds; np.inf = forbidden combination


@dataclass
class CostGraph:
    nodes: list[CostNode]
    edges: list[CostEdge]
    memory_budget: float | None = None      # bytes per device; None = unconstrained
    memory_offset: float = 0.0              # bytes every plan pays regardless of choices
    # Each entry is one class of identical layers: a list of layers, each layer a list of node
    # indices; position j of every layer in a class is the "same" node (same strategies, costs).
    layer_groups: list[list[list[int]]] = field(default_factory=list)


@dataclass
class Solution:
    choice: np.ndarray        # shape (num_nodes,), chosen strategy index per node
    time: float               # objective: predicted seconds (sum of node and edge times)
    memory: float             # bytes per device (memory_offset + sum of chosen node memory)
    lower_bound: float        # best proven lower bound on the objective
    status: str               # "optimal" | "feasible" (time limit hit) | "fallback"
    backend: str              # which solver produced it
    solve_seconds: float
    stats: dict = field(default_factory=dict)   # sizes before/after simplification etc.

    @property
    def gap(self) -> float:
        """Relative optimality gap (0.0 when proven optimal)."""
        if self.time <= 0:
            return 0.0
        return max(0.0, (self.time - self.lower_bound) / self.time)
