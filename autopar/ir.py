"""The IR's invariants between passes, written down once and checked by `verify(gm, stage, ctx)`.

    captured      every node has meta["val"] with GLOBAL shapes; placeholders carry
                  meta["autopar_role"] and ["autopar_name"]; ops carry meta["phase"].
    apply_plan    + every placeholder and op (getitems too) has meta["autopar_outs"] and
                  ["autopar_ins"]: one spec (placement per mesh axis) per output / tensor input.
    recompute     (same invariants) + re-run forward ops of recomputed layers sit in backward with
                  meta["autopar_pass"] = "recompute" and the originals' val and placements.
    insert_redistribute
                  + every op input's spec equals what the op requires (mismatches go through
                  `redistribute` nodes); the loss is Replicate; each gradient has its master spec.
    lower_collectives
                  + no redistribute node survives; every functional collective names the process
                  group of a real mesh axis and is followed by its wait_tensor.
    bucket_collectives
                  + gradient collectives and ZeRO-1/2 parameter gathers may be fused (fused_all_reduce
                  / fused_reduce_scatter / fused_all_gather nodes listing the logical collectives they
                  carry in meta["autopar_fused"]).
    bucket_layer_gathers
                  + parameter all-gathers may be fused per (phase, layer) into fused_all_gather nodes
                  placed before their first use (same meta["autopar_fused"]).
    schedule_overlap
                  + fused gradient (and loss) reductions may be split into buckets: a start node
                  (start_all_reduce / start_reduce_scatter, listing its logical collectives in
                  meta["autopar_fused"], meta["autopar_pass"] = "schedule_overlap") with exactly one
                  user, its wait_buckets node. Only these may stay in flight while other nodes and
                  collectives run (all are waited before the output); every other collective is
                  still waited before the next one starts (no hoisted gathers).
    localize_shapes
                  + the program runs on LOCAL shapes: propagating fake tensors of each input's
                  local shape (parameters: the plan's master shard) gives every planned op the
                  local shape of its planned output spec.
    fuse_addmm    (same invariants) + add(mm, bias) pairs with no collective between them may be one
                  addmm node (the add's meta, meta["autopar_pass"] = "fuse_addmm").
    grads_into_buckets
                  (same invariants) + a start_all_reduce may take `into=` a bucket_buffer node that
                  mm_into nodes (meta["autopar_into_bucket"]) wrote some of its members into.
    tidy          (same invariants) + fewer nodes: permute pairs cancelled, view chains merged,
                  duplicate pure nodes of one phase merged; every remaining node keeps its meta.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.graph import FUSED, INS, OUTS, PASS, ROLE, VAL, is_getitem
from autopar.placement import local_shape, replicated

c10d = torch.ops._c10d_functional
COLLECTIVES = {c10d.all_gather_into_tensor.default, c10d.all_reduce.default, c10d.reduce_scatter_tensor.default,
               c10d.all_to_all_single.default}


# nodes born local: no global val
LOCAL_PASSES = ("lower_collectives", "bucket_collectives", "bucket_layer_gathers", "schedule_overlap",
                "grads_into_buckets")


class IRError(AssertionError):
    """An invariant between passes is broken: a bug in autopar, not the user's mistake."""


def verify(gm: fx.GraphModule, stage: str, ctx=None) -> None:
    """Check the invariants that hold after `stage` (a pass name, or "captured")."""
    checks = {
        "captured": (_captured,),
        "apply_plan": (_captured, _planned),
        "recompute": (_captured, _planned),
        "insert_redistribute": (_captured, _planned, _consistent),
        "lower_collectives": (_captured, _lowered),
        "bucket_collectives": (_captured, _lowered),
        "bucket_layer_gathers": (_captured, _lowered),
        "schedule_overlap": (_captured, _lowered),
        "localize_shapes": (_captured, _lowered, _local),
        "fuse_addmm": (_captured, _lowered, _local),
        "grads_into_buckets": (_captured, _lowered, _local),
        "tidy": (_captured, _lowered, _local),
    }
    if stage not in checks:
        raise ValueError(f"unknown stage {stage!r}; one of {list(checks)}")
    for check in checks[stage]:
        check(gm, ctx)


def _fail(node: fx.Node, msg: str) -> None:
    raise IRError(f"{node.name} ({node.target}): {msg}")


def _captured(gm, ctx) -> None:
    for node in gm.graph.nodes:
        if node.op == "placeholder" and ROLE not in node.meta:
            _fail(node, "placeholder without autopar_role")
        if node.op in ("placeholder", "call_function") and VAL not in node.meta \
                and node.meta.get(PASS) not in LOCAL_PASSES:
            _fail(node, "no meta['val']")


def _planned(gm, ctx) -> None:
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "call_function") and node.meta.get(VAL) is not None \
                and OUTS not in node.meta and node.meta.get(PASS) not in LOCAL_PASSES:
            _fail(node, "no planned placement after apply_plan")


def _consistent(gm, ctx) -> None:
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_getitem(node) or INS not in node.meta:
            continue
        for a, want in zip(node.all_input_nodes, node.meta[INS]):
            if a.meta[OUTS][0] != want:
                _fail(node, f"input {a.name} is {a.meta['autopar_outs'][0]} but {want} is required")
    out = gm.graph.output_node().args[0]
    if out[0].meta[OUTS][0] != replicated(len(ctx.axis_sizes)):
        _fail(out[0], "the loss is not Replicate")


def _lowered(gm, ctx) -> None:
    from autopar.passes.ops import redistribute
    groups = set(ctx.group_names) if ctx is not None else set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is redistribute:
            _fail(node, "redistribute survived lowering")
        if node.target in COLLECTIVES:
            if groups and node.args[-1] not in groups:
                _fail(node, f"collective on unknown group {node.args[-1]!r}")
            if [u.target for u in node.users] != [c10d.wait_tensor.default]:
                _fail(node, "collective without its wait_tensor")
    _one_in_flight(gm)


def _one_in_flight(gm) -> None:
    """Each collective is waited before the next one starts: nothing hoists gathers (ZeRO-3 memory)
    or leaves many async ops in flight. The exception, on purpose: schedule_overlap's gradient
    buckets (`_overlapped_buckets`), which stay in flight until their wait before the output."""
    from autopar.passes.ops import start_all_reduce, start_reduce_scatter
    starts = (start_all_reduce, start_reduce_scatter)
    pending = None
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in COLLECTIVES or node.target in starts:
            if pending is not None:
                _fail(node, f"collective starts while {pending.name} is still in flight")
            if node.target in starts:
                _overlapped_bucket(node)
            else:
                pending = node
        elif pending is not None and node.target is c10d.wait_tensor.default and node.args[0] is pending:
            pending = None


def _overlapped_bucket(start: fx.Node) -> None:
    """A bucket left in flight is schedule_overlap's, carries only gradient (or loss) reductions, and
    has exactly one wait (after it: its only user)."""
    from autopar.passes.ops import wait_buckets
    if [u.target for u in start.users] != [wait_buckets]:
        _fail(start, "overlapped bucket without exactly one wait_buckets")
    reasons = [r["reason"] for r in start.meta.get(FUSED, ())]
    if start.meta.get(PASS) != "schedule_overlap" or not reasons \
            or not all(r.startswith("gradient") or r == "loss to every rank" for r in reasons):
        _fail(start, "only schedule_overlap's gradient buckets may stay in flight")


def _local(gm, ctx) -> None:
    """Propagate fake local-shaped inputs and compare every planned op with its planned local shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    args = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            v = node.meta[VAL]
            shape = local_shape(node.meta[OUTS][0], tuple(v.shape), ctx.axis_sizes)
            with mode:
                args.append(torch.empty(shape, dtype=v.dtype, device=v.device if v.device.type != "meta" else "cpu"))
    env = {}

    class Prop(FakeTensorProp):
        def run_node(self, n):
            r = super().run_node(n)
            env[n] = r
            return r

    saved = {n: n.meta.get(VAL) for n in gm.graph.nodes}  # FakeTensorProp overwrites meta[VAL]
    try:
        Prop(gm, mode).propagate_dont_convert_inputs(*args)
    finally:
        for n, v in saved.items():
            if v is None:
                n.meta.pop(VAL, None)
            else:
                n.meta[VAL] = v
    for node, got in env.items():
        if node.op != "call_function" or OUTS not in node.meta or VAL not in node.meta:
            continue
        if node.meta.get(PASS) in LOCAL_PASSES:
            continue
        vals = got if isinstance(got, (tuple, list)) else (got,)
        gvals = node.meta[VAL] if isinstance(node.meta[VAL], (tuple, list)) else (node.meta[VAL],)
        for v, g, spec in zip(vals, gvals, node.meta[OUTS]):
            if isinstance(v, torch.Tensor) and spec is not None:
                want = local_shape(spec, tuple(g.shape), ctx.axis_sizes)
                if tuple(v.shape) != tuple(want):
                    _fail(node, f"local shape {tuple(v.shape)} but the plan says {want}")
