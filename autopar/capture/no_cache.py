"""No generation-time state while a training step is captured.

A transformers model fills a KV cache when its config says `use_cache=True` (the default of causal LMs);
the cache's tensors are created and updated in place during forward, which torch.export refuses (a
captured tensor mutated), and a training step never reads them. Passing `use_cache=False` reaches only
a top-level forward that has the parameter: a model inside the user's own wrapper module gets it from
its config. So, for the trace, every config object held by any module (and its sub-configs, such as a
multimodal model's `text_config`) has its cache settings turned off, and they are put back afterwards,
also when the trace fails.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn

CACHE_SETTINGS = ("use_cache",)   # config attributes that make a forward build generation-time state


def _is_config(obj: Any) -> bool:
    """A plain object carrying a cache setting (a transformers PretrainedConfig or GenerationConfig)."""
    return (not isinstance(obj, (nn.Module, torch.Tensor, type)) and hasattr(obj, "__dict__")
            and any(isinstance(vars(obj).get(key), bool) for key in CACHE_SETTINGS))


def configs_of(model: nn.Module) -> list[Any]:
    """Every config object the model's modules hold, and the configs those hold, each once."""
    found: dict[int, Any] = {}
    for module in model.modules():
        for obj in vars(module).values():
            if _is_config(obj):
                found.setdefault(id(obj), obj)
                for sub in vars(obj).values():
                    if _is_config(sub):
                        found.setdefault(id(sub), sub)
    return list(found.values())


@contextlib.contextmanager
def caches_off(model: nn.Module) -> Iterator[None]:
    """Within the block, every cache setting of the model's configs is False; restored on exit."""
    changed = []
    for config in configs_of(model):
        for key in CACHE_SETTINGS:
            if vars(config).get(key) is True:
                changed.append((config, key))
                setattr(config, key, False)
    try:
        yield
    finally:
        for config, key in reversed(changed):
            setattr(config, key, True)
