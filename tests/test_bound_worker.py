"""The layout search's bound worker (autopar/pipeline/bound_worker.py): a forked process that works out the fast
search's LP bounds ahead of it, in the order it asks for them. It may only move work to another CPU: the search
with it prices exactly what it prices alone, and a worker that fails leaves the search to itself."""
from __future__ import annotations

import os
import time
import warnings

import pytest

import autopar
from autopar._testing import models
from autopar.costmodel.hardware import get_hardware
from autopar.pipeline import bound_worker, search
from autopar.pipeline.bound_worker import BoundWorker, Request
from autopar.pipeline.candidates import branch_and_bound, lp_requests
from autopar.pipeline.search import Profiler, candidate_jobs

pytestmark = pytest.mark.skipif(not bound_worker.usable(), reason="needs os.fork (Linux) and two CPUs")


def _wait_until(worker: BoundWorker, done, seconds: float = 120.0) -> None:
    """Polls the worker's messages (asking for nothing) until `done()`."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        worker.poll()
        time.sleep(0.02)
    assert done(), "the worker did not get there in time"


class _Fake:
    """A Profiler's two methods the worker calls, and `seed`, which the search's side calls. `delay`: seconds each
    LP bound takes."""

    def __init__(self, fail: bool = False, delay: float = 0.0):
        self.fail, self.delay, self.seeded = fail, delay, []

    def lp_bound(self, m, dp, tp, strategy, ratio):
        if self.fail:
            raise RuntimeError("a worker that fails")
        time.sleep(self.delay)
        return m + dp / 10 + tp / 100 + ratio

    def layers(self, m, dp, tp, budget, strategy, act_weight, step_weight):
        return (m, dp, tp, step_weight)

    def seed(self, m, dp, tp, strategy, ratio, layers):
        self.seeded.append((m, dp, tp, ratio, layers))


def test_the_worker_answers_every_request_in_order_with_its_profile_and_is_reaped():
    requests = [(2, 2, 2, 0.25), (4, 2, 2, 0.2), (4, 2, 4, 0.2), (8, 4, 2, 0.1), (2, 2, 2, 0.25)]   # one twice
    fake = _Fake()
    worker = BoundWorker(fake, requests)
    pid = worker.pid
    assert pid is not None and fake.helper() is worker   # the Profiler asks it for budget-free profiles
    assert len(worker.jobs) == 4
    _wait_until(worker, lambda: len(worker.found) == len(worker.jobs))
    for m, dp, tp, ratio in requests:
        assert worker.get(m, dp, tp, ratio) == m + dp / 10 + tp / 100 + ratio   # exactly: floats round-trip
    assert worker.get(16, 2, 2, 0.05) is None   # not a request
    assert not worker.solved_here
    assert fake.seeded == [(*r, (*r[:3], r[3])) for r in requests[:4]]   # in the search's order
    assert worker.profile(4, 2, 4, 0.2) and not worker.profile(4, 2, 4, 1.0)
    worker.close()
    assert worker.pid is None and fake.helper is None
    with pytest.raises(ChildProcessError):   # reaped: no zombie left
        os.waitpid(pid, os.WNOHANG)


def test_the_search_waits_for_the_bound_the_worker_is_on_and_it_skips_past_those_it_has_not_started():
    requests = [(m, 2, 2, 0.5) for m in (2, 4, 8, 16, 32, 64)]
    with BoundWorker(_Fake(delay=1.0), requests) as worker:
        _wait_until(worker, lambda: worker.started == 0)
        assert worker.get(*requests[0]) == 2.72 and not worker.solved_here   # the one it is on: waited for
        _wait_until(worker, lambda: worker.started == 1)
        assert worker.get(*requests[3]) is None   # not started: the search solves it, the worker moves past it
        assert worker.solved_here == {3}
        _wait_until(worker, lambda: worker.ended)   # every request done or skipped
        assert sorted(worker.found) == [0, 1, 4, 5]   # 2 and 3 skipped
        assert worker.get(*requests[5]) == 64.72


def test_the_worker_leaves_the_bounds_the_searchs_cutoff_rules_out():
    """A bound is asked for only while one of its candidates' first bounds is within the search's cutoff
    (`candidates._walk`): a request (4, 2, 2) whose only candidate's first bound is 5, under a cutoff of 3, is not
    worked out; (8, 2, 2) is, for its second candidate."""
    requests = [Request(2, 2, 2, 0.5, bound=1.0), Request(4, 2, 2, 0.5, bound=5.0), Request(8, 2, 2, 0.5, bound=9.0),
                Request(8, 2, 2, 0.5, bound=2.0), Request(16, 2, 2, 0.5, bound=3.0)]
    with BoundWorker(_Fake(delay=1.0), requests) as worker:
        _wait_until(worker, lambda: worker.started == 0)
        worker.cutoff(3.0)
        _wait_until(worker, lambda: worker.ended)
        assert sorted(worker.found) == [0, 2, 3]   # jobs: (2, ...), (4, ...), (8, ...), (16, ...)


def test_a_worker_its_search_drops_is_killed_and_reaped():
    """A search left by an exception drops its worker: the Profiler holds it weakly, so it closes at once."""
    fake = _Fake(delay=60.0)
    worker = BoundWorker(fake, [(2, 2, 2, 0.25), (4, 2, 2, 0.2), (4, 2, 4, 0.2), (8, 4, 2, 0.1)])
    pid = worker.pid
    assert pid is not None
    del worker
    assert fake.helper is None or fake.helper() is None
    with pytest.raises(ChildProcessError):   # killed and reaped
        os.waitpid(pid, os.WNOHANG)


def test_a_worker_that_fails_answers_nothing_and_the_search_goes_on():
    requests = [(2, 2, 2, 0.25), (4, 2, 2, 0.2), (4, 2, 4, 0.2), (8, 4, 2, 0.1)]
    with BoundWorker(_Fake(fail=True), requests) as worker:
        _wait_until(worker, lambda: worker.ended)   # the worker exits at its first job; its pipe then closes
        assert all(worker.get(*r) is None for r in requests)   # no wait on a job it started and never finished
        assert not worker.profile(2, 2, 2, 0.25)


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
        if with_worker == "ahead":   # every answer in before the search starts
            _wait_until(worker, lambda: len(worker.found) == len(worker.jobs))
        solved.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = branch_and_bound(prof, jobs, 8e9, None, keep=1, fast=True, worker=worker)
        used = len(worker.used)
        worker.close()
        return found, used, len(solved)

    solved = []
    solve = search.spmd.solve_problem
    monkeypatch.setattr(search.spmd, "solve_problem", lambda *a, **k: solved.append(1) or solve(*a, **k))
    alone, _, solves = run(False)
    ahead, used, fewer = run("ahead")
    assert ahead == alone and used >= 2 and fewer <= solves - used   # each answer taken is a solve saved here
    racing, _, _ = run("racing")   # the search starting at once, beside the worker
    assert racing == alone
