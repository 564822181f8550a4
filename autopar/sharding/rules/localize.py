"""Rewrite an op's shape arguments from global to local sizes under a chosen strategy.

Shape-carrying ops (view, expand, full, new_zeros, ...) bake the global shape into their arguments;
running them on shards needs the local shape. A slice whose end covers a sharded dimension keeps
covering it. A split of a strided dim (autopar/sharding/rules/strided.py) splits the local shard into the same
number of pieces. Every other op's arguments are shape-free and stay as they are.
"""
from __future__ import annotations

import torch

from autopar.placement import local_shape

aten = torch.ops.aten

# op packet -> position of its size argument
SIZE_ARG = {aten.view: 1, aten.view_copy: 1, aten._unsafe_view: 1, aten.reshape: 1, aten.expand: 1,
            aten.expand_copy: 1, aten.full: 0, aten.zeros: 0, aten.ones: 0, aten.empty: 0,
            aten.new_zeros: 1, aten.new_ones: 1, aten.new_empty: 1, aten.new_full: 1, aten.empty_permuted: 0,
            aten.empty_strided: 0}

# splits whose size argument (position 1) counts elements of the split dim (chunk counts pieces: as is)
SPLIT_ARG = {aten.split, aten.split_copy, aten.split_with_sizes, aten.split_with_sizes_copy}


def localize_args(target, args: tuple, out_shape, out_spec, in_shape, in_spec, axis_sizes) -> tuple:
    """Return `args` with global sizes replaced by local ones; `out_spec`/`in_spec` may be None."""
    packet = getattr(target, "overloadpacket", None)
    if packet in SIZE_ARG and out_spec is not None:
        pos = SIZE_ARG[packet]
        args = list(args)
        local = list(local_shape(out_spec, out_shape, axis_sizes))
        if packet in (aten.expand, aten.expand_copy):  # keep -1 entries meaning "unchanged"
            local = [-1 if g == -1 else l for g, l in zip(args[pos], local)]
        args[pos] = local
        if packet is aten.empty_strided:
            args[1] = list(torch.empty(local, device="meta").stride())
        return tuple(args)
    if packet in SPLIT_ARG and in_spec is not None:  # a split of a strided dim: local piece sizes
        dim = args[2] if len(args) > 2 else 0
        dim = dim + len(in_shape) if dim < 0 else dim
        loc = local_shape(in_spec, in_shape, axis_sizes)[dim]
        if loc != in_shape[dim]:
            sizes = args[1]
            args = list(args)
            args[1] = [v * loc // in_shape[dim] for v in sizes] if isinstance(sizes, (list, tuple)) \
                else sizes * loc // in_shape[dim]
            return tuple(args)
        return args
    if packet in (aten.slice, aten.slice_copy) and in_spec is not None:
        dim = args[1] if len(args) > 1 else 0
        dim = dim + len(in_shape) if dim < 0 else dim
        loc_in = local_shape(in_spec, in_shape, axis_sizes)
        if loc_in[dim] != in_shape[dim]:  # sharded dim: only full slices are allowed there
            args = list(args) + [None] * (4 - len(args))
            args[2], args[3] = 0, loc_in[dim]
            return tuple(args)
    return args
