"""Pipeline stages: schedule formulas and the exact contiguous split of layers into stages.

Pure Python/numpy (torch only for zero bubble's action order, through `_torch_compat`): the search prices
thousands of candidate splits.

Units. A model is a sequence of L `LayerCost` units that cannot be cut inside (embedding, one
block, head+loss). A stage is a contiguous run of units [a, b]. Its time per micro-batch is

    t(a, b) = sum_{l=a..b} (fwd_l + bwd_l) + [b < L-1] c(b) + [a > 0] c(a-1)

where c(l) = p2p_time(boundary_bytes_l) is one point-to-point transfer across the cut after unit l.
Each cut is crossed twice per micro-batch (the activation forward, its gradient backward) and each
crossing is charged to the sending stage (a blocking send), so a cut costs both neighbours c(l).

Schedules (p stages, m micro-batches, times t_i = f_i + b_i):
    gpipe, 1f1b         step = sum_i t_i + (m - 1) * max_i t_i
    interleaved_1f1b    p*v virtual stages (chunks), device d holds chunks d, d+p, ...;
                        step = sum_j t_j / v + (m - 1/v) * max_d D_d,  D_d = sum of d's chunks
    zero_bubble         each stage's backward as B (input gradients) and W (weight gradients, t_i = f_i +
                        b_i + w_i), run in torch's ZB-H1 order (`ScheduleInterleavedZeroBubble`, one stage
                        per device): step = the longest path of that order with these times
                        (`zero_bubble_step`); balanced, m(f + b + w) + (p - 1)(f + b - w). Interleaved
                        zero bubble: the same on v chunks per device (d, d + p, ...); zero_bubble_v:
                        torch's ZB-V order (`ScheduleZBVZeroBubble`) on two chunks per device in a V
                        (d and 2p - 1 - d), priced the same way, the cut between chunks p - 1 and p (one
                        device, no transfer) free
    bubble fraction     (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1) (balanced stages)
The first term is the first micro-batch's trip through every stage (fill and drain), the second
the steady state paced by the slowest stage. Both are exact for a flow shop of identical jobs
whose backward pass is paced by the same stage as the forward (tests check a simulated timeline);
for 1F1B with uneven stages it is an upper bound (an early bottleneck overlaps its warm-up with
later stages; < 10% on random 2-8 stage tests), so the search never over-promises.

Memory of stage k (bytes per device): state(a..b) + in_flight(k) * activations(a..b), where
in_flight is m for GPipe (every micro-batch's activations are kept until the backward pass),
min(m, p - k) for 1F1B (stage k runs p - k forwards before its first backward) and, for zero bubble,
the peak count of forwards whose W has not run in torch's order (min(m, p) on every stage), plus on
stages k >= 1 the gradients B hands W (`LayerCost.carried_bytes`) of the most micro-batches waiting
between their B and W (k + 1): an upper bound (`memory_counts`; measured: benchmarks/pipeline_memory.py).

`partition` is exact for gpipe and 1f1b. With T[a, b] the stage-time matrix and mask_k[a, b] the
memory-fits matrix of stage k, the objective sum_k T_k + (m-1) max_k T_k is minimised by
enumerating the bottleneck B over the distinct values of T in ascending order; for each B a DP

    F_k[b] = min_{a : T[a,b] <= B, mask_k[a,b]} F_{k-1}[a-1] + T[a, b]

gives the least sum of stage times whose maximum is at most B, and F_{p-1}[L-1] + (m-1) B bounds
the objective of the split it returns from above (equal when its maximum is B). The scan stops
once (least unconstrained sum) + (m-1) B exceeds the best value found: no larger B can win.
For interleaved_1f1b the same search runs over p*v chunks minimising sum_j t_j / v + (m v - 1) max_j t_j
(an upper bound of the device formula, as D_d <= v max_j t_j) with each chunk within its round's share
of the budget (evenly, then the first round given 0.4 and 0.6 of it: `ROUND_SHARES`); every
bottleneck's split is priced by the device formula, the fastest kept, and then improved by moving one
chunk boundary at a time while the device formula falls and every device's chunks fit (`_improve`):
a sound plan, not proven optimal across the non-contiguous device groups (Llama-3-70B, pp 8, m 32,
80 GB: 7.052 s by the surrogate alone, 6.537 s now).
A tensor several units read (LayerCost.shared: a tied embedding) is counted in its first reader's
unit; a device whose stages read it without holding that unit keeps its own copy and adds its state bytes
and per-step seconds once (the runtime holds, steps, gathers and reduces it once on every such device: a
device's chunks share one copy; `_Shared.excess` takes off what the per-chunk matrices count twice).
Per-step costs (LayerCost.per_step: gradient sync, optimizer) run once after the drain, all stages
in parallel: the step time adds max_k (per-step seconds of stage k) to each bottleneck's split, and the
fastest is kept. The split is exact for the per-micro-batch objective; the per-step term only chooses
among those splits.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from autopar.costmodel.memory import format_bytes
from autopar.errors import InfeasiblePlanError, InputError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "interleaved_zero_bubble", "zero_bubble_v")
ZERO_BUBBLE = "zero_bubble"
INTERLEAVED_ZERO_BUBBLE = "interleaved_zero_bubble"
ZERO_BUBBLE_V = "zero_bubble_v"   # torch's ScheduleZBVZeroBubble: two chunks per device in a V
ZERO_BUBBLES = (ZERO_BUBBLE, INTERLEAVED_ZERO_BUBBLE, ZERO_BUBBLE_V)   # B and W apart, in torch's own order
INTERLEAVED = ("interleaved_1f1b", INTERLEAVED_ZERO_BUBBLE)  # v chunks per device, "loop" placement
V_SHAPED = (ZERO_BUBBLE_V,)   # two chunks per device, "v" placement: device d holds chunks d and 2p - 1 - d
ROUND_SHARES = (0.4, 0.6)   # `_round_shares`: the first round's share of a device's budget, besides 1 / v
INTERLEAVE = 2            # chunks per device (v) of the interleaved schedules, unless the caller says otherwise


def chunks_per_device(schedule: str, v: int = INTERLEAVE) -> int:
    """v for the interleaved schedules (`INTERLEAVED`), 2 for the V-shaped ones, 1 for the others."""
    return v if schedule in INTERLEAVED else 2 if schedule in V_SHAPED else 1


def chunk_device(schedule: str, p: int, chunk: int) -> int:
    """The device (pipeline rank) of chunk `chunk` of p * v: chunk % p ("loop": d, d + p, ...), or in a V
    (`V_SHAPED`) chunk for the first p and 2p - 1 - chunk for the rest."""
    if schedule in V_SHAPED and chunk >= p:
        return 2 * p - 1 - chunk
    return chunk % p


def device_chunks(schedule: str, p: int, v: int) -> np.ndarray:
    """Chunk indices as a (v, p) array: row r, column d is device d's chunk of round r (`chunk_device`)."""
    order = np.arange(p * v).reshape(v, p)
    if schedule in V_SHAPED:
        order[1] = order[1][::-1]
    return order


def _per_device(x: np.ndarray, schedule: str, p: int, v: int) -> np.ndarray:
    """Per chunk values summed per device (`device_chunks`)."""
    return x[device_chunks(schedule, p, v)].sum(axis=0)


@dataclass(frozen=True)
class LayerCost:
    """One contiguous unit that cannot be cut inside (embedding, one block, head+loss)."""
    name: str                 # module path, e.g. "transformer.h.3" (or a group label for top-level ops)
    forward: float            # seconds per micro-batch, forward, incl. its intra-stage collectives
    backward: float           # seconds per micro-batch, backward
    state_bytes: float        # per device: params + grads + optimizer state of this unit
    activation_bytes: float   # per device per micro-batch: kept for backward
    boundary_bytes: float     # per device per micro-batch: the activation this unit sends to the next one
    per_step: float = 0.0     # seconds once per step, not per micro-batch: gradient all-reduces,
                              # optimizer update, ZeRO parameter gathers (added after the drain)
    # tensors that several units read (a tied embedding: <pre> and <post>), as (key, state bytes, per-step
    # seconds), listed by every reader and counted in the first one's state_bytes and per_step: a stage
    # without that first reader holds its own copy (state, ZeRO-1/2 gather, optimizer update, gradient
    # reduction), once
    shared: tuple = ()
    weight: float = 0.0       # seconds of `backward` that only parameter gradients need (zero-bubble's W)
    carried_bytes: float = 0.0   # per device per micro-batch: the gradients zero bubble's B hands its W, held
                                 # from B until W runs (zero bubble only: `memory_counts`)


@dataclass(frozen=True)
class StageSplit:
    """A split of the units into stages (chunks for interleaved) and its predicted schedule."""
    bounds: tuple[int, ...]         # first layer index of each stage (len p, or p*v chunks; bounds[0] == 0)
    stage_times: tuple[float, ...]  # forward+backward per micro-batch of each stage (incl. p2p)
    stage_memory: tuple[float, ...] # bytes per device of each stage, in-flight activations included
    step_time: float                # the schedule's predicted step time (seconds)
    bubble_fraction: float          # idle fraction of the step


def _check_schedule(schedule: str, p: int, m: int, v: int) -> None:
    if schedule not in SCHEDULES:
        raise InputError(f"unknown pipeline schedule {schedule!r}; valid: {SCHEDULES}")
    if p < 1 or m < 1 or v < 1:
        raise InputError(f"stages, micro-batches and chunks must be >= 1, got p={p}, m={m}, v={v}")


def bubble_fraction(p: int, m: int, schedule: str, v: int = 1) -> float:
    """Idle fraction of a balanced pipeline: (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1); zero bubble
    (ZB-H1, with forward, input-gradient and weight-gradient times equal) (p-1)/(3m+p-1), interleaved
    (p-1)/(3vm+p-1): the fill and drain of one chunk's F, B and W (the split's own figure is simulated)."""
    _check_schedule(schedule, p, m, v)
    vv = chunks_per_device(schedule, v)
    if schedule in ZERO_BUBBLES:
        return (p - 1) / (3 * vv * m + p - 1)
    return (p - 1) / (vv * m + p - 1)


def in_flight(schedule: str, p: int, m: int, stage: int, v: int = 1) -> int:
    """Micro-batches whose activations stage `stage` keeps at its peak: GPipe m, 1F1B min(m, p - stage), zero
    bubble the most forwards whose W has not run at any point of torch's order.
    Interleaved: counted in chunk-micro-batches on device `stage` (1F1B: Megatron's warm-up, 2(p-d-1) +
    (v-1)p + 1, capped at m*v; zero bubble: the peak of torch's order over the device's chunks); the caller
    scales it by the device's activations / v."""
    _check_schedule(schedule, p, m, v)
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, p - stage)
    if schedule in ZERO_BUBBLES:   # forwards whose W has not run yet, at the peak of torch's own order
        return _zero_bubble_order(p, m, chunks_per_device(schedule, v), schedule in V_SHAPED)[1][stage]
    return min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1)


def schedule_step_time(fwd: Sequence[float], bwd: Sequence[float], m: int, schedule: str, p2p: float = 0.0,
                       v: int = 1, weight: Sequence[float] | None = None) -> float:
    """Predicted step time of one pipeline schedule from per-stage (per-chunk for interleaved) times.
    `p2p` is the seconds of one boundary transfer; each boundary is crossed forward and backward per
    micro-batch, charged to the sending stage. gpipe/1f1b: sum t + (m-1) max t. zero_bubble: `weight`
    (per stage, the part of `bwd` that only parameter gradients need) runs apart, as torch's order says."""
    n = len(fwd)
    vv = chunks_per_device(schedule, v)
    _check_schedule(schedule, max(n // vv, 1), m, vv)
    if n != len(bwd) or n % vv:
        raise InputError(f"{len(fwd)} forward and {len(bwd)} backward times for v={vv} chunks per stage")
    cut = p2p * (np.r_[0.0, np.ones(n - 1)] + np.r_[np.ones(n - 1), 0.0])
    if schedule in V_SHAPED:   # chunks p - 1 and p share a device: no transfer between them
        cut[n // 2 - 1: n // 2 + 1] -= p2p
    if schedule in ZERO_BUBBLES:
        w = np.zeros(n) if weight is None else np.asarray(weight, float)
        return zero_bubble_step(np.asarray(fwd, float) + cut / 2, np.asarray(bwd, float) - w + cut / 2, w, m, vv,
                                schedule in V_SHAPED)
    t = np.asarray(fwd, float) + np.asarray(bwd, float) + cut
    return _step(t, m, schedule, vv)


@functools.lru_cache(maxsize=32)
def _zero_bubble_order(p: int, m: int, v: int = 1, v_shape: bool = False) -> tuple[tuple, tuple[int, ...], tuple[int, ...]]:
    """torch's ZB1P order on p devices of v chunks each (stages d, d + p, ...; `v_shape`: its ZB-V order, stages
    d and 2p - 1 - d), m micro-batches (`compat.zero_bubble_order`), as a dependency graph: actions (stage, kind, previous action of the rank,
    actions it waits for) in an order that respects them; each device's peak of forwards whose W has not run
    (chunk-micro-batches); and its peak of micro-batches whose B has run and W not, on its stages but the
    first (stage 0's B is empty: the runtime runs its whole backward as W)."""
    from autopar import _torch_compat as compat
    order = compat.zero_bubble_order(p, m, v, v_shape)
    last_stage = p * v - 1
    index: dict = {}
    actions: list = []
    ptr, last = [0] * p, [-1] * p
    while len(actions) < sum(map(len, order)):
        moved = False
        for r in range(p):
            while ptr[r] < len(order[r]):
                s, kind, mb = order[r][ptr[r]]
                if kind == "F":
                    deps = [("F", s - 1, mb)] if s > 0 else []
                elif kind == "W":
                    deps = [("IB", s, mb)]
                else:
                    deps = [("F", s, mb)] + ([("IB", s + 1, mb)] if s < last_stage else [])
                if any(d not in index for d in deps):
                    break
                index[("F" if kind == "F" else "W" if kind == "W" else "IB", s, mb)] = len(actions)
                actions.append((s, kind, last[r], tuple(index[d] for d in deps)))
                last[r], ptr[r], moved = len(actions) - 1, ptr[r] + 1, True
        assert moved, f"torch's zero-bubble order for p={p}, m={m}, v={v} deadlocks"
    peaks, waiting = [], []
    for r in range(p):
        live = peak = ran_b = most = 0
        for s, kind, _ in order[r]:
            live += kind == "F"
            live -= kind in ("W", "B")
            if s > 0:
                ran_b += (kind == "I") - (kind == "W")
            peak, most = max(peak, live), max(most, ran_b)
        peaks.append(peak)
        waiting.append(most)
    return tuple(actions), tuple(peaks), tuple(waiting)


def zero_bubble_step(f: np.ndarray, b: np.ndarray, w: np.ndarray, m: int, v: int = 1, v_shape: bool = False) -> float:
    """The step of torch's zero-bubble order (`_zero_bubble_order`) for per-stage (per-chunk: v per device)
    forward `f`, input-gradient `b` and weight-gradient `w` seconds per micro-batch: each action starts when
    its rank is free and what it waits for is done (the longest path of the order's dependency graph).
    Stage 0 has no input gradient to send (its inputs are the batch): its whole backward runs as W, as the
    runtime runs it."""
    p = len(f) // v
    b, w = np.array(b, float), np.array(w, float)
    w[0], b[0] = w[0] + b[0], 0.0
    kind, stage, prev, dep_a, dep_b = _zero_bubble_arrays(p, m, v, v_shape)
    dur = np.stack([np.asarray(f, float), b, w, b + w])[kind, stage].tolist()   # each action's seconds
    end = [0.0] * (len(dur) + 1)   # end[-1] = 0.0: "no such action"
    for i, (d, r, x, y) in enumerate(zip(dur, prev, dep_a, dep_b)):
        start, ex, ey = end[r], end[x], end[y]
        if ex > start:
            start = ex
        if ey > start:
            start = ey
        end[i] = start + d
    return max(end)


@functools.lru_cache(maxsize=32)
def _zero_bubble_arrays(p: int, m: int, v: int, v_shape: bool = False) -> tuple[np.ndarray, np.ndarray, list, list, list]:
    """`_zero_bubble_order`'s actions as flat arrays for `zero_bubble_step`'s walk: kind (0 F, 1 I, 2 W, 3 B) and
    stage per action (numpy, to gather durations), the rank's previous action and up to two actions waited
    for (lists; -1: none)."""
    actions = _zero_bubble_order(p, m, v, v_shape)[0]
    codes = {"F": 0, "I": 1, "W": 2, "B": 3}
    kind = np.array([codes[k] for _, k, _, _ in actions], dtype=np.intp)
    stage = np.array([s for s, _, _, _ in actions], dtype=np.intp)
    assert all(len(deps) <= 2 for *_, deps in actions)
    deps = [tuple(deps) + (-1,) * (2 - len(deps)) for *_, deps in actions]
    return kind, stage, [a[2] for a in actions], [d[0] for d in deps], [d[1] for d in deps]


@functools.lru_cache(maxsize=32)
def _zero_bubble_heads(p: int, m: int, v: int, v_shape: bool = False) -> np.ndarray:
    """Per device, the chunk its first action in torch's zero-bubble order runs forward (0 where that action is
    no forward): it waits for every earlier chunk's forward of that micro-batch, so the device starts no sooner
    than their forward seconds (`_Priced`'s floor)."""
    from autopar import _torch_compat as compat
    order = compat.zero_bubble_order(p, m, v, v_shape)
    return np.array([rank[0][0] if rank and rank[0][1] == "F" else 0 for rank in order], dtype=np.intp)


def _step(t: np.ndarray, m: int, schedule: str, v: int) -> float:
    if schedule != "interleaved_1f1b":
        return float(t.sum() + (m - 1) * t.max())
    p = len(t) // v
    device = t.reshape(v, p).sum(axis=0)  # chunk j runs on device j % p
    return float(t.sum() / v + (m - 1 / v) * device.max())


def step_weight(pp: int, m: int) -> float:
    """The per-step seconds' weight against the per-micro-batch seconds in a pipeline's step: 1F1B and
    GPipe run (m + pp - 1) micro-batch slots of a stage's 1 / pp of the per-micro-batch seconds and its
    1 / pp of the per-step seconds once, so the stage SPMD plan to solve minimises S + P / (pp + m - 1)
    (interleaved 1F1B: nearly so); gradient accumulation (pp = 1): S + P / m; the SPMD plan (1, 1): S + P.
    Solving S + P instead let the plan trade per-micro-batch seconds for per-step ones that the
    schedule pays once: Llama-3-70B (8 layers) on pp 4 x dp 16 x tp 8, m 16, 1F1B: 1,700 ms with auto's
    plan of least S + P against 1,025 ms with plain data x tensor parallelism."""
    return 1.0 / (pp + m - 1)


def step_lower_bound(per_microbatch: float, per_step: float, p: int, m: int, schedule: str, v: int = 1) -> float:
    """A lower bound of the step time of any split into p stages (p*v chunks for interleaved_1f1b)
    of units whose forward+backward seconds sum to at least `per_microbatch` and whose per-step
    seconds sum to at least `per_step`: with S = sum of stage times and max_k t_k >= S / p,
        gpipe/1f1b      S + (m-1) S / p                    (the stage-time term of _step)
        interleaved     S / v + (m - 1/v) S / p            (device times D_d >= S / p)
        zero_bubble     m S / p                            (the busiest stage's own work)
    plus max_k per-step >= per_step / p. p2p transfers only add (c >= 0)."""
    if schedule in ZERO_BUBBLES:   # the busiest device's work alone: W fills the fill and drain
        return per_microbatch * m / p + per_step / p
    vv = chunks_per_device(schedule, v)
    return per_microbatch * (1 / vv + (m - 1 / vv) / p) + per_step / p


def _prefix(layers: Sequence[LayerCost], attr: str) -> np.ndarray:
    return np.r_[0.0, np.cumsum([getattr(x, attr) for x in layers])]


def _segment(prefix: np.ndarray) -> np.ndarray:
    """S[a, b] = sum of units a..b (inclusive); inf below the diagonal (empty stages)."""
    n = len(prefix) - 1
    seg = prefix[None, 1:] - prefix[:n, None]
    seg[np.tril_indices(n, -1)] = np.inf
    return seg


def stage_time_matrix(layers: Sequence[LayerCost], p2p_time: Callable[[float], float]) -> np.ndarray:
    """T[a, b]: forward+backward per micro-batch of a stage holding units a..b, cut transfers included."""
    n = len(layers)
    cut = np.array([p2p_time(x.boundary_bytes) for x in layers[:-1]] + [0.0])
    seg = _segment(_prefix(layers, "forward") + _prefix(layers, "backward"))
    incoming = np.r_[0.0, cut[:-1]]               # stage starting at a receives across cut a-1
    return seg + cut[None, :] + incoming[:, None] if n else seg


def memory_counts(schedule: str, p: int, m: int, v: int) -> list[tuple[float, int]]:
    """Per chunk, (micro-batches whose activations it keeps: `chunk_in_flight`, micro-batches whose carried
    gradients it keeps: `LayerCost.carried_bytes`); the keys of `_stage_memory`. Zero bubble: stage s >= 1
    holds at its peak at most s + 1 micro-batches that ran B and wait for W (torch's order), each with its
    carried gradients; stage 0 none (its B is empty: its whole backward is W). A micro-batch's B frees the
    activations only B reads, which this leaves counted: an upper bound of the peak. On this CPU
    (`benchmarks/pipeline_memory.py`: GPT 4 x 512, pp2, m8) the last stage's step peaked 196 MiB above
    1F1B's: predicted 288, and 136 without the carried gradients (the runtime outgrew that plan); counting
    B's freeing exactly (torch's order, the activations W reads kept) also gives 136, under the measured peak,
    so the bound stays."""
    counts = [chunk_in_flight(schedule, p, m, k, v) for k in range(p * v)]
    if schedule not in ZERO_BUBBLES:
        return [(c, 0) for c in counts]
    # interleaved: a device's peak (chunk-micro-batches) spread over its chunks that have a B, as activations are
    waiting = _zero_bubble_order(p, m, v, schedule in V_SHAPED)[2]
    device = [chunk_device(schedule, p, k) for k in range(p * v)]
    return [(c, waiting[device[k]] / (v - (device[k] == 0)) if k else 0) for k, c in enumerate(counts)]


def _stage_memory(layers: Sequence[LayerCost], counts: Sequence[tuple[float, int]]) -> dict[tuple, np.ndarray]:
    """M_k[a, b] for each distinct (in-flight, carried) count (`memory_counts`): state (shared copies
    included) + in-flight * activations + carried * carried gradients."""
    state = _segment(_prefix(layers, "state_bytes")) + _shared(layers, 1)
    act = _segment(_prefix(layers, "activation_bytes"))
    carried = _segment(_prefix(layers, "carried_bytes")) if any(w for _, w in counts) else None
    return {(c, w): state + c * act + (w * carried if w else 0.0) for c, w in set(counts)}


@dataclass(frozen=True)
class _Shared:
    """The shared tensors (`LayerCost.shared`) of a split's units: `seconds[a, b]`, the per-step seconds a stage of
    units a..b adds (`_shared(layers, 2)`), and each tensor's readers as (unit, state bytes, per-step seconds)."""
    seconds: np.ndarray
    readers: tuple = ()

    @staticmethod
    def of(layers: Sequence[LayerCost]) -> "_Shared":
        found: dict = {}
        for u, x in enumerate(layers):
            for entry in x.shared:
                found.setdefault(entry[0], []).append((u, entry[1], entry[2]))
        return _Shared(_shared(layers, 2), tuple(tuple(rows) for rows in found.values() if len(rows) > 1))

    def excess(self, a: np.ndarray, schedule: str, p: int, v: int) -> tuple[np.ndarray, np.ndarray]:
        """Per chunk of the split starting at units `a`, (state bytes, per-step seconds) that the stage matrices
        count beyond what its device holds. They count a copy of a shared tensor on every chunk that reads it and
        starts after its first reader; a device holds one copy however many of its chunks read it, and none
        where its own chunk holds the first reader (whose unit counts the tensor): a tied embedding read by
        chunks 0 and 2p - 1, one device in a V. Zero with one chunk per device."""
        nbytes, seconds = np.zeros(len(a)), np.zeros(len(a))
        if v == 1 or not self.readers:
            return nbytes, seconds
        for rows in self.readers:
            chunk = (np.searchsorted(a, [u for u, _, _ in rows], side="right") - 1).tolist()
            held, prev = {chunk_device(schedule, p, chunk[0])}, chunk[0]   # the first reader's device counts it
            for c, (_, b, t) in zip(chunk, rows):   # readers in unit order: chunks in order
                if c == prev:   # the first reader's chunk (no copy counted), or a chunk's second reader
                    continue
                prev, d = c, chunk_device(schedule, p, c)
                if d in held:   # the chunk's matrix counts a copy its device already holds
                    nbytes[c], seconds[c] = nbytes[c] + b, seconds[c] + t
                held.add(d)
        return nbytes, seconds


def _shared(layers: Sequence[LayerCost], field: int) -> np.ndarray:
    """X[a, b]: the shared tensors' costs (`LayerCost.shared`, field 1 state bytes, 2 per-step seconds)
    that a stage of units a..b adds: each tensor once, where the stage reads it but starts after its
    first reader (which counts it in its own unit)."""
    n = len(layers)
    out = np.zeros((n, n))
    readers: dict = {}
    for u, x in enumerate(layers):
        for entry in x.shared:
            readers.setdefault(entry[0], []).append((u, entry[field]))
    for rows in readers.values():
        for a in range(rows[0][0] + 1, n):
            later = [(u, v) for u, v in rows if u >= a]
            if later:
                out[a, later[0][0]:] += later[0][1]
    return out


def _least_sum(T: np.ndarray, masks: list[np.ndarray], bound: float) -> tuple[float, list[int]] | None:
    """min sum_k T[a_k, b_k] over contiguous splits into len(masks) stages with T <= bound and each
    stage's memory mask; returns (sum, bounds) or None if no split qualifies."""
    return _Band(T, masks).least_sum(bound)


class _Band:
    """`_least_sum` for one T and its stage masks under any bound, on the band of stages allowed: a stage of
    units a..b only for a within w of b (the longest stage any mask allows under the bound), so each stage's DP
    step is n * w, not n * n (a pipeline of many chunks on few units each: Llama-3.1-405B's 16-64 chunks on
    128 units, w 10-35). The same sums and the same first least a per b as over the whole matrix: the same
    split. Built once per T and masks (the widest band, no bound), each bound's band a slice of it."""

    def __init__(self, T: np.ndarray, masks: list[np.ndarray]):
        n = T.shape[0]
        self.cols = cols = np.arange(n)
        # the units a..b some stage may hold (the bottlenecks `_scan` tries are their times)
        self.allowed = union = np.logical_or.reduce(masks) & np.isfinite(T)
        lo = union.argmax(axis=0)             # per unit b, the first a some stage a..b may start at
        has = union[lo, cols]
        w = int((cols - lo)[has].max()) + 1 if has.any() else 1
        rows = cols[None, :] - (w - 1) + np.arange(w)[:, None]   # band row r of column b: a = b - w + 1 + r
        valid = rows >= 0
        self.rows = np.where(valid, rows, 0)
        self.T = np.where(valid, T[self.rows, cols], np.inf)
        self.masks = [valid & mk[self.rows, cols] for mk in masks]
        self.union = np.logical_or.reduce(self.masks)

    def least_sum(self, bound: float) -> tuple[float, list[int]] | None:
        cols, n = self.cols, len(self.cols)
        ok = self.union & (self.T <= bound)
        first = ok.argmax(axis=0)   # the band's rows run a ascending: the bound's band is its last rows
        has = ok[first, cols]
        if not has.any():
            return None
        top = int(first[has].min())
        rows, T, within = self.rows[top:], self.T[top:], ok[top:]
        best = np.full(n + 1, np.inf)   # best[b + 1]: least sum covering units 0..b with k+1 stages
        best[0] = 0.0
        choice = []
        for mask in self.masks:
            cand = best[rows] + T   # cand[r, b]: previous stages end at a - 1, a = rows[r, b]
            cand[~(mask[top:] & within)] = np.inf
            arg = cand.argmin(axis=0)
            best[1:] = cand[arg, cols]
            best[0] = np.inf
            choice.append(rows[arg, cols])
        if not np.isfinite(best[n]):
            return None
        bounds, end = [], n - 1
        for k in range(len(self.masks) - 1, -1, -1):
            a = int(choice[k][end])
            bounds.append(a)
            end = a - 1
        return float(best[n]), bounds[::-1]


def partition(layers: Sequence[LayerCost], p: int, m: int, schedule: str, *, p2p_time: Callable[[float], float],
              memory_budget: float | None = None, v: int = 1, overhead: float = 0.0) -> StageSplit:
    """Exact contiguous split of `layers` into p non-empty stages (p*v chunks for interleaved_1f1b)
    minimising the schedule's step time with every stage's memory within `memory_budget`; the step
    time includes `overhead`, seconds every rank's step pays once (`HardwareSpec.runtime_overhead`).
    Raises InfeasiblePlanError (with min_memory_per_device) when no split fits."""
    vv = chunks_per_device(schedule, v)
    _check_schedule(schedule, p, m, vv)
    n, chunks = len(layers), p * vv
    if chunks > n:
        raise InputError(f"{chunks} stages for {n} layers: every stage needs at least one layer")
    T = stage_time_matrix(layers, p2p_time)
    counts = memory_counts(schedule, p, m, vv)
    mem = _stage_memory(layers, counts)
    budget = np.inf if memory_budget is None else float(memory_budget)
    weight = m * vv - 1   # gpipe/1f1b: m - 1; interleaved: (m - 1/v) * v
    per_step, shared = _prefix(layers, "per_step"), _Shared.of(layers)
    parts = _parts(layers, schedule, p2p_time)
    best = None
    shares = _round_shares(vv) if np.isfinite(budget) else [(1.0,) * vv]
    if vv > 1 and np.isfinite(budget):
        shares = [None] + shares   # first the budget-free split: kept if its devices fit
    cm = np.stack([mem[c] for c in counts])   # chunk k's memory matrix
    splits = _Splits(T, cm, m, schedule, vv, per_step, shared, parts)
    for share in shares:
        # chunk k (device k % p, round k // p) within share[k // p] of the budget: the device's sum fits
        masks = [mem[c] <= (np.inf if share is None else budget * share[k // p]) for k, c in enumerate(counts)]
        found = _scan(T, masks, splits, m, schedule, vv, weight)
        if found is not None and vv > 1:
            start, found = found, _improve(found, T, splits, np.inf if share is None else budget)
            if share is None:
                if max(found.stage_memory) <= budget:
                    best = found   # the budget-free split fits: kept, the shares' scans skipped
                    break
                # else improve its scan's start under the budget, where that fits
                found = None if max(start.stage_memory) > budget else _improve(start, T, splits, budget)
        best = found if best is None or (found is not None and found.step_time < best.step_time) else best
    if best is None:
        need = vv * _min_memory(mem, counts, T)
        raise InfeasiblePlanError(
            f"no split of {n} layers into {chunks} pipeline stages fits the memory budget "
            f"({format_bytes(budget)} per device); the best split needs {format_bytes(need)}",
            min_memory_per_device=need, budget=memory_budget)
    return dataclasses.replace(best, step_time=best.step_time + overhead) if overhead else best


def priced_split(layers: Sequence[LayerCost], bounds: Sequence[int], p: int, m: int, schedule: str, *,
                 p2p_time: Callable[[float], float], v: int = 1, overhead: float = 0.0) -> StageSplit:
    """The StageSplit of `layers` cut at `bounds` (first unit of each stage, or chunk for interleaved), priced
    as `partition` prices the splits it compares: its step time (`overhead` included) and each device's memory."""
    vv = chunks_per_device(schedule, v)
    _check_schedule(schedule, p, m, vv)
    counts = memory_counts(schedule, p, m, vv)
    mem = _stage_memory(layers, counts)
    split = _Priced(list(bounds), stage_time_matrix(layers, p2p_time), np.stack([mem[c] for c in counts]), m, schedule,
                    vv, _prefix(layers, "per_step"), _Shared.of(layers), _parts(layers, schedule, p2p_time)).split()
    return dataclasses.replace(split, step_time=split.step_time + overhead) if overhead else split


def chunk_memory(layers: Sequence[LayerCost], bounds: Sequence[int], schedule: str, p: int, m: int,
                 v: int = 1) -> list[float]:
    """Bytes of each chunk of the split cut at `bounds` as `partition` counts them (a device's memory is the sum
    over its chunks): its state, a shared tensor's copy included where its device holds no other (`_Shared`),
    plus its share of the device's in-flight activations and, under zero bubble, of its carried gradients
    (`memory_counts`)."""
    vv = chunks_per_device(schedule, v)
    counts = memory_counts(schedule, p, m, vv)
    mem = _stage_memory(layers, counts)
    ends = list(bounds[1:]) + [len(layers)]
    extra = _Shared.of(layers).excess(np.asarray(bounds), schedule, p, vv)[0]
    return [float(mem[c][a, b - 1] - x) for c, a, b, x in zip(counts, bounds, ends, extra)]


def _round_shares(v: int) -> list[tuple[float, ...]]:
    """How a device's budget is shared among its v chunks (one per round) in `partition`'s masks:
    evenly, then the first round (whose chunks keep the most micro-batches in flight) given more or
    less. A chunk within its share keeps the device within budget; a device's chunks are not
    contiguous, so the DP cannot bound their sum directly, and an even share alone misses splits
    whose rounds differ (random models against exhaustive splits, with `_improve`: exact on 35 of 60
    and 7 feasible ones called infeasible, against 30 of 57 and 10 evenly; Llama-3-70B, pp 8, m 32,
    80 GB: the surrogate's split 7.052 s evenly, 7.008 s with the shares). `partition` tries the
    budget-free split first and keeps it where its devices fit."""
    if v == 1:
        return [(1.0,)]
    return [(1 / v,) * v] + [(a, *[(1 - a) / (v - 1)] * (v - 1)) for a in ROUND_SHARES]


def _improve(split: StageSplit, T, splits: _Splits, budget) -> StageSplit:
    """Move one chunk boundary by one unit while that lowers the step (the schedule's own formula) and
    every device stays within budget (its chunks' sum, exactly). The DP's least-sum split per
    bottleneck ignores which chunks share a device; this pairs them better (Llama-3-70B, pp 8, m 32,
    interleaved, 80 GB: 7.008 -> 6.537 s, the split torchtitan's recipe gets)."""
    n = T.shape[0]
    improved = True
    while improved:
        improved = False
        bounds = list(split.bounds)
        for k in range(1, len(bounds)):
            for step in (-1, 1):
                moved = bounds[:k] + [bounds[k] + step] + bounds[k + 1:]
                if not all(a < b for a, b in zip(moved, moved[1:] + [n])):
                    continue   # a chunk would be empty
                ends = moved[1:] + [n]
                if not all(np.isfinite(T[a, b - 1]) for a, b in zip(moved, ends)):
                    continue
                goal = split.step_time * (1 - 1e-12)
                trial = splits(moved, budget, goal)
                if trial is not None and trial.step_time < goal:
                    split, improved = trial, True
                    break
            if improved:
                break
    return split


def _scan(T, masks, splits: _Splits, m, schedule, v, weight) -> StageSplit | None:
    """The fastest split under `masks` among the least-sum splits of every bottleneck (chunk time)
    B in ascending order, priced by the schedule's own formula (`_Splits`); None if none fits. Only the times
    of chunks some mask allows are bottlenecks: between two of them no chunk's mask changes, nor any split."""
    band = _Band(T, masks)
    free = band.least_sum(np.inf)
    if free is None:
        return None
    values = np.unique(T[band.allowed])
    best = None
    for bound in values[_first_feasible(band, values):]:
        # every split whose largest chunk is >= bound steps >= (least sum + weight * bound) / v: its
        # sum is >= the least, and the device holding that chunk is busy >= bound per micro-batch
        # (zero bubble: >= m * bound, that stage's own work)
        least = m * bound if schedule in ZERO_BUBBLES else (free[0] + weight * bound) / v
        if best is not None and least >= best.step_time:
            break
        found = band.least_sum(bound)
        if found is not None:
            split = splits(found[1], cutoff=np.inf if best is None else best.step_time)
            best = split if split is not None and (best is None or split.step_time < best.step_time) else best
    return best


def _first_feasible(band: _Band, values: np.ndarray) -> int:
    """Index of the least bottleneck in `values` that admits a split (feasibility grows with it)."""
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if band.least_sum(values[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo


def chunk_in_flight(schedule: str, p: int, m: int, chunk: int, v: int) -> float:
    """In-flight micro-batches of chunk `chunk` (its stage's count; interleaved spreads a device's
    chunk-micro-batches over its v chunks)."""
    if schedule not in INTERLEAVED + V_SHAPED:
        return in_flight(schedule, p, m, chunk)
    return in_flight(schedule, p, m, chunk_device(schedule, p, chunk), v) / chunks_per_device(schedule, v)


def _min_memory(mem: dict, counts: list[tuple], T: np.ndarray) -> float:
    """The least, over all splits, of the fullest stage's memory (bisection on the distinct values)."""
    values = np.unique(np.concatenate([m_[np.isfinite(m_)] for m_ in mem.values()]))
    lo, hi = 0, len(values) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _least_sum(T, [mem[c] <= values[mid] for c in counts], np.inf) is None:
            lo = mid + 1
        else:
            hi = mid
    return float(values[lo])


def _parts(layers: Sequence[LayerCost], schedule: str, p2p_time: Callable[[float], float]):
    """(forward, backward, weight) segment matrices, which zero bubble's step needs apart, and each cut's
    transfer seconds (`stage_time_matrix`'s c(l): in a V the cut between chunks p - 1 and p stays on one
    device, which `_Priced` takes off); None for the other schedules."""
    if schedule not in ZERO_BUBBLES:
        return None
    cut = np.array([p2p_time(x.boundary_bytes) for x in layers[:-1]] + [0.0])
    return (*(_segment(_prefix(layers, attr)) for attr in ("forward", "backward", "weight")), cut)


class _Priced:
    """One split cut at `bounds`: its devices' memory and its step's floor at once, its step (for zero bubble a
    walk of torch's order, the costly part) when first asked. `floor`: each device runs all of its chunks' work,
    m of each, one after another, so a zero-bubble step is at least m * (the busiest device's chunk times) plus
    its per-step seconds (-inf for the other schedules, whose step is a formula). `cm[k]`: chunk k's memory
    matrix."""
    __slots__ = ("args", "a", "e", "times", "memory", "once", "memory_max", "floor", "found", "fwd_bwd")

    def __init__(self, bounds, T, cm, m, schedule, v, per_step: np.ndarray, shared: _Shared, parts=None):
        n, p = T.shape[0], len(bounds) // v
        a = np.asarray(bounds)
        e = np.r_[a[1:], n] - 1   # each chunk's last unit
        times = T[a, e]
        if schedule in V_SHAPED:   # chunks p - 1 and p share a device: no transfer between them
            local = parts[3][e[p - 1]]
            times = times - np.r_[np.zeros(p - 1), local, local, np.zeros(p - 1)]
        extra_bytes, extra_seconds = shared.excess(a, schedule, p, v)   # a shared tensor: one copy per device
        memory = _per_device(cm[np.arange(len(a)), a, e] - extra_bytes, schedule, p, v)   # a device's chunks: their sum
        once = _per_device(per_step[e + 1] - per_step[a] + shared.seconds[a, e] - extra_seconds, schedule, p, v)
        self.args, self.a, self.e, self.times, self.memory, self.once = (m, schedule, v, parts), a, e, times, memory, once
        self.memory_max = float(memory.max())
        self.floor, self.fwd_bwd = -np.inf, None
        if schedule in ZERO_BUBBLES:
            # a device runs m of each of its chunks' work one after another, from when its first forward's
            # inputs are ready: after every earlier chunk's forward (forward seconds and half of each cut)
            self.fwd_bwd = f, bwd = parts[0][a, e], parts[1][a, e]
            fwd = f + (times - f - bwd) / 2
            head = np.r_[0.0, np.cumsum(fwd)][_zero_bubble_heads(p, m, v, schedule in V_SHAPED)]
            busy = head + m * _per_device(times, schedule, p, v)
            self.floor = float(busy.max()) * (1 - 1e-9) + float(once.max())
        self.found: StageSplit | None = None

    def split(self, budget: float = np.inf, cutoff: float = np.inf) -> StageSplit | None:
        """The priced split; None where its devices exceed `budget` or its floor is `cutoff` or more."""
        if self.memory_max > budget or self.floor >= cutoff:
            return None
        if self.found is None:
            m, schedule, v, parts = self.args
            a, e, times, once, p = self.a, self.e, self.times, self.once, len(self.a) // v
            if schedule in ZERO_BUBBLES:   # the cut transfers (T's rest), half with the forward, half with B
                (f, bwd), w = self.fwd_bwd, parts[2][a, e]
                cut = times - f - bwd
                step = zero_bubble_step(f + cut / 2, bwd - w + cut / 2, w, m, v, schedule in V_SHAPED)
            else:
                step = _step(times, m, schedule, v)
            step += float(once.max())
            busy = (m * times.sum() + once.sum()) / p
            self.found = StageSplit(tuple(a.tolist()), tuple(times.tolist()), tuple(self.memory.tolist()), step,
                                    float(max(0.0, 1.0 - busy / step)) if step > 0 else 0.0)
        return self.found


class _Splits:
    """The splits one `partition` call compares, each priced once (`_Priced`): its scans and its boundary moves
    meet the same splits again and again (Llama-3-70B x 64, bf16: half of 27k prices were repeats)."""

    def __init__(self, T, cm, m, schedule, v, per_step: np.ndarray, shared: _Shared, parts=None):
        self.args, self.seen = (T, cm, m, schedule, v, per_step, shared, parts), {}

    def __call__(self, bounds, budget: float = np.inf, cutoff: float = np.inf) -> StageSplit | None:
        key = tuple(bounds)
        priced = self.seen.get(key)
        if priced is None:
            priced = self.seen[key] = _Priced(bounds, *self.args)
        return priced.split(budget, cutoff)


def mesh_factorizations(world: int, devices_per_node: int | None) -> list[tuple[int, int, int]]:
    """Every (pp, dp, tp) with pp * dp * tp == world and tp inside one node (tp divides
    devices_per_node). The mesh is laid out (pp, dp, tp), tp innermost, so only pp or dp cross nodes."""
    if world < 1:
        raise InputError(f"world size must be >= 1, got {world}")
    out = []
    for tp in range(1, world + 1):
        if world % tp or (devices_per_node is not None and devices_per_node % tp):
            continue
        rest = world // tp
        for pp in range(1, rest + 1):
            if rest % pp == 0:
                out.append((pp, rest // pp, tp))
    return sorted(out)
