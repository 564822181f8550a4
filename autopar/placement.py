"""Placements: how one tensor lives on one mesh axis, and helpers over per-axis tuples of them.

We use DTensor's own placement types (Replicate, Shard(dim), Partial(reduce_op)) so a Plan speaks the
same language as the runtime. A `Spec` is a tuple with one placement per mesh axis.

A strided shard `SS(dim, k)` (DTensor's `_StridedShard(dim, split_factor=k)`) views `dim` as k equal
contiguous pieces and shards each over the axis: rank r holds [piece0_r; piece1_r; ...; piece(k-1)_r].
It is what a column split of a fused [q; k; v] projection needs (k=3: each rank whole heads of q, k
and v). Its `kind` is "S" (it splits work and memory as a Shard does); `is_strided` tells the two
apart wherever the order of the rows matters (resharding, lowering, local slices). Text form: S<dim>k<k>.
"""
from __future__ import annotations

import math
from typing import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar._torch_compat import StridedShard, strided_shard

Spec = tuple  # tuple[Placement, ...], one per mesh axis

R = Replicate()
P = Partial("sum")
PAVG = Partial("avg")


def S(dim: int) -> Shard:
    return Shard(dim)


def SS(dim: int, k: int):
    """Strided shard: `dim` viewed as k equal pieces, each sharded over the axis."""
    return strided_shard(dim, k)


# type -> "R" | "S" | "P" ("" for anything else). A dict lookup, because isinstance against DTensor's
# placement classes is slow in torch 2.13: a Python __instancecheck__ runs on every negative answer.
_KINDS: dict[type, str] = {Replicate: "R", Shard: "S", Partial: "P", StridedShard: "S"}


def kind(p) -> str:
    """The letter of a placement's class: R (Replicate), S (Shard), P (Partial), subclasses included;
    the empty string for anything else."""
    k = _KINDS.get(type(p))
    if k is None:
        k = _KINDS[type(p)] = ("S" if isinstance(p, Shard) else "P" if isinstance(p, Partial)
                               else "R" if isinstance(p, Replicate) else "")
    return k


def is_shard(p: Placement, dim: int | None = None) -> bool:
    return kind(p) == "S" and (dim is None or p.dim == dim)


def is_partial(p: Placement) -> bool:
    return kind(p) == "P"


def is_strided(p: Placement) -> bool:
    return type(p) is StridedShard


def pieces(p: Placement) -> int:
    """k of a strided shard, 1 for a plain one."""
    return p.split_factor if type(p) is StridedShard else 1


def to_str(p: Placement) -> str:
    """Compact text: R, S0, P, Pavg, Pmax."""
    k = kind(p)
    if k == "R":
        return "R"
    if k == "S":
        return f"S{p.dim}k{p.split_factor}" if is_strided(p) else f"S{p.dim}"
    op = p.reduce_op
    return "P" if op == "sum" else f"P{op}"


def from_str(s: str) -> Placement:
    if s == "R":
        return R
    if s.startswith("S") and s[1:].isdigit():
        return Shard(int(s[1:]))
    if s.startswith("S") and "k" in s and all(x.isdigit() for x in s[1:].split("k")) and s.count("k") == 1:
        dim, k = s[1:].split("k")
        return SS(int(dim), int(k))
    if s == "P":
        return P
    if s.startswith("P") and s[1:] in ("avg", "max", "min"):
        return Partial(s[1:])
    raise ValueError(f"not a placement: {s!r} (expected R, S<dim>, S<dim>k<pieces>, P, Pavg, Pmax or Pmin)")


def spec_str(spec: Spec) -> str:
    return "(" + ",".join(to_str(p) for p in spec) + ")"


def shard_factor(spec: Spec, dim: int, axis_sizes: Sequence[int]) -> int:
    """How many pieces dimension `dim` is cut into by this spec."""
    return math.prod(n for p, n in zip(spec, axis_sizes) if kind(p) == "S" and p.dim == dim)


def divides(spec: Spec, shape: Sequence[int], axis_sizes: Sequence[int]) -> bool:
    """True when every sharded dimension splits evenly (uneven shards are never chosen). A strided
    dim needs k * n equal pieces and is split on no other axis (nesting is not modelled)."""
    cuts: dict[int, int] = {}  # dim -> shard_factor(spec, dim, axis_sizes) * k, for sharded dims
    strided: set[int] = set()
    for p, n in zip(spec, axis_sizes):
        if kind(p) == "S":
            d = p.dim
            if not 0 <= d < len(shape) or (d in cuts and (d in strided or is_strided(p))):
                return False
            if is_strided(p):
                strided.add(d)
            cuts[d] = cuts.get(d, 1) * n * pieces(p)
    return all(shape[d] % f == 0 for d, f in cuts.items())


def local_shape(spec: Spec, shape: Sequence[int], axis_sizes: Sequence[int]) -> tuple[int, ...]:
    return tuple(shape[d] // shard_factor(spec, d, axis_sizes) for d in range(len(shape)))


def local_ranges(spec: Spec, shape: Sequence[int], coords: Sequence[int],
                 axis_sizes: Sequence[int]) -> list[list[tuple[int, int]]]:
    """Per dimension, the [start, stop) ranges of the global tensor that the device at `coords` holds,
    in the order its local block stacks them: one range, or k for a strided shard (a block of each
    piece). What a reader of one slice of a checkpoint needs (`autopar/runtime/safetensors_io.py`)."""
    loc = local_shape(spec, shape, axis_sizes)
    out = []
    for d, n in enumerate(shape):
        if loc[d] == n:
            out.append([(0, n)])
            continue
        k = math.prod(pieces(p) for p in spec if kind(p) == "S" and p.dim == d)
        offset, size = 0, n // k
        for axis, p in enumerate(spec):   # nested chunks in mesh-axis order
            if kind(p) == "S" and p.dim == d:
                size //= axis_sizes[axis]
                offset += coords[axis] * size
        out.append([(j * (n // k) + offset, j * (n // k) + offset + size) for j in range(k)])
    return out


def local_fraction(spec: Spec, axis_sizes: Sequence[int]) -> float:
    """Fraction of the global tensor a device stores (Partial and Replicate store it whole)."""
    return 1.0 / math.prod(n for p, n in zip(spec, axis_sizes) if kind(p) == "S")


def replicated(ndim_mesh: int) -> Spec:
    return (R,) * ndim_mesh
