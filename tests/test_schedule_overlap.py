"""schedule_overlap: gradient buckets start in the backward as their last gradient is produced and are
waited at the end; the collectives really run asynchronously on gloo; numerics equal one process."""
from __future__ import annotations

from collections import Counter
from datetime import timedelta

import pytest
import torch

from autopar._testing import models
from autopar._testing.dist_cases import assert_matches, train_many, train_reference
from autopar._testing.dist_cases import lowered_for_rank0_of_2 as _lowered
from autopar._testing.dist_utils import run_distributed
from autopar.graph import is_view_like
from autopar.ir import IRError, verify
from autopar.passes import PIPELINE, emitted_collectives, schedule_overlap
from autopar.passes.ops import dense_in_order, start_all_reduce, start_reduce_scatter, wait_buckets

STARTS = (start_all_reduce, start_reduce_scatter)
SMALL = dict(FIRST_BUCKET_BYTES=4096, BUCKET_BYTES=16384)  # many buckets on a tiny GPT


@pytest.mark.parametrize("strategy", ["dp", "zero3"])
def test_buckets_start_when_their_last_gradient_is_produced_and_wait_at_the_end(gpt_case, monkeypatch, strategy):
    for name, value in SMALL.items():
        monkeypatch.setattr(schedule_overlap, name, value)
    plan, _, gm = _lowered(gpt_case, strategy)
    nodes = list(gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    starts = [n for n in nodes if n.target in STARTS]
    assert len(starts) >= 4, "small buckets: several reductions in flight"
    last_inputs = []
    for start in starts:
        last = max(at[x] for x in start.args[0])
        # nothing but other buckets' starts between the last gradient and its bucket's start
        assert all(n.target in STARTS for n in nodes[last + 1:at[start]]), start.name
        last_inputs.append(last)
    assert last_inputs == sorted(last_inputs), "buckets follow the order the backward produces gradients"
    # the first bucket starts while most of the backward is still to run
    compute = [i for i, n in enumerate(nodes) if n.op == "call_function" and n.meta.get("phase") == "backward"
               and "autopar_pass" not in n.meta]
    assert at[starts[0]] < compute[len(compute) // 2]
    # every wait comes after all compute: only waits, their getitems and views of the results follow
    first_wait = min(at[n] for n in nodes if n.target is wait_buckets)
    assert first_wait > compute[-1]
    for n in nodes[first_wait:]:
        assert n.op == "output" or n.target is wait_buckets or "getitem" in str(n.target) or is_view_like(n) \
            or n.target is dense_in_order, n.name
    emitted = Counter((c["kind"], c["phase"]) for c in emitted_collectives(gm))
    assert emitted == Counter((r.kind, r.phase) for r in plan.collectives)


def test_overlap_changes_no_collective_and_no_computation(gpt_case, monkeypatch):
    """With and without the pass: the same logical collectives and the same compute ops."""
    for name, value in SMALL.items():
        monkeypatch.setattr(schedule_overlap, name, value)
    # (grads_into_buckets needs the starts; tidy drops no-op copies of the bucket results they make)
    _, _, overlapped = _lowered(gpt_case, "dp", disabled={"grads_into_buckets", "tidy"})
    _, _, plain = _lowered(gpt_case, "dp", disabled={"schedule_overlap", "grads_into_buckets", "tidy"})
    key = lambda c: (c["kind"], c["phase"], c["reason"], c["source"])  # noqa: E731
    assert sorted(map(key, emitted_collectives(overlapped))) == sorted(map(key, emitted_collectives(plain)))
    ops = lambda gm: Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function"  # noqa: E731
                             and n.target not in (*STARTS, wait_buckets) and "fused" not in str(n.target)
                             and "getitem" not in str(n.target))
    assert ops(overlapped) == ops(plain)
    assert [name for name, _ in PIPELINE].index("schedule_overlap") == \
        [name for name, _ in PIPELINE].index("bucket_layer_gathers") + 1


def test_verify_lets_only_gradient_buckets_stay_in_flight(gpt_case):
    _, ctx, gm = _lowered(gpt_case, "zero3")
    start = next(n for n in gm.graph.nodes if n.target in STARTS)
    record = start.meta["autopar_fused"][0]
    start.meta["autopar_fused"][0] = dict(record, reason="(S0)->(R) activation")
    with pytest.raises(IRError, match="only schedule_overlap's gradient buckets"):
        verify(gm, "schedule_overlap", ctx)
    start.meta["autopar_fused"][0] = record
    # a plain collective may still not be left in flight across another one
    gather = next(n for n in gm.graph.nodes if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default)
    wait = next(iter(gather.users))
    later = next(n for n in list(gm.graph.nodes)[list(gm.graph.nodes).index(wait):] if n.target in STARTS)
    later.append(wait)  # the wait moved after a bucket's start
    with pytest.raises(IRError, match="in flight"):
        verify(gm, "schedule_overlap", ctx)


# ------------------------------------------------------------------ gloo ranks: one spawn for every case

def _async_check(rank, world, store_path) -> list[str]:
    """Rank 1 joins each collective only after rank 0's start returned: a start that blocked until the
    collective completed would never let rank 0 say so (rank 1 then reports it and joins anyway)."""
    import torch.distributed as dist
    store = dist.FileStore(store_path, world)
    group = dist.group.WORLD.group_name
    bad = []
    cases = [(start_all_reduce, ("sum", group)), (start_reduce_scatter, ("sum", world, group))]
    for k, (start, args) in enumerate(cases):
        tensors = [torch.ones(4 * world, 3) * (rank + 1)]
        if rank == 0:
            pending = start(tensors, *args)
            store.set(f"started{k}", "1")
        else:
            try:
                store.wait([f"started{k}"], timedelta(seconds=60))
            except Exception:  # noqa: BLE001 (a timeout: rank 0 is blocked inside its start)
                bad.append(f"{start.__name__} blocked until the peer joined")
            pending = start(tensors, *args)
        (got,) = wait_buckets(pending)
        if not torch.equal(got, torch.full_like(got, world * (world + 1) / 2)):
            bad.append(f"{start.__name__}: wrong sum")
    return bad


def _bucket_numerics(rank, world) -> list[str]:
    """Several buckets (mixed dtypes, a transposed tensor) in flight at once, waited out of order,
    equal one collective per tensor."""
    import torch.distributed as dist

    from autopar.passes import ops
    ops.BUCKET_BYTES = 64  # this process only: many flat buckets per start
    group = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(4, 6, generator=gen), torch.randn(6, 4, generator=gen).t(),
               torch.randn(8, generator=gen).double(), torch.randn(2, 3, 2, generator=gen)]
    first = start_all_reduce(tensors, "sum", group)
    second = start_reduce_scatter(tensors, "sum", world, group)
    bad = []
    for t, got in zip(tensors, wait_buckets(second)):
        want = torch.empty(t.shape[0] // world, *t.shape[1:], dtype=t.dtype)
        dist.reduce_scatter_tensor(want, t.contiguous())
        if not torch.allclose(got, want):
            bad.append(f"reduce_scatter {tuple(t.shape)}")
    for t, got in zip(tensors, wait_buckets(first)):
        want = t.clone()
        dist.all_reduce(want)
        if not torch.allclose(got, want):
            bad.append(f"all_reduce {tuple(t.shape)}")
    return bad


def _worker(rank, world, store_path, model, batches, steps, kws):
    for name, value in SMALL.items():  # training runs with many buckets in flight
        setattr(schedule_overlap, name, value)
    return {"async": _async_check(rank, world, store_path), "buckets": _bucket_numerics(rank, world),
            "train": train_many(rank, world, model, batches, steps, kws)}


def test_overlapped_buckets_run_asynchronously_and_train_like_one_process(tmp_path):
    case = models.tiny_gpt(batch=4, seq=16)
    batches = [((case.args[0].roll(s, 1), case.args[1].roll(s, 1)), {}) for s in range(3)]
    ref_losses, ref_state = train_reference(case.model, batches, 3)
    kws = [dict(strategy="dp"), dict(strategy="zero3")]
    results = run_distributed(_worker, 2, str(tmp_path / "store"), case.model, batches, 3, kws, timeout=600)
    assert [r["async"] for r in results] == [[], []]
    assert [r["buckets"] for r in results] == [[], []]
    assert_matches([r["train"] for r in results], ref_losses, ref_state, [str(kw) for kw in kws])
