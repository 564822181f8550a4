"""autopar/cpu_memory.py: freed step memory stays in the process instead of being faulted in again.

Each case runs in a fresh interpreter (the allocator's thresholds are process-wide state) and counts
the minor page faults of a third "step" that allocates and writes 32 x 4 MiB, then frees it all.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning is glibc's mallopt")

STEP_PAGES = 32 * 2**20 // 4096  # pages one step writes

SCRIPT = """
import resource, sys
import torch
from autopar.cpu_memory import keep_freed_memory

def step():  # a training step's activations: allocated, written, all freed at the end
    xs = [torch.ones(2**20) for _ in range(32)]
    del xs

state = keep_freed_memory() if sys.argv[1] == "keep" else "untouched"
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(state, "|", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _third_step_faults(mode: str, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "AUTOPAR_KEEP_CPU_MEMORY")}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env={**clean, **env}, capture_output=True,
                         text=True, timeout=120, check=True).stdout.strip().splitlines()[-1]
    state, faults = out.rsplit("|", 1)
    return state.strip(), int(faults)


def test_glibc_defaults_fault_every_step_in_again():
    """The case the module exists for: without it the third step faults all its pages once more."""
    state, faults = _third_step_faults("default")
    assert state == "untouched"
    assert faults > STEP_PAGES // 2, faults


def test_keep_freed_memory_stops_the_faults():
    state, faults = _third_step_faults("keep")
    assert state.startswith("set"), state
    assert faults < STEP_PAGES // 20, faults  # a few pages of Python's own; the step's 8192 come back free


def test_opt_out_and_user_tuning_leave_the_allocator_alone():
    state, faults = _third_step_faults("keep", AUTOPAR_KEEP_CPU_MEMORY="0")
    assert state == "skipped: AUTOPAR_KEEP_CPU_MEMORY=0"
    assert faults > STEP_PAGES // 2, faults
    state, _ = _third_step_faults("keep", MALLOC_ARENA_MAX="2", MALLOC_TRIM_THRESHOLD_="1048576")
    assert state == "skipped: the environment tunes malloc already (MALLOC_TRIM_THRESHOLD_)"
    state, _ = _third_step_faults("keep", LD_PRELOAD="")
    assert state.startswith("set"), state
