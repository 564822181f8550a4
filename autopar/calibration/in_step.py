"""The in-step scale: how much longer a training step's ops take than the isolated benchmarks price them.

Each compute benchmark of `autopar.calibration.measure` repeats one op on the same operands, so its
operands sit in the caches; in a training step every op reads what the ops before it wrote (weights,
activations, gradients: more than the caches hold), and on a CPU the other ranks' steps share the
caches and the memory bus. On the 2-core machine the example GPT's graph ran ~35% longer per rank in
its job than the fitted rates priced it, although every matmul of its shapes, timed alone, ran at the
calibrated speed.

So calibration ends with a reference step: a small GPT (`autopar._testing.gpt`, at a size no example
or benchmark uses) is captured as its joint forward+backward ATen graph, priced op by op with the
profile just fitted (exactly as the planner prices a one-device plan), and run as the runtime runs a
rank's graph, back to back, on every rank at once. The slowest rank's seconds over the priced
seconds is `HardwareSpec.in_step_scale`; `costmodel.compute.op_time` multiplies every op by it. The
optimizer's per-parameter work is not part of it (`param_step_overhead` is timed in its own context).

Then the same reference model trains as a user's loop trains it: data parallel over the job's ranks
(`autopar.runtime.module.parallelize_spmd`, `pmodel.optimizer`'s fused AdamW), zero_grad, train_step,
the optimizer's step and the loss read back. Its measured step (slowest rank) less the step its plan
prices with the profile just fitted (`in_step_scale` included) is `HardwareSpec.runtime_overhead`:
what the runtime adds around each rank's program once per step (the inputs cut, gradients handed to
`p.grad`, the loss returned), and on a CPU what the collectives' threads take from the ops. On the
2-core machine it is ~10-20 ms per step, the same to within a few ms for GPTs whose steps run 30 to
150 ms: it is a per-step cost, not a per-op one.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from autopar._testing.gpt import GPT, GPTConfig
from autopar.calibration.timing import mean_time, sustained_time
from autopar.capture.canonicalize import canonicalize
from autopar.capture.trace import capture
from autopar.costmodel.hardware import HardwareSpec
from autopar.graph import NAME, ROLE
from autopar.mesh import Mesh
from autopar.planning.problem import ProblemBuilder
from autopar.runtime.compile import CompiledProgram
from autopar.runtime.module import parallelize_spmd

# The reference: two layers, sized apart from the examples (GPT 4 x 128) and benchmarks (4 x 256).
CPU_REFERENCE = dict(config=GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=192,
                                      tie_weights=False), batch=4)
CUDA_REFERENCE = dict(config=GPTConfig(vocab_size=8192, block_size=512, n_layer=2, n_head=16, n_embd=1024,
                                       tie_weights=False), batch=8)


@dataclass(frozen=True)
class InStep:
    """The reference step's graph seconds: measured (slowest rank) and priced by the fitted rates."""

    measured: float
    priced: float
    ops: int

    @property
    def scale(self) -> float:
        return self.measured / self.priced


def _reference(device: torch.device):
    """(config, rows per rank, dtype) of the reference step on `device`."""
    reference = CUDA_REFERENCE if device.type == "cuda" else CPU_REFERENCE
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32   # the dtype the benchmarks timed
    return reference["config"], reference["batch"], dtype


def _tokens(config: GPTConfig, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (rows, config.block_size + 1), generator=generator).to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _model(config: GPTConfig, device: torch.device, dtype: torch.dtype) -> GPT:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT(config).to(device=device, dtype=dtype)


def measure_in_step(spec: HardwareSpec, device: torch.device, iters: int, compiled: bool = False) -> InStep:
    """Run the reference step on every rank at once (call on every rank); see the module docstring.
    `spec`: the fitted profile (priced here with in_step_scale 1: the benchmarks' rates alone). `compiled`:
    the graph run as Inductor compiles it (`runtime.compile.CompiledProgram`) and priced as compiled
    (-> `compiled_in_step_scale`)."""
    spec = replace(spec, in_step_scale=1.0, compiled_in_step_scale=0.0).for_program(compiled)
    config, batch, dtype = _reference(device)
    model = _model(config, device, dtype)
    inputs = _tokens(config, batch, device)
    captured = capture(model, inputs, cache=False)
    canonicalize(captured.gm)
    problem = ProblemBuilder(captured, Mesh((1,), ("dp",), spec, None)).build()
    ops = [i for i, node in enumerate(problem.nodes) if node.op != "placeholder"]   # parameters: the optimizer's
    priced = float(sum(np.min(problem.compute[i] + problem.local_comm[i]) for i in ops))

    tensors, fed = {**dict(model.named_parameters()), **dict(model.named_buffers())}, iter(inputs)
    args = [next(fed) if node.meta[ROLE] == "input" else tensors[node.meta[NAME]].detach()
            for node in captured.placeholders()]
    program = CompiledProgram(captured.gm, "calibration") if compiled else captured.gm
    with torch.no_grad():
        program(*args)   # a compiled program compiles at its first call
        dist.barrier()
        measured = torch.tensor([sustained_time(lambda: program(*args), device, iters)], dtype=torch.float64,
                                device=device)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)   # one profile for all: the slowest rank's
    return InStep(float(measured.item()), priced, len(ops))


@dataclass(frozen=True)
class RuntimeStep:
    """The reference model's whole training step under the runtime (slowest rank) and its plan's price."""

    measured: float
    priced: float

    @property
    def overhead(self) -> float:
        return max(0.0, self.measured - self.priced)


def measure_runtime_step(spec: HardwareSpec, device: torch.device, iters: int, steps: int = 8) -> RuntimeStep:
    """Train the reference model data parallel over the job's ranks and time whole steps (call on every
    rank; see the module docstring). `spec`: the fitted profile, `in_step_scale` included and
    `runtime_overhead` 0 (what is measured here). `iters` runs of `steps` steps, the median run."""
    world = dist.get_world_size()
    spec = replace(spec, runtime_overhead=0.0)
    config, batch, dtype = _reference(device)
    inputs = _tokens(config, batch * world, device)   # every rank's program sees `batch` rows, as measure_in_step's
    with torch.random.fork_rng(devices=[]):
        pmodel = parallelize_spmd(_model(config, device, dtype), inputs, mesh=Mesh((world,), hardware=spec),
                                  plan=None, strategy="dp", optimizer="fused_adamw", baselines=False)
        optimizer = pmodel.optimizer(torch.optim.AdamW, lr=1e-4)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss = pmodel.train_step(*inputs)
            optimizer.step()
            loss.item()   # the loop reads the loss back, as a training loop's logging does

        for _ in range(3):
            step()
        runs = []
        for _ in range(max(iters, 3)):
            dist.barrier()   # mean_time: the same count on every rank, so each step's collectives pair up
            runs.append(mean_time(step, device, steps))
    measured = torch.tensor([float(np.median(runs))], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)   # one profile for all: the slowest rank's
    return RuntimeStep(float(measured.item()), pmodel.plan.predicted_step_time)
