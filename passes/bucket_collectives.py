"""bucket_collectives: fuse the gradient (and loss) all-reduces / reduce-scatters at the end of the
step into flat buckets of at most 25 MB per process group, as DDP and FSDP do, and likewise the
ZeRO-1/2 parameter all-gathers at the start of the step (each sharded master gathered once). The cost
model prices exactly this (autopar.planning.reshard / planning.problem: both kinds pay their share of one bucket's
latency); unfused, 50 small gathers cost 50 launches that the plan never priced.

Each fused node keeps the logical collectives it carries in meta["autopar_fused"], so the emitted
program can still be checked collective by collective against `Plan.collectives`.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar._torch_compat import stable_toposort
from autopar.graph import COLLECTIVE, PASS

from .context import PassContext
from .ops import fused_all_gather, fused_all_reduce, fused_reduce_scatter

c10d = torch.ops._c10d_functional
STEP_END = {c10d.all_reduce.default: fused_all_reduce, c10d.reduce_scatter_tensor.default: fused_reduce_scatter}
STEP_START = {c10d.all_gather_into_tensor.default: fused_all_gather}
ZERO_GATHER = "parameter gather (ZeRO-1/2)"  # insert_redistribute's reason for a master gathered once


def _fusible(wait: fx.Node) -> dict:
    """The fused form this collective may join: step-end reductions and step-start gathers."""
    reason = wait.meta.get(COLLECTIVE, {}).get("reason", "")
    if reason.startswith("gradient") or reason == "loss to every rank":
        return STEP_END
    return STEP_START if reason == ZERO_GATHER else {}


def bucket_collectives_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Gradient collectives (and ZeRO-1/2 gathers) of one kind, op and group become one fused node
    (bucketed at run time)."""
    groups: dict[tuple, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is c10d.wait_tensor.default:
            coll = node.args[0]
            if coll.target in _fusible(node):
                key = (coll.target, *coll.args[1:])  # op (and n) and group name
                groups.setdefault(key, []).append(node)
    groups = {k: w for k, w in groups.items() if len(w) > 1}
    if not groups:
        return gm  # nothing to fuse: the graph is returned unchanged
    order = {n: i for i, n in enumerate(gm.graph.nodes)}  # once: new nodes get their anchor's position
    for key, waits in groups.items():
        target, *rest = key
        inputs = [w.args[0].args[0] for w in waits]
        fn = {**STEP_END, **STEP_START}[target]
        anchor = max(inputs, key=order.__getitem__)  # a 2-D gradient's second collective reads the
        with gm.graph.inserting_after(anchor):        # first group's fused output; users re-sorted below
            fused = gm.graph.call_function(fn, (inputs, *rest))
            outs = [gm.graph.call_function(operator.getitem, (fused, i)) for i in range(len(waits))]
        order.update({n: order[anchor] + 0.5 for n in (fused, *outs)})
        phase = waits[0].meta[COLLECTIVE]["phase"]
        fused.meta.update(autopar_fused=[w.meta[COLLECTIVE] for w in waits], phase=phase,
                          autopar_pass="bucket_collectives")
        for w, o in zip(waits, outs):
            o.meta.update(w.meta)
            o.meta.pop(COLLECTIVE, None)
            o.meta[PASS] = "bucket_collectives"
            w.replace_all_uses_with(o)
            coll = w.args[0]
            gm.graph.erase_node(w)
            gm.graph.erase_node(coll)
    stable_toposort(gm)  # users of an early gradient now follow the fused node; nothing else moves
    gm.graph.lint()
    gm.recompile()
    return gm
