"""The layout search's bound worker (autopar/pipeline/bound_worker.py): a forked process that works out the fast
search's LP bounds from the far end of its list. It may only move work to another CPU: the search with it prices
exactly what it prices alone, and a worker that fails leaves the search to itself."""
from __future__ import annotations

import os
import time
import warnings

import pytest

import autopar
from autopar._testing import models
from autopar.costmodel.hardware import get_hardware
from autopar.pipeline import bound_worker
from autopar.pipeline.bound_worker import BoundWorker
from autopar.pipeline.candidates import branch_and_bound, lp_requests
from autopar.pipeline.search import Profiler, candidate_jobs

pytestmark = pytest.mark.skipif(not bound_worker.usable(), reason="needs os.fork (Linux) and two CPUs")


def _wait_for(worker: BoundWorker, request, seconds: float = 120.0):
    """The worker's answer to `request`, waiting for it (the worker answers from the last request back)."""
    deadline = time.monotonic() + seconds
    while (found := worker.get(*request)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


class _Fake:
    """A Profiler's two methods the worker calls, and `seed`, which the search's side calls."""

    def __init__(self, fail: bool = False):
        self.fail, self.seeded = fail, []

    def lp_bound(self, m, dp, tp, strategy, ratio):
        if self.fail:
            raise RuntimeError("a worker that fails")
        return m + dp / 10 + tp / 100 + ratio

    def layers(self, m, dp, tp, budget, strategy, act_weight, step_weight):
        return (m, dp, tp, step_weight)

    def seed(self, m, dp, tp, strategy, ratio, layers):
        self.seeded.append((m, dp, tp, ratio, layers))


def test_the_worker_answers_every_request_with_its_profile_and_is_reaped():
    requests = [(2, 2, 2, 0.25), (4, 2, 2, 0.2), (4, 2, 4, 0.2), (8, 4, 2, 0.1), (2, 2, 2, 0.25)]   # one twice
    fake = _Fake()
    worker = BoundWorker(fake, requests)
    pid = worker.pid
    assert pid is not None
    assert _wait_for(worker, requests[0]) == 2 + 0.2 + 0.02 + 0.25   # the first request comes back last
    for m, dp, tp, ratio in requests:
        assert worker.get(m, dp, tp, ratio) == m + dp / 10 + tp / 100 + ratio   # exactly: floats round-trip
    assert worker.get(16, 2, 2, 0.05) is None   # not a request
    assert sorted(fake.seeded) == sorted((*r, (*r[:3], r[3])) for r in dict.fromkeys(requests))
    worker.close()
    assert worker.pid is None
    with pytest.raises(ChildProcessError):   # reaped: no zombie left
        os.waitpid(pid, os.WNOHANG)


def test_a_worker_that_fails_answers_nothing_and_the_search_goes_on():
    requests = [(2, 2, 2, 0.25), (4, 2, 2, 0.2), (4, 2, 4, 0.2), (8, 4, 2, 0.1)]
    with BoundWorker(_Fake(fail=True), requests) as worker:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:   # the worker exits at its first request; its pipe then closes
            if os.waitpid(worker.pid, os.WNOHANG)[0]:
                worker.pid = None   # reaped here (close would wait for it again)
                break
            time.sleep(0.05)
        assert all(worker.get(*r) is None for r in requests)
    os.close(worker.fd)


def test_few_requests_or_the_setting_off_fork_no_worker(monkeypatch):
    requests = [(2, 2, 2, 0.25), (4, 2, 2, 0.2), (4, 2, 4, 0.2), (8, 4, 2, 0.1)]
    assert BoundWorker(_Fake(), requests[:bound_worker.MIN_REQUESTS - 1]).pid is None
    monkeypatch.setenv("AUTOPAR_PLAN_WORKER", "0")
    assert not bound_worker.usable() and BoundWorker(_Fake(), requests).pid is None


def test_the_fast_search_with_its_worker_prices_what_it_prices_alone(monkeypatch):
    """A GPT on 8 devices of 4 per node (2-D sub-meshes dp 2 x tp 2 and 2 x 4: LP bounds): the fast branch and bound
    with a worker that has answered every request (its bounds and profiles used, no capture or solve of its own for
    them) returns the same candidates, in the same order, as without one."""
    monkeypatch.setattr(bound_worker, "MIN_REQUESTS", 1)
    case = models.meta_gpt(n_layer=4, n_embd=128, n_head=4, batch=16, seq=128)
    mesh = autopar.Mesh((8,), hardware=get_hardware("h100"), devices_per_node=4)

    def run(with_worker: bool):
        prof = Profiler(case.model, case.example_inputs, mesh.hardware, 4, mixed_precision="bf16")
        jobs = [job for job in candidate_jobs(prof, mesh, 16, ("1f1b", "interleaved_1f1b", "zero_bubble"),
                                              keep_dominated=False) if job[0] > 1 or job[3] > 1]
        requests = lp_requests(prof, jobs, 8e9)
        worker = BoundWorker(prof, requests if with_worker else [])
        if with_worker:
            assert worker.pid is not None and len(set(requests)) >= 2
            assert _wait_for(worker, requests[0]) is not None   # every answer in before the search starts
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = branch_and_bound(prof, jobs, 8e9, None, keep=1, fast=True, worker=worker)
        used = len(worker.used)
        worker.close()
        return found, used, prof

    alone, _, _ = run(False)
    helped, used, prof = run(True)
    assert used >= 1 and helped == alone
    assert prof.seeded or prof.solutions   # the worker's profiles were seeded (or solved again where priced on)
