"""autopar/runtime/cpu_memory.py: freed step memory stays in the process instead of being faulted in again.

Each case runs in a fresh interpreter (the allocator's thresholds are process-wide state) and counts
the minor page faults of a sixth "step" that allocates and writes 3 x 40 MiB, then frees it all. 40 MiB
is above the largest mmap threshold glibc adapts to (32 MiB), so its defaults map those tensors afresh
every step, whatever else the process did before (with 4 MiB tensors, whether the default trims the
heap depends on where small allocations happened to land: sometimes it did not).
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning is glibc's mallopt")

STEP_PAGES = 3 * 40 * 2**20 // 4096  # pages one step writes

SCRIPT = """
import resource, sys
import torch
from autopar.runtime.cpu_memory import keep_freed_memory

def step():  # a training step's activations: allocated, written, all freed at the end
    xs = [torch.ones(10 * 2**20) for _ in range(3)]
    del xs

state = keep_freed_memory() if sys.argv[1] == "keep" else "untouched"
for _ in range(5):  # the heap settles in the first steps
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(state, "|", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _step_faults(mode: str, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "AUTOPAR_KEEP_CPU_MEMORY")}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env={**clean, **env}, capture_output=True,
                         text=True, timeout=120, check=True).stdout.strip().splitlines()[-1]
    state, faults = out.rsplit("|", 1)
    return state.strip(), int(faults)


def test_glibc_defaults_fault_every_step_in_again():
    """The case the module exists for: without it every step faults all its pages in once more."""
    state, faults = _step_faults("default")
    assert state == "untouched"
    assert faults > STEP_PAGES * 9 // 10, faults


def test_keep_freed_memory_stops_the_faults():
    state, faults = _step_faults("keep")
    assert state.startswith("set (glibc M_MMAP_THRESHOLD 1024 MiB"), state  # 40 MiB needs more than 32
    assert faults < STEP_PAGES // 20, faults  # a few pages of Python's own; the step's 30720 come back free


def test_opt_out_and_user_tuning_leave_the_allocator_alone():
    state, faults = _step_faults("keep", AUTOPAR_KEEP_CPU_MEMORY="0")
    assert state == "skipped: AUTOPAR_KEEP_CPU_MEMORY=0"
    assert faults > STEP_PAGES * 9 // 10, faults
    state, _ = _step_faults("keep", MALLOC_ARENA_MAX="2", MALLOC_TRIM_THRESHOLD_="1048576")
    assert state == "skipped: the environment tunes malloc already (MALLOC_TRIM_THRESHOLD_)"
    state, _ = _step_faults("keep", LD_PRELOAD="")
    assert state.startswith("set"), state
