"""Canonicalisation step: dropout masks are saved for backward as 1-byte booleans.

The captured joint graph draws a dropout mask as `bernoulli(1 - p)` in the activation dtype, scales
it (`div(mask, 1 - p)`) and hands the scaled mask to the backward: 2 or 4 bytes per element kept,
where Megatron (Korthikanti et al. 2022) keeps a 1-byte mask. For every forward value that the
backward reads and that is a deterministic chain (scalar mul/div, dtype casts, views) from a random
0/1 mask (a `bernoulli` draw, or a comparison of a `rand` draw), this step saves the mask as
`torch.bool` in the forward and rebuilds the chain in the backward from it, by the same ops, so
the backward reads bit-identical values:

    forward   m = bernoulli(e, 0.9); s = div(m, 0.9); y = mul(x, s)  ->  ... ; b = _to_copy(m, bool)
    backward  g = mul(dy, s)                                          ->  g = mul(dy, div(_to_copy(b, bf16), 0.9))

A bernoulli draw is exactly 0 or 1, so bool -> dtype restores it bit for bit. The boolean copy is
meta["autopar_mask"] = True: recompute keeps it (never re-runs it, as the draw itself). Every node
made here carries the meta (val, phase, module_path) of the value it stands for, with
meta["autopar_pass"] = "dropout_masks".
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.graph import PHASE, VAL, VIEW_OPS, is_random, packet

aten = torch.ops.aten

_SCALE_OPS = {aten.mul, aten.div}                # by a Python number
_COMPARE_OPS = {aten.lt, aten.le, aten.gt, aten.ge}  # rand(...) < keep
_META_KEYS = ("val", "phase", "module_path", "stack_trace", "nn_module_stack", "autopar_unscoped")


def _is_forward(node: fx.Node) -> bool:
    return node.op == "call_function" and node.meta.get(PHASE) == "forward"


def _is_mask_source(node: fx.Node) -> bool:
    """A forward draw whose every element is 0 or 1: bernoulli, or a bool comparison of a random draw."""
    if not _is_forward(node):
        return False
    if packet(node) is aten.bernoulli:
        return True
    val = node.meta.get(VAL)
    return (packet(node) in _COMPARE_OPS and isinstance(val, torch.Tensor) and val.dtype == torch.bool
            and any(is_random(a) for a in node.all_input_nodes))


def _is_chain_op(node: fx.Node, prev: fx.Node) -> bool:
    """A forward op whose value is a deterministic function of `prev` alone (scale, cast, view)."""
    if not _is_forward(node) or node.all_input_nodes != [prev]:
        return False
    if packet(node) in _SCALE_OPS:
        return all(isinstance(a, (int, float)) for a in node.args[1:]) and not node.kwargs
    return packet(node) in VIEW_OPS and node.args[0] is prev


def _chain(source: fx.Node) -> list[fx.Node]:
    """The source and every op that derives from it alone, in graph order."""
    found, stack = {source}, [source]
    while stack:
        prev = stack.pop()
        for user in prev.users:
            if user not in found and _is_chain_op(user, prev):
                found.add(user)
                stack.append(user)
    order = {n: k for k, n in enumerate(source.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def _backward_readers(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if u.op == "call_function" and u.meta.get(PHASE) == "backward"]


def _new_node(graph: fx.Graph, target, args, kwargs, like: fx.Node, **meta) -> fx.Node:
    node = graph.call_function(target, args, kwargs)
    node.meta.update({k: like.meta[k] for k in _META_KEYS if k in like.meta})
    node.meta.update(meta, autopar_pass="dropout_masks")
    return node


def _save_as_bool(gm: fx.GraphModule, source: fx.Node) -> bool:
    """Save `source`'s mask as bool and rebuild what backward reads of its chain; False if nothing to do."""
    chain = _chain(source)
    read = [n for n in chain if _backward_readers(n)]
    src_val = source.meta[VAL]
    if not read or (src_val.dtype == torch.bool and read == [source]):
        return False
    mask = source
    if src_val.dtype != torch.bool:
        with gm.graph.inserting_after(source):
            mask = _new_node(gm.graph, aten._to_copy.default, (source,), {"dtype": torch.bool}, source,
                             val=src_val.to(torch.bool), autopar_mask=True)
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    first = min((u for n in read for u in _backward_readers(n)), key=order.__getitem__)
    need = set(read)
    for n in reversed(chain):  # the chain ops on the way from the source to what backward reads
        if any(u in need for u in n.users):
            need.add(n)
    env: dict[fx.Node, fx.Node] = {}
    with gm.graph.inserting_before(first):
        env[source] = mask if mask is source else _new_node(
            gm.graph, aten._to_copy.default, (mask,), {"dtype": src_val.dtype}, source, phase="backward")
        for n in chain[1:]:
            if n in need:
                env[n] = _new_node(gm.graph, n.target, fx.node.map_arg(n.args, env.__getitem__),
                                   fx.node.map_arg(n.kwargs, env.__getitem__), n, phase="backward")
    for n in read:
        for u in _backward_readers(n):
            u.replace_input_with(n, env[n])
    return True


def save_bool_masks(gm: fx.GraphModule) -> int:
    """Save every dropout mask that backward reads as torch.bool (module docstring); returns how many.
    The caller (`canonicalize`) lints and recompiles."""
    return sum(_save_as_bool(gm, n) for n in list(gm.graph.nodes) if _is_mask_source(n))
