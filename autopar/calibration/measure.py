"""`autopar calibrate`: measure this cluster's links and devices and write a hardware profile.

Run on every rank under torchrun (gloo on CPU, NCCL on CUDA: the same code, the device follows the
backend). For each mesh axis, every rank times all_reduce, all_gather, reduce_scatter, all_to_all
and send/recv inside its own axis group over a range of message sizes B, each as the lowered graph
issues it (functional collective + wait_tensor; all_reduce's copy of its input included). At each
size the kinds take turns, round after round, so that load from elsewhere hits them alike; a time is
the slowest rank's median round (`measure_collectives`).
Each (link kind, collective) is then fitted to the alpha-beta formula of `costmodel.comm`
(`autopar.calibration.fit`).

Compute is timed the same way: square matmuls give the achieved FLOP/s (-> `compute_efficiency`
against the base preset's peak); causal attention forward and backward their FLOP/s (counted by
the cost model's formulas) as fractions of the matmul's (-> `attention_efficiency`,
`attention_backward_efficiency`); exp, tanh and gelu the `transcendental_rate` (elements/s); and
pointwise ops over sizes from 64 elements to 1M, their operands streamed from memory rather than
cache (`measure_pointwise`), the per-launch overhead and the memory bandwidth, by a line fit
(`fit_line`):

    t(M) = o + M·(1/W)            (M bytes read and written)

All compute is timed as sustained streams (`sustained_time`): on a shared machine a burst after
a pause runs faster than a step that keeps the core busy. The per-parameter work of a step
(zero_grad, the gradient's DTensor wrapping into p.grad, AdamW's step, as train_step and the loop
do them) is timed on K tiny DTensor parameters (what `ParallelModule` hands torch.optim) for several K; the slope of t(K) is
`param_step_overhead`, the seconds each parameter tensor adds beyond its bytes; the same with
`pmodel.optimizer`'s fused step on the local shards (`autopar/runtime/optim.py`) gives
`fused_step_overhead`.
Last, a reference step (`autopar.calibration.in_step`): a small GPT's joint graph, priced with the rates
above and run as a step runs it on every rank at once; measured over priced is `in_step_scale`, which
multiplies every op's time (operands come cold from the ops before, the ranks share caches and memory);
then that model trained data parallel by the runtime: its whole step less its plan's price is
`runtime_overhead`, which every plan's step pays once.
The collectives above run back to back, the ranks in lockstep; in a step the ranks reach a blocking
collective from compute. `sync_latency` is the difference: ~10 ms of matmuls then a 4-byte
all_reduce, against the same matmuls alone and the all_reduce back to back (CPU/gloo: ~1 ms, the
communication threads of ranks that were computing have to be woken; with NCCL the wait is queued on
the device and costs nothing extra).
On CPU everything is measured under the allocator thresholds autopar's programs run with
(`autopar.runtime.cpu_memory`): under glibc's defaults each large collective's fresh output is faulted in
page by page, which the program does not pay. 13.8 MB on 2 ranks of a 2-core machine, 12
calibrations each: all-reduce fitted at a median 15.4 ms and all-gather at 11.0 ms under the
defaults, 12.6 and 8.2 ms under autopar's settings; timed alone, as the program issues them,
12.5-13.7 and 6.4-6.7 ms.
The compiled program's figures (`compiled_op_overhead` per kernel, `compiled_mem_bandwidth` of a fused
chain) are measured by `autopar.calibration.compiled` on the runtime's own `CompiledProgram`.
The result is a `HardwareSpec`; `HardwareSpec.save` writes the JSON that `Mesh(hardware=path)` reads.
"""
from __future__ import annotations

import itertools
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

from autopar import _torch_compat as compat
from autopar.calibration.compiled import measure_compiled
from autopar.calibration.fit import Sample, fit_line, fit_links
from autopar.calibration.in_step import InStep, RuntimeStep, measure_in_step, measure_runtime_step
from autopar.calibration.timing import mean_time, sustained_time, sync
from autopar.costmodel import compute as compute_model
from autopar.costmodel.hardware import COLLECTIVE_KINDS, HardwareSpec, get_hardware
from autopar.costmodel.memory import format_bytes, format_seconds
from autopar.errors import InputError
from autopar.mesh import Mesh
from autopar.runtime.cpu_memory import keep_freed_memory
from autopar.runtime.optim import local_shard_optimizer

DEFAULT_SIZES = tuple(4 ** k * 1024 for k in range(9))   # 1 KiB .. 64 MiB
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Calibration:
    """What `calibrate` measured and the profile fitted from it."""

    spec: HardwareSpec
    samples: tuple[Sample, ...]
    matmul_flops: float        # achieved FLOP/s of the square matmuls (median)
    attention_flops: float     # achieved FLOP/s of causal attention forward (the cost model's count)
    mem_bandwidth: float       # effective bytes/s of pointwise ops (fitted)
    op_overhead: float         # seconds per op (fitted intercept)
    param_step_overhead: float = 0.0   # seconds per DTensor parameter tensor per step (fitted slope)
    transcendental_rate: float = 0.0   # elements/s of exp, tanh and gelu (median)
    attention_backward_flops: float = 0.0   # achieved FLOP/s of its backward
    sync_latency: float = 0.0  # seconds a blocking collective adds after compute (median excess)
    fused_step_overhead: float = 0.0   # param_step_overhead with pmodel.optimizer's fused local-shard step
    compiled_op_overhead: float = 0.0  # seconds per kernel of an Inductor-compiled program (calibration/compiled.py)
    compiled_mem_bandwidth: float = 0.0   # bytes/s of a compiled fused chain's one pass
    reference: InStep | None = None    # the reference step (-> spec.in_step_scale)
    compiled_reference: InStep | None = None   # the same compiled by Inductor (-> spec.compiled_in_step_scale)
    runtime: RuntimeStep | None = None  # the reference model's whole step under the runtime (-> spec.runtime_overhead)

    def summary(self) -> str:
        """A short table of the fitted links and compute figures."""
        peak = self.matmul_flops / self.spec.compute_efficiency  # the measured dtype's peak
        lines = [f"profile {self.spec.name}: matmul {self.matmul_flops / 1e9:.1f} GFLOP/s "
                 f"(efficiency {self.spec.compute_efficiency:.2f} of {peak / 1e9:.0f}),"
                 f" attention {self.attention_flops / 1e9:.1f} GFLOP/s forward"
                 f" (x{self.spec.attention_efficiency:.2f}), {self.attention_backward_flops / 1e9:.1f} backward"
                 f" (x{self.spec.attention_backward_efficiency:.2f}),"
                 f" pointwise "
                 f"{format_bytes(self.mem_bandwidth)}/s, exp/tanh/gelu {self.transcendental_rate / 1e6:.0f} M elements/s, "
                 f"op overhead {format_seconds(self.op_overhead)}, "
                 f"{format_seconds(self.param_step_overhead)} per parameter tensor per step "
                 f"({format_seconds(self.fused_step_overhead)} with pmodel.optimizer), "
                 f"{format_seconds(self.sync_latency)} per collective reached from compute; compiled program "
                 f"{format_seconds(self.compiled_op_overhead)} per kernel, fused chains "
                 f"{format_bytes(self.compiled_mem_bandwidth)}/s"]
        if self.reference is not None:
            lines.append(f"in-step scale x{self.reference.scale:.2f}: a reference step's {self.reference.ops} ops ran "
                         f"{format_seconds(self.reference.measured)} where the rates above price "
                         f"{format_seconds(self.reference.priced)} (every op's time is multiplied by it)")
        if self.compiled_reference is not None:
            lines.append(f"compiled in-step scale x{self.compiled_reference.scale:.2f}: compiled by Inductor it ran "
                         f"{format_seconds(self.compiled_reference.measured)}, priced as compiled "
                         f"{format_seconds(self.compiled_reference.priced)} (a compiled program's ops)")
        if self.runtime is not None:
            lines.append(f"runtime overhead {format_seconds(self.runtime.overhead)} per step: the reference model "
                         f"trained data parallel by the runtime ran {format_seconds(self.runtime.measured)} per step where "
                         f"its plan prices {format_seconds(self.runtime.priced)} (every plan's step pays it once)")
        for link_kind, fits in self.spec.collectives.items():
            for kind, link in fits.items():
                lines.append(f"  {link_kind:<6}{kind:<16} alpha {format_seconds(link.latency):>9}  "
                             f"beta {format_bytes(link.bandwidth)}/s")
        return "\n".join(lines)


def build_profile(base: HardwareSpec, samples: Sequence[Sample], *, matmul_flops: float,
                  mem_bandwidth: float, op_overhead: float, devices_per_node: int | None,
                  dtype: str = "float32", name: str | None = None,
                  param_step_overhead: float | None = None,
                  transcendental_rate: float | None = None, attention_flops: float | None = None,
                  attention_backward_flops: float | None = None,
                  sync_latency: float | None = None,
                  fused_step_overhead: float | None = None, compiled_op_overhead: float | None = None,
                  compiled_mem_bandwidth: float | None = None) -> HardwareSpec:
    """The calibrated spec: base's capacity, measured compute, fitted links (base's where unmeasured;
    the per-tensor step overhead, the transcendental rate and the attention efficiencies too when
    not measured). An attention efficiency is its FLOP/s over the matmul's."""
    peak = max(base.flops(dtype), matmul_flops)
    fits = fit_links(samples)
    generic = {lk: fits[lk].get("all_reduce") or next(iter(fits[lk].values()))
               for lk in fits}
    return replace(
        base, name=name or f"{base.name}-calibrated",
        peak_flops={**base.peak_flops, dtype: peak}, mem_bandwidth=mem_bandwidth,
        intra_node=generic.get("intra", base.intra_node), inter_node=generic.get("inter", base.inter_node),
        devices_per_node=devices_per_node, compute_efficiency=min(1.0, matmul_flops / peak),
        collectives=fits, op_overhead=op_overhead,
        param_step_overhead=base.param_step_overhead if param_step_overhead is None else param_step_overhead,
        transcendental_rate=base.transcendental_rate if transcendental_rate is None else transcendental_rate,
        attention_efficiency=(base.attention_efficiency if attention_flops is None
                              else attention_flops / matmul_flops),
        attention_backward_efficiency=(base.attention_backward_efficiency if attention_backward_flops is None
                                       else attention_backward_flops / matmul_flops),
        sync_latency=base.sync_latency if sync_latency is None else sync_latency,
        fused_step_overhead=base.fused_step_overhead if fused_step_overhead is None else fused_step_overhead,
        compiled_op_overhead=base.compiled_op_overhead if compiled_op_overhead is None else compiled_op_overhead,
        compiled_mem_bandwidth=(base.compiled_mem_bandwidth if compiled_mem_bandwidth is None
                                else compiled_mem_bandwidth))


# --- measuring (every rank runs these in the same order) -------------------------------------------

def _collective_fns(kind: str, nbytes: int, group, pos: int, ranks: list[int], device: torch.device):
    """A no-argument callable running one `kind` of B = nbytes in `group`, as the lowered graph runs
    it: a functional collective (out of place: all_reduce copies its input) and its wait_tensor."""
    n = len(ranks)
    numel = max(n, (nbytes // 4) // n * n)   # float32, divisible by n
    x = torch.ones(numel, device=device)
    fc, name = torch.ops._c10d_functional, group.group_name
    if kind == "all_reduce":
        return lambda: fc.wait_tensor(fc.all_reduce(x, "sum", name))
    if kind == "all_gather":
        part = torch.ones(numel // n, device=device)
        return lambda: fc.wait_tensor(fc.all_gather_into_tensor(part, n, name))
    if kind == "reduce_scatter":
        return lambda: fc.wait_tensor(fc.reduce_scatter_tensor(x, "sum", n, name))
    if kind == "all_to_all":
        split = [numel // n] * n
        return lambda: fc.wait_tensor(fc.all_to_all_single(x, split, split, name))
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


CALLS_PER_ROUND = 2   # back-to-back calls of one collective per timed round


def measure_collectives(mesh: Mesh, sizes: Sequence[int], iters: int, device: torch.device,
                        progress: Progress) -> list[Sample]:
    """Time every collective kind on every axis at every size; the slowest rank's median counts.

    At each size the kinds take turns: `iters` rounds, each timing CALLS_PER_ROUND back-to-back
    calls of every kind in turn, and a sample is this rank's median round, then the slowest rank's.
    The planner compares kinds at one size (a gradient all-reduce against a reduce-scatter plus an
    all-gather of the same bytes), so a spell of load from elsewhere should slow a round of every kind
    alike rather than every timing of one kind, which would steer the plan."""
    plan, local = [], []
    for axis, (group, ranks) in enumerate(_axis_groups(mesh.shape)):
        if len(ranks) < 2:
            continue
        link_kind = mesh.link_kind(axis)
        progress(f"{', '.join(COLLECTIVE_KINDS)} on axis {mesh.axis_names[axis]} ({link_kind}, n={len(ranks)}): "
                 f"{format_bytes(sizes[0])} .. {format_bytes(sizes[-1])}, {iters} rounds")
        pos = ranks.index(dist.get_rank())
        for nbytes in sizes:
            fns = [_collective_fns(kind, nbytes, group, pos, ranks, device) for kind in COLLECTIVE_KINDS]
            rounds = _interleaved_times(fns, device, iters)
            local += [statistics.median(r) for r in rounds]
            plan += [(kind, link_kind, len(ranks), nbytes) for kind in COLLECTIVE_KINDS]
    slowest = torch.tensor(local, dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return [Sample(k, lk, n, float(b), float(t)) for (k, lk, n, b), t in zip(plan, slowest.tolist())]


def _interleaved_times(fns: Sequence[Callable[[], object]], device: torch.device, iters: int) -> list[list[float]]:
    """Per fn, the mean seconds per call of each of `iters` rounds; in a round every fn runs
    CALLS_PER_ROUND times back to back, after a barrier, one fn after the other (one warm-up call
    each first). The same calls on every rank, so the fns may be collectives."""
    times: list[list[float]] = [[] for _ in fns]
    with warnings.catch_warnings():   # torch's deprecation notes on *_into_tensor / *_tensor names
        warnings.simplefilter("ignore", FutureWarning)
        for fn in fns:
            fn()
        for _ in range(iters):
            for fn, out in zip(fns, times):
                sync(device)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(CALLS_PER_ROUND):
                    fn()
                sync(device)
                out.append((time.perf_counter() - t0) / CALLS_PER_ROUND)
    return times


def measure_compute(device: torch.device, iters: int, dtype: torch.dtype, progress: Progress,
                    quick: bool = False) -> dict[str, float]:
    """Matmul and attention FLOP/s, pointwise bytes/s and the per-op overhead on `device`."""
    big = device.type == "cuda"
    dims = (2048, 4096, 8192) if big else ((256, 512) if quick else (512, 1024, 2048))
    progress(f"matmul {dtype} at {', '.join(map(str, dims))}; attention forward and backward; pointwise ops; "
             "op overhead")
    rates = []
    for d in dims:
        a, b = torch.randn(d, d, device=device, dtype=dtype), torch.randn(d, d, device=device, dtype=dtype)
        rates.append(2 * d ** 3 / sustained_time(lambda: a @ b, device, iters))
    attention, attention_backward = measure_attention(device, iters, dtype, quick)
    numel = 1 << (24 if big else 18 if quick else 20)
    overhead, bandwidth = measure_pointwise(device, iters, dtype, numel, pool_bytes=(64 << 20) if quick else None)
    # exp-class ops on 1M elements even when quick (the time is the same: each is a 50 ms stream), as
    # the full calibration: 256K elements (1 MB) would be read from a CPU's L2 rather than from memory
    special_numel = 1 << (24 if big else 20)
    x = torch.randn(special_numel, device=device, dtype=dtype)
    special = statistics.median(special_numel / sustained_time(lambda: op(x), device, iters)
                                for op in (torch.exp, torch.tanh, F.gelu))
    return {"matmul": statistics.median(rates), "attention": attention, "attention_backward": attention_backward,
            "bandwidth": bandwidth, "overhead": overhead, "transcendental": special}


def measure_attention(device: torch.device, iters: int, dtype: torch.dtype, quick: bool = False) -> tuple[float, float]:
    """FLOP/s of causal `scaled_dot_product_attention` forward and of its backward alone (autograd
    on a kept graph), FLOPs counted by the cost model's own formulas for the kernels it prices."""
    big = device.type == "cuda"
    bh, s, hd = (16, 2048, 128) if big else (16, 128 if quick else 256, 64)
    shape = (1, bh, s, hd)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        forward = sustained_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device, iters)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad_out = torch.randn_like(out)
    backward = sustained_time(lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True),
                               device, iters)
    return (compute_model.attention_forward_flops(shape, shape, shape) / forward,
            compute_model.attention_backward_flops(shape, shape, shape, shape) / backward)


def measure_pointwise(device: torch.device, iters: int, dtype: torch.dtype, max_numel: int,
                      pool_bytes: int | None = None) -> tuple[float, float]:
    """(seconds per op, bytes/s): `fit_line` over sizes 64 .. max_numel elements of x + y and
    x * 0.5 (bytes = inputs + output), the mean of the two fits; each size is a sustained stream
    of calls (`sustained_time`). The ops are called as the per-rank graph calls them, through
    their ATen overloads (`torch.ops.aten.add.Tensor`): on a CPU that costs ~2x the dispatch of
    Python's `torch.add` binding (6 against 3 µs per call, one idle core).

    Each call reads other operands: views spread over two pools larger than the caches
    (`pool_bytes` each: 256 MiB, 1 GiB on a GPU), so the operands stream from device memory as a
    step's do (its activations outgrow the caches; the same adds over cache-resident operands run
    ~2.5x faster on this project's CPU: 75-80 against ~30 GB/s per core)."""
    aten = torch.ops.aten
    numels = sorted({n for n in (64, 1024, 16384, 262144, max_numel) if n <= max_numel})
    pool_bytes = pool_bytes or (1 << (30 if device.type == "cuda" else 28))
    itemsize = torch.empty((), dtype=dtype).element_size()
    pool_numel = max(pool_bytes // itemsize, 2 * max_numel)
    pools = [torch.ones(pool_numel, device=device, dtype=dtype) for _ in range(2)]
    fits = []
    for op, tensors in ((aten.add.Tensor, 3), (lambda x, y: aten.mul.Tensor(x, 0.5), 2)):
        sizes, times = [], []
        for numel in numels:
            count = min(pool_numel // numel, 4096)
            stride = pool_numel // count
            pairs = itertools.cycle([(pools[0][i * stride:i * stride + numel], pools[1][i * stride:i * stride + numel])
                                     for i in range(count)])
            times.append(sustained_time(lambda: op(*next(pairs)), device, iters))
            sizes.append(tensors * numel * itemsize)
        fits.append(fit_line(sizes, times))
    overhead = statistics.fmean(f[0] for f in fits)
    return overhead, 1.0 / max(statistics.fmean(f[1] for f in fits), 1e-15)


def measure_param_step(device: torch.device, iters: int, counts: Sequence[int] = (4, 16, 64),
                       fused: bool = False) -> float:
    """Seconds per parameter tensor of what a training step does once per DTensor parameter, as
    `ParallelModule.train_step` and the user's loop do it: `zero_grad(set_to_none=True)`, the graph's
    local gradient wrapped into a DTensor and stored in `p.grad` (no autograd: train_step skips it
    unless a hook watches the step), and `torch.optim.AdamW().step()` with default options (`fused`:
    `pmodel.optimizer(torch.optim.AdamW)`'s step on the local shards instead), on tiny replicated
    parameters of a 1-D mesh of the world. The slope of `fit_line` over `counts` tensors; their bytes
    are negligible, so the slope is the per-tensor dispatch cost. (Timing autograd's `to_local` /
    backward path as well over-priced the example GPT's 52 parameters by ~35%.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    device_mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    times = []
    for count in counts:
        params = [torch.nn.Parameter(distribute_tensor(torch.ones(16, device=device), device_mesh, [Replicate()]))
                  for _ in range(count)]
        specs = [compat.dtensor_spec(p) for p in params]
        local_grad = torch.ones(16, device=device)
        opt = local_shard_optimizer(torch.optim.AdamW, params, lr=1e-3) if fused else torch.optim.AdamW(params, lr=1e-3)

        def step(params=params, specs=specs, opt=opt):
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for p, spec in zip(params, specs):
                    p.grad = compat.dtensor_grad(local_grad.clone(), spec)
            opt.step()
        times.append(sustained_time(step, device, iters))
    return fit_line(counts, times)[1]


def measure_sync_latency(device: torch.device, iters: int, segment: float = 10e-3, reps: int = 8) -> float:
    """Seconds a blocking collective adds when the ranks reach it from compute (`sync_latency`): per
    round, `reps` times ~`segment` seconds of matmuls, then the same each followed by a 4-byte
    all_reduce (functional + wait, as the graph issues it), then the all_reduce alone back to back;
    the excess of the second over the other two, median of `iters` rounds, never below 0."""
    dim = 4096 if device.type == "cuda" else 512
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(dim, dim, device=device, dtype=dtype)
    calls = torch.tensor([max(1.0, segment / sustained_time(lambda: a @ a, device, 3))], device=device)
    dist.all_reduce(calls, op=dist.ReduceOp.MAX)   # every rank runs the same work
    calls = int(calls.item())
    fc, name, x = torch.ops._c10d_functional, dist.group.WORLD.group_name, torch.ones(1, device=device)

    def work():
        for _ in range(calls):
            a @ a

    def reduce():
        fc.wait_tensor(fc.all_reduce(x, "sum", name))

    def per_call(fn, n: int) -> float:
        dist.barrier()
        return mean_time(fn, device, n)

    excess = []
    for _ in range(iters):
        alone, lockstep = per_call(work, reps), per_call(reduce, 4 * reps)
        excess.append(per_call(lambda: (work(), reduce()), reps) - alone - lockstep)
    return max(0.0, statistics.median(excess))


def _slowest(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Every rank's figures agreed: the slowest rank's (min rate, max overhead) so all get one spec."""
    rates = ("matmul", "attention", "attention_backward", "bandwidth", "transcendental", "compiled_bandwidth",
             "eager_chain_ratio")
    names = sorted(values)
    t = torch.tensor([-values[k] if k in rates else values[k] for k in names], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {k: -v if k in rates else v for k, v in zip(names, t.tolist())}


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
              progress: Progress | None = None, quick_compute: bool = False, compiled: bool = True) -> Calibration:
    """Measure and fit a profile; call on every rank of an initialised process group.

    `mesh_shape` defaults to (world,); `devices_per_node` to torchrun's LOCAL_WORLD_SIZE when the
    job spans several nodes (one node: the base preset's). `compiled=False` skips the compiled program's
    figures (they compile several programs: tens of seconds from a cold Inductor cache on a small CPU;
    unmeasured, a compiled plan is priced with the eager figures). Returns the same result on every rank."""
    if not dist.is_initialized():
        raise InputError("calibrate() needs a process group: run it under torchrun (`autopar calibrate`)")
    world = dist.get_world_size()
    mesh_shape = tuple(mesh_shape) if mesh_shape else (world,)
    if math.prod(mesh_shape) != world:
        raise InputError(f"mesh {mesh_shape} has {math.prod(mesh_shape)} devices but the world has {world}")
    device = _device()
    if device.type == "cpu":   # the allocator settings the program runs with (see the docstring)
        keep_freed_memory()
    base_spec = get_hardware(base) if base is not None else default_base(device)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    dpn = devices_per_node or (local_world if local_world < world else base_spec.devices_per_node)
    mesh = Mesh(mesh_shape, hardware=base_spec, devices_per_node=dpn)
    say = progress or (_print_progress if dist.get_rank() == 0 else (lambda msg: None))
    samples = measure_collectives(mesh, sorted(sizes), iters, device, say)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    figures = measure_compute(device, iters, dtype, say, quick_compute)
    say("per-parameter step work: zero_grad, gradient into p.grad, AdamW (and pmodel.optimizer's) over 4, 16, 64 "
        "DTensor parameters; a collective reached from compute")
    figures = _slowest({**figures, "param_step": measure_param_step(device, iters),
                        "fused_step": measure_param_step(device, iters, fused=True),
                        "sync": measure_sync_latency(device, iters),
                        **(measure_compiled(device, dtype, lambda fn: sustained_time(fn, device, iters), quick_compute)
                           if compiled else {})},
                       device)
    spec = build_profile(base_spec, samples, matmul_flops=figures["matmul"], mem_bandwidth=figures["bandwidth"],
                         op_overhead=figures["overhead"], devices_per_node=dpn,
                         dtype="bfloat16" if device.type == "cuda" else "float32",
                         param_step_overhead=figures["param_step"], transcendental_rate=figures["transcendental"],
                         attention_flops=figures["attention"], attention_backward_flops=figures["attention_backward"],
                         sync_latency=figures["sync"], fused_step_overhead=figures["fused_step"],
                         compiled_op_overhead=figures.get("compiled_overhead"),
                         compiled_mem_bandwidth=figures.get("compiled_bandwidth"))
    say("a reference training step's graph run as a step runs it, against what the rates above price it")
    reference = measure_in_step(spec, device, iters)
    compiled_reference = measure_in_step(spec, device, iters, compiled=True) if compiled else None
    spec = replace(spec, in_step_scale=reference.scale,
                   compiled_in_step_scale=compiled_reference.scale if compiled else spec.compiled_in_step_scale)
    say("the reference model trained data parallel by the runtime: its whole step against its plan's price")
    runtime = measure_runtime_step(spec, device, iters)
    spec = replace(spec, runtime_overhead=runtime.overhead)
    return Calibration(spec, tuple(samples), figures["matmul"], figures["attention"], figures["bandwidth"],
                       figures["overhead"], figures["param_step"], figures["transcendental"],
                       figures["attention_backward"], figures["sync"], figures["fused_step"],
                       figures.get("compiled_overhead", 0.0), figures.get("compiled_bandwidth", 0.0), reference,
                       compiled_reference, runtime)


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
