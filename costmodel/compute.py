"""Compute cost: FLOPs and bytes of one ATen op call, priced by a roofline on a `HardwareSpec`.

FLOPs come from `torch.utils.flop_counter.FlopCounterMode`: the op is re-run on meta tensors of the
same shapes (no data, no device) and the result is cached by the call's signature, because a
transformer repeats the same few shapes in every layer. Ops the counter does not know (elementwise,
reductions, views) count 0 FLOPs: they are memory bound and priced by their bytes. Each priced op
also pays the hardware's `op_overhead` (0 in the presets, measured by `autopar calibrate`). View ops
(aliases: view, permute, expand, ...) move no bytes but are still dispatched calls in the per-rank
graph, so they cost `op_overhead` alone (`view_time`): on a CPU each is a few microseconds of ATen
dispatch, about an add's (5 µs against 6 µs through `torch.ops.aten`, one idle core).

Exp-class pointwise ops (`TRANSCENDENTAL_OPS`: exp, gelu, softmax, tanh, ...) also have a third
bound, E/T: E elements at the hardware's `transcendental_rate` T. On a CPU it binds (gelu is ~10x
slower than its bytes); on a GPU the special-function units outrun memory and M/W still binds.

Fused attention kernels run below matmul speed, the backward more so (CPU: 0.5-0.8 of it): their
F/(η·P) is divided by the hardware's `attention_efficiency` (forward) or
`attention_backward_efficiency` (`flop_efficiency`), both measured by `autopar calibrate`.

`ROOFLINE` is the same formula in sympy, t = max(F/(η·P), M/W, E/T) + o, and `explain_compute`
prints it with its numbers.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import sympy as sp
import torch
from torch.utils.flop_counter import FlopCounterMode

from .hardware import HardwareSpec
from .memory import format_bytes, format_seconds

aten = torch.ops.aten


def _bmm_flops(batch: int, m: int, k: int, n: int) -> int:
    return 2 * batch * m * k * n


def attention_forward_flops(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    """q @ k^T then scores @ v, as torch's own sdpa formula (GQA: k/v heads broadcast to q's)."""
    b, h, s_q, d_q = query_shape
    s_k, d_v = key_shape[2], value_shape[3]
    return _bmm_flops(b * h, s_q, d_q, s_k) + _bmm_flops(b * h, s_q, s_k, d_v)


def attention_backward_flops(grad_out_shape, query_shape, key_shape, value_shape,
                              *args, **kwargs) -> int:
    """Recompute scores, then grad_scores, grad_v, grad_q, grad_k: five batched matmuls."""
    b, h, s_q, d_q = query_shape
    s_k, d_v = key_shape[2], value_shape[3]
    return (_bmm_flops(b * h, s_q, d_q, s_k) + _bmm_flops(b * h, s_q, d_v, s_k)
            + _bmm_flops(b * h, s_k, s_q, d_v) + _bmm_flops(b * h, s_q, s_k, d_q)
            + _bmm_flops(b * h, d_q, s_q, s_k))


# torch's flop counter has no entry for the CPU flash-attention kernels that torch.export emits on
# CPU; give them the same formulas as the GPU attention kernels.
_CUSTOM_FORMULAS: dict[Any, Callable[..., int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: attention_forward_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: attention_backward_flops,
}
ATTENTION_FORWARD_OPS = frozenset(getattr(aten, name) for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"))
ATTENTION_BACKWARD_OPS = frozenset(getattr(aten, name) for name in (
    "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention_backward"))
_COUNTED_OPS = frozenset(
    FlopCounterMode(display=False, custom_mapping=_CUSTOM_FORMULAS).flop_registry)
_FLOP_CACHE: dict[tuple, float] = {}


SYM_F, SYM_M, SYM_P, SYM_ETA, SYM_W, SYM_O, SYM_E, SYM_T = sp.symbols("F M P eta W o E T", nonnegative=True)
ROOFLINE: sp.Expr = sp.Max(SYM_F / (SYM_ETA * SYM_P), SYM_M / SYM_W, SYM_E / SYM_T) + SYM_O

# Pointwise ops whose every element costs an exp, erf, tanh or log: E = elements of the output.
TRANSCENDENTAL_OPS = frozenset(getattr(aten, name) for name in (
    "exp", "exp2", "expm1", "log", "log1p", "log2", "tanh", "tanh_backward", "sigmoid", "sigmoid_backward",
    "gelu", "gelu_backward", "silu", "silu_backward", "erf", "_softmax", "_softmax_backward_data",
    "_log_softmax", "_log_softmax_backward_data", "sin", "cos"))


def op_time(flops: float, nbytes: float, hw: HardwareSpec, dtype: torch.dtype | str,
            elements: float = 0.0, efficiency: float = 1.0, *, overhead: float | None = None,
            bandwidth: float | None = None) -> float:
    """Roofline seconds: the largest of compute time at achievable peak (times `efficiency`, see
    `flop_efficiency`), memory-traffic time and, for `elements` of an exp-class op, their time at
    `transcendental_rate`; plus the per-launch overhead (`ROOFLINE` evaluated in floats); all of it
    times `in_step_scale` (a calibrated profile's ratio of a step's op seconds to the benchmarks'; for a compiled
    program `compiled_in_step_scale` when measured: `HardwareSpec.step_scale`).
    `overhead` and `bandwidth` replace the eager program's `op_overhead` and `mem_bandwidth` (a compiled
    program's kernel: `HardwareSpec.kernel_overhead`, `fused_bandwidth`; `autopar/planning/fusion.py`)."""
    compute = flops / (hw.flops(dtype_name(dtype)) * hw.compute_efficiency * efficiency)
    special = elements / hw.transcendental_rate if hw.transcendental_rate else 0.0
    memory = nbytes / (hw.mem_bandwidth if bandwidth is None else bandwidth)
    return (max(compute, memory, special) + (hw.op_overhead if overhead is None else overhead)) * hw.step_scale


def view_time(hw: HardwareSpec) -> float:
    """Seconds of one view op (an alias: no kernel, no bytes): the dispatch overhead `op_overhead`
    (times `in_step_scale`)."""
    return hw.op_overhead * hw.step_scale


def explain_compute(flops: float, nbytes: float, hw: HardwareSpec,
                    dtype: torch.dtype | str = "float32", elements: float = 0.0,
                    efficiency: float = 1.0) -> str:
    """One line: the roofline formula, its numbers, which side binds, and the seconds.

    e.g. "max(F/(η·P), M/W) + o = max(1.07 GFLOP / (0.6·67.0 TFLOP/s), 12.6 MB / 3.35 TB/s) + 0 s
    = 26.7 µs (compute bound)"; with `elements` of an exp-class op, E/T joins the max; an
    attention kernel's `efficiency` (`flop_efficiency`) shows as a factor of η.
    """
    peak = hw.flops(dtype_name(dtype))
    eta = hw.compute_efficiency * efficiency
    compute, memory = flops / (peak * eta), nbytes / hw.mem_bandwidth
    special = elements / hw.transcendental_rate if elements and hw.transcendental_rate else 0.0
    bound = ("compute bound" if compute >= max(memory, special)
             else "memory bound" if memory >= special else "transcendental bound")
    third = (f", {elements:.3g} / {hw.transcendental_rate:.3g}/s" if special else "")
    formula = f"max(F/(η·P), M/W{', E/T' if special else ''}) + o"
    numbers = (f"max({flops / 1e9:.3g} GFLOP / ({eta:.3g}·{peak / 1e12:.3g} TFLOP/s), {format_bytes(nbytes)} / "
               f"{format_bytes(hw.mem_bandwidth)}/s{third}) + {format_seconds(hw.op_overhead)}")
    if hw.step_scale != 1.0:   # a calibrated profile: the in-step scale s multiplies the whole
        formula, numbers = f"({formula}) × s", f"({numbers}) × {hw.step_scale:.2f}"
    return (f"{formula} = {numbers} = "
            f"{format_seconds(op_time(flops, nbytes, hw, dtype, elements, efficiency))} ({bound})")


def flop_efficiency(target: Any, hw: HardwareSpec) -> float:
    """The fraction of matmul FLOP/s that `target` achieves on `hw`: the attention efficiencies for
    fused attention kernels (forward or backward), 1 for every other op."""
    packet_ = getattr(target, "overloadpacket", None)
    if packet_ in ATTENTION_FORWARD_OPS:
        return hw.attention_efficiency
    if packet_ in ATTENTION_BACKWARD_OPS:
        return hw.attention_backward_efficiency
    return 1.0


def is_transcendental(target: Any) -> bool:
    """True if `target` (an ATen OpOverload) is an exp-class pointwise op (`TRANSCENDENTAL_OPS`)."""
    return getattr(target, "overloadpacket", None) in TRANSCENDENTAL_OPS


def dtype_name(dtype: torch.dtype | str) -> str:
    """"float32" for torch.float32 (and for the string itself), the key of `peak_flops`."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def is_flop_counted(target: Any) -> bool:
    """True if `target` (an ATen OpOverload) has a FLOP formula; other ops are memory bound."""
    return getattr(target, "overloadpacket", None) in _COUNTED_OPS


def node_flops(target: Any, args: tuple, kwargs: dict | None = None, out: Any = None) -> float:
    """FLOPs of one call `target(*args, **kwargs)`; args may be fake, meta or real tensors.

    `out` is accepted so callers can pass a node's output alongside; the count needs only inputs.
    """
    if not is_flop_counted(target):
        return 0.0
    kwargs = kwargs or {}
    key = (target, _signature(args), _signature(kwargs))
    cached = _FLOP_CACHE.get(key)
    if cached is None:
        cached = _FLOP_CACHE[key] = _count_on_meta(target, args, kwargs)
    return cached


def _count_on_meta(target: Any, args: tuple, kwargs: dict) -> float:
    meta_args, meta_kwargs = _to_meta(args), _to_meta(kwargs)
    counter = FlopCounterMode(display=False, custom_mapping=_CUSTOM_FORMULAS)
    try:
        with counter:
            target(*meta_args, **meta_kwargs)
    except (RuntimeError, NotImplementedError, TypeError) as e:
        warnings.warn(f"cannot count FLOPs of {target} on meta tensors ({e}); counting 0",
                      RuntimeWarning, stacklevel=3)
        return 0.0
    return float(counter.get_total_flops())


def node_bytes(args: Any, out: Any) -> float:
    """Bytes read and written: the sizes of every tensor among the inputs and the outputs."""
    tensors = [*_tensors(args), *_tensors(out)]
    return float(sum(t.numel() * t.element_size() for t in tensors))


def _tensors(x: Any):
    """Every tensor inside nested lists, tuples and dicts."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for item in x:
            yield from _tensors(item)
    elif isinstance(x, dict):
        for item in x.values():
            yield from _tensors(item)


def _signature(x: Any) -> Any:
    """A hashable key standing for a call argument: tensors by shape, stride and dtype."""
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(int(s) for s in x.shape), tuple(int(s) for s in x.stride()), x.dtype)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_signature(item) for item in x))
    if isinstance(x, dict):
        return ("dict", tuple(sorted((k, _signature(v)) for k, v in x.items())))
    if isinstance(x, float) and math.isnan(x):
        return ("nan",)
    try:
        hash(x)
    except TypeError:
        return ("repr", repr(x))
    return x


def _to_meta(x: Any) -> Any:
    """The same structure with every tensor replaced by an empty meta tensor of its layout."""
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return (list if isinstance(x, list) else tuple)(_to_meta(item) for item in x)
    if isinstance(x, dict):
        return {k: _to_meta(v) for k, v in x.items()}
    return x
