"""What a kernel of an Inductor-compiled per-rank program costs: `autopar calibrate`'s compiled figures.

`autoparallelize(compile=True)` runs each rank's joint graph as the code Inductor generates
(`autopar/runtime/compile.py`), and the planner prices such a plan by `autopar/planning/fusion.py`'s model:
views free, memory-bound chains fused into one pass over their inputs and outputs, one launch per kernel.
Two figures of that model are measured here, on the same `CompiledProgram` the runtime uses:

- `compiled_op_overhead`, seconds per kernel: K layers of (tiny matmul, then relu, scale and shift, which
  Inductor fuses into one kernel) for K = 8 and 32, compiled; the kernels are counted in the code Inductor
  emitted (`kernel_calls`: 2K here) and the slope of a line fit of time against kernels is the overhead
  (the intercept is the program's own call). The same ATen graph run eagerly, one dispatch per op, gives
  the eager figure beside it (`eager_op_overhead`; `op_overhead` proper comes from `measure_pointwise`).
- `compiled_mem_bandwidth`, bytes/s of a fused chain: six pointwise ops over two operands (one kernel:
  reads x and y, writes the result, 3 tensors' bytes), compiled at a small and a large size, operands
  streamed from two pools larger than the caches as `measure_pointwise` does; the slope of time against
  one pass's bytes. The eager chain (six ops, each reading and writing) is timed beside it
  (`eager_chain_ratio`: eager time / compiled time at the large size; the model says ~5-6 on a CPU, where
  each op is memory bound).

The first calibration on a machine compiles these programs (seconds per program; C++ on a CPU, Triton on a
GPU); Inductor's caches serve later ones.
"""
from __future__ import annotations

import itertools
import re
from typing import Callable

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.calibration.fit import fit_line
from autopar.planning.fusion import compiled_kernels, count_kernels
from autopar.runtime.compile import CompiledProgram

Timer = Callable[[Callable[[], object]], float]   # seconds per call of a sustained stream

# a kernel launch in Inductor's Python wrapper: a C++ kernel, a Triton kernel, an extern ATen call
_KERNEL_CALL = re.compile(r"^\s*(?:\w+ = )?(?:cpp_fused_\w+\(|triton_\w+\.run\(|extern_kernels\.\w+\(|"
                          r"torch\.ops\.\w+\.\w+\.\w+\()", re.MULTILINE)
LAYERS = (8, 32)   # K of the overhead program


def kernel_calls(source: str) -> int:
    """Kernel launches in the `call` function of an Inductor wrapper's source (0 for no source)."""
    start = source.find("def call(")
    if start < 0:
        return 0
    end = source.find("\nrunner = ", start)
    return len(_KERNEL_CALL.findall(source[start:end if end > 0 else len(source)]))


def layered_program(num_layers: int) -> Callable:
    """relu(x @ w) * 0.5 + 0.1, `num_layers` times: a matmul and a fused chain (2 kernels) per layer."""
    def program(x, w):
        for _ in range(num_layers):
            x = torch.relu(x @ w) * 0.5 + 0.1
        return x
    return program


def chain_program(x, y):
    """Six pointwise ops over x and y: one fused kernel reading both and writing one result."""
    a = x * 0.5 + y
    a = torch.relu(a) - 0.25
    return a * y + 1.0


def trace_aten(fn: Callable, *args) -> fx.GraphModule:
    """`fn`'s ATen graph for `args`, as the per-rank programs are (make_fx)."""
    return make_fx(fn)(*args)


def _kernels(program: CompiledProgram) -> int:
    """Kernels Inductor emitted for `program` (its source), or this planner's count when a cache served the
    program without source."""
    return kernel_calls(program.source) or count_kernels(compiled_kernels(program.gm))


def measure_overhead(device: torch.device, dtype: torch.dtype, timer: Timer) -> dict[str, float]:
    """Per-kernel seconds of a compiled program and per-op seconds of the same graph run eagerly."""
    kernels, compiled, nodes, eager = [], [], [], []
    for num_layers in LAYERS:
        x = torch.randn(8, 8, device=device, dtype=dtype)
        w = torch.randn(8, 8, device=device, dtype=dtype) / 8
        gm = trace_aten(layered_program(num_layers), x, w)
        program = CompiledProgram(gm, "calibration")
        program(x, w)
        kernels.append(_kernels(program))
        compiled.append(timer(lambda: program(x, w)))
        nodes.append(sum(n.op == "call_function" for n in gm.graph.nodes))
        eager.append(timer(lambda: gm(x, w)))
    return {"compiled_overhead": fit_line(kernels, compiled)[1], "eager_op_overhead": fit_line(nodes, eager)[1]}


def measure_fused_bandwidth(device: torch.device, dtype: torch.dtype, timer: Timer, max_numel: int,
                            pool_bytes: int) -> dict[str, float]:
    """Bytes/s of one compiled pointwise chain's pass (inputs + output), and eager / compiled time of the
    chain at `max_numel` elements; operands are views cycling through two pools of `pool_bytes`."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    pool_numel = max(pool_bytes // itemsize, 2 * max_numel)
    pools = [torch.ones(pool_numel, device=device, dtype=dtype) for _ in range(2)]
    sizes, times, ratio = [], [], 0.0
    for numel in (max_numel // 64, max_numel):
        count = min(pool_numel // numel, 256)
        pairs = [(pools[0][i * numel:(i + 1) * numel], pools[1][i * numel:(i + 1) * numel]) for i in range(count)]
        gm = trace_aten(chain_program, *pairs[0])
        program = CompiledProgram(gm, "calibration")
        program(*pairs[0])
        cycle = itertools.cycle(pairs)
        times.append(timer(lambda: program(*next(cycle))))
        sizes.append(3 * numel * itemsize)
        if numel == max_numel:
            ratio = timer(lambda: gm(*next(cycle))) / times[-1]
    return {"compiled_bandwidth": 1.0 / max(fit_line(sizes, times)[1], 1e-15), "eager_chain_ratio": ratio}


def measure_compiled(device: torch.device, dtype: torch.dtype, timer: Timer, quick: bool = False) -> dict[str, float]:
    """`compiled_overhead` (s per kernel), `compiled_bandwidth` (bytes/s of a fused pass), and the eager
    figures beside them (`eager_op_overhead`, `eager_chain_ratio`) for the calibration's summary."""
    big = device.type == "cuda"
    max_numel = 1 << (24 if big else 18 if quick else 20)
    pool_bytes = (1 << 30) if big else (64 << 20) if quick else (256 << 20)
    return {**measure_overhead(device, dtype, timer),
            **measure_fused_bandwidth(device, dtype, timer, max_numel, pool_bytes)}
