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


def run_distributed(fn, world: int, *args, timeout: float = 240.0) -> list:
    """fn(rank, world, *args) on `world` ranks; returns the results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue, os.getpid()),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    except Exception as e:  # queue.Empty on timeout
        errors.append(f"timed out after {timeout}s waiting for ranks ({type(e).__name__})")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("distributed run failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world)]
