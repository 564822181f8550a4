"""Checkpoint layouts: strided shards saved as plain shards, so `torch.distributed.checkpoint` can save them.

A parameter split by strided columns (a fused [q; k; v] projection, `autopar/sharding/rules/strided.py`) is a
DTensor with `_StridedShard`: rank r holds [q_r; k_r; v_r], which is not one contiguous block of the
global tensor, so DCP cannot describe it as a chunk (its save fails with "overlapping chunks"). In a
state dict such a tensor (parameter or optimizer state) is therefore handed out as the same global
tensor with a plain `Shard` on that dim (one all-gather and a local slice per strided tensor), and
turned back into its strided layout on load. The global shapes and values are the model's own, so a
checkpoint stays loadable under any other plan or world size.

`ParallelModule.state_dict()` / `load_state_dict()` do this by themselves (module hooks);
`optimizer_state_dict(pmodel, opt)` / `load_optimizer_state_dict(pmodel, opt, state)` wrap
torch's `get_optimizer_state_dict` / `set_optimizer_state_dict` the same way.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from autopar.placement import is_strided


def _has_strided(t) -> bool:
    return isinstance(t, DTensor) and any(is_strided(p) for p in t.placements)


def unstrided(t):
    """A strided DTensor as the same global tensor with plain shards; anything else unchanged."""
    if not _has_strided(t):
        return t
    mesh = t.device_mesh
    full = t.redistribute(mesh, [Replicate() if is_strided(p) else p for p in t.placements])
    return full.redistribute(mesh, [Shard(p.dim) if is_strided(p) else p for p in t.placements])


def restrided(value, like):
    """`value` in the layout of `like` where `like` is strided (the inverse of `unstrided`)."""
    if not _has_strided(like) or not isinstance(value, DTensor) or value.placements == like.placements:
        return value
    mesh = like.device_mesh
    full = value.redistribute(mesh, [Replicate() if is_strided(p) else p for p in like.placements])
    return full.redistribute(mesh, list(like.placements))


def _map(state, fn):
    if isinstance(state, dict):
        return {k: _map(v, fn) for k, v in state.items()}
    if isinstance(state, list):
        return [_map(v, fn) for v in state]
    return fn(state)


def _zip_map(state, like, fn):
    """fn(value, like_value) over two state trees of the same keys (values without a twin unchanged)."""
    if isinstance(state, dict) and isinstance(like, dict):
        return {k: _zip_map(v, like.get(k), fn) for k, v in state.items()}
    if isinstance(state, list) and isinstance(like, list) and len(state) == len(like):
        return [_zip_map(v, w, fn) for v, w in zip(state, like)]
    return fn(state, like)


def state_dict_post_hook(module, state: dict, prefix: str, local_metadata) -> None:
    """nn.Module state-dict hook: strided entries replaced by their plain-shard form (in place)."""
    for key, value in list(state.items()):
        if key.startswith(prefix) and _has_strided(value):
            state[key] = unstrided(value)


def load_state_dict_pre_hook(module, state: dict, prefix: str, *args) -> None:
    """nn.Module load hook: plain-shard entries of strided parameters turned back into their layout."""
    own = {prefix + name: t for name, t in module.named_parameters(remove_duplicate=False)}  # tied keys too
    for key, like in own.items():
        if key in state and _has_strided(like.data if isinstance(like, torch.nn.Parameter) else like):
            state[key] = restrided(state[key], like.data)


def register_hooks(module: torch.nn.Module) -> None:
    """Install the two hooks above on a parallelized module."""
    module.register_state_dict_post_hook(state_dict_post_hook)
    module.register_load_state_dict_pre_hook(load_state_dict_pre_hook)


def optimizer_state_dict(pmodel, opt) -> dict:
    """torch's `get_optimizer_state_dict`, with strided optimizer states in plain-shard form (DCP-savable)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    return _map(get_optimizer_state_dict(pmodel, opt), unstrided)


def load_optimizer_state_dict(pmodel, opt, state: dict) -> None:
    """torch's `set_optimizer_state_dict` from a state made by `optimizer_state_dict` (any plan's)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    like = get_optimizer_state_dict(pmodel, opt)
    set_optimizer_state_dict(pmodel, opt, _zip_map(state, like, restrided))
