"""The cost of moving a tensor from one spec to another, one mesh axis at a time, in seconds.

Per axis (n devices, B = bytes of the tensor as held across that axis):
    S(i) -> R : all_gather(B)          P -> R    : all_reduce(B)
    P -> S(i) : reduce_scatter(B)      S(i)->S(j): all_to_all(B / n)
    R -> S(i) : free (local slice)     R -> P    : free (rank 0 keeps it, others zero; avg: as is)
    S(i) -> P : all_gather(B)          P(a)->P(b): all_reduce(B)
A strided shard (placement.SS) moves as a Shard (its gather, reduce-scatter and slice add only a local
reorder); between a strided and any other shard it goes through Replicate: all_gather(B) and a slice.
Axes are processed in mesh order and B follows the tensor as each axis changes (a gather on axis 0
makes the message on axis 1 larger). `steps()` lists the collectives, `time()` sums them.

Four refinements of plain alpha-beta, the first two mirrored by the runtime:
  * gradient collectives are bucketed (BUCKET_BYTES, as DDP/FSDP do): a gradient of B bytes pays
    min(1, B / BUCKET_BYTES) of one collective's latency, so 100 small biases do not cost 100 alphas;
  * parameters of one layer are all-gathered in one collective per phase
    (passes/bucket_layer_gathers.py, as FSDP2 gathers a layer's flat buffer): the all-gathers of a
    parameter's data edge pay the caller's `gather_share` of one collective's latency, launch
    overhead and sync latency (autopar/planning/problem.py: the parameter's bytes over the layer's, at least
    one over the layer's parameter count);
  * every collective but a bucketed gradient also pays a launch overhead of LAUNCH_FRACTION * alpha
    (a gathered parameter its share), which breaks ties towards fewer collectives (one all_reduce
    rather than reduce_scatter + all_gather);
  * each collective pays the hardware's `sync_latency` once: what a blocking collective adds when
    the ranks reach it from compute rather than back to back as calibration times alpha (CPU/gloo:
    ~1 ms); a bucketed gradient pays min(1, B / BUCKET_BYTES) of it, as of alpha, a gathered
    parameter its `gather_share`. Two collectives with no compute between them pay it twice here,
    once in the step: an upper bound for such pairs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from autopar.costmodel.comm import coefficients, collective_time
from autopar.costmodel.hardware import LinkSpec
from autopar.placement import R, Spec, is_partial, is_shard, is_strided, local_fraction

BUCKET_BYTES = 25 * 2**20
LAUNCH_FRACTION = 0.1


@dataclass(frozen=True)
class Step:
    kind: str      # all_gather | all_reduce | reduce_scatter | all_to_all
    axis: int
    nbytes: float  # the B of the collective formula


def axis_step(src, dst, axis: int, nbytes: float, n: int) -> Step | None:
    if src == dst or n == 1:
        return None
    if is_shard(dst):
        if is_partial(src):
            return Step("reduce_scatter", axis, nbytes)
        if is_shard(src) and (is_strided(src) or is_strided(dst)):
            return Step("all_gather", axis, nbytes)  # through Replicate, then a local slice
        if is_shard(src):
            return Step("all_to_all", axis, nbytes / n)
        return None  # R -> S: slice locally
    if is_partial(dst):
        if is_shard(src):
            return Step("all_gather", axis, nbytes)
        if is_partial(src):
            return Step("all_reduce", axis, nbytes)
        return None  # R -> P: mask (sum) or keep (avg)
    # dst is Replicate
    return Step("all_gather" if is_shard(src) else "all_reduce", axis, nbytes)


def _nested(spec: Spec) -> bool:
    dims = [p.dim for p in spec if is_shard(p)]
    return len(dims) != len(set(dims))


def _moved(src: Spec, dst: Spec) -> bool:
    """A dim sharded on one axis in src and on another axis in dst (shard order would change)."""
    return any(is_shard(p) and is_shard(q) and p.dim == q.dim and a != b
               for a, p in enumerate(src) for b, q in enumerate(dst))


def transitions(src: Spec, dst: Spec) -> list[tuple[int, object, object]]:
    """The per-axis moves (axis, from, to) that take `src` to `dst`, in execution order.

    Without a dim sharded on two axes (or moving from one axis to another), axes move independently
    in mesh order. Otherwise shards nest in axis order (a dim split on axis 0, then again on axis 1),
    so from the first axis that changes on, shards are gathered innermost first and then re-split
    outermost first.
    """
    if src == dst:
        return []
    if not (_nested(src) or _nested(dst) or _moved(src, dst)):
        return [(a, s, d) for a, (s, d) in enumerate(zip(src, dst)) if s != d]
    first = next(a for a in range(len(src)) if src[a] != dst[a])
    moves, current = [], list(src)
    for a in reversed(range(first, len(src))):
        if is_shard(current[a]) or (is_partial(current[a]) and current[a] != dst[a]):
            moves.append((a, current[a], R))
            current[a] = R
    for a in range(first, len(src)):
        if current[a] != dst[a]:
            moves.append((a, current[a], dst[a]))
            current[a] = dst[a]
    return moves


def steps(src: Spec, dst: Spec, nbytes: float, axis_sizes: tuple[int, ...]) -> list[Step]:
    """Collectives that turn a tensor of `nbytes` global bytes from spec `src` into `dst`."""
    out = []
    current = list(src)
    for axis, frm, to in transitions(src, dst):
        n = axis_sizes[axis]
        held = nbytes * local_fraction(tuple(p for a, p in enumerate(current) if a != axis),
                                       tuple(m for a, m in enumerate(axis_sizes) if a != axis))
        step = axis_step(frm, to, axis, held, n)
        if step is not None:
            out.append(step)
        current[axis] = to
    return out


def _shape_free(src: Spec, dst: Spec) -> list[tuple[str, int, tuple[int, ...], bool]]:
    """`steps` for any byte count and axis sizes above 1: (kind, axis, the other axes the held bytes are
    sharded on, all_to_all?) per step. Which collectives run, and on which axes, depends on the placements
    alone; the sizes only scale the bytes (`_sized`)."""
    out = []
    current = list(src)
    for axis, frm, to in transitions(src, dst):
        step = axis_step(frm, to, axis, 1.0, 2)
        if step is not None:
            sharded = tuple(a for a, p in enumerate(current) if a != axis and is_shard(p))
            out.append((step.kind, axis, sharded, step.kind == "all_to_all"))
        current[axis] = to
    return out


def _sized(free: list, axis_sizes: tuple[int, ...]) -> list[tuple[str, int, float, int]]:
    """`_shape_free`'s steps on a mesh of `axis_sizes` (a step on an axis of one device moves nothing):
    (kind, axis, fraction of the bytes held, divisor), so that step bytes = nbytes * fraction / divisor
    (the divisor only for all_to_all), as `steps` computes."""
    return [(kind, axis, 1.0 / math.prod(axis_sizes[a] for a in sharded), axis_sizes[axis] if a2a else 1)
            for kind, axis, sharded, a2a in free if axis_sizes[axis] != 1]


# spec -> number, and (src number, dst number) -> `_shape_free`, for every mesh of the process: the
# layout search prices the same placements on many sub-meshes, and working out their collectives
# (placement comparisons in Python) cost more than the prices themselves
_SPEC_NUMBERS: dict[Spec, int] = {}
_SHAPE_FREE: dict[tuple[int, int], list] = {}


class ReshardCost:
    """Prices spec changes on a mesh, caching by (src, dst, bytes, bucketed). Specs are keyed by a
    small integer (equal specs share one): hashing torch's Placement objects is slow Python, and the
    planner asks for the same few specs hundreds of thousands of times."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.axis_sizes = tuple(mesh.shape)
        self._times: dict[tuple, float] = {}
        self._pairs: dict[tuple[int, int], list] = {}          # (src, dst) -> `_sized` steps
        self._by_id: dict[int, tuple[Spec, int]] = {}          # id(spec) -> (spec kept alive, its number)
        self._terms = lru_cache(maxsize=None)(self._step_terms)
        self._affine: dict[tuple, np.ndarray] = {}   # `matrix`'s coefficients
        self._pair_coefficients: dict[tuple[int, int, bool], tuple] = {}   # `_coefficients` per spec pair
        self._all_reduces: dict[tuple, float] = {}   # `all_reduce_time`

    def _number(self, spec: Spec) -> int:
        found = self._by_id.get(id(spec))
        if found is None:   # the spec is held in _by_id, so its id is never reused for another object
            found = self._by_id[id(spec)] = (spec, _SPEC_NUMBERS.setdefault(spec, len(_SPEC_NUMBERS)))
        return found[1]

    def unique(self, specs: list) -> tuple[list, tuple[int, ...], list[int]]:
        """(the distinct specs of `specs` in first-seen order, their numbers, each spec's position among
        them): `dict.fromkeys` and an index of it, keyed by the specs' numbers (hashing Placements is slow
        Python, and the planner indexes the same spec lists for every edge of every build)."""
        where: dict[int, int] = {}
        firsts: list = []
        index = []
        for spec in specs:
            number = self._number(spec)
            at = where.get(number)
            if at is None:
                at = where[number] = len(firsts)
                firsts.append(spec)
            index.append(at)
        return firsts, tuple(where), index

    def step_time(self, step: Step, bucketed: bool = False, total_bytes: float | None = None,
                  gather_share: float = 1.0) -> float:
        link = self.mesh.hardware.link(self.mesh.link_kind(step.axis), step.kind)
        sync = self.mesh.hardware.sync_latency
        if bucketed:
            share = min(1.0, (total_bytes if total_bytes is not None else step.nbytes) / BUCKET_BYTES)
            latency = link.latency * share
        else:
            share = gather_share if step.kind == "all_gather" else 1.0
            latency = link.latency * share if share != 1.0 else link.latency
        t = collective_time(step.kind, step.nbytes, self.axis_sizes[step.axis], LinkSpec(link.bandwidth, latency))
        return t + share * sync if bucketed else t + LAUNCH_FRACTION * latency + share * sync

    def _step_terms(self, kind: str, axis: int) -> tuple[float, float, float, float]:
        """(bw(n), hops(n), bandwidth, latency) of one collective kind on one axis: what `step_time` looks up."""
        link = self.mesh.hardware.link(self.mesh.link_kind(axis), kind)
        return (*coefficients(kind, self.axis_sizes[axis]), link.bandwidth, link.latency)

    def _compute(self, templates: list, nbytes: float, bucketed: bool, gather_share: float) -> float:
        # the same floating-point operations as summing step_time over steps(src, dst, nbytes), with
        # the per-(kind, axis) lookups cached: collective_time is bw * B / bandwidth + hops * latency
        total = 0
        sync = self.mesh.hardware.sync_latency
        for kind, axis, frac, div in templates:
            step_bytes = nbytes * frac / div if div != 1 else nbytes * frac
            bw, hops, bandwidth, latency = self._terms(kind, axis)
            if bucketed:
                share = min(1.0, nbytes / BUCKET_BYTES)
                t = bw * step_bytes / bandwidth + hops * (latency * share) + share * sync
            else:
                share = gather_share if kind == "all_gather" else 1.0
                if share != 1.0:
                    latency = latency * share
                t = bw * step_bytes / bandwidth + hops * latency + LAUNCH_FRACTION * latency + share * sync
            total += t
        return total

    def time(self, src: Spec, dst: Spec, nbytes: float, bucketed: bool = False, gather_share: float = 1.0) -> float:
        """Seconds of src -> dst for a tensor of `nbytes` (`gather_share`: of the latencies its
        non-bucketed all-gathers pay, see the module docstring)."""
        if src is dst:
            return 0.0
        pair = (self._number(src), self._number(dst))
        key = (*pair, float(nbytes), bucketed, gather_share)
        t = self._times.get(key)
        if t is None:
            templates = self._pair(src, dst, *pair)
            t = self._times[key] = self._compute(templates, float(nbytes), bucketed, gather_share) or 0.0
        return t

    def matrix(self, a_specs: list, b_specs: list, nbytes: float, bucketed: bool = False,
               gather_share: float = 1.0) -> np.ndarray:
        """`time(a, b, nbytes, ...)` for every a in a_specs (rows) and b in b_specs (columns). A pair's
        price is affine in the bytes and in `gather_share`: slope * nbytes + fixed + gather_share *
        gathered (a bucketed gradient's latencies times min(1, nbytes / BUCKET_BYTES) instead), so each
        pair's coefficients are found once per mesh and every tensor after is one array expression: the
        planner prices the same spec lists at the bytes of every tensor, micro-batch size and layer share
        (Llama-3-70B's search: ~1.8M pair prices without this)."""
        key = (tuple(map(self._number, a_specs)), tuple(map(self._number, b_specs)), bucketed)
        coef = self._affine.get(key)
        if coef is None:
            known, none = self._pair_coefficients, (0.0, 0.0, 0.0)
            rows = []
            for a, na in zip(a_specs, key[0]):
                row = []
                for b, nb in zip(b_specs, key[1]):
                    found = known.get((na, nb, bucketed)) if na != nb else none
                    if found is None:   # a pair recurs in many spec lists
                        found = known[na, nb, bucketed] = self._coefficients(self._pair(a, b, na, nb), bucketed)
                    row.append(found)
                rows.append(row)
            coef = self._affine[key] = np.array(rows, dtype=float).reshape(len(a_specs), len(b_specs), 3) \
                .transpose(2, 0, 1)
        slope, fixed, gathered = coef
        nbytes = float(nbytes)
        if bucketed:
            return slope * nbytes + min(1.0, nbytes / BUCKET_BYTES) * fixed
        return slope * nbytes + fixed + gather_share * gathered

    def reduces(self, a_specs: list, b_specs: list) -> np.ndarray:
        """Per (a, b): does resharding a -> b all-reduce or reduce-scatter? Cached per pair."""
        out = np.zeros((len(a_specs), len(b_specs)), dtype=bool)
        for i, (a, na) in enumerate(zip(a_specs, map(self._number, a_specs))):
            for j, (b, nb) in enumerate(zip(b_specs, map(self._number, b_specs))):
                out[i, j] = na != nb and any(t[0] in ("all_reduce", "reduce_scatter") for t in self._pair(a, b, na, nb))
        return out

    def _pair(self, src: Spec, dst: Spec, ns: int, nd: int) -> list:
        templates = self._pairs.get((ns, nd))
        if templates is None:
            free = _SHAPE_FREE.get((ns, nd))
            if free is None:
                free = _SHAPE_FREE[ns, nd] = _shape_free(src, dst)
            templates = self._pairs[ns, nd] = _sized(free, self.axis_sizes)
        return templates

    def _coefficients(self, templates: list, bucketed: bool) -> tuple[float, float, float]:
        """(seconds per byte, fixed seconds, seconds per unit of gather_share) of `_compute`'s sum;
        bucketed, the fixed part is what min(1, nbytes / BUCKET_BYTES) scales (latencies and sync)."""
        slope = fixed = gathered = 0.0
        sync = self.mesh.hardware.sync_latency
        for kind, axis, frac, div in templates:
            bw, hops, bandwidth, latency = self._terms(kind, axis)
            slope += bw * frac / div / bandwidth
            if bucketed:
                fixed += hops * latency + sync
            elif kind == "all_gather":   # its latencies, launch and sync scale with the share
                gathered += hops * latency + LAUNCH_FRACTION * latency + sync
            else:
                fixed += hops * latency + LAUNCH_FRACTION * latency + sync
        return slope, fixed, gathered

    def all_reduce_time(self, src: Spec, dst: Spec, nbytes: float) -> float:
        """The all-reduce steps' share of `time(src, dst, nbytes, bucketed=True)` (a gradient's reshard: the
        part that runs once per step, `autopar.pipeline.layer_profile`), cached per (src, dst, bytes)."""
        key = (self._number(src), self._number(dst), float(nbytes))
        t = self._all_reduces.get(key)
        if t is None:
            t = self._all_reduces[key] = sum(self.step_time(st, bucketed=True, total_bytes=nbytes)
                                             for st in self.steps(src, dst, nbytes) if st.kind == "all_reduce")
        return t

    def steps(self, src: Spec, dst: Spec, nbytes: float) -> list[Step]:
        return steps(src, dst, nbytes, self.axis_sizes)
