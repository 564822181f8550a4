"""Pipeline stage math (autopar/pipeline/stages.py): schedule formulas against a simulated timeline, the
exact partition against brute force, and the splits it must find on uneven or memory-bound models."""
from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from autopar.errors import InfeasiblePlanError
from autopar.pipeline.stages import (
    LayerCost,
    bubble_fraction,
    chunk_device,
    chunk_in_flight,
    in_flight,
    memory_counts,
    mesh_factorizations,
    partition,
    schedule_step_time,
    step_lower_bound,
)


def simulate(fwd, bwd, m, schedule, p2p=0.0):
    """Event simulation of one step: each stage runs its ops in schedule order; F(i, j) waits for
    F(i-1, j), B(i, j) for B(i+1, j) (the last stage's for its own F). A send blocks its stage."""
    p = len(fwd)
    f = [fwd[i] + (p2p if i < p - 1 else 0.0) for i in range(p)]
    b = [bwd[i] + (p2p if i > 0 else 0.0) for i in range(p)]
    orders = []
    for i in range(p):
        if schedule == "gpipe":
            orders.append([("F", j) for j in range(m)] + [("B", j) for j in range(m)])
        else:  # 1f1b: p - i - 1 warm-up forwards, then one forward one backward, then the drain
            warm = min(p - i - 1, m)
            ops = [("F", j) for j in range(warm)]
            for j in range(m - warm):
                ops += [("F", warm + j), ("B", j)]
            ops += [("B", j) for j in range(m - warm, m)]
            orders.append(ops)
    done, free, pos = {}, [0.0] * p, [0] * p
    while any(pos[i] < len(orders[i]) for i in range(p)):
        progressed = False
        for i in range(p):
            if pos[i] == len(orders[i]):
                continue
            kind, j = orders[i][pos[i]]
            dep = (("F", i - 1, j) if i > 0 else None) if kind == "F" else \
                  (("B", i + 1, j) if i < p - 1 else ("F", i, j))
            if dep is not None and dep not in done:
                continue
            start = max(free[i], done[dep] if dep else 0.0)
            free[i] = done[(kind, i, j)] = start + (f[i] if kind == "F" else b[i])
            pos[i] += 1
            progressed = True
        assert progressed, "schedule deadlocked"
    return max(free)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 3), (8, 16)])
def test_gpipe_step_formula_matches_simulated_timeline(p, m):
    rng = random.Random(p * 100 + m)
    fwd = [rng.uniform(1.0, 3.0) for _ in range(p)]
    bwd = [2.0 * x for x in fwd]  # backward paced by the same stage as forward
    sim = simulate(fwd, bwd, m, "gpipe", p2p=0.05)
    assert schedule_step_time(fwd, bwd, m, "gpipe", p2p=0.05) == pytest.approx(sim, rel=0.01)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 3), (8, 16)])
def test_1f1b_step_formula_exact_when_balanced_and_an_upper_bound_otherwise(p, m):
    """1F1B overlaps an early bottleneck stage's warm-up with later stages, so for uneven stages
    sum t + (m-1) max t is pessimistic (here by < 10%); balanced it is exact."""
    assert schedule_step_time([1.0] * p, [2.0] * p, m, "1f1b") == pytest.approx(
        simulate([1.0] * p, [2.0] * p, m, "1f1b"), rel=0.01)
    rng = random.Random(p * 10 + m)
    fwd = [rng.uniform(1.0, 3.0) for _ in range(p)]
    bwd = [2.0 * x for x in fwd]
    sim = simulate(fwd, bwd, m, "1f1b", p2p=0.05)
    formula = schedule_step_time(fwd, bwd, m, "1f1b", p2p=0.05)
    assert sim - 1e-9 <= formula <= 1.1 * sim


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 12), (8, 32)])
def test_gpipe_bubble_formula_matches_simulation(p, m):
    sim = simulate([1.0] * p, [2.0] * p, m, "gpipe")
    idle = 1.0 - m * 3.0 / sim
    assert idle == pytest.approx(bubble_fraction(p, m, "gpipe"), abs=0.01)
    assert bubble_fraction(p, m, "interleaved_1f1b", v=2) == pytest.approx((p - 1) / (2 * m + p - 1))


def test_in_flight_counts():
    assert [in_flight("gpipe", 4, 8, k) for k in range(4)] == [8] * 4
    assert [in_flight("1f1b", 4, 8, k) for k in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 4, 2, k) for k in range(4)] == [2, 2, 2, 1]


def _random_layers(rng, n):
    return [LayerCost(f"l{i}", rng.uniform(0.1, 2.0), rng.uniform(0.2, 4.0), rng.uniform(1, 10),
                      rng.uniform(1, 5), rng.uniform(0.5, 3)) for i in range(n)]


def brute_force(layers, p, m, schedule, p2p, budget):
    """Every contiguous split, priced by schedule_step_time-compatible arithmetic."""
    n, best = len(layers), None
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts)
        ends = (*cuts, n)
        t, ok = [], True
        for k, (a, b) in enumerate(zip(bounds, ends)):
            seg = layers[a:b]
            time = sum(x.forward + x.backward for x in seg)
            time += (p2p(layers[b - 1].boundary_bytes) if b < n else 0) + (p2p(layers[a - 1].boundary_bytes) if a else 0)
            mem = sum(x.state_bytes for x in seg) + in_flight(schedule, p, m, k) * sum(x.activation_bytes for x in seg)
            ok &= budget is None or mem <= budget
            t.append(time)
        if ok:
            step = sum(t) + (m - 1) * max(t)
            if best is None or step < best[0] - 1e-12:
                best = (step, bounds)
    return best


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_partition_equals_brute_force(schedule):
    rng = random.Random(7)
    p2p = lambda nbytes: 0.3 * nbytes  # noqa: E731
    checked = 0
    for trial in range(40):
        n, p, m = rng.randint(3, 9), rng.randint(1, 4), rng.randint(1, 6)
        if p > n:
            continue
        layers = _random_layers(rng, n)
        budget = rng.choice([None, rng.uniform(20, 60)])
        expect = brute_force(layers, p, m, schedule, p2p, budget)
        if expect is None:
            with pytest.raises(InfeasiblePlanError):
                partition(layers, p, m, schedule, p2p_time=p2p, memory_budget=budget)
            continue
        got = partition(layers, p, m, schedule, p2p_time=p2p, memory_budget=budget)
        assert got.step_time == pytest.approx(expect[0], rel=1e-9)
        assert len(got.bounds) == p and got.bounds[0] == 0
        assert budget is None or max(got.stage_memory) <= budget
        checked += 1
    assert checked >= 20


def test_uneven_model_balances_time_not_layer_count():
    """Large embedding and LM head around 8 small blocks: the end stages get fewer units."""
    emb = LayerCost("emb", 4.0, 8.0, 0, 1, 1)
    head = LayerCost("head", 4.0, 8.0, 0, 1, 1)
    blocks = [LayerCost(f"h.{i}", 1.0, 2.0, 0, 1, 1) for i in range(8)]
    split = partition([emb, *blocks, head], 4, 8, "1f1b", p2p_time=lambda b: 0.0)
    # stage times 12 | 4 blocks = 12 | 4 blocks = 12 | 12: perfectly balanced, not 3/3/2/2 units
    assert split.bounds == (0, 1, 5, 9)
    assert split.stage_times == pytest.approx((12.0, 12.0, 12.0, 12.0))
    assert split.step_time == pytest.approx(4 * 12 + 7 * 12)


def test_in_flight_memory_changes_the_split():
    """1F1B keeps p - k micro-batches on stage k: a tight budget pushes layers to later stages, and
    a budget too tight for 2 stages needs more of them."""
    layers = [LayerCost(f"h.{i}", 1.0, 2.0, 1.0, 10.0, 1.0) for i in range(8)]
    free = partition(layers, 2, 8, "1f1b", p2p_time=lambda b: 0.0)
    assert free.bounds == (0, 4)
    tight = partition(layers, 2, 8, "1f1b", p2p_time=lambda b: 0.0, memory_budget=65.0)
    assert tight.bounds == (0, 3)  # stage 0 holds 2 micro-batches: 3 layers * (1 + 20) = 63 <= 65
    assert max(tight.stage_memory) <= 65.0 and tight.step_time > free.step_time
    with pytest.raises(InfeasiblePlanError):
        partition(layers, 2, 8, "1f1b", p2p_time=lambda b: 0.0, memory_budget=50.0)
    more = partition(layers, 4, 8, "1f1b", p2p_time=lambda b: 0.0, memory_budget=50.0)
    assert max(more.stage_memory) <= 50.0


def test_infeasible_reports_minimum_memory():
    layers = [LayerCost(f"h.{i}", 1.0, 2.0, 5.0, 1.0, 1.0) for i in range(4)]
    with pytest.raises(InfeasiblePlanError) as info:
        partition(layers, 2, 4, "gpipe", p2p_time=lambda b: 0.0, memory_budget=10.0)
    # best split: 2 + 2 layers, each 2 * 5 state + 4 in flight * 2 * 1 activations = 18
    assert info.value.min_memory_per_device == pytest.approx(18.0)
    assert partition(layers, 2, 4, "gpipe", p2p_time=lambda b: 0.0, memory_budget=18.0).bounds == (0, 2)


def test_interleaved_split_fits_and_beats_plain_1f1b_bubble():
    layers = [LayerCost(f"h.{i}", 1.0, 2.0, 1.0, 1.0, 1.0) for i in range(16)]
    plain = partition(layers, 4, 4, "1f1b", p2p_time=lambda b: 0.0)
    inter = partition(layers, 4, 4, "interleaved_1f1b", p2p_time=lambda b: 0.0, v=2)
    assert len(inter.bounds) == 8 and len(inter.stage_memory) == 4
    assert inter.step_time < plain.step_time
    assert inter.bubble_fraction == pytest.approx(bubble_fraction(4, 4, "interleaved_1f1b", v=2))


def test_mesh_factorizations_keep_tp_in_a_node():
    got = mesh_factorizations(16, 4)
    assert all(pp * dp * tp == 16 and 4 % tp == 0 for pp, dp, tp in got)
    assert (1, 1, 16) not in got and (1, 4, 4) in got and (16, 1, 1) in got
    assert len(mesh_factorizations(8, None)) == 10


def _interleaved_brute_force(layers, p, m, v, p2p, budget):
    """Every contiguous split into p * v chunks, priced by the module docstring's device formula:
    step = sum_j t_j / v + (m - 1/v) max_d D_d, device d holding chunks d, d + p, ... (memory: their sum)."""
    n, best = len(layers), None
    for cuts in itertools.combinations(range(1, n), p * v - 1):
        bounds, ends = (0, *cuts), (*cuts, n)
        t, mem = [], [0.0] * p
        for k, (a, b) in enumerate(zip(bounds, ends)):
            seg = layers[a:b]
            t.append(sum(x.forward + x.backward for x in seg) + (p2p(layers[b - 1].boundary_bytes) if b < n else 0)
                     + (p2p(layers[a - 1].boundary_bytes) if a else 0))
            mem[k % p] += sum(x.state_bytes for x in seg) + chunk_in_flight(
                "interleaved_1f1b", p, m, k, v) * sum(x.activation_bytes for x in seg)
        if budget is None or max(mem) <= budget:
            step = sum(t) / v + (m - 1 / v) * max(sum(t[d::p]) for d in range(p))
            best = step if best is None else min(best, step)
    return best


def test_interleaved_split_fits_and_is_near_the_exhaustive_optimum():
    """Interleaved 1F1B's split is not proven optimal (a device's chunks are not contiguous), but on
    random models it fits every device, is the exhaustive optimum on most and close on the rest:
    the surrogate search alone (one even budget share, the least-sum split per bottleneck) was exact
    on 15 of 57 of these, 5.3% over on average, up to 26%; with the round shares and the boundary moves,
    35 of 60, 1.9%, 17% (and fewer feasible models called infeasible: 7 against 10)."""
    rng = random.Random(11)
    p2p = lambda nbytes: 0.3 * nbytes  # noqa: E731
    ratios = []
    for _ in range(120):
        n, p, v = rng.randint(5, 10), rng.randint(2, 3), 2
        m = p * rng.randint(1, 3)
        if p * v > n:
            continue
        layers = _random_layers(rng, n)
        budget = rng.choice([None, rng.uniform(20, 60)])
        best = _interleaved_brute_force(layers, p, m, v, p2p, budget)
        try:
            got = partition(layers, p, m, "interleaved_1f1b", p2p_time=p2p, memory_budget=budget, v=v)
        except InfeasiblePlanError:
            continue
        assert best is not None and got.step_time >= best * (1 - 1e-9)   # a real split: never below the optimum
        assert budget is None or max(got.stage_memory) <= budget * (1 + 1e-12)
        ratios.append(got.step_time / best)
    assert len(ratios) >= 50
    assert sum(r < 1 + 1e-9 for r in ratios) >= len(ratios) / 2 and sum(ratios) / len(ratios) < 1.03


@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (8, 32)])
def test_zero_bubble_step_is_zb_h1_when_balanced(p, m):
    """torch's ScheduleInterleavedZeroBubble order, priced by `zero_bubble_step` (its dependency graph's
    longest path): with F = B = W per stage, the ZB-H1 step of Qi et al., m(F + B + W) + (p - 1)(F + B - W),
    against 1F1B's (m + p - 1)(F + B + W); the bubble formula says the same."""
    step = schedule_step_time([1.0] * p, [2.0] * p, m, "zero_bubble", weight=[1.0] * p)
    assert step == pytest.approx(3 * m + (p - 1))
    assert schedule_step_time([1.0] * p, [2.0] * p, m, "1f1b") == pytest.approx(3 * (m + p - 1))
    assert bubble_fraction(p, m, "zero_bubble") == pytest.approx((p - 1) / step)
    # a stage keeps the activations of every forward whose W has not run: p of them at the peak
    assert [in_flight("zero_bubble", p, m, k) for k in range(p)] == [min(m, p)] * p


def test_zero_bubble_step_between_the_work_bound_and_1f1b():
    """Uneven stages, random F / B / W and p2p: the zero-bubble step is never above 1F1B's formula for the
    same stage times (W only leaves the backward chain) and never below `step_lower_bound` (the busiest
    stage's own work), and without W (nothing to fill the bubble with) it is no faster than 1F1B's timeline."""
    rng = random.Random(11)
    for _ in range(60):
        p, m = rng.randint(2, 6), rng.randint(1, 12)
        fwd = [rng.uniform(0.5, 2.0) for _ in range(p)]
        weight = [rng.uniform(0.0, 1.0) * f for f in fwd]
        bwd = [w + rng.uniform(0.5, 2.0) * f for w, f in zip(weight, fwd)]
        p2p = rng.choice([0.0, 0.2])
        zb = schedule_step_time(fwd, bwd, m, "zero_bubble", p2p=p2p, weight=weight)
        assert zb <= schedule_step_time(fwd, bwd, m, "1f1b", p2p=p2p) * (1 + 1e-9)
        total = sum(fwd) + sum(bwd)
        assert zb >= step_lower_bound(total, 0.0, p, m, "zero_bubble") * (1 - 1e-9)
        assert schedule_step_time(fwd, bwd, m, "zero_bubble", p2p=p2p) >= simulate(fwd, bwd, m, "1f1b", p2p) - 1e-9


def test_zero_bubble_partition_prices_its_split_by_the_order():
    """partition(schedule="zero_bubble") returns a split whose step is the order's own price of its stages
    (`schedule_step_time` with their forward, backward and weight seconds), no slower than the best 1F1B
    split of the same layers when the layers have weight-gradient seconds to move."""
    rng = random.Random(5)
    for _ in range(20):
        n, p, m = rng.randint(4, 9), rng.randint(2, 4), rng.randint(2, 8)
        layers = [dataclasses.replace(x, weight=0.4 * x.backward) for x in _random_layers(rng, n)]
        zb = partition(layers, p, m, "zero_bubble", p2p_time=lambda b: 0.0)
        ends = list(zb.bounds[1:]) + [n]
        stages = [layers[a:b] for a, b in zip(zb.bounds, ends)]
        want = schedule_step_time([sum(x.forward for x in s) for s in stages], [sum(x.backward for x in s) for s in stages],
                                  m, "zero_bubble", weight=[sum(x.weight for x in s) for s in stages])
        assert zb.step_time == pytest.approx(want + max(sum(x.per_step for x in s) for s in stages))
        assert zb.step_time <= partition(layers, p, m, "1f1b", p2p_time=lambda b: 0.0).step_time * (1 + 1e-9)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_interleaved_zero_bubble_step_below_zb_h1_when_balanced(p, m):
    """schedule="interleaved_zero_bubble": torch's ZB1P order on v = 2 chunks per device (chunk k on device
    k % p), priced by its dependency graph. Balanced (each chunk half a stage's F, B and W): never below the
    device's own work, 3m, and its fill and drain shorter than ZB-H1's on one chunk (p - 1)(F + B - W), as
    interleaving shrinks a pipeline's bubble; the bubble formula's fill is one chunk's; a device keeps as many
    activations (chunk-micro-batches / v) as ZB-H1's stage, and W waits on chunks past the first only."""
    n = 2 * p
    step = schedule_step_time([0.5] * n, [1.0] * n, m, "interleaved_zero_bubble", weight=[0.5] * n, v=2)
    assert 3 * m <= step < 3 * m + (p - 1)
    assert bubble_fraction(p, m, "interleaved_zero_bubble", v=2) == pytest.approx((p - 1) / (6 * m + p - 1))
    assert [chunk_in_flight("interleaved_zero_bubble", p, m, k, 2) for k in range(p)] == \
        [in_flight("zero_bubble", p, m, k) for k in range(p)]
    counts = memory_counts("interleaved_zero_bubble", p, m, 2)
    assert counts[0][1] == 0 and all(w > 0 for _, w in counts[1:])   # chunk 0's B is empty: nothing carried


def test_interleaved_zero_bubble_partition_prices_its_split_by_the_order():
    """partition(schedule="interleaved_zero_bubble", v=2) returns p * v chunks, chunk k on device k % p, whose step
    is the order's own price of its chunks and whose devices' memory is their chunks' sum within the budget; under
    a budget its budget-free split fits, no split slower than that one."""
    rng = random.Random(7)
    for _ in range(20):
        p = rng.randint(2, 3)
        n, m = rng.randint(2 * p, 9), p * rng.randint(1, 3)
        layers = [dataclasses.replace(x, weight=0.4 * x.backward, carried_bytes=0.3 * x.activation_bytes)
                  for x in _random_layers(rng, n)]
        free = partition(layers, p, m, "interleaved_zero_bubble", p2p_time=lambda b: 0.0, v=2)
        budget = 1.1 * max(free.stage_memory)
        # the budget-free split fits: partition keeps it (the shares alone missed 7 of these 20)
        got = partition(layers, p, m, "interleaved_zero_bubble", p2p_time=lambda b: 0.0, v=2, memory_budget=budget)
        assert got.step_time <= free.step_time * (1 + 1e-12)
        assert len(got.bounds) == 2 * p and max(got.stage_memory) <= budget * (1 + 1e-12)
        ends = list(got.bounds[1:]) + [n]
        chunks = [layers[a:b] for a, b in zip(got.bounds, ends)]
        want = schedule_step_time([sum(x.forward for x in c) for c in chunks], [sum(x.backward for x in c) for c in chunks],
                                  m, "interleaved_zero_bubble", weight=[sum(x.weight for x in c) for c in chunks], v=2)
        per_step = [sum(x.per_step for c in chunks[d::p] for x in c) for d in range(p)]
        assert got.step_time == pytest.approx(want + max(per_step))
        counts = memory_counts("interleaved_zero_bubble", p, m, 2)
        memory = [sum(x.state_bytes + a * x.activation_bytes + w * x.carried_bytes for x in c)
                  for c, (a, w) in zip(chunks, counts)]
        assert got.stage_memory == pytest.approx([sum(memory[d::p]) for d in range(p)])


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (4, 8), (8, 16)])
def test_zero_bubble_v_step_and_memory_when_balanced(p, m):
    """schedule="zero_bubble_v": torch's ScheduleZBVZeroBubble order on two chunks per device in a V (device d
    holds chunks d and 2p - 1 - d), priced by its dependency graph. Balanced (each chunk half a stage's F, B
    and W): never below the device's own work, 3m, and its fill and drain shorter than ZB-H1's on one chunk,
    (p - 1)(F + B - W), from 2p - 1 micro-batches on; with a transfer per cut, the cut between chunks p - 1 and p (one device) is free, so
    the step is below interleaved zero bubble's, which crosses every cut (again from 2p - 1 on). A device keeps as many activations
    (chunk-micro-batches / 2) as ZB-H1's stage, at most 1F1B's first stage's; W waits on chunks past the first."""
    n = 2 * p
    step = schedule_step_time([0.5] * n, [1.0] * n, m, "zero_bubble_v", weight=[0.5] * n)
    assert 3 * m <= step <= 3 * m + (p - 1)
    assert step < 3 * m + (p - 1) or m < 2 * p - 1   # torch's V fills its steady state from 2p - 1 micro-batches
    assert [chunk_device("zero_bubble_v", p, k) for k in range(n)] == [*range(p), *reversed(range(p))]
    assert [chunk_device("interleaved_zero_bubble", p, k) for k in range(n)] == [*range(p)] * 2
    with_p2p = schedule_step_time([0.5] * n, [1.0] * n, m, "zero_bubble_v", weight=[0.5] * n, p2p=0.1)
    loop = schedule_step_time([0.5] * n, [1.0] * n, m, "interleaved_zero_bubble", weight=[0.5] * n, p2p=0.1, v=2)
    assert with_p2p < loop or m < 2 * p - 1   # (2 micro-batches on 2 devices: 7.5 against 7.2)
    per_chunk = [chunk_in_flight("zero_bubble_v", p, m, k, 2) for k in range(n)]
    # a device's two chunks (half a stage's activations each) keep c of them each: c stages' worth
    assert all(c <= in_flight("1f1b", p, m, 0) for c in per_chunk)
    assert per_chunk == [min(m, p)] * n or m < 2 * p - 1
    counts = memory_counts("zero_bubble_v", p, m, 2)
    assert counts[0][1] == 0 and all(w > 0 for _, w in counts[1:])   # chunk 0's B is empty: nothing carried


def test_zero_bubble_v_partition_places_chunks_in_a_v():
    """partition(schedule="zero_bubble_v") returns 2p chunks, chunk k on device `chunk_device` (d and 2p - 1 - d),
    whose step is the order's own price of its chunks (the cut between chunks p - 1 and p costs nothing: one
    device) and whose devices' memory is their two chunks' sum, within the budget."""
    rng = random.Random(17)
    for _ in range(20):
        p = rng.randint(2, 3)
        n, m = rng.randint(2 * p, 9), rng.randint(1, 3 * p)
        layers = [dataclasses.replace(x, weight=0.4 * x.backward, carried_bytes=0.3 * x.activation_bytes)
                  for x in _random_layers(rng, n)]
        p2p = rng.choice([0.0, 0.3])
        free = partition(layers, p, m, "zero_bubble_v", p2p_time=lambda b: p2p)
        budget = 1.1 * max(free.stage_memory)
        got = partition(layers, p, m, "zero_bubble_v", p2p_time=lambda b: p2p, memory_budget=budget)
        assert len(got.bounds) == 2 * p and max(got.stage_memory) <= budget * (1 + 1e-12)
        assert got.step_time <= free.step_time * (1 + 1e-12)
        ends = list(got.bounds[1:]) + [n]
        chunks = [layers[a:b] for a, b in zip(got.bounds, ends)]
        want = schedule_step_time([sum(x.forward for x in c) for c in chunks],
                                  [sum(x.backward for x in c) for c in chunks], m, "zero_bubble_v",
                                  weight=[sum(x.weight for x in c) for c in chunks], p2p=p2p)
        device = [chunk_device("zero_bubble_v", p, k) for k in range(2 * p)]
        per_step = [sum(x.per_step for k, c in enumerate(chunks) if device[k] == d for x in c) for d in range(p)]
        assert got.step_time == pytest.approx(want + max(per_step))
        counts = memory_counts("zero_bubble_v", p, m, 2)
        memory = [sum(x.state_bytes + a * x.activation_bytes + w * x.carried_bytes for x in c)
                  for c, (a, w) in zip(chunks, counts)]
        assert got.stage_memory == pytest.approx([sum(mem for k, mem in enumerate(memory) if device[k] == d)
                                                  for d in range(p)])


def test_the_banded_least_sum_equals_every_split_enumerated():
    """`stages._least_sum` (its DP on the band of stages the bound and masks allow, `_Band`): the least sum of
    stage times over contiguous splits whose every stage is within the bound and its own mask, against all
    splits enumerated, with ties (equal units) and masks that rule out long stages or some stages' places."""
    import numpy as np

    from autopar.pipeline.stages import _least_sum, _segment

    rng = np.random.default_rng(5)
    for trial in range(60):
        n, p = int(rng.integers(2, 9)), int(rng.integers(1, 5))
        if p > n:
            continue
        units = rng.choice([1.0, 2.0, 3.0], n) if trial % 2 else rng.uniform(0.5, 2.0, n)   # ties on odd trials
        T = _segment(np.r_[0.0, np.cumsum(units)])
        longest = int(rng.integers(1, n + 1))
        masks = [np.triu(np.ones((n, n), bool)) & (np.subtract.outer(np.arange(n), np.arange(n)) > -longest)
                 & (rng.uniform(size=(n, n)) > 0.15) for _ in range(p)]
        bound = float(rng.choice([np.inf, float(np.median(T[np.isfinite(T)]))]))
        best = None
        for cuts in itertools.combinations(range(1, n), p - 1):
            starts, ends = (0, *cuts), (*cuts, n)
            if all(masks[k][a, b - 1] and T[a, b - 1] <= bound for k, (a, b) in enumerate(zip(starts, ends))):
                total = sum(T[a, b - 1] for a, b in zip(starts, ends))
                best = total if best is None else min(best, total)
        got = _least_sum(T, masks, bound)
        if best is None:
            assert got is None
            continue
        total, bounds = got
        assert total == pytest.approx(best)
        ends = bounds[1:] + [n]
        assert bounds[0] == 0 and all(a < b for a, b in zip(bounds, ends))
        assert all(masks[k][a, b - 1] and T[a, b - 1] <= bound for k, (a, b) in enumerate(zip(bounds, ends)))
        assert sum(T[a, b - 1] for a, b in zip(bounds, ends)) == pytest.approx(total)


@pytest.mark.parametrize("schedule", ["zero_bubble", "interleaved_zero_bubble", "zero_bubble_v"])
def test_a_zero_bubble_splits_floor_is_below_its_walked_step(schedule):
    """`stages._Priced.floor`, what lets `partition` skip walking torch's order for a split that cannot beat the
    best found: each device's m micro-batches of its chunks' work after every earlier chunk's forward, plus the
    per-step seconds. Never above the split's walked step (random units, cuts, transfers, per-step seconds), and
    the busiest device's work alone would be a weaker floor on the later devices (the forwards they wait for)."""
    import numpy as np

    from autopar.pipeline.stages import (
        _parts,
        _per_device,
        _prefix,
        _Priced,
        _Shared,
        _stage_memory,
        chunks_per_device,
        stage_time_matrix,
    )

    rng = random.Random(3)
    v = chunks_per_device(schedule)
    above_work = 0
    for _ in range(40):
        n, p = rng.randint(2 * v + 2, 16), rng.randint(2, 4)
        if p * v > n:
            continue
        m = rng.choice([p, 2 * p, 4 * p] if schedule != "zero_bubble_v" else [2 * p, 4 * p])
        layers = [dataclasses.replace(x, weight=rng.uniform(0.1, 0.6) * x.backward, per_step=rng.uniform(0.0, 0.3),
                                      boundary_bytes=rng.uniform(0.0, 1e9)) for x in _random_layers(rng, n)]
        p2p = lambda b: 1e-9 * b   # noqa: E731
        T, counts = stage_time_matrix(layers, p2p), memory_counts(schedule, p, m, v)
        mem = _stage_memory(layers, counts)
        args = (T, np.stack([mem[c] for c in counts]), m, schedule, v, _prefix(layers, "per_step"),
                _Shared.of(layers), _parts(layers, schedule, p2p))
        for _ in range(10):
            bounds = [0] + sorted(rng.sample(range(1, n), p * v - 1))
            priced = _Priced(bounds, *args)
            step = priced.split().step_time
            assert priced.floor <= step
            work = m * float(_per_device(priced.times, schedule, p, v).max()) + float(priced.once.max())
            above_work += priced.floor > work
    assert above_work > 0
