"""Per-rank data: a rank may pass only its own data-parallel slice of the batch (autopar/runtime/batch.py).

Single process: which mesh axes split the batch, a rank's slice number, the global-or-slice decision
and its errors, on hand-made specs. Worlds 2 and 4 (dp, zero3; 2-D dp x tp, pp2 x dp2): training fed
with each rank's slice equals training fed with the global batch on every rank, bit for bit; inputs the
plan lays out unlike the slices are all-gathered and cut as planned.
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar._testing import models
from autopar._testing.dist_cases import run_each
from autopar._testing.dist_utils import run_distributed
from autopar._testing.dp_cases import feed_global_and_local, gather_fallback
from autopar.errors import InputError
from autopar.runtime.batch import BatchLayout

S0, S1, R = Shard(0), Shard(1), Replicate()
STEPS = 3


def _layout(specs, coords, sizes, shapes=None, microbatches=1) -> BatchLayout:
    shapes = shapes or [(8, 4)] * len(specs)
    return BatchLayout([f"in{i}" for i in range(len(specs))], shapes, specs, coords, sizes, microbatches=microbatches)


def test_batch_axes_rank_and_size():
    # dp x tp, tokens split on dp only: the two tp ranks of a dp row read one slice
    assert [(b.axes, b.rank, b.size) for b in (_layout([(S0, R), (S0, S1)], c, (2, 2)) for c in
                                                 ((0, 0), (0, 1), (1, 0), (1, 1)))] == [((0,), 0, 2), ((0,), 0, 2),
                                                                                        ((0,), 1, 2), ((0,), 1, 2)]
    # the batch split on both axes: four slices, the first axis outermost
    assert [_layout([(S0, S0)], c, (2, 2)).rank for c in ((0, 0), (0, 1), (1, 0), (1, 1))] == [0, 1, 2, 3]
    # nothing splits the batch (tp): one slice, every rank reads all of it
    layout = _layout([(R, S1)], (1, 1), (2, 2))
    assert (layout.axes, layout.rank, layout.size, layout.local_batch) == ((), 0, 1, None)
    # an input planned whole whose ops read it split on axis 0 (auto plans: cutting it after is free)
    layout = BatchLayout(["idx", "targets"], [(8, 4), (8, 4)], [(R, R), (R, R)], (1, 0), (2, 2),
                         reads=[[(S0, R), (S0, S1)], [(R, R)]])
    assert (layout.axes, layout.rank, layout.size) == ((0,), 1, 2)
    # the most split input decides; a position-id input of another first dimension is not batched
    layout = _layout([(R,), (S0,), (R,)], (1,), (2,), shapes=[(8, 4), (8, 4), (1, 4)])
    assert (layout.axes, layout.batch, layout.local_batch, layout.batched) == ((0,), 8, 4, [True, True, False])


def test_slices_give_the_global_batch_blocks():
    gen = torch.Generator().manual_seed(0)
    x, y, pos = torch.randn(8, 4, generator=gen), torch.randn(8, 4, generator=gen), torch.arange(4).view(1, 4)
    for coords in ((0, 0), (0, 1), (1, 0), (1, 1)):
        layout = _layout([(S0, S1), (S0, R), (R, R)], coords, (2, 2), shapes=[(8, 4), (8, 4), (1, 4)])
        r = layout.rank
        whole = layout.local_inputs((x, y, pos), "cpu")
        sliced = layout.local_inputs((x.chunk(2)[r], y.chunk(2)[r], pos), "cpu")
        for a, b in zip(whole, sliced):
            assert torch.equal(a, b), coords
    # a pipeline of 2 micro-batches: the slice is the rank's part of each micro-batch, in order
    for rank in (0, 1):
        layout = _layout([(S0,)], (rank,), (2,), microbatches=2)
        part = torch.cat([c.chunk(2)[rank] for c in x.chunk(2)])
        assert torch.equal(layout.local_inputs((x,), "cpu")[0], layout.local_inputs((part,), "cpu")[0])


def test_wrong_or_mixed_sizes_are_refused_saying_what_was_expected():
    layout = _layout([(S0,), (S0,)], (1,), (2,))
    x = torch.zeros(8, 4)
    with pytest.raises(InputError, match=r"'in0' has shape \(3, 4\); the plan expects the global batch \(8, 4\) "
                                         r".*or this rank's data-parallel slice \(4, 4\) \(data_parallel_rank 1 of "
                                         r"data_parallel_size 2\)"):
        layout.local_inputs((x[:3], x), "cpu")
    with pytest.raises(InputError, match=r"'in0' hold the global batch \(8 rows\) but 'in1' hold this rank's "
                                         r"data-parallel slice \(4 rows\)"):
        layout.local_inputs((x, x[:4]), "cpu")
    with pytest.raises(InputError, match=r"expected 2 inputs \(in0, in1\), got 1"):
        layout.local_inputs((x,), "cpu")
    with pytest.raises(InputError, match=r"'in1' has shape NoneType"):
        layout.local_inputs((x, None), "cpu")


# ---------------------------------------------------------------- worlds 2 and 4

def _check_feeding(results: list, label: str, size: int, world: int) -> None:
    """Every rank: the slices' run equals the global run exactly; the split is `size` slices."""
    for rank, res in enumerate(results):
        assert not isinstance(res, str), f"{label} rank {rank}: {res}"
        assert res["local"]["losses"] == res["global"]["losses"], f"{label} rank {rank}"
        for key, want in res["global"]["state"].items():
            assert torch.equal(res["local"]["state"][key], want), f"{label} rank {rank} {key}"
        dp_rank, dp_size, needs = res["split"]
        assert dp_size == size, (label, res["split"])
        assert res["sampler"] == list(range(dp_rank, 16, dp_size)), label
        if needs:
            (gx, *_), (lx, *_) = res["rows"]["global"], res["rows"]["local"]
            assert lx[0] * size == gx[0], (label, res["rows"])
            wrong, mixed = res["errors"]
            assert "the plan expects the global batch" in wrong, wrong
            assert "hold this rank's data-parallel slice" in mixed, mixed
    ranks = {res["split"][0] for res in results if res["split"][2]}
    assert ranks == set(range(size)), (label, [res["split"] for res in results])


def _check_gather(results: list, world: int) -> None:
    for rank, res in enumerate(results):
        assert not isinstance(res, str), f"rank {rank}: {res}"
        assert res["split"] == (rank, world)
        for a, b in zip(res["whole"], res["sliced"]):
            assert torch.equal(a, b), rank


def test_rank_slices_equal_the_global_batch_at_world_2():
    """dp, zero3 and auto at world 2 (GPT, batch 8; the targets are planned whole, auto plans the tokens
    whole too: those are all-gathered from the slices), and the all-gather fallback on hand-made specs."""
    case = models.tiny_gpt(batch=8, seq=16)
    batches = models.zoo_batches(case, STEPS)
    kws = [dict(strategy="dp"), dict(strategy="zero3"), dict(strategy="auto")]
    jobs = [(feed_global_and_local, case.model, batches, STEPS, kw) for kw in kws]
    jobs += [(gather_fallback, 1), (gather_fallback, 2)]
    results = run_distributed(run_each, 2, jobs, timeout=900)
    for j, kw in enumerate(kws):
        _check_feeding([r[j] for r in results], f"world=2 {kw}", 2, 2)
    for j in (3, 4):
        _check_gather([r[j] for r in results], 2)


def test_rank_slices_equal_the_global_batch_at_world_4():
    """2-D dp x tp (the tp pair of a dp row reads one slice) and pp2 x dp2 (only the first stage's ranks
    feed; the others pass nothing) at world 4."""
    case = models.tiny_gpt(batch=8, seq=16)
    batches = models.zoo_batches(case, STEPS)
    kws = [dict(mesh=autopar.Mesh((2, 2), axis_names=("dp", "tp")), strategy={"dp": "dp", "tp": "tp"}),
           dict(mesh=autopar.Mesh((2, 2), axis_names=("pp", "dp")), strategy="dp", schedule="gpipe",
                num_microbatches=2)]
    jobs = [(feed_global_and_local, case.model, batches, STEPS, kw) for kw in kws] + [(gather_fallback, 2)]
    results = run_distributed(run_each, 4, jobs, timeout=1200)
    two_d = [r[0] for r in results]
    _check_feeding(two_d, "world=4 dp x tp", 2, 4)
    assert [res["split"][0] for res in two_d] == [0, 0, 1, 1], "ranks differing only on tp share a slice"
    pipe = [r[1] for r in results]
    _check_feeding(pipe, "world=4 pp2 x dp2", 2, 4)
    assert [res["split"][2] for res in pipe] == [True, True, False, False], "only stage 0 reads inputs"
    _check_gather([r[2] for r in results], 4)
