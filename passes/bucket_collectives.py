"""bucket_collectives: fuse the gradient (and loss) all-reduces / reduce-scatters at the end of the
step into flat buckets of at most 25 MB per process group, as DDP and FSDP do. The cost model prices
exactly this (autopar.reshard: gradient collectives pay their share of one bucket's latency).

Each fused node keeps the logical collectives it carries in meta["autopar_fused"], so the emitted
program can still be checked collective by collective against `Plan.collectives`.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar._torch_compat import stable_toposort

from .context import PassContext
from .ops import fused_all_reduce, fused_reduce_scatter

c10d = torch.ops._c10d_functional
FUSIBLE = {c10d.all_reduce.default: "all_reduce", c10d.reduce_scatter_tensor.default: "reduce_scatter"}


def _is_step_end(wait: fx.Node) -> bool:
    info = wait.meta.get("autopar_collective", {})
    return info.get("reason", "").startswith("gradient") or info.get("reason") == "loss to every rank"


def bucket_collectives_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Gradient collectives of one kind, op and group become one fused node (bucketed at run time)."""
    groups: dict[tuple, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is c10d.wait_tensor.default and _is_step_end(node):
            coll = node.args[0]
            if coll.target in FUSIBLE:
                key = (coll.target, *coll.args[1:])  # op (and n) and group name
                groups.setdefault(key, []).append(node)
    groups = {k: w for k, w in groups.items() if len(w) > 1}
    if not groups:
        return gm  # nothing to fuse: the graph is returned unchanged
    for key, waits in groups.items():
        order = {n: i for i, n in enumerate(gm.graph.nodes)}  # a 2-D gradient's second collective
        target, *rest = key                                     # reads the first group's fused output
        inputs = [w.args[0].args[0] for w in waits]
        fn = fused_all_reduce if target is c10d.all_reduce.default else fused_reduce_scatter
        with gm.graph.inserting_after(max(inputs, key=order.get)):  # users are re-sorted below
            fused = gm.graph.call_function(fn, (inputs, *rest))
            outs = [gm.graph.call_function(operator.getitem, (fused, i)) for i in range(len(waits))]
        fused.meta.update(autopar_fused=[w.meta["autopar_collective"] for w in waits], phase="backward",
                          autopar_pass="bucket_collectives")
        for w, o in zip(waits, outs):
            o.meta.update(w.meta)
            o.meta.pop("autopar_collective", None)
            o.meta["autopar_pass"] = "bucket_collectives"
            w.replace_all_uses_with(o)
            coll = w.args[0]
            gm.graph.erase_node(w)
            gm.graph.erase_node(coll)
    stable_toposort(gm)  # users of an early gradient now follow the fused node; nothing else moves
    gm.graph.lint()
    gm.recompile()
    return gm
