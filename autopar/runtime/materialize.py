"""Build a meta-device model's weights one module at a time, so no rank ever holds the whole model.

`stream_tensors(model, init_fn)` visits modules in `model.apply` order (children before parents),
gives each module real storage for its own parameters and buffers, runs `init_fn(module)` and yields
every tensor once its last owner (tied weights have several) has been initialised; the caller keeps
only its shard and the full tensor is freed. With the same seed, the values equal those of
`model.to_empty(...); model.apply(init_fn)` on one device, because the random draws happen in the same
order. `init_fn` must touch only the module's own (non-recursive) tensors.
"""
from __future__ import annotations

import contextlib
import warnings
import zlib
from typing import Callable, Iterator

import torch
import torch.nn as nn


def default_init(module: nn.Module) -> None:
    """torch.nn layers' own `reset_parameters` (Linear, Embedding, LayerNorm, ...); others untouched."""
    if type(module).__module__.startswith("torch.nn") and hasattr(module, "reset_parameters"):
        module.reset_parameters()


def default_init_for(model: nn.Module) -> Callable[[nn.Module], None]:
    """The init a meta-built `model` gets when the caller names none: inside a transformers model
    (found at any depth, e.g. in the user's wrapper), that model's own `_init_weights`, which also
    sets what its constructor computed (rotary `inv_freq`, norm weights of ones); elsewhere
    `default_init`."""
    owner: dict[int, Callable] = {}
    for mod in model.modules():   # outer first: an inner transformers model overrides its container
        init = getattr(mod, "_init_weights", None)
        if callable(init) and hasattr(mod, "config") and hasattr(mod, "post_init"):
            owner.update({id(m): init for m in mod.modules()})
    return lambda module: owner.get(id(module), default_init)(module)


def is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters())


def model_tensors(model: nn.Module, wanted: list[str], init_fn: Callable | None = None, device="cpu",
                  seed: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full value) for each name of `wanted` (one name per tensor): a meta-device model's built
    module by module (`stream_tensors`, in its order, only the modules that own a wanted tensor, each
    drawing from its own `seed`-derived generator state), a real model's own, in `wanted`'s order."""
    if is_meta(model):
        for names, tensor in stream_tensors(model, init_fn, device=device, only=set(wanted), seed=seed):
            for name in [n for n in names if n in wanted][:1]:   # the wanted name of a tied tensor
                yield name, tensor
        return
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name in wanted:
        yield name, tensors[name].detach()


def _post_order(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in model.named_children():
        yield from _post_order(child, f"{prefix}{name}.")
    yield prefix, model


def stream_tensors(model: nn.Module, init_fn: Callable | None = None, device="cpu", only: set[str] | None = None,
                   seed: int | None = None) -> Iterator[tuple[list[str], torch.Tensor]]:
    """Yield (names, tensor) for each distinct parameter/buffer: all FQNs that share it, and its value.

    `only`: FQNs wanted; a module none of whose own tensors is wanted (under any of its names) is
    neither given storage nor initialised, and its tensors are not yielded (a pipeline rank builds its
    stage's modules only). `seed`: each module's init draws from the generator seeded with `seed` and
    the module's path (`module_seed`), so a module's values do not depend on which other modules this
    process builds (ranks that build different subsets, and share a tied tensor, agree on it)."""
    init_fn = init_fn or default_init_for(model)
    unset: list[str] = []
    order = list(_post_order(model))
    owners: dict[int, list[tuple[int, str, nn.Module, str, bool]]] = {}
    for k, (prefix, mod) in enumerate(order):
        for kind, table in ((True, mod._parameters), (False, mod._buffers)):
            for name, t in table.items():
                if t is not None:
                    owners.setdefault(id(t), []).append((k, prefix + name, mod, name, kind))
    last = {key: max(o[0] for o in refs) for key, refs in owners.items()}
    wanted = {key for key, refs in owners.items() if only is None or any(o[1] in only for o in refs)}
    real: dict[int, torch.Tensor] = {}
    originals = {}
    for k, (prefix, mod) in enumerate(order):
        own = [id(t) for table in (mod._parameters, mod._buffers) for t in table.values() if t is not None]
        if own and not any(key in wanted for key in own):
            continue   # none of its tensors is wanted: no storage, no init
        for kind, table in ((True, mod._parameters), (False, mod._buffers)):
            for name, t in list(table.items()):
                if t is None:
                    continue
                key = id(originals.get((id(mod), name), t))
                originals[(id(mod), name)] = t
                if key not in real:
                    real[key] = _unset_marker(torch.empty(t.shape, dtype=t.dtype, device=device))
                table[name] = nn.Parameter(real[key], requires_grad=t.requires_grad) if kind else real[key]
        with torch.no_grad(), _module_rng(seed, prefix, device):
            init_fn(mod)
        for kind, table in ((True, mod._parameters), (False, mod._buffers)):
            for name in list(table):
                if (id(mod), name) in originals:
                    table[name] = originals[(id(mod), name)]  # back to meta: the real copy is the caller's
        for key in [key for key, k_last in last.items() if k_last == k and key in real]:
            names, tensor = [o[1] for o in owners[key]], real.pop(key)
            if _left_unset(tensor):
                unset.append(names[0])
            yield names, tensor
    if unset:
        warnings.warn(f"materialising the meta-device model left {len(unset)} tensors uninitialised ("
                      f"{', '.join(unset[:5])}{', ...' if len(unset) > 5 else ''}): they hold NaN (or the dtype's "
                      "least value) until loaded; pass autoparallelize(..., init_fn=fn) where fn(module) sets each "
                      "module's own tensors, or load weights (pmodel.load_safetensors / load_state_dict) before "
                      "training", UninitializedTensorWarning, stacklevel=3)


def module_seed(seed: int, prefix: str) -> int:
    """The generator seed of the module at `prefix` ("transformer.h.0.") under base `seed`."""
    return (seed + zlib.crc32(prefix.encode())) % 2 ** 63


@contextlib.contextmanager
def _module_rng(seed: int | None, prefix: str, device):
    """Nothing when `seed` is None (draws continue the process's generator); else the module's own
    seed, the process's generator state restored afterwards."""
    if seed is None:
        yield
        return
    dev = torch.device(device)
    cuda = dict(devices=[dev.index or 0], device_type="cuda") if dev.type == "cuda" else dict(devices=[])
    with torch.random.fork_rng(**cuda):
        torch.manual_seed(module_seed(seed, prefix))
        yield


class UninitializedTensorWarning(UserWarning):
    """A meta-device model's tensor that its init_fn did not set (it holds a marker, not a value)."""


def _unset_marker(t: torch.Tensor) -> torch.Tensor:
    """Fill new storage with a value no init leaves behind: NaN, or the integer dtype's least value."""
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).min) if t.dtype != torch.bool else t.fill_(False)


def _left_unset(t: torch.Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    return t.dtype != torch.bool and bool((t == torch.iinfo(t.dtype).min).any())
