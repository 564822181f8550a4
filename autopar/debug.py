"""Levelled debug output from one environment variable, AUTOPAR_DEBUG (printed to stderr).

    1  timings of each planning phase and each rewrite pass
    2  + the numbered pass list, cost-graph sizes and solver statistics
    3  + every collective the lowering emits
    4  + each graph after each pass (AUTOPAR_DUMP_DIR writes them to files instead)
"""
from __future__ import annotations

import os
import sys


def level() -> int:
    try:
        return int(os.environ.get("AUTOPAR_DEBUG", "0") or 0)
    except ValueError:
        return 1


def progress(msg: str, *, end: str = "\n") -> None:
    """A progress line on an interactive terminal (stderr); silent in pipes, CI and tests."""
    if sys.stderr.isatty() and level() == 0:
        print(f"\rautopar: {msg}", end=end, file=sys.stderr, flush=True)


def log(at: int, msg: str) -> None:
    if level() >= at:
        print(f"[autopar] {msg}", file=sys.stderr, flush=True)
