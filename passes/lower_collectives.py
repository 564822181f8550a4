"""lower_collectives: replace each abstract redistribute with functional collectives on the right
mesh-axis process group, one mesh axis at a time (the order `autopar.planning.reshard.steps` prices).

Per axis of size n, with this rank at coordinate c:
    S(d) -> R     all_gather_into_tensor along d          P -> R     all_reduce(op)
    P -> S(d)     reduce_scatter_tensor along d           R -> S(d)  narrow(d, c * size, size)
    S(i) -> S(j)  all_to_all_single                       R -> P     rank 0 keeps x, others zeros (avg: x)
    S -> P, P(a) -> P(b): through Replicate.
    strided shards (SS(d, k)): gather + local reorder, slice, reorder + reduce_scatter (`_strided_axis`).
Collectives work on dim 0: along a dim d != 0, one permute-copy moves the n pieces between dim 0
and their place (after a gather, before a reduce-scatter). Inputs are copied only when not dense. Every
collective's wait node carries meta["autopar_collective"] = (kind, axis, phase, reason).
MoE grouped matmuls (autopar/sharding/rules/moe.py) split by rows get this rank's offsets; expert-parallel ones
are lowered to dispatch all_to_all -> local grouped matmul (-> combine all_to_all), split sizes from
`offs` at run time.
Under a mixed-precision plan whose reduce_dtype is narrower than a gradient's dtype, the gradient is
cast to it before its collectives and back after them (`_reduce_dtype`), as the plan priced.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar.capture.moe_ops import GROUPED_MM, GROUPED_MM_WGRAD
from autopar.debug import log
from autopar.graph import COLLECTIVE, INS, MODULE_PATH, OUTS, PHASE, REASON, SRC, VAL
from autopar.placement import R, is_partial, is_shard, is_strided, local_shape, pieces
from autopar.planning.reshard import transitions
from autopar.sharding.rules.moe import ep_axes

from . import moe_dispatch
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
                         module_path=self.anchor.meta.get(MODULE_PATH, ""))
        return node

    def call_kw(self, target, args: tuple, kwargs: dict) -> fx.Node:
        node = self.call(target, *args)
        node.kwargs = kwargs
        return node

    def collective(self, kind: str, axis: int, target, *args) -> fx.Node:
        wait = self.call(c10d.wait_tensor.default, self.call(target, *args))
        wait.meta[COLLECTIVE] = dict(kind=kind, axis=self.ctx.axis_names[axis], **self.info)
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
    if is_strided(src) or is_strided(dst):
        return _strided_axis(em, x, src, dst, axis, shape)
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


def _swap_blocks(em: _Emitter, x: fx.Node, d: int, shape: tuple, a: int, b: int) -> fx.Node:
    """x (local shape `shape`) with dim d viewed as [a, b, m] reordered to [b, a, m] (one copy)."""
    m = shape[d] // (a * b)
    blocks = em.call(aten.view.default, em.call(contiguous, x), [*shape[:d], a, b, m, *shape[d + 1:]])
    moved = em.call(aten.transpose.int, blocks, d, d + 1)
    dense = em.call_kw(aten.clone.default, (moved,), {"memory_format": torch.contiguous_format})
    return em.call(aten.view.default, dense, list(shape))


def _strided_axis(em: _Emitter, x: fx.Node, src, dst, axis: int, shape: tuple) -> fx.Node:
    """Moves to or from a strided shard SS(d, k) (rank r holds [piece0_r; ...; piece(k-1)_r]):
        SS -> R   all_gather along d ([n, k, m] blocks), then reorder to [k, n, m]
        R -> SS   keep block c of each piece          P -> SS   reorder to [n, k, m], reduce_scatter
        anything else: through Replicate (as autopar.planning.reshard prices it)."""
    n, c = em.ctx.axis_sizes[axis], em.ctx.coords[axis]
    if is_strided(src):
        d, k = src.dim, pieces(src)
        full = list(shape)
        full[d] *= n
        y = _swap_blocks(em, em.gather(x, d, shape, axis), d, tuple(full), n, k)
        return y if dst == R else _axis(em, y, R, dst, axis, tuple(full))
    d, k = dst.dim, pieces(dst)
    if is_partial(src):
        return em.reduce_scatter(_swap_blocks(em, x, d, shape, k, n), d, shape, axis, src.reduce_op)
    if is_shard(src):  # a plain shard: gather it whole first
        full = list(shape)
        full[src.dim] *= n
        return _axis(em, em.gather(x, src.dim, shape, axis), R, dst, axis, tuple(full))
    m = shape[d] // (k * n)
    blocks = em.call(aten.view.default, em.call(contiguous, x), [*shape[:d], k, n, m, *shape[d + 1:]])
    mine = em.call(aten.select.int, blocks, d + 1, c)
    dense = em.call_kw(aten.clone.default, (mine,), {"memory_format": torch.contiguous_format})
    return em.call(aten.view.default, dense, [*shape[:d], k * m, *shape[d + 1:]])


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


def _reduce_dtype(ctx: PassContext, node: fx.Node, steps) -> torch.dtype | None:
    """The dtype a gradient's collectives move when the plan's mixed precision asks for a narrower one
    than the gradient's (`reduce_dtype`, autopar.capture.precision; the cost model prices the same bytes);
    None: move the value as it is."""
    policy = getattr(ctx.plan, "mixed_precision", None)
    if not policy or not node.meta.get(REASON, "").startswith("gradient"):
        return None
    wire, have = getattr(torch, policy["reduce_dtype"]), node.meta[VAL].dtype
    if not have.is_floating_point or wire.itemsize >= have.itemsize:
        return None
    moves = any((is_partial(frm) or is_shard(frm)) and ctx.axis_sizes[axis] > 1 for axis, frm, _ in steps)
    return wire if moves else None  # R -> S (a slice) or R -> P moves nothing: no casts


def _lower_one(gm: fx.GraphModule, node: fx.Node, ctx: PassContext) -> None:
    x, src, dst = node.args[0], node.meta[SRC], node.meta[OUTS][0]
    info = dict(phase=node.meta.get(PHASE, "forward"), reason=node.meta.get(REASON, ""),
                source=x.name)
    em = _Emitter(gm, node, ctx, info)
    gshape = tuple(node.meta[VAL].shape)
    current = list(src)
    steps = transitions(tuple(src), tuple(dst))
    wire = _reduce_dtype(ctx, node, steps)
    y = x if wire is None else em.call_kw(aten._to_copy.default, (x,), {"dtype": wire})
    for axis, frm, to in steps:
        lshape = local_shape(tuple(current), gshape, ctx.axis_sizes)
        y = _axis(em, y, frm, to, axis, lshape)
        current[axis] = to
    if wire is not None:  # back to the parameter's dtype (fp32) for the optimizer
        y = em.call_kw(aten._to_copy.default, (y,), {"dtype": node.meta[VAL].dtype})
    if y is not x:  # permutes and slices leave strides the graph's later views never saw
        y = _restore_layout(em, y, node.meta[VAL])
    y.meta[OUTS] = (tuple(dst),)
    y.meta.setdefault(VAL, node.meta[VAL])  # the global value, as users' shape rewrites expect
    node.replace_all_uses_with(y)
    gm.graph.erase_node(node)


def lower_collectives_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """No redistribute node survives; each became functional collectives (+ waits) or local ops.
    Grouped matmuls split by rows get this rank's offsets, and expert-parallel ones their dispatch."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is redistribute:
            _lower_one(gm, node, ctx)
        elif node.op == "call_function" and node.target in (GROUPED_MM, GROUPED_MM_WGRAD):
            _lower_grouped(gm, node, ctx)
    gm.graph.lint()
    gm.recompile()
    return gm


# ---------------------------------------------------------------- grouped matmuls (MoE experts)

def _nested_range(spec, size: int, dim_coords, ctx: PassContext) -> tuple[int, int]:
    """[lo, hi) of dim 0 that a Shard(0) on several axes (nested in axis order) leaves this rank."""
    lo = 0
    for axis, p in enumerate(spec):
        if is_shard(p, 0):
            size //= ctx.axis_sizes[axis]
            lo += dim_coords[axis] * size
    return lo, lo + size


def _lower_grouped(gm: fx.GraphModule, node: fx.Node, ctx: PassContext) -> None:
    """Rows split (x Shard(0)): offsets relative to this rank's rows. Expert parallel (experts split
    too): all_to_all the rows to the ranks holding their experts, and back (autopar/sharding/rules/moe.py)."""
    ins, outs = node.meta[INS], node.meta[OUTS]
    if not any(is_shard(p, 0) for p in ins[0]):
        return
    rows = node.all_input_nodes[0].meta[VAL].shape[0]
    experts_spec = ins[1] if node.target is GROUPED_MM else outs[0]
    experts = node.args[2].meta[VAL].shape[0]
    axes = ep_axes(node.target, ins, outs)
    if len(axes) > 1:
        raise NotImplementedError("expert parallelism on more than one mesh axis is not lowered yet")
    info = dict(phase=node.meta.get(PHASE, "forward"), reason=f"expert dispatch for {node.name}", source=node.name)
    em = _Emitter(gm, node, ctx, info)
    if not axes:
        lo, hi = _nested_range(ins[0], rows, ctx.coords, ctx)
        node.args = (*node.args[:2], em.call(moe_dispatch.local_offsets, node.args[2], lo, hi, 0, experts))
        return
    axis = axes[0]
    members = []
    for q in range(ctx.axis_sizes[axis]):
        coords = [*ctx.coords[:axis], q, *ctx.coords[axis + 1:]]
        members.append((_nested_range(ins[0], rows, coords, ctx), _nested_range(experts_spec, experts, coords, ctx)))
    plan = em.call(moe_dispatch.ep_dispatch, node.args[2], members, ctx.coords[axis])
    send, recv, offs = (em.call(operator.getitem, plan, i) for i in range(3))
    group = ctx.group_names[axis]
    moved = [em.collective("all_to_all", axis, c10d.all_to_all_single.default, em.call(contiguous, a), recv, send, group)
             for a in node.args[:1 if node.target is GROUPED_MM else 2]]
    if node.target is GROUPED_MM:
        y = em.call(node.target, moved[0], node.args[1], offs)
        y = em.collective("all_to_all", axis, c10d.all_to_all_single.default, y, send, recv, group)
    else:
        y = em.call(node.target, moved[0], moved[1], offs)
    y.meta.update(val=node.meta[VAL], autopar_outs=outs)
    node.replace_all_uses_with(y)
    gm.graph.erase_node(node)
