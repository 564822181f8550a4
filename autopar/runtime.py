"""The runtime: `autoparallelize()` and `ParallelModule`, the per-rank program under torchrun.

Parameters are DTensors on a DeviceMesh built from the world and the plan's mesh, placed as the
plan's master specs, so an unmodified torch.optim optimizer steps on local shards and
torch.distributed.checkpoint / full_tensor() work. A forward call runs the rewritten joint graph on
local shards (inputs: every rank passes the same global batch; each keeps its planned slice) and
returns the loss; backward hands the graph's gradients (already reduced to each master spec) to
autograd, which fills `p.grad` as DTensors.
"""
from __future__ import annotations

import math

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import distribute_tensor

from autopar import _torch_compat as compat
from autopar import checkpoint, errors, precision
from autopar.canonicalize import canonicalize
from autopar.cpu_memory import keep_freed_memory
from autopar.capture import capture
from autopar.errors import DeviceError, InputError, MeshError
from autopar.materialize import is_meta, stream_tensors
from autopar.mesh import Mesh
from autopar.placement import is_strided, local_shape, pieces
from autopar.plan import Plan
from autopar.planner import _reject_unsupported, fingerprint, plan_captured
from autopar.passes import PassContext, run_passes
from autopar.passes.context import parse_spec


def _backend_for(device: str | None) -> str:
    """gloo for "cpu", NCCL for "cuda"; None follows what this machine has (CUDA when present)."""
    if device is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if device not in ("cpu", "cuda"):
        raise InputError(f"device={device!r}: use 'cpu' (gloo), 'cuda' (NCCL) or None (CUDA when present)")
    if device == "cuda" and not torch.cuda.is_available():
        why = "this torch is a CPU build" if torch.version.cuda is None else "no GPU or driver is visible"
        raise DeviceError(f"device='cuda' was requested but torch.cuda.is_available() is False ({why}: torch "
                          f"{torch.__version__}); use device='cpu' (gloo), or run on a GPU machine with a CUDA "
                          "build of torch")
    return "nccl" if device == "cuda" else "gloo"


def _init_distributed(device: str | None = None) -> tuple[int, int]:
    """Join torchrun's process group (gloo on CPU, NCCL with CUDA), or make a world of one."""
    backend = _backend_for(device)
    if dist.is_initialized() and device is not None and dist.get_backend() != backend:
        raise DeviceError(f"device={device!r} needs the {backend} backend but the process group was initialised "
                          f"with {dist.get_backend()}; initialise it with {backend!r} or pass device=None")
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
            if attempt is None:
                dist.init_process_group(backend)
            else:  # torchrun may keep its store across restarts: a restarted job must not read the
                # previous attempt's addresses (a stale gloo peer address hangs or refuses the connection)
                store, rank, world = next(dist.rendezvous("env://"))
                dist.init_process_group(backend, store=dist.PrefixStore(f"autopar/attempt_{attempt}", store),
                                        rank=rank, world_size=world)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def _device_type() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _local_device() -> str:
    if _device_type() == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def _broadcast_plan(plan_fn) -> Plan:
    """Rank 0 plans, every rank receives the same JSON (solver time limits may not be repeatable).

    Planning may fail on rank 0 (a user mistake it detects, an infeasible budget): then every rank
    raises the same error, instead of the others waiting in the broadcast for a plan that never comes.
    """
    box: list = [None]
    failure = None
    if dist.get_rank() == 0:
        try:
            box = [plan_fn().to_json()]
        except Exception as e:  # every rank must leave the broadcast; rank 0 re-raises its own below
            failure, box = e, [_portable_error(e)]
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if isinstance(box[0], dict):
        raise _rebuild_error(box[0])
    return Plan.from_json(box[0])


def _portable_error(e: Exception) -> dict:
    """An exception as plain data (its class may not unpickle: keyword-only constructor arguments)."""
    return {"type": type(e).__name__, "message": str(e),
            "attrs": {k: v for k, v in vars(e).items() if isinstance(v, (int, float, str, type(None)))}}


def _rebuild_error(data: dict) -> Exception:
    cls = getattr(errors, data["type"], None)
    if isinstance(cls, type) and issubclass(cls, errors.AutoparError):
        err = cls.__new__(cls)
        Exception.__init__(err, data["message"])
        err.__dict__.update(data["attrs"])
        return err
    return RuntimeError(f"planning failed on rank 0 ({data['type']}): {data['message']}")


def autoparallelize(model: nn.Module, example_inputs: tuple, *, mesh=None, strategy="auto", memory_budget=None,
                    plan: Plan | None = None, loss_fn=None, example_kwargs=None, optimizer: str = "adamw",
                    time_limit=None, verify: bool = False, init_fn=None, device: str | None = None,
                    **kw) -> "ParallelModule":
    """Plan (or reuse `plan`), rewrite and return a module that trains on this rank of the job.

    A model on the meta device is materialised module by module (`init_fn(module)`, default: torch.nn
    layers' reset_parameters), each rank keeping only its shards; see `autopar.materialize`.
    `device`: "cpu" (gloo), "cuda" (NCCL) or None (CUDA when this machine has it).
    """
    _, world = _init_distributed(device)
    if _device_type() == "cpu":
        keep_freed_memory()  # else glibc page-faults every step's activations in again (autopar/cpu_memory.py)
    if mesh is None:
        mesh = Mesh((world,), hardware="cpu" if _device_type() == "cpu" else "h100")
    elif not isinstance(mesh, Mesh):
        mesh = Mesh(mesh)
    if mesh.size != world:
        raise MeshError(f"the mesh has {mesh.size} devices ({mesh}) but this job has {world} ranks; "
                        f"launch with torchrun --nproc_per_node {mesh.size} or pass a mesh of {world}")
    if kw.get("num_stages") == "auto":  # search the layout; the plan brings its mesh
        from autopar.planner import plan as make_plan
        search_kw = {k: kw.pop(k) for k in ("num_stages", "num_microbatches", "schedule") if k in kw}
        if plan is None:
            plan = _broadcast_plan(lambda: make_plan(model, example_inputs, mesh=mesh, memory_budget=memory_budget,
                                                     optimizer=optimizer, loss_fn=loss_fn, time_limit=time_limit,
                                                     **search_kw))
        mesh = plan.mesh
    if _is_pipelined(mesh, plan, kw):  # a "pp" axis: autopar/pipeline_runtime.py
        from autopar.pipeline_runtime import autoparallelize_pipelined
        return autoparallelize_pipelined(
            model, example_inputs, mesh=mesh, plan=plan, example_kwargs=example_kwargs, loss_fn=loss_fn,
            verify=verify, device_type=_device_type(), device=_local_device(), broadcast=_broadcast_plan,
            strategy=strategy, memory_budget=memory_budget, optimizer=optimizer, time_limit=time_limit, **kw)
    policy = precision.resolve_with_plan(kw.pop("mixed_precision", None), plan)  # None: fp32
    captured = capture(model, example_inputs, example_kwargs=example_kwargs, loss_fn=loss_fn,
                       mixed_precision=policy)
    canonicalize(captured.gm)
    baselines = kw.pop("baselines", True)
    recompute = kw.pop("recompute", None)
    _reject_unsupported(kw)
    if plan is None:
        plan = _broadcast_plan(lambda: plan_captured(captured, model, example_inputs, mesh=mesh, strategy=strategy,
                                                     memory_budget=memory_budget, optimizer=optimizer,
                                                     time_limit=time_limit, baselines=baselines,
                                                     recompute=recompute))
    plan.check_matches(fingerprint(captured, mesh), mesh)
    device_mesh = init_device_mesh(_device_type(), tuple(mesh.shape), mesh_dim_names=tuple(mesh.axis_names))
    ctx = PassContext(plan, tuple(mesh.shape), coords=tuple(device_mesh.get_coordinate()),
                      group_names=tuple(device_mesh.get_group(a).group_name for a in range(mesh.ndim)),
                      grad_names=tuple(captured.grad_param_names), device=_local_device())
    gm = run_passes(captured.gm, ctx, verify=verify)
    return ParallelModule(model, captured, plan, gm, device_mesh, ctx, init_fn=init_fn)


def _is_pipelined(mesh: Mesh, plan: Plan | None, kw: dict) -> bool:
    """A forced pipeline (num_stages > 1), a mesh with a "pp" axis, or a saved plan with stages."""
    stages = kw.get("num_stages") or 1
    if not isinstance(stages, int) or stages < 1:
        raise InputError(f"num_stages={stages!r}: pass a number of pipeline stages (>= 1) or 'auto'")
    return stages > 1 or "pp" in mesh.axis_names or (plan is not None and bool(plan.stages))


class _JointStep(torch.autograd.Function):
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
        if _is_one(g):  # loss.backward() seeds 1: skip a pass over every gradient
            grads = _distinct(fctx.grads)
        else:
            grads = [None if gr is None else gr * g for gr in fctx.grads]
        grads = [None if gr is None else compat.dtensor_grad(gr, spec) for gr, spec in zip(grads, fctx.specs)]
        return (None, None, *grads, *([None] * fctx.num_rest))


def _distinct(grads: list) -> list:
    """Never hand autograd one tensor for two parameters: it may accumulate into p.grad in place."""
    seen: set[int] = set()
    out = []
    for gr in grads:
        if gr is not None and id(gr) in seen:
            gr = gr.clone()
        elif gr is not None:
            seen.add(id(gr))
        out.append(gr)
    return out


def _is_one(g: torch.Tensor) -> bool:
    """True for the seed of a plain `loss.backward()`; checked only on the CPU (no device sync)."""
    return g.device.type == "cpu" and not g.requires_grad and g.numel() == 1 and g.item() == 1.0


class ParallelModule(nn.Module):
    """The parallelized model on this rank: `pmodel(*inputs) -> loss`, `.train_step`, `.plan`."""

    def __init__(self, model, captured, plan: Plan, gm, device_mesh: DeviceMesh, ctx: PassContext,
                 init_fn=None):
        super().__init__()
        self.plan = plan
        checkpoint.register_hooks(self)  # strided shards leave state_dict() as plain shards (DCP-savable)
        object.__setattr__(self, "gm", gm)  # the program: not a submodule (no state of its own)
        object.__setattr__(self, "device_mesh", device_mesh)
        self._param_names = list(captured.param_names)
        self._buffer_names = list(captured.buffer_names)
        self._input_names = list(captured.input_names)
        self._grad_index = {n: i for i, n in enumerate(captured.grad_param_names)}
        self._tied = dict(captured.tied)
        self._input_specs = [parse_spec(plan.nodes[n.name].outs[0]) for n in captured.placeholders("input")]
        self._input_shapes = [tuple(n.meta["val"].shape) for n in captured.placeholders("input")]
        self._coords = ctx.coords
        self._device = torch.device(ctx.device)
        self._axis_sizes = ctx.axis_sizes
        self._specs = {name: parse_spec(plan.params[name].master) for name in self._param_names}
        for node, name in zip(captured.placeholders("buffer"), self._buffer_names):
            self._specs[name] = parse_spec(plan.nodes[node.name].outs[0])
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
        self._param_owners = [_owner(self, n) for n in self._param_names]
        self._buffer_owners = [_owner(self, n) for n in self._buffer_names]

    def _place(self, name: str, full: torch.Tensor, requires_grad: bool) -> None:
        dt = distribute_tensor(full.detach(), self.device_mesh, list(self._specs[name]))
        if name in self._param_names:
            _set(self, name, nn.Parameter(dt, requires_grad=requires_grad), param=True)
        else:
            _set(self, name, dt, param=False)

    # ------------------------------------------------------------------ running
    def grads_by_param(self, grads) -> list:
        return [grads[self._grad_index[n]] if n in self._grad_index else None for n in self._param_names]

    def _local_inputs(self, inputs) -> list[torch.Tensor]:
        if len(inputs) != len(self._input_shapes):
            raise InputError(f"expected {len(self._input_shapes)} inputs ({', '.join(self._input_names)}), "
                             f"got {len(inputs)}")
        out = []
        for name, x, shape, spec in zip(self._input_names, inputs, self._input_shapes, self._input_specs):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise InputError(f"rank {dist.get_rank()}: input {name!r} has shape {got} but the plan was made "
                                 f"for {shape}; re-plan for the new shape or pad/crop the batch")
            out.append(_local_slice(x, spec, self._coords, self._axis_sizes).contiguous().to(self._device))
        return out

    def _step_args(self, inputs, kwargs) -> tuple[list, list]:
        """(the DTensor parameters, the graph's other inputs: local buffers, then this rank's inputs)."""
        inputs = tuple(inputs) + tuple(kwargs[n] for n in self._input_names[len(inputs):] if n in kwargs)
        local_inputs = self._local_inputs(inputs)
        params = [owner._parameters[leaf] for owner, leaf in self._param_owners]
        bufs = [compat.local_tensor(owner._buffers[leaf]) for owner, leaf in self._buffer_owners]
        return params, bufs + local_inputs

    def _run_graph(self, params, rest) -> tuple[torch.Tensor, list]:
        """The joint graph on the parameters' local shards: (the loss, each parameter's local gradient
        or None), computed without autograd recording."""
        with torch.no_grad():
            outs = self.gm(*[compat.local_tensor(p) for p in params], *rest)
        return outs[0], self.grads_by_param(outs[1:])

    def forward(self, *inputs, **kwargs) -> torch.Tensor:
        params, rest = self._step_args(inputs, kwargs)
        return _JointStep.apply(self, len(params), *params, *rest)

    def train_step(self, *inputs, **kwargs) -> torch.Tensor:
        """Forward and backward: returns the loss (same on every rank); gradients are added to p.grad.

        The graph computes the gradients along with the loss, so unless something watches the step
        (`_backward_is_watched`) they go straight into p.grad, as loss.backward() would
        put them, without the autograd round trip (_JointStep's backward, then AccumulateGrad detaching
        each DTensor gradient through DTensor dispatch: about 0.8 ms a step for the step_time GPT's 52
        parameters)."""
        if self._backward_is_watched():
            loss = self(*inputs, **kwargs)
            loss.backward()
            return loss.detach()
        params, rest = self._step_args(inputs, kwargs)
        loss, grads = self._run_graph(params, rest)
        with torch.no_grad():
            for p, gr in zip(params, _distinct(grads)):
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

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters and buffers under the original model's names (tied names included)."""
        out = {}
        for name in self._param_names + self._buffer_names:
            full = _get(self, name).full_tensor().detach()
            out[name] = full
            for alias in self._tied.get(name, ()):
                out[alias] = full
        return out


def _local_slice(x: torch.Tensor, spec, coords, axis_sizes) -> torch.Tensor:
    full = tuple(x.shape)
    loc = local_shape(spec, full, axis_sizes)
    for d in range(len(full)):
        if loc[d] == full[d]:
            continue
        # offset of this rank's block along d: nested chunks in mesh-axis order; a strided shard
        # (placement.SS, alone on its dim) takes that block of each of its k pieces
        k = math.prod(pieces(p) for p in spec if getattr(p, "dim", None) == d and is_strided(p))
        offset, size = 0, full[d] // k
        for axis, p in enumerate(spec):
            if getattr(p, "dim", None) == d and not p.is_partial():
                size //= axis_sizes[axis]
                offset += coords[axis] * size
        x = x.unflatten(d, (k, full[d] // k)).narrow(d + 1, offset, size).flatten(d, d + 1)
    return x


def _set(root: nn.Module, fqn: str, value, *, param: bool) -> None:
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part) or not isinstance(getattr(mod, part), nn.Module):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if param:
        mod.register_parameter(leaf, value)
    else:
        mod.register_buffer(leaf, value)


def _owner(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    path, _, leaf = fqn.rpartition(".")
    return root.get_submodule(path), leaf


def _get(root: nn.Module, fqn: str):
    try:
        return root.get_parameter(fqn)
    except AttributeError:
        return root.get_buffer(fqn)
