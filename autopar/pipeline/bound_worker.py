"""A second process that works out the layout search's LP bounds ahead of it.

The fast search bounds each 2-D (micro-batch count, dp, tp) group by the proven bound of the group's budget-free
tiled solve (`search.Profiler.lp_bound`: a three-layer capture, a build and an LP), and a group it prices starts
from that solve's unit profile (bf16 Llama-3-70B x 64 H100s: 19 LP bounds, ~14 s of a ~37 CPU s call). A worker
forked before the search (by the default call once its 1-D SPMD plan says the search runs, else by
`candidates.branch_and_bound`) computes the bounds in the order the search will ask for them and sends back each
bound with the budget-free unit profile behind it; the search takes the answers that have come back (the profiles
seeded into its Profiler: `Profiler.seed`, which `Profiler.layers` answers from).

The two processes coordinate through a second pipe. The worker says which bound it starts; when the search asks
for the one the worker is on, it waits for it (at most WAIT_FLOOR seconds or WAIT_FACTOR times the worker's
slowest bound, whichever is longer, then it solves it itself); when it asks for one the worker has not started, it
solves that one itself and tells the worker, which then skips every bound up to it (the search has moved past
them). The search also tells the worker each time its cutoff falls, and the worker skips the bounds the search
will no longer ask for (every candidate behind them has a first bound above the cutoff: `candidates._walk`). So
the worker, forked seconds before the search needs its first bound, stays ahead of it, and neither process solves
what the other has. (Before, the worker worked from the last request back: the search solved the first bounds
itself, 2 of 19 on the 70B.) A bound and its profile are deterministic functions of the model and the request (the
same capture, build and LP in either process), so the search prunes, prices and returns exactly what it would
alone: the worker only moves work to another CPU. What a price needs beyond that profile (the budget-free plan of
least S + P, memory rows, recompute, the Solution a plan is built from) the search solves itself: a worker that
also solved the groups' S + P plans (needed by 5 of the 70B's 19 groups, which only the split of the first
profile tells) finished the bounds late, and the search waited 4.5 s for them.

Only where it can help and cannot harm: Linux (`os.fork`), at least two CPUs this process may run on, neither
CUDA nor torch.distributed initialised in this process (a job's ranks already have the machine's CPUs), enough
requests (MIN_REQUESTS), and AUTOPAR_PLAN_WORKER not "0". The worker writes nothing but its answers (its stdout
and stderr go to /dev/null), leaves by `os._exit` (no cleanup of the parent's state runs twice), and is killed
and reaped when the search ends; a worker that fails, hangs or is killed only answers fewer requests.
"""
from __future__ import annotations

import math
import os
import pickle
import select
import signal
import struct
import sys
import time
import warnings
import weakref
from typing import TYPE_CHECKING, NamedTuple

from autopar import config
from autopar.debug import log

if TYPE_CHECKING:
    from autopar.pipeline.search import Profiler

MIN_REQUESTS = 4   # fewer LP bounds than this: not worth a process
PIPE_BYTES = 1 << 20   # the answer pipe's capacity asked for: every answer (a bound and ~82 units' profile, ~10 kB)
WAIT_FLOOR = 10.0   # seconds the search waits at least for the bound the worker is on ...
WAIT_FACTOR = 4.0   # ... or this times the worker's slowest bound so far, whichever is longer
_TELL = struct.Struct("<qd")   # the search to the worker: (a job it solves itself or -1, its cutoff)
_MISSING = object()


class Request(NamedTuple):
    """An LP bound the search may ask for (`Profiler.lp_bound`'s m, dp, tp, ratio), for one of its candidates: it
    asks while the candidate's first lower bound `bound` is within its cutoff (`candidates._walk`)."""
    m: int
    dp: int
    tp: int
    ratio: float
    bound: float = 0.0


def usable() -> bool:
    """Whether a worker may be forked here (module docstring)."""
    if not config.plan_worker_enabled() or sys.platform != "linux" or not hasattr(os, "fork"):
        return False
    if len(os.sched_getaffinity(0)) < 2:
        return False
    torch = sys.modules.get("torch")
    if torch is None:
        return True
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    return not torch.cuda.is_initialized() and not distributed


class BoundWorker:
    """`lp_bound(m, dp, tp, strategy, ratio)` for each of `requests` (`Request`s or (m, dp, tp, ratio) tuples, in
    the order the search asks), each with the unit profile of its solve, computed by a forked process in that order:
    its jobs, one per distinct request. `get` answers a request's bound (its profile seeded into the Profiler:
    `Profiler.seed`), `profile` seeds its profile; both wait for the job the worker is on and otherwise leave the
    job to the search (module docstring); `cutoff` tells the worker the search's cutoff. While it runs the worker is
    the Profiler's `helper`, by a weak reference (`Profiler.layers` asks it for budget-free profiles). Use as a
    context manager (or `close`): closing kills the worker."""

    def __init__(self, prof: Profiler, requests: list[tuple], strategy=None):
        self.prof, self.strategy = prof, strategy
        self.requests = [Request(*r) for r in requests]   # (m, dp, tp, ratio) alone: asked at any cutoff
        self.job_of: dict[tuple, int] = {}   # (m, dp, tp, ratio) -> its job, numbered in the order asked
        for r in self.requests:
            self.job_of.setdefault(r[:4], len(self.job_of))
        self.jobs = list(self.job_of)
        self.first_bound = [min(r.bound for r in self.requests if r[:4] == key) for key in self.jobs]
        self.found: dict[int, tuple] = {}   # job -> (bound, profile or None)
        self.started, self.slowest, self.ended = -1, 0.0, False   # the job the worker is on; its slowest; EOF
        self.used: set[int] = set()   # jobs whose answer the search took
        self.solved_here: set[int] = set()   # jobs the search asked for before the worker had started them
        self.told_cutoff = math.inf
        self.pid, self.fd, self.tells, self._buffer = None, None, None, b""
        if len(self.jobs) < MIN_REQUESTS or not usable():
            return
        import fcntl  # POSIX only, like fork

        read, write = os.pipe()
        tell_read, tell_write = os.pipe()
        try:   # room for every answer, so the worker need not wait for the search to read (Linux: up to 1 MB)
            fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except (OSError, AttributeError):
            pass
        with warnings.catch_warnings():   # Python 3.12+ warns when a process with threads forks: the worker
            warnings.simplefilter("ignore", DeprecationWarning)   # only computes, and a hung one is killed
            pid = os.fork()
        if pid == 0:   # the worker
            try:
                os.close(read)
                os.close(tell_write)
                quiet = os.open(os.devnull, os.O_WRONLY)
                os.dup2(quiet, 1)
                os.dup2(quiet, 2)
                os.set_blocking(tell_read, False)
                prof.helper = None   # an earlier search's worker is not this process's to ask
                self._serve(write, tell_read)
            finally:
                os._exit(0)
        os.close(write)
        os.close(tell_read)
        os.set_blocking(read, False)
        os.set_blocking(tell_write, False)
        self.pid, self.fd, self.tells = pid, read, tell_write
        prof.helper = weakref.ref(self)   # weak: a search left by an exception drops the worker, which closes

    # the worker's side

    def _serve(self, out: int, tells: int) -> None:
        """Every job in order, skipping those the search has asked for before this process started them and those
        its cutoff says it will not ask for."""
        past, cutoff, pending = -1, math.inf, b""
        for j, (m, dp, tp, ratio) in enumerate(self.jobs):
            try:   # what the search has told: (a job it solves itself or -1, its cutoff)
                while chunk := os.read(tells, 1 << 12):
                    pending += chunk
            except BlockingIOError:
                pass
            while len(pending) >= _TELL.size:
                (solved, told), pending = _TELL.unpack(pending[:_TELL.size]), pending[_TELL.size:]
                past, cutoff = max(past, solved), min(cutoff, told)
            if j <= past or self.first_bound[j] > cutoff:
                continue
            _send(out, ("start", j))
            t = time.perf_counter()
            bound = self.prof.lp_bound(m, dp, tp, self.strategy, ratio)
            layers = self.prof.layers(m, dp, tp, None, self.strategy, 1.0, ratio) if math.isfinite(bound) else None
            _send(out, ("done", j, time.perf_counter() - t, bound, layers))

    # the search's side

    def __enter__(self) -> BoundWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:   # a search left by an exception: no worker outlives it
        self.close()

    def get(self, m: int, dp: int, tp: int, ratio: float) -> float | None:
        """The worker's bound for this request (its profile then seeded into the Profiler); None where the search
        solves it itself (not a request, or the worker has not started it)."""
        job = self.job_of.get((m, dp, tp, ratio))
        answer = _MISSING if job is None else self._answer(job)
        return None if answer is _MISSING else answer[0]

    def profile(self, m: int, dp: int, tp: int, step_weight: float) -> bool:
        """Whether the worker's budget-free profile of (m, dp, tp) for this step weight is seeded into the Profiler
        (`Profiler.layers` asks before it solves one)."""
        job = self.job_of.get((m, dp, tp, step_weight))
        return job is not None and self._answer(job) is not _MISSING

    def cutoff(self, value: float) -> None:
        """The search's cutoff has fallen to `value`: the worker leaves what the search will no longer ask for."""
        if value < self.told_cutoff and self.tells is not None:
            self.told_cutoff = value
            self._tell(-1, value)

    def poll(self) -> None:
        """Takes in what the worker has sent so far, without asking for anything."""
        if self.fd is not None:
            self._read(0.0)

    def _tell(self, job: int, cutoff: float) -> None:
        if self.ended:   # nobody reads any more (and a process that does not ignore SIGPIPE would die writing)
            return
        try:
            os.write(self.tells, _TELL.pack(job, cutoff))
        except OSError:   # a worker gone (broken pipe) or far behind (full pipe): nothing to tell
            pass

    def _answer(self, job: int):
        """Job `job`'s answer, waiting while the worker is on it; else tells the worker the search solves it
        (_MISSING)."""
        if self.fd is not None and job not in self.found:
            self._read(0.0)
            deadline = time.monotonic() + max(WAIT_FLOOR, WAIT_FACTOR * self.slowest)
            while job not in self.found and self.started == job and not self.ended:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._read(left)
            if job not in self.found and job not in self.solved_here:
                self.solved_here.add(job)
                self._tell(job, self.told_cutoff)   # the worker skips it and every job before it
        found = self.found.get(job, _MISSING)
        if found is not _MISSING:
            self.used.add(job)
        return found

    def _read(self, timeout: float) -> None:
        """Reads the worker's messages, waiting up to `timeout` seconds for the first."""
        if timeout > 0 and not self.ended:
            select.select([self.fd], [], [], timeout)
        try:
            while chunk := os.read(self.fd, 1 << 20):
                self._buffer += chunk
            self.ended = True   # end of file: the worker has exited
        except BlockingIOError:
            pass
        while len(self._buffer) >= 8:
            size = int.from_bytes(self._buffer[:8], "little")
            if len(self._buffer) < 8 + size:
                break
            message = pickle.loads(self._buffer[8:8 + size])
            self._buffer = self._buffer[8 + size:]
            if message[0] == "start":
                self.started = message[1]
                continue
            _, job, seconds, bound, layers = message
            self.found[job], self.slowest = (bound, layers), max(self.slowest, seconds)
            if layers is not None:
                m, dp, tp, ratio = self.jobs[job]
                self.prof.seed(m, dp, tp, self.strategy, ratio, layers)

    def close(self) -> None:
        if self.pid is not None:
            log(2, f"bound worker: {len(self.used)} of {len(self.jobs)} LP bounds taken from it ({len(self.found)} "
                   f"came back; {len(self.solved_here)} asked for before it started them)")
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(self.pid, 0)
            os.close(self.fd)
            os.close(self.tells)
            self.pid = self.fd = self.tells = None
            helper = getattr(self.prof, "helper", None)
            if helper is not None and helper() is self:
                self.prof.helper = None


def _send(fd: int, message: tuple) -> None:
    data = pickle.dumps(message)
    os.write(fd, len(data).to_bytes(8, "little") + data)
