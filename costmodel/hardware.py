"""Hardware specs: what one device can compute, store and send, as plain numbers in SI units.

A `HardwareSpec` is the only thing the cost model knows about a machine. The presets below are
taken from public datasheets (cited next to each figure); a calibrated profile measured on a real
cluster is the same dataclass stored as JSON (`HardwareSpec.to_json()` / `get_hardware(path)`).
Units: FLOP/s, bytes, bytes/s, seconds.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autopar.errors import HardwareError

LINK_KINDS = ("intra", "inter")
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


@dataclass(frozen=True)
class LinkSpec:
    """One interconnect as alpha-beta: a message of B bytes over one hop costs alpha + B / beta."""

    bandwidth: float  # bytes/s per device, unidirectional bus bandwidth seen by ring collectives
    latency: float    # seconds per message hop (alpha)

    def __post_init__(self) -> None:
        _check_positive("bandwidth", self.bandwidth)
        _check_non_negative("latency", self.latency)
        # floats, so that equal specs print (and fingerprint) the same whether given 8 or 8.0
        object.__setattr__(self, "bandwidth", float(self.bandwidth))
        object.__setattr__(self, "latency", float(self.latency))


@dataclass(frozen=True)
class HardwareSpec:
    """One device type and the links between devices.

    `devices_per_node` None means "any mesh fits in one node" (the CPU preset: every gloo process
    runs on this one machine). `collectives` holds fitted per-collective links from calibration,
    `{"intra": {"all_reduce": LinkSpec, ...}, "inter": {...}}`; presets leave it empty.
    `op_overhead` is the fixed cost of one kernel launch (eager dispatch on CPU, launch on GPU),
    measured by `autopar calibrate`; it matters for small models where ops are microseconds. The GPU
    presets leave it 0: launches are asynchronous and hide behind any kernel longer than a launch.
    `param_step_overhead` is the fixed cost a training step pays per parameter tensor beyond its
    memory traffic: `zero_grad`, `to_local()`, the gradient's DTensor wrapping and torch.optim's
    per-tensor (or per-list) ops on a DTensor parameter, measured by `autopar calibrate` with
    AdamW. The GPU presets take
    10 µs (AdamW's default `foreach` path issues a few kernels per chunk of tensors; DTensor's
    sharding propagation costs CPU microseconds per tensor).
    `transcendental_rate` is how many elements per second exp-class pointwise ops (exp, gelu,
    softmax, tanh, ...) compute: on a CPU they are compute bound, several times slower than their
    bytes. 0 means unmeasured (priced by bytes alone). The GPU presets take their special-function
    units' throughput, far above what memory feeds, so bytes still bind there.
    `attention_efficiency` and `attention_backward_efficiency` are the achieved FLOP/s of the fused
    attention kernels (forward; backward) as a fraction of a large matmul's (η·P), counting FLOPs by
    `costmodel.compute`'s formulas: on a CPU the backward runs well below matmul speed. 1 prices
    attention as a matmul. `autopar calibrate` measures both; the GPU presets' are estimates.
    `sync_latency` is what a blocking collective adds when the ranks reach it from compute rather
    than in lockstep, as in a training step (once per collective, not per hop): on a CPU with gloo,
    ~1 ms of waking the communication threads of ranks that were busy computing; the alpha-beta
    fits are timed back to back and do not see it. Measured by `autopar calibrate`; presets 0.
    `fused_step_overhead` is `param_step_overhead` when `pmodel.optimizer(...)` steps the local shards
    with torch's fused kernel (`autopar/runtime/optim.py`): zero_grad and the gradient's wrapping stay,
    the DTensor dispatch of the step goes. Plans made with `optimizer="fused_adamw"` (any name with the
    `fused_` prefix) price it (`step_overhead`); 0 means unmeasured (the presets): then
    `param_step_overhead` prices it too.
    `compiled_op_overhead` and `compiled_mem_bandwidth` are what a kernel of an Inductor-compiled per-rank
    program (`autoparallelize(compile=True)`: a fused pointwise/reduction kernel or an extern call such as a
    matmul) costs beyond its roofline, and the bytes/s a fused kernel streams its inputs and outputs at,
    measured by `autopar calibrate` (`autopar/calibration/compiled.py`); 0 means unmeasured (the presets):
    `op_overhead` and `mem_bandwidth` price them.
    `compiled` says which program the planner prices: False the eager FX program (one dispatched ATen call
    per node), True the compiled one (views free, memory-bound chains fused into one pass over their inputs
    and outputs, `autopar/planning/fusion.py`). It is a pricing choice, not a figure of the device:
    `autopar.plan(..., compile=True)` and `autoparallelize(compile=True)` set it (`for_program`).
    `in_step_scale` is how much longer a training step's ops take than the isolated benchmarks price
    them: in a step, operands come cold from the ops before and the other ranks share the caches and
    memory. `autopar calibrate` runs a reference training graph as a step runs it, on every rank at
    once, and divides its measured seconds by the seconds the fitted rates give it; every op's time
    (`costmodel.compute.op_time`, `view_time`; a compiled program's kernels too: the same operands
    come cold) is multiplied by it. Presets 1. `compiled_in_step_scale` is the same for the reference
    graph run compiled by Inductor and priced as compiled (on a CPU Inductor's C++ kernels for some ops,
    gelu's backward, transposed copies, run slower than ATen's, which bytes and launches do not show); it
    multiplies a compiled program's ops (`step_scale`); 0 (unmeasured) takes `in_step_scale`.
    `runtime_overhead` is what a training step costs beyond its priced ops, collectives and optimizer
    updates: the runtime's own per-step work around each rank's program (its inputs cut or gathered,
    gradients handed to `p.grad`, the loss returned) and, on a CPU, the collectives' threads taking
    cores from the ops. `autopar calibrate` measures it as the reference model's whole training step,
    run by the runtime on the job's ranks, less that step's priced seconds; every plan's step pays it
    once (`planning.assemble.totals`, the pipeline schedules' step). Presets 0.
    """

    name: str
    peak_flops: dict[str, float]      # dtype name -> dense FLOP/s
    mem_bandwidth: float              # bytes/s of device memory
    mem_capacity: float               # bytes of device memory
    intra_node: LinkSpec
    inter_node: LinkSpec
    devices_per_node: int | None
    compute_efficiency: float = 0.6   # achievable fraction of peak FLOP/s for large matmuls
    collectives: dict[str, dict[str, LinkSpec]] = field(default_factory=dict)
    op_overhead: float = 0.0          # seconds each kernel launch adds (calibrated; presets: 0)
    param_step_overhead: float = 0.0  # seconds a step adds per (DTensor) parameter tensor
    transcendental_rate: float = 0.0  # elements/s of exp-class pointwise ops (0: bytes alone)
    attention_efficiency: float = 1.0           # attention forward FLOP/s / matmul FLOP/s
    attention_backward_efficiency: float = 1.0  # attention backward FLOP/s / matmul FLOP/s
    sync_latency: float = 0.0         # seconds a blocking collective adds after compute (calibrated)
    fused_step_overhead: float = 0.0  # param_step_overhead under pmodel.optimizer (0: unmeasured)
    compiled_op_overhead: float = 0.0    # seconds per kernel of a compiled program (0: unmeasured)
    compiled_mem_bandwidth: float = 0.0  # bytes/s of a fused kernel's one pass (0: unmeasured)
    in_step_scale: float = 1.0        # a step's op seconds / the isolated benchmarks' (calibrated; presets 1)
    compiled_in_step_scale: float = 0.0   # the same for the compiled program (0: unmeasured, in_step_scale)
    runtime_overhead: float = 0.0     # seconds a step pays once beyond its priced work (calibrated; presets 0)
    compiled: bool = False            # price the compiled program (True) or the eager FX one

    def __post_init__(self) -> None:
        _validate(self)
        # Copy the dicts so a caller's later mutation cannot change a frozen spec; numbers become
        # floats so that equal specs fingerprint the same.
        object.__setattr__(self, "peak_flops", {k: float(v) for k, v in self.peak_flops.items()})
        for name in ("mem_bandwidth", "mem_capacity", "compute_efficiency", "op_overhead",
                     "param_step_overhead", "transcendental_rate", "attention_efficiency",
                     "attention_backward_efficiency", "sync_latency", "fused_step_overhead",
                     "compiled_op_overhead", "compiled_mem_bandwidth", "in_step_scale",
                     "compiled_in_step_scale", "runtime_overhead"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "collectives", {k: dict(v) for k, v in self.collectives.items()})

    def __hash__(self) -> int:
        return hash(self.fingerprint())  # the dict fields make the generated hash impossible

    def link(self, link_kind: str, collective: str | None = None) -> LinkSpec:
        """The link for `link_kind` ("intra"/"inter"), or its calibrated fit for `collective`."""
        if link_kind not in LINK_KINDS:
            raise ValueError(f"link kind must be one of {LINK_KINDS}, got {link_kind!r}")
        fitted = self.collectives.get(link_kind, {}).get(collective) if collective else None
        if fitted is not None:
            return fitted
        return self.intra_node if link_kind == "intra" else self.inter_node

    def step_overhead(self, fused: bool) -> float:
        """Seconds a step adds per parameter tensor: under pmodel.optimizer (`fused`) when measured."""
        return self.fused_step_overhead if fused and self.fused_step_overhead > 0 else self.param_step_overhead

    def for_program(self, compiled: bool) -> "HardwareSpec":
        """This spec pricing the compiled per-rank program (`compiled=True`) or the eager one."""
        return self if self.compiled == compiled else replace(self, compiled=compiled)

    @property
    def kernel_overhead(self) -> float:
        """Seconds one kernel of the priced program adds: `compiled_op_overhead` for a compiled program
        (when measured), else the eager dispatch `op_overhead`."""
        if self.compiled and self.compiled_op_overhead > 0:
            return self.compiled_op_overhead
        return self.op_overhead

    @property
    def step_scale(self) -> float:
        """What multiplies every op's priced seconds (`costmodel.compute.op_time`): `in_step_scale`, or
        `compiled_in_step_scale` for a compiled program when measured."""
        if self.compiled and self.compiled_in_step_scale > 0:
            return self.compiled_in_step_scale
        return self.in_step_scale

    @property
    def fused_bandwidth(self) -> float:
        """Bytes/s of a compiled program's fused kernel (`compiled_mem_bandwidth` when measured)."""
        return self.compiled_mem_bandwidth if self.compiled_mem_bandwidth > 0 else self.mem_bandwidth

    def flops(self, dtype_name: str) -> float:
        """Peak dense FLOP/s for a dtype name; dtypes without an entry use float32's peak."""
        return self.peak_flops.get(dtype_name, self.peak_flops["float32"])

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; `HardwareSpec.from_json` reads it back (also from a JSON string).

        The optional figures (`_OPTIONAL`: overheads, rates, attention efficiencies) are written only
        when they differ from their defaults, so profiles written before they existed keep their
        fingerprints."""
        data = {
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "mem_bandwidth": self.mem_bandwidth,
            "mem_capacity": self.mem_capacity,
            "intra_node": _link_to_json(self.intra_node),
            "inter_node": _link_to_json(self.inter_node),
            "devices_per_node": self.devices_per_node,
            "compute_efficiency": self.compute_efficiency,
            "collectives": {lk: {c: _link_to_json(l) for c, l in d.items()}
                            for lk, d in self.collectives.items()},
        }
        for name, default in _OPTIONAL.items():
            if getattr(self, name) != default:
                data[name] = getattr(self, name)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any] | str) -> "HardwareSpec":
        """Parse and validate a profile (dict or JSON text); bad fields raise `HardwareError`."""
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as e:
                raise HardwareError(f"hardware profile is not valid JSON ({e}); "
                                    "write it with HardwareSpec.to_json()") from e
        return _spec_from_dict(data)

    def save(self, path: str | os.PathLike) -> None:
        """Write the profile as JSON so `get_hardware(path)` can load it."""
        Path(path).write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")

    def fingerprint(self) -> str:
        """A stable short hash of every figure, for plan caches and mismatch checks."""
        cached = self.__dict__.get("_fingerprint")
        if cached is None:
            text = json.dumps(self.to_json(), sort_keys=True)
            cached = hashlib.sha256(text.encode()).hexdigest()[:16]
            object.__setattr__(self, "_fingerprint", cached)  # a cache, not a field
        return cached


# --- validation and parsing -----------------------------------------------------------------------

_FIELDS = ("name", "peak_flops", "mem_bandwidth", "mem_capacity", "intra_node", "inter_node",
           "devices_per_node", "compute_efficiency", "collectives", "op_overhead", "param_step_overhead",
           "transcendental_rate", "attention_efficiency", "attention_backward_efficiency", "sync_latency",
           "fused_step_overhead", "compiled_op_overhead", "compiled_mem_bandwidth", "compiled", "in_step_scale",
           "compiled_in_step_scale", "runtime_overhead")
_REQUIRED = _FIELDS[:7]
_OPTIONAL = {"op_overhead": 0.0, "param_step_overhead": 0.0, "transcendental_rate": 0.0,   # default when absent
             "attention_efficiency": 1.0, "attention_backward_efficiency": 1.0, "sync_latency": 0.0,
             "fused_step_overhead": 0.0, "compiled_op_overhead": 0.0, "compiled_mem_bandwidth": 0.0,
             "compiled": False, "in_step_scale": 1.0, "compiled_in_step_scale": 0.0, "runtime_overhead": 0.0}
_FIX = "fix the field or regenerate the profile with HardwareSpec.save()"


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_positive(name: str, x: Any) -> None:
    if not _is_number(x) or not x > 0 or x == float("inf"):
        raise HardwareError(f"field {name!r} must be a positive finite number, got {x!r}; {_FIX}")


def _check_non_negative(name: str, x: Any) -> None:
    if not _is_number(x) or not 0 <= x < float("inf"):
        raise HardwareError(f"field {name!r} must be a number >= 0, got {x!r}; {_FIX}")


def _validate(spec: HardwareSpec) -> None:
    """Check types and ranges of every field; raises `HardwareError` naming the bad field."""
    if not isinstance(spec.name, str) or not spec.name:
        raise HardwareError(f"field 'name' must be a non-empty string, got {spec.name!r}; {_FIX}")
    if not isinstance(spec.peak_flops, dict) or "float32" not in spec.peak_flops:
        raise HardwareError(f"field 'peak_flops' must map dtype names to FLOP/s and include "
                            f"'float32', got {spec.peak_flops!r}; {_FIX}")
    for dtype, value in spec.peak_flops.items():
        _check_positive(f"peak_flops.{dtype}", value)
    _check_positive("mem_bandwidth", spec.mem_bandwidth)
    _check_positive("mem_capacity", spec.mem_capacity)
    for name in ("intra_node", "inter_node"):
        if not isinstance(getattr(spec, name), LinkSpec):
            raise HardwareError(f"field {name!r} must be a LinkSpec; {_FIX}")
    dpn = spec.devices_per_node
    if dpn is not None and (not isinstance(dpn, int) or isinstance(dpn, bool) or dpn < 1):
        raise HardwareError(f"field 'devices_per_node' must be a positive int or null, "
                            f"got {dpn!r}; {_FIX}")
    if not _is_number(spec.compute_efficiency) or not 0 < spec.compute_efficiency <= 1:
        raise HardwareError(f"field 'compute_efficiency' must be in (0, 1], "
                            f"got {spec.compute_efficiency!r}; {_FIX}")
    _check_non_negative("op_overhead", spec.op_overhead)
    _check_non_negative("param_step_overhead", spec.param_step_overhead)
    _check_non_negative("transcendental_rate", spec.transcendental_rate)
    _check_non_negative("sync_latency", spec.sync_latency)
    _check_non_negative("fused_step_overhead", spec.fused_step_overhead)
    _check_non_negative("compiled_op_overhead", spec.compiled_op_overhead)
    _check_non_negative("compiled_mem_bandwidth", spec.compiled_mem_bandwidth)
    if not isinstance(spec.compiled, bool):
        raise HardwareError(f"field 'compiled' must be true or false, got {spec.compiled!r}; {_FIX}")
    _check_positive("attention_efficiency", spec.attention_efficiency)
    _check_positive("attention_backward_efficiency", spec.attention_backward_efficiency)
    _check_positive("in_step_scale", spec.in_step_scale)
    _check_non_negative("compiled_in_step_scale", spec.compiled_in_step_scale)
    _check_non_negative("runtime_overhead", spec.runtime_overhead)
    if not isinstance(spec.collectives, dict) or not set(spec.collectives) <= set(LINK_KINDS):
        raise HardwareError(f"field 'collectives' must map {LINK_KINDS} to collective fits; {_FIX}")
    for link_kind, fits in spec.collectives.items():
        if (not isinstance(fits, dict) or not set(fits) <= set(COLLECTIVE_KINDS)
                or not all(isinstance(v, LinkSpec) for v in fits.values())):
            raise HardwareError(f"field 'collectives.{link_kind}' must map collective kinds "
                                f"{COLLECTIVE_KINDS} to LinkSpecs, got {fits!r}; {_FIX}")


def _link_to_json(link: LinkSpec) -> dict[str, float]:
    return {"bandwidth": link.bandwidth, "latency": link.latency}


def _link_from_json(name: str, data: Any) -> LinkSpec:
    if not isinstance(data, dict) or set(data) != {"bandwidth", "latency"}:
        raise HardwareError(f"field {name!r} must be an object with exactly 'bandwidth' (bytes/s) "
                            f"and 'latency' (s), got {data!r}; {_FIX}")
    try:
        return LinkSpec(bandwidth=data["bandwidth"], latency=data["latency"])
    except HardwareError as e:
        raise HardwareError(f"in field {name!r}: {e}") from e


def _spec_from_dict(data: Any) -> HardwareSpec:
    if not isinstance(data, dict):
        raise HardwareError(f"hardware profile must be a JSON object, got {type(data).__name__}")
    missing = [f for f in _REQUIRED if f not in data]
    if missing:
        raise HardwareError(f"hardware profile lacks field(s) {missing}; {_FIX}")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise HardwareError(f"hardware profile has unknown field(s) {unknown}; "
                            f"valid fields: {list(_FIELDS)}")
    collectives = data.get("collectives", {})
    if not isinstance(collectives, dict) or not all(isinstance(v, dict) for v in collectives.values()):
        raise HardwareError(f"field 'collectives' must be an object of objects; {_FIX}")
    fits = {lk: {c: _link_from_json(f"collectives.{lk}.{c}", l) for c, l in d.items()}
            for lk, d in collectives.items()}
    return HardwareSpec(
        name=data["name"],
        peak_flops=data["peak_flops"],
        mem_bandwidth=data["mem_bandwidth"],
        mem_capacity=data["mem_capacity"],
        intra_node=_link_from_json("intra_node", data["intra_node"]),
        inter_node=_link_from_json("inter_node", data["inter_node"]),
        devices_per_node=data["devices_per_node"],
        compute_efficiency=data.get("compute_efficiency", 0.6),
        collectives=fits,
        **{name: data.get(name, default) for name, default in _OPTIONAL.items()},
    )


# --- presets --------------------------------------------------------------------------------------

# CPU with gloo, measured on this project's 2-core AMD EPYC VM (torch 2.13+cpu), one process per
# core: a 1024^3 fp32 matmul ran at ~47 GFLOP/s on one thread (~125 on two); bf16/fp16 matmuls have
# no fast CPU kernel here (~0.9 GFLOP/s). A 256 MB copy moved ~39 GB/s (read+write), shared by the
# processes. Links: DESIGN.md reports ~0.35 ms and ~1-2 GB/s for 2 gloo processes; a 2-process
# all_reduce here (load ~1.7 from other jobs) took ~0.95 ms for 4 bytes (= 2 hops -> ~0.47 ms
# each) and 78 ms for 64 MiB (~0.86 GB/s). We take 0.45 ms and 0.9 GB/s. Inter-node (gloo over TCP
# between machines) assumes 10 GbE: 1.25 GB/s at best, so the same 0.9 GB/s and ~0.5 ms.
CPU = HardwareSpec(
    name="cpu",
    peak_flops={"float32": 50e9, "bfloat16": 1e9, "float16": 1e9},
    mem_bandwidth=20e9,    # half of the measured 39 GB/s: two processes share it
    mem_capacity=8e9,      # the VM has ~25 GB for all processes and other jobs
    intra_node=LinkSpec(bandwidth=0.9e9, latency=450e-6),
    inter_node=LinkSpec(bandwidth=0.9e9, latency=500e-6),
    devices_per_node=None,
    compute_efficiency=0.8,
    # Per step and DTensor parameter (zero_grad, to_local, gradient wrapping, AdamW's ~10 ops) and
    # exp/tanh/gelu: measured at load 16 (2.7 ms, 200 M elements/s, matmul 16.8 GFLOP/s), scaled by
    # that matmul's slowdown against the idle machine's 47 GFLOP/s.
    param_step_overhead=1e-3,
    transcendental_rate=5e8,
    # causal sdpa (1 x 16 heads x 256 x 64) against 512-2048^3 matmuls, one thread per process, five
    # calibrations at loads 8-17: forward 0.72-0.84, backward 0.46-0.77 (most 0.66-0.77) of the
    # matmul's FLOP/s (FLOPs as costmodel.compute counts them)
    attention_efficiency=0.75,
    attention_backward_efficiency=0.65,
)

# NVIDIA A100 SXM4 80GB. "NVIDIA A100 Tensor Core GPU Datasheet"
# (https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf):
# FP32 19.5 TFLOP/s (TF32 tensor core 156, not used by torch's default fp32 matmul precision),
# BF16/FP16 tensor core 312 TFLOP/s dense, HBM2e 2,039 GB/s, 80 GB, NVLink 600 GB/s total
# (bidirectional) -> 300 GB/s per direction. Inter-node: DGX A100 User Guide, 8x ConnectX-6
# 200 Gb/s HDR InfiniBand, one per GPU -> 25 GB/s. Latencies: NVLink hop ~5 us, IB ~10 us
# (typical NCCL small-message figures).
A100 = HardwareSpec(
    name="a100",
    peak_flops={"float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12},
    mem_bandwidth=2.039e12,
    mem_capacity=80e9,
    intra_node=LinkSpec(bandwidth=300e9, latency=5e-6),
    inter_node=LinkSpec(bandwidth=25e9, latency=10e-6),
    devices_per_node=8,
    compute_efficiency=0.6,
    param_step_overhead=10e-6,   # see HardwareSpec: AdamW's foreach path on DTensors
    transcendental_rate=2.4e12,  # 108 SMs x 16 SFU results/clock x 1.41 GHz (A100 whitepaper)
    # Estimates: H100's figures (measured on an H200, see H100), not measured on an A100.
    attention_efficiency=0.74,
    attention_backward_efficiency=0.59,
)

# NVIDIA H100 SXM5 80GB. "NVIDIA H100 Tensor Core GPU Datasheet"
# (https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet):
# FP32 67 TFLOP/s, BF16/FP16 1,979 TFLOP/s with sparsity -> 989 dense, HBM3 3.35 TB/s, 80 GB,
# NVLink 900 GB/s total -> 450 GB/s per direction. Inter-node: DGX H100 User Guide, 8x ConnectX-7
# 400 Gb/s NDR InfiniBand, one per GPU -> 50 GB/s.
H100 = HardwareSpec(
    name="h100",
    peak_flops={"float32": 67e12, "bfloat16": 989e12, "float16": 989e12},
    mem_bandwidth=3.35e12,
    mem_capacity=80e9,
    intra_node=LinkSpec(bandwidth=450e9, latency=5e-6),
    inter_node=LinkSpec(bandwidth=50e9, latency=10e-6),
    devices_per_node=8,
    compute_efficiency=0.6,
    param_step_overhead=10e-6,   # see HardwareSpec: AdamW's foreach path on DTensors
    transcendental_rate=4.2e12,  # 132 SMs x 16 SFU results/clock x 1.98 GHz (H100 whitepaper)
    # Causal bf16 sdpa (1 x 16 heads x 2048 x 128, autopar calibrate's GPU shape) against an 8192^3
    # bf16 matmul (788 TFLOP/s), measured on an H200 (same tensor cores; an estimate for the H100):
    # forward 0.74, backward 0.59 of the matmul's FLOP/s (0.46 / 0.40 at 64 heads x 1024 x 64).
    attention_efficiency=0.74,
    attention_backward_efficiency=0.59,
)

# NVIDIA H200 SXM 141GB. "NVIDIA H200 Tensor Core GPU" product page / datasheet
# (https://www.nvidia.com/en-us/data-center/h200/): same tensor cores as H100 SXM (FP32 67,
# BF16/FP16 1,979 sparse -> 989 dense TFLOP/s), HBM3e 4.8 TB/s, 141 GB, NVLink 900 GB/s total.
# Inter-node: DGX H200 uses the same 8x ConnectX-7 400 Gb/s as DGX H100 -> 50 GB/s per GPU.
H200 = replace(H100, name="h200", mem_bandwidth=4.8e12, mem_capacity=141e9)

PRESETS: dict[str, HardwareSpec] = {spec.name: spec for spec in (CPU, A100, H100, H200)}


def get_hardware(spec: str | HardwareSpec | os.PathLike) -> HardwareSpec:
    """Resolve a preset name (case-insensitive), a `HardwareSpec`, or a path to a JSON profile."""
    if isinstance(spec, HardwareSpec):
        return spec
    if isinstance(spec, str) and spec.lower() in PRESETS:
        return PRESETS[spec.lower()]
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        if path.is_file():
            return load_hardware(path)
        raise HardwareError(f"unknown hardware {str(spec)!r}: use a preset name "
                            f"({', '.join(PRESETS)}), a HardwareSpec, or a path to a JSON profile")
    raise HardwareError(f"hardware must be a preset name, a HardwareSpec or a path, "
                        f"got {type(spec).__name__}")


def load_hardware(path: str | os.PathLike) -> HardwareSpec:
    """Read a JSON profile written by `HardwareSpec.save`."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise HardwareError(f"cannot read hardware profile {str(path)!r}: {e}") from e
    try:
        return HardwareSpec.from_json(text)
    except HardwareError as e:
        raise HardwareError(f"hardware profile {str(path)!r}: {e}") from e
