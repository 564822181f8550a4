"""Helpers both runtimes (SPMD and pipelined) use on DTensor parameters, gradients and inputs."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from autopar.placement import is_strided, local_shape, pieces


def local_slice(x: torch.Tensor, spec, coords, axis_sizes) -> torch.Tensor:
    """This rank's block of a full tensor placed as `spec` (one placement per mesh axis) at `coords`."""
    full = tuple(x.shape)
    loc = local_shape(spec, full, axis_sizes)
    for d in range(len(full)):
        if loc[d] == full[d]:
            continue
        # offset of this rank's block along d: nested chunks in mesh-axis order; a strided shard
        # (placement.SS, alone on its dim) takes that block of each of its k pieces
        k = math.prod(pieces(p) for p in spec if getattr(p, "dim", None) == d and is_strided(p))
        offset, size = 0, full[d] // k
        for axis, p in enumerate(spec):
            if getattr(p, "dim", None) == d and not p.is_partial():
                size //= axis_sizes[axis]
                offset += coords[axis] * size
        x = x.unflatten(d, (k, full[d] // k)).narrow(d + 1, offset, size).flatten(d, d + 1)
    return x


def set_tensor(root: nn.Module, fqn: str, value, *, param: bool, persistent: bool = True) -> None:
    """Register `value` as parameter or buffer `fqn` of `root`, making empty modules on the way
    (`persistent=False`: a buffer left out of the state dict, as the model keeps it)."""
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part) or not isinstance(getattr(mod, part), nn.Module):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if param:
        mod.register_parameter(leaf, value)
    else:
        mod.register_buffer(leaf, value, persistent=persistent)


def owner_of(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    path, _, leaf = fqn.rpartition(".")
    return root.get_submodule(path), leaf


def get_tensor(root: nn.Module, fqn: str):
    """The parameter or buffer `fqn` of `root`."""
    try:
        return root.get_parameter(fqn)
    except AttributeError:
        return root.get_buffer(fqn)


def distinct(grads: list) -> list:
    """Never hand autograd one tensor for two parameters: it may accumulate into p.grad in place."""
    seen: set[int] = set()
    out = []
    for gr in grads:
        if gr is not None and id(gr) in seen:
            gr = gr.clone()
        elif gr is not None:
            seen.add(id(gr))
        out.append(gr)
    return out


def is_unit_seed(g) -> bool:
    """True for the seed of a plain `loss.backward()` (or no seed at all); checked only on the CPU, so
    a device gradient never forces a sync (it is then treated as a general scale)."""
    return g is None or (g.device.type == "cpu" and not g.requires_grad and g.numel() == 1 and g.item() == 1.0)
