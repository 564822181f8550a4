"""Joining the job: the process group (gloo or NCCL), this rank's device, and one plan for every rank."""
from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist

from autopar import errors
from autopar.errors import DeviceError, InputError
from autopar.plan import Plan


def _backend_for(device: str | None) -> str:
    """gloo for "cpu", NCCL for "cuda"; None follows what this machine has (CUDA when present)."""
    if device is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if device not in ("cpu", "cuda"):
        raise InputError(f"device={device!r}: use 'cpu' (gloo), 'cuda' (NCCL) or None (CUDA when present)")
    if device == "cuda" and not torch.cuda.is_available():
        why = "this torch is a CPU build" if torch.version.cuda is None else "no GPU or driver is visible"
        raise DeviceError(f"device='cuda' was requested but torch.cuda.is_available() is False ({why}: torch "
                          f"{torch.__version__}); use device='cpu' (gloo), or run on a GPU machine with a CUDA "
                          "build of torch")
    return "nccl" if device == "cuda" else "gloo"


def init_distributed(device: str | None = None) -> tuple[int, int]:
    """Join torchrun's process group (gloo on CPU, NCCL with CUDA), or make a world of one."""
    backend = _backend_for(device)
    if dist.is_initialized() and device is not None and dist.get_backend() != backend:
        raise DeviceError(f"device={device!r} needs the {backend} backend but the process group was initialised "
                          f"with {dist.get_backend()}; initialise it with {backend!r} or pass device=None")
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
            if attempt is None:
                dist.init_process_group(backend)
            else:  # torchrun may keep its store across restarts: a restarted job must not read the
                # previous attempt's addresses (a stale gloo peer address hangs or refuses the connection)
                store, rank, world = next(dist.rendezvous("env://"))
                dist.init_process_group(backend, store=dist.PrefixStore(f"autopar/attempt_{attempt}", store),
                                        rank=rank, world_size=world)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def leave_job() -> NoReturn:
    """Ends a torchrun rank whose work is done (outputs written, process group destroyed) without the
    interpreter's shutdown: under gloo, a worker thread of torch's process group may release a finished
    collective (the last barrier keeps the collectives before it) only after the script's last line, and if the
    interpreter is shutting down by then, its tensors' release takes the GIL and aborts the rank ("terminate
    called without an active exception", rc -6: the 4-rank ZeRO-3 run of examples/train_gpt.py, beside a CPU hog,
    in 4 of 18 runs before it ended so, none of 24 after; the mechanism of pytorch/pytorch#179291).
    `dist.destroy_process_group()` does not join those threads (docs/debugging.md)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def local_device() -> str:
    if device_type() == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def broadcast_plan(plan_fn) -> Plan:
    """Rank 0 plans, every rank receives the same JSON (solver time limits may not be repeatable).

    Planning may fail on rank 0 (a user mistake it detects, an infeasible budget): then every rank
    raises the same error, instead of the others waiting in the broadcast for a plan that never comes.
    """
    box: list = [None]
    failure = None
    if dist.get_rank() == 0:
        try:
            box = [plan_fn().to_json()]
        except Exception as e:  # every rank must leave the broadcast; rank 0 re-raises its own below
            failure, box = e, [_portable_error(e)]
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if isinstance(box[0], dict):
        raise _rebuild_error(box[0])
    return Plan.from_json(box[0])


def _portable_error(e: Exception) -> dict:
    """An exception as plain data (its class may not unpickle: keyword-only constructor arguments)."""
    return {"type": type(e).__name__, "message": str(e),
            "attrs": {k: v for k, v in vars(e).items() if isinstance(v, (int, float, str, type(None)))}}


def _rebuild_error(data: dict) -> Exception:
    cls = getattr(errors, data["type"], None)
    if isinstance(cls, type) and issubclass(cls, errors.AutoparError):
        err = cls.__new__(cls)
        Exception.__init__(err, data["message"])
        err.__dict__.update(data["attrs"])
        return err
    return RuntimeError(f"planning failed on rank 0 ({data['type']}): {data['message']}")
