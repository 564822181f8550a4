"""The one place where autopar touches private or unstable torch APIs.

Every other module imports these helpers instead of reaching into `torch._*` itself, so a torch
upgrade that moves an internal has one file to fix. Keep it small: thin wrappers only, no logic.
"""
from __future__ import annotations

import copy
from typing import Callable, Mapping

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch._decomp import core_aten_decompositions
from torch._functorch._aot_autograd.logging_utils import setup_stacktrace_preservation_hooks
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_global_tensor_info
from torch.distributed.tensor.placement_types import _StridedShard
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.tools_common import stable_topological_sort

__all__ = [
    "FakeTensor",
    "FakeTensorMode",
    "export_graph",
    "trace_joint",
    "tag_backward_nodes",
    "core_decompositions",
    "StridedShard",
    "strided_shard",
    "local_tensor",
    "dtensor_spec",
    "dtensor_grad",
    "has_grad_hooks",
    "InitGroupHook",
    "foreach_mul_",
    "local_tensors",
    "zero_bubble_order",
]

# DTensor's placement for a dim viewed as `split_factor` equal pieces, each sharded over the mesh axis
# (rank r holds [piece0_r; piece1_r; ...]); private in torch 2.13 (FSDP2 + TP use it).
StridedShard = _StridedShard


def strided_shard(dim: int, split_factor: int) -> _StridedShard:
    return _StridedShard(dim, split_factor=split_factor)


def local_tensor(dt: DTensor) -> torch.Tensor:
    """The local shard of `dt` itself, outside autograd (what `to_local()` views, minus its autograd node)."""
    return dt._local_tensor


def local_tensors(items: list) -> list:
    """`items` with each DTensor replaced by its local shard (`local_tensor`), anything else kept: one pass,
    no call per item (an optimizer step maps several lists of every parameter tensor)."""
    return [t._local_tensor if isinstance(t, DTensor) else t for t in items]


def dtensor_spec(dt: DTensor) -> DTensorSpec:
    return dt._spec


def dtensor_grad(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """The gradient of a (non-Partial) DTensor with `spec`, around this rank's `local` gradient: what
    `to_local()`'s backward builds (same placements, global shape, global stride from the local
    layout), without its autograd Function and from_local round trip."""
    _, stride = compute_global_tensor_info(local, spec.mesh, spec.placements)
    meta = spec.tensor_meta
    if tuple(stride) == meta.stride and local.dtype == meta.dtype:
        spec = copy.copy(spec)  # as torch does: propagation may modify a spec
    else:
        spec = DTensorSpec(spec.mesh, spec.placements, tensor_meta=TensorMeta(meta.shape, tuple(stride), local.dtype))
    return DTensor(local, spec, requires_grad=False)


class InitGroupHook:
    """Mixin before a torch.optim optimizer class: its step() gathers each param group's per-tensor lists
    (params, grads, states, steps) with the private `_init_group(group, *lists)` (every built-in
    optimizer, torch 2.6-2.14), then hands them to its foreach/fused functional. This asks
    `self._reuse(group, lists)` first, which may fill the lists itself and return `_init_group`'s result;
    otherwise it runs torch's, then `self._gathered(group, lists, result)`, which may replace the lists'
    items in place."""

    def _init_group(self, group, *lists):
        result = self._reuse(group, lists)
        if result is None:
            result = super()._init_group(group, *lists)
            self._gathered(group, lists, result)
        return result


def foreach_mul_(tensors: list[torch.Tensor], scalar: torch.Tensor) -> None:
    """Each tensor of `tensors` (one device and dtype) times `scalar`, in place, in one foreach kernel."""
    torch._foreach_mul_(tensors, scalar)


def has_grad_hooks(t: torch.Tensor) -> bool:
    """Whether a hook watches `t`'s gradient (`register_hook`, `register_post_accumulate_grad_hook`)."""
    return bool(t._backward_hooks) or bool(getattr(t, "_post_accumulate_grad_hooks", None))


def export_graph(module: torch.nn.Module, args: tuple) -> torch.fx.GraphModule:
    """Non-strict `torch.export` of `module(*args)`; returns the ATen training-IR GraphModule whose
    parameters and buffers are attributes and whose placeholders are `args`, flat."""
    ep = torch.export.export(module, args, strict=False)
    return ep.module()


def core_decompositions() -> Mapping:
    """The core-ATen decomposition table (what `ep.run_decompositions()` would use), minus the
    fused attention kernels: their decompositions return the attention weights where the
    backward kernel expects the logsumexp (wrong gradients), and the planner wants them fused."""
    return {op: fn for op, fn in core_aten_decompositions().items()
            if not op.name().startswith("aten::_scaled_dot_product_") and op.name() not in KEEP_FUSED}


# Fused kernels kept whole (autopar has sharding rules for them): decomposed, GELU's and layer
# norm's backward become ~50 elementwise ops per layer, measured +100 ms/step on a 4-layer GPT; a
# decomposed (log-)softmax backward is four passes over the logits (exp, mul, sum, sub) where the
# kernel makes one, and a decomposed cross-entropy backward three (fill, copy for the scatter, mul)
# where the kernel fills and scatters.
KEEP_FUSED = {"aten::gelu", "aten::gelu_backward", "aten::native_layer_norm_backward",
              "aten::_log_softmax_backward_data", "aten::_softmax_backward_data", "aten::nll_loss_backward"}


def trace_joint(fn: Callable, flat_args: list, decompose: bool) -> torch.fx.GraphModule:
    """Trace `fn(*flat_args)` (fake tensors) to an ATen graph with mutations functionalized but
    views kept (plain view/permute/slice, not *_copy), keeping node meta set by an Interpreter."""
    table = core_decompositions() if decompose else None
    functional = torch.func.functionalize(fn, remove="mutations")
    with fx_traceback.preserve_node_meta():
        return make_fx(functional, decomposition_table=table, tracing_mode="fake")(*flat_args)


def tag_backward_nodes(loss: torch.Tensor) -> None:
    """Hook `loss`'s autograd graph so that each backward op traced later carries the `seq_nr`
    (and stack trace) of the forward op it differentiates, as aot_autograd does."""
    if loss.grad_fn is not None:
        setup_stacktrace_preservation_hooks([loss.grad_fn])


def stable_toposort(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Topologically sort gm in place, keeping the original order wherever dependencies allow (a
    plain Kahn sort would hoist every collective whose inputs are ready, e.g. all ZeRO-3 gathers)."""
    return stable_topological_sort(gm)


def module_hook_ids(module: torch.nn.Module | None = None) -> tuple:
    """The handle ids of the forward/backward hooks on `module`, or of the global module hooks when
    None: registering or removing a hook changes them (torch never reuses a handle id)."""
    import torch.nn.modules.module as nn_module
    if module is None:
        dicts = (nn_module._global_forward_pre_hooks, nn_module._global_forward_hooks,
                 nn_module._global_backward_pre_hooks, nn_module._global_backward_hooks)
    else:
        dicts = (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks,
                 module._backward_hooks)
    return tuple(tuple(d) for d in dicts)


def lazy_recompile():
    """A context in which GraphModules created (traced, copied) generate their Python code only when
    first called or read (`_LazyGraphModule`), not on every `recompile()`: a 20,000-node graph that is
    only costed, never run, skips seconds of code generation per rewrite."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module
    return _use_lazy_graph_module(True)


def inductor_compile(gm: torch.fx.GraphModule, example_args: list, config_patches: dict,
                     on_output: Callable) -> Callable:
    """`gm` (an ATen graph, functional collectives included) compiled by Inductor for the shapes, strides
    and dtypes of `example_args` (real tensors; they are only read for their metadata). No Dynamo:
    `compile_fx` re-traces `gm` with Inductor's decompositions (aot_autograd, an inference graph) and
    hands the result to `compile_fx_inner`, whose compiled output (`OutputCode`) goes to `on_output`.
    The fake inputs carry a ShapeEnv (static shapes), without which Inductor's FX graph cache bypasses
    ('No shape env'): with it, a restarted job with the same program loads the compiled kernels."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    def inner(*args, **kwargs):
        out = compile_fx_inner(*args, **kwargs)
        on_output(out)
        return out

    mode = FakeTensorMode(shape_env=ShapeEnv())
    fakes = [mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in example_args]
    return compile_fx(gm, fakes, inner_compile=inner, config_patches=config_patches)


# Inductor config for compile="cudagraphs": its cudagraph trees around the compiled code (static shapes).
CUDA_GRAPH_PATCHES = {"triton.cudagraphs": True, "triton.cudagraph_trees": True}


def cudagraph_step_begin() -> None:
    """Tell the cudagraph trees a new step begins (the previous replay's outputs may be overwritten)."""
    torch.compiler.cudagraph_mark_step_begin()


def output_source(output_code) -> str:
    """The Python wrapper Inductor generated for a compiled graph ('' where it kept none)."""
    return getattr(output_code, "source_code", "") or ""


def compile_counters() -> dict:
    """torch's compile counters, by family ('inductor': FX graph cache hits/misses, 'aot_autograd',
    'graph_break': Dynamo's graph breaks by reason, 'stats'), as plain dicts."""
    from torch._dynamo.utils import counters
    return {family: dict(c) for family, c in counters.items()}


def zero_bubble_order(p: int, m: int, v: int = 1, v_shape: bool = False) -> list[list[tuple[int, str, int]]]:
    """The actions each pipeline rank runs under torch's ScheduleInterleavedZeroBubble with v stages per rank
    (rank r holds stages r, r + p, ...), or, `v_shape`, under ScheduleZBVZeroBubble (two stages per rank in a
    V: rank r holds stages r and 2p - 1 - r), as (stage, "F" | "I" | "W" | "B", micro-batch) in order ("I":
    input gradients, "W": weight gradients, "B": both), from the schedule's own private order builder, called
    without building stages."""
    import types

    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble as zb
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble as zbv
    rounds = max(1, m // p)
    fake = types.SimpleNamespace(n_local_stages=2 if v_shape else v, pp_group_size=p, _n_microbatches=m,
                                 number_of_rounds=rounds, microbatches_per_round=m // rounds, num_stages=2 * p)
    build = zbv._calculate_single_rank_operations if v_shape else zb._calculate_single_rank_operations
    fake.pipeline_order = {r: build(fake, r) for r in range(p)}
    names = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}
    return [[(a.stage_index, names[a.computation_type.name], a.microbatch_index)
             for a in fake.pipeline_order[r] if a is not None] for r in range(p)]


def forward_only_schedule(schedule_cls, stages: list, m: int, **options):
    """torch's `schedule_cls` of these PipelineStages running only its forward actions, in its own order: the
    forward-only evaluation of a V-shaped schedule. Its own `eval` runs the order's backward actions too, and
    the hand-off of input gradients between the two chunks a rank holds fails without a backward (torch 2.13:
    "can't steal_bwd_input if this stage doesn't have backward"). The sends and receives are added by the
    schedule's own lowering (`_add_send_recv`; its validation, which wants every backward, is skipped)."""
    from torch.distributed.pipelining.schedules import _add_send_recv, _ComputationType
    schedule = schedule_cls(stages, m, **options)
    forward = {rank: [a for a in actions if a is not None and a.computation_type == _ComputationType.FORWARD]
               for rank, actions in schedule.pipeline_order.items()}
    schedule.pipeline_order_with_comms = _add_send_recv(
        forward, stage_to_rank=lambda s: schedule.stage_index_to_group_rank[s], num_stages=schedule._num_stages)
    return schedule
