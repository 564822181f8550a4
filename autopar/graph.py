"""Graph helpers every stage needs: node-meta keys, view ops, and small readers of FX nodes.

A leaf module (it imports only torch), so capture, sharding, planning, the passes and the cost model
read nodes the same way without importing one another. What each meta key holds, and which stage
writes it, is listed here once; `autopar/ir.py` checks the keys each stage promises.
"""
from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx

aten = torch.ops.aten

# ---------------------------------------------------------------- node.meta keys
VAL = "val"                      # FakeTensor (or tuple of them): global shape before localize, local after
PHASE = "phase"                  # "forward" | "backward" | "optimizer" (capture)
MODULE_PATH = "module_path"      # owning module's FQN, e.g. "transformer.h.0.attn" (capture)
NAME = "autopar_name"            # a placeholder's FQN or input name (capture)
ROLE = "autopar_role"            # a placeholder's role: "param" | "buffer" | "input" (capture)
UNSCOPED = "autopar_unscoped"    # an op capture could not attribute to a module
STAMPED_FROM = "autopar_stamped_from"  # the traced layer a stamped node was copied from (capture.stamp)
MASK = "autopar_mask"            # a dropout mask saved as a 1-byte boolean (capture.dropout_masks)
OUTS = "autopar_outs"            # chosen placement per output, one spec per mesh axis (apply_plan)
INS = "autopar_ins"              # placement each tensor input is read in (apply_plan)
MASTER = "autopar_master"        # a parameter's optimizer-side placement (apply_plan)
PASS = "autopar_pass"            # the pass that created the node (provenance)
REASON = "autopar_reason"        # why a redistribute node exists (insert_redistribute)
COLLECTIVE = "autopar_collective"  # on a collective's wait: kind, axis, phase, reason (lower_collectives)
FUSED = "autopar_fused"          # a bucket's members' COLLECTIVE records (bucket_collectives and later)
DEFERRED = "autopar_deferred"    # gm.meta: gradient reductions left to the runtime (defer_grad_reductions)
INTO_BUCKET = "autopar_into_bucket"  # a matmul writing into a bucket buffer: the bucket start's name
SRC = "autopar_src"              # a redistribute node's source placement (insert_redistribute)

# ---------------------------------------------------------------- op sets
VIEW_OPS = {aten.view, aten._unsafe_view, aten.reshape, aten.permute, aten.t, aten.transpose, aten.expand,
            aten.unsqueeze, aten.squeeze, aten.slice, aten.select, aten.alias, aten.detach, aten.view_copy,
            aten.permute_copy, aten.t_copy, aten.transpose_copy, aten.expand_copy, aten.unsqueeze_copy,
            aten.squeeze_copy, aten.slice_copy, aten.alias_copy, aten.clone, aten._to_copy}


# ---------------------------------------------------------------- readers
def packet(node: fx.Node):
    """The op's overload packet (aten.mm for aten.mm.default), None for non-ATen targets."""
    return getattr(node.target, "overloadpacket", None)


def is_view_like(node: fx.Node) -> bool:
    return node.op == "call_function" and packet(node) in VIEW_OPS


def val_of(node: fx.Node):
    return node.meta.get(VAL)


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def producer_of(node: fx.Node) -> tuple[fx.Node, int]:
    """(producer, output index) of a value: getitem(p, i) is output i of p."""
    if is_getitem(node):
        return node.args[0], int(node.args[1])
    return node, 0


def nbytes_of(val) -> float:
    return float(val.numel() * val.element_size()) if isinstance(val, torch.Tensor) else 0.0


@functools.lru_cache(maxsize=1 << 16)   # a pure function of the string; planning asks it per node, many times
def layer_of(path: str) -> tuple[str, int] | None:
    """("transformer.h", 3) for "transformer.h.3.attn.c_attn" — the first numbered component."""
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i]), int(p)
    return None


def node_path(node: fx.Node) -> str:
    """The module path of an op, or the FQN of a placeholder."""
    if node.op == "placeholder":
        return node.meta.get(NAME, "")
    return node.meta.get(MODULE_PATH, "") or ""


def is_random(node: fx.Node) -> bool:
    """Ops that draw random numbers (dropout masks): never re-run, their output is kept."""
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def reads_in_backward(user: fx.Node) -> bool:
    """Does this reader of a forward value run in backward (or return it from the step)?"""
    return user.op == "output" or user.meta.get(PHASE) != "forward"


def ancestors(node: fx.Node) -> set[fx.Node]:
    """`node` and every node it depends on (e.g. the loss's ancestors are the forward part)."""
    seen, stack = {node}, [node]
    while stack:
        for inp in stack.pop().all_input_nodes:
            if inp not in seen:
                seen.add(inp)
                stack.append(inp)
    return seen
