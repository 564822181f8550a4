"""How an Inductor-compiled per-rank program runs the joint graph: which ops become kernels of their own,
which fuse, and which bytes a fused kernel moves. The planner prices a plan made with `compile=True`
(`HardwareSpec.compiled`) by this model instead of one dispatched ATen call per node.

Each op of the joint graph gets a role:
    free    a view (view, permute, expand, ...): Inductor folds it into its readers' indexing; no kernel,
            no bytes, no dispatch (the eager program pays `op_overhead` for each)
    extern  a matmul, attention or other FLOP-counted op (`costmodel.compute.is_flop_counted`), or an op
            Inductor leaves to ATen (`EXTERN_OPS`): a kernel of its own that reads every input and writes
            every output, as in eager
    fused   every other op (pointwise, reductions, norms, casts, copies, embeddings): Inductor fuses the
            memory-bound chains between extern ops into kernels that read each input once and write
            only what leaves the chain
A fused op reads an input from memory only when its producer (seen through views) is not a fused op of
the same phase, and writes an output only when a consumer is not one (an extern op, an op of the other
phase, e.g. a forward value the backward reads, or the graph's output). A fused op that writes is the end
of a kernel and pays one launch (`HardwareSpec.kernel_overhead`); one whose outputs all stay in the chain
pays none. So a chain of L pointwise ops over a tensor of B bytes costs one pass, (inputs + output)/W + o,
not L·(2B/W + o): what `autopar calibrate` measures of a compiled chain (`autopar/calibration/compiled.py`).
Inductor's own choices differ in detail (it may recompute a cheap value in two kernels, or split a
reduction's consumers into a second kernel); `tests/test_fusion.py` compares this model's kernel count
with the kernels Inductor emits for a GPT's joint graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.costmodel import compute
from autopar.graph import PHASE, VIEW_OPS, is_getitem, packet, producer_of

aten = torch.ops.aten
FREE_OPS = VIEW_OPS - {aten.clone, aten._to_copy}   # aliases (clone and casts are copies: fused)
# ops Inductor runs through ATen as they are (no lowering of its own), beyond the FLOP-counted ones
EXTERN_OPS = frozenset({aten._scaled_dot_product_flash_attention_for_cpu,
                        aten._scaled_dot_product_flash_attention_for_cpu_backward,
                        aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward,
                        aten._scaled_dot_product_efficient_attention,
                        aten._scaled_dot_product_efficient_attention_backward,
                        aten._scaled_dot_product_cudnn_attention, aten._scaled_dot_product_cudnn_attention_backward})


@dataclass(frozen=True)
class Kernel:
    """One op's part in the compiled program: its role, which inputs (`node.all_input_nodes` order) it reads
    from memory, which outputs it writes, and whether it ends a kernel (pays one launch)."""

    role: str                  # "free" | "extern" | "fused"
    reads: tuple[bool, ...]
    writes: tuple[bool, ...]
    launches: bool


def role_of(node: fx.Node) -> str:
    """"free", "extern" or "fused" (see the module docstring); placeholders and the output are "extern"
    (memory a kernel reads from or writes to)."""
    if node.op != "call_function" or is_getitem(node):
        return "extern"
    if packet(node) in FREE_OPS:
        return "free"
    if packet(node) in EXTERN_OPS or compute.is_flop_counted(node.target):
        return "extern"
    return "fused"


def compiled_kernels(gm: fx.GraphModule) -> dict[fx.Node, Kernel]:
    """Every op's `Kernel` in the program Inductor compiles from `gm` (getitems are seen through)."""
    roles = {n: role_of(n) for n in gm.graph.nodes}
    out = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_getitem(node):
            continue
        role = roles[node]
        if role != "fused":
            width = _num_outputs(node)
            out[node] = Kernel(role, tuple(role == "extern" for _ in node.all_input_nodes),
                               tuple(role == "extern" for _ in range(width)), role == "extern")
            continue
        phase = node.meta.get(PHASE)
        reads = tuple(not _fuses(_source(a), phase, roles) for a in node.all_input_nodes)
        writes = tuple(v is not None and any(not _fuses(u, phase, roles) for u in _consumers(v))
                       for v in _outputs(node))
        out[node] = Kernel(role, reads, writes, any(writes))
    return out


def count_kernels(kernels: dict[fx.Node, Kernel]) -> int:
    """Kernels the compiled program launches, by this model: extern ops and the ends of fused chains."""
    return sum(k.launches for k in kernels.values())


def _fuses(node: fx.Node, phase, roles: dict) -> bool:
    """Can a fused op of `phase` share a kernel with `node` (its producer or consumer)?"""
    return roles[node] == "fused" and node.meta.get(PHASE) == phase


def _source(value: fx.Node) -> fx.Node:
    """The op that computes `value`, seen through views and getitems."""
    node, _ = producer_of(value)
    while node.op == "call_function" and packet(node) in FREE_OPS and node.all_input_nodes:
        node, _ = producer_of(node.all_input_nodes[0])
    return node


def _consumers(value: fx.Node) -> list[fx.Node]:
    """The non-view ops (or the output node) that read `value`, seen through views."""
    found, todo = [], list(value.users)
    while todo:
        user = todo.pop()
        if user.op == "call_function" and (packet(user) in FREE_OPS or is_getitem(user)):
            todo.extend(user.users)
        else:
            found.append(user)
    return found


def _outputs(node: fx.Node) -> list[fx.Node | None]:
    """One value per output of `node`: itself, or the getitems that select its outputs (in output order;
    None for an output nobody selects)."""
    width = _num_outputs(node)
    if width == 1:
        return [node]
    picked = {int(u.args[1]): u for u in node.users if is_getitem(u)}
    return [picked.get(i) for i in range(width)]


def _num_outputs(node: fx.Node) -> int:
    val = node.meta.get("val")
    return len(val) if isinstance(val, (tuple, list)) else 1
