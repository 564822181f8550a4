"""Plan inspection: the one-screen summary (`str(plan)`) and `plan.explain(name)`.

The summary groups the plan by module path in model order (embedding, each block, head, loss) and
folds identical repeated blocks into one row (`transformer.h.{0..11} ×12`): two blocks are identical
when every cell of their rows matches once the layer index is removed. A folded row shows ONE block's
figures. Model order is the order of the parameter placeholders (`arg0_1`, `arg1_1`, ... in
`plan.nodes`), which follows parameter registration; it survives the JSON round trip, whose dicts
are sorted by name.

Weight cells show the spec the optimizer steps on (`master`) and the mode per mesh axis. A "shard"
mode is named by how the forward pass consumes the parameter: "tp" when some forward op computes on
its shard on that axis (tensor parallelism), "zero3" when every forward op reads it gathered whole
(`ParamPlacement.read_sharded`; ZeRO-3 / FSDP).
"""
from __future__ import annotations

import dataclasses
import difflib
import heapq
import io
import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass

from autopar.costmodel.hardware import PRESETS
from autopar.costmodel.memory import format_bytes, format_seconds
from autopar.errors import AutoparError

KIND_ABBR = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A", "send_recv": "P2P"}
PHASES = ("forward", "backward", "optimizer")
PHASE_ABBR = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}
MAIN_OPS = ("mm", "bmm", "addmm", "embedding", "native_layer_norm", "_log_softmax", "_scaled_dot_product")
TOP_LEVEL = "(top level, loss)"
MAX_CANDIDATES = 12


class UnknownNameError(AutoparError, KeyError):
    """`explain` was given a name that is no parameter, module path or graph node of the plan."""

    def __str__(self) -> str:
        return str(self.args[0])


# ---------------------------------------------------------------------------------------- the rows
@dataclass(frozen=True)
class Row:
    """One module path: per-axis weight placement, activation placement, collectives per phase."""
    path: str
    rel: str              # path inside its group ("" for the group itself)
    weights: tuple        # per mesh axis, e.g. "S0 (tp)"; "" without parameters
    activation: str       # output spec of the module's main forward op, e.g. "S0" or "S0,R"
    comm: tuple           # per phase in PHASES: "2AG 65.5 kB 3.10 µs" or ""
    stage: str

    def cells(self) -> tuple:
        return (self.rel, *self.weights, self.activation, *self.comm, self.stage)


@dataclass(frozen=True)
class Group:
    """A top-level unit (a module, or one repeated block) or a run of identical blocks."""
    label: str
    paths: tuple          # unit paths folded into this group
    rows: tuple

    @property
    def count(self) -> int:
        return len(self.paths)


def mode_label(param, axis: int) -> str:
    """dp | zero1 | zero2 | tp | zero3 (see the module docstring for "shard")."""
    mode = param.modes[axis]
    if mode == "shard":
        sharded = param.read_sharded[axis] if param.read_sharded else param.use[axis].startswith("S")
        return "tp" if sharded else "zero3"
    return mode


def param_module(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def split_unit(path: str) -> tuple[str, str]:
    """("transformer.h.3", "attn.c_attn") for "transformer.h.3.attn.c_attn"; (path, "") if not repeated."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1]), ".".join(parts[i + 1:])
    return path, ""


def spec_text(spec) -> str:
    return "" if spec is None else ",".join(spec)


def is_main_op(node_name: str) -> bool:
    base = re.sub(r"(_default)?(_\d+)?$", "", node_name)
    return base in MAIN_OPS or base.startswith("_scaled_dot_product")


def _order_keys(plan) -> dict[str, int]:
    """Module path -> index of its first parameter placeholder (registration order)."""
    modules = {param_module(f) for f in plan.params}
    keys: dict[str, int] = {}
    for name, node in plan.nodes.items():
        if node.phase == "input" and node.module in modules:
            digits = re.findall(r"\d+", name)
            index = int(digits[0]) if digits else len(keys)
            parts = node.module.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                keys[prefix] = min(keys.get(prefix, index), index)
    return keys


def _sort_key(path: str, keys: dict[str, int]) -> tuple:
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in keys:
            return (keys[prefix], len(parts), path)
    return (1 << 29, len(parts), path)


def model_order(plan) -> dict[str, int]:
    """Module path -> position in forward order; the top level ("") last.

    A plan fresh from the planner keeps `nodes` in graph order. A loaded plan's nodes come back
    sorted by name (the JSON has sorted keys); then node names, which number each op kind in graph
    order (`mm_default`, `mm_default_1`, ...), give one chain of modules per op kind, and a
    topological sort of the chains, ties broken by parameter registration order, approximates the
    forward order (modules no chain relates keep registration order).
    """
    keys = _order_keys(plan)
    if list(plan.nodes) != sorted(plan.nodes):   # graph order is still there (a plan not yet saved)
        order = {}
        for node in plan.nodes.values():
            if node.phase == "forward" and node.module:
                order.setdefault(node.module, len(order))
        for m in sorted({param_module(f) for f in plan.params} - set(order) - {""}, key=lambda m: _sort_key(m, keys)):
            order[m] = len(order)
        order[""] = len(order)
        return order
    chains: dict[str, list] = defaultdict(list)
    for name, node in plan.nodes.items():
        if node.phase == "forward" and node.module:
            base, _, index = re.fullmatch(r"(.*?)(_(\d+))?", name).groups()
            chains[base].append((int(index or 0), node.module))
    succ: dict[str, set] = defaultdict(set)
    indeg: Counter = Counter()
    modules = {m for chain in chains.values() for _, m in chain} | {param_module(f) for f in plan.params} - {""}
    for chain in chains.values():
        chain.sort()
        for (_, a), (_, b) in zip(chain, chain[1:]):
            if a != b and b not in succ[a]:
                succ[a].add(b)
                indeg[b] += 1
    ready = [(_sort_key(m, keys), m) for m in modules if indeg[m] == 0]
    heapq.heapify(ready)
    order: dict[str, int] = {}
    while ready:
        _, m = heapq.heappop(ready)
        order[m] = len(order)
        for b in succ[m]:
            indeg[b] -= 1
            if indeg[b] == 0:
                heapq.heappush(ready, (_sort_key(b, keys), b))
    for m in sorted(modules - set(order), key=lambda m: _sort_key(m, keys)):
        order[m] = len(order)
    order[""] = len(order)
    return order


def _comm_cells(records) -> tuple:
    cells = []
    for phase in PHASES:
        rs = [c for c in records if c.phase == phase]
        if not rs:
            cells.append("")
            continue
        kinds = Counter(KIND_ABBR.get(c.kind, c.kind) for c in rs)
        text = "+".join(f"{n}{k}" for k, n in sorted(kinds.items()))
        nbytes, seconds = format_bytes(sum(c.bytes for c in rs)), format_seconds(sum(c.predicted_time for c in rs))
        cells.append(f"{text} {nbytes.replace(' ', '')} {seconds.replace(' ', '')}")
    return tuple(cells)


def _stage_of(plan, path: str) -> str:
    for stage in plan.stages:
        if any(path == m or path.startswith(m + ".") or m == "" for m in stage.modules):
            return str(stage.index)
    return ""


def _activation(nodes: list) -> str:
    main = [n for n in nodes if is_main_op(n[0])] or nodes
    return spec_text(main[-1][1].outs[0]) if main and main[-1][1].outs else ""


def build_rows(plan) -> list[Row]:
    """One Row per module path that owns a parameter, a main forward op or a collective, in model order."""
    params: dict[str, list] = defaultdict(list)
    for p in plan.params.values():
        params[param_module(p.name)].append(p)
    tied = {param_module(a): param_module(owner) for owner, aliases in plan.model.get("tied", {}).items()
            for a in aliases}
    fwd: dict[str, list] = defaultdict(list)
    for name, node in plan.nodes.items():
        if node.phase == "forward":
            fwd[node.module].append((name, node))
    comm: dict[str, list] = defaultdict(list)
    for c in plan.collectives:
        comm[c.module].append(c)
    order = model_order(plan)
    paths = set(params) | {m for m, ns in fwd.items() if any(is_main_op(n) for n, _ in ns)} | set(comm) | set(tied)
    rows = []
    for path in sorted(paths, key=lambda p: (order.get(p, len(order) - 1), p)):
        if path in params:
            main = max(params[path], key=lambda p: math.prod(p.shape))
            weights = tuple(f"{main.master[a]} ({mode_label(main, a)})" for a in range(plan.mesh.ndim))
        else:
            weights = ("tied",) * plan.mesh.ndim if path in tied else ("",) * plan.mesh.ndim
        rel = split_unit(path)[1] if path else ""
        rows.append(Row(path, rel, weights, _activation(sorted(fwd.get(path, []), key=lambda n: _node_index(n[0]))),
                        _comm_cells(comm.get(path, ())), _stage_of(plan, path)))
    return rows


def _node_index(name: str) -> tuple:
    digits = re.findall(r"\d+$", name)
    return (int(digits[0]) if digits else -1, name)


def build_groups(plan) -> list[Group]:
    """Rows grouped by top-level unit, consecutive identical repeated blocks folded."""
    units: dict[str, list[Row]] = {}
    for row in build_rows(plan):
        unit = split_unit(row.path)[0] if row.path else TOP_LEVEL
        units.setdefault(unit, []).append(row)
    groups: list[Group] = []
    for unit, rows in units.items():
        prev = groups[-1] if groups else None
        if prev and _template(prev.paths[-1]) == _template(unit) and _template(unit) != unit \
                and [r.cells()[:-1] for r in prev.rows] == [r.cells()[:-1] for r in rows]:
            # identical but for the stage: one group, its stage column the stages' span ("1-6")
            merged = tuple(dataclasses.replace(a, stage=_stage_span(a.stage, b.stage)) for a, b in zip(prev.rows, rows))
            groups[-1] = Group(_fold_label(prev.paths + (unit,)), prev.paths + (unit,), merged)
        else:
            groups.append(Group(unit, (unit,), tuple(rows)))
    return groups


def _stage_span(span: str, stage: str) -> str:
    """The stage column of a folded group: "3" and "3" stay "3"; "1" then "2" is "1-2" ("" for no stage)."""
    if not span or span == stage:
        return span or stage
    first = span.split("-")[0]
    return f"{first}-{stage}"


def _template(unit: str) -> str:
    return re.sub(r"\.\d+$", ".{}", unit)


def _fold_label(paths: tuple) -> str:
    first, last = paths[0].rsplit(".", 1)[1], paths[-1].rsplit(".", 1)[1]
    return f"{_template(paths[0]).replace('{}', '')}{{{first}..{last}}} ×{len(paths)}"


# ------------------------------------------------------------------------------------ the summary
def table_columns(plan) -> tuple[list[str], list[int]]:
    """Header and, per Row.cells() position, whether that column is shown (phases with collectives)."""
    phases = [p for p in PHASES if any(c.phase == p for c in plan.collectives)]
    header = ["module"] + [f"weight {a}" for a in plan.mesh.axis_names] + ["activation"]
    header += [f"{PHASE_ABBR[p]} comm" for p in phases] + (["stage"] if plan.stages else [])
    n = plan.mesh.ndim
    keep = list(range(n + 2)) + [n + 2 + PHASES.index(p) for p in phases]
    keep += [n + 2 + len(PHASES)] if plan.stages else []
    return header, keep


def table_rows(plan, groups: list[Group]) -> list[tuple[list[str], bool]]:
    """(cells, is_group_heading) lines of the module table."""
    _, keep = table_columns(plan)
    out = []
    for g in groups:
        own = [r for r in g.rows if r.rel == ""]
        if len(g.rows) == 1 and own:
            out.append(([g.label] + [own[0].cells()[i] for i in keep[1:]], True))
            continue
        heading = [g.label] + ([own[0].cells()[i] for i in keep[1:]] if own else [""] * (len(keep) - 1))
        out.append((heading, True))
        out += [(["  " + r.rel] + [r.cells()[i] for i in keep[1:]], False) for r in g.rows if r.rel]
    return out


def _recipe_mix(plan, axis: int) -> str:
    weight = Counter()
    for p in plan.params.values():
        weight[mode_label(p, axis)] += math.prod(p.shape)
    total = sum(weight.values()) or 1
    return ", ".join(f"{100 * n / total:.0f}% {m}" for m, n in weight.most_common(3))


_NORM_MODULE = re.compile(r"(norm|^ln)", re.I)   # a module leaf naming a layer norm / RMSNorm
_LAYER = re.compile(r"^(.*?\.\d+)(\.|$)")          # "model.layers.3" of "model.layers.3.input_layernorm"


def sequence_parallel_line(plan) -> str | None:
    """Where the sequence is split (Korthikanti et al. 2022): per mesh axis, how many norms inside
    numbered layers run on a sequence shard, i.e. every forward op of the norm module holds Shard(d)
    with d past the batch dim on that axis; None when none does (the line is then left out)."""
    norms: dict[str, list] = defaultdict(list)  # norm module -> output specs of its forward ops
    for c in plan.nodes.values():
        if c.phase == "forward" and _LAYER.match(c.module) and _NORM_MODULE.search(c.module.rsplit(".", 1)[-1]) \
                and c.outs and c.outs[0]:
            norms[c.module].append(c.outs[0])
    parts = []
    for a, ax in enumerate(plan.mesh.axis_names):
        split = [m for m, specs in norms.items() if all(re.fullmatch(r"S[1-9]\d*", spec[a]) for spec in specs)]
        if split:
            layers = {_LAYER.match(m).group(1) for m in split}
            parts.append(f"{len(split)} of {len(norms)} norms in {len(layers)} layers split on the sequence over "
                         f"axis {ax}")
    return "sequence  " + "; ".join(parts) + " (sequence parallelism)" if parts else None


def _flops(x: float) -> str:
    """1.23 PFLOP, 456 TFLOP, ... (three significant digits)."""
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} FLOP"


def header_lines(plan) -> list[str]:
    m = plan.model
    lines = [f"autopar plan — {m.get('name', '?')}, {m.get('parameters', 0):,} parameters, inputs "
             + " ".join(str(list(s)) for s in m.get("inputs", []))]
    lines.append(f"mesh      {plan.mesh}")
    recipes = "; ".join(f"{ax}: {r} (weights {_recipe_mix(plan, i)})"
                        for i, (ax, r) in enumerate(zip(plan.mesh.axis_names, plan.recipes)))
    lines.append(f"strategy  {plan.strategy!s} -> {recipes}")
    if plan.mixed_precision:  # fp32 plans print as before
        mp = plan.mixed_precision
        lines.append(f"precision {mp['param_dtype']} compute (autocast), fp32 master weights and optimizer state, "
                     f"{mp['reduce_dtype']} gradient reduction")
    sequence = sequence_parallel_line(plan)
    if sequence:  # plans without sequence parallelism print as before
        lines.append(sequence)
    for owner, aliases in m.get("tied", {}).items():
        lines.append(f"tied      {', '.join(aliases)} = {owner}")
    lines.append("feasible  yes" if plan.feasible else f"INFEASIBLE  {plan.infeasible_reason}")
    return lines


def totals_lines(plan) -> list[str]:
    overhead = plan.mesh.hardware.runtime_overhead   # measured per step on this machine (calibration)
    bubble = max(0.0, plan.predicted_step_time - plan.predicted_compute_time - plan.predicted_comm_time - overhead) \
        if plan.stages else 0.0
    bubble = bubble if bubble > 1e-9 * plan.predicted_step_time else 0.0   # float rounding of a bubble-free step
    mem = plan.memory_breakdown
    budget = "no budget" if plan.memory_budget is None else \
        f"budget {format_bytes(plan.memory_budget)} ({100 * plan.memory_per_device / plan.memory_budget:.0f}% used)"
    s = plan.solver
    sizes = ", ".join(f"{s[k]:,} {k}" for k in ("nodes", "edges") if k in s)
    if s.get("shallow_nodes"):   # the search priced a copy traced a few layers deep; its choice maps onto every layer
        sizes += f"; searched on the {s['shallow_nodes']:,} nodes of {s.get('shallow_layers', '?')} traced layers"
    lines = [
        f"step time {format_seconds(plan.predicted_step_time)} = compute {format_seconds(plan.predicted_compute_time)}"
        f" + communication {format_seconds(plan.predicted_comm_time)} + bubble {format_seconds(bubble)}"
        + (f" + runtime {format_seconds(overhead)}" if overhead else "") + f"; {program_priced(plan)} program",
        f"memory    {format_bytes(plan.memory_per_device)} per device = "
        + " + ".join(f"{k} {format_bytes(mem.get(k, 0.0))}" for k in ("params", "grads", "optimizer", "activations"))
        + f"; {budget}",
        f"solver    {s.get('backend', '?')} {s.get('status', '?')}, "
        + (f"gap {plan.gap:.2%}, " if math.isfinite(plan.gap) else "gap unknown (no bound yet), ")
        + format_seconds(s.get("seconds", 0.0)) + (f" ({sizes})" if sizes else ""),
        "planning  " + " · ".join(f"{k} {format_seconds(v)}" for k, v in _timings(plan.timings)),
    ]
    mfu = plan.predicted_mfu
    if mfu is not None:
        dtype = plan.mixed_precision["param_dtype"] if plan.mixed_precision else "float32"
        peak = _flops(plan.mesh.hardware.flops(dtype))
        lines.insert(1, f"mfu       {mfu:.1%} = {_flops(plan.model['flops'])} per step / ({peak}/s {dtype} peak × "
                        f"{plan.mesh.size} devices × {format_seconds(plan.predicted_step_time)})")
    if plan.recompute:  # after the memory line: the activations it frees are in that line
        lines.insert(2, f"recompute {len(plan.recompute)} layers re-run their forward in backward: "
                        + _compact_paths(plan.recompute))
    if plan.stages:
        lines[1:1] = stage_lines(plan)
    lines[1:1] = uncalibrated_note(plan)  # right under the step time it qualifies
    return lines


def program_priced(plan) -> str:
    """Which per-rank program the plan's times price: "compiled" (by Inductor) for a plan made with compile=True
    (fused kernels, `autopar/planning/fusion.py`), else "eager" (one dispatched ATen call per op)."""
    return "compiled" if plan.mesh.hardware.compiled else "eager"


def uncalibrated_note(plan) -> list[str]:
    """For a plan priced on the `cpu` preset: its figures were measured once on another machine (a
    plan for this one can be off by 2x), and how to price this machine instead. Nothing otherwise
    (a calibrated profile, or a GPU preset: datasheet figures for the device it names)."""
    if plan.mesh.hardware.for_program(False) != PRESETS["cpu"]:
        return []
    return ["          (uncalibrated: the `cpu` preset's figures, from another machine; to price this one, run",
            f"          torchrun --nproc_per_node {plan.mesh.size} -m autopar calibrate --out hw.json; "
            "Mesh(hardware=\"hw.json\"))"]


def stage_lines(plan) -> list[str]:
    """The pipeline: schedule, micro-batches, predicted bubble, then per stage (device group) its units,
    ranks, time per micro-batch (forward + backward) and memory per device. Interleaved plans list one
    StagePlan per chunk; a device's line names its chunks and sums their time and memory."""
    devices: dict[tuple, list] = {}
    for st in plan.stages:
        devices.setdefault(tuple(st.ranks), []).append(st)
    p, m, v = len(devices), plan.num_microbatches, len(plan.stages) // len(devices)
    bubble = plan.solver.get("bubble_fraction", (p - 1) / (v * m + p - 1))
    chunks = f" x {v} chunks per device" if v > 1 else ""
    if p == 1:   # one stage: gradient accumulation, no pipeline
        st = plan.stages[0]
        return [f"pipeline  none: gradient accumulation over {m} micro-batches, one optimizer step; "
                f"{format_seconds(st.predicted_time)}/micro-batch  {format_bytes(st.memory)}"]
    lines = [f"pipeline  {p} stages{chunks}, {m} micro-batches, schedule {plan.schedule}, "
             f"predicted bubble {100 * bubble:.0f}% of the step"]
    for d, (ranks, held) in enumerate(devices.items()):
        span = f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
        units = " · ".join((f"chunk {st.index} " if v > 1 else "") + _stage_units(st.modules) for st in held)
        lines.append(f"  stage {d}  ranks {span}  {units}  "
                     f"{format_seconds(sum(st.predicted_time for st in held))}/micro-batch  "
                     f"{format_bytes(sum(st.memory for st in held))}")
    return lines


def _stage_units(modules) -> str:
    blocks = [u for u in modules if not u.startswith("<")]
    return ", ".join([u for u in modules if u == "<pre>"] + ([_compact_paths(blocks)] if blocks else [])
                     + [u for u in modules if u == "<post>"])


def _compact_paths(paths) -> str:
    """("transformer.h.0", "transformer.h.1", "transformer.h.3") -> "transformer.h.{0,1,3}"."""
    by: dict[str, list[str]] = {}
    for p in paths:
        container, _, index = p.rpartition(".")
        by.setdefault(container, []).append(index)
    return ", ".join(f"{c}.{{{','.join(ix)}}}" if len(ix) > 1 else f"{c}.{ix[0]}" for c, ix in by.items())


def _timings(timings: dict) -> list[tuple[str, float]]:
    """Planning phases in the order they run (a saved plan's dict comes back sorted by name)."""
    order = ("capture", "canonicalize", "strategies+costs", "baselines", "solve")
    rank = {k: i for i, k in enumerate(order)}
    return sorted(timings.items(), key=lambda kv: (kv[0] == "total", rank.get(kv[0], len(order)), kv[0]))


def baseline_rows(plan) -> list[list[str]]:
    rows = []
    ordered = sorted(plan.baselines.items(), key=lambda kv: (not kv[1].get("feasible"), kv[1].get("time") or 0.0))
    for name, b in ordered:
        if b.get("bound") is not None:   # not solved: no plan of it beats the best found (auto.py's deferral)
            rows.append([name, f">= {format_seconds(b['bound'])}", "-", b.get("reason", "")])
            continue
        if not b.get("feasible"):
            rows.append([name, "-", format_bytes(b["memory"]) if b.get("memory") else "-",
                         f"infeasible: {b.get('reason', '')}"])
            continue
        ratio = b["time"] / plan.predicted_step_time if plan.predicted_step_time else float("nan")
        note = f"{ratio:.2f}× this plan's time" + (f"; {b['reason']}" if b.get("reason") else "")
        rows.append([name, format_seconds(b["time"]), format_bytes(b["memory"]), note])
    return rows


def fit(lines: list[str], width: int) -> list[str]:
    """Break lines longer than `width` after their " · " / " + " separators, indenting the rest."""
    out = []
    for line in lines:
        pieces = re.split(r"(?<= [·+=]) ", line)
        current = pieces[0]
        for piece in pieces[1:]:
            if len(current) + 1 + len(piece) > width:
                out.append(current.rstrip())
                current = " " * 10 + piece
            else:
                current += " " + piece
        out.append(current)
    return out


def render_summary(plan, *, rich: bool | None = None, width: int = 100) -> str:
    """The plan on one screen: header, module table (folded blocks), totals, baseline recipes."""
    groups = build_groups(plan)
    header, _ = table_columns(plan)
    lines = table_rows(plan, groups)
    legend = ("weight: master spec (mode) · activation: main forward op's output · comm per block: "
              "count+kind bytes time (AR all-reduce, AG all-gather, RS reduce-scatter)")
    base_header = ["recipe", "step time", "memory", "vs this plan"]
    base = baseline_rows(plan)
    if rich is not False:
        try:
            return _render_rich(plan, header, lines, legend, base_header, base, width)
        except ImportError:
            if rich:
                raise
    out = fit(header_lines(plan), width) + [""] + plain_table(header, [c for c, _ in lines])
    out += fit([legend], width) + [""] + fit(totals_lines(plan), width)
    if base:
        out += ["", "baseline recipes under the same cost model:"] + plain_table(base_header, base)
    return "\n".join(out)


def plain_table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def _render_rich(plan, header, lines, legend, base_header, base, width) -> str:
    import sys

    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(record=True, width=width, file=io.StringIO())
    console.print("\n".join(fit(header_lines(plan), width)), highlight=False, markup=False, soft_wrap=True)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold", padding=(0, 1, 0, 0))
    for name in header:
        table.add_column(name, no_wrap=name == "module")
    for cells, heading in lines:
        table.add_row(*cells, style="bold" if heading else None)
    console.print(table)
    console.print("\n".join(fit([legend], width)), style="dim", highlight=False, markup=False, soft_wrap=True)
    console.print("\n".join(fit(totals_lines(plan), width)), highlight=False, markup=False, soft_wrap=True)
    if base:
        bt = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold",
                   title="baseline recipes under the same cost model", title_justify="left")
        for name in base_header:
            bt.add_column(name)
        for row in base:
            bt.add_row(*row)
        console.print(bt)
    styles = sys.stdout.isatty()
    return console.export_text(styles=styles).rstrip("\n")


# ------------------------------------------------------------------------------------------ explain
def lookup(plan, name: str) -> tuple[str, list[str], list[str]]:
    """(kind, parameter FQNs, node names) that `name` stands for; kind is param | module | node."""
    tied = {a: owner for owner, aliases in plan.model.get("tied", {}).items() for a in aliases}
    if name in plan.params or name in tied:
        return "param", [tied.get(name, name)], []
    if name in plan.nodes:
        return "node", [], [name]
    prefix = name + "."
    fqns = [f for f in plan.params if f.startswith(prefix) and param_module(f) == name]
    fqns += [tied[a] for a in tied if param_module(a) == name]
    fqns.sort(key=lambda f: -math.prod(plan.params[f].shape))
    nodes = [n for n, c in plan.nodes.items() if c.module == name and n in plan.candidates and c.phase != "input"]
    if fqns or nodes:
        return "module", fqns, sorted(nodes, key=lambda n: (PHASES.index(plan.nodes[n].phase)
                                                             if plan.nodes[n].phase in PHASES else 9, _node_index(n)))
    modules = {c.module for c in plan.nodes.values()} | {param_module(f) for f in plan.params}
    close = difflib.get_close_matches(name, list(plan.params) + sorted(modules) + list(plan.nodes), n=5, cutoff=0.5)
    raise UnknownNameError(f"{name!r} is not a parameter, module path or graph node of this plan"
                           + (f"; close matches: {', '.join(close)}" if close else ""))


def _candidate_lines(plan, key: str) -> list[str]:
    rows = plan.candidates.get(key, [])
    if not rows:
        return ["  (no candidates recorded)"]
    ordered = sorted(rows, key=lambda r: (not r["chosen"], r["compute"] + r["comm"]))
    table = [[("* " if r["chosen"] else "  ") + r["strategy"], format_seconds(r["compute"]),
              format_seconds(r["comm"]) if r["comm"] != float("inf") else "inf",
              format_bytes(r["memory"]), _verdict(r.get("verdict", ""))] for r in ordered[:MAX_CANDIDATES]]
    out = ["  " + line for line in plain_table(["strategy", "compute", "comm", "memory", "verdict"], table)]
    if len(ordered) > MAX_CANDIDATES:
        out.append(f"  ... and {len(ordered) - MAX_CANDIDATES} more candidates")
    return out


def _verdict(text: str) -> str:
    """Print the verdict's raw seconds and bytes in readable units."""
    text = re.sub(r"by ([-+0-9.e]+) s\b", lambda m: f"by {format_seconds(float(m.group(1)))}", text)
    return re.sub(r"by ([-+0-9.e]+) B\b", lambda m: f"by {format_bytes(float(m.group(1)))}", text)


def _collective_lines(records) -> list[str]:
    if not records:
        return ["  collectives: none"]
    return ["  collectives:"] + [f"    {c.phase:<8} {c.kind:<14} axis {c.axis:<6} {format_bytes(c.bytes):>9} "
                                 f"{format_seconds(c.predicted_time):>9}  {c.reason}" for c in records]


def explain(plan, name: str) -> str:
    """Why `name` (parameter FQN, module path or node) is placed as it is: its candidates with compute,
    comm and memory (comm includes the resharding to its neighbours if only it changed), the verdict
    on each, and the collectives touching it."""
    kind, fqns, nodes = lookup(plan, name)
    out = [f"{name} ({kind})"]
    for fqn in fqns:
        p = plan.params[fqn]
        aliases = plan.model.get("tied", {}).get(fqn, [])
        out.append(f"parameter {fqn} shape {list(p.shape)}" + (f" (tied: {', '.join(aliases)})" if aliases else ""))
        for a, axis in enumerate(plan.mesh.axis_names):
            out.append(f"  axis {axis}: use {p.use[a]}, master {p.master[a]}, grad {p.grad[a]}, "
                       f"mode {mode_label(p, a)}")
        out += _candidate_lines(plan, fqn)
        out += _collective_lines([c for c in plan.collectives if c.source == fqn])
    for n in nodes:
        c = plan.nodes[n]
        out.append(f"node {n} ({c.phase}, module {c.module or '(top level)'}): outputs "
                   + " ".join(f"({spec_text(o)})" for o in c.outs if o is not None)
                   + " <- " + " ".join(f"({spec_text(i)})" for i in c.ins))
        out += _candidate_lines(plan, n)
        out += _collective_lines([r for r in plan.collectives if r.source == n])
    if kind == "module":
        extra = [c for c in plan.collectives if c.module == name and c.source not in set(fqns) | set(nodes)]
        if extra:
            out.append(f"other collectives attributed to {name}:")
            out += _collective_lines(extra)[1:]
    return "\n".join(out)
