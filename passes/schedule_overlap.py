"""schedule_overlap: gradient reductions start during the backward and are waited at the end of the
step, so their communication overlaps the rest of the backward, as DDP's bucketed all-reduces do.

`bucket_collectives` fuses each process group's step-end reductions (gradient all-reduces or ZeRO
reduce-scatters, and the loss's) into one node at the end of the step. This pass cuts each such node
into buckets in the order the backward produces its inputs (reverse layer order): the first bucket
up to FIRST_BUCKET_BYTES, the others up to BUCKET_BYTES (DDP's 1 MB and 25 MB), by local bytes.
Each bucket becomes
    start_all_reduce / start_reduce_scatter(tensors, ...)  right after its last input is produced:
                                                           copies into a flat buffer and starts the
                                                           collective (it runs on the process
                                                           group's threads), returns at once;
    wait_buckets(in_flight)                                right before the first user of any of
                                                           its results (the graph's output).
A bucket's gradients may be freed as soon as they are copied; the flat buffers live to the end, as
the single fused node's did. Logical collectives are unchanged: each start node lists the ones it
carries in meta["autopar_fused"], so `emitted_collectives(gm)` still equals `Plan.collectives`.
autopar/ir.py's verify lets these starts stay in flight; every other collective is still waited
before the next one starts.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar._torch_compat import stable_toposort
from autopar.graph import FUSED, MODULE_PATH, OUTS, PASS, PHASE, VAL
from autopar.placement import local_shape

from .context import PassContext
from .ops import (
    BUCKET_BYTES,
    contiguous,
    fused_all_reduce,
    fused_reduce_scatter,
    start_all_reduce,
    start_reduce_scatter,
    wait_buckets,
)

FIRST_BUCKET_BYTES = 2**20  # small, so the first reduction starts early in the backward (DDP's choice)
COPIES = (contiguous, torch.ops.aten._to_copy.default)
START = {fused_all_reduce: start_all_reduce, fused_reduce_scatter: start_reduce_scatter}


def local_numel_dtype(node: fx.Node, ctx: PassContext) -> tuple[int, torch.dtype] | None:
    """This rank's element count and dtype of a collective's input: the planned local shape of the
    value it copies (through contiguous / dtype casts, whose dtype counts); None where no node says."""
    dtype = None
    while OUTS not in node.meta or VAL not in node.meta:
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
            return None
        if node.target is torch.ops.aten._to_copy.default and dtype is None:
            dtype = node.kwargs.get("dtype")
        elif node.target is not contiguous and node.target is not torch.ops.aten._to_copy.default:
            return None
        node = node.args[0]
    val, spec = node.meta[VAL], node.meta[OUTS][0]
    if not isinstance(val, torch.Tensor) or spec is None:
        return None
    return torch.Size(local_shape(spec, tuple(val.shape), ctx.axis_sizes)).numel(), dtype or val.dtype


def _local_bytes(node: fx.Node, ctx: PassContext) -> int:
    """This rank's bytes of a collective's input; 0 where no node says (sizes only steer the cut:
    the start ops bucket by the real tensors)."""
    found = local_numel_dtype(node, ctx)
    return 0 if found is None else found[0] * found[1].itemsize


def _cut(members: list[int], sizes: list[int]) -> list[list[int]]:
    """Members (in production order) cut into buckets: the first up to FIRST_BUCKET_BYTES, then BUCKET_BYTES."""
    out, bucket, total, limit = [], [], 0, FIRST_BUCKET_BYTES
    for i in members:
        if bucket and total + sizes[i] > limit:
            out.append(bucket)
            bucket, total, limit = [], 0, BUCKET_BYTES
        bucket.append(i)
        total += sizes[i]
    return out + [bucket]


def _copies_to_their_source(x: fx.Node, order: dict) -> None:
    """Move the copies lowering put before a reduction (contiguous, a dtype cast), inserted where the
    gradient was consumed (the step's end), right after the gradient they copy: the bucket is
    then ready when the backward produces it."""
    chain = []
    while x.op == "call_function" and x.target in COPIES and len(x.users) == 1 and isinstance(x.args[0], fx.Node):
        chain.append(x)
        x = x.args[0]
    for k, node in enumerate(reversed(chain), start=1):
        x.append(node)
        order[node] = order[x] + k / (len(chain) + 1)  # between x and the node after it
        x = node


def _split(gm: fx.GraphModule, fused: fx.Node, order: dict, ctx: PassContext) -> None:
    """One fused reduction -> a start/wait pair per bucket; `order` gets the new nodes' positions."""
    graph = gm.graph
    inputs, rest = fused.args[0], fused.args[1:]
    outs: dict[int, fx.Node] = {u.args[1]: u for u in fused.users}  # getitem(fused, i)
    for x in inputs:
        _copies_to_their_source(x, order)
    members = sorted(range(len(inputs)), key=lambda i: order[inputs[i]])
    sizes = [_local_bytes(x, ctx) for x in inputs]
    for bucket in _cut(members, sizes):
        last = max((inputs[i] for i in bucket), key=order.__getitem__)
        with graph.inserting_after(last):
            start = graph.call_function(START[fused.target], ([inputs[i] for i in bucket], *rest))
        start.meta.update(autopar_fused=[fused.meta[FUSED][i] for i in bucket],
                          phase=last.meta.get(PHASE, "backward"), autopar_pass="schedule_overlap",
                          module_path=last.meta.get(MODULE_PATH, ""))
        order[start] = order[last] + 0.99  # after last's copies (if any), before the next original node
        users = [u for i in bucket if i in outs for u in outs[i].users]
        first = min(users, key=order.__getitem__) if users else graph.output_node()
        with graph.inserting_before(first):
            wait = graph.call_function(wait_buckets, (start,))
            gets = {i: graph.call_function(operator.getitem, (wait, k)) for k, i in enumerate(bucket) if i in outs}
        wait.meta.update(phase="backward", autopar_pass="schedule_overlap")
        order[wait] = order.get(first, len(order)) - 0.5
        for i, get in gets.items():
            get.meta.update(outs[i].meta)
            get.meta[PASS] = "schedule_overlap"
            order[get] = order[wait]
            outs[i].replace_all_uses_with(get)
            graph.erase_node(outs[i])
    graph.erase_node(fused)


def schedule_overlap_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Fused step-end reductions -> buckets started as their last gradient is produced, waited at the end."""
    fused = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in START]
    if not fused:
        return gm  # nothing to schedule: the graph is returned unchanged
    order = {n: i for i, n in enumerate(gm.graph.nodes)}  # once: new nodes get in-between positions
    for node in fused:  # graph order: a 2-D gradient's second reduction reads the first's results
        _split(gm, node, order, ctx)
    stable_toposort(gm)  # a no-op unless an input of a later group follows its start's anchor
    gm.graph.lint()
    gm.recompile()
    return gm
