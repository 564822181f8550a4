"""lower_collectives: replace each abstract redistribute with functional collectives on the right
mesh-axis process group, one mesh axis at a time (the order `autopar.reshard.steps` prices).

Per axis of size n, with this rank at coordinate c:
    S(d) -> R     all_gather_into_tensor along d          P -> R     all_reduce(op)
    P -> S(d)     reduce_scatter_tensor along d           R -> S(d)  narrow(d, c * size, size)
    S(i) -> S(j)  all_to_all_single                       R -> P     rank 0 keeps x, others zeros (avg: x)
    S -> P, P(a) -> P(b): through Replicate.
Collectives work on dim 0: along a dim d != 0, one permute-copy moves the n pieces between dim 0
and their place (after a gather, before a reduce-scatter). Inputs are copied only when not dense. Every
collective's wait node carries meta["autopar_collective"] = (kind, axis, phase, reason).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.placement import R, is_partial, is_shard, local_shape
from autopar.debug import log
from autopar.reshard import transitions

from .context import PassContext
from .ops import contiguous, dense_in_order, redistribute

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


class _Emitter:
    """Appends nodes before `anchor`, tracking the local shape of the value being moved."""

    def __init__(self, gm: fx.GraphModule, anchor: fx.Node, ctx: PassContext, info: dict):
        self.gm, self.anchor, self.ctx, self.info = gm, anchor, ctx, info

    def call(self, target, *args) -> fx.Node:
        with self.gm.graph.inserting_before(self.anchor):
            node = self.gm.graph.call_function(target, args)
        node.meta.update(phase=self.info["phase"], autopar_pass="lower_collectives",
                         module_path=self.anchor.meta.get("module_path", ""))
        return node

    def call_kw(self, target, args: tuple, kwargs: dict) -> fx.Node:
        node = self.call(target, *args)
        node.kwargs = kwargs
        return node

    def collective(self, kind: str, axis: int, target, *args) -> fx.Node:
        wait = self.call(c10d.wait_tensor.default, self.call(target, *args))
        wait.meta["autopar_collective"] = dict(kind=kind, axis=self.ctx.axis_names[axis], **self.info)
        log(3, f"{kind} on axis {self.ctx.axis_names[axis]} ({self.info['phase']}): {self.info['reason']}")
        return wait

    def gather(self, x: fx.Node, d: int, shape: tuple, axis: int) -> fx.Node:
        """all_gather along dim d of x (local shape `shape`): the collective stacks the n pieces on
        dim 0, so for d > 0 one permute-copy puts them in place (DTensor does the same)."""
        n, group = self.ctx.axis_sizes[axis], self.ctx.group_names[axis]
        y = self.collective("all_gather", axis, c10d.all_gather_into_tensor.default, self.call(contiguous, x), n, group)
        if d == 0:
            return y
        stacked = self.call(aten.view.default, y, [n, *shape])
        moved = self.call(aten.permute.default, stacked, [*range(1, d + 1), 0, *range(d + 1, len(shape) + 1)])
        full = [*shape[:d], shape[d] * n, *shape[d + 1:]]
        return self.call(aten.view.default, self.call_kw(aten.clone.default, (moved,),
                                                         {"memory_format": torch.contiguous_format}), full)

    def reduce_scatter(self, x: fx.Node, d: int, shape: tuple, axis: int, op: str) -> fx.Node:
        """reduce_scatter along dim d of x (local shape `shape`, whole along d): for d > 0 one
        permute-copy brings the n pieces to the front; the result is already dense."""
        n, group = self.ctx.axis_sizes[axis], self.ctx.group_names[axis]
        x = self.call(contiguous, x)
        if d > 0:
            split = self.call(aten.view.default, x, [*shape[:d], n, shape[d] // n, *shape[d + 1:]])
            moved = self.call(aten.permute.default, split, [d, *range(d), *range(d + 1, len(shape) + 1)])
            x = self.call_kw(aten.clone.default, (moved,), {"memory_format": torch.contiguous_format})
        y = self.collective("reduce_scatter", axis, c10d.reduce_scatter_tensor.default, x, op, n, group)
        if d == 0:
            return y
        return self.call(aten.view.default, y, [*shape[:d], shape[d] // n, *shape[d + 1:]])


def _axis(em: _Emitter, x: fx.Node, src, dst, axis: int, shape: tuple) -> fx.Node:
    """Move x (local shape `shape`) from src to dst on one axis."""
    ctx = em.ctx
    n, c, group = ctx.axis_sizes[axis], ctx.coords[axis], ctx.group_names[axis]
    if src == dst or n == 1:
        return x
    if is_partial(src) and (dst == R or is_partial(dst)):
        y = em.collective("all_reduce", axis, c10d.all_reduce.default, x, src.reduce_op, group)
        return y if dst == R else _axis(em, y, R, dst, axis, shape)
    if is_partial(src) and is_shard(dst):
        return em.reduce_scatter(x, dst.dim, shape, axis, src.reduce_op)
    if is_shard(src) and is_shard(dst):
        return _all_to_all(em, x, src.dim, dst.dim, axis, shape)
    if is_shard(src):  # -> R, or -> P through R
        y = em.gather(x, src.dim, shape, axis)
        if dst == R:
            return y
        full = list(shape)
        full[src.dim] *= n
        return _axis(em, y, R, dst, axis, tuple(full))
    if is_shard(dst):  # R -> S(d): keep my slice
        size = shape[dst.dim] // n
        return em.call(aten.slice.Tensor, x, dst.dim, c * size, (c + 1) * size)
    # R -> Partial: rank 0 holds the value for a sum, everyone for an average
    if dst.reduce_op == "sum" and c != 0:
        return em.call(aten.zeros_like.default, x)
    return x


def _all_to_all(em: _Emitter, x: fx.Node, i: int, j: int, axis: int, shape: tuple) -> fx.Node:
    """S(i) -> S(j): split j into n parts, exchange, concatenate the received parts along i."""
    n, group = em.ctx.axis_sizes[axis], em.ctx.group_names[axis]
    parts = [em.call(aten.slice.Tensor, x, j, k * (shape[j] // n), (k + 1) * (shape[j] // n)) for k in range(n)]
    stacked = em.call(aten.stack.default, parts)
    y = em.collective("all_to_all", axis, c10d.all_to_all_single.default, stacked, [1] * n, [1] * n, group)
    pieces = [em.call(aten.select.int, y, 0, k) for k in range(n)]
    return em.call(aten.cat.default, pieces, i)


def _restore_layout(em: _Emitter, y: fx.Node, val: torch.Tensor) -> fx.Node:
    """y with its dims laid out in memory in the original value's order (e.g. the CPU attention
    kernel returns B,H,S,D stored as B,S,H,D; later views rely on that); copies only when needed."""
    order = sorted(range(val.dim()), key=lambda d: (-val.stride(d), d))
    return em.call(dense_in_order, y, order)


def _lower_one(gm: fx.GraphModule, node: fx.Node, ctx: PassContext) -> None:
    x, src, dst = node.args[0], node.meta["autopar_src"], node.meta["autopar_outs"][0]
    info = dict(phase=node.meta.get("phase", "forward"), reason=node.meta.get("autopar_reason", ""),
                source=x.name)
    em = _Emitter(gm, node, ctx, info)
    gshape = tuple(node.meta["val"].shape)
    current = list(src)
    y = x
    for axis, frm, to in transitions(tuple(src), tuple(dst)):
        lshape = local_shape(tuple(current), gshape, ctx.axis_sizes)
        y = _axis(em, y, frm, to, axis, lshape)
        current[axis] = to
    if y is not x:  # permutes and slices leave strides the graph's later views never saw
        y = _restore_layout(em, y, node.meta["val"])
    y.meta["autopar_outs"] = (tuple(dst),)
    y.meta.setdefault("val", node.meta["val"])  # the global value, as users' shape rewrites expect
    node.replace_all_uses_with(y)
    gm.graph.erase_node(node)


def lower_collectives_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """No redistribute node survives; each became functional collectives (+ waits) or local ops."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is redistribute:
            _lower_one(gm, node, ctx)
    gm.graph.lint()
    gm.recompile()
    return gm


