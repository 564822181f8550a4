"""`autopar.diff(a, b)`: what changed between two plans of the same model.

Placements are compared per module path (the rows of the summary: the weight's master spec and mode
per mesh axis, the main forward op's output spec) and folded per top-level unit like the summary:
consecutive blocks with the same changes print once (`transformer.h.{0..11} ×12`).
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.costmodel.memory import format_bytes, format_seconds
from autopar.inspection.summary import TOP_LEVEL, Row, build_rows, split_unit


@dataclass(frozen=True)
class Change:
    group: str        # folded unit label, e.g. "transformer.h.{0..3} ×4"
    module: str       # path inside the unit ("" for the unit itself)
    what: str         # "weight", "activation" or "comm"
    before: str
    after: str


@dataclass(frozen=True)
class PlanDiff:
    """The differences between plan `a` and plan `b` (read "a -> b")."""
    same_model: bool
    models: tuple                 # (a's "name, N parameters", b's)
    settings: tuple               # (field, a's value, b's value) for mesh, strategy, budget, ... that differ
    totals: tuple                 # (name, a, b, "time" | "bytes") for step time, comm time, memory
    changes: tuple                # Change, in model order

    @property
    def identical(self) -> bool:
        return not self.settings and not self.changes and all(a == b for _, a, b, _ in self.totals)

    def __str__(self) -> str:
        lines = ["plan diff (a -> b)"]
        if not self.same_model:
            lines.append(f"  different models: {self.models[0]} vs {self.models[1]}; only totals are compared")
        for name, a, b in self.settings:
            lines.append(f"  {name:<10}{a} -> {b}")
        for name, a, b, unit in self.totals:
            fmt = format_seconds if unit == "time" else format_bytes
            rel = f" ({(b - a) / a:+.1%})" if a else ""
            lines.append(f"  {name:<10}{fmt(a)} -> {fmt(b)}{rel}")
        if not self.same_model:
            return "\n".join(lines)
        if not self.changes:
            lines.append("no placement changed")
            return "\n".join(lines)
        lines.append("changed placements:")
        width = max(len(c.module) for c in self.changes) + 2
        group = None
        for c in self.changes:
            if c.group != group:
                group = c.group
                lines.append(f"  {group}")
            lines.append(f"    {c.module or '(itself)':<{width}}{c.what:<11}{c.before or '-'} -> {c.after or '-'}")
        return "\n".join(lines)


def diff(plan_a, plan_b) -> PlanDiff:
    """Compare two plans: settings (mesh, strategy, budget), totals, and per-module placements."""
    same = _model_key(plan_a) == _model_key(plan_b)
    settings = []
    for name, get in (("mesh", lambda p: str(p.mesh)), ("strategy", lambda p: str(p.strategy)),
                      ("recipes", lambda p: "/".join(p.recipes)),
                      ("budget", lambda p: format_bytes(p.memory_budget) if p.memory_budget is not None else "none"),
                      ("feasible", lambda p: "yes" if p.feasible else f"no ({p.infeasible_reason})")):
        if get(plan_a) != get(plan_b):
            settings.append((name, get(plan_a), get(plan_b)))
    totals = (("step time", plan_a.predicted_step_time, plan_b.predicted_step_time, "time"),
              ("comm time", plan_a.predicted_comm_time, plan_b.predicted_comm_time, "time"),
              ("memory", plan_a.memory_per_device, plan_b.memory_per_device, "bytes"))
    changes = _placement_changes(plan_a, plan_b) if same else ()
    return PlanDiff(same, (_model_text(plan_a), _model_text(plan_b)), tuple(settings), totals, tuple(changes))


def _model_key(plan) -> tuple:
    return plan.model.get("name"), plan.model.get("parameters"), tuple(sorted(plan.params))


def _model_text(plan) -> str:
    return f"{plan.model.get('name', '?')} ({plan.model.get('parameters', 0):,} parameters)"


def _row_changes(a: Row | None, b: Row | None) -> list[tuple[str, str, str, str]]:
    """(module, what, before, after) for one module path."""
    rel = (a or b).rel
    weights = lambda r: " | ".join(r.weights) if r and any(r.weights) else ""  # noqa: E731
    comm = lambda r: " · ".join(c for c in r.comm if c) if r else ""  # noqa: E731
    out = []
    for what, get in (("weight", weights), ("activation", lambda r: r.activation if r else ""), ("comm", comm)):
        if get(a) != get(b):
            out.append((rel, what, get(a), get(b)))
    return out


def _placement_changes(plan_a, plan_b) -> list[Change]:
    rows_a = {r.path: r for r in build_rows(plan_a)}
    rows_b = {r.path: r for r in build_rows(plan_b)}
    paths = list(rows_a) + [p for p in rows_b if p not in rows_a]
    units: dict[str, list] = {}
    for path in paths:
        unit = split_unit(path)[0] if path else TOP_LEVEL
        units.setdefault(unit, []).extend(_row_changes(rows_a.get(path), rows_b.get(path)))
    folded: list[tuple[list[str], list]] = []   # ([unit paths], changes)
    for unit, changes in units.items():
        if not changes:
            continue
        prev = folded[-1] if folded else None
        if prev and _template(prev[0][-1]) == _template(unit) != unit and prev[1] == changes \
                and _consecutive(prev[0][-1], unit):
            prev[0].append(unit)
        else:
            folded.append(([unit], changes))
    return [Change(_label(us), *c) for us, changes in folded for c in changes]


def _template(unit: str) -> str:
    head, _, last = unit.rpartition(".")
    return f"{head}.{{}}" if last.isdigit() else unit


def _consecutive(a: str, b: str) -> bool:
    return int(b.rpartition(".")[2]) == int(a.rpartition(".")[2]) + 1


def _label(units: list[str]) -> str:
    if len(units) == 1:
        return units[0]
    head = units[0].rpartition(".")[0]
    return f"{head}.{{{units[0].rpartition('.')[2]}..{units[-1].rpartition('.')[2]}}} ×{len(units)}"
