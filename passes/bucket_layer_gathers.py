"""bucket_layer_gathers: the parameter all-gathers of one layer in one phase become one flat
all-gather, as FSDP2 gathers a layer's flat buffer: a ZeRO-3 step then pays one collective per layer
and phase instead of one per parameter and use (on gloo ~0.3 ms of launch each, 88 on a 4-layer GPT).

A gather qualifies when it moves a parameter (its input is a parameter placeholder, through
`contiguous`); gathers are grouped by (phase, layer, process group), a layer being the first
numbered module path component of the parameter (`autopar.planning.problem.layer_of`: "transformer.h.3").
Parameters outside the stack (embeddings, final norm; a tied embedding is read by the first and the
last pipeline stage) keep their own gathers, so no group spans two pipeline stages. The fused node
goes right before the group's first real use (the first user that is not a view or copy of a
gathered weight), so gathered weights live from there to the layer's last use, as FSDP2's do, and
a backward gather never runs in forward.

Logical collectives are unchanged: the fused node lists them in meta["autopar_fused"] (as
`bucket_collectives` does), so `emitted_collectives(gm)` still equals `Plan.collectives`. The cost
model prices each of them at its share of one collective's latencies (`EdgeInfo.gather_share` in
autopar/planning/problem.py: its bytes over the layer's, at least one over the layer's parameter count).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar._torch_compat import stable_toposort
from autopar.graph import COLLECTIVE, MODULE_PATH, NAME, PASS, ROLE, is_view_like, layer_of

from .context import PassContext
from .ops import contiguous, dense_in_order, fused_all_gather

c10d = torch.ops._c10d_functional


def _param_source(coll: fx.Node) -> fx.Node | None:
    """The parameter placeholder an all_gather moves, or None when it moves anything else."""
    x = coll.args[0]
    while x.op == "call_function" and x.target is contiguous:
        x = x.args[0]
    return x if x.op == "placeholder" and x.meta.get(ROLE) == "param" else None


def _group_key(wait: fx.Node, param: fx.Node) -> tuple | None:
    """(phase, layer, n, group name), or None for a parameter outside the stack of layers."""
    layer = layer_of(param.meta[NAME])
    return None if layer is None else (wait.meta[COLLECTIVE]["phase"], layer, *wait.args[0].args[1:])


def _first_use(wait: fx.Node, order: dict) -> int:
    """Position of the first node that reads the gathered value other than through views/copies."""
    first, todo = len(order), list(wait.users)
    while todo:
        user = todo.pop()
        if user.op == "call_function" and (is_view_like(user) or user.target in (contiguous, dense_in_order)):
            todo.extend(user.users)
        else:
            first = min(first, order[user])
    return first


def _fuse(gm: fx.GraphModule, members: list[tuple[fx.Node, fx.Node]], anchor: fx.Node) -> None:
    graph = gm.graph
    with graph.inserting_before(anchor):
        fused = graph.call_function(fused_all_gather, ([p for _, p in members], *members[0][0].args[0].args[1:]))
        outs = [graph.call_function(operator.getitem, (fused, i)) for i in range(len(members))]
    fused.meta.update(autopar_fused=[w.meta[COLLECTIVE] for w, _ in members],
                      autopar_pass="bucket_layer_gathers",
                      phase=members[0][0].meta[COLLECTIVE]["phase"],
                      module_path=anchor.meta.get(MODULE_PATH, ""))
    for (wait, _), out in zip(members, outs):
        out.meta.update(wait.meta)
        out.meta.pop(COLLECTIVE, None)
        out.meta[PASS] = "bucket_layer_gathers"
        wait.replace_all_uses_with(out)
        coll = wait.args[0]
        src = coll.args[0]
        graph.erase_node(wait)
        graph.erase_node(coll)
        if src.op == "call_function" and src.target is contiguous and not src.users:
            graph.erase_node(src)


def bucket_layer_gathers_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Parameter all-gathers of one (phase, layer, group) -> one fused_all_gather before their first use."""
    groups: dict[tuple, list[tuple[fx.Node, fx.Node]]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is c10d.wait_tensor.default \
                and node.args[0].target is c10d.all_gather_into_tensor.default:
            param = _param_source(node.args[0])
            key = None if param is None else _group_key(node, param)
            if key is not None:
                groups.setdefault(key, []).append((node, param))
    groups = {k: m for k, m in groups.items() if len(m) > 1}
    if not groups:
        return gm  # nothing to fuse: the graph is returned unchanged
    nodes = list(gm.graph.nodes)  # once: first uses are compute nodes, which fusing neither moves nor erases
    order = {n: i for i, n in enumerate(nodes)}
    for members in groups.values():
        _fuse(gm, members, nodes[min(_first_use(w, order) for w, _ in members)])
    stable_toposort(gm)  # view chains of a weight made early (for backward) now follow the fused gather
    gm.graph.lint()
    gm.recompile()
    return gm
