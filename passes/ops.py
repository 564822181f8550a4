"""The abstract redistribute op: a graph node meaning "move this tensor from spec src to spec dst".

`insert_redistribute` adds these; `lower_collectives` replaces every one with functional
collectives. It is a plain Python function so a graph holding one still runs in one process: there
it only checks that no real movement is needed (world size 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def redistribute(x: torch.Tensor, src: str, dst: str) -> torch.Tensor:
    """Placeholder semantics before lowering: valid only when every mesh axis has size 1."""
    return x


redistribute.__module__ = "autopar.passes.ops"


def contiguous(x: torch.Tensor) -> torch.Tensor:
    """x itself when dense (a collective's input), else a dense copy: no copy for the common case."""
    return x if x.is_contiguous() else x.contiguous()


def dense_in_order(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    """x with its dims stored outermost-first in `order` (e.g. B,H,S,D stored as B,S,H,D), dense;
    x itself when it already is, else one copy. Later views in the graph rely on that layout."""
    moved = x.permute(order)
    if moved.is_contiguous():
        return x
    inverse = [order.index(d) for d in range(x.dim())]
    return moved.contiguous().permute(inverse)


contiguous.__module__ = dense_in_order.__module__ = "autopar.passes.ops"


BUCKET_BYTES = 25 * 2**20  # as autopar.planning.reshard.BUCKET_BYTES: the cost model prices this bucketing


def _buckets(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices grouped by dtype, each group cut into buckets of at most BUCKET_BYTES."""
    out: list[list[int]] = []
    by_dtype: dict = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for idxs in by_dtype.values():
        bucket, size = [], 0
        for i in idxs:
            nbytes = tensors[i].numel() * tensors[i].element_size()
            if bucket and size + nbytes > BUCKET_BYTES:
                out.append(bucket)
                bucket, size = [], 0
            bucket.append(i)
            size += nbytes
        out.append(bucket)
    return out


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors one after another in one new flat buffer: one copy each, also of a transposed
    weight gradient (reshape(-1) + cat would copy it twice)."""
    return _fill(torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device),
                 tensors)


@dataclass(frozen=True)
class InFlight:
    """Flat buckets whose collectives are in flight, and how to cut their results back into tensors:
    `buckets[k]` lists the tensors `flats[k]` carries, `shapes[i]` is result i's shape."""
    flats: tuple[torch.Tensor, ...]
    buckets: tuple[tuple[int, ...], ...]
    shapes: tuple[torch.Size, ...]


def bucket_buffer(numel: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """A flat gradient bucket allocated before its gradients are computed, so that `mm_into` can
    write them into their slots (passes/grads_into_buckets.py)."""
    return torch.empty(numel, dtype=dtype, device=device)


def mm_into(a: torch.Tensor, b: torch.Tensor, flat: torch.Tensor, offset: int) -> torch.Tensor:
    """mm(a, b) written straight into flat[offset:offset + m*n], its slot of a gradient bucket; the
    slot viewed as (m, n). The same BLAS call as mm, writing elsewhere."""
    m, n = a.shape[0], b.shape[1]
    return torch.mm(a, b, out=flat[offset:offset + m * n].view(m, n))


def _fill(flat: torch.Tensor, tensors: list[torch.Tensor]) -> torch.Tensor:
    """`flat` holding the tensors one after another: those `mm_into` computed in their slot are there
    already, the others are copied in."""
    sizes = [t.numel() for t in tensors]
    assert flat.numel() == sum(sizes), "grads_into_buckets laid the bucket out for other local sizes"
    for t, piece in zip(tensors, flat.split(sizes)):
        slot = piece.view(t.shape)
        if t.is_set_to(slot):
            continue  # computed in its slot (same storage, offset, sizes and strides)
        slot.copy_(t)  # (copy_ refuses a source overlapping its slot any other way)
    return flat


def start_all_reduce(tensors: list[torch.Tensor], op: str, group: str, into: torch.Tensor | None = None) -> InFlight:
    """Start all-reducing many tensors as few flat buckets (one collective each); returns at once.
    The flat buffer is this op's own copy, so the reduction runs in place (no second copy). With
    `into` (a `bucket_buffer`), the tensors go as one bucket in that buffer, where some already are."""
    c10d = torch.ops._c10d_functional
    if into is not None:
        buckets = [list(range(len(tensors)))]
        flats = [c10d.all_reduce_(_fill(into, tensors), op, group)]
    else:
        buckets = _buckets(tensors)
        flats = [c10d.all_reduce_(_flatten([tensors[i] for i in bucket]), op, group) for bucket in buckets]
    return InFlight(tuple(flats), tuple(map(tuple, buckets)), tuple(t.shape for t in tensors))


def start_reduce_scatter(tensors: list[torch.Tensor], op: str, n: int, group: str) -> InFlight:
    """Start reduce-scattering many tensors along dim 0 (each (n*a, ...)) as few flat buckets."""
    c10d = torch.ops._c10d_functional
    flats = []
    buckets = _buckets(tensors)
    for bucket in buckets:
        sizes = [tensors[i].numel() // n for i in bucket]
        rows = torch.empty(n, sum(sizes), dtype=tensors[bucket[0]].dtype, device=tensors[bucket[0]].device)
        for i, cols in zip(bucket, rows.split(sizes, dim=1)):  # one copy each, whatever the layout
            t = tensors[i]
            cols.view(n, t.shape[0] // n, *t.shape[1:]).copy_(t.unflatten(0, (n, t.shape[0] // n)))
        flats.append(c10d.reduce_scatter_tensor(rows, op, n, group))
    shapes = tuple(torch.Size((t.shape[0] // n, *t.shape[1:])) for t in tensors)
    return InFlight(tuple(flats), tuple(map(tuple, buckets)), shapes)


def wait_buckets(pending: InFlight) -> list[torch.Tensor]:
    """Wait for every bucket of `pending`; its results as views of the flat buffers."""
    c10d = torch.ops._c10d_functional
    out: list = [None] * len(pending.shapes)
    for flat, bucket in zip(pending.flats, pending.buckets):
        flat = c10d.wait_tensor(flat).reshape(-1)
        for i, piece in zip(bucket, flat.split([pending.shapes[i].numel() for i in bucket])):
            out[i] = piece.view(pending.shapes[i])
    return out


def fused_all_reduce(tensors: list[torch.Tensor], op: str, group: str) -> list[torch.Tensor]:
    """All-reduce many tensors as few flat buckets (one collective each), all in flight together."""
    return wait_buckets(start_all_reduce(tensors, op, group))


def fused_reduce_scatter(tensors: list[torch.Tensor], op: str, n: int, group: str) -> list[torch.Tensor]:
    """Reduce-scatter many tensors along dim 0 (each (n*a, ...)) as few flat buckets."""
    return wait_buckets(start_reduce_scatter(tensors, op, n, group))


start_all_reduce.__module__ = start_reduce_scatter.__module__ = wait_buckets.__module__ = "autopar.passes.ops"
bucket_buffer.__module__ = mm_into.__module__ = "autopar.passes.ops"
InFlight.__module__ = "autopar.passes.ops"
fused_all_reduce.__module__ = fused_reduce_scatter.__module__ = "autopar.passes.ops"


def fused_all_gather(tensors: list[torch.Tensor], n: int, group: str) -> list[torch.Tensor]:
    """All-gather many tensors along dim 0 (each (a, ...) -> (n*a, ...)) as few flat buckets."""
    c10d = torch.ops._c10d_functional
    out: list = [None] * len(tensors)
    for bucket in _buckets(tensors):
        flat = _flatten([tensors[i] for i in bucket])
        rows = c10d.wait_tensor(c10d.all_gather_into_tensor(flat, n, group)).view(n, -1)
        sizes = [tensors[i].numel() for i in bucket]
        for i, piece in zip(bucket, rows.split(sizes, dim=1)):
            shape = (tensors[i].shape[0] * n, *tensors[i].shape[1:])
            out[i] = piece.reshape(shape)
    return out


fused_all_gather.__module__ = "autopar.passes.ops"
