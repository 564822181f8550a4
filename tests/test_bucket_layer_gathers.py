"""bucket_layer_gathers: ZeRO-3 gathers one flat buffer per layer and phase, before the first use,
and still emits exactly the plan's logical collectives (numerics: tests/test_runtime.py's zero3 runs
and test_passes.py's fused all-gather check on gloo)."""
from __future__ import annotations

from collections import Counter

import torch

import autopar
from autopar._testing.dist_cases import lowered_for_rank0_of_2
from autopar.graph import is_view_like, layer_of
from autopar.passes import PIPELINE, PassContext, emitted_collectives
from autopar.passes.bucket_layer_gathers import bucket_layer_gathers_pass
from autopar.passes.ops import contiguous, dense_in_order, fused_all_gather

c10d = torch.ops._c10d_functional


def _lowered(case, strategy, disabled=frozenset()):
    plan, _, gm = lowered_for_rank0_of_2(case, strategy, disabled)
    return plan, gm


def _first_real_use(node: torch.fx.Node) -> list[torch.fx.Node]:
    out, todo = [], list(node.users)
    while todo:
        u = todo.pop()
        if u.op == "call_function" and (is_view_like(u) or u.target in (contiguous, dense_in_order)):
            todo.extend(u.users)
        else:
            out.append(u)
    return out


def test_zero3_gathers_one_flat_buffer_per_layer_and_phase(gpt_case):
    model, inputs = gpt_case
    plan, gm = _lowered(gpt_case, "zero3")
    nodes = list(gm.graph.nodes)
    fused = [n for n in nodes if n.target is fused_all_gather]
    groups = Counter()
    for node in fused:
        layers = {layer_of(p.meta["autopar_name"]) for p in node.args[0]}
        assert len(layers) == 1, f"{node.name} mixes layers {layers}"
        (layer,) = layers
        groups[(node.meta["phase"], layer)] += 1
        # placed right before its first real use, which runs in the same phase (never a backward
        # gather in forward: the weight would stay gathered across the whole forward)
        uses = [u for g in node.users for u in _first_real_use(g)]
        first = min(nodes.index(u) for u in uses)
        at = nodes.index(node)
        assert at < first and all(n.target is not fused_all_gather for n in nodes[at + 1:first])
        assert {u.meta.get("phase") for u in uses} == {node.meta["phase"]}, node.name
    for layer in (("transformer.h", 0), ("transformer.h", 1)):
        assert groups[("forward", layer)] == 1 and groups[("backward", layer)] == 1, groups
    # no parameter of a layer is gathered on its own any more
    for node in nodes:
        if node.target is c10d.all_gather_into_tensor.default:
            src = node.args[0].args[0] if node.args[0].target is contiguous else node.args[0]
            assert src.op != "placeholder" or layer_of(src.meta["autopar_name"]) is None, node.name
    # the logical collectives are still the plan's, one by one
    emitted = Counter((c["kind"], c["phase"]) for c in emitted_collectives(gm))
    assert emitted == Counter((r.kind, r.phase) for r in plan.collectives)


def test_fusing_changes_no_collective_and_no_computation(gpt_case):
    """With and without the pass: the same logical collectives and the same compute ops."""
    plan, fused = _lowered(gpt_case, "zero3")
    _, plain = _lowered(gpt_case, "zero3", disabled={"bucket_layer_gathers"})
    key = lambda c: (c["kind"], c["phase"], c["reason"], c["source"])  # noqa: E731
    assert sorted(map(key, emitted_collectives(fused))) == sorted(map(key, emitted_collectives(plain)))
    ops = lambda gm: Counter(str(n.target) for n in gm.graph.nodes  # noqa: E731
                             if n.op == "call_function" and "c10d" not in str(n.target)
                             and n.target not in (fused_all_gather, contiguous) and "getitem" not in str(n.target))
    assert ops(fused) == ops(plain)
    assert sum(1 for n in plain.graph.nodes if n.target is c10d.all_gather_into_tensor.default) >= \
        3 * sum(1 for n in fused.graph.nodes if n.target in (fused_all_gather, c10d.all_gather_into_tensor.default))


def test_a_plan_without_parameter_gathers_is_left_unchanged(gpt_case):
    # fuse_addmm, grads_into_buckets and tidy too: their invariants include localize_shapes' (local
    # shapes), switched off here
    _, gm = _lowered(gpt_case, "dp", disabled={"bucket_layer_gathers", "localize_shapes", "fuse_addmm",
                                               "grads_into_buckets", "tidy"})
    code = gm.code
    plan = autopar.plan(gpt_case[0], gpt_case[1], mesh=autopar.Mesh((2,)), strategy="dp", baselines=False)
    out = bucket_layer_gathers_pass(gm, PassContext(plan, (2,), coords=(0,), group_names=("axis0",)))
    assert out is gm and out.code == code
    assert [name for name, _ in PIPELINE].index("bucket_layer_gathers") == \
        [name for name, _ in PIPELINE].index("bucket_collectives") + 1
