"""The front door: `plan`, `autoparallelize` and `scaling`, every option explicit.

Each function checks what it was given, then hands the work to one stage of the pipeline (docs/architecture.md):
SPMD planning (`autopar.planning.spmd`), pipelined planning (`autopar.pipeline.planning`) or the
layout search (`autopar.pipeline.search`); the SPMD runtime (`autopar.runtime.module`) or the
pipelined one (`autopar.pipeline.runtime`). This module is the only one that knows both.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.nn as nn

from autopar.calibration.machine import machine_hardware
from autopar.capture.precision import MixedPrecision
from autopar.errors import InputError, MeshError
from autopar.mesh import Mesh
from autopar.pipeline.auto import plan_auto
from autopar.pipeline.planning import plan_pipelined
from autopar.pipeline.runtime import PipelinedModule, parallelize_pipelined
from autopar.plan import Plan
from autopar.planning.scaling import ScalingReport, plan_scaling
from autopar.planning.spmd import plan_spmd
from autopar.runtime.compile import resolve as resolve_compile
from autopar.runtime.cpu_memory import keep_freed_memory
from autopar.runtime.launch import broadcast_plan, device_type, init_distributed, local_device
from autopar.runtime.module import ParallelModule, parallelize_spmd

Strategy = str | dict   # "auto" | "dp" | "zero1" | "zero2" | "zero3" | "tp", or {axis name: one of these}
Budget = int | float | str | None   # bytes per device, or "80GB"
Precision = str | MixedPrecision | None
Recompute = str | Sequence[str] | None


def plan(model: nn.Module, example_inputs, *, mesh: Mesh | tuple, strategy: Strategy = "auto",
         memory_budget: Budget = None, optimizer: str = "adamw", loss_fn: Callable | None = None,
         time_limit: float | None = None, example_kwargs: dict | None = None, baselines: bool = True,
         mixed_precision: Precision = None, recompute: Recompute = None, num_stages: int | str | None = "auto",
         num_microbatches: int | None = None, schedule: str | None = None,
         virtual_stages: int | None = None, search: str = "fast", compile: bool = False) -> Plan:
    """Capture `model`'s training step, price every way to split it over `mesh`, and pick the fastest
    that fits `memory_budget` bytes per device (int or "80GB"). One process, fake tensors.

    `baselines=False` skips pricing the textbook recipes for comparison (faster; none in the plan).
    `mixed_precision="bf16"` (or a `MixedPrecision`) plans the autocast step (`autopar.capture.precision`).
    `recompute`: None/"auto" (layers recompute only when no plan fits the budget otherwise), "none",
    "all", or a list of layer paths ("transformer.h.0"); see `autopar.planning.recompute`.
    `num_stages="auto"` (the default, with strategy "auto") searches the layout: the SPMD plan on `mesh`
    and on the other shapes of its devices (one axis; dp x tp grids, tp inside a node), and pipeline x
    data x tensor layouts of the same devices that could beat them (`autopar.pipeline.auto`); the plan's
    mesh is the layout chosen ("pp" first when pipelined).
    `num_stages=p` (or a mesh whose first axis is "pp") forces a pipeline of p stages, run with
    `schedule` ("gpipe", "1f1b", "zero_bubble", "interleaved_1f1b" / "interleaved_zero_bubble" with
    `virtual_stages` chunks per device, and "zero_bubble_v": two chunks per device in a V) over
    `num_microbatches`; `num_stages=None` or 1 plans without stages on `mesh` as given.
    `search="fast"` searches pipelines only when the SPMD plan of the devices as one axis does not fit or
    is over 4x a pipeline's step bound, else, for a model that fills devices, all of them where they are
    few (up to 16 devices) or a probe (one micro-batch count, 1-D sub-meshes): planning stays within
    seconds of SPMD planning; `search="exact"` always runs the branch and bound
    over pipelines too (minutes for 8B+ models on this machine's two cores); `plan.solver["search"]`.
    `compile=True` prices each rank's program as `autoparallelize(compile=True)` runs it, compiled by Inductor
    (views free, memory-bound chains fused, the hardware's compiled per-kernel figures: docs/cost_model.md);
    False the eager FX program. The plan's summary says which (`plan.mesh.hardware.compiled`)."""
    mesh = mesh if isinstance(mesh, Mesh) else Mesh(mesh)
    mesh = mesh.for_program(_compile_flag(compile))
    if _searches(num_stages, strategy, mesh):
        return _search(model, example_inputs, mesh=mesh, memory_budget=memory_budget, optimizer=optimizer,
                       loss_fn=loss_fn, time_limit=time_limit, baselines=baselines, example_kwargs=example_kwargs,
                       mixed_precision=mixed_precision, recompute=recompute, num_microbatches=num_microbatches,
                       schedule=schedule, virtual_stages=virtual_stages, search=search)
    num_stages = None if num_stages == "auto" else num_stages   # not searched: a forced recipe or a "pp" axis
    if _stage_count(num_stages) > 1 or "pp" in mesh.axis_names:
        return plan_pipelined(model, example_inputs, mesh=mesh, num_stages=num_stages,
                              num_microbatches=num_microbatches, schedule=schedule, virtual_stages=virtual_stages,
                              example_kwargs=example_kwargs, loss_fn=loss_fn, strategy=strategy,
                              memory_budget=memory_budget, optimizer=optimizer, time_limit=time_limit,
                              baselines=baselines, mixed_precision=mixed_precision, recompute=recompute)
    _reject_pipeline_options("plan", num_microbatches, schedule, virtual_stages)
    return plan_spmd(model, example_inputs, mesh=mesh, strategy=strategy, memory_budget=memory_budget,
                     optimizer=optimizer, loss_fn=loss_fn, time_limit=time_limit, example_kwargs=example_kwargs,
                     baselines=baselines, mixed_precision=mixed_precision, recompute=recompute)


def autoparallelize(model: nn.Module, example_inputs, *, mesh: Mesh | tuple | None = None,
                    strategy: Strategy = "auto", memory_budget: Budget = None, plan: Plan | None = None,
                    loss_fn: Callable | None = None, example_kwargs: dict | None = None, optimizer: str = "adamw",
                    time_limit: float | None = None, verify: bool = False,
                    init_fn: Callable[[nn.Module], None] | None = None, device: str | None = None,
                    baselines: bool | None = None, mixed_precision: Precision = None,
                    recompute: Recompute = None, num_stages: int | str | None = "auto", num_microbatches: int | None = None,
                    schedule: str | None = None, virtual_stages: int | None = None, search: str = "fast",
                    compile: bool | str | None = None) -> ParallelModule | PipelinedModule:
    """Plan (or reuse `plan`), rewrite and return a module that trains on this rank of the job.

    `mesh=None`: a 1-D mesh over the torchrun world, priced on a given plan's hardware, else on CPU
    this machine's profile (measured at the first job and cached: `autopar.calibration.machine`),
    on CUDA the h100 preset. A model on the meta device is materialised
    module by module (`init_fn(module)`; default: a transformers model's own `_init_weights`, else torch.nn
    layers' reset_parameters; a tensor left unset is warned about and holds NaN), each rank keeping
    only its shards; see `autopar.runtime.materialize`. `device`: "cpu" (gloo), "cuda" (NCCL) or None
    (CUDA when this machine has it). `verify=True` checks the IR between passes (autopar/ir.py).
    `baselines` (price the textbook recipes for the plan's comparison table) defaults to yes for SPMD
    plans and the layout search, no for a forced pipeline (a recipe there is a solve per stage layout).
    `compile=True` runs each rank's program (each stage's, pipelined: its forward, backward and once-per-step
    ZeRO-1/2 gather programs) as code Inductor generates at the first step; `compile="cudagraphs"` also replays
    that code as CUDA graphs (Inductor's cudagraph trees; CUDA only, else InputError; every step must feed the
    same shapes, else InputError); None takes the faster measured choice for the device type
    (`autopar.runtime.compile`, docs/performance.md). `repr(pmodel)` and `pmodel.compile_seconds` report the
    first step's compile time; Inductor's FX graph cache serves a restarted job with the same program.
    The plan made here is priced for the program that runs (`plan(..., compile=)`); a given `plan` keeps its
    own pricing.
    The other options are `plan`'s."""
    _, world = init_distributed(device)
    compile = resolve_compile(compile, device_type())
    if device_type() == "cpu":
        keep_freed_memory()  # else glibc page-faults every step's activations in again (runtime/cpu_memory.py)
    mesh = _world_mesh(mesh, world, plan, bool(compile)).for_program(
        bool(compile) if plan is None else plan.mesh.hardware.compiled)
    if plan is None and _searches(num_stages, strategy, mesh):  # search; the plan brings its mesh, micro-batches, schedule
        plan = broadcast_plan(lambda: _search(
            model, example_inputs, mesh=mesh, memory_budget=memory_budget, optimizer=optimizer, loss_fn=loss_fn,
            time_limit=time_limit, baselines=baselines is not False, example_kwargs=example_kwargs,
            mixed_precision=mixed_precision, recompute=recompute, num_microbatches=num_microbatches,
            schedule=schedule, virtual_stages=virtual_stages, search=search))
        mesh, num_stages, num_microbatches, schedule = plan.mesh, None, None, None
        recompute = None if plan.stages and not plan.recompute else recompute
    num_stages = None if num_stages == "auto" else num_stages   # not searched: a given plan, a forced recipe, a "pp" axis
    if _stage_count(num_stages) > 1 or "pp" in mesh.axis_names or (plan is not None and bool(plan.stages)):
        return parallelize_pipelined(
            model, example_inputs, mesh=mesh, plan=plan, num_stages=num_stages, num_microbatches=num_microbatches,
            schedule=schedule, virtual_stages=virtual_stages, example_kwargs=example_kwargs, loss_fn=loss_fn,
            verify=verify, device_type=device_type(), device=local_device(), broadcast=broadcast_plan,
            mixed_precision=mixed_precision, recompute=recompute, strategy=strategy, memory_budget=memory_budget,
            optimizer=optimizer, time_limit=time_limit, baselines=bool(baselines), init_fn=init_fn, compile=compile)
    _reject_pipeline_options("autoparallelize", num_microbatches, schedule, virtual_stages)
    return parallelize_spmd(model, example_inputs, mesh=mesh, plan=plan, example_kwargs=example_kwargs,
                            loss_fn=loss_fn, strategy=strategy, memory_budget=memory_budget, optimizer=optimizer,
                            time_limit=time_limit, baselines=baselines is not False, mixed_precision=mixed_precision,
                            recompute=recompute, verify=verify, init_fn=init_fn, compile=compile)


def scaling(model: nn.Module, example_inputs, *, devices: Sequence[int] = (1, 2, 4, 8), hardware="cpu",
            memory_budget: Budget = None, threshold: float = 0.5, devices_per_node: int | None = None,
            optimizer: str = "adamw", loss_fn: Callable | None = None,
            time_limit: float | None = None) -> ScalingReport:
    """Plan `model` on each device count of `devices` (strong scaling: the batch of `example_inputs`
    is split among them) on `hardware` (a preset name or a HardwareSpec), and say where adding
    devices stops paying: the first count whose efficiency falls below `threshold` or whose
    throughput does not rise (`autopar.planning.scaling`). Each count is planned by the layout search
    (`plan`'s default: SPMD plans and, where the devices as one axis do not fit, pipelines), from one
    capture. `.rows`, `.stop_at`, `.reason`, `.plot()`."""
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)

    def search(captured, mesh: Mesh, budget) -> Plan:
        return plan_auto(model, inputs, mesh=mesh, memory_budget=budget, optimizer=optimizer, loss_fn=loss_fn,
                         time_limit=time_limit, baselines=False, captured=captured)
    return plan_scaling(model, example_inputs, devices=devices, hardware=hardware, memory_budget=memory_budget,
                        threshold=threshold, devices_per_node=devices_per_node, optimizer=optimizer,
                        loss_fn=loss_fn, time_limit=time_limit, planner=search)


# ---------------------------------------------------------------- option checks
def _compile_flag(compile) -> bool:
    if not isinstance(compile, bool):
        raise InputError(f"compile={compile!r}: pass True to price the Inductor-compiled program, False the eager one")
    return compile


def _searches(num_stages, strategy, mesh: Mesh) -> bool:
    """The layout search runs for num_stages="auto" with strategy "auto" on a mesh of 2 or more devices
    without a "pp" axis (a forced recipe, a "pp" axis or a stage count plan as told; one device has no
    layout to search, and its SPMD plan then comes from the runtime's own capture)."""
    return num_stages == "auto" and strategy == "auto" and "pp" not in mesh.axis_names and mesh.size > 1


def _search(model, example_inputs, *, mesh: Mesh, memory_budget, optimizer, loss_fn, time_limit, baselines,
            example_kwargs, mixed_precision, recompute, num_microbatches, schedule, virtual_stages,
            search: str = "fast") -> Plan:
    if virtual_stages is not None:
        raise InputError("virtual_stages applies to a forced pipeline (num_stages=p); with num_stages='auto' "
                         "the search prices the interleaved schedules with their own chunk count")
    return plan_auto(model, example_inputs, mesh=mesh, memory_budget=memory_budget, optimizer=optimizer,
                     loss_fn=loss_fn, time_limit=time_limit, example_kwargs=example_kwargs, baselines=baselines,
                     mixed_precision=mixed_precision, recompute=recompute, num_microbatches=num_microbatches,
                     schedule=schedule, search=search)


def _stage_count(num_stages) -> int:
    if num_stages is None or num_stages == "auto":   # "auto" with a forced recipe: no stages
        return 1
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise InputError(f"num_stages={num_stages!r}: pass a number of pipeline stages (>= 1) or 'auto'")
    return num_stages


def _reject_pipeline_options(where: str, num_microbatches, schedule, virtual_stages) -> None:
    """Micro-batches, a schedule and chunks per device mean nothing without pipeline stages."""
    for key, value in (("num_microbatches", num_microbatches), ("schedule", schedule),
                       ("virtual_stages", virtual_stages)):
        if value not in (None, 1):
            raise InputError(f"{key}={value!r} applies to pipelined plans only: pass num_stages=2 or more, or a "
                             f"mesh with a 'pp' axis (in {where}())")


def _world_mesh(mesh, world: int, plan: Plan | None, compiled: bool) -> Mesh:
    if mesh is None:
        if plan is not None:
            return Mesh((world,), hardware=plan.mesh.hardware)
        return Mesh((world,), hardware=machine_hardware(world, compiled) if device_type() == "cpu" else "h100")
    mesh = mesh if isinstance(mesh, Mesh) else Mesh(mesh)
    if mesh.size != world:
        raise MeshError(f"the mesh has {mesh.size} devices ({mesh}) but this job has {world} ranks; "
                        f"launch with torchrun --nproc_per_node {mesh.size} or pass a mesh of {world}")
    return mesh
