"""insert_redistribute: wherever a value's spec differs from what its user needs, add an abstract
`redistribute(x, src, dst)` node (lowered to collectives by the next pass).

Three kinds of mismatch: an op input (planned reshard), a ZeRO-1/2 parameter (stored sharded,
used whole: gathered once after the placeholder), and the outputs (the loss must be Replicate on
every rank; each gradient must match its parameter's master spec).
"""
from __future__ import annotations

import torch.fx as fx

from autopar.graph import INS, MASTER, MODULE_PATH, OUTS, PASS, PHASE, VAL, is_getitem
from autopar.placement import replicated, spec_str

from .context import PassContext, value_spec
from .ops import redistribute


def _add(gm: fx.GraphModule, x: fx.Node, src, dst, phase: str, reason: str, where: fx.Node, after=False) -> fx.Node:
    ctx_mgr = gm.graph.inserting_after(where) if after else gm.graph.inserting_before(where)
    with ctx_mgr:
        r = gm.graph.call_function(redistribute, (x, spec_str(src), spec_str(dst)))
    r.meta.update(val=x.meta[VAL], phase=phase, module_path=where.meta.get(MODULE_PATH, ""),
                  autopar_outs=(dst,), autopar_ins=(src,), autopar_src=src, autopar_reason=reason,
                  autopar_pass="insert_redistribute")
    return r


def _zero_params(gm: fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        master = node.meta.get(MASTER)
        if master is None or master == value_spec(node):
            continue
        use = value_spec(node)
        users = list(node.users)
        node.meta[OUTS] = (master,)
        r = _add(gm, node, master, use, "forward", "parameter gather (ZeRO-1/2)", node, after=True)
        for u in users:
            u.replace_input_with(node, r)


def _op_inputs(gm: fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or INS not in node.meta or node.target is redistribute \
                or is_getitem(node):  # a getitem reads its producer's output as it is, by construction
            continue
        if node.meta.get(PASS) == "insert_redistribute":
            continue
        for a, want in zip(list(node.all_input_nodes), node.meta[INS]):
            have = value_spec(a)
            if have != want:
                reason = f"{spec_str(have)}->{spec_str(want)} for {node.target}"
                node.replace_input_with(a, _add(gm, a, have, want, node.meta.get(PHASE, "forward"), reason, node))


def _outputs(gm: fx.GraphModule, ctx: PassContext) -> None:
    out = gm.graph.output_node()
    values = list(out.args[0])
    loss = values[0]
    rep = replicated(len(ctx.axis_sizes))
    if value_spec(loss) != rep:
        values[0] = _add(gm, loss, value_spec(loss), rep, "backward", "loss to every rank", out)
    for k, (g, name) in enumerate(zip(values[1:], ctx.grad_names), start=1):
        master = ctx.plan_master(name)
        if value_spec(g) != master:
            values[k] = _add(gm, g, value_spec(g), master, "backward", f"gradient of {name}", out)
    out.args = (tuple(values),)


def insert_redistribute_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Make every producer/consumer spec pair agree by inserting redistribute nodes."""
    _zero_params(gm)
    _op_inputs(gm)
    _outputs(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    return gm
