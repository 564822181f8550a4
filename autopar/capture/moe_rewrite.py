"""Capture of transformers' mixture-of-experts layers: their grouped matmul made traceable.

Mixture-of-experts: a traceable grouped matmul and its strategies, expert parallelism included.

Capture route. transformers' Mixtral keeps its experts as 3-D weights (gate_up_proj [E, 2I, H],
down_proj [E, H, I]) and offers three experts implementations: "eager" loops over the experts hit
(data-dependent `nonzero`: export guards fail), "batched_mm" gathers a whole [2I, H] weight per
token (captures, but its backward materializes S x 2I x H gradients: 3.8 TB per layer at 8x7B
size, and nothing to shard by expert), and "grouped_mm", which sorts the S = tokens x top_k rows by
expert and runs one grouped matmul over contiguous row groups (`offs` = cumulative rows per expert).
autopar captures "grouped_mm". On CPU and in float32 transformers calls its custom op
`transformers::grouped_mm_fallback` (aten._grouped_mm's fake kernel accepts bf16 only); neither its
autograd registration nor any Python autograd.Function survives the joint trace (functorch's grad
inside functionalize: "NYI: Functionalize rule for custom_function_call"). So `use_traceable_experts`
swaps that node of the exported graph for `standin`, mm(x, w.sum(0)): same shapes, a backward torch
knows (an mm for grad x, a broadcast mm(x.T, g) for grad w); after the joint trace `fuse_grouped_mm`
replaces those three matmuls by autopar's custom ops `autopar::grouped_mm` (forward and grad x) and
`autopar::grouped_mm_wgrad` (grad w), with the original `offs`. The model is not modified.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.capture.moe_ops import GROUPED_MM, GROUPED_MM_WGRAD
from autopar.graph import VAL

aten = torch.ops.aten


def standin(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """What the joint trace differentiates in place of a grouped matmul: mm(x, w.sum(0)) has the same
    shapes and a backward of the same structure (mm for grad x, broadcast of mm(x.T, g) for grad w);
    `fuse_grouped_mm` then swaps the three matmuls for the grouped ones. `offs` rides along in a
    zero-valued term so the fused nodes can find it."""
    return torch.mm(x, w.sum(0)) + (offs[-1] * 0).to(x.dtype)


def use_traceable_experts(gm: fx.GraphModule) -> int:
    """Retarget transformers' CPU grouped-matmul custom op in an exported graph to `standin` (same
    arguments; `fuse_grouped_mm` restores the maths after the joint trace) and make histc count
    floats; returns how many grouped matmuls changed."""
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is None:
        return 0
    changed = 0
    for node in gm.graph.nodes:
        counted = node.args[0].meta.get(VAL) if node.target is torch.ops.aten.histc.default else None
        if counted is not None and not counted.is_floating_point():  # a meta-device export takes
            with gm.graph.inserting_before(node):                 # transformers' CUDA branch (no CPU kernel)
                as_float = gm.graph.call_function(torch.ops.aten._to_copy.default, (node.args[0],),
                                                  {"dtype": torch.float32})
            node.args = (as_float, *node.args[1:])
        if node.op == "call_function" and node.target in (fallback, getattr(fallback, "default", None)):
            x, w = node.args[:2]
            offs = node.args[2] if len(node.args) > 2 else node.kwargs["offs"]
            node.target, node.args, node.kwargs = standin, (x, w, offs), {}
            changed += 1
    return changed


def fuse_grouped_mm(gm: fx.GraphModule) -> int:
    """In a joint graph traced through `standin`, swap mm(x, w.sum(0)) and its two backward matmuls
    for grouped_mm / grouped_mm_wgrad on the 3-D weight; returns how many stand-ins were fused."""
    fused = 0
    for node in list(gm.graph.nodes):
        if node.target is aten.sum.dim_IntList and list(node.args[1]) == [0] and node.args[0].meta[VAL].ndim == 3:
            fwd = [u for u in node.users if u.target is aten.mm.default and u.args[1] is node]
            if len(fwd) == 1 and _fuse_one(gm, node.args[0], node, fwd[0]):
                fused += 1
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return fused


def _fuse_one(gm: fx.GraphModule, w: fx.Node, summed: fx.Node, fwd: fx.Node) -> bool:
    marker = next((u for u in fwd.users if u.target is aten.add.Tensor), None)
    offs = _offs_of(marker.args[1]) if marker is not None else None
    if offs is None:
        return False
    x = fwd.args[0]
    _replace(gm, marker, GROUPED_MM, (x, w, offs))
    for t in [u for u in summed.users if u.target is aten.permute.default]:
        for grad_x in [u for u in t.users if u.target is aten.mm.default and u.args[1] is t]:
            with gm.graph.inserting_before(grad_x):
                wt = gm.graph.call_function(aten.permute.default, (w, [0, 2, 1]))
            wt.meta.update(grad_x.meta, val=w.meta[VAL].permute(0, 2, 1))
            _replace(gm, grad_x, GROUPED_MM, (grad_x.args[0], wt, offs))
    for xt in [u for u in x.users if u.target is aten.permute.default]:
        for grad_w0 in [u for u in xt.users if u.target is aten.mm.default and u.args[0] is xt]:
            grad_w = _broadcast_over_experts(grad_w0, w.meta[VAL].shape)
            if grad_w is not None:
                _replace(gm, grad_w, GROUPED_MM_WGRAD, (x, grad_w0.args[1], offs))
    return True


def _offs_of(n: fx.Node) -> fx.Node | None:
    """The 1-D integer tensor the stand-in's zero term `(offs[-1] * 0).to(dtype)` was made from."""
    while isinstance(n, fx.Node) and n.all_input_nodes:
        n = n.all_input_nodes[0]
        val = n.meta.get(VAL)
        if isinstance(val, torch.Tensor) and val.ndim == 1 and not val.is_floating_point():
            return n
    return None


def _broadcast_over_experts(n: fx.Node, shape) -> fx.Node | None:
    """The node that expands grad(w.sum(0)) back to the [E, K, N] weight (sum's backward)."""
    while len(n.users) == 1:
        n = next(iter(n.users))
        if tuple(n.meta[VAL].shape) == tuple(shape):
            return n
    return None


def _replace(gm: fx.GraphModule, old: fx.Node, target, args: tuple) -> None:
    with gm.graph.inserting_before(old):
        new = gm.graph.call_function(target, args)
    vals = [a.meta[VAL] if isinstance(a, fx.Node) else a for a in args]
    with vals[0].fake_mode:
        val = target(*vals)
    new.meta.update(old.meta, val=val)
    old.replace_all_uses_with(new)
    gm.graph.erase_node(old)
