"""View, permute, expand, slice, cat/split, select, gather/scatter/index: shards follow the dims.

A view maps input dim i to output dim j when the dims before them hold the same number of elements
(both shards then cut the same contiguous blocks of the flat buffer). Everything here is linear, so
Partial passes through unchanged.
"""
from __future__ import annotations

import math

import torch

from autopar.placement import PAVG, SS, P, R, S
from autopar.sharding.rules.registry import OpCall, normalize_dim, register
from autopar.sharding.rules.strided import equal_cat, equal_split, stridable

aten = torch.ops.aten


def _partials(call: OpCall, tensors) -> list:
    n_out = len(call.outs)
    return [call.strat((p,) * n_out, {t.idx: p for t in tensors}) for p in (P, PAVG)]


def view_dim_map(src: tuple[int, ...], dst: tuple[int, ...]) -> dict[int, int]:
    """src dim -> dst dim whose shards coincide (same element count before both, both sizes > 1)."""
    dst_prefix = {}
    acc = 1
    for j, size in enumerate(dst):
        if size > 1:
            dst_prefix.setdefault(acc, j)
        acc *= size
    out, acc = {}, 1
    for i, size in enumerate(src):
        if size > 1 and acc in dst_prefix:
            out[i] = dst_prefix[acc]
        acc *= size
    return out


@register(aten.view, aten.view_copy, aten._unsafe_view, aten.reshape, aten.unsqueeze, aten.squeeze,
          aten.unsqueeze_copy, aten.squeeze_copy, aten.flatten, aten.unflatten)
@stridable
def view_rule(call: OpCall) -> list:
    x = call.args[0]
    strats = [call.strat(S(j), {x.idx: S(i)}) for i, j in view_dim_map(x.shape, call.out.shape).items()]
    return strats + _partials(call, [x])


@register(aten.permute, aten.permute_copy)
@stridable
def permute_rule(call: OpCall) -> list:
    x, dims = call.args[0], [normalize_dim(d, call.args[0].ndim) for d in call.args[1]]
    strats = [call.strat(S(k), {x.idx: S(d)}) for k, d in enumerate(dims) if x.shape[d] > 1]
    return strats + _partials(call, [x])


@register(aten.transpose, aten.transpose_copy, aten.t, aten.t_copy)
@stridable
def transpose_rule(call: OpCall) -> list:
    x = call.args[0]
    if x.ndim < 2:
        return _partials(call, [x])
    d0, d1 = (call.args[1], call.args[2]) if len(call.args) > 2 else (0, 1)
    d0, d1 = normalize_dim(d0, x.ndim), normalize_dim(d1, x.ndim)
    swap = {d0: d1, d1: d0}
    strats = [call.strat(S(swap.get(d, d)), {x.idx: S(d)}) for d in range(x.ndim) if x.shape[d] > 1]
    return strats + _partials(call, [x])


@register(aten.expand, aten.expand_copy)
@stridable
def expand_rule(call: OpCall) -> list:
    x, out = call.args[0], call.out
    off = out.ndim - x.ndim
    strats = [call.strat(S(d + off), {x.idx: S(d)}) for d in range(x.ndim)
              if x.shape[d] > 1 and x.shape[d] == out.shape[d + off]]
    return strats + _partials(call, [x])


def _other_dims(call: OpCall, tensors, dim: int) -> list:
    """Shard every dim except `dim` on all tensors and outputs (same rank everywhere)."""
    strats = []
    for d in range(call.out.ndim):
        if d == dim or call.out.shape[d] == 1:
            continue
        if all(t.shape[d] == call.out.shape[d] for t in tensors):
            strats.append(call.strat((S(d),) * len(call.outs), {t.idx: S(d) for t in tensors}))
    return strats


@register(aten.slice, aten.slice_copy)
def slice_rule(call: OpCall) -> list:
    x = call.args[0]
    dim = normalize_dim(call.args[1] if len(call.args) > 1 else 0, x.ndim)
    strats = _other_dims(call, [x], dim)
    if x.shape == call.out.shape and x.shape[dim] > 1:  # a full slice is the identity
        strats.append(call.strat(S(dim), {x.idx: S(dim)}))
    return strats + _partials(call, [x])


@register(aten.slice_scatter)
def slice_scatter_rule(call: OpCall) -> list:
    x, src = call.args[0], call.args[1]
    dim = normalize_dim(call.args[2] if len(call.args) > 2 else 0, x.ndim)
    return _other_dims(call, [x, src], dim) + _partials(call, [x, src])


@register(aten.cat)
def cat_rule(call: OpCall) -> list:
    tensors = [t for t in call.args[0] if hasattr(t, "idx") and t.shape != (0,)]
    if len(tensors) != len(call.args[0]):
        return []
    dim = normalize_dim(call.args[1] if len(call.args) > 1 else 0, call.out.ndim)
    strats = _other_dims(call, tensors, dim) + _partials(call, tensors)
    hit = equal_cat(call.node)
    if hit is not None and hit[2] in call.strided:  # k equal Shard(d) pieces -> SS(d, k)
        strats.append(call.strat(SS(dim, hit[2]), {t.idx: S(dim) for t in tensors}))
    return strats


@register(aten.split, aten.split_with_sizes, aten.split_copy, aten.split_with_sizes_copy, aten.unbind,
          aten.unbind_copy, aten.chunk)
def split_rule(call: OpCall) -> list:
    x = call.args[0]
    pos = 1 if call.target.overloadpacket in (aten.unbind, aten.unbind_copy) else 2
    dim = normalize_dim(call.args[pos] if len(call.args) > pos else 0, x.ndim)
    strats = []
    for d in range(x.ndim):
        if d == dim or x.shape[d] == 1:
            continue
        od = d if call.out.ndim == x.ndim else (d if d < dim else d - 1)
        strats.append(call.strat((S(od),) * len(call.outs), {x.idx: S(d)}))
    hit = equal_split(call.node)
    if hit is not None and hit[2] in call.strided:  # SS(d, k) into its k pieces: each S(d)
        strats.append(call.strat((S(dim),) * len(call.outs), {x.idx: SS(dim, hit[2])}))
    return strats + _partials(call, [x])


@register(aten.select, aten.select_copy)
def select_rule(call: OpCall) -> list:
    x = call.args[0]
    dim = normalize_dim(call.args[1], x.ndim)
    strats = [call.strat(S(d if d < dim else d - 1), {x.idx: S(d)}) for d in range(x.ndim)
              if d != dim and x.shape[d] > 1]
    return strats + _partials(call, [x])


@register(aten.gather, aten.scatter, aten.scatter_add, aten.scatter_reduce)
def gather_scatter_rule(call: OpCall) -> list:
    tensors = call.tensor_args()
    dim = normalize_dim(call.args[1], call.args[0].ndim)
    return _other_dims(call, tensors, dim)


@register(aten.index_select)
def index_select_rule(call: OpCall) -> list:
    x = call.args[0]
    dim = normalize_dim(call.args[1], x.ndim)
    return [call.strat(S(d), {x.idx: S(d)}) for d in range(x.ndim) if d != dim and x.shape[d] > 1] + \
        _partials(call, [x])


def _index_layout(call: OpCall):
    """For x[idx0, idx1, ...] with k leading tensor indices: (k, index shape) or None."""
    indices = call.args[1]
    if not indices or any(not hasattr(i, "idx") for i in indices):
        return None
    shapes = {i.shape for i in indices}
    if len(shapes) != 1:
        return None
    return len(indices), next(iter(shapes))


@register(aten.index.Tensor)
def index_rule(call: OpCall) -> list:
    x, layout = call.args[0], _index_layout(call)
    if layout is None:
        return []
    k, ishape = layout
    idx_ids = {i.idx for i in call.args[1]}
    strats = [call.strat(S(len(ishape) + d - k), {x.idx: S(d)}) for d in range(k, x.ndim) if x.shape[d] > 1]
    strats += [call.strat(S(d), {**{i: S(d) for i in idx_ids}, x.idx: R}) for d in range(len(ishape))
               if ishape[d] > 1]
    return strats + [call.strat(p, {x.idx: p}) for p in (P, PAVG)]


@register(aten.index_put)
def index_put_rule(call: OpCall) -> list:
    """x[idx] (+)= v: trailing dims shard with v; with accumulate, split indices+values -> Partial."""
    x, layout, v = call.args[0], _index_layout(call), call.args[2]
    if layout is None:
        return []
    k, ishape = layout
    idx_ids = {i.idx for i in call.args[1]}
    voff = v.ndim - (x.ndim - k)
    strats = [call.strat(S(d), {x.idx: S(d), v.idx: S(voff + d - k)}) for d in range(k, x.ndim)
              if x.shape[d] > 1 and voff + d - k >= 0 and v.shape[voff + d - k] == x.shape[d]]
    accumulate = len(call.args) > 3 and call.args[3]
    if accumulate:
        for d in range(len(ishape)):
            if ishape[d] > 1 and v.ndim == len(ishape) + x.ndim - k and v.shape[d] == ishape[d]:
                strats.append(call.strat(P, {x.idx: P, v.idx: S(d), **{i: S(d) for i in idx_ids}}))
        strats.append(call.strat(P, {x.idx: P, v.idx: P}))
    return strats


@register(aten.constant_pad_nd)
def pad_rule(call: OpCall) -> list:
    x, pad = call.args[0], call.args[1]
    padded = {x.ndim - 1 - i // 2 for i in range(len(pad)) if pad[i] != 0}
    return [call.strat(S(d), {x.idx: S(d)}) for d in range(x.ndim) if d not in padded and x.shape[d] > 1]


def numel(shape) -> int:
    return math.prod(shape)
