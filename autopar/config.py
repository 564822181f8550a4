"""Every setting autopar reads from the environment, in one place.

| variable | default | effect |
|---|---|---|
| AUTOPAR_DEBUG | 0 | 0: progress lines on a terminal only; 1: timings of each planning phase and pass; 2: + the pass list, cost-graph sizes, solver statistics; 3: + every collective the lowering emits; 4: + each graph after each pass |
| AUTOPAR_DUMP_DIR | unset | a folder that receives each graph before and after each pass (NN_pass_{before,after}.py) |
| AUTOPAR_DISABLE_PASSES | unset | comma-separated optional passes to switch off (`autopar.passes.OPTIONAL`) |
| AUTOPAR_CAPTURE_CACHE | 1 | 0: trace the model at every call instead of reusing the graph captured for the same model object, inputs and options |
| AUTOPAR_KEEP_CPU_MEMORY | 1 | 0: leave glibc's malloc thresholds as they are (`autopar/runtime/cpu_memory.py`) |
| AUTOPAR_CALIBRATE | 1 | 0: a CPU `autoparallelize` with no mesh plans on the uncalibrated `cpu` preset instead of this machine's profile, measured at first use and cached (`autopar/calibration/machine.py`) |
| AUTOPAR_CACHE_DIR | ~/.cache/autopar | where those profiles are cached ($XDG_CACHE_HOME/autopar when that is set) |
| AUTOPAR_PLAN_WORKER | 1 | 0: the layout search computes its LP bounds itself, without the second process that works them out ahead of it (`autopar/pipeline/bound_worker.py`) |
| AUTOPAR_COMPILE_OVERLAP | unset | how a compiled program's collectives overlap compute: `inductor`, `layers` or `program` (`autopar.runtime.compile.OVERLAP`); unset: the measured default for the device type |

Each is read when it is used (not at import), so a test or a script may set it at any time.
The launcher's own variables (RANK, WORLD_SIZE, LOCAL_RANK, ...) are torch's, read where they are used.
"""
from __future__ import annotations

import os
from pathlib import Path

DEBUG = "AUTOPAR_DEBUG"
DUMP_DIR = "AUTOPAR_DUMP_DIR"
DISABLE_PASSES = "AUTOPAR_DISABLE_PASSES"
CAPTURE_CACHE = "AUTOPAR_CAPTURE_CACHE"
KEEP_CPU_MEMORY = "AUTOPAR_KEEP_CPU_MEMORY"
CALIBRATE = "AUTOPAR_CALIBRATE"
CACHE_DIR = "AUTOPAR_CACHE_DIR"
COMPILE_OVERLAP = "AUTOPAR_COMPILE_OVERLAP"
PLAN_WORKER = "AUTOPAR_PLAN_WORKER"
_OFF = ("0", "false", "off", "no")


def debug_level() -> int:
    """AUTOPAR_DEBUG as an int (a value that is not a number counts as 1)."""
    try:
        return int(os.environ.get(DEBUG, "0") or 0)
    except ValueError:
        return 1


def dump_dir() -> str | None:
    return os.environ.get(DUMP_DIR) or None


def disabled_passes() -> frozenset[str]:
    """Pass names in AUTOPAR_DISABLE_PASSES (unchecked; `autopar.passes.env_disabled` checks them)."""
    return frozenset(n.strip() for n in os.environ.get(DISABLE_PASSES, "").split(",") if n.strip())


def capture_cache_enabled() -> bool:
    return os.environ.get(CAPTURE_CACHE, "1").strip().lower() not in _OFF


def keep_cpu_memory() -> bool:
    return os.environ.get(KEEP_CPU_MEMORY, "1") != "0"


def calibrate_enabled() -> bool:
    return os.environ.get(CALIBRATE, "1").strip().lower() not in _OFF


def plan_worker_enabled() -> bool:
    return os.environ.get(PLAN_WORKER, "1").strip().lower() not in _OFF


def cache_dir() -> Path:
    """AUTOPAR_CACHE_DIR, else $XDG_CACHE_HOME/autopar, else ~/.cache/autopar."""
    if os.environ.get(CACHE_DIR):
        return Path(os.environ[CACHE_DIR]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "autopar"


def compile_overlap() -> str | None:
    """AUTOPAR_COMPILE_OVERLAP (unchecked; `autopar.runtime.compile.overlap_mode` checks it), None when unset."""
    return os.environ.get(COMPILE_OVERLAP, "").strip().lower() or None
