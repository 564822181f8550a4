"""`autopar.scaling()` (autopar/api.py): plan one model for 1, 2, 4, ... devices and say where adding devices stops paying.

Strong scaling: the global batch of `example_inputs` stays fixed and is split among N devices. For
each N the planner picks its best plan (no hand-written baselines, for speed); the table shows its
predicted step time, throughput (samples/s), memory per device and scaling efficiency

    efficiency(N) = T_compute(1) / (N · T_step(N))

where T_compute(1) is the one-device compute time (no communication), so 100% means perfect
division of the work. A count *pays* when a plan fits, its efficiency is at least `threshold` and
its throughput beats every smaller count's. `stop_at` is the largest count that pays, so no larger
count that pays has better throughput (a count where no plan fits is reported as such, and counts
past it are still considered); `stopped_by` is the next count, and `reason` says why it does not
pay: the lost time is mostly collectives ("communication"), pipeline bubbles ("bubble"), no plan
fits the memory budget ("memory"), or work that does not divide ("compute"). Every row also shows
the plan's predicted MFU. The model is captured once and planned per mesh.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

from autopar.capture.canonicalize import canonicalize
from autopar.capture.trace import capture
from autopar.costmodel.hardware import HardwareSpec, get_hardware
from autopar.costmodel.memory import format_bytes, format_seconds, parse_bytes
from autopar.errors import InfeasiblePlanError, InputError
from autopar.mesh import Mesh
from autopar.plan import Plan
from autopar.planning.spmd import plan_captured

CAUSES = ("communication", "bubble", "memory", "compute")


@dataclass(frozen=True)
class ScalingRow:
    """One device count: its mesh and plan figures (None where no plan fits the memory budget)."""

    devices: int
    mesh_shape: tuple[int, ...]
    predicted_step_time: float | None
    throughput: float | None          # samples per second
    memory_per_device: float | None   # bytes; for an infeasible row, the least any plan needs
    efficiency: float | None
    plan: Plan | None

    @property
    def feasible(self) -> bool:
        return self.plan is not None

    @property
    def mfu(self) -> float | None:
        """The plan's predicted model FLOPs utilisation (`Plan.predicted_mfu`)."""
        return self.plan.predicted_mfu if self.plan is not None else None


@dataclass(frozen=True)
class ScalingReport:
    """The table of `scaling()` and its verdict: `stop_at`, `reason`, `cause`."""

    rows: tuple[ScalingRow, ...]
    hardware: str
    batch: int
    threshold: float
    stop_at: int | None      # last device count that pays; None if none is feasible
    stopped_by: int | None   # first device count that does not pay; None if all pay
    cause: str | None        # one of CAUSES, None if all pay
    reason: str

    def __str__(self) -> str:
        head = (f"{'devices':>7} {'mesh':>8} {'step time':>10} {'samples/s':>10} {'memory/dev':>11} "
                f"{'efficiency':>10}  comm share  {'MFU':>5}")
        lines = [f"scaling on {self.hardware}, global batch {self.batch}, threshold {self.threshold:.0%}",
                 head, "-" * len(head)]
        for r in self.rows:
            mesh = "x".join(map(str, r.mesh_shape))
            if not r.feasible:
                need = format_bytes(r.memory_per_device) if r.memory_per_device else "?"
                lines.append(f"{r.devices:>7} {mesh:>8} {'no plan fits the budget (needs ' + need + ')':>53}")
                continue
            share = r.plan.predicted_comm_time / r.predicted_step_time if r.predicted_step_time else 0.0
            mark = "  <- stop" if r.devices == self.stopped_by else ""
            lines.append(f"{r.devices:>7} {mesh:>8} {format_seconds(r.predicted_step_time):>10} "
                         f"{r.throughput:>10.4g} {format_bytes(r.memory_per_device):>11} "
                         f"{r.efficiency:>10.1%}  {share:>9.0%}  {_percent(r.mfu):>5}{mark}")
        lines.append(self.reason)
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike) -> None:
        """Save throughput and efficiency against device count as a PNG (needs matplotlib)."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("ScalingReport.plot needs matplotlib: pip install 'autopar[plot]' "
                              "(or pip install matplotlib)") from e
        rows = [r for r in self.rows if r.feasible]
        xs = [r.devices for r in rows]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        ax1.plot(xs, [r.throughput for r in rows], "o-", label="predicted")
        if rows:   # ideal: N devices doing one device's compute-only work N times over (efficiency's reference)
            per_device = rows[0].throughput / (rows[0].efficiency * rows[0].devices)
            ax1.plot(xs, [per_device * x for x in xs], "--", color="gray", label="ideal")
        ax1.set(xscale="log", yscale="log", xlabel="devices", ylabel="samples / s", title="throughput")
        ax2.plot(xs, [100 * r.efficiency for r in rows], "o-")
        ax2.axhline(100 * self.threshold, color="red", linestyle=":", label=f"threshold {self.threshold:.0%}")
        ax2.set(xscale="log", ylim=(0, 105), xlabel="devices", ylabel="efficiency %",
                title=f"scaling efficiency ({self.hardware})")
        for ax in (ax1, ax2):
            if self.stopped_by is not None:
                ax.axvline(self.stopped_by, color="orange", alpha=0.6, label=f"stop: {self.cause}")
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def _percent(x: float | None) -> str:
    return "?" if x is None else f"{x:.0%}"


def default_mesh_shape(devices: int, hw: HardwareSpec, devices_per_node: int | None = None) -> tuple[int, ...]:
    """1-D within a node; (nodes, devices_per_node) across nodes, so each axis has one link kind."""
    dpn = devices_per_node or hw.devices_per_node
    if dpn is None or devices <= dpn or devices % dpn:
        return (devices,)
    return (devices // dpn, dpn)


def plan_scaling(model, example_inputs, *, devices: Sequence[int] = (1, 2, 4, 8), hardware="cpu",
            memory_budget=None, threshold: float = 0.5, devices_per_node: int | None = None,
            optimizer: str = "adamw", loss_fn=None, time_limit: float | None = None,
            planner=None) -> ScalingReport:
    """Plan `model` on each device count and find where scaling stops paying (see the module doc).
    `planner(captured, mesh, budget) -> Plan` plans one count (autopar.scaling passes the layout
    search, `autopar.pipeline.auto`); default: the SPMD planner on the count's mesh."""
    counts = _check_devices(devices)
    if not 0 < threshold <= 1:
        raise InputError(f"threshold must be in (0, 1], got {threshold!r}")
    hw = get_hardware(hardware)
    budget = parse_bytes(memory_budget) if memory_budget is not None else None
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    captured = capture(model, inputs, loss_fn=loss_fn)
    canonicalize(captured.gm)

    def plan_on(n: int, budget_bytes):
        mesh = Mesh(default_mesh_shape(n, hw, devices_per_node), hardware=hw,
                    devices_per_node=devices_per_node)
        if planner is not None:
            return planner(captured, mesh, budget_bytes)
        return plan_captured(captured, model, inputs, mesh=mesh, memory_budget=budget_bytes,
                             optimizer=optimizer, time_limit=time_limit, baselines=False)

    reference = plan_on(1, None).predicted_compute_time   # one device, no budget: the work itself
    batch = _batch_size(inputs)
    rows = tuple(_row(n, plan_on, budget, reference, batch, hw, devices_per_node) for n in counts)
    return _verdict(rows, hw.name, batch, threshold)


def _check_devices(devices) -> list[int]:
    counts = list(devices) if isinstance(devices, (list, tuple, range)) else None
    if not counts or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in counts):
        raise InputError(f"devices must be a non-empty list of positive ints, e.g. [1, 2, 4, 8]; got {devices!r}")
    return sorted(set(counts))


def _batch_size(inputs: tuple) -> int:
    first = next((t for t in inputs if hasattr(t, "shape") and len(t.shape) > 0), None)
    return int(first.shape[0]) if first is not None else 1


def _row(n, plan_on, budget, reference, batch, hw, dpn) -> ScalingRow:
    shape = default_mesh_shape(n, hw, dpn)
    try:
        p = plan_on(n, budget)
    except InfeasiblePlanError as e:
        return ScalingRow(n, shape, None, None, e.min_memory_per_device, None, None)
    if not p.feasible:
        return ScalingRow(n, shape, None, None, p.memory_per_device, None, None)
    step = p.predicted_step_time
    return ScalingRow(n, shape, step, batch / step, p.memory_per_device, reference / (n * step), p)


def _verdict(rows: tuple[ScalingRow, ...], hw_name: str, batch: int, threshold: float) -> ScalingReport:
    """`stop_at`: the largest count that pays (feasible, efficiency >= threshold, more samples/s than
    every smaller feasible count), so no larger count that pays has better throughput; a count where
    no plan fits is reported as such and does not end the scan. `stopped_by`: the first feasible
    count after `stop_at` (it does not pay), or, if none, the first larger count where nothing fits."""
    best, last_good = 0.0, None
    for r in rows:
        if r.feasible and r.efficiency >= threshold and r.throughput > best:
            last_good = r
        if r.feasible:
            best = max(best, r.throughput)
    if last_good is None:
        if not any(r.feasible for r in rows):
            return ScalingReport(rows, hw_name, batch, threshold, None, None, "memory",
                                 "no device count in the range has a plan that fits the memory budget")
        first = next(r for r in rows if r.feasible)
        return ScalingReport(rows, hw_name, batch, threshold, None, first.devices, _cause(first),
                             f"no device count pays: on {first.devices} efficiency is {first.efficiency:.0%} "
                             f"(< {threshold:.0%}); cause: {_cause(first)}{_detail(first)}")
    later = [r for r in rows if r.devices > last_good.devices]
    r = next((r for r in later if r.feasible), None) or next(iter(later), None)
    if r is None:
        return ScalingReport(rows, hw_name, batch, threshold, last_good.devices, None, None,
                             f"scaling pays up to {last_good.devices} devices, the end of the range "
                             f"(efficiency {last_good.efficiency:.0%})")
    if not r.feasible:
        cause, why = "memory", f"no plan fits the memory budget on {r.devices} devices"
    elif r.efficiency < threshold:
        cause, why = _cause(r), f"efficiency falls to {r.efficiency:.0%} (< {threshold:.0%})"
    else:
        cause, why = _cause(r), (f"throughput stops rising ({r.throughput:.4g} samples/s vs "
                                 f"{last_good.throughput:.4g} on {last_good.devices})")
    skipped = [q.devices for q in rows if not q.feasible and q.devices < last_good.devices]
    note = f"; no plan fits on {', '.join(map(str, skipped))}" if skipped and r.feasible else ""
    reason = (f"stop at {last_good.devices} devices: on {r.devices} {why}; cause: {cause}"
              f"{_detail(r) if r.feasible else ''}{note}")
    return ScalingReport(rows, hw_name, batch, threshold, last_good.devices, r.devices, cause, reason)


def _cause(r: ScalingRow) -> str:
    """What the lost time (step minus the ideal share) is made of."""
    p = r.plan
    ideal = r.predicted_step_time * r.efficiency
    undivided = max(0.0, p.predicted_compute_time - ideal)
    bubble = 0.0
    if len(getattr(p, "stages", ())) > 1:   # the schedule's idle time: the step less every device's work
        bubble = p.predicted_step_time - p.predicted_compute_time - p.predicted_comm_time - \
            p.mesh.hardware.runtime_overhead
    if bubble > max(p.predicted_comm_time, undivided):
        return "bubble"
    return "communication" if p.predicted_comm_time >= undivided else "compute"


def _detail(r: ScalingRow) -> str:
    p = r.plan
    top = {}
    for c in p.collectives:
        top[(c.kind, c.axis)] = top.get((c.kind, c.axis), 0.0) + c.predicted_time
    if not top:
        return ""
    (kind, axis), seconds = max(top.items(), key=lambda kv: kv[1])
    share = p.predicted_comm_time / r.predicted_step_time
    return (f" (collectives are {share:.0%} of the step; largest: {kind} on axis {axis}, "
            f"{format_seconds(seconds)} per step)")


def parse_devices(text: str) -> list[int]:
    """ "1,2,4,8" -> [1, 2, 4, 8]; "1-64" -> powers of two from 1 to 64."""
    if "-" in text:
        lo, _, hi = text.partition("-")
        if lo.isdigit() and hi.isdigit() and 0 < int(lo) <= int(hi):
            return [2 ** k for k in range(int(math.log2(int(lo))), int(math.log2(int(hi))) + 1)]
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise InputError(f"bad device list {text!r}: use e.g. 1,2,4,8 or 1-64")
    return [int(p) for p in parts]
