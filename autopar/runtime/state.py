"""The unmodified model's state dict on a parallelized module: same keys, each rank its own shards.

A parallelized module registers its DTensors under the model's names, and also (`install`)
every tied alias (`lm_head.weight` tied to the input embedding) as the same Parameter, and buffers
the model keeps out of its state dict (`persistent=False`, e.g. rotary tables) as non-persistent.
So `pmodel.state_dict()` has exactly `model.state_dict()`'s keys, and torch's own strict key
checking reports missing and unexpected keys as it would for the model.

`load_state_dict` also takes the unmodified model's plain tensors (a pretrained full state dict):
the pre-hook below replaces each by this rank's block of it as a DTensor in the parameter's
placements (no communication), which nn.Module's copy then writes into the local shard. A pipelined
rank holds only its stages' tensors: the keys other stages hold are dropped, not "unexpected".
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from autopar.runtime.tensors import get_tensor, local_slice, set_tensor


@dataclass(frozen=True)
class StateEntry:
    """One distinct tensor of the model's state dict: its keys (the first is the one the parallelized
    module places; the others are tied aliases of it), global shape and dtype."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_param: bool

    @property
    def name(self) -> str:
        return self.names[0]


def state_entries(model: nn.Module, placed) -> list[StateEntry]:
    """The distinct tensors of `model.state_dict()` in its order (a meta-device model too), each with
    the name in `placed` (the names the capture kept) first. Entries that are no parameter or buffer
    (`get_extra_state`) are not placed by autopar and are left out."""
    placed = set(placed)
    params = dict(model.named_parameters(remove_duplicate=False))
    tensors = {**params, **dict(model.named_buffers(remove_duplicate=False))}
    groups: dict[int, list[str]] = {}
    for key in model.state_dict(keep_vars=True):
        if key in tensors:
            groups.setdefault(id(tensors[key]), []).append(key)
    out = []
    for names in groups.values():
        names.sort(key=lambda n: n not in placed)   # stable: the placed name first, the others in order
        t = tensors[names[0]]
        out.append(StateEntry(tuple(names), tuple(t.shape), t.dtype, names[0] in params))
    return out


def install(module: nn.Module, entries: list[StateEntry]) -> None:
    """Give a parallelized `module` holding (some of) the model's tensors the model's state-dict keys: each
    tied alias registered as the same tensor, as the model ties them, and the load hooks below (the keys
    of tensors it does not hold, another pipeline stage's, dropped on load)."""
    for entry in entries:
        if len(entry.names) > 1 and holds(module, entry.name):
            value = get_tensor(module, entry.name)
            for alias in entry.names[1:]:
                set_tensor(module, alias, value, param=entry.is_param)
    module.register_load_state_dict_pre_hook(plain_to_shards_hook)
    elsewhere = frozenset(n for e in entries if not holds(module, e.name) for n in e.names)
    if elsewhere:
        module.register_load_state_dict_pre_hook(partial(drop_keys_hook, elsewhere))


def holds(module: nn.Module, name: str) -> bool:
    """Whether `module` has parameter or buffer `name` (a pipeline rank holds only its stages')."""
    try:
        get_tensor(module, name)
    except AttributeError:
        return False
    return True


def shard_of(full: torch.Tensor, like: DTensor) -> DTensor:
    """This rank's block of the plain global tensor `full`, as a DTensor placed as `like` (no communication)."""
    mesh = like.device_mesh
    local = local_slice(full, like.placements, tuple(mesh.get_coordinate()), tuple(mesh.shape))
    return DTensor.from_local(local.contiguous(), mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def plain_to_shards_hook(module, state: dict, prefix: str, *args) -> None:
    """nn.Module load pre-hook: a plain tensor of a DTensor's global shape becomes this rank's shard of it
    (a tensor of another shape is left for torch to report as a size mismatch)."""
    own = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, like in own:
        key = prefix + name
        like = like.data if isinstance(like, nn.Parameter) else like
        value = state.get(key)
        if (isinstance(like, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
                and value.shape == like.shape):
            state[key] = shard_of(value, like)


def drop_keys_hook(keys: frozenset, module, state: dict, prefix: str, *args) -> None:
    """nn.Module load pre-hook: remove `keys` (the model's keys that other pipeline stages hold)."""
    for key in keys:
        state.pop(prefix + key, None)


def full_tensors(module: nn.Module, entries: list[StateEntry]) -> dict[str, torch.Tensor]:
    """{key: unsharded tensor} of the entries `module` holds, tied keys sharing one tensor (a collective
    over each tensor's mesh: every rank of it takes part, in the same order)."""
    out = {}
    for entry in entries:
        if holds(module, entry.name):
            t = get_tensor(module, entry.name)
            full = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
            out.update(dict.fromkeys(entry.names, full))
    return out
