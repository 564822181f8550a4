"""Capture's user-facing failures: a tracing error turned into a TraceError naming the user's line,
and models that modify their example inputs in place."""
from __future__ import annotations

import linecache
import os
import sys
import traceback
from typing import Callable

import torch
import torch.fx

from autopar.config import debug_level
from autopar.errors import InputError, NoLossError, TraceError


def traced(step: Callable[[], torch.fx.GraphModule]) -> torch.fx.GraphModule:
    """Run a tracing step; turn torch's failure into a TraceError naming the user's line."""
    try:
        return step()
    except (InputError, NoLossError):
        raise
    except Exception as e:  # noqa: BLE001 - any tracing failure is reported the same way
        err = TraceError(trace_message(e))
        err.original = e
        if debug_level() > 0:
            raise err from e
        raise err from None


def trace_message(e: BaseException) -> str:
    reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    where = _user_frame(e)
    at = f" at {where[0]}:{where[1]}" + (f": `{where[2]}`" if where[2] else "") if where else ""
    hint = ""
    if "data-dependent" in str(e) or "data dependent" in str(e):
        hint = ("Python control flow that depends on tensor values (e.g. `if x.sum() > 0:`) "
                "cannot be traced: use torch.where / torch.cond, or move it out of forward. ")
    return (f"could not capture the model{at}. torch said: {type(e).__name__}: {reason}\n"
            f"{hint}Set AUTOPAR_DEBUG=1 to see torch's traceback.")


def _user_frame(e: BaseException) -> tuple[str, int, str] | None:
    """The innermost frame outside torch, autopar and the standard library, over the chain (autopar's
    shipped test models, autopar/_testing/, count as the user's code)."""
    skip = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules["autopar"]))
    models = os.path.join(os.path.dirname(sys.modules["autopar"].__file__), "_testing") + os.sep
    stdlib = os.path.dirname(os.__file__) + os.sep
    found, seen = None, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for frame, line in traceback.walk_tb(e.__traceback__):
            path = frame.f_code.co_filename
            internal = path.startswith(skip) and not path.startswith(models)
            if not internal and not path.startswith(stdlib) and not path.startswith("<"):
                found = (path, line)
        e = e.__cause__ or e.__context__
    if found is None:
        return None
    return found[0], found[1], linecache.getline(found[0], found[1]).strip()


def check_inputs_not_mutated(gm: torch.fx.GraphModule, input_names: list[str]) -> None:
    """An in-place op on an example input would change the caller's batch on every step, and a
    sharded runtime would change only a slice of it: refuse it with the line that does it."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(inputs, input_names):
        for user in node.users:
            schema = getattr(user.target, "_schema", None)
            if schema is None:
                continue
            for i, arg in enumerate(schema.arguments):
                if i < len(user.args) and user.args[i] is node and arg.alias_info is not None and arg.alias_info.is_write:
                    at = _last_frame(user.meta.get("stack_trace", ""))
                    raise InputError(
                        f"the model modifies its input {name!r} in place with {user.target}{at}. autopar "
                        "shards inputs across ranks, so in-place changes to them are not supported: "
                        "work on a copy (e.g. `x = x * 2` instead of `x.mul_(2)`).")


def _last_frame(stack_trace: str) -> str:
    """' at file, line N: `code`' for the innermost frame of an FX stack trace ('' if none)."""
    lines = [ln.strip() for ln in stack_trace.splitlines() if ln.strip()]
    frames = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
    if not frames:
        return ""
    i = frames[-1]
    code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
    return f" at {lines[i].removeprefix('File ')}" + (f": `{code}`" if code else "")
