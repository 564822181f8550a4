"""Predicted against measured seconds per category of one training step (used by costmodel_fidelity.py).

Categories: matmul, attention, transcendental (exp-class pointwise), pointwise/other, copy (clone,
_to_copy, copy_, cat: layout copies), view/alloc (aliases and allocations), collective (functional
collectives, their waits and what they call, p2p send/recv), optimizer/param (everything under
`Optimizer.step` / `zero_grad` and the per-parameter DTensor work the profile's
`param_step_overhead` prices), and, measured only, what no ATen op accounts for: the autograd engine,
Python (the graph's own code, DTensor dispatch) and "unprofiled" (wall time no profiler event covers:
p2p waits of a pipeline schedule, page faults between ops).

Predicted: each node's chosen-strategy seconds from the cost model (`CostProblem.compute`), by the
node's op; node-local collectives and every edge's resharding as "collective"; parameters'
optimizer-step seconds as "optimizer/param". Measured: torch.profiler self CPU time per event, a
mean over a few steps, on every rank. SPMD plans only are predicted per category (a pipeline's
prediction is its schedule formula, not a sum over one graph).
"""
from __future__ import annotations

import resource
import statistics
import time
from collections import defaultdict

import numpy as np
import torch.distributed as dist

from autopar.graph import packet

MATMUL = {"mm", "addmm", "bmm", "baddbmm", "linear", "matmul"}
COPY = {"clone", "_to_copy", "copy_", "contiguous", "cat", "stack", "copy"}
TRANSCENDENTAL = {"exp", "exp2", "expm1", "log", "log1p", "tanh", "tanh_backward", "sigmoid", "sigmoid_backward",
                  "gelu", "gelu_backward", "silu", "silu_backward", "erf", "_softmax", "_softmax_backward_data",
                  "_log_softmax", "_log_softmax_backward_data"}
VIEW_ALLOC = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "slice", "select",
              "as_strided", "alias", "unsqueeze", "squeeze", "detach", "split", "unbind", "chunk", "narrow",
              "_reshape_alias", "lift_fresh", "empty", "empty_strided", "empty_like", "new_empty_strided",
              "resize_", "zeros", "zero_", "fill_", "ones"}
COLLECTIVE_PREFIXES = ("_c10d_functional::", "c10d::", "gloo:", "nccl:")
CATEGORIES = ("matmul", "attention", "transcendental", "pointwise/other", "copy", "view/alloc", "collective",
              "optimizer/param", "autograd engine", "python", "unprofiled")


def op_category(name: str) -> str:
    """The category of an ATen op by name ("aten::mm", "aten.mm.default" or "mm")."""
    base = name.removeprefix("aten::").removeprefix("aten.").split(".")[0]
    if "scaled_dot_product" in base:
        return "attention"
    for cat, names in (("matmul", MATMUL), ("transcendental", TRANSCENDENTAL), ("copy", COPY),
                       ("view/alloc", VIEW_ALLOC)):
        if base in names:
            return cat
    return "pointwise/other"


def predicted(prob, choice: np.ndarray) -> dict[str, float]:
    """Seconds per category of the plan whose per-node strategy indices are `choice` in `prob`."""
    from autopar.planning.problem import FREE_OPS
    out: dict[str, float] = defaultdict(float)
    for i, node in enumerate(prob.nodes):
        if node.op == "placeholder":
            cat = "optimizer/param"
        elif packet(node) in FREE_OPS:
            cat = "view/alloc"
        else:
            cat = op_category(str(node.target))
        out[cat] += float(prob.compute[i][choice[i]])
        out["collective"] += float(prob.local_comm[i][choice[i]])
    for e in prob.cg.edges:
        out["collective"] += float(e.time[choice[e.src], choice[e.dst]])
    return dict(out)


def _event_category(e) -> str:
    names, anc = [], e
    while anc is not None:
        names.append(anc.name)
        anc = anc.cpu_parent
    if any(n.startswith(("Optimizer.", "_FromTorchTensor", "_ToTorchTensor")) for n in names):
        return "optimizer/param"
    if any(n.startswith(COLLECTIVE_PREFIXES) for n in names):
        return "collective"
    if e.name.startswith("aten::"):
        return op_category(e.name)
    if e.name.startswith("autograd::") or "Backward" in e.name:
        return "autograd engine"
    return "python"


def measured(step, batches, steps: int = 3) -> tuple[dict[str, float], float, float]:
    """Mean self CPU seconds per category over `steps` profiled steps on this rank, the mean wall, and
    the mean bytes of memory the step page-faulted in (fresh pages from the C allocator: a cost no op
    is priced for; on glibc, tensors above its mmap/trim thresholds are mapped and faulted every step)."""
    from torch.profiler import ProfilerActivity, profile
    total: dict[str, float] = defaultdict(float)
    walls, faults = [], 0
    for s in range(steps):
        dist.barrier()
        t0, f0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(*batches[s % len(batches)])
        walls.append(time.perf_counter() - t0)
        faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        for e in prof.events():
            total[_event_category(e)] += e.self_cpu_time_total / 1e6
    wall = statistics.fmean(walls)
    out = {c: t / steps for c, t in total.items()}
    out["unprofiled"] = max(0.0, wall - sum(out.values()))
    return out, wall, faults * resource.getpagesize() / steps


def table(name: str, pred: dict[str, float] | None, per_rank: list[dict[str, float]],
          faulted: list[float] | None = None) -> str:
    """Rows of predicted and per-rank measured milliseconds per category (and MiB page-faulted)."""
    head = f"{name}: ms per step{'':<10}{'predicted':>10}" + "".join(f"{'rank ' + str(r):>9}"
                                                                  for r in range(len(per_rank)))
    rows = [head]
    for cat in CATEGORIES:
        p = f"{pred[cat] * 1e3:10.1f}" if pred is not None and cat in pred else f"{'-':>10}"
        rows.append(f"  {cat:<27}{p}" + "".join(f"{m.get(cat, 0.0) * 1e3:9.1f}" for m in per_rank))
    p = f"{sum(pred.values()) * 1e3:10.1f}" if pred is not None else f"{'-':>10}"
    rows.append(f"  {'total':<27}{p}" + "".join(f"{sum(m.values()) * 1e3:9.1f}" for m in per_rank))
    if faulted is not None:
        rows.append(f"  {'MiB page-faulted per step':<27}{'-':>10}" + "".join(f"{b / 2**20:9.1f}" for b in faulted))
    return "\n".join(rows)
