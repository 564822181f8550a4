"""`to_html(plan, path)`: the plan as one self-contained HTML page (inline CSS, JS and SVG; no network).

Sections: the module tree (the summary's folded groups) coloured by weight mode and activation
placement (and stage), the collectives per layer with a bar of their time, a memory bar chart per
device (per stage for pipelined plans), and the baseline recipes. The page's script fills in
filtering/expansion and, only when it ran without error, appends `<div id="autopar-ok">` (tests look
for it in a headless browser).
"""
from __future__ import annotations

import html
import json
from pathlib import Path

from autopar.costmodel.memory import format_bytes, format_seconds
from autopar.inspection.summary import (
    PHASES,
    Group,
    baseline_rows,
    build_groups,
    header_lines,
    mode_label,
    split_unit,
    totals_lines,
)

MEMORY_PARTS = (("params", "#4e79a7"), ("grads", "#f28e2b"), ("optimizer", "#e15759"), ("activations", "#76b7b2"))
STAGE_COLOURS = ("#fde0dd", "#e0ecf4", "#e5f5e0", "#fff7bc", "#efedf5", "#fee6ce", "#deebf7", "#f7f7f7")

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:6px 0}td,th{padding:2px 8px;text-align:left;white-space:nowrap}
th{background:#f3f3f3}tr.group td{font-weight:600;background:#fafafa;cursor:pointer}
tr.sub td:first-child{padding-left:24px}tr.hidden{display:none}
.m-dp{background:#dbe9f6}.m-zero1{background:#d9f0d3}.m-zero2{background:#b8e3b0}.m-zero3{background:#fbe3c8}
.m-tp{background:#f4cccc}.m-tied{background:#eee}.a-S{background:#e8f0fe}.a-R{background:#f5f5f5}
.a-P{background:#fff2cc}.bad{color:#b00;font-weight:600}.ok{color:#070}pre{background:#f7f7f7;padding:8px}
.bar{display:inline-block;height:10px;background:#4e79a7;vertical-align:middle}.legend span{padding:1px 6px;margin-right:4px}
"""

SCRIPT = """
(function(){
  var data = JSON.parse(document.getElementById('plan-data').textContent);
  document.getElementById('n-collectives').textContent = String(data.num_collectives);
  var rows = Array.prototype.slice.call(document.querySelectorAll('#tree tr[data-group]'));
  rows.forEach(function(tr){
    if (!tr.classList.contains('group')) return;
    tr.addEventListener('click', function(){
      var g = tr.getAttribute('data-group');
      rows.forEach(function(r){ if (r !== tr && r.getAttribute('data-group') === g) r.classList.toggle('hidden'); });
    });
  });
  document.getElementById('filter').addEventListener('input', function(ev){
    var q = ev.target.value.toLowerCase();
    rows.forEach(function(r){ r.style.display = (!q || r.textContent.toLowerCase().indexOf(q) >= 0) ? '' : 'none'; });
  });
  var ok = document.createElement('div');
  ok.id = 'autopar-ok'; ok.textContent = 'rendered ' + rows.length + ' rows';
  ok.style.display = 'none';
  document.body.appendChild(ok);
})();
"""


def _e(x) -> str:
    return html.escape(str(x))


def _mode_class(cell: str) -> str:
    if cell == "tied":
        return "m-tied"
    if "(" in cell:
        return "m-" + cell.split("(")[1].rstrip(")")
    return ""


def _act_class(cell: str) -> str:
    return f"a-{cell[0]}" if cell else ""


def _tree(plan, groups: list[Group]) -> str:
    axes = plan.mesh.axis_names
    phases = [p for p in PHASES if any(c.phase == p for c in plan.collectives)]
    head = ["module"] + [f"weight {a}" for a in axes] + [f"activation ({','.join(axes)})"]
    head += [f"{p} comm" for p in phases] + (["stage"] if plan.stages else [])
    out = ["<input id='filter' placeholder='filter modules…'> <small>click a group to fold it</small>",
           "<table id='tree'><tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>"]
    for gi, g in enumerate(groups):
        rows = sorted(g.rows, key=lambda r: r.rel != "")
        if not rows[0].rel == "":
            out.append(f"<tr class='group' data-group='{gi}'><td>{_e(g.label)}</td>"
                       + "<td></td>" * (len(head) - 1) + "</tr>")
        for r in rows:
            cls = "group" if r.rel == "" else "sub"
            name = g.label if r.rel == "" else r.rel
            cells = [f"<td>{_e(name)}</td>"]
            cells += [f"<td class='{_mode_class(w)}'>{_e(w)}</td>" for w in r.weights]
            cells.append(f"<td class='{_act_class(r.activation)}'>{_e(r.activation)}</td>")
            cells += [f"<td>{_e(r.comm[PHASES.index(p)])}</td>" for p in phases]
            if plan.stages:
                # a folded group of several stages ("0-6") gets a neutral shade
                colour = STAGE_COLOURS[int(r.stage) % len(STAGE_COLOURS)] if r.stage.isdigit() else \
                    "#eee" if r.stage else "#fff"
                cells.append(f"<td style='background:{colour}'>{_e(r.stage)}</td>")
            out.append(f"<tr class='{cls}' data-group='{gi}'>" + "".join(cells) + "</tr>")
    out.append("</table>")
    legend = "".join(f"<span class='m-{m}'>{m}</span>" for m in ("dp", "zero1", "zero2", "zero3", "tp"))
    out.append(f"<p class='legend'>weight modes: {legend} · activation: "
               "<span class='a-S'>sharded</span><span class='a-R'>replicated</span><span class='a-P'>partial</span></p>")
    return "\n".join(out)


def _collectives_by_layer(plan) -> str:
    per: dict[str, dict] = {}
    for c in plan.collectives:
        unit = split_unit(c.module)[0] if c.module else "(top level, loss)"
        row = per.setdefault(unit, {"count": 0, "bytes": 0.0, "time": 0.0, "kinds": {}})
        row["count"] += 1
        row["bytes"] += c.bytes
        row["time"] += c.predicted_time
        row["kinds"][c.kind] = row["kinds"].get(c.kind, 0) + 1
    if not per:
        return "<p>no collectives</p>"
    longest = max(r["time"] for r in per.values()) or 1.0
    out = ["<table id='collectives'><tr><th>layer</th><th>count</th><th>kinds</th><th>bytes</th>"
           "<th>time</th><th></th></tr>"]
    order = [g for grp in build_groups(plan) for g in grp.paths]
    for unit in sorted(per, key=lambda u: order.index(u) if u in order else len(order)):
        r = per[unit]
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(r["kinds"].items()))
        out.append(f"<tr><td>{_e(unit)}</td><td>{r['count']}</td><td>{_e(kinds)}</td><td>{format_bytes(r['bytes'])}"
                   f"</td><td>{format_seconds(r['time'])}</td><td><span class='bar' "
                   f"style='width:{max(1, int(200 * r['time'] / longest))}px'></span></td></tr>")
    out.append("</table>")
    return "\n".join(out)


def _memory_svg(plan) -> str:
    """Stacked bars: one per stage (or one for every device of an SPMD plan) with the budget line."""
    bars = [(f"stage {s.index}", {"total": s.memory}) for s in plan.stages] or \
        [("every device", dict(plan.memory_breakdown))]
    top = max([plan.memory_budget or 0.0] + [sum(v for k, v in b.items()) for _, b in bars]) or 1.0
    width, bar_h, left = 640, 26, 110
    height = 30 + len(bars) * (bar_h + 12) + 30
    scale = (width - left - 20) / top
    parts = [f"<svg id='memory' xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
             "font-size='12' font-family='sans-serif'>"]
    for i, (label, values) in enumerate(bars):
        y, x = 20 + i * (bar_h + 12), left
        parts.append(f"<text x='4' y='{y + 17}'>{_e(label)}</text>")
        for key, colour in MEMORY_PARTS + (("total", "#4e79a7"),):
            w = values.get(key, 0.0) * scale
            if w > 0:
                parts.append(f"<rect x='{x:.1f}' y='{y}' width='{w:.1f}' height='{bar_h}' fill='{colour}'>"
                             f"<title>{key} {format_bytes(values[key])}</title></rect>")
                x += w
        parts.append(f"<text x='{x + 4:.1f}' y='{y + 17}'>{format_bytes(sum(values.values()))}</text>")
    if plan.memory_budget:
        bx = left + plan.memory_budget * scale
        parts.append(f"<line x1='{bx:.1f}' y1='10' x2='{bx:.1f}' y2='{height - 25}' stroke='#b00' "
                     f"stroke-dasharray='4 3'/><text x='{bx - 60:.1f}' y='{height - 10}' fill='#b00'>budget "
                     f"{format_bytes(plan.memory_budget)}</text>")
    ly = height - 10
    for j, (key, colour) in enumerate(MEMORY_PARTS):
        parts.append(f"<rect x='{left + j * 110}' y='{ly - 10}' width='10' height='10' fill='{colour}'/>"
                     f"<text x='{left + j * 110 + 14}' y='{ly}'>{key}</text>")
    parts.append("</svg>")
    return "".join(parts)


def _baselines(plan) -> str:
    rows = baseline_rows(plan)
    if not rows:
        return "<p>no baselines recorded</p>"
    out = ["<table id='baselines'><tr><th>recipe</th><th>step time</th><th>memory</th><th>vs this plan</th></tr>"]
    for name, t, mem, verdict in rows:
        cls = " class='bad'" if verdict.startswith("infeasible") else ""
        out.append(f"<tr><td>{_e(name)}</td><td>{_e(t)}</td><td>{_e(mem)}</td><td{cls}>{_e(verdict)}</td></tr>")
    out.append("</table>")
    return "\n".join(out)


def render_html(plan) -> str:
    """The page as a string."""
    groups = build_groups(plan)
    data = {"num_collectives": len(plan.collectives), "step_time": plan.predicted_step_time,
            "memory_per_device": plan.memory_per_device,
            "modes": sorted({mode_label(p, a) for p in plan.params.values() for a in range(plan.mesh.ndim)})}
    data_json = json.dumps(data).replace("</", "<\\/")
    feasible = "<span class='ok'>feasible</span>" if plan.feasible else \
        f"<span class='bad'>INFEASIBLE: {_e(plan.infeasible_reason)}</span>"
    title = f"autopar plan — {plan.model.get('name', 'model')} on {plan.mesh}"
    return "\n".join([
        "<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>", f"<title>{_e(title)}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1><p>{feasible} · <span id='n-collectives'>?</span> collectives</p>",
        "<pre id='header'>" + _e("\n".join(header_lines(plan) + [""] + totals_lines(plan))) + "</pre>",
        "<h2 id='tree-title'>Modules</h2>", _tree(plan, groups),
        "<h2>Collectives per layer</h2>", _collectives_by_layer(plan),
        "<h2>Memory per device</h2>", _memory_svg(plan),
        "<h2>Baseline recipes</h2>", _baselines(plan),
        f"<script type='application/json' id='plan-data'>{data_json}</script>",
        f"<script>{SCRIPT}</script>", "</body></html>",
    ])


def to_html(plan, path) -> None:
    """Write the plan's self-contained HTML report to `path`."""
    Path(path).write_text(render_html(plan), encoding="utf-8")
