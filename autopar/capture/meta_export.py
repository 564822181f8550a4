"""Export a meta-device model as if it lived on the CPU, without allocating it.

A forward turns Python data into tensors on its inputs' device: `x[..., [-2]]` (Falcon's fused qkv),
`torch.tensor(c, device=x.device)`. On the meta device those constants have no values, so a graph
exported there computes with garbage (NaN losses). So for the export, every meta parameter and buffer
is swapped for a fake CPU tensor (a shape and dtype, no storage; tied ones stay one tensor) and the
inputs are fake CPU tensors of the same mode: the constants are real CPU tensors, nothing is allocated,
and the model gets its own tensors back afterwards, also when the export fails. Code that branches on
the device (transformers' MoE routing casts for CPU `histc`) now takes the CPU branch, as a real CPU
capture and the joint retrace (which runs on fake CPU tensors) do.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn

from autopar import _torch_compat as compat


def _fake(t: torch.Tensor, mode: compat.FakeTensorMode) -> torch.Tensor:
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")


@contextlib.contextmanager
def on_fake_cpu(model: nn.Module) -> Iterator[compat.FakeTensorMode]:
    """Within the block, the model's meta parameters and buffers are fake CPU tensors of the mode yielded."""
    mode = compat.FakeTensorMode(allow_non_fake_inputs=True)
    stand_ins: dict[int, torch.Tensor] = {}   # one per tensor: a tied weight stays tied
    swapped = []
    for module in model.modules():
        for is_param, table in ((True, module._parameters), (False, module._buffers)):
            for name, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in stand_ins:
                    fake = _fake(t, mode)
                    stand_ins[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if is_param else fake
                swapped.append((table, name, t))
                table[name] = stand_ins[id(t)]
    try:
        yield mode
    finally:
        for table, name, t in reversed(swapped):
            table[name] = t


def export_meta(wrapper: nn.Module, model: nn.Module, inputs: tuple) -> torch.fx.GraphModule:
    """`compat.export_graph(wrapper, inputs)` for a `model` (held by `wrapper`) with meta tensors."""
    with on_fake_cpu(model) as mode:
        fakes: dict[int, torch.Tensor] = {}   # an input passed twice, (ids, ids), stays one tensor
        return compat.export_graph(wrapper, tuple(fakes.setdefault(id(t), _fake(t, mode)) for t in inputs))
