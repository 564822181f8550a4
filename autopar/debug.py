"""Levelled debug output from one environment variable, AUTOPAR_DEBUG (printed to stderr; `autopar.config`).

    1  timings of each planning phase and each rewrite pass
    2  + the numbered pass list, cost-graph sizes and solver statistics
    3  + every collective the lowering emits
    4  + each graph after each pass (AUTOPAR_DUMP_DIR writes them to files instead)
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager

from autopar.config import debug_level as level


def progress(msg: str, *, end: str = "\n") -> None:
    """A progress line on an interactive terminal (stderr); silent in pipes, CI and tests."""
    if sys.stderr.isatty() and level() == 0:
        print(f"\rautopar: {msg}", end=end, file=sys.stderr, flush=True)


def log(at: int, msg: str) -> None:
    if level() >= at:
        print(f"[autopar] {msg}", file=sys.stderr, flush=True)


class PhaseTimer(dict):
    """Seconds per named phase (`with timer("solve"): ...`), logged and shown as progress lines."""

    @contextmanager
    def __call__(self, name):
        start = time.perf_counter()
        log(2, f"{name} ...")
        progress(f"{name} ...", end="")
        try:
            yield
        finally:   # a phase that raises (a cutoff, an infeasible solve) took its time too
            self[name] = self.get(name, 0.0) + time.perf_counter() - start
            progress(f"{name}: {self[name]:.1f} s")
            log(1, f"{name}: {self[name]:.2f} s")
