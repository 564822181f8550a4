"""localize_shapes: rewrite global sizes baked into op arguments (view, expand, full, slice, ...)
to this rank's local sizes under the node's planned output spec, and the capture device baked into
factory ops (`device=cpu`) to this rank's device."""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.graph import INS, OUTS, VAL
from autopar.placement import local_shape
from autopar.sharding.rules.localize import SIZE_ARG, SPLIT_ARG, localize_args

from .context import PassContext


def localize_shapes_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Each shape-carrying op now builds its local shard's shape."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.kwargs.get("device"), torch.device) \
                and node.kwargs["device"] != torch.device(ctx.device):
            node.kwargs = {**node.kwargs, "device": torch.device(ctx.device)}
        if node.op != "call_function" or OUTS not in node.meta or VAL not in node.meta:
            continue
        packet = getattr(node.target, "overloadpacket", None)
        if packet is torch.ops.aten.convolution_backward:
            _localize_bias_sizes(node, ctx)
            continue
        if packet is None or (packet not in SIZE_ARG and packet not in SPLIT_ARG
                              and packet.__name__ not in ("slice", "slice_copy")):
            continue
        val = node.meta[VAL]
        out_spec = node.meta[OUTS][0]
        inputs = node.all_input_nodes
        in_val = inputs[0].meta.get(VAL) if inputs else None
        in_spec = node.meta[INS][0] if inputs else None
        out_shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None  # a split: several outputs
        node.args = localize_args(node.target, node.args, out_shape, out_spec,
                                  tuple(in_val.shape) if in_val is not None else None, in_spec, ctx.axis_sizes)
    gm.graph.lint()
    gm.recompile()
    return gm


def _localize_bias_sizes(node: fx.Node, ctx: PassContext) -> None:
    """convolution_backward's `bias_sizes` (argument 3) is the bias gradient's shape: make it local."""
    spec, bias = node.meta[OUTS][2], node.meta[VAL][2]
    if node.args[3] is None or spec is None or bias is None:
        return
    args = list(node.args)
    args[3] = list(local_shape(spec, tuple(bias.shape), ctx.axis_sizes))
    node.args = tuple(args)
