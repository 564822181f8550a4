"""`autopar calibrate`: measure this cluster's links and devices and write a hardware profile.

Run on every rank under torchrun (gloo on CPU, NCCL on CUDA: the same code, the device follows the
backend). For each mesh axis, every rank times all_reduce, all_gather, reduce_scatter, all_to_all
and send/recv inside its own axis group over a range of message sizes B; a time is the slowest
rank's median. Each (link kind, collective) is then fitted to the alpha-beta formula of
`costmodel.comm`, which is linear in alpha and 1/beta:

    t(n, B) = hops(n)·α + bw(n)·B·(1/β)      (least squares, weighted by 1/t: relative error)

Compute is timed the same way: square matmuls give the achieved FLOP/s (-> `compute_efficiency`
against the base preset's peak), pointwise ops the effective memory bandwidth, a tiny op the
per-launch overhead, and attention its FLOP/s (printed; the cost model prices it as a matmul).
The result is a `HardwareSpec`; `HardwareSpec.save` writes the JSON that `Mesh(hardware=path)` reads.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.costmodel.comm import coefficients
from autopar.costmodel.hardware import COLLECTIVE_KINDS, LINK_KINDS, HardwareSpec, LinkSpec, get_hardware
from autopar.costmodel.memory import format_bytes, format_seconds
from autopar.errors import InputError
from autopar.mesh import Mesh

DEFAULT_SIZES = tuple(4 ** k * 1024 for k in range(9))   # 1 KiB .. 64 MiB
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Sample:
    """One measured collective: `kind` over `n` devices on a `link_kind` link, B bytes, seconds."""

    kind: str
    link_kind: str
    n: int
    nbytes: float
    seconds: float


@dataclass(frozen=True)
class Calibration:
    """What `calibrate` measured and the profile fitted from it."""

    spec: HardwareSpec
    samples: tuple[Sample, ...]
    matmul_flops: float        # achieved FLOP/s of the square matmuls (median)
    attention_flops: float     # achieved FLOP/s of causal attention
    mem_bandwidth: float       # effective bytes/s of pointwise ops (median)
    op_overhead: float         # seconds per tiny op

    def summary(self) -> str:
        """A short table of the fitted links and compute figures."""
        lines = [f"profile {self.spec.name}: matmul {self.matmul_flops / 1e9:.1f} GFLOP/s "
                 f"(efficiency {self.spec.compute_efficiency:.2f} of {self.spec.flops('float32') / 1e9:.0f}),"
                 f" attention {self.attention_flops / 1e9:.1f} GFLOP/s, pointwise "
                 f"{format_bytes(self.mem_bandwidth)}/s, op overhead {format_seconds(self.op_overhead)}"]
        for link_kind, fits in self.spec.collectives.items():
            for kind, link in fits.items():
                lines.append(f"  {link_kind:<6}{kind:<16} alpha {format_seconds(link.latency):>9}  "
                             f"beta {format_bytes(link.bandwidth)}/s")
        return "\n".join(lines)


# --- fitting (pure, tested on synthetic timings) ---------------------------------------------------

def fit_alpha_beta(kind: str, samples: Sequence[tuple[int, float, float]]) -> LinkSpec:
    """Least-squares alpha (s) and beta (bytes/s) of `kind` from (n, B, seconds) samples.

    Relative error is minimised (rows weighted by 1/t), so 1 KiB messages fix alpha as much as
    64 MiB ones fix beta. Both stay physical: a negative alpha is clamped to 0 and refitted."""
    rows = [(*coefficients(kind, n), b, t) for n, b, t in samples if n > 1 and t > 0]
    if len(rows) < 2:
        raise InputError(f"fitting {kind} needs at least 2 timings over n > 1 devices, got {len(rows)}")
    hops = np.array([r[1] for r in rows])
    volume = np.array([r[0] * r[2] for r in rows])   # bw(n)·B
    t = np.array([r[3] for r in rows])
    w = 1.0 / t
    (alpha, inv_beta), *_ = np.linalg.lstsq(np.stack([hops * w, volume * w], 1), t * w, rcond=None)
    if alpha < 0:
        alpha = 0.0
        inv_beta = float(np.sum(volume * w * t * w) / np.sum((volume * w) ** 2))
    if inv_beta <= 0:   # no bandwidth term visible (all messages tiny): latency only
        inv_beta = 1e-15
        alpha = float(np.sum(hops * w * t * w) / np.sum((hops * w) ** 2))
    return LinkSpec(bandwidth=1.0 / float(inv_beta), latency=float(alpha))


def fit_links(samples: Sequence[Sample]) -> dict[str, dict[str, LinkSpec]]:
    """Per link kind and collective kind, the alpha-beta fit of its samples."""
    out: dict[str, dict[str, LinkSpec]] = {}
    for link_kind in LINK_KINDS:
        for kind in COLLECTIVE_KINDS:
            rows = [(s.n, s.nbytes, s.seconds) for s in samples
                    if s.link_kind == link_kind and s.kind == kind]
            if len(rows) >= 2:
                out.setdefault(link_kind, {})[kind] = fit_alpha_beta(kind, rows)
    return out


def build_profile(base: HardwareSpec, samples: Sequence[Sample], *, matmul_flops: float,
                  mem_bandwidth: float, op_overhead: float, devices_per_node: int | None,
                  dtype: str = "float32", name: str | None = None) -> HardwareSpec:
    """The calibrated spec: base's capacity, measured compute, fitted links (base's where unmeasured)."""
    peak = max(base.flops(dtype), matmul_flops)
    fits = fit_links(samples)
    generic = {lk: fits[lk].get("all_reduce") or next(iter(fits[lk].values()))
               for lk in fits}
    return replace(
        base, name=name or f"{base.name}-calibrated",
        peak_flops={**base.peak_flops, dtype: peak}, mem_bandwidth=mem_bandwidth,
        intra_node=generic.get("intra", base.intra_node), inter_node=generic.get("inter", base.inter_node),
        devices_per_node=devices_per_node, compute_efficiency=min(1.0, matmul_flops / peak),
        collectives=fits, op_overhead=op_overhead)


# --- measuring (every rank runs these in the same order) -------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 1) -> float:
    with warnings.catch_warnings():   # torch's deprecation notes on *_into_tensor / *_tensor names
        warnings.simplefilter("ignore", FutureWarning)
        return _median_time_quiet(fn, device, iters, warmup)


def _median_time_quiet(fn, device: torch.device, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _collective_fns(kind: str, nbytes: int, group, pos: int, ranks: list[int], device: torch.device):
    """A no-argument callable running one `kind` of B = nbytes in `group`; None if B is too small."""
    n = len(ranks)
    numel = max(n, (nbytes // 4) // n * n)   # float32, divisible by n
    x = torch.ones(numel, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if kind == "all_gather":
        part = torch.ones(numel // n, device=device)
        return lambda: dist.all_gather_into_tensor(x, part, group=group)
    if kind == "reduce_scatter":
        out = torch.empty(numel // n, device=device)
        return lambda: dist.reduce_scatter_tensor(out, x, group=group)
    if kind == "all_to_all":
        out = torch.empty_like(x)
        return lambda: dist.all_to_all_single(out, x, group=group)
    peer = pos ^ 1   # send_recv: positions 2k and 2k+1 pair up; an odd one out only barriers
    if peer >= n:
        return lambda: None
    if pos % 2 == 0:
        return lambda: dist.send(x, ranks[peer])
    return lambda: dist.recv(x, ranks[peer])


def _axis_groups(mesh_shape: tuple[int, ...]) -> list[tuple[object, list[int]]]:
    """Per axis, this rank's (process group, ranks in axis order); every rank creates every group."""
    rank = dist.get_rank()
    grid = np.arange(math.prod(mesh_shape)).reshape(mesh_shape)
    mine = []
    for axis in range(len(mesh_shape)):
        lines = np.moveaxis(grid, axis, -1).reshape(-1, mesh_shape[axis])
        chosen = None
        for line in lines:
            ranks = [int(r) for r in line]
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                chosen = (group, ranks)
        mine.append(chosen)
    return mine


def measure_collectives(mesh: Mesh, sizes: Sequence[int], iters: int, device: torch.device,
                        progress: Progress) -> list[Sample]:
    """Time every collective kind on every axis at every size; the slowest rank's median counts."""
    plan, local = [], []
    for axis, (group, ranks) in enumerate(_axis_groups(mesh.shape)):
        if len(ranks) < 2:
            continue
        link_kind = mesh.link_kind(axis)
        for kind in COLLECTIVE_KINDS:
            progress(f"{kind} on axis {mesh.axis_names[axis]} ({link_kind}, n={len(ranks)}): "
                     f"{format_bytes(sizes[0])} .. {format_bytes(sizes[-1])}")
            for nbytes in sizes:
                fn = _collective_fns(kind, nbytes, group, ranks.index(dist.get_rank()), ranks, device)
                dist.barrier()
                local.append(_median_time(fn, device, iters))
                plan.append((kind, link_kind, len(ranks), nbytes))
    slowest = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return [Sample(k, lk, n, float(b), float(t)) for (k, lk, n, b), t in zip(plan, slowest.tolist())]


def measure_compute(device: torch.device, iters: int, dtype: torch.dtype, progress: Progress,
                    quick: bool = False) -> dict[str, float]:
    """Matmul and attention FLOP/s, pointwise bytes/s and the per-op overhead on `device`."""
    big = device.type == "cuda"
    dims = (2048, 4096, 8192) if big else ((256, 512) if quick else (512, 1024, 2048))
    progress(f"matmul {dtype} at {', '.join(map(str, dims))}; attention; pointwise ops; op overhead")
    rates = []
    for d in dims:
        a, b = torch.randn(d, d, device=device, dtype=dtype), torch.randn(d, d, device=device, dtype=dtype)
        rates.append(2 * d ** 3 / _median_time(lambda: a @ b, device, iters))
    bh, s, hd = (16, 2048, 128) if big else (8, 128 if quick else 256, 64)
    q = torch.randn(1, bh, s, hd, device=device, dtype=dtype)
    t = _median_time(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True), device, iters)
    attention = 4 * bh * s * s * hd / 2 / t   # causal: half of the two s×s×hd matmuls
    numel = (1 << 24) if big else (1 << 18 if quick else 1 << 20)
    x, y = torch.randn(numel, device=device, dtype=dtype), torch.randn(numel, device=device, dtype=dtype)
    nb = numel * x.element_size()
    bandwidths = [3 * nb / _median_time(lambda: x + y, device, iters),
                  2 * nb / _median_time(lambda: F.gelu(x), device, iters),
                  2 * nb / _median_time(lambda: x * 0.5, device, iters)]
    tiny = torch.ones(8, device=device, dtype=dtype)
    overhead = _median_time(lambda: [tiny + tiny for _ in range(100)], device, max(3, iters)) / 100
    return {"matmul": statistics.median(rates), "attention": attention,
            "bandwidth": statistics.median(bandwidths), "overhead": overhead}


def _slowest(values: dict[str, float]) -> dict[str, float]:
    """Every rank's figures agreed: the slowest rank's (min rate, max overhead) so all get one spec."""
    t = torch.tensor([-values["matmul"], -values["attention"], -values["bandwidth"], values["overhead"]],
                     dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"matmul": -t[0].item(), "attention": -t[1].item(), "bandwidth": -t[2].item(),
            "overhead": t[3].item()}


def default_base(device: torch.device) -> HardwareSpec:
    """The preset whose peak FLOP/s and capacity a calibration on `device` starts from."""
    if device.type != "cuda":
        return get_hardware("cpu")
    name = torch.cuda.get_device_name(device).lower()
    for preset in ("h200", "h100", "a100"):
        if preset in name:
            return get_hardware(preset)
    return replace(get_hardware("h100"), name=name.replace(" ", "-"),
                   mem_capacity=float(torch.cuda.get_device_properties(device).total_memory))


def calibrate(mesh_shape: Sequence[int] | None = None, *, sizes: Sequence[int] = DEFAULT_SIZES,
              iters: int = 5, base: str | HardwareSpec | None = None, devices_per_node: int | None = None,
              progress: Progress | None = None, quick_compute: bool = False) -> Calibration:
    """Measure and fit a profile; call on every rank of an initialised process group.

    `mesh_shape` defaults to (world,); `devices_per_node` to torchrun's LOCAL_WORLD_SIZE when the
    job spans several nodes (one node: the base preset's). Returns the same result on every rank."""
    if not dist.is_initialized():
        raise InputError("calibrate() needs a process group: run it under torchrun (`autopar calibrate`)")
    world = dist.get_world_size()
    mesh_shape = tuple(mesh_shape) if mesh_shape else (world,)
    if math.prod(mesh_shape) != world:
        raise InputError(f"mesh {mesh_shape} has {math.prod(mesh_shape)} devices but the world has {world}")
    device = _device()
    base_spec = get_hardware(base) if base is not None else default_base(device)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    dpn = devices_per_node or (local_world if local_world < world else base_spec.devices_per_node)
    mesh = Mesh(mesh_shape, hardware=base_spec, devices_per_node=dpn)
    say = progress or (_print_progress if dist.get_rank() == 0 else (lambda msg: None))
    samples = measure_collectives(mesh, sorted(sizes), iters, device, say)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    figures = _slowest(measure_compute(device, iters, dtype, say, quick_compute))
    spec = build_profile(base_spec, samples, matmul_flops=figures["matmul"], mem_bandwidth=figures["bandwidth"],
                         op_overhead=figures["overhead"], devices_per_node=dpn,
                         dtype="bfloat16" if device.type == "cuda" else "float32")
    return Calibration(spec, tuple(samples), figures["matmul"], figures["attention"], figures["bandwidth"],
                       figures["overhead"])


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _print_progress(msg: str) -> None:
    print(f"autopar calibrate: {msg}", file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    """ "64K" -> 65536, "4M" -> 4194304, "1024" -> 1024 (binary units)."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    if not number.isdigit() or int(number) <= 0:
        raise InputError(f"bad message size {text!r}: use e.g. 1K, 64K, 4M")
    return int(number) * scale


def size_range(low: str, high: str) -> tuple[int, ...]:
    """Sizes low, 4·low, 16·low, ... up to high."""
    lo, hi = parse_size(low), parse_size(high)
    if lo > hi:
        raise InputError(f"--min-bytes {low} is larger than --max-bytes {high}")
    return tuple(lo * 4 ** k for k in range(int(math.log(hi / lo, 4)) + 1))
