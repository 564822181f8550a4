"""The multi-process harness (autopar/_testing/dist_utils.py) fails a test fast and says why: a rank that
raises gives its traceback; a rank that dies in native code (a segfault in a collective library, say) is named
with its signal within seconds, while the rank left waiting on it in a collective is killed, instead of the
test waiting out its timeout (CI once spent 40 minutes so on a rank's SIGSEGV)."""
from __future__ import annotations

import os
import signal

import pytest

from autopar._testing.dist_utils import run_distributed


def _rank0_crashes(rank, world, rank1_waits):
    import torch.distributed as dist
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSEGV)
    if rank1_waits:
        dist.barrier()   # rank 1 waits here for a rank that is gone: gloo raises, rank 1 reports the error
    return rank          # or rank 1 reports its result, as a rank that catches its jobs' errors does


def _identity(rank, world):
    return rank


def _rank1_raises(rank, world):
    if rank == 1:
        raise ValueError("rank 1's mistake")
    return rank


@pytest.mark.parametrize("rank1_waits", [False, True], ids=["rank 1 reports", "rank 1 in a collective"])
def test_a_rank_killed_by_a_signal_fails_the_run_with_its_signal_not_a_timeout(rank1_waits):
    with pytest.raises(AssertionError) as info:
        run_distributed(_rank0_crashes, 2, rank1_waits, timeout=600)
    assert "rank 0 died (SIGSEGV)" in str(info.value), info.value
    assert "timed out" not in str(info.value)


def test_a_rank_that_raises_fails_the_run_with_its_traceback():
    with pytest.raises(AssertionError) as info:
        run_distributed(_rank1_raises, 2, timeout=600)
    assert "rank 1:" in str(info.value) and "ValueError: rank 1's mistake" in str(info.value), info.value


def test_every_rank_that_reports_returns_its_result_in_rank_order():
    assert run_distributed(_identity, 2, timeout=600) == [0, 1]
