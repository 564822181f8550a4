"""Placements: how one tensor lives on one mesh axis, and helpers over per-axis tuples of them.

We use DTensor's own placement types (Replicate, Shard(dim), Partial(reduce_op)) so a Plan speaks the
same language as the runtime. A `Spec` is a tuple with one placement per mesh axis.
"""
from __future__ import annotations

import math
from typing import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

Spec = tuple  # tuple[Placement, ...], one per mesh axis

R = Replicate()
P = Partial("sum")
PAVG = Partial("avg")


def S(dim: int) -> Shard:
    return Shard(dim)


def is_shard(p: Placement, dim: int | None = None) -> bool:
    return isinstance(p, Shard) and (dim is None or p.dim == dim)


def is_partial(p: Placement) -> bool:
    return isinstance(p, Partial)


def to_str(p: Placement) -> str:
    """Compact text: R, S0, P, Pavg, Pmax."""
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Shard):
        return f"S{p.dim}"
    op = p.reduce_op
    return "P" if op == "sum" else f"P{op}"


def from_str(s: str) -> Placement:
    if s == "R":
        return R
    if s.startswith("S") and s[1:].isdigit():
        return Shard(int(s[1:]))
    if s == "P":
        return P
    if s.startswith("P") and s[1:] in ("avg", "max", "min"):
        return Partial(s[1:])
    raise ValueError(f"not a placement: {s!r} (expected R, S<dim>, P, Pavg, Pmax or Pmin)")


def spec_str(spec: Spec) -> str:
    return "(" + ",".join(to_str(p) for p in spec) + ")"


def shard_factor(spec: Spec, dim: int, axis_sizes: Sequence[int]) -> int:
    """How many pieces dimension `dim` is cut into by this spec."""
    return math.prod(n for p, n in zip(spec, axis_sizes) if is_shard(p, dim))


def divides(spec: Spec, shape: Sequence[int], axis_sizes: Sequence[int]) -> bool:
    """True when every sharded dimension splits evenly (uneven shards are never chosen)."""
    for p in spec:
        if isinstance(p, Shard) and not (0 <= p.dim < len(shape)):
            return False
    return all(shape[d] % shard_factor(spec, d, axis_sizes) == 0 for d in range(len(shape)))


def local_shape(spec: Spec, shape: Sequence[int], axis_sizes: Sequence[int]) -> tuple[int, ...]:
    return tuple(shape[d] // shard_factor(spec, d, axis_sizes) for d in range(len(shape)))


def local_fraction(spec: Spec, axis_sizes: Sequence[int]) -> float:
    """Fraction of the global tensor a device stores (Partial and Replicate store it whole)."""
    return 1.0 / math.prod(n for p, n in zip(spec, axis_sizes) if isinstance(p, Shard))


def replicated(ndim_mesh: int) -> Spec:
    return (R,) * ndim_mesh
