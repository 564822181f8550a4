"""How calibration times things: every rank runs the same calls, the device synchronised around them."""
from __future__ import annotations

import statistics
import time
import warnings
from typing import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mean_time(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Mean seconds of `iters` calls after one warm-up; the same number of calls on every rank, so
    collectives can be timed."""
    with warnings.catch_warnings():   # torch's deprecation notes on *_into_tensor / *_tensor names
        warnings.simplefilter("ignore", FutureWarning)
        fn()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(device)
        return (time.perf_counter() - t0) / iters


def sustained_time(fn: Callable[[], object], device: torch.device, iters: int,
                   min_seconds: float = 0.05) -> float:
    """Mean seconds per call of `fn` run back to back for at least `min_seconds`, median of `iters`
    such runs. A training step keeps the core busy for its whole length; on a shared machine a
    short burst after a pause runs faster than that (the scheduler favours a task that slept), so
    short ops are timed as a sustained stream, like the step runs them."""
    fn()
    sync(device)
    runs = []
    for _ in range(iters):
        calls, t0 = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            if calls & (calls - 1) == 0:   # check the clock (and sync) at 1, 2, 4, 8, ... calls
                sync(device)
                elapsed = time.perf_counter() - t0
                if elapsed >= min_seconds:
                    break
        runs.append(elapsed / calls)
    return statistics.median(runs)
