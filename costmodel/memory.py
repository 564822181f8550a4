"""Memory accounting helpers: optimizer state per parameter, parsing/printing byte counts, and the
published activation-memory formulas of a transformer layer.

The planner's memory row adds parameters, gradients, optimizer state and saved activations per
device; this module supplies the optimizer part (bytes of state per parameter element), the
unit handling users see ("80GB" in, "1.23 GB" out), and Korthikanti et al.'s per-layer activation
counts, the reference the planner's saved-tensor accounting is checked against.
"""
from __future__ import annotations

import math
import re

import sympy as sp
import torch

from autopar.errors import InputError

# Optimizer -> number of fp32 state tensors the size of the parameter. Stated in fp32 because
# mixed-precision training keeps optimizer state in fp32 even for bf16/fp16 parameters.
_STATE_TENSORS: dict[str, float] = {
    "adamw": 2,          # exp_avg, exp_avg_sq
    "adam": 2,
    "sgd": 0,            # plain SGD keeps no state
    "sgd_momentum": 1,   # momentum_buffer
    "momentum": 1,
    "lion": 1,           # exp_avg
    "adagrad": 1,        # sum of squares
    "rmsprop": 1,        # square_avg (no momentum, not centered)
    # Adafactor (no momentum) keeps factored second moments: (rows + cols) values per matrix, under
    # 1% of the parameter bytes for matrices wider than ~400. Counted as 0 per element here.
    "adafactor": 0,
}


FUSED_PREFIX = "fused_"   # "fused_adamw": AdamW stepped by pmodel.optimizer on local shards (same state)


def steps_local_shards(optimizer: str | int | float) -> bool:
    """Whether the plan's optimizer name says `pmodel.optimizer(...)` steps it (the `fused_` prefix): the
    cost model then prices its per-tensor work with `HardwareSpec.fused_step_overhead`."""
    return isinstance(optimizer, str) and optimizer.lower().startswith(FUSED_PREFIX)


def optimizer_state_bytes_per_param(optimizer: str | int | float,
                                    param_dtype: torch.dtype = torch.float32,
                                    *, master_weights: bool = False) -> float:
    """Bytes of optimizer state per parameter element.

    `optimizer` is a name from the table above (with or without the `fused_` prefix) or a number of
    bytes per element for a custom optimizer. States are fp32 (fp64 for fp64 parameters). `master_weights=True` adds an fp32
    master copy for parameters stored in a narrower dtype (the ZeRO paper's mixed-precision Adam:
    2 + 2 + 12 bytes per parameter).
    """
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool):
        if not 0 <= optimizer < math.inf:
            raise InputError(f"optimizer state bytes per element must be >= 0, got {optimizer!r}")
        return float(optimizer)
    if steps_local_shards(optimizer):
        optimizer = optimizer[len(FUSED_PREFIX):]
    if not isinstance(optimizer, str) or optimizer.lower() not in _STATE_TENSORS:
        raise InputError(f"unknown optimizer {optimizer!r}: use one of {sorted(_STATE_TENSORS)} "
                         "(a `fused_` prefix: stepped by pmodel.optimizer) or a number of bytes of state per parameter element")
    state_itemsize = max(4, param_dtype.itemsize)
    nbytes = _STATE_TENSORS[optimizer.lower()] * state_itemsize
    if master_weights and param_dtype.itemsize < 4:
        nbytes += 4
    return float(nbytes)


# Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Table 2):
# bytes of activations one GPT layer keeps for backward, per device, with 2-byte activations and
# 1-byte dropout masks; s sequence, b batch, h hidden, a heads, t tensor-parallel ways.
_s, _bb, _h, _a, _t = sp.symbols("s b h a t", positive=True)
LAYER_ACTIVATION_FORMULAS: dict[str, sp.Expr] = {
    "none": _s * _bb * _h * (34 + 5 * _a * _s / _h),
    "tensor": _s * _bb * _h * (10 + 24 / _t + 5 * _a * _s / (_h * _t)),
    "tensor+sequence": _s * _bb * _h * (34 + 5 * _a * _s / _h) / _t,
}


def layer_activation_bytes(seq: int, batch: int, hidden: int, heads: int, tp: int = 1,
                           parallelism: str = "none") -> float:
    """Korthikanti et al.'s activation bytes per transformer layer and device; `parallelism` is
    "none", "tensor" (t = `tp` ways) or "tensor+sequence" (sequence parallelism between the regions)."""
    if parallelism not in LAYER_ACTIVATION_FORMULAS:
        raise InputError(f"unknown parallelism {parallelism!r}; choose one of {sorted(LAYER_ACTIVATION_FORMULAS)}")
    expr = LAYER_ACTIVATION_FORMULAS[parallelism]
    return float(expr.subs({_s: seq, _bb: batch, _h: hidden, _a: heads, _t: tp}))


_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}
_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(x: int | float | str) -> int:
    """A byte count from a number or a string like "80GB" (1e9), "80GiB" (2**30), "1.5TB"."""
    example = 'e.g. 80e9, "80GB" (decimal) or "80GiB" (binary)'
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        if not 0 <= x < math.inf:
            raise InputError(f"a byte count must be a finite number >= 0, got {x!r}; {example}")
        return int(round(x))
    if not isinstance(x, str):
        raise InputError(f"a byte count must be a number or a string, got {type(x).__name__}; "
                         f"{example}")
    match = _BYTES_RE.match(x)
    unit = match.group(2).lower() if match else ""
    if match is None or (unit and unit not in _UNITS):
        raise InputError(f"cannot read {x!r} as a byte count; {example} "
                         "(units: B, kB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB)")
    return int(round(float(match.group(1)) * _UNITS.get(unit, 1)))


def _three_digits(value: float, units: list[tuple[float, str]]) -> str:
    """`value` in the largest unit not exceeding it, with three significant digits."""
    for scale, name in units:
        if abs(value) >= scale or scale == units[-1][0]:
            scaled = value / scale
            decimals = max(0, 2 - int(math.floor(math.log10(abs(scaled))))) if scaled else 0
            return f"{scaled:.{decimals}f} {name}"
    raise AssertionError("unreachable")


def format_bytes(n: float) -> str:
    """Decimal units with three significant digits: 4194304 -> "4.19 MB"."""
    units = [(1e15, "PB"), (1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1.0, "B")]
    if abs(n) < 1000:
        return f"{n:.0f} B"
    return _bump(_three_digits(n, units), units)


def format_seconds(s: float) -> str:
    """Seconds with three significant digits: 0.0123 -> "12.3 ms", 1.2 -> "1.20 s"."""
    units = [(1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns")]
    if s == 0:
        return "0 s"
    if abs(s) >= 1000:
        return f"{s:.0f} s"
    return _bump(_three_digits(s, units), units)


def _bump(text: str, units: list[tuple[float, str]]) -> str:
    """Turn "1000 kB" (rounding carried into the next unit) into "1.00 MB"."""
    number, name = text.split(" ")
    names = [u for _, u in units]
    index = names.index(name)
    if abs(float(number)) >= 1000 and index > 0:
        return f"{float(number) / 1000:.2f} {names[index - 1]}"
    return text
