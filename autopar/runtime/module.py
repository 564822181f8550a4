"""The SPMD runtime: `ParallelModule`, the per-rank program under torchrun (`autopar.autoparallelize`).

Parameters are DTensors on a DeviceMesh built from the world and the plan's mesh, placed as the
plan's master specs, so an unmodified torch.optim optimizer steps on local shards and
torch.distributed.checkpoint / full_tensor() work. A forward call runs the rewritten joint graph on
local shards (inputs: every rank passes the same global batch and keeps its planned block, or its own
data-parallel slice: `autopar/runtime/batch.py`) and returns the loss; backward hands the graph's
gradients (already reduced to each master spec) to autograd, which fills `p.grad` as DTensors.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import distribute_tensor

from autopar import _torch_compat as compat
from autopar.capture import precision
from autopar.capture.canonicalize import canonicalize
from autopar.capture.trace import capture
from autopar.graph import VAL
from autopar.mesh import Mesh
from autopar.passes import PassContext, run_passes
from autopar.passes.context import parse_spec
from autopar.plan import Plan
from autopar.planning.spmd import fingerprint, plan_captured
from autopar.runtime import checkpoint, optim, safetensors_io, state
from autopar.runtime import compile as compiling
from autopar.runtime.batch import BatchLayout, DataParallelInputs, input_reads
from autopar.runtime.launch import broadcast_plan, device_type, local_device
from autopar.runtime.materialize import is_meta, stream_tensors
from autopar.runtime.tensors import distinct, get_tensor, is_unit_seed, owner_of, set_tensor


def parallelize_spmd(model: nn.Module, example_inputs: tuple, *, mesh: Mesh, plan: Plan | None, example_kwargs=None,
                     loss_fn=None, strategy="auto", memory_budget=None, optimizer: str = "adamw", time_limit=None,
                     baselines: bool = True, mixed_precision=None, recompute=None, verify: bool = False,
                     init_fn=None, compile: bool | str = False) -> "ParallelModule":
    """The SPMD branch of `autopar.autoparallelize` (autopar/api.py), in a joined process group whose
    world is `mesh`: capture, plan on rank 0 (or check `plan`), rewrite for this rank, place the weights."""
    policy = precision.resolve_with_plan(mixed_precision, plan)  # None: fp32
    captured = capture(model, example_inputs, example_kwargs=example_kwargs, loss_fn=loss_fn,
                       mixed_precision=policy)
    canonicalize(captured.gm)
    if plan is None:
        plan = broadcast_plan(lambda: plan_captured(captured, model, example_inputs, mesh=mesh, strategy=strategy,
                                                    memory_budget=memory_budget, optimizer=optimizer,
                                                    time_limit=time_limit, baselines=baselines,
                                                    recompute=recompute))
    plan.check_matches(fingerprint(captured, mesh), mesh)
    device_mesh = init_device_mesh(device_type(), tuple(mesh.shape), mesh_dim_names=tuple(mesh.axis_names))
    ctx = PassContext(plan, tuple(mesh.shape), coords=tuple(device_mesh.get_coordinate()),
                      group_names=tuple(device_mesh.get_group(a).group_name for a in range(mesh.ndim)),
                      grad_names=tuple(captured.grad_param_names), device=local_device(),
                      disabled=compiling.disabled_passes(compile, device_type()))
    reads = input_reads(captured, plan)  # before the passes rewrite the inputs' users
    gm = run_passes(captured.gm, ctx, verify=verify)
    return ParallelModule(model, captured, plan, gm, device_mesh, ctx, init_fn=init_fn, input_reads=reads,
                          compile=compile)


class JointStepFunction(torch.autograd.Function):
    """Runs the per-rank joint graph in forward; its backward returns the graph's gradients.

    It takes the DTensor parameters themselves and hands the graph their local shards; its backward
    returns DTensor gradients (each parameter's placements), so no per-parameter `to_local()` node
    and from_local round trip sits between the step and AccumulateGrad (the step_time GPT's 52
    parameters, one process: 7-16 ms -> 1.3-1.6 ms per step).
    """

    @staticmethod
    def forward(fctx, runner, num_params, *args):
        params = args[:num_params]
        loss, fctx.grads = runner._run_graph(params, args[num_params:])
        fctx.specs = [compat.dtensor_spec(p) for p in params]
        fctx.num_rest = len(args) - num_params
        return loss.detach().clone()

    @staticmethod
    def backward(fctx, g):
        if is_unit_seed(g):  # loss.backward() seeds 1: skip a pass over every gradient
            grads = distinct(fctx.grads)
        else:
            grads = [None if gr is None else gr * g for gr in fctx.grads]
        grads = [None if gr is None else compat.dtensor_grad(gr, spec) for gr, spec in zip(grads, fctx.specs)]
        return (None, None, *grads, *([None] * fctx.num_rest))


class ParallelModule(DataParallelInputs, nn.Module):
    """The parallelized model on this rank: `pmodel(*inputs) -> loss`, `.train_step`, `.plan`; inputs are
    the global batch or this rank's slice (`.data_parallel_rank` of `.data_parallel_size`,
    `.distributed_sampler(dataset)`)."""

    needs_inputs = True   # every rank's program reads the inputs (a pipeline's first stage only)

    def __init__(self, model, captured, plan: Plan, gm, device_mesh: DeviceMesh, ctx: PassContext,
                 init_fn=None, input_reads=None, compile: bool | str = False):
        super().__init__()
        self.plan = plan
        checkpoint.register_hooks(self)  # strided shards leave state_dict() as plain shards (DCP-savable)
        object.__setattr__(self, "gm", gm)  # the program: not a submodule (no state of its own)
        # what runs it: the GraphModule itself, or Inductor's code for it (autopar/runtime/compile.py)
        program = gm if not compile else compiling.CompiledProgram(
            gm, overlap=compiling.overlap_mode(compile, device_type()), cuda_graphs=compile == compiling.CUDA_GRAPHS)
        object.__setattr__(self, "program", program)
        object.__setattr__(self, "device_mesh", device_mesh)
        self._param_names = list(captured.param_names)
        self._buffer_names = list(captured.buffer_names)
        self._input_names = list(captured.input_names)
        self._grad_index = {n: i for i, n in enumerate(captured.grad_param_names)}
        self._tied = dict(captured.tied)
        inputs = captured.placeholders("input")
        self.batch_layout = BatchLayout(self._input_names, [n.meta[VAL].shape for n in inputs],
                                        [parse_spec(plan.nodes[n.name].outs[0]) for n in inputs], ctx.coords,
                                        ctx.axis_sizes, mesh=device_mesh, reads=input_reads)
        self._device = torch.device(ctx.device)
        self._specs = {name: parse_spec(plan.params[name].master) for name in self._param_names}
        for node, name in zip(captured.placeholders("buffer"), self._buffer_names):
            self._specs[name] = parse_spec(plan.nodes[node.name].outs[0])
        self._state = state.state_entries(model, self._specs)   # model.state_dict()'s tensors, tied keys grouped
        self._persistent = frozenset(n for entry in self._state for n in entry.names)
        if is_meta(model):  # one module at a time: no rank ever holds the whole model
            for names, tensor in stream_tensors(model, init_fn, device=ctx.device):
                for name in names:
                    if name in self._specs:
                        self._place(name, tensor, name in self._grad_index)
                        break
        else:
            tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
            for name in self._specs:
                self._place(name, tensors[name].detach(), tensors[name].requires_grad)
        # (module holding it, attribute name), looked up once: get_parameter walks the path on every
        # call (the step_time GPT's 52 parameters: 0.48 ms a step)
        self._param_owners = [owner_of(self, n) for n in self._param_names]
        self._buffer_owners = [owner_of(self, n) for n in self._buffer_names]
        state.install(self, self._state)  # state_dict() keys = the model's; load_state_dict() takes its tensors

    def _place(self, name: str, full: torch.Tensor, requires_grad: bool) -> None:
        dt = distribute_tensor(full.detach(), self.device_mesh, list(self._specs[name]))
        if name in self._param_names:
            set_tensor(self, name, nn.Parameter(dt, requires_grad=requires_grad), param=True)
        else:
            set_tensor(self, name, dt, param=False, persistent=name in self._persistent)

    # ------------------------------------------------------------------ running
    def grads_by_param(self, grads) -> list:
        return [grads[self._grad_index[n]] if n in self._grad_index else None for n in self._param_names]

    def _step_args(self, inputs, kwargs) -> tuple[list, list]:
        """(the DTensor parameters, the graph's other inputs: local buffers, then this rank's inputs)."""
        inputs = tuple(inputs) + tuple(kwargs[n] for n in self._input_names[len(inputs):] if n in kwargs)
        local_inputs = self.batch_layout.local_inputs(inputs, self._device)
        params = [owner._parameters[leaf] for owner, leaf in self._param_owners]
        bufs = [compat.local_tensor(owner._buffers[leaf]) for owner, leaf in self._buffer_owners]
        return params, bufs + local_inputs

    def step_arguments(self, *inputs, **kwargs) -> list[torch.Tensor]:
        """The per-rank program's arguments for one step, as forward builds them (`self.gm(*args)`):
        local parameter shards, local buffers, this rank's part of the inputs (`autopar.runtime.memtrack`)."""
        params, rest = self._step_args(inputs, kwargs)
        return [compat.local_tensor(p) for p in params] + rest

    def _run_graph(self, params, rest) -> tuple[torch.Tensor, list]:
        """The joint graph on the parameters' local shards: (the loss, each parameter's local gradient
        or None), computed without autograd recording."""
        with torch.no_grad():
            outs = self.program(*[compat.local_tensor(p) for p in params], *rest)
        return outs[0], self.grads_by_param(outs[1:])

    def forward(self, *inputs, **kwargs) -> torch.Tensor:
        params, rest = self._step_args(inputs, kwargs)
        return JointStepFunction.apply(self, len(params), *params, *rest)

    def train_step(self, *inputs, **kwargs) -> torch.Tensor:
        """Forward and backward: returns the loss (same on every rank); gradients are added to p.grad.

        The graph computes the gradients along with the loss, so unless something watches the step
        (`_backward_is_watched`) they go straight into p.grad, as loss.backward() would
        put them, without the autograd round trip (JointStepFunction's backward, then AccumulateGrad detaching
        each DTensor gradient through DTensor dispatch: about 0.8 ms a step for the step_time GPT's 52
        parameters)."""
        if self._backward_is_watched():
            loss = self(*inputs, **kwargs)
            loss.backward()
            return loss.detach()
        params, rest = self._step_args(inputs, kwargs)
        loss, grads = self._run_graph(params, rest)
        with torch.no_grad():
            for p, gr in zip(params, distinct(grads)):
                if gr is None or not p.requires_grad:
                    continue
                gr = compat.dtensor_grad(gr, compat.dtensor_spec(p))
                if p.grad is None:
                    p.grad = gr
                else:
                    p.grad.add_(gr)  # in place, as AccumulateGrad adds to an existing gradient
        return loss.clone()  # not a view that keeps the loss's bucket buffer alive

    def _backward_is_watched(self) -> bool:
        """Grad mode off, a gradient hook on a parameter, or a forward/backward hook on this module
        (or a global one): then train_step goes through `self(...)` and autograd, which run them."""
        return (not torch.is_grad_enabled() or any(compat.module_hook_ids(self) + compat.module_hook_ids())
                or any(compat.has_grad_hooks(owner._parameters[leaf]) for owner, leaf in self._param_owners))

    @property
    def compile_seconds(self) -> float | None:
        """Inductor's first-step compile time (None: eager, or not compiled yet)."""
        return compiling.compile_seconds([self.program])

    def extra_repr(self) -> str:
        return compiling.describe([self.program])

    def optimizer(self, cls: type = torch.optim.AdamW, params=None, **options) -> torch.optim.Optimizer:
        """`cls(self.parameters() or params, **options)` (AdamW, Adam, SGD) stepping the DTensors' local shards
        with torch's fused or foreach kernel: torch.optim's semantics and numbers, no DTensor dispatch per tensor;
        `.clip_grad_norm_(max_norm)` clips the whole model's gradients (`autopar/runtime/optim.py`)."""
        return optim.local_shard_optimizer(cls, self.parameters() if params is None else params, **options)

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """`model.state_dict()` of the unmodified model, unsharded (tied keys included): a collective, every
        rank takes part and gets it. It loads into the model with `strict=True`."""
        return state.full_tensors(self, self._state)

    def load_safetensors(self, path, *, strict: bool = True) -> None:
        """Load pretrained weights from a safetensors file, or a folder transformers' `save_pretrained` wrote
        (one file or shards with `model.safetensors.index.json`): each rank reads only its own slices
        (`autopar/runtime/safetensors_io.py`). `strict`: the file's keys must be the model's (tied keys may
        be missing, as transformers saves them once). A model built on the meta device loads too: buffers
        no checkpoint holds (rotary tables) come from its init, by default a transformers model's own
        `_init_weights` (`autopar.runtime.materialize.default_init_for`)."""
        safetensors_io.load(self, self._state, path, strict=strict)

    def save_safetensors(self, path, *, max_shard_bytes: int | None = None) -> None:
        """Write the unsharded model in safetensors form as transformers' `save_pretrained` does (one file, or
        shards of at most `max_shard_bytes` and an index), streamed by rank 0 one tensor at a time. A
        collective: every rank calls it. `path`: a folder, or a `.safetensors` file (no sharding)."""
        safetensors_io.save(self._state, self._gather, path, max_shard_bytes=max_shard_bytes)

    def _gather(self, entry: state.StateEntry) -> torch.Tensor:
        """One unsharded tensor (a collective over the mesh: every rank gets it; the writer, rank 0, keeps it)."""
        return get_tensor(self, entry.name).full_tensor().detach()
