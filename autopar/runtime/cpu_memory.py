"""On CPU, keep the memory a training step frees, so the next step does not page-fault it in again.

glibc's malloc gives memory back to the kernel when the free space at the top of its heap exceeds
M_TRIM_THRESHOLD, and maps every allocation above M_MMAP_THRESHOLD afresh (both thresholds adapt,
up to 64 and 32 MiB). A training step allocates its activations, frees them, and allocates the same
sizes again in the next step; once a step's frees leave more than the trim threshold at the top of
the heap, every step hands those pages back and faults each one in again, zero-filled by the kernel.
autopar's step frees its activations as one graph, in an order that does exactly this: the step_time
GPT (4 layers x 256, 2 ranks, dp), alone in its process, faulted 19-20 thousand pages (~80 MB) per
step and spent 36-40 ms of kernel time on them: 353-355 ms per step against DDP's 309-327 ms (whose
order of frees mostly does not trim), 308-317 ms with the thresholds below.

PyTorch keeps freed memory for the same reason on GPUs (the CUDA caching allocator), and its CPU
launcher (`python -m torch.backends.xeon.run_cpu`) preloads jemalloc or tcmalloc configured never to
return freed memory. `keep_freed_memory` is the glibc equivalent, applied once per process when
autopar runs on CPU (`autoparallelize`; `autopar calibrate`, to measure under the same settings):
M_MMAP_THRESHOLD 1 GiB (32 MiB where an older glibc refuses more; larger tensors are still mapped
per allocation, as by default) and M_TRIM_THRESHOLD 2 GiB - 1 (the largest `mallopt` takes). The
cost is that the process keeps its peak heap, which a training job reaches again every step anyway.

It leaves the allocator alone when the C library is not glibc, when AUTOPAR_KEEP_CPU_MEMORY=0, when
the user tuned malloc already (MALLOC_*_ or a glibc.malloc tunable in the environment), and when
LD_PRELOAD loads another allocator (jemalloc, tcmalloc, mimalloc).
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform

from autopar.config import keep_cpu_memory

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLDS = (2**30, 32 * 2**20)  # an older glibc may refuse more than HEAP_MAX_SIZE / 2 (32 MiB)
TRIM_THRESHOLD = 2**31 - 1   # mallopt takes an int
USER_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

_state: str | None = None  # what the first call did; later calls repeat it


def keep_freed_memory() -> str:
    """Raise glibc's mmap and trim thresholds once per process; returns what was done ("set", or
    "skipped: <why>"), which is also logged at INFO."""
    global _state
    if _state is None:
        _state = _apply()
        log.info("CPU allocator: %s", _state)
    return _state


def _apply() -> str:
    if not keep_cpu_memory():
        return "skipped: AUTOPAR_KEEP_CPU_MEMORY=0"
    if platform.libc_ver()[0] != "glibc":
        return "skipped: the C library is not glibc"
    tuned = [v for v in USER_ENV if v in os.environ]
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        tuned.append("GLIBC_TUNABLES")
    if tuned:
        return f"skipped: the environment tunes malloc already ({', '.join(tuned)})"
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in OTHER_ALLOCATORS):
        return f"skipped: LD_PRELOAD loads another allocator ({preload})"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "skipped: mallopt is not available"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # the mmap threshold first: setting either one turns glibc's adaptive thresholds off
    mmap = next((t for t in MMAP_THRESHOLDS if mallopt(M_MMAP_THRESHOLD, t)), None)
    if mmap is None or not mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        return "skipped: glibc refused the thresholds"
    return f"set (glibc M_MMAP_THRESHOLD {mmap >> 20} MiB, M_TRIM_THRESHOLD {TRIM_THRESHOLD >> 20} MiB)"
