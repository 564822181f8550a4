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
import torch.nn as nn

from autopar.config import debug_level
from autopar.errors import InputError, NoLossError, TraceError


def traced(step: Callable[[], torch.fx.GraphModule], model: nn.Module | None = None,
           node: Callable[[], torch.fx.Node | None] | None = None) -> torch.fx.GraphModule:
    """Run a tracing step; turn torch's failure into a TraceError naming the user's line and, when
    `model` is given, the innermost of its modules that was running: read off the frames of a step that
    runs the modules (export), or off `node()`, the exported graph's node a retrace was running."""
    try:
        return step()
    except (InputError, NoLossError):
        raise
    except Exception as e:  # noqa: BLE001 - any tracing failure is reported the same way
        failed = node() if node is not None else None
        module = _node_module(failed, model) if failed is not None else _frame_module(e, model)
        err = TraceError(trace_message(e, module, failed))
        err.original = e
        if debug_level() > 0:
            raise err from e
        raise err from None


def trace_message(e: BaseException, module: tuple[str, nn.Module] | None = None,
                  node: torch.fx.Node | None = None) -> str:
    """The TraceError text: torch's reason, the user's line (or the failing node's, for a retrace of the
    exported graph), the module (path, object) if known, a hint."""
    reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    where = _user_frame(e)
    at = f" at {where[0]}:{where[1]}" + (f": `{where[2]}`" if where[2] else "") if where else ""
    if not at and node is not None:
        at = _last_frame(node.meta.get("stack_trace") or "")
    inside = f" in module `{module[0] or '(the model)'}` ({type(module[1]).__name__})" if module else ""
    hint = ""
    if "data-dependent" in str(e) or "data dependent" in str(e):
        hint = ("Python control flow that depends on tensor values (e.g. `if x.sum() > 0:`) "
                "cannot be traced: use torch.where / torch.cond, or move it out of forward. ")
    elif "captured" in str(e) and ("mutate" in str(e) or "in-place" in str(e)):
        hint = _captured_state_hint(module)
    return (f"could not capture the model{inside}{at}. torch said: {type(e).__name__}: {reason}\n"
            f"{hint}Set AUTOPAR_DEBUG=1 to see torch's traceback.")


def _path(name: str) -> str:
    """A module path without the capture wrapper's "model." prefix."""
    return name.removeprefix("model").removeprefix(".")


def _frame_module(e: BaseException, model: nn.Module | None) -> tuple[str, nn.Module] | None:
    """(path, module) of the innermost frame, over the exception chain, whose `self` is one of `model`'s
    modules (not the wrapper itself)."""
    if model is None:
        return None
    names = {id(m): _path(name) for name, m in model.named_modules()}
    found, seen = None, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for frame, _ in traceback.walk_tb(e.__traceback__):
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in names and owner is not model:
                found = (names[id(owner)], owner)
        e = e.__cause__ or e.__context__
    return found


def _node_module(node: torch.fx.Node, model: nn.Module | None) -> tuple[str, nn.Module] | None:
    """(path, module) of the innermost module an exported graph's node was recorded in."""
    stack = node.meta.get("nn_module_stack") or {}
    if model is None or not stack:
        return None
    path = list(stack.values())[-1][0]
    try:
        return _path(path), model.get_submodule(path)
    except AttributeError:
        return None


def _captured_state_hint(module: tuple[str, nn.Module] | None) -> str:
    """What to change when forward updates in place a tensor that is no input, parameter or buffer."""
    what = f"`{module[0] or '(the model)'}`" if module else "the model"
    flags = _cache_flags(*module) if module else []
    fix = (" or ".join(f"set `{f} = False`" for f in flags) + " for training") if flags else (
        "turn that state off for training (e.g. a cache flag in the module or its config) or register the "
        "tensor as a buffer (`self.register_buffer(...)`) if it is part of the model's state")
    return (f"{what} changes in place a tensor that is neither an input, a parameter nor a buffer, such as "
            f"a cache kept for generation (autopar already turns every config's use_cache off while it "
            f"captures): {fix}. ")


def _cache_flags(path: str, module: nn.Module) -> list[str]:
    """`model.<path>.<flag>` for each True boolean attribute named like a cache switch on the module or
    its config."""
    prefix = ".".join(["model", *([path] if path else [])])
    flags = [f"{prefix}.{k}" for k, v in vars(module).items() if v is True and "cache" in k.lower()]
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "__dict__"):
        flags += [f"{prefix}.config.{k}" for k, v in vars(config).items() if v is True and "cache" in k.lower()]
    return flags


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
