"""autopar's grouped matmul ops for mixture-of-experts layers: `autopar::grouped_mm` (forward and
grad x) and `autopar::grouped_mm_wgrad` (grad w), with fake kernels and FLOP formulas.

They take the rows of x sorted by expert and `offs`, the cumulative row count per expert, as
transformers' "grouped_mm" experts implementation does. `autopar/capture/moe_rewrite.py` puts them
into the joint graph; `autopar/sharding/rules/moe.py` says how they split.
"""
from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula


@torch.library.custom_op("autopar::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out[rows of group i] = x[rows of group i] @ w[i]; rows past offs[-1] are zero."""
    out = x.new_zeros(x.shape[0], w.shape[2])
    start = 0
    for i, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(x[start:end], w[i], out=out[start:end])
        start = max(start, end)
    return out


@_grouped_mm_op.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("autopar::grouped_mm_wgrad", mutates_args=())
def _grouped_mm_wgrad_op(x: torch.Tensor, g: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Weight gradient of grouped_mm: out[i] = x[rows of i].T @ g[rows of i], shape [E, K, N]."""
    out = x.new_zeros(offs.shape[0], x.shape[1], g.shape[1])
    start = 0
    for i, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(x[start:end].T, g[start:end], out=out[i])
        start = max(start, end)
    return out


@_grouped_mm_wgrad_op.register_fake
def _(x, g, offs):
    return x.new_empty(offs.shape[0], x.shape[1], g.shape[1])


GROUPED_MM = torch.ops.autopar.grouped_mm.default
GROUPED_MM_WGRAD = torch.ops.autopar.grouped_mm_wgrad.default


@register_flop_formula(torch.ops.autopar.grouped_mm)
def _grouped_mm_flops(x_shape, w_shape, offs_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * w_shape[2]


@register_flop_formula(torch.ops.autopar.grouped_mm_wgrad)
def _grouped_mm_wgrad_flops(x_shape, g_shape, offs_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * g_shape[1]
