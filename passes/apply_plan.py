"""apply_plan: copy the plan's per-node strategy (and parameter placements) onto node.meta."""
from __future__ import annotations

import torch.fx as fx

from autopar.graph import INS, MASTER, NAME, OUTS, ROLE, VAL, is_getitem

from .context import PassContext, parse_spec


def apply_plan_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Every op and placeholder gets meta["autopar_outs"] / ["autopar_ins"] (specs per axis)."""
    plan = ctx.plan
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if is_getitem(node):
            producer, idx = node.args[0], int(node.args[1])
            node.meta[OUTS] = (producer.meta[OUTS][idx],)
            node.meta[INS] = (producer.meta[OUTS][idx],)
            continue
        choice = plan.nodes.get(node.name)
        if choice is None:
            if node.meta.get(VAL) is None:
                continue
            raise KeyError(f"plan has no strategy for node {node.name}")
        node.meta[OUTS] = tuple(parse_spec(o) for o in choice.outs)
        node.meta[INS] = tuple(parse_spec(i) for i in choice.ins)
        if node.op == "placeholder" and node.meta.get(ROLE) == "param":
            p = plan.params[node.meta[NAME]]
            node.meta[MASTER] = parse_spec(p.master)
    gm.graph.lint()
    gm.recompile()
    return gm
