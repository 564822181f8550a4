"""A second process that works out the layout search's LP bounds ahead of it, from the far end of its list.

The fast search bounds each 2-D (micro-batch count, dp, tp) group by the proven bound of the group's budget-free
tiled solve (`search.Profiler.lp_bound`: a three-layer capture, a build and an LP). Most groups the bound prunes
come last in the search's order, after the winner is priced, and so do many whose price is a quick rejection of
that very solve's unit profile (bf16 Llama-3-70B x 64 H100s: 19 LP bounds, ~14 s of a ~37 CPU s call). A worker
forked before the search (by the default call once its 1-D SPMD plan says the search runs, else by
`candidates.branch_and_bound`) computes the same bounds from the last request backwards while the search works
forwards, and sends back each bound with the budget-free unit profile behind it; the search takes those that
have come back (the profile seeded into its Profiler: `Profiler.seed`) and computes the others itself. A bound
and its profile are deterministic functions of the model and the request (the same capture, build and LP in
either process), so the search prunes, prices and returns exactly what it would alone: the worker only moves
work to another CPU. What a price needs beyond the budget-free profile (memory rows, recompute, the Solution a
plan is built from) the search solves itself.

Only where it can help and cannot harm: Linux (`os.fork`), at least two CPUs this process may run on, neither
CUDA nor torch.distributed initialised in this process (a job's ranks already have the machine's CPUs), enough
requests (MIN_REQUESTS), and AUTOPAR_PLAN_WORKER not "0". The worker writes nothing but its answers (its stdout
and stderr go to /dev/null), leaves by `os._exit` (no cleanup of the parent's state runs twice), and is killed
and reaped when the search ends; a worker that fails or hangs only answers fewer requests.
"""
from __future__ import annotations

import math
import os
import pickle
import signal
import sys
import warnings
from typing import TYPE_CHECKING

from autopar import config
from autopar.debug import log

if TYPE_CHECKING:
    from autopar.pipeline.search import Profiler

MIN_REQUESTS = 4   # fewer LP bounds than this: not worth a process
PIPE_BYTES = 1 << 20   # the pipe's capacity asked for: every answer (a bound and ~82 units' profile, ~10 kB)


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
    """`lp_bound(m, dp, tp, strategy, ratio)` for each of `requests` (in the order the search asks), computed by
    a forked process from the last request backwards, with the unit profile of the solve behind it (`get` seeds
    it into the search's Profiler: `Profiler.seed`). Use as a context manager (or `close`): `get` answers a
    request the worker has finished (None otherwise); closing kills the worker."""

    def __init__(self, prof: Profiler, requests: list[tuple[int, int, int, float]], strategy=None):
        self.prof, self.strategy, self.requests = prof, strategy, requests
        self.index = {key: i for i, key in reversed(list(enumerate(requests)))}
        self.found: dict[int, float] = {}
        self.used: set[int] = set()   # requests `get` answered
        self.pid, self.fd, self._buffer = None, None, b""
        if len(self.index) < MIN_REQUESTS or not usable():
            return
        import fcntl  # POSIX only, like fork

        read, write = os.pipe()
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
                quiet = os.open(os.devnull, os.O_WRONLY)
                os.dup2(quiet, 1)
                os.dup2(quiet, 2)
                for i in sorted(set(self.index.values()), reverse=True):
                    m, dp, tp, ratio = requests[i]
                    bound = prof.lp_bound(m, dp, tp, strategy, ratio)
                    layers = prof.layers(m, dp, tp, None, strategy, 1.0, ratio) if math.isfinite(bound) else None
                    message = pickle.dumps((i, bound, layers))
                    os.write(write, len(message).to_bytes(8, "little") + message)
            finally:
                os._exit(0)
        os.close(write)
        os.set_blocking(read, False)
        self.pid, self.fd = pid, read

    def __enter__(self) -> BoundWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:   # a search left by an exception: no worker outlives it
        self.close()

    def get(self, m: int, dp: int, tp: int, ratio: float) -> float | None:
        """The worker's bound for this request, if it has come back (its profile then seeded into the Profiler)."""
        i = self.index.get((m, dp, tp, ratio))
        if i is None or self.fd is None:
            return None
        if i not in self.found:
            self._read()
        if i in self.found:
            self.used.add(i)
        return self.found.get(i)

    def _read(self) -> None:
        try:
            while chunk := os.read(self.fd, 1 << 20):
                self._buffer += chunk
        except BlockingIOError:
            pass
        while len(self._buffer) >= 8:
            size = int.from_bytes(self._buffer[:8], "little")
            if len(self._buffer) < 8 + size:
                break
            i, bound, layers = pickle.loads(self._buffer[8:8 + size])
            self._buffer = self._buffer[8 + size:]
            self.found[i] = bound
            if layers is not None:
                m, dp, tp, ratio = self.requests[i]
                self.prof.seed(m, dp, tp, self.strategy, ratio, layers)

    def close(self) -> None:
        if self.pid is not None:
            log(2, f"bound worker: {len(self.used)} of {len(self.index)} LP bounds taken from it "
                   f"({len(self.found)} came back)")
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(self.pid, 0)
            os.close(self.fd)
            self.pid = self.fd = None
