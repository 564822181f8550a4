"""This machine's hardware profile for CPU jobs: measured once, at first use, then read from a cache.

`autoparallelize` with no mesh, on CPU, prices its plan on what this machine does rather than on the
`cpu` preset, whose figures were measured once on another machine (on this project's 2-core VM the
example GPT's plan said 134 ms per step under the preset; its steps ran at 75-90 ms). The first job
for a given host, CPU model, torch version, world size and thread count runs a short calibration on
every rank (`calibrate` with messages up to 4 MiB, 3 rounds, and the full compute benchmarks:
~7 s on 2 ranks of a 2-core machine; the quick ones' smaller operands stay in cache and priced the
example GPT's step 11% faster than the full ones, 25.6 against 28.7 ms, its step running at 38-43 ms); rank 0 writes the profile under `AUTOPAR_CACHE_DIR` (default
~/.cache/autopar) and later jobs read it back. Rank 0's choice is broadcast, so every rank plans on
the same figures. `AUTOPAR_CALIBRATE=0` plans on the preset instead; the summary then says so.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from autopar import config
from autopar.calibration.measure import calibrate, size_range
from autopar.costmodel.hardware import HardwareSpec, get_hardware, load_hardware
from autopar.errors import HardwareError

QUICK_SIZES = size_range("1K", "4M")   # the largest gradient bucket of a small model; alpha-beta extrapolates
QUICK_ITERS = 3
FORMAT = 6   # 3: the compiled program's figures (calibration/compiled.py); 4: in_step_scale (calibration/in_step.py);
# 5: compiled_in_step_scale (the reference step compiled); 6: runtime_overhead (the reference model's runtime step).
# Bump when what a cached profile holds changes: older files are then measured again


def machine_key(world: int) -> dict[str, object]:
    """What a cached profile was measured for; a job with another key measures again."""
    return {"format": FORMAT, "host": socket.gethostname(), "cpu": cpu_model(), "torch": torch.__version__,
            "world": world, "threads": torch.get_num_threads()}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux; platform's answer elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile_path(key: dict[str, object]) -> Path:
    """Where the profile for `key` is cached: one file per key, named by its world size and a hash of
    the key. The file is a plain profile (`Mesh(hardware=path)` and `autopar plan --hardware` read it);
    beside it, `<name>.key.json` says what it was measured for (for people: the name decides)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return config.cache_dir() / "profiles" / f"cpu-world{key['world']}-{digest}.json"


def read_profile(path: Path) -> HardwareSpec | None:
    """The profile cached at `path`; None when absent or unreadable (a truncated or hand-broken file
    is measured again, not trusted)."""
    if not path.is_file():
        return None
    try:
        return load_hardware(path)
    except HardwareError:
        return None


def write_profile(path: Path, key: dict[str, object], spec: HardwareSpec, seconds: float) -> None:
    """Write atomically (temporary files renamed), so a job reading meanwhile sees all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    about = {"measured_for": key, "seconds": round(seconds, 3)}
    for target, text in ((path.with_suffix(".key.json"), json.dumps(about, indent=2, sort_keys=True) + "\n"),
                         (path, json.dumps(spec.to_json(), indent=2, sort_keys=True) + "\n")):
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, target)


def machine_hardware(world: int, compiled: bool = False) -> HardwareSpec:
    """This machine's calibrated profile for a CPU job of `world` ranks, measured now if none is
    cached; the `cpu` preset when AUTOPAR_CALIBRATE=0. Call on every rank of the process group.
    The compiled program's figures are measured only for a job that compiles (`compiled`: a cached
    profile without them is measured again, with them): they compile several programs."""
    if not config.calibrate_enabled():
        return get_hardware("cpu")
    key = machine_key(world)
    path = profile_path(key)
    rank0 = dist.get_rank() == 0
    cached = read_profile(path) if rank0 else None
    box = [cached.to_json() if cached is not None else None]
    dist.broadcast_object_list(box, src=0)   # rank 0's cache decides for every rank (and every node)
    if box[0] is not None and (not compiled or HardwareSpec.from_json(box[0]).compiled_op_overhead > 0):
        return HardwareSpec.from_json(box[0])
    return _measure(path, key, rank0, compiled)


def _measure(path: Path, key: dict[str, object], rank0: bool, compiled: bool) -> HardwareSpec:
    """Calibrate on every rank (the same result on each), cache on rank 0. The global RNG is left
    as it was: a first run must draw the same random numbers as the runs that read the cache."""
    if rank0:
        print(f"autopar: first CPU job on this machine with world size {key['world']}, {key['threads']} thread(s) per "
              f"rank: calibrating (a few seconds, once; AUTOPAR_CALIBRATE=0 skips it) -> {path}",
              file=sys.stderr, flush=True)
    start = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        spec = calibrate(sizes=QUICK_SIZES, iters=QUICK_ITERS, quick_compute=False, progress=lambda msg: None,
                         compiled=compiled).spec
    seconds = time.perf_counter() - start
    if rank0:
        try:
            write_profile(path, key, spec, seconds)
        except OSError as e:   # a read-only home: plan on the measured figures, measure again next time
            warnings.warn(f"autopar: could not cache the calibrated profile at {path} ({e}); set AUTOPAR_CACHE_DIR "
                          f"to a writable folder", stacklevel=2)
        print(f"autopar: calibrated in {seconds:.1f} s", file=sys.stderr, flush=True)
    return spec
