"""The capture cache: one trace per (model, inputs, options); every caller gets its own copy.

`autoparallelize` captures on every rank for every call and `plan` captures again, so a process that
plans or parallelizes the same model several times (strategies compared, a plan then a run, the
pipeline search's micro-batch graphs) paid a torch.export + joint trace each time: seconds, against
~0.2 s to copy the graph. `capture()` looks here first (see its docstring for what the key holds and
what it does not catch).

The cache maps a weak reference to the model (a model is never kept alive by it) to the key of the
model's state when it was traced and up to `MAX_PER_MODEL` graphs, one per (inputs, options). A
model whose state key changed loses all its graphs. The stored `Captured` is never handed out:
callers get a deep copy (`copy.deepcopy` of the GraphModule, node meta included), since
canonicalize and the passes rewrite their graph in place.
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import logging
import types
import weakref
from collections import OrderedDict
from typing import Any, Callable

import torch
import torch.nn as nn

from autopar import _torch_compat as compat
from autopar.config import capture_cache_enabled

log = logging.getLogger(__name__)

MAX_PER_MODEL = 8           # graphs kept per model (the pipeline search captures one per micro-batch size)
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout, enum.Enum)
_SKIP = object()            # left out of the key: modules (keyed on their own), tensors, opaque objects


@dataclasses.dataclass
class _Entries:
    model_key: tuple
    graphs: OrderedDict      # call key -> (Captured, weak references that must still resolve)


_cache: "weakref.WeakKeyDictionary[nn.Module, _Entries]" = weakref.WeakKeyDictionary()
_stats = {"hits": 0, "misses": 0, "derived": 0}


def clear_capture_cache() -> None:
    """Forget every cached capture (the counters in `capture_cache_stats` too)."""
    _cache.clear()
    _stats.update(hits=0, misses=0, derived=0)


def capture_cache_stats() -> dict[str, int]:
    """Hits, misses and derived graphs since the last clear: a miss is a real trace; a derived graph was
    built from another cached one (a full capture stamped out from the shallow capture of the same call)."""
    return dict(_stats)


def enabled(cache: bool | None) -> bool:
    """`cache` if given, else the environment: AUTOPAR_CAPTURE_CACHE=0 (or "false", "off") turns it off."""
    if cache is not None:
        return bool(cache)
    return capture_cache_enabled()


def cached(model: nn.Module, args: tuple, kwargs: dict, options: dict, trace: Callable[[], Any],
           derive: Callable[[Callable[[dict], Any]], Any] | None = None) -> Any:
    """A copy of the graph captured for this model, inputs and options: from the cache, or `trace()`d
    and stored. Calls the cache cannot key (an input or option that is not plain data) just trace.
    `derive`, on a miss: called with `stored(other_options)` (a copy of the graph cached for the same
    model and inputs under other options, or None), it returns this call's graph built from one, or
    None to trace (a full capture stamped out from a shallow one: `capture`)."""
    call = _call_key(args, kwargs, options)
    if call is None:
        return trace()
    key, refs = call
    model_key = _model_key(model)
    try:
        entries = _cache.get(model)
    except TypeError:   # a module class that is not hashable or takes no weak references
        return trace()
    if entries is None or entries.model_key != model_key:
        entries = _cache[model] = _Entries(model_key, OrderedDict())
    hit = _stored(entries, key)
    if hit is not None:
        _stats["hits"] += 1
        log.debug("capture: reusing the cached graph of %s", type(model).__name__)
        return hit
    captured = None
    if derive is not None:
        def stored(other: dict) -> Any:   # the graph of the same model and inputs under other options
            other_call = _call_key(args, kwargs, other)
            return _stored(entries, other_call[0]) if other_call is not None else None
        captured = derive(stored)
    if captured is None:
        captured = trace()
        _stats["misses"] += 1
    else:
        _stats["derived"] += 1
    entries.graphs[key] = (captured, refs)
    while len(entries.graphs) > MAX_PER_MODEL:
        entries.graphs.popitem(last=False)
    return copy_captured(captured)


def _stored(entries: _Entries, key: tuple) -> Any:
    """A copy of the graph `entries` holds under the call key `key` (`_call_key`), or None."""
    hit = entries.graphs.get(key)
    if hit is None or not all(ref() is not None for ref in hit[1]):  # alive: their ids in the key are theirs
        return None
    entries.graphs.move_to_end(key)
    return copy_captured(hit[0])


def copy_captured(captured: Any) -> Any:
    """A `Captured` whose graph and name lists the caller may change freely."""
    return dataclasses.replace(
        captured, gm=copy.deepcopy(captured.gm), param_names=list(captured.param_names),
        tied={k: list(v) for k, v in captured.tied.items()}, buffer_names=list(captured.buffer_names),
        input_names=list(captured.input_names), grad_param_names=list(captured.grad_param_names),
        unused_params=list(captured.unused_params), param_shapes=dict(captured.param_shapes),
        param_dtypes=dict(captured.param_dtypes), stamped=dict(captured.stamped),
        shallow=dict(captured.shallow))


# ---------------------------------------------------------------- keys

def _tensor_key(t: torch.Tensor) -> tuple:
    return (type(t), tuple(t.shape), t.dtype, t.device, tuple(t.stride()), t.requires_grad)


def _model_key(model: nn.Module) -> tuple:
    """What of the model the trace depends on: module tree, each module's class, forward code, training
    flag, hooks and plain attributes; every parameter and buffer (name, shape, dtype, device, strides,
    requires_grad, which are tied); global module hooks and the default dtype."""
    memo: dict[int, Any] = {}
    modules = tuple((name, type(m), _forward_code(m), m.training, compat.module_hook_ids(m), _attributes(m, memo))
                    for name, m in model.named_modules(remove_duplicate=False))
    return (modules, _tensors_key(model.named_parameters(remove_duplicate=False)),
            _tensors_key(model.named_buffers(remove_duplicate=False)), compat.module_hook_ids(),
            torch.get_default_dtype())


def _tensors_key(named) -> tuple:
    first: dict[int, int] = {}
    return tuple((name, _tensor_key(t), first.setdefault(id(t), i)) for i, (name, t) in enumerate(named))


def _forward_code(m: nn.Module) -> Any:
    fn = getattr(m.forward, "__func__", m.forward)
    return getattr(fn, "__code__", None) or type(fn)


def _attributes(m: nn.Module, memo: dict) -> tuple:
    """The module's plain attributes (dropout's p, eps, head counts...), and those of plain objects it
    holds (e.g. a transformers config, with its dicts and sub-configs), two levels down; memoised by object."""
    out = []
    for name, value in vars(m).items():
        if name in ("_parameters", "_buffers", "_modules"):
            continue
        plain = _plain(value, memo, depth=3)
        if plain is not _SKIP:
            out.append((name, plain))
    return tuple(out)


def _plain(value: Any, memo: dict, depth: int) -> Any:
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return ("function", getattr(value, "__module__", None), value.__qualname__)  # names: no reference kept
    if depth == 0 or isinstance(value, (nn.Module, torch.Tensor, type)) or callable(value):
        return _SKIP
    if isinstance(value, (tuple, list)):
        items = tuple(_plain(v, memo, depth - 1) for v in value)
        return _SKIP if any(v is _SKIP for v in items) else (type(value), items)
    if isinstance(value, dict):
        items = tuple((k, _plain(v, memo, depth - 1)) for k, v in value.items() if isinstance(k, _PLAIN))
        return tuple((k, v) for k, v in items if v is not _SKIP)
    if hasattr(value, "__dict__"):   # a config object: its plain attributes, computed once per call
        if id(value) not in memo:
            memo[id(value)] = (type(value), tuple((k, p) for k, v in vars(value).items()
                                                  if (p := _plain(v, memo, depth - 1)) is not _SKIP))
        return memo[id(value)]
    return _SKIP


def _call_key(args: tuple, kwargs: dict, options: dict) -> tuple | None:
    """(hashable key, weak references) for the inputs and capture options, or None when some value is
    neither a tensor, plain data nor a callable that takes weak references. A callable (loss_fn) is
    matched by identity: its id (a method's object and function ids) is in the key, and an entry is
    used only while its weak reference lives, so the id cannot belong to another object."""
    refs: list = []
    parts = [tuple(_tensor_key(a) for a in args)]
    for name, value in [*kwargs.items(), *sorted(options.items())]:
        if isinstance(value, torch.Tensor):
            parts.append((name, _tensor_key(value)))
        elif callable(value) and not isinstance(value, type):
            ref = _weak(value)
            if ref is None:
                return None
            refs.append(ref)
            ids = (id(value.__self__), id(value.__func__)) if isinstance(ref, weakref.WeakMethod) else (id(value),)
            parts.append((name, "callable", ids, _model_key(value) if isinstance(value, nn.Module) else None))
        else:
            plain = _plain(value, {}, depth=3)
            if plain is _SKIP:
                return None
            parts.append((name, plain))
    try:
        key = tuple(parts)
        hash(key)
    except TypeError:   # e.g. an enum member or a config attribute that is not hashable
        return None
    return key, refs


def _weak(fn: Any) -> weakref.ref | None:
    try:
        return weakref.WeakMethod(fn) if hasattr(fn, "__self__") and hasattr(fn, "__func__") else weakref.ref(fn)
    except TypeError:
        return None
