"""Pricing the pipeline search's candidates, and the branch and bound that skips most of them.

A candidate is a (pp, dp, tp) mesh, a micro-batch count m and a schedule. `price` splits the unit
profile of the micro-batch graph on the (dp, tp) sub-mesh (`search.Profiler.layers`, its SPMD plan
solved for the least S + P / (pp + m - 1), the pipeline's weighting of per-micro-batch seconds S and
per-step seconds P: `stages.step_weight`) into pp stages exactly for the schedule, under the budget
(`stages.partition`). If no split fits, the SPMD plan
is re-solved with memory rows before the candidate is called infeasible: first rows that weigh
activations by the mean number of micro-batches a stage keeps in flight (w: GPipe m, 1F1B
(pp + 1) / 2 for m >= pp; `stages.in_flight`),
    Σ state + w · Σ activations <= pp · budget  (then half of pp · budget: INNER_TIGHTENING),
what the stages hold together when the split evens out their memory (tried after the loosest
unweighted row and before the tighter one).
The mean overstates what an uneven split holds (it gives the stages that keep many micro-batches
fewer units), so a weighted row that no SPMD plan meets is retried at FLOOR_SLACK times the least
weighted memory: those plans keep the fewest activations, and often split. Not where no split can
fit: the stages together hold at least Σ state + c · Σ activations >= (c / w) · (least weighted
memory) for c the fewest micro-batches any stage keeps, which must not exceed pp * budget (GPipe,
where every stage keeps m = w, is thus never retried). Where it does exceed it, no plan of any row
splits, and the candidate stops there (before, the tighter unweighted row was solved too: on
Llama-3-70B x 64, a 2-D GPipe group's memory-row MIP took 156 CPU s to find a plan that could not
split). When no plan meets the loosest unweighted row, pp * budget, no split fits at all (every stage
keeps at least one micro-batch): the candidate stops.
A row the looser plan already meets is not re-solved. Unweighted rows alone let the SPMD plan keep
large activations (Llama-70B on 256 devices at 40 GB, pp 8 x dp 4 x tp 8, 1F1B, m 32: 92 GB of
activations per micro-batch under a 160 GB row, kept up to 8 times on the first stages), so auto
found no split where ZeRO-3 x TP did.
If no row's plan splits, each of them is priced with full recompute (`_recomputed`: every layer but
the last of each stack re-runs its forward in backward, strategies unchanged) before the candidate is
called infeasible; the first that splits within the budget is the candidate, with as few layers
recomputed as each device's budget then allows on that split (`fewest_recomputed`: the rest go back to
the plan's own, cheaper backward) (auto only, not a forced recipe: the recipes with activation
checkpointing are priced as such by benchmarks/plan_quality.py).
Where no plan can split without recompute (`_needs_recompute`), the budget-free plans are priced so
before any memory row is solved: the first that splits is the candidate the rows would have led to.
Branch and bound (`branch_and_bound`) keeps the search exact while skipping SPMD solves: a candidate
is priced only if a lower bound of its step time is within the k-th fastest found so far. The bounds
hold for every plan of the cost model: no op or parameter on k devices costs less than 1/k of its
one-device time (roofline on local FLOPs and bytes, both >= 1/k) nor less than its launch overhead
(`search.Profiler.seconds_bound`), edges cost >= 0, and the
schedules' step time is >= f * S + P / pp for S the per-micro-batch seconds, P the per-step seconds,
f = 1/v + (m - 1/v) / pp (`stages.step_lower_bound`); the second bound also charges the resharding of
a spanning forest of the cost graph (`autopar.planning.forest_bound`). A candidate whose saved activations
alone exceed the budget on its fullest device (`_needs_recompute`: the whole batch's one-device
activations over m k, spread over the stages' in-flight counts) can only be priced with recompute, so
its first bound adds the least re-run seconds that free the excess (`search.Profiler.rerun_seconds_bound`,
the activation floors of the layers that can recompute as a fractional knapsack: a candidate may recompute
fewer layers than all): on Llama-3.1-405B x 2,048, where every candidate needs recompute, the bounds
without any re-run ignored a third of the work and pruned almost nothing. The fast search uses instead, on
2-D sub-meshes, where the SPMD solve is a MIP, the proven bound of the group's budget-free tiled solve
(`search.Profiler.lp_bound`: its root LP, the relaxation of the layer quotient, is integral as a rule),
weighted by the group's step weight (`stages.step_weight`: within 1 / (f * pp) of every schedule), a bound
over tiled plans, to which a recompute-only candidate adds its least re-run; a group that is priced starts
from that very solve. The forest bound leaves out most communication: on Llama-3-70B x 64 H100s (bf16) it
stayed at 0.5-0.9 of the LP bound, so it pruned none of the seven 2-D groups whose budget-free MIPs took
22-58 CPU s each; the LP bound was 1.13-2.2x the best step there, except one (1.0x) that is priced.
Those LP bounds (and the budget-free profiles behind them) may come from a `BoundWorker`, a forked process that
computes them ahead of the search, in the order it asks for them (`autopar.pipeline.bound_worker`): the same
values, on another CPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from autopar.costmodel.memory import format_bytes
from autopar.errors import InfeasiblePlanError
from autopar.mesh import Mesh
from autopar.pipeline.bound_worker import BoundWorker, Request
from autopar.pipeline.stages import (
    INTERLEAVE,
    INTERLEAVED,
    INTERLEAVED_ZERO_BUBBLE,
    V_SHAPED,
    ZERO_BUBBLE,
    ZERO_BUBBLES,
    LayerCost,
    StageSplit,
    chunk_device,
    chunk_in_flight,
    chunks_per_device,
    partition,
    priced_split,
    step_lower_bound,
    step_weight,
)

if TYPE_CHECKING:
    from autopar.pipeline.search import Profiler

SKIPPED = "not priced under memory rows"   # a fast search's candidate (`price`'s cutoff)
SKIP_MARGIN = 1.05   # ... when its budget-free plan splits at least this times slower than the cutoff
INNER_TIGHTENING = (1.0, 0.5)   # inner SPMD memory rows tried, as fractions of pp * budget
FLOOR_SLACK = 1.05        # a weighted row no SPMD plan meets is retried at this times the least one
ROUNDS = (ZERO_BUBBLE, INTERLEAVED_ZERO_BUBBLE)   # torch's ZB1P: rounds of equal size
RESPLITS = 3   # `_recomputed`: the partly recomputed profile split anew (and thinned) at most this many times

@dataclass(frozen=True)
class Candidate:
    """One priced point of the search: a (pp, dp, tp) mesh, micro-batch count and schedule."""
    pp: int
    dp: int
    tp: int
    num_microbatches: int
    schedule: str                        # a stages.SCHEDULES name ("1f1b" with pp = 1: gradient accumulation)
    feasible: bool
    step_time: float | None              # seconds (None when infeasible)
    memory_per_device: float             # fullest stage's bytes, or the least any split needs
    split: StageSplit | None = None
    stage_modules: tuple[tuple[str, ...], ...] = ()   # unit names per stage (chunk for interleaved)
    inner_budget: float | None = None    # the SPMD memory row the profile was solved under
    inner_weight: float = 1.0            # ... with activations weighted by this in-flight count
    inner_step_weight: float = 1.0       # ... minimising per-micro-batch + this x per-step seconds (`step_weight`)
    reason: str = ""
    recompute: tuple[str, ...] = ()      # layers whose forward re-runs in backward (`Profiler.recomputed`)

    def as_dict(self) -> dict:
        """A JSON-ready row (for Plan.baselines or a report)."""
        return {"mesh": {"pp": self.pp, "dp": self.dp, "tp": self.tp}, "num_microbatches": self.num_microbatches,
                "schedule": self.schedule, "feasible": self.feasible, "time": self.step_time,
                "memory": self.memory_per_device, "bounds": list(self.split.bounds) if self.split else None,
                "bubble": float(self.split.bubble_fraction) if self.split else None, "reason": self.reason,
                "recompute": len(self.recompute)}


def branch_and_bound(prof: Profiler, jobs, budget, strategy, keep: int, incumbent: float = float("inf"),
                     fast: bool = False, stats: dict | None = None, recompute: bool = True,
                     worker: BoundWorker | None = None) -> list[Candidate]:
    """Price `jobs` best-first by a lower bound of their step time, skipping every candidate whose
    bound exceeds the `keep`-th fastest feasible time found so far: it cannot be among the `keep`
    fastest, so the search's best (and its keep - 1 runners-up) are those of pricing every job.
    Two bounds, cheap first: `stages.step_lower_bound` of the one-device seconds of the micro-batch
    size (no CostProblem needed; it orders the (micro-batch size, dp, tp) groups, whose memory rows are
    solved together while their CostProblem is kept), then the spanning-forest relaxation of the
    group's CostProblem (`Profiler.forest_bound`, which adds the communication a forest must pay).
    `incumbent`: the step time of a plan found outside `jobs` (the default search's SPMD plan): no
    candidate whose bound exceeds it is priced.
    `fast` (the default search's "fast" mode): on 2-D sub-meshes the bound of the group's budget-free tiled
    solve instead of the forest (`Profiler.lp_bound`: over tiled plans, which the budget-free solve
    returns; a memory row's full-graph fallback may not be tiled; on Llama-3-70B x 64 the forests, ~20
    CPU s, skipped no candidate the LP kept), plus, for a candidate only recompute can fit, the least
    re-run seconds its first bound charges (its plan's per-micro-batch seconds are a tiled plan's and the
    re-run of the layers it recomputes), and `price` solves no memory rows for a
    candidate whose budget-free plan splits SKIP_MARGIN times slower than the best found or more; and
    gradient accumulation (pp = 1, m > 1) is priced by its budget-free plan alone in bound order, and
    under its memory rows only after every pipeline group, under their cutoff; and a zero-bubble candidate
    that only recompute can fit is left out (its bound, the busiest stage's work, prunes little, and each
    stage keeps pp micro-batches: on Llama-3.1-405B x 2,048, where every candidate needs recompute, pricing
    them took the search from 251 to 556 CPU s for the same 1F1B plan); and zero bubble V (`stages.V_SHAPED`) only
    from 2pp - 1 micro-batches on, where torch's V order fills its steady state (below, balanced chunks step slower
    than interleaved zero bubble's: tests/test_stages.py).
    `stats` (a dict) receives groups, groups_priced (those where some candidate was priced),
    lp_pruned (candidates the LP bound skipped) and rows_skipped. `recompute=False`: no candidate is
    priced with recompute (`price`). `worker`: a `BoundWorker` already working out this search's LP bounds
    (`lp_requests`; the default call forks it once its 1-D SPMD plan says the search runs), else the search forks
    its own."""
    ordered, rerun_of = _ordered_groups(prof, jobs, budget, strategy, fast, recompute)
    own = worker is None
    worker = BoundWorker(prof, _requests(ordered, strategy, fast, incumbent), strategy) if own else worker
    try:
        found, priced, lp_pruned = _walk(prof, ordered, budget, strategy, keep, incumbent, fast, recompute, rerun_of,
                                         worker)
    finally:
        if own:
            worker.close()
    if stats is not None:
        stats.update(groups=len(ordered), groups_priced=priced, lp_pruned=lp_pruned,
                     rows_skipped=sum(c.reason.startswith(SKIPPED) for c in found))
    return found


def lp_requests(prof: Profiler, jobs, budget, strategy=None, fast: bool = True, recompute: bool = True,
                incumbent: float = float("inf")) -> list[Request]:
    """The LP bounds (`Profiler.lp_bound`'s m, dp, tp, ratio) that `branch_and_bound` with these arguments may ask
    for, in its order (accumulation's among them), each with the first bound that decides whether it asks
    (`bound_worker.Request`): what a `BoundWorker` works out ahead of it."""
    return _requests(_ordered_groups(prof, jobs, budget, strategy, fast, recompute)[0], strategy, fast, incumbent)


def _requests(ordered: list[list[tuple]], strategy, fast: bool, incumbent: float) -> list[Request]:
    return [Request(m, dp, tp, step_weight(pp, m), bound) for group in ordered for bound, pp, dp, tp, m, s in group
            if fast and strategy is None and min(dp, tp) > 1 and bound <= incumbent]


def _ordered_groups(prof: Profiler, jobs, budget, strategy, fast: bool, recompute: bool
                    ) -> tuple[list[list[tuple]], dict[tuple, float]]:
    """`branch_and_bound`'s candidates with their first bounds, (bound, pp, dp, tp, m, schedule), grouped by (m, sub-mesh)
    and the groups in order of their least bound; and the least re-run seconds of each recompute-only candidate."""
    groups: dict[tuple, list[tuple]] = {}
    rerun_of: dict[tuple, float] = {}   # the least re-run seconds per micro-batch of a recompute-only candidate
    for pp, dp, tp, m, names in jobs:
        ops, step = prof.seconds_bound(m, dp * tp)
        for s in names:
            if pp == 1 and strategy is None and _needs_recompute(prof, 1, dp * tp, m, s, budget):
                continue   # accumulation that only recompute could fit: `price` prices none for one stage
            bound = step_lower_bound(ops, step, pp, m, s, INTERLEAVE)
            needs = pp > 1 and _needs_recompute(prof, pp, dp * tp, m, s, budget)
            if fast and s in ZERO_BUBBLES and needs:
                continue   # zero bubble keeps pp micro-batches on every stage: where only recompute fits, fast leaves it
            if fast and s in V_SHAPED and m < 2 * pp - 1:
                continue   # torch's V fills its steady state from 2pp - 1 micro-batches on (interleaving's are searched)
            if recompute and strategy is None and needs:
                # only recompute can make it fit (`price`): at least what freeing the excess re-runs
                excess = _excess(prof, pp, dp * tp, m, s, budget)
                rerun = rerun_of[pp, dp, tp, m, s] = prof.rerun_seconds_bound(m, dp * tp, excess)
                bound = step_lower_bound(ops + rerun, step, pp, m, s, INTERLEAVE)
            groups.setdefault((m, *prof._inner(dp, tp, strategy)), []).append((bound, pp, dp, tp, m, s))
    return sorted(groups.values(), key=lambda group: min(group)[0]), rerun_of   # stable on ties


def _walk(prof: Profiler, ordered: list[list[tuple]], budget, strategy, keep: int, incumbent: float, fast: bool,
          recompute: bool, rerun_of: dict, worker: BoundWorker) -> tuple[list[Candidate], int, int]:
    """`branch_and_bound`'s walk over its groups in bound order: (the candidates priced, how many groups had one
    priced, how many candidates the LP bound skipped)."""
    found: list[Candidate] = []
    fastest: list[float] = []
    cutoff = incumbent
    priced = lp_pruned = 0
    # fast: gradient accumulation (one stage) is priced in bound order by its budget-free plan only; one that
    # does not fit waits until every pipeline group has set the cutoff (its memory rows are tight 2-D MIPs:
    # Llama-13B x 16, 40 GB, 23 and 105 CPU s before any pipeline was priced), while one that fits sets the
    # cutoff early (Llama-3-70B x 64: 1 x 8 x 8, m 2 fits, and a pipeline group's rows are then skipped)
    waiting: list[tuple] = []
    last = False   # pricing the accumulation that waited, under the cutoff of the rest
    worker.cutoff(cutoff)
    for group in ordered + [[]]:
        if not group:   # every other candidate priced: the accumulation that waited
            group, last = sorted(waiting), True
        if not group or min(group)[0] > cutoff:
            continue  # (the later groups have larger least bounds still)
        priced_here = False
        # the forest and LP bounds need the group's CostProblem: worth building first only where the solve
        # is the costly 2-D one (auto on a dp x tp sub-mesh); 1-D and forced-recipe groups solve by the DP
        for bound, pp, dp, tp, m, s in group:
            if bound > cutoff:
                continue
            costly = strategy is None and min(dp, tp) > 1
            if costly and not fast and cutoff < float("inf") and prof.forest_bound(m, dp, tp, strategy, pp, s) > cutoff:
                continue
            if costly and fast and cutoff < float("inf"):   # the LP bound in place of the forest
                # a recompute-only candidate's plan runs a tiled plan's seconds and its re-run on top
                lp = worker.get(m, dp, tp, step_weight(pp, m))
                if lp is None:
                    lp = prof.lp_bound(m, dp, tp, strategy, step_weight(pp, m))
                lp += rerun_of.get((pp, dp, tp, m, s), 0.0)
                if _per_microbatch(pp, m, s) * lp > cutoff:
                    lp_pruned += 1
                    continue
            free_only = fast and pp == 1 and strategy is None and not last
            new = price(prof, pp, dp, tp, m, (s,), budget, strategy, cutoff if fast else None, recompute,
                        free_only=free_only)
            if free_only and not any(c.feasible or c.reason.startswith(SKIPPED) for c in new):
                waiting.append((bound, pp, dp, tp, m, s))
                continue
            found += new
            priced_here = True
            fastest = sorted(fastest + [c.step_time for c in new if c.feasible])[:keep]
            # the bound is a sum of the same terms in another order: allow for float rounding
            cutoff = min(incumbent, fastest[-1] * (1 + 1e-9) if len(fastest) == keep else float("inf"))
            worker.cutoff(cutoff)   # what it will not ask for, its worker leaves
        priced += priced_here
    return found, priced, lp_pruned


def _needs_recompute(prof: Profiler, pp: int, k: int, m: int, schedule: str, budget: float | None) -> bool:
    """No plan of this candidate fits `budget` without recompute: a device holding chunks c keeps
    in-flight(c) x (c's share of one micro-batch's saved activations), so the fullest holds at least
    `activation_floor` / Σ_c 1 / in-flight(c) (the least, over the shares, of the largest product),
    state aside. `price` then prices it with recompute or not at all."""
    if budget is None:
        return False
    spread = _inverse_in_flight(pp, m, schedule)
    if spread is None:   # a chunk that keeps nothing could hold every unit
        return False
    return prof.activation_floor(m, k) / spread > budget


def _excess(prof: Profiler, pp: int, k: int, m: int, schedule: str, budget: float) -> float:
    """Bytes of one micro-batch's saved activations (summed over the stages) that recompute must free
    for a plan to fit, where `_needs_recompute` holds: what its fullest device would hold beyond `budget`,
    times Σ_c 1 / in-flight(c)."""
    return prof.activation_floor(m, k) - budget * _inverse_in_flight(pp, m, schedule)


def _inverse_in_flight(pp: int, m: int, schedule: str) -> float | None:
    """Σ_c 1 / in-flight(c) over the schedule's chunks; None where a chunk keeps no micro-batch."""
    v = chunks_per_device(schedule)
    counts = [chunk_in_flight(schedule, pp, m, c, v) for c in range(pp * v)]
    return None if min(counts) <= 0 else sum(1.0 / c for c in counts)


def _per_microbatch(pp: int, m: int, schedule: str) -> float:
    """f of `stages.step_lower_bound`: the step's weight on the per-micro-batch seconds."""
    return step_lower_bound(1.0, 0.0, pp, m, schedule, INTERLEAVE)


def price(prof: Profiler, pp: int, dp: int, tp: int, m: int, schedules, budget, strategy=None,
          cutoff: float | None = None, recompute: bool = True, free_only: bool = False) -> list[Candidate]:
    """Candidates of one (pp, dp, tp, m) for each schedule: the loosest SPMD memory row whose split fits,
    else (`recompute`, auto only) the first of those rows' plans that splits with full recompute.
    `cutoff` (search="fast"): when the budget-free plan does not split under the budget, its split
    without a budget is computed first, and if that is SKIP_MARGIN times `cutoff` or slower, no memory
    row is solved: the candidate comes back infeasible, its reason starting with SKIPPED. A memory row
    only makes the SPMD plan's total slower, but not always its split's step: the row's plan spreads
    its time over the units differently (Llama-3-70B x 64 H100s, bf16, pp4 x dp4 x tp4, m 8,
    interleaved: 5.303 s budget-free, 5.291 s under its row; the other rows measured that split, +10.4%
    and +11.6%), hence the margin, and exact search prices every row. Where only full recompute can fit
    (`_needs_recompute`) and no budget-free plan splits even recomputed, the cutoff is tested again on the
    budget-free plan recomputed, as every row's plan would be priced. Under a `cutoff` one stage
    (accumulation) tries its budget-free plan first too, where otherwise its first row is the budget
    itself. The rows are the search's costly part: 2-D memory-row MIPs of 20-150 CPU s each on
    Llama-3-70B (HiGHS at the root node, cuts and sub-MIPs). `free_only` (one stage): the budget-free
    plan alone, no row (its candidate comes back infeasible when that plan does not fit)."""
    full = Mesh((pp, dp, tp), ("pp", "dp", "tp"), prof.hardware, prof.dpn)
    p2p = (lambda nbytes: full.p2p_time(nbytes, "pp")) if pp > 1 else (lambda nbytes: 0.0)
    out = []
    for schedule in schedules:
        v = chunks_per_device(schedule)
        if schedule in INTERLEAVED and m % pp:
            continue  # interleaving needs whole rounds of pp micro-batches
        if schedule in ROUNDS and m % max(1, m // pp):
            continue  # torch's ZB1P order runs rounds of equal size (`planning.schedule_options`)
        best, least, held = None, float("inf"), None   # held: (state, activation) bytes of the last plan
        skipped, solved = "", []   # solved: the (row, weight, step weight) whose SPMD plans were found, loosest first
        r = step_weight(pp, m)

        def split_under(layers, memory_budget):
            return partition(layers, pp, m, schedule, p2p_time=p2p, memory_budget=memory_budget, v=v,
                             overhead=full.hardware.runtime_overhead)

        def reprice(layers, bounds):
            return priced_split(layers, bounds, pp, m, schedule, p2p_time=p2p, v=v,
                                overhead=full.hardware.runtime_overhead)

        counts = [chunk_in_flight(schedule, pp, m, c, v) for c in range(pp * v)]   # micro-batches each chunk keeps
        rows, k, fewest = _rows(pp, counts, budget), 0, min(counts)
        if pp == 1 and (cutoff is not None or free_only) and budget is not None:
            # fast: the budget-free plan first, its rows only if it could win (`free_only`: that plan alone)
            rows = [(None, 1.0)] + ([] if free_only else rows)
        rows = [(row, w, r) for row, w in rows]
        if budget is not None and r != 1.0 and rows[0][0] is None:
            # before any memory row: the budget-free plan of least S + P, which holds per-step state more
            # frugally (ZeRO), where the step's weighting's own plan does not split
            rows.insert(1, (None, 1.0, 1.0))
        # no plan splits without recompute (`_needs_recompute`): the rows' plans can only be priced recomputed,
        # loosest first, so where a budget-free plan splits so, no memory row is solved (Llama-3.1-405B x 2,048:
        # 7 of its 16 row MIPs, ~59 CPU s each, were for the plan the budget-free rows give anyway)
        full_rc = recompute and pp > 1 and strategy is None and _needs_recompute(prof, pp, dp * tp, m, schedule, budget)
        while k < len(rows):
            (row, w, rw), k = rows[k], k + 1
            if full_rc and row is not None and solved and solved[-1][0] is None:
                full_rc = False   # once, after the budget-free rows
                best, least = _recomputed(prof, pp, dp, tp, m, schedule, v, solved, split_under, budget, least, reprice)
                if best is not None:
                    break
                if cutoff is not None and (None, 1.0, r) in solved:
                    # the fast cutoff on the plan these rows would be priced as: recomputed (below)
                    layers = prof.recomputed(m, dp, tp, None, None, 1.0, r)[0]
                    free = split_under(layers, None).step_time
                    if free >= SKIP_MARGIN * cutoff:
                        skipped = (f"{SKIPPED}: its budget-free plan, recomputed as it would have to be, splits "
                                   f"at {free:.4g} s, {free / cutoff:.2f}x the best found ({cutoff:.4g} s), and "
                                   f"needs {format_bytes(least)} per device")
                        break
            if held is not None and row is not None and held[0] + w * held[1] <= row:
                continue  # the looser plan already fits this row: a re-solve would return it again
            try:
                layers = prof.layers(m, dp, tp, row, strategy, act_weight=w, step_weight=rw)
            except InfeasiblePlanError as e:  # no SPMD plan fits this row: a tighter one cannot either
                if pp == 1:  # one stage: the whole graph's memory is the device's
                    least = min(least, e.min_memory_per_device or float("inf"))
                if w == 1.0 and row == pp * budget:
                    break   # every stage keeps >= 1 micro-batch: no split of any plan holds less than this row
                rows[k:] = [x for x in rows[k:] if x[1] != w]   # drop this weight's tighter rows
                floor = e.min_memory_per_device   # the least weighted memory any SPMD plan has
                if floor is not None and floor * fewest / w > pp * budget * (1 + 1e-9):
                    break   # no plan splits under any row: its stages hold >= (fewest / w) * floor together
                if (w != 1.0 and floor is not None and math.isfinite(floor) and (floor * FLOOR_SLACK, w, rw) not in rows
                        and floor * fewest / w <= pp * budget):
                    rows.insert(k, (floor * FLOOR_SLACK, w, rw))   # the most activation-frugal plans
                continue
            held = (sum(x.state_bytes for x in layers), sum(x.activation_bytes for x in layers))
            solved.append((row, w, rw))
            if pp * v > len(layers):
                break
            try:
                split = split_under(layers, budget)
            except InfeasiblePlanError as e:
                least = min(least, e.min_memory_per_device or float("inf"))
                if cutoff is not None and row is None and rw == r:
                    free = split_under(layers, None).step_time
                    if free >= SKIP_MARGIN * cutoff:
                        skipped = (f"{SKIPPED}: its budget-free plan splits at {free:.4g} s, {free / cutoff:.2f}x the "
                                   f"best found ({cutoff:.4g} s), and needs {format_bytes(least)} per device")
                        break
                continue
            best = Candidate(pp, dp, tp, m, schedule, True, split.step_time, max(split.stage_memory), split,
                             stage_modules(layers, split), row, w, inner_step_weight=rw)
            break
        if best is None and recompute and not skipped and pp > 1 and strategy is None:
            best, least = _recomputed(prof, pp, dp, tp, m, schedule, v, solved, split_under, budget, least, reprice)
        if best is None and least < float("inf"):
            best = Candidate(pp, dp, tp, m, schedule, False, None, least,
                             reason=skipped or f"needs {format_bytes(least)} per device")
        if best is not None:
            out.append(best)
    return out


def _recomputed(prof: Profiler, pp, dp, tp, m, schedule, v, solved, split_under, budget, least, reprice):
    """(the candidate, least memory) with recompute: where no plan of the rows splits within the
    budget, each of them (loosest first) with every layer that can recompute re-running its forward in
    backward (`Profiler.recomputed`, strategies unchanged): the first whose split fits, then with only
    the layers that split's devices need recomputing (`fewest_recomputed`). A recomputed layer's
    activations shrink to its input, for the re-run forward's seconds (Llama-3.1-405B, 2,048 x 8,192
    tokens on 2,048 H100s: no candidate fit 80 GB without recompute, the least needed 81.9 GB)."""
    for row, w, rw in solved:
        layers, _, rc = prof.recomputed(m, dp, tp, row, None, w, rw)
        if not rc.paths or pp * v > len(layers):
            return None, least
        try:
            split = split_under(layers, budget)
        except InfeasiblePlanError as e:
            least = min(least, e.min_memory_per_device or float("inf"))
            continue
        plain = prof.layers(m, dp, tp, row, None, w, rw)
        layers, split, names = fewest_recomputed(plain, layers, split, budget, pp, m, schedule, v, reprice)
        for _ in range(RESPLITS):   # the thinned profile's own split, thinned again, while it steps faster
            try:
                again = split_under(layers, budget)
            except InfeasiblePlanError:
                break
            if again.step_time >= split.step_time * (1 - 1e-12):
                break
            layers, split, names = fewest_recomputed(plain, layers, again, budget, pp, m, schedule, v, reprice)
        return Candidate(pp, dp, tp, m, schedule, True, split.step_time, max(split.stage_memory), split,
                         stage_modules(layers, split), row, w, rw, recompute=names), least
    return None, least


def fewest_recomputed(plain: list[LayerCost], recomputed: list[LayerCost], split: StageSplit, budget: float | None,
                      pp: int, m: int, schedule: str, v: int, reprice) -> tuple[list[LayerCost], StageSplit, tuple]:
    """The split `split` of the `recomputed` profile (every layer that can recompute does: Megatron's full
    recompute) with as few layers recomputed as its devices' budget allows, stage bounds unchanged: each
    layer's re-run forward costs seconds on its stage and saves in-flight activations there, so layers go
    back to `plain` (the same strategies, not recomputed) one at a time, the most seconds saved per byte
    added first (the highest layer first among equals: a stack recomputing its lowest layers adds no
    re-run peak), while their device stays within `budget`. (mixed profile, its split priced by
    `reprice(layers, bounds)`, the names of the layers still recomputed, in order.) Where the search
    priced full recompute only, Llama-3.1-405B x 2,048 recomputed 125 of its 126 layers on stages with
    room; now 104, each stage as many as its in-flight count needs (75.27 -> 74.81 s per step)."""
    on = [i for i, (a, b) in enumerate(zip(plain, recomputed)) if a != b]
    if budget is None or not on:
        return list(recomputed), split, tuple(recomputed[i].name for i in on)
    chunk_of = np.searchsorted(np.asarray(split.bounds), np.arange(len(plain)), side="right") - 1
    room = [budget - used for used in split.stage_memory]   # per device (its chunks: `stages.chunk_device`)

    def added(i: int) -> float:   # the in-flight activations layer i keeps again on its device
        k = int(chunk_of[i])
        return chunk_in_flight(schedule, pp, m, k, v) * (
            plain[i].activation_bytes - recomputed[i].activation_bytes)

    def saved(i: int) -> float:
        return (recomputed[i].forward + recomputed[i].backward) - (plain[i].forward + plain[i].backward)

    mixed = list(recomputed)
    for i in sorted(on, key=lambda i: (-saved(i) / max(added(i), 1e-30), -i)):
        d = chunk_device(schedule, pp, int(chunk_of[i]))
        if saved(i) > 0 and added(i) <= room[d]:
            mixed[i], room[d] = plain[i], room[d] - added(i)
    if all(mixed[i] is recomputed[i] for i in on):
        return mixed, split, tuple(recomputed[i].name for i in on)
    relaxed = reprice(mixed, split.bounds)
    if max(relaxed.stage_memory) > budget or relaxed.step_time > split.step_time:   # rounding: keep the full recompute
        return list(recomputed), split, tuple(recomputed[i].name for i in on)
    return mixed, relaxed, tuple(recomputed[i].name for i in on if mixed[i] is recomputed[i])


def _rows(pp: int, counts: list[float], budget: float | None) -> list[tuple[float | None, float]]:
    """(memory row, activation weight) in the order tried: no row, the loosest unweighted row (so a
    candidate that split there before still does, with the same plan), then for a pipeline the rows
    weighing activations by the stages' mean in-flight count, then the tighter unweighted rows. One
    stage starts at the budget itself: the solver returns the fastest plan when it fits (the same
    one, at the same cost), and when no plan fits it says so without solving for the fastest."""
    rows = [(None, 1.0)]
    if budget is None:
        return rows
    if pp == 1:   # one stage fits iff its plan meets the row; the fastest plan is tried first when it does
        return [(budget * f, 1.0) for f in INNER_TIGHTENING]
    w = float(np.mean(counts))
    unweighted = [(pp * budget * f, 1.0) for f in INNER_TIGHTENING]
    weighted = [(pp * budget * f, w) for f in INNER_TIGHTENING] if w != 1.0 else []
    return rows + unweighted[:1] + weighted + unweighted[1:]


def stage_modules(layers, split: StageSplit) -> tuple[tuple[str, ...], ...]:
    ends = list(split.bounds[1:]) + [len(layers)]
    return tuple(tuple(x.name for x in layers[a:b]) for a, b in zip(split.bounds, ends))
