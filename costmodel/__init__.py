"""The cost model: hardware presets and seconds/bytes of communication, compute and memory.

One file per part: `hardware` (what a device and its links can do), `comm` (alpha-beta time of
each collective, kept symbolic in sympy), `compute` (FLOPs via torch's flop counter, roofline
time), `memory` (optimizer state, byte parsing and formatting). Importable as `autopar.costmodel`.
"""
from .comm import (
                   FORMULAS,
                   coefficients,
                   collective_bytes_moved,
                   collective_time,
                   explain,
                   formula,
                   hardware_collective_time,
)
from .compute import ROOFLINE, explain_compute, node_bytes, node_flops, op_time
from .hardware import PRESETS, HardwareSpec, LinkSpec, get_hardware, load_hardware
from .memory import format_bytes, format_seconds, optimizer_state_bytes_per_param, parse_bytes

__all__ = [
    "FORMULAS", "coefficients", "ROOFLINE", "explain_compute", "collective_bytes_moved", "collective_time", "explain", "formula",
    "hardware_collective_time", "node_bytes", "node_flops", "op_time", "PRESETS", "HardwareSpec",
    "LinkSpec", "get_hardware", "load_hardware", "format_bytes", "format_seconds",
    "optimizer_state_bytes_per_param", "parse_bytes",
]
