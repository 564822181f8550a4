"""Strided shards: the placements a fused projection split into k equal pieces needs.

`q, k, v = linear(x).split(C, dim=-1)` on a fused [q; k; v] weight: a contiguous column split of the
weight gives rank 0 all of q and half of k, so no plan with that split gives each rank whole heads.
A strided shard SS(d, k) (autopar.placement) gives rank r [q_r; k_r; v_r] instead, as Megatron does:

    split/chunk of SS(d, k) along d into k equal pieces   -> S(d) pieces (locally: k equal pieces)
    cat of k equal S(d) pieces along d                    -> SS(d, k)     (the backward of the split)
    ops whose Shard strategies act index by index along the sharded dims (matmuls, elementwise, views,
    permutes, reductions over other dims) keep a strided shard: each such strategy has a strided twin
    with every Shard(d) replaced by SS(d, k), all tensors alike.

Which k to offer is read off the graph: every equal split or cat with k >= 2 pieces of a dim of size N
makes (N, k) a *split factor*; an op gets strided twins for k when one of its tensors has a dim of
size N. Graphs without such splits get no extra strategies.
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.fx as fx

from autopar.graph import VAL
from autopar.placement import SS, kind

aten = torch.ops.aten

SPLITS = (aten.split, aten.split_with_sizes, aten.split_copy, aten.split_with_sizes_copy, aten.chunk)

# fx.Graph -> (number of nodes when computed, frozenset of (size, k)); a memo, recomputed when the graph grows
_FACTORS: "weakref.WeakKeyDictionary[fx.Graph, tuple[int, frozenset]]" = weakref.WeakKeyDictionary()


def _shape(node) -> tuple | None:
    v = node.meta.get(VAL) if isinstance(node, fx.Node) else None
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def equal_split(node: fx.Node) -> tuple[int, int, int] | None:
    """(dim, size of dim, k) when `node` splits one tensor into k >= 2 equal pieces along dim."""
    if node.op != "call_function" or getattr(node.target, "overloadpacket", None) not in SPLITS:
        return None
    shape = _shape(node.args[0])
    outs = node.meta.get(VAL)
    if shape is None or not isinstance(outs, (tuple, list)) or len(outs) < 2:
        return None
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    dim = dim + len(shape) if dim < 0 else dim
    sizes = {int(o.shape[dim]) for o in outs}
    return (dim, shape[dim], len(outs)) if len(sizes) == 1 else None


def equal_cat(node: fx.Node) -> tuple[int, int, int] | None:
    """(dim, size of dim, k) when `node` concatenates k >= 2 equal-shaped tensors along dim."""
    if node.op != "call_function" or node.target is not aten.cat.default:
        return None
    parts = [_shape(a) for a in node.args[0]]
    out = _shape(node)
    if out is None or len(parts) < 2 or None in parts or len(set(parts)) != 1:
        return None
    dim = node.args[1] if len(node.args) > 1 else 0
    dim = dim + len(out) if dim < 0 else dim
    return dim, out[dim], len(parts)


def split_factors(graph: fx.Graph) -> frozenset:
    """{(size, k)}: dims of `size` that the graph splits into (or concatenates from) k equal pieces."""
    num_nodes = len(graph.nodes)
    memo = _FACTORS.get(graph)
    if memo is None or memo[0] != num_nodes:
        found = set()
        for node in graph.nodes:
            hit = equal_split(node) or equal_cat(node)
            if hit is not None:
                found.add(hit[1:])
        memo = _FACTORS[graph] = (num_nodes, frozenset(found))
    return memo[1]


def node_factors(node: fx.Node, shapes) -> tuple[int, ...]:
    """The k's worth offering a node whose tensors have `shapes`: sorted, usually empty."""
    factors = split_factors(node.graph)
    if not factors:
        return ()
    sizes = {s for shape in shapes if shape is not None for s in shape}
    return tuple(sorted({k for size, k in factors if size in sizes}))


def _strided_spec(placements: tuple, k: int) -> tuple:
    return tuple(SS(p.dim, k) if p is not None and kind(p) == "S" else p for p in placements)


def strided_twins(strategies: list, ks: tuple) -> list:
    """Each strategy with a Shard, again with every Shard(d) as SS(d, k), for each k."""
    out = []
    for s in strategies:
        if not any(p is not None and kind(p) == "S" for p in (*s.outs, *s.ins)):
            continue
        for k in ks:
            out.append(type(s)(_strided_spec(s.outs, k), _strided_spec(s.ins, k)))
    return out


def stridable(rule):
    """Decorate a rule whose Shard strategies act index by index along the sharded dims: it also
    offers their strided twins for the node's split factors."""
    @functools.wraps(rule)
    def wrapped(call):
        found = rule(call)
        if not call.strided:
            return found
        return list(found) + strided_twins(found, call.strided)
    return wrapped
