"""The pipelined program: `autoparallelize(..., num_stages=p)` -> a PipelinedModule on this rank.

Every rank captures the MICRO-BATCH graph, rewrites it with the SPMD passes for its coordinates on the
sub-mesh (every axis but "pp"), and cuts it into stage programs (`passes/split_stages.py`). It keeps
its own stage: its parameters (DTensors on the sub-mesh, nowhere else) and a `StageModule`
(autopar/pipeline/stage_module.py) that runs the stage's programs: a once-per-step `gather` program for
ZeRO-1/2 parameters (the gathered copies kept for the step's micro-batches and freed after the schedule: one
gather per step, as the cost model prices; ZeRO-3 parameters are gathered inside every forward and backward
program, per micro-batch, as priced), then per micro-batch the forward program (saving what its backward
reads) and the backward program (boundary gradients in, input-activation and parameter gradients out); under
`compile=True` each of them is Inductor's code (`autopar.runtime.compile`). torch.distributed.pipelining's
PipelineStage and ScheduleGPipe / Schedule1F1B run
the micro-batches; an interleaved plan (p*v chunks, rank d holding chunks d, d+p, ...) builds one
PipelineStage per chunk it holds and runs them with ScheduleInterleaved1F1B (zero bubble V: chunks d and
2p - 1 - d, ScheduleZBVZeroBubble; rank 0 then runs the first and the last chunk, the loss). A parameter used by
several stages (a tied embedding) lives once on each rank that holds one of them (shared by that
rank's chunks, whose contributions autograd sums) and its gradient is all-reduced between those
ranks after the schedule (Megatron's embedding group).

Gradient all-reduces run once per step, not once per micro-batch: `defer_grad_reductions_pass` takes
them out of the program before the split, each stage's backward leaves those gradients Partial,
p.grad sums them over the micro-batches, and `train_step` all-reduces them after the schedule in flat
buckets per process group (as DDP's no_sync + one reduction; what the cost model prices). Gradient
reduce-scatters (ZeRO) stay in every micro-batch's backward: accumulating unsharded gradients would
cost the memory ZeRO saves.

`train_step(*inputs)` returns the mean loss over the micro-batches (the full-batch loss for a mean
loss) on every rank and leaves gradients, averaged over micro-batches, in p.grad for
optimizer.step(). Calling the module (`pmodel(*inputs)`) is a forward-only evaluation: the loss, no
gradients. Of a meta-device model each rank builds only the modules that own its stages' tensors, one
at a time (`autopar.runtime.materialize`), each from a seed shared by every rank, and keeps its shards.
A bf16 plan's graph is captured under its policy (`autopar.capture.precision`); a recompute plan's
layers are re-run inside the stages' backward programs (`passes/recompute.py`, before the split).
`state_dict()` holds this rank's tensors under the model's keys (`autopar.runtime.state`);
`load_state_dict` takes the model's full state dict (each rank keeps its stages' part); `load_safetensors` / `save_safetensors` read and write pretrained weights. Only the
first pipeline rank's stage reads the inputs (labels travel to the loss with the activations):
`needs_inputs` says whether this rank's do; elsewhere the inputs may be None, left out or anything,
and are ignored. A rank passes the global batch or its data-parallel slice
(`autopar/runtime/batch.py`: rank r's slice stands for its r-th part of each micro-batch).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import distribute_tensor

from autopar import _torch_compat as compat
from autopar.capture import precision
from autopar.capture.canonicalize import canonicalize
from autopar.capture.trace import capture
from autopar.errors import InputError
from autopar.graph import NAME, VAL
from autopar.mesh import Mesh
from autopar.passes import PassContext, run_passes
from autopar.passes.context import parse_spec
from autopar.passes.defer_grad_reductions import defer_grad_reductions_pass
from autopar.passes.ops import start_all_reduce, wait_buckets
from autopar.passes.split_stages import StageProgram, split_stages
from autopar.passes.split_weight_grads import with_weight_split
from autopar.pipeline import planning as pp
from autopar.pipeline.stage_module import StageModule
from autopar.pipeline.stages import V_SHAPED, ZERO_BUBBLES, chunk_device
from autopar.plan import Plan
from autopar.planning.spmd import fingerprint
from autopar.runtime import checkpoint, optim, safetensors_io, state
from autopar.runtime import compile as compiling
from autopar.runtime.batch import BatchLayout, DataParallelInputs, input_reads
from autopar.runtime.materialize import is_meta, model_tensors
from autopar.runtime.tensors import get_tensor, set_tensor

# zero bubble is torch's ZB1P (ScheduleInterleavedZeroBubble) on one chunk per device, interleaved zero bubble the
# same on v chunks per device, zero bubble V torch's ZB-V (two chunks per device in a V)
SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
                    "zero_bubble": ScheduleInterleavedZeroBubble,
                    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble, "zero_bubble_v": ScheduleZBVZeroBubble}
# schedules that take a list of this rank's PipelineStages
MULTI_STAGE = ("interleaved_1f1b", "zero_bubble", "interleaved_zero_bubble", "zero_bubble_v")
SPLIT_BACKWARD = ZERO_BUBBLES   # schedules that run B and W apart (passes/split_weight_grads.py)


def parallelize_pipelined(model: nn.Module, example_inputs: tuple, *, mesh: Mesh, plan: Plan | None,
                          num_stages=None, num_microbatches=None, schedule=None, virtual_stages=None,
                          example_kwargs=None, loss_fn=None, verify: bool = False, device_type: str = "cpu",
                          device: str = "cpu", broadcast=None, mixed_precision=None, recompute=None,
                          strategy="auto", memory_budget=None, optimizer: str = "adamw", time_limit=None,
                          baselines: bool = False, init_fn=None, compile: bool | str = False) -> "PipelinedModule":
    """The pipelined branch of `autopar.autoparallelize` (called with the resolved mesh of the world)."""
    policy = precision.resolve_with_plan(mixed_precision, plan)  # None: fp32
    if plan is not None and num_stages is None:
        num_stages = plan.mesh.shape[0]
    mesh = plan.mesh if plan is not None else pp.pipeline_mesh(mesh, num_stages)
    if plan is not None and virtual_stages not in (None, pp.chunks_per_device(plan)):
        raise InputError(f"virtual_stages={virtual_stages} but the plan has {pp.chunks_per_device(plan)} chunks per "
                         "device; drop virtual_stages or re-plan")
    m, schedule, v = pp.schedule_options(mesh.shape[0], num_microbatches or (plan.num_microbatches if plan else None),
                                schedule or (plan.schedule if plan else None),
                                virtual_stages or (pp.chunks_per_device(plan) if plan else None))
    micro = pp.microbatch(tuple(example_inputs), m)
    micro_kwargs = pp.microbatch((example_kwargs,), m)[0] if example_kwargs else example_kwargs
    captured = capture(model, micro, example_kwargs=micro_kwargs, loss_fn=loss_fn, mixed_precision=policy)
    canonicalize(captured.gm)
    if plan is None:
        plan = broadcast(lambda: pp.plan_pipelined_captured(captured, model, micro, mesh=mesh, num_microbatches=m,
                                                            schedule=schedule, virtual_stages=v, strategy=strategy,
                                                            memory_budget=memory_budget, optimizer=optimizer,
                                                            time_limit=time_limit, baselines=baselines,
                                                            recompute=recompute))
    plan.check_matches(fingerprint(captured, mesh), mesh)
    device_mesh = init_device_mesh(device_type, tuple(mesh.shape), mesh_dim_names=tuple(mesh.axis_names))
    sub_dm = device_mesh[tuple(mesh.axis_names[1:])]
    coords = tuple(device_mesh.get_coordinate())
    stage_plan = pp.stage_plan(plan)
    ctx = PassContext(stage_plan, tuple(mesh.shape[1:]), coords=coords[1:],
                      group_names=tuple(sub_dm.get_group(a).group_name for a in range(mesh.ndim - 1)),
                      grad_names=tuple(captured.grad_param_names), device=device,
                      disabled=frozenset({"bucket_collectives"})  # a bucket must not mix two stages' grads
                      | compiling.disabled_passes(compile, device_type))
    reads = input_reads(captured, stage_plan)  # before the passes rewrite the inputs' users
    gm = run_passes(captured.gm, ctx, verify=verify)
    gm = defer_grad_reductions_pass(gm, ctx)   # gradient all-reduces: once per step, in train_step
    units = [list(s.modules) for s in plan.stages]
    programs = split_stages(gm, units, [u for s in units for u in s], list(captured.grad_param_names))
    if plan.schedule in SPLIT_BACKWARD:
        programs = [with_weight_split(p) for p in programs]
    programs = [compiling.compile_stage(p, compile, device_type) for p in programs] if compile else programs
    return PipelinedModule(model, captured, plan, programs, device_mesh, sub_dm, coords, stage_plan, device,
                           init_fn=init_fn, input_reads=reads)


class PipelinedModule(DataParallelInputs, nn.Module):
    """This rank's stages of a pipelined plan (one, or v chunks when interleaved): `.train_step(*inputs)
    -> loss`, `pmodel(*inputs)` (eval), `.plan`, `.full_state_dict()`. Only this rank's parameters are
    registered, each once (optimizers see them). `.needs_inputs`, `.data_parallel_rank` / `_size` and
    `.distributed_sampler(dataset)` say what this rank feeds."""

    def __init__(self, model, captured, plan: Plan, programs: list[StageProgram], device_mesh, sub_dm, coords,
                 stage_plan: Plan, device: str, init_fn=None, input_reads=None):
        super().__init__()
        self.plan = plan
        checkpoint.register_hooks(self)  # strided shards leave state_dict() as plain shards (DCP-savable)
        object.__setattr__(self, "device_mesh", device_mesh)
        object.__setattr__(self, "sub_mesh", sub_dm)
        self._pp_rank, self._num_ranks = coords[0], plan.mesh.shape[0]
        # chunks d, d + p, ... (in a V: d and 2p - 1 - d), and the rank of the last one, which runs the loss
        self._chunks = [k for k in range(len(programs)) if self._rank_of(k) == self._pp_rank]
        self._loss_rank = self._rank_of(len(programs) - 1)
        self._per_stage = device_mesh.size() // self._num_ranks
        self._m, self._device = plan.num_microbatches, torch.device(device)
        self._input_names = list(captured.input_names)
        inputs = captured.placeholders("input")
        self.batch_layout = BatchLayout(self._input_names,
                                        [(int(n.meta[VAL].shape[0]) * self._m, *n.meta[VAL].shape[1:]) for n in inputs],
                                        [parse_spec(stage_plan.nodes[n.name].outs[0]) for n in inputs], coords[1:],
                                        tuple(sub_dm.shape), mesh=sub_dm, microbatches=self._m, reads=input_reads)
        names = [*captured.param_names, *captured.buffer_names]
        self._state, self._owner = state.state_entries(model, names), _owners(programs, self._rank_of, names)
        params, buffers = self._distribute(model, captured, [programs[k] for k in self._chunks], stage_plan, init_fn)
        state.install(self, self._state)   # state_dict(): the model's keys this rank holds; loads the model's
        last = len(programs) - 1
        object.__setattr__(self, "_stages", [StageModule(programs[k], params, buffers, k == last, sub_dm)
                                             for k in self._chunks])
        self._shared = _shared_groups(programs, self._pp_rank, self._rank_of, self._per_stage, coords[1:], sub_dm)
        self._deferred = _deferred_by_axis([programs[k] for k in self._chunks])
        pipes = [self._pipeline_stage(programs[k], mod, k, len(programs), sub_dm)
                 for k, mod in zip(self._chunks, self._stages)]
        # scale_grads=False: train_step divides each gradient by m once (torch scales per stage, which
        # would divide a parameter shared by two chunks of this rank twice)
        cls, stages = SCHEDULE_CLASSES[plan.schedule], pipes if plan.schedule in MULTI_STAGE else pipes[0]
        schedule = cls(stages, self._m, loss_fn=_loss_is_output, scale_grads=False)
        object.__setattr__(self, "_schedule", schedule)
        # forward-only evaluation: the same schedule, but a V's forwards alone (torch's eval of it fails)
        evaluate = compat.forward_only_schedule(cls, stages, self._m, loss_fn=_loss_is_output, scale_grads=False) \
            if plan.schedule in V_SHAPED else schedule
        object.__setattr__(self, "_evaluate", evaluate)

    def _distribute(self, model, captured, programs: list[StageProgram], stage_plan: Plan,
                    init_fn) -> tuple[dict, dict]:
        """This rank's parameters and buffers (those its programs read, and those it owns: `_owners`), each
        distributed once over the sub-mesh; of a meta-device model only the modules owning them are built,
        one at a time, each from a seed every rank shares (`_shared_seed`): a tensor two stages hold (a
        tied embedding) gets the same values on both."""
        buffer_nodes = {n.meta[NAME]: n.name for n in captured.placeholders("buffer")}
        mine = {n for prog in programs for n in [*prog.params, *prog.buffers]}
        mine |= {n for n, owner in self._owner.items() if owner == self._pp_rank}
        specs = {n: list(parse_spec(stage_plan.params[n].master)) for n in captured.param_names if n in mine}
        specs.update({n: list(parse_spec(stage_plan.nodes[buffer_nodes[n]].outs[0]))
                      for n in captured.buffer_names if n in mine})
        grad = {n: p.requires_grad for n, p in model.named_parameters()}
        persistent = {n for e in self._state for n in e.names}
        params, buffers = {}, {}
        wanted = sorted(specs, key=lambda n: (n not in grad, n))
        for name, full in model_tensors(model, wanted, init_fn, self._device, seed=_shared_seed(model, self._device)):
            dt = distribute_tensor(full, self.sub_mesh, specs[name])
            table = params if name in grad else buffers
            table[name] = nn.Parameter(dt, requires_grad=grad[name]) if name in grad else dt
            set_tensor(self, name, table[name], param=name in grad, persistent=name in persistent)
        return params, buffers

    def _pipeline_stage(self, program: StageProgram, module, index: int, num_chunks: int, sub_dm) -> PipelineStage:
        ins = _examples(program, program.inputs, sub_dm, self._device)
        outs = _examples(program, program.outputs, sub_dm, self._device)
        if module._is_last:
            outs = (torch.empty((), device=self._device, requires_grad=True),)
        return PipelineStage(module, index, num_chunks, self._device, input_args=ins, output_args=outs,
                             group=self.device_mesh.get_group(0),
                             dw_builder=module.weight_runner if program.backward_weight is not None else None)

    def _rank_of(self, chunk: int) -> int:
        """The pipeline rank running chunk `chunk` (`stages.chunk_device`)."""
        return chunk_device(self.plan.schedule, self._num_ranks, chunk)

    # ------------------------------------------------------------------ running
    @property
    def needs_inputs(self) -> bool:
        """True on the ranks of the first pipeline stage, the only ones whose program reads the inputs."""
        return self._pp_rank == 0

    def _stage_inputs(self, inputs: tuple, kwargs: dict) -> list[torch.Tensor]:
        """Stage 0's arguments: of each micro-batch this rank's block, re-joined along dim 0 (the schedule
        cuts them again into the same micro-batches)."""
        inputs = tuple(inputs) + tuple(kwargs[n] for n in self._input_names[len(inputs):] if n in kwargs)
        return self.batch_layout.local_inputs(inputs, self._device)

    def _run(self, inputs: tuple, kwargs: dict, train: bool) -> torch.Tensor:
        args = self._stage_inputs(inputs, kwargs) if self._pp_rank == 0 else []
        last = self._pp_rank == self._loss_rank   # the last chunk's rank
        losses: list = []
        extra = dict(target=torch.zeros(self._m), losses=losses, return_outputs=False) if last else {}
        for stage in self._stages:   # ZeRO-1/2 gathers: once per step, kept for every micro-batch
            stage.begin_step()
        try:
            (self._schedule.step if train else self._evaluate.eval)(*args, **extra)
        finally:
            for stage in self._stages:
                stage.end_step()
        if train:   # before the world-wide broadcast: a stage that drains early reduces while others finish
            self._reduce_deferred()
        loss = torch.stack([x.detach() for x in losses]).mean() if last else torch.zeros(())
        dist.broadcast(loss, src=self._loss_rank * self._per_stage)  # one source for the whole world
        return loss

    def train_step(self, *inputs, **kwargs) -> torch.Tensor:
        """Forward and backward of every micro-batch: returns the mean loss (same on every rank);
        gradients (micro-batch mean, shared parameters summed across their stages) are added to p.grad,
        as `loss.backward()` adds them (call `optimizer.zero_grad()` between steps unless accumulating)."""
        earlier = {}   # gradients of earlier calls: the schedule sums micro-batches into p.grad, then scales
        for name, param in self.named_parameters():
            if param.grad is not None:
                earlier[name], param.grad = param.grad, None
        loss = self._run(inputs, kwargs, train=True)
        for param in self.parameters():
            if param.grad is not None:
                param.grad.div_(self._m)   # the mean over micro-batches
        for name, group in self._shared:
            grad = self.get_parameter(name).grad
            if grad is not None:
                dist.all_reduce(grad.to_local(), group=group)
        for name, grad in earlier.items():
            param = self.get_parameter(name)
            param.grad = grad if param.grad is None else grad.add_(param.grad)
        return loss

    def _reduce_deferred(self) -> None:
        """The gradient all-reduces the stage programs left out (passes/defer_grad_reductions.py), once per
        step on the micro-batches' summed partial gradients: per mesh axis, one bucketed all-reduce per
        process group (25 MB flat buckets, passes/ops.py), axis after axis (a gradient reduced on two), in the
        plan's reduce dtype where it is narrower (cast down for the collective, back into p.grad after)."""
        for axis, groups in self._deferred:
            pending = []
            for (group, dtype), names in groups:
                grads = [self.get_parameter(n).grad.to_local() for n in names]
                wire = grads if dtype is None else [g.to(getattr(torch, dtype)) for g in grads]
                pending.append((grads, start_all_reduce(wire, "sum", group)))
            for grads, flight in pending:
                for g, summed in zip(grads, wait_buckets(flight)):
                    g.copy_(summed)

    def forward(self, *inputs, **kwargs) -> torch.Tensor:
        """Forward-only evaluation of every micro-batch: the mean loss, no gradients."""
        with torch.no_grad():
            return self._run(inputs, kwargs, train=False)

    @property
    def compile_seconds(self) -> float | None:
        """Inductor's compile time of this rank's stage programs (None: eager, or not compiled yet)."""
        return compiling.compile_seconds(self.programs())

    def extra_repr(self) -> str:
        return compiling.describe(self.programs())

    def programs(self) -> list:
        """What runs this rank's stages: each one's gather (if any), forward and backward program (zero bubble:
        its B and W programs instead of the whole backward; the first stage's B, which has no op, left out)."""
        out = []
        for s in self._stages:
            prog = s.program
            split = prog.backward_input is not None
            out += [g for g in (prog.gather, prog.forward, *((prog.backward_input, prog.backward_weight) if split
                                                             else (prog.backward,)))
                    if g is not None and compiling.runs_ops(g)]
        return out

    def optimizer(self, cls: type = torch.optim.AdamW, params=None, **options) -> torch.optim.Optimizer:
        """This rank's parameters' optimizer stepping local shards; see `ParallelModule.optimizer`. Its
        `clip_grad_norm_` counts every stage's gradients (a parameter shared by stages, once)."""
        shared = [self.get_parameter(n) for n, _ in self._shared if self._owner[n] != self._pp_rank]
        return optim.local_shard_optimizer(cls, self.parameters() if params is None else params, uncounted=shared,
                                           **options)

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """`model.state_dict()` of the unmodified model, every stage's tensors unsharded (tied keys too), on
        every rank: a collective. It loads into the model with `strict=True`."""
        mine = state.full_tensors(self, [e for e in self._state if self._owner[e.name] == self._pp_rank])
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        merged = {k: v for part in everyone for k, v in part.items()}
        return {n: merged[n] for e in self._state for n in e.names}

    def load_safetensors(self, path, *, strict: bool = True) -> None:
        """Pretrained weights from safetensors, each rank reading its slices; see `ParallelModule.load_safetensors`."""
        safetensors_io.load(self, self._state, path, strict=strict)

    def save_safetensors(self, path, *, max_shard_bytes: int | None = None) -> None:
        """The unsharded model in safetensors, streamed by rank 0; see `ParallelModule.save_safetensors`."""
        safetensors_io.save(self._state, self._gather, path, max_shard_bytes=max_shard_bytes)

    def _gather(self, entry: state.StateEntry) -> torch.Tensor | None:
        """One unsharded tensor on rank 0: all-gathered on the sub-mesh of the pipeline rank owning it, then
        sent to rank 0 from that sub-mesh's first rank."""
        owner = self._owner[entry.name]
        src, rank = owner * self._per_stage, dist.get_rank()
        full = get_tensor(self, entry.name).full_tensor().detach() if self._pp_rank == owner else None
        if src != 0 and rank == src:
            dist.send(full.contiguous(), 0)
        elif src != 0 and rank == 0:
            full = torch.empty(entry.shape, dtype=entry.dtype, device=self._device)
            dist.recv(full, src)
        return full if rank == 0 else None


def _shared_seed(model, device) -> int | None:
    """For a meta-device model: rank 0's seed (`torch.initial_seed()`), the base of every module's
    init generator (`autopar.runtime.materialize.module_seed`); None for a real model (nothing drawn)."""
    if not is_meta(model):
        return None
    seed = torch.tensor([torch.initial_seed() % 2 ** 62], dtype=torch.int64, device=device)
    dist.broadcast(seed, src=0)
    return int(seed.item())


def _owners(programs: list[StageProgram], rank_of, names: list[str]) -> dict[str, int]:
    """The pipeline rank that owns each parameter or buffer in a state dict: the lowest whose chunks read
    it (a tied one lives on each that reads it), rank 0 for one no program reads (an unused pooler).
    `rank_of(k)`: chunk k's pipeline rank."""
    owner: dict[str, int] = {}
    for prog in programs:
        for n in [*prog.params, *prog.buffers]:
            owner[n] = min(owner.get(n, len(programs)), rank_of(prog.index))
    return {n: owner.get(n, 0) for n in names}


def _examples(program: StageProgram, names: list[str], sub_dm, device) -> tuple:
    """Empty tensors of the local shape and dtype of boundary values: PipelineStage's static metadata
    (its dynamic inference runs a stage on uninitialised buffers, which index ops cannot take)."""
    from autopar.placement import local_shape
    out = []
    for name in names:
        shape, dtype, spec = program.values[name]
        local = local_shape(spec, shape, tuple(sub_dm.shape)) if spec is not None else shape
        t = torch.empty(local, dtype=dtype, device=device)
        out.append(t.requires_grad_(True) if program.differentiable[name] else t)
    return tuple(out)


def _loss_is_output(output, target):
    return output


def _flat(coords, sub_dm) -> int:
    index = 0
    for c, n in zip(coords, sub_dm.shape):
        index = index * n + c
    return index


def _deferred_by_axis(programs: list[StageProgram]) -> list[tuple[int, list[tuple[tuple, list[str]]]]]:
    """[(axis, [((group name, wire dtype or None), parameter names)])], axes and names sorted: the deferred
    gradient all-reduces of this rank's chunks (a parameter two chunks share, once), in an order every
    rank of a group shares."""
    by_axis: dict[int, dict[tuple, set[str]]] = {}
    for prog in programs:
        for d in prog.deferred:
            key = (d["group"], d.get("dtype"))
            by_axis.setdefault(d["axis_index"], {}).setdefault(key, set()).add(d["param"])
    return [(axis, [(key, sorted(names)) for key, names in sorted(by_axis[axis].items(), key=lambda kv: str(kv[0]))])
            for axis in sorted(by_axis)]


def _shared_groups(programs, pp_rank: int, rank_of, per_stage: int, coords, sub_dm) -> list:
    """(param, process group of its copies at this sub-mesh coordinate) for each parameter that chunks
    on several pipeline ranks share (chunk k runs on rank `rank_of(k)`; chunks of one rank share one
    copy). Every rank creates every group, in the same order (new_group's rule)."""
    owners: dict[str, set[int]] = {}
    for prog in programs:
        for name in prog.shared_params:
            owners.setdefault(name, set()).add(rank_of(prog.index))
    mine, index = [], _flat(coords, sub_dm)
    for name in sorted(n for n, ranks in owners.items() if len(ranks) > 1):
        for j in range(per_stage):
            group = dist.new_group([k * per_stage + j for k in sorted(owners[name])])
            if j == index and pp_rank in owners[name]:
                mine.append((name, group))
    return mine
