"""Run a function on N gloo ranks in fresh processes, with a timeout so a hung collective fails the
test instead of CI. Results come back pickled through a queue (tensors as CPU tensors)."""
from __future__ import annotations

import faulthandler
import io
import os
import socket
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent(parent: int) -> None:
    """Linux: this rank gets SIGKILL when the process that spawned it dies (a killed or interrupted pytest would
    otherwise leave its ranks running, computing or waiting on a collective, until their own timeouts)."""
    import ctypes
    import signal
    import sys
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)   # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:   # the parent died before prctl: nobody will send the signal
        os._exit(1)


def _worker(rank, world, port, fn, args, queue, parent):
    import torch.distributed as dist
    _die_with_parent(parent)
    faulthandler.enable()  # a crash in a native library prints every thread's Python stack
    # one share of the cores per rank, as torchrun's OMP_NUM_THREADS=1: 4 ranks of torch's default 2 intra-op
    # threads each would oversubscribe 2 cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(result, buf)  # plain bytes: shared-memory tensors die with this process
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _died(p) -> str:
    """How an exited rank ended: 'exit code 1', or the signal that killed it ('SIGSEGV', a native crash)."""
    import signal
    if p.exitcode is not None and p.exitcode < 0:
        try:
            return signal.Signals(-p.exitcode).name
        except ValueError:
            return f"signal {-p.exitcode}"
    return f"exit code {p.exitcode}"


def run_distributed(fn, world: int, *args, timeout: float = 240.0) -> list:
    """fn(rank, world, *args) on `world` ranks; returns the results in rank order.

    Fails with the first rank's traceback when one raises; fails within seconds when a rank dies without
    reporting (a native crash: its signal is named, faulthandler has printed its threads' stacks to stderr),
    instead of waiting out `timeout` while the other ranks hang in a collective or report alone."""
    import queue as queue_module
    import time
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue, os.getpid()),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = time.monotonic() + timeout
    exited = {}   # rank -> when it was first seen exited without having reported
    announced = set()   # ranks whose death is already in `errors`
    try:
        while len(results) < world and not errors:
            try:
                rank, status, value = queue.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except queue_module.Empty:
                now = time.monotonic()
                for r, p in enumerate(procs):
                    if r not in results and not p.is_alive():
                        exited.setdefault(r, now)
                # a rank's result is in the pipe before its process ends: wait a little for it, then fail
                dead = [r for r, t in exited.items() if r not in results and now - t > 5.0]
                if dead:
                    announced.update(dead)
                    errors += [f"rank {r} died ({_died(procs[r])}) without reporting: its stderr above has "
                               f"faulthandler's stacks" for r in dead]
                elif now >= deadline:
                    errors.append(f"timed out after {timeout}s waiting for ranks "
                                  f"{sorted(set(range(world)) - set(results))}")
                continue
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=0 if errors else 5)
        # a rank killed by a signal is the cause of what the others then report (a peer gone in a collective)
        errors[:0] = [f"rank {r} died ({_died(p)}): its stderr above has faulthandler's stacks"
                      for r, p in enumerate(procs) if (p.exitcode or 0) < 0 and r not in announced]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        raise AssertionError("distributed run failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world)]
