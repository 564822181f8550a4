"""grads_into_buckets: weight gradients are computed straight into their slot of the flat buffer that
all-reduces them, instead of into a tensor of their own that the bucket then copies.

`schedule_overlap` leaves each gradient bucket as `start_all_reduce(tensors, ...)`, which copies its
tensors into a new flat buffer and reduces that buffer in place. Most of those bytes are weight
gradients, each the result of one matmul (`mm(grad_out^T, x)`, seen by the bucket through a pair of
transposes that cancel). This pass allocates the bucket's buffer before the first of them is computed
(`bucket_buffer`, with the layout the start will use: the members one after another, by local size),
turns each such matmul into `mm_into(a, b, flat, offset)` (the same BLAS call with `out=` its slot),
and hands the buffer to the start (`start_all_reduce(..., into=flat)`), which then copies only the
members computed elsewhere (biases, norm weights, the loss). DDP copies every gradient into its bucket
and, by default, back out after the reduction; autopar now copies neither way for these. The step_time
GPT at 2 ranks: 12.6 of the 13.7 MB per step no longer copied, about 1 ms less per step (of ~310; a
probe alternating the pass on and off). Dropping the copies outright measured 5 ms, but most of that
was writing the fresh buffer, which the matmul now does instead of writing a buffer of its own.

A matmul qualifies when its result reaches the bucket only through permutes that compose to the
identity and nothing else reads it: the bucket's reduction runs in place, so a later reader of the
slot would see the reduced value. Only all-reduce buckets (a reduce-scatter's slots are strided
columns) whose members share one dtype and have known local sizes are laid out. The values and the
collectives are unchanged; a graph without such a bucket is returned unchanged.

Memory: the buffer lives from the bucket's first gradient instead of from its start, so up to one
bucket (BUCKET_BYTES) is allocated earlier in the backward than the gradients it holds were, one by
one, before (DDP keeps its buckets allocated for the whole run). The plan books every gradient whole
under "grads", and `autopar.runtime.memtrack` counts the buffer as their storage, not as activations.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.graph import INTO_BUCKET, PHASE

from .context import PassContext
from .ops import bucket_buffer, mm_into, start_all_reduce
from .schedule_overlap import local_numel_dtype

aten = torch.ops.aten
NAME = "grads_into_buckets"


def _computed_in_slot(member: fx.Node, start: fx.Node) -> fx.Node | None:
    """The mm whose result `member` is, when only identity-composing permutes lie between them and
    each node on the way has the next as its only user (the member: `start` alone, listed once)."""
    if list(member.users) != [start] or start.args[0].count(member) != 1:
        return None
    node, order = member, None  # order: the dims of `member` in terms of the dims of `node`
    while node.op == "call_function" and node.target is aten.permute.default:
        dims = list(node.args[1])
        order = dims if order is None else [dims[d] for d in order]
        parent = node.args[0]
        if not isinstance(parent, fx.Node) or list(parent.users) != [node]:
            return None
        node = parent
    if node.op != "call_function" or node.target is not aten.mm.default or node.kwargs:
        return None
    if order is not None and order != list(range(len(order))):
        return None
    return node


def _lay_out(gm: fx.GraphModule, start: fx.Node, at: dict, ctx: PassContext) -> bool:
    members = start.args[0]
    layout = [local_numel_dtype(x, ctx) for x in members]
    if any(found is None for found in layout) or len({dtype for _, dtype in layout}) != 1:
        return False
    producers = {i: mm for i, x in enumerate(members) if (mm := _computed_in_slot(x, start)) is not None}
    if not producers:
        return False
    offsets, total = [], 0
    for numel, _ in layout:
        offsets.append(total)
        total += numel
    graph = gm.graph
    with graph.inserting_before(min(producers.values(), key=at.__getitem__)):
        flat = graph.call_function(bucket_buffer, (total, layout[0][1], ctx.device))
    flat.meta.update(autopar_pass=NAME, phase=start.meta.get(PHASE, "backward"))
    for i, mm in producers.items():
        with graph.inserting_before(mm):
            into = graph.call_function(mm_into, (*mm.args, flat, offsets[i]))
        into.meta.update(mm.meta)
        into.meta[INTO_BUCKET] = start.name
        mm.replace_all_uses_with(into)
        graph.erase_node(mm)
    start.kwargs = {**start.kwargs, "into": flat}
    return True


def grads_into_buckets_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Each all-reduce bucket's matmul-computed gradients -> computed into its pre-allocated buffer."""
    starts = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is start_all_reduce
              and "into" not in n.kwargs]
    at = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = [_lay_out(gm, start, at, ctx) for start in starts]
    if not any(changed):
        return gm  # nothing to lay out: the graph is returned unchanged
    gm.graph.lint()
    gm.recompile()
    return gm
