"""Canonicalise a captured joint graph before planning (structure only; numerics unchanged).

  * addmm(b, A, B) -> add(mm(A, B), b): keeps Megatron's row-parallel split (mm -> Partial, then the
    bias added once) expressible; a single addmm cannot take a contraction split.
  * parameter views used by the backward get their own copy: a ZeRO-3 plan then gathers the weight
    again in backward instead of silently keeping the forward's gathered copy alive.
  * dropout masks that backward reads are saved as torch.bool and rebuilt in backward by the same
    ops, bit for bit (`autopar/capture/dropout_masks.py`): 1 byte per element, as Megatron keeps them.
  * nodes without users and without effects are dropped.
Meta (val, phase, module_path) is carried onto every node made here, with meta["autopar_pass"].
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.graph import PASS, PHASE, ROLE, is_view_like

aten = torch.ops.aten


def _copy_meta(src: fx.Node, dst: fx.Node, why: str, **overrides) -> None:
    for key in ("val", "phase", "module_path", "stack_trace", "nn_module_stack"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]
    dst.meta.update(overrides)
    dst.meta[PASS] = why


def split_addmm(gm: fx.GraphModule) -> int:
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.addmm.default or node.kwargs:
            continue
        bias, a, b = node.args[:3]
        with gm.graph.inserting_before(node):
            mm = gm.graph.call_function(aten.mm.default, (a, b))
            add = gm.graph.call_function(aten.add.Tensor, (mm, bias))
        _copy_meta(node, mm, "canonicalize.split_addmm")
        _copy_meta(node, add, "canonicalize.split_addmm")
        node.replace_all_uses_with(add)
        gm.graph.erase_node(node)
        count += 1
    return count


def _param_derived(node: fx.Node, memo: dict) -> bool:
    """True if `node` is a parameter placeholder or a view-like chain of one."""
    if node in memo:
        return memo[node]
    if node.op == "placeholder":
        memo[node] = node.meta.get(ROLE) == "param"
    else:
        memo[node] = is_view_like(node) and all(_param_derived(a, memo) for a in node.all_input_nodes)
    return memo[node]


def split_param_views(gm: fx.GraphModule) -> int:
    """Give backward users of forward parameter views their own copy of the view chain."""
    memo: dict = {}
    copies: dict = {}

    def bwd_copy(node: fx.Node) -> fx.Node:
        if node.op == "placeholder" or node.meta.get(PHASE) == "backward":
            return node
        if node not in copies:
            args = fx.node.map_arg(node.args, bwd_copy)
            kwargs = fx.node.map_arg(node.kwargs, bwd_copy)
            with gm.graph.inserting_after(node):
                copies[node] = new = gm.graph.call_function(node.target, args, kwargs)
            _copy_meta(node, new, "canonicalize.split_param_views", phase="backward")
        return copies[node]

    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.meta.get(PHASE) != "forward" or not _param_derived(node, memo):
            continue
        bwd_users = [u for u in node.users if u.op == "call_function" and u.meta.get(PHASE) == "backward"]
        for user in bwd_users:
            user.replace_input_with(node, bwd_copy(node))
    return len(copies)


def canonicalize(gm: fx.GraphModule) -> dict[str, int]:
    """Apply every canonicalisation in place; returns counts of what changed."""
    from autopar.capture.dropout_masks import save_bool_masks  # it uses this module's helpers
    stats = {"split_addmm": split_addmm(gm), "split_param_views": split_param_views(gm),
             "bool_masks": save_bool_masks(gm)}
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return stats
