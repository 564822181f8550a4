"""Capture: an unmodified model and example inputs -> one joint forward+backward ATen graph.

Steps (each a function below):
  1. check the inputs and name them from the model's `forward` signature;
  2. wrap the model so it returns a scalar loss (`autopar/capture/loss.py`: a tensor, `.loss`, `["loss"]`,
     the one scalar of a tuple such as `(logits, loss)`, or `loss_fn`);
  3. `torch.export` (non-strict) the wrapper: gets past Python control flow in HF mask code; every
     config's `use_cache` is off meanwhile, at any depth (`autopar/capture/no_cache.py`);
  4. retrace the exported graph under `grad_and_value` + `functionalize` with `make_fx`, on fake
     tensors (meta parameters are treated as CPU ones, so nothing is allocated and kernel choice
     such as CPU flash attention matches a real run), decomposing to core ATen;
  5. flatten inputs/outputs and annotate every node (role, phase, module path).

The result, `Captured.gm`, is called as `gm(*params, *buffers, *inputs) -> (loss, *grads)`; a
model that updates buffers (BatchNorm) gets `copy_` nodes into the buffer placeholders. Factory
ops of a meta-device model are retargeted to CPU, so the graph runs on real CPU tensors.

Node meta written here (the capture stage's invariants):
  every node:         meta["val"]  FakeTensor / tuple of them / python scalar
  placeholders:       meta["autopar_role"] in {"param", "buffer", "input"}, meta["autopar_name"]
  call_function:      meta["phase"] in {"forward", "backward"} (forward = ancestors of the loss, plus
                      the other outputs of a forward op, like saved statistics),
                      meta["module_path"]: FQN of the innermost user module ("" if unknown); a
                      backward node takes the path of the forward op it differentiates (seq_nr).
"""
from __future__ import annotations

import inspect
import logging
import operator
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx
import torch.nn as nn

from autopar import _torch_compat as compat
from autopar.capture import cache as capture_cache  # `cache` is capture()'s option
from autopar.capture import moe_rewrite, stamp, trace_errors
from autopar.capture.loss import LossModule
from autopar.capture.meta_export import export_meta
from autopar.capture.no_cache import caches_off
from autopar.capture.precision import MixedPrecision, autocast_forward
from autopar.errors import InputError
from autopar.graph import MODULE_PATH, NAME, PHASE, ROLE, UNSCOPED, VAL, ancestors

log = logging.getLogger(__name__)
_PREFIX = "model."          # the wrapper's attribute name, stripped from every FQN
_MM_OPS = ("mm", "addmm", "bmm", "baddbmm")


@dataclass
class Captured:
    """A joint forward+backward graph and the names of its inputs and outputs."""

    gm: torch.fx.GraphModule
    param_names: list[str]
    tied: dict[str, list[str]]
    buffer_names: list[str]
    input_names: list[str]
    grad_param_names: list[str]
    unused_params: list[str]
    param_shapes: dict[str, torch.Size] = field(default_factory=dict)
    param_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    stamped: dict[str, int] = field(default_factory=dict)  # layer stack FQN -> layers (traced 3, stamped)
    # capture(shallow=True): the one stack, traced 3 layers deep and not stamped out -> its layer count
    # (layer 1 of the graph stands for layers 1 .. L - 2: `autopar.pipeline.depth`)
    shallow: dict[str, int] = field(default_factory=dict)
    mixed_precision: MixedPrecision | None = None  # the forward was traced under this autocast policy

    @property
    def output_nodes(self) -> tuple:
        return tuple(self.gm.graph.output_node().args[0])

    @property
    def loss_node(self) -> torch.fx.Node:
        return self.output_nodes[0]

    @property
    def grad_nodes(self) -> dict[str, torch.fx.Node]:
        return dict(zip(self.grad_param_names, self.output_nodes[1:]))

    def placeholders(self, role: str | None = None) -> list[torch.fx.Node]:
        """Placeholder nodes in call order, optionally only those of one role."""
        nodes = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        return [n for n in nodes if role is None or n.meta[ROLE] == role]

    def summary(self) -> dict[str, int]:
        """Counts: nodes, ops per phase, matmuls, parameters and their elements."""
        calls = [n for n in self.gm.graph.nodes if n.op == "call_function"]
        phases = Counter(n.meta[PHASE] for n in calls)
        return {
            "nodes": len(self.gm.graph.nodes),
            "ops": len(calls),
            "forward_ops": phases["forward"],
            "backward_ops": phases["backward"],
            "matmuls": sum(1 for n in calls if _op_name(n) in _MM_OPS),
            "params": len(self.param_names),
            "param_numel": sum(s.numel() for s in self.param_shapes.values()),
            "buffers": len(self.buffer_names),
            "inputs": len(self.input_names),
            "tied": sum(len(v) for v in self.tied.values()),
            "unused_params": len(self.unused_params),
        }


def capture(
    model: nn.Module,
    example_inputs: tuple,
    *,
    example_kwargs: dict | None = None,
    loss_fn: Callable | None = None,
    decompose: bool = True,
    stamp_layers: bool = True,
    mixed_precision: MixedPrecision | None = None,
    cache: bool | None = None,
    shallow: bool = False,
) -> Captured:
    """Capture one training step of `model` as a joint forward+backward ATen graph.

    `example_inputs` is a tuple of tensors passed positionally (a trailing dict is taken as keyword
    arguments, like `example_kwargs`). The model must return a scalar loss (a tensor, an object
    with `.loss`, a dict with "loss" or a tuple/list with exactly one scalar floating item, such as
    `(logits, loss)`) or `loss_fn(output, *example_inputs)` must compute it. Parameters may live on the meta device: nothing is allocated.
    A stack of alike layers is traced three layers deep and stamped out (`autopar/capture/stamp.py`);
    `stamp_layers=False` traces every layer. `shallow=True` returns the three traced layers without stamping
    them out, when the model has exactly one such stack and its traced layers pass stamping's checks
    (`Captured.shallow` then names the stack and its depth; otherwise it is empty and the graph is the
    full one): what the layout search prices (`autopar.pipeline.depth`). `mixed_precision` traces the forward under autocast
    (`autopar.capture.precision`): the graph holds autocast's casts, parameters stay fp32.

    Cache (`autopar/capture/cache.py`): a second capture of the same model object with inputs and
    options that match returns a copy of the first graph instead of tracing again (`plan`, every
    `autoparallelize` strategy on a rank, the pipeline search's micro-batch graphs). The copy is the
    caller's to rewrite; the cache holds the model only weakly. `cache=False`, or the environment
    variable AUTOPAR_CAPTURE_CACHE=0, traces every time; `capture_cache.clear_capture_cache()` forgets.
    The key: every module's name, class, `forward` code, `training` flag, hook handles and plain
    attributes (numbers, strings, dtypes, function names, such as dropout's `p`; also those of plain
    objects a module holds, such as a transformers config with its dicts and sub-configs); every
    parameter and buffer's name, shape, dtype, device, strides, requires_grad and which are tied;
    global module hooks and the default dtype; each input's shape, dtype, device, strides and
    requires_grad and each non-tensor keyword input's value; `loss_fn` by identity, `decompose`,
    `stamp_layers` and `mixed_precision`.
    Not caught (pass cache=False): parameter and buffer *values* (the trace is on fake tensors, but a
    model whose trace branches on a value, or a plain tensor attribute that is not a buffer, changes
    it), code other than each module's `forward` (helper methods, module-level functions, a closure's
    variables, a `loss_fn` closure's variables), global torch settings other than the default dtype,
    and attributes held more than two objects below a module.
    """
    args, kwargs = _check_inputs(example_inputs, example_kwargs)          # 1. validate, name
    _bind_inputs(model, args, kwargs)
    options = dict(loss_fn=loss_fn, decompose=decompose, stamp_layers=stamp_layers, mixed_precision=mixed_precision)
    if shallow:   # a separate cache entry: a full capture of the same call stays a full one
        options["shallow"] = True
    if capture_cache.enabled(cache):
        trace = lambda: _capture_layers(model, args, kwargs, **options)  # noqa: E731
        derive = None
        if stamp_layers and not shallow:   # the layout search's final plan: its micro-batch graph was shallow
            derive = lambda stored: _stamped_from(model, stored({**options, "shallow": True}))  # noqa: E731
        return capture_cache.cached(model, args, kwargs, options, trace, derive)
    return _capture_layers(model, args, kwargs, **options)


def _stamped_from(model: nn.Module, shallow: Captured | None) -> Captured | None:
    """The full capture of a call whose shallow capture (a copy, the caller's) is `shallow`: its three
    traced layers stamped out, as `_capture` stamps the same trace; None where there is none."""
    if shallow is None or not shallow.shallow:
        return None
    stacks = stamp.find_stacks(model)
    if [s.path for s in stacks] != list(shallow.shallow):
        return None
    start = time.perf_counter()
    gm = shallow.gm
    params, tied, buffers, grad_names = _stamp(gm, model, stacks, shallow.grad_param_names, shallow.input_names)
    log.info("capture: stamped out the shallow graph in %.2f s, %d nodes", time.perf_counter() - start,
             len(gm.graph.nodes))
    return _captured(gm, params, tied, buffers, shallow.input_names, grad_names, stacks, shallow.mixed_precision)


def _capture_layers(model: nn.Module, args: tuple, kwargs: dict, *, loss_fn: Callable | None, decompose: bool,
                    stamp_layers: bool, mixed_precision: MixedPrecision | None, shallow: bool = False) -> Captured:
    """Trace with layer stamping, or every layer when stamping does not apply; `shallow`: see `capture`."""
    stacks = stamp.find_stacks(model) if stamp_layers or shallow else []
    if shallow and len(stacks) == 1:
        try:
            return _capture(model, args, kwargs, loss_fn, decompose, stacks, mixed_precision, stamp_out=False)
        except stamp.StampError as e:
            log.info("capture: no shallow graph, stamping out: %s", e)
    if stacks:
        try:
            return _capture(model, args, kwargs, loss_fn, decompose, stacks, mixed_precision)
        except stamp.StampError as e:
            log.info("capture: tracing every layer: %s", e)
    return _capture(model, args, kwargs, loss_fn, decompose, [], mixed_precision)


def _capture(model: nn.Module, args: tuple, kwargs: dict, loss_fn: Callable | None, decompose: bool,
             stacks: list[stamp.LayerStack], mixed_precision: MixedPrecision | None = None,
             stamp_out: bool = True) -> Captured:
    start = time.perf_counter()
    traced = stamp.shallow_model(model, stacks) if stacks else model
    input_names, flat_inputs, call = _bind_inputs(traced, args, kwargs)
    params, tied = _unique_tensors(traced.named_parameters(remove_duplicate=False))
    buffers, buffer_ties = _unique_tensors(traced.named_buffers(remove_duplicate=False))
    wrapper = LossModule(traced, call, loss_fn, len(args))                # 2. model -> loss (loss.py)
    on_meta = any(t.is_meta for t in [*params.values(), *buffers.values()])
    export = (lambda: export_meta(wrapper, traced, tuple(flat_inputs))) if on_meta else (  # meta: as fake CPU
        lambda: compat.export_graph(wrapper, tuple(flat_inputs)))
    with caches_off(traced):                                              # no KV cache at any depth
        exported = trace_errors.traced(export, wrapper)                   # 3. export
    trace_errors.check_inputs_not_mutated(exported, input_names)
    _retarget_meta_to_cpu(exported)
    moe_rewrite.use_traceable_experts(exported)                           # MoE grouped matmul (moe_rewrite.py)
    exported_at = time.perf_counter()
    grad_names = _grad_names(params)
    aliases = {**_alias_map(tied), **_alias_map(buffer_ties)}
    joint = _TracedStep(exported, list(params), list(buffers), grad_names, aliases, mixed_precision)
    mode = compat.FakeTensorMode(allow_non_fake_inputs=True)              # tensor constants stay real
    flat = [_to_fake(t, mode) for t in [*params.values(), *buffers.values(), *flat_inputs]]
    gm = trace_errors.traced(lambda: compat.trace_joint(joint, flat, decompose), wrapper,  # 4. joint fwd+bwd
                             node=lambda: joint.node)
    _flatten_and_clean(gm)                                                # 5. flat I/O, node meta
    names = [*params, *buffers, *input_names]
    roles = ["param"] * len(params) + ["buffer"] * len(buffers) + ["input"] * len(input_names)
    _annotate(gm, names, roles)
    moe_rewrite.fuse_grouped_mm(gm)                                       # stand-ins -> grouped matmuls
    if stacks and stamp_out:                                              # 6. stamp out the layers
        params, tied, buffers, grad_names = _stamp(gm, model, stacks, grad_names, input_names)
    elif stacks:   # shallow: only the checks that make layer 1 stand for every middle layer
        _check_stamp(model, stacks, gm)
    log.info("capture: export %.2f s, joint trace %.2f s, %d nodes", exported_at - start,
             time.perf_counter() - exported_at, len(gm.graph.nodes))
    return _captured(gm, params, tied, buffers, input_names, grad_names, stacks, mixed_precision, stamp_out)


def _captured(gm: torch.fx.GraphModule, params: dict, tied: dict, buffers: dict, input_names: list[str],
              grad_names: list[str], stacks: list, mixed_precision: MixedPrecision | None,
              stamp_out: bool = True) -> Captured:
    used = _params_used_in_forward(gm)
    return Captured(
        gm=gm, param_names=list(params), tied=tied, buffer_names=list(buffers),
        input_names=input_names, grad_param_names=grad_names,
        unused_params=[n for n in params if n not in used],
        param_shapes={n: p.shape for n, p in params.items()},
        param_dtypes={n: p.dtype for n, p in params.items()},
        stamped={s.path: s.num_layers for s in stacks} if stamp_out else {}, mixed_precision=mixed_precision,
        shallow={} if stamp_out else {s.path: s.num_layers for s in stacks},
    )


def _check_stamp(model: nn.Module, stacks: list, gm: torch.fx.GraphModule) -> None:
    """Raise StampError where `_stamp` would (tied tensors in a stack, traced layers not alike) without
    stamping anything out."""
    _refuse_ties_in_stacks(model, stacks)
    loss = gm.graph.output_node().args[0][0]
    for stack in stacks:
        stamp.check_stack(gm, stack, loss)


def _refuse_ties_in_stacks(model: nn.Module, stacks: list) -> tuple:
    """The model's (params, tied, buffers); StampError if a tensor inside a stack is tied to another."""
    params, tied = _unique_tensors(model.named_parameters(remove_duplicate=False))
    buffers, buffer_ties = _unique_tensors(model.named_buffers(remove_duplicate=False))
    for name in [*_alias_map(tied), *_alias_map(buffer_ties), *tied, *buffer_ties]:
        if any(name.startswith(s.path + ".") for s in stacks):
            raise stamp.StampError(f"{name} is tied to another tensor")
    return params, tied, buffers


def _grad_names(params: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, p in params.items() if p.requires_grad and p.is_floating_point()]


def _stamp(gm: torch.fx.GraphModule, model: nn.Module, stacks: list, traced_grads: list[str],
           input_names: list[str]) -> tuple:
    """The shallow graph -> the full model's graph; returns the full model's params, ties, buffers
    and gradient names."""
    params, tied, buffers = _refuse_ties_in_stacks(model, stacks)
    outputs = gm.graph.output_node().args[0]
    loss, grads = outputs[0], dict(zip(traced_grads, outputs[1:]))
    for stack in stacks:
        grads = stamp.stamp_stack(gm, stack, loss, grads)
    grad_names = _grad_names(params)
    stamp.finish(gm, loss, grads, [*params, *buffers, *input_names], grad_names)
    return params, tied, buffers, grad_names


# ---------------------------------------------------------------- 1. inputs and names

def _check_inputs(example_inputs: Any, example_kwargs: Any) -> tuple[tuple, dict]:
    if not isinstance(example_inputs, tuple):
        raise InputError(
            f"example_inputs must be a tuple of tensors, got {type(example_inputs).__name__}; "
            "wrap a single input as (x,)")
    args, kwargs = example_inputs, dict(example_kwargs or {})
    if args and isinstance(args[-1], dict):
        args, kwargs = args[:-1], {**args[-1], **kwargs}
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            raise InputError(
                f"example_inputs[{i}] is a {type(a).__name__}; expected a torch.Tensor "
                "(pass keyword arguments and non-tensor options in example_kwargs)")
    if not isinstance(example_kwargs, (dict, type(None))):
        raise InputError(f"example_kwargs must be a dict, got {type(example_kwargs).__name__}")
    return args, kwargs


def _bind_inputs(model: nn.Module, args: tuple, kwargs: dict) -> tuple[list[str], list, Callable]:
    """Name each tensor input after the forward parameter it binds to; return the names, the
    tensors (flat, in order) and `call(*flat) -> model output` that rebuilds args and kwargs."""
    sig = inspect.signature(model.forward)
    if "use_cache" in sig.parameters and "use_cache" not in kwargs:
        kwargs = {**kwargs, "use_cache": False}
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise InputError(f"example inputs do not match {type(model).__name__}.forward{sig}: {e}") from None
    positional = [p.name for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    tensor_keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    names = [positional[i] if i < len(positional) else f"args_{i}" for i in range(len(args))]
    flat = [*args, *(kwargs[k] for k in tensor_keys)]
    num_args = len(args)

    def call(*tensors: torch.Tensor) -> Any:
        kw = {**kwargs, **dict(zip(tensor_keys, tensors[num_args:]))}
        return model(*tensors[:num_args], **kw)

    return names + tensor_keys, flat, call


def _unique_tensors(named: Any) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """Deduplicate shared tensors: canonical name (first seen) -> tensor, and canonical -> others."""
    by_id: dict[int, str] = {}
    unique: dict[str, torch.Tensor] = {}
    tied: dict[str, list[str]] = {}
    for name, t in named:
        canonical = by_id.setdefault(id(t), name)
        if canonical == name:
            unique[name] = t
        else:
            tied.setdefault(canonical, []).append(name)
    return unique, tied


def _alias_map(tied: dict[str, list[str]]) -> dict[str, str]:
    return {alias: canonical for canonical, others in tied.items() for alias in others}


def _to_fake(t: torch.Tensor, mode: compat.FakeTensorMode) -> torch.Tensor:
    """A fake copy of `t`; a meta tensor becomes a fake CPU tensor (no storage either way)."""
    if t.is_meta:
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    return mode.from_tensor(t.detach())


# ---------------------------------------------------------------- 3-4. export and joint retrace

def _retarget_meta_to_cpu(gm: torch.fx.GraphModule) -> None:
    """Make factory ops of a meta-device export create CPU tensors (fakes are CPU), and drop the
    device assertions export inserts, which would pin the graph to the capture device.
    Only an Interpreter runs this graph afterwards, so it is not recompiled."""
    cpu = torch.device("cpu")
    fix = lambda a: cpu if isinstance(a, torch.device) and a.type == "meta" else a  # noqa: E731
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
            continue
        node.args = torch.fx.node.map_aggregate(node.args, fix)
        node.kwargs = torch.fx.node.map_aggregate(node.kwargs, fix)


class _GraphRunner(torch.fx.Interpreter):
    """Runs the exported graph with its parameters/buffers taken from `tensors` (by FQN); `step.node` is
    the node running (a failure's TraceError names its module)."""

    def __init__(self, gm: torch.fx.GraphModule, tensors: dict[str, torch.Tensor], aliases: dict[str, str],
                 step: "_TracedStep"):
        super().__init__(gm)
        self.tensors, self.aliases, self.step = tensors, aliases, step

    def run_node(self, n: torch.fx.Node) -> Any:
        self.step.node = n
        return super().run_node(n)

    def get_attr(self, target: str, args: tuple, kwargs: dict) -> Any:
        name = target.removeprefix(_PREFIX)
        name = self.aliases.get(name, name)
        if name in self.tensors:
            return self.tensors[name]
        return super().get_attr(target, args, kwargs)


def _device_type(tensors) -> str:
    """The device type the step is traced on: the first tensor's (meta is traced as CPU)."""
    kind = next((t.device.type for t in tensors if isinstance(t, torch.Tensor)), "cpu")
    return "cpu" if kind == "meta" else kind


class _TracedStep:
    """`(*params, *buffers, *inputs) -> (loss, *grads)` by functorch over the exported graph."""

    def __init__(self, exported: torch.fx.GraphModule, param_names: list[str],
                 buffer_names: list[str], grad_names: list[str], aliases: dict[str, str],
                 mixed_precision: MixedPrecision | None = None):
        self.exported, self.aliases, self.mixed_precision = exported, aliases, mixed_precision
        self.param_names, self.buffer_names, self.grad_names = param_names, buffer_names, grad_names
        self.node: torch.fx.Node | None = None   # the exported graph's node running

    def __call__(self, *flat: torch.Tensor) -> tuple:
        num_p, num_b = len(self.param_names), len(self.buffer_names)
        params = dict(zip(self.param_names, flat[:num_p]))
        buffers = dict(zip(self.buffer_names, flat[num_p:num_p + num_b]))
        inputs = flat[num_p + num_b:]

        def loss_of(diff: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> torch.Tensor:
            # buffers are an argument, not a closure: functorch only lets a function mutate its inputs.
            # Autocast covers the forward only (as `with autocast: loss = model(x)`; backward outside):
            # torch.export records ops above autocast, so the casts appear when this retrace runs them.
            with autocast_forward(self.mixed_precision, _device_type(flat)):
                out = _GraphRunner(self.exported, {**params, **buffers, **diff}, self.aliases, self).run(*inputs)
            loss = out[0] if isinstance(out, (tuple, list)) else out
            compat.tag_backward_nodes(loss)
            return loss

        diff = {n: params[n] for n in self.grad_names}
        grads, loss = torch.func.grad_and_value(loss_of)(diff, buffers)
        return (loss, *(grads[n] for n in self.grad_names))


# ---------------------------------------------------------------- 5. flatten and annotate

def _flatten_and_clean(gm: torch.fx.GraphModule) -> None:
    """Plain flat calling convention (no pytree codegen) and no no-op alias nodes."""
    out = gm.graph.output_node()
    out.args = (tuple(out.args[0]),)
    out.meta[VAL] = tuple(n.meta[VAL] for n in out.args[0])
    gm.graph.set_codegen(torch.fx.graph.CodeGen())
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.alias.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


def _annotate(gm: torch.fx.GraphModule, names: list[str], roles: list[str]) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(names), (len(placeholders), len(names))
    for node, name, role in zip(placeholders, names, roles):
        node.meta[NAME], node.meta[ROLE] = name, role
    loss = gm.graph.output_node().args[0][0]
    forward = ancestors(loss)
    first_of_seq: dict[int, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        node.meta[PHASE] = "forward" if node in forward or _is_forward_getitem(node, forward) else "backward"
        if node.meta[PHASE] == "forward":
            node.meta[MODULE_PATH] = _module_path(node.meta.get("nn_module_stack"))
            first_of_seq.setdefault(node.meta.get("seq_nr"), node)
            source = node.meta.get("nn_module_stack")
        else:
            source = first_of_seq.get(node.meta.get("seq_nr"))
            node.meta[MODULE_PATH] = source.meta[MODULE_PATH] if source is not None else ""
        if not source:  # e.g. autograd's gradient accumulation: no module of its own ("" is the root)
            node.meta[UNSCOPED] = True


def _is_forward_getitem(node: torch.fx.Node, forward: set[torch.fx.Node]) -> bool:
    """An extra output of a forward op (e.g. layer norm's saved mean/rstd) is forward too."""
    return node.target is operator.getitem and node.args[0] in forward


def _module_path(stack: dict | None) -> str:
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return "" if path == _PREFIX.rstrip(".") else path.removeprefix(_PREFIX)


def _params_used_in_forward(gm: torch.fx.GraphModule) -> set[str]:
    used = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.meta[ROLE] == "param":
            if any(u.meta.get(PHASE) == "forward" for u in node.users):
                used.add(node.meta[NAME])
    return used


def _op_name(node: torch.fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]
