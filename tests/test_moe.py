"""Mixture-of-experts (autopar/sharding/rules/moe.py): Mixtral's grouped matmul captured, its strategies
numerically valid on 2 virtual ranks (including expert parallelism's dispatch, simulated in one
process), and expert parallelism chosen, priced and emitted as all_to_all on Mixtral-8x7B shapes.
World-2 training equal to one process is in tests/test_zoo.py (auto, zero3, tp and the forced plans).
"""
from __future__ import annotations

import copy
import warnings
from collections import Counter

import pytest
import torch
from test_rules import N, _close, _Recorder, fitting_strategies

import autopar
import autopar.capture.canonicalize
import autopar.capture.trace
from autopar._testing import models
from autopar._testing.simulate import join, run_local, split
from autopar.capture import moe_ops, moe_rewrite
from autopar.graph import val_of
from autopar.passes import PassContext, emitted_collectives, moe_dispatch, run_passes
from autopar.placement import P, S
from autopar.planning.spmd import plan_captured
from autopar.sharding.rules import OpCall, moe
from autopar.sharding.strategies import StrategyEnumerator

GROUPED = (moe_ops.GROUPED_MM, moe_ops.GROUPED_MM_WGRAD)


def _reference_grouped_mm(x, w, offs):
    bounds = [0, *offs.tolist()]
    out = torch.zeros(x.shape[0], w.shape[2])
    for i in range(w.shape[0]):
        out[bounds[i]:bounds[i + 1]] = x[bounds[i]:bounds[i + 1]] @ w[i]
    return out


@pytest.mark.parametrize("offs", [[3, 5, 8, 10], [0, 4, 4, 10], [2, 2, 6, 7]])
def test_grouped_mm_and_its_gradients(offs):
    """Forward, grad x and grad w equal per-group matmuls (empty groups, rows past offs[-1] zero)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, 4, generator=gen, requires_grad=True)
    w = torch.randn(4, 4, 8, generator=gen, requires_grad=True)
    offs = torch.tensor(offs, dtype=torch.int32)
    g = torch.randn(10, 8, generator=gen)
    want = _reference_grouped_mm(x, w, offs)
    gx, gw = torch.autograd.grad((want * g).sum(), (x, w))
    torch.testing.assert_close(moe_ops.GROUPED_MM(x, w, offs), want)
    torch.testing.assert_close(moe_ops.GROUPED_MM(g, w.transpose(-2, -1), offs), gx)
    torch.testing.assert_close(moe_ops.GROUPED_MM_WGRAD(x, g, offs), gw)


@pytest.fixture(scope="module")
def mixtral():
    """The tiny Mixtral, its captured step (captured once: tests copy the graph before changing it) and
    the flat real inputs of that graph."""
    case = models.tiny_mixtral()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = autopar.capture.trace.capture(case.model, case.args, example_kwargs=case.kwargs)
    named = {**dict(case.model.named_parameters()), **dict(case.model.named_buffers())}
    inputs = iter([*case.args, case.kwargs["labels"]])
    flat = [next(inputs) if n.meta["autopar_role"] == "input" else named[n.meta["autopar_name"]].detach()
            for n in captured.placeholders()]
    return case, captured, flat


def test_capture_fuses_every_expert_matmul_and_keeps_the_numerics(mixtral):
    """2 layers x 2 projections: 4 forward grouped matmuls, 4 for grad x, 4 weight gradients; the
    captured step's loss and expert gradients equal eager transformers ("grouped_mm")."""
    case, captured, flat = mixtral
    gm = captured.gm
    counts = Counter((n.target, n.meta["phase"]) for n in gm.graph.nodes if n.target in GROUPED)
    assert counts == {(moe_ops.GROUPED_MM, "forward"): 4, (moe_ops.GROUPED_MM, "backward"): 4,
                      (moe_ops.GROUPED_MM_WGRAD, "backward"): 4}
    assert not [n for n in gm.graph.nodes if n.target is moe_rewrite.standin]
    named = dict(case.model.named_parameters())
    loss, *grads = gm(*flat)
    case.model.zero_grad()
    eager = case.eager_loss()
    eager.backward()
    torch.testing.assert_close(loss, eager.detach(), rtol=1e-5, atol=1e-6)
    for name, g in zip(captured.grad_param_names, grads):
        if "experts" in name:
            torch.testing.assert_close(g, named[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def _simulate(node, strat, values, n: int, gen):
    """Run a grouped node under a 1-D strategy as the lowering does: rows -> local offsets; expert
    parallel -> ep_dispatch's split sizes with the all_to_all done by hand."""
    if node.target not in GROUPED or strat.ins[0] != S(0):
        return run_local(node, strat, values, n, gen)
    x_g, y_g, offs = (values[a] for a in node.all_input_nodes)
    xs, ys = split(x_g, strat.ins[0], n, gen), split(y_g, strat.ins[1], n, gen)
    rows, experts = x_g.shape[0], offs.shape[0]
    ranges = [((r * rows // n, (r + 1) * rows // n), (r * experts // n, (r + 1) * experts // n)) for r in range(n)]
    ep = moe.ep_axes(node.target, ((strat.ins[0],), (strat.ins[1],)), ((strat.outs[0],),))
    if not ep:
        lo_hi = [r[0] for r in ranges]
        outs = [node.target(xs[r], ys[r], moe_dispatch.local_offsets(offs, *lo_hi[r], 0, experts)) for r in range(n)]
        return join(outs, strat.outs[0])
    plans = [moe_dispatch.ep_dispatch(offs, ranges, r) for r in range(n)]

    def all_to_all(chunks, sizes_in, sizes_out):
        pieces = [list(torch.split(c, s)) for c, s in zip(chunks, sizes_in)]
        got = [torch.cat([pieces[src][dst] for src in range(n)]) for dst in range(n)]
        assert [g.shape[0] for g in got] == [sum(s) for s in sizes_out]
        return got

    send, recv = [p[0] for p in plans], [p[1] for p in plans]
    xr = all_to_all(xs, send, recv)
    if node.target is moe_ops.GROUPED_MM:
        yr = [node.target(xr[r], ys[r], plans[r][2]) for r in range(n)]
        return join(all_to_all(yr, recv, send), strat.outs[0])
    gr = all_to_all(ys, send, recv)
    return join([node.target(xr[r], gr[r], plans[r][2]) for r in range(n)], strat.outs[0])


def test_every_grouped_strategy_matches_the_real_value(mixtral):
    """Replicate, tp column/row, rows (data parallel) and expert parallel, forward and backward ops,
    on routing that is not balanced (the real top-2 choices of the tiny Mixtral)."""
    _, captured, flat = mixtral
    gm = captured.gm
    rec = _Recorder(gm)
    with torch.no_grad():
        rec.run(*flat)
    values = rec.values
    enum = StrategyEnumerator((N,))
    gen = torch.Generator().manual_seed(0)
    checked, kinds, failures = 0, set(), []
    for node in gm.graph.nodes:
        if node.target not in GROUPED and node.target is not torch.ops.aten.histc.default:
            continue
        for strat in fitting_strategies(enum, OpCall(node, val_of)):
            checked += 1
            kinds.add((node.target, strat.ins[:2], strat.outs))
            if not _close(_simulate(node, strat, values, N, gen), values[node]):
                failures.append(f"{node.name} outs={strat.outs} ins={strat.ins}")
    assert (moe_ops.GROUPED_MM, (S(0), S(0)), (S(0),)) in kinds and (moe_ops.GROUPED_MM_WGRAD, (S(0), S(0)), (P,)) in kinds
    assert checked >= 12 * 5
    assert not failures, "\n".join(failures)


def test_dispatch_within_a_group_whose_rows_are_not_contiguous():
    """On a 2-D mesh with rows split on both axes and experts on the outer one, the two ranks of an
    expert group hold sorted rows [0, 4) and [8, 12): each still gets every row of its experts there."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(16, 4, generator=gen), torch.randn(4, 4, 8, generator=gen)
    offs = torch.tensor([3, 9, 10, 16], dtype=torch.int32)
    members = [((0, 4), (0, 2)), ((8, 12), (2, 4))]
    plans = [moe_dispatch.ep_dispatch(offs, members, q) for q in range(2)]
    assert [p[0] for p in plans] == [[4, 0], [1, 3]] and [p[1] for p in plans] == [[4, 1], [0, 3]]
    chunks = [list(torch.split(x[lo:hi], plans[q][0])) for q, ((lo, hi), _) in enumerate(members)]
    got = [moe_ops.GROUPED_MM(torch.cat([chunks[p][q] for p in range(2)]), w[e0:e1], plans[q][2])
           for q, (_, (e0, e1)) in enumerate(members)]
    back = [list(torch.split(got[q], plans[q][1])) for q in range(2)]
    want = moe_ops.GROUPED_MM(x, w, offs)
    for q, ((lo, hi), _) in enumerate(members):
        torch.testing.assert_close(torch.cat([back[p][q] for p in range(2)]), want[lo:hi])


def test_misrouted_rows_follow_the_uniform_routing_bound():
    assert moe.expected_misrouted_rows(8192, 1024) == pytest.approx(2 * (2 / torch.pi) ** 0.5 * 8192 ** 0.5 / 2)
    assert moe.expected_misrouted_rows(16, 2) == 2  # capped by the rows a rank holds


@pytest.fixture(scope="module")
def mixtral_8x7b_plans():
    """Mixtral-8x7B dimensions, 2 layers, 8 H100s: the auto plan and each forced experts layout."""
    case = models.meta_mixtral(num_layers=2, batch=1, seq=4096)
    mesh = autopar.Mesh((8,), hardware="h100")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = autopar.capture.trace.capture(case.model, case.args, example_kwargs=case.kwargs)
        autopar.capture.canonicalize.canonicalize(captured.gm)
        plans = {}
        for mode in ("auto", "replicate", "tp", "ep"):
            with moe.force_experts(mode):
                plans[mode] = plan_captured(captured, case.model, case.example_inputs, mesh=mesh, baselines=False)
    return plans


def _expert_layouts(plan) -> set:
    return {(c.ins[0][0], c.ins[1][0]) for name, c in plan.nodes.items() if name.startswith("grouped_mm_default")}


def test_auto_plan_is_expert_parallel_and_beats_the_forced_layouts(mixtral_8x7b_plans):
    auto = mixtral_8x7b_plans["auto"]
    assert _expert_layouts(auto) == {("S0", "S0")}
    assert auto.placement("model.layers.0.mlp.experts.gate_up_proj")[0] == autopar.placement.S(0)
    assert auto.predicted_step_time < mixtral_8x7b_plans["replicate"].predicted_step_time
    assert auto.predicted_step_time < mixtral_8x7b_plans["tp"].predicted_step_time
    assert auto.predicted_step_time == pytest.approx(mixtral_8x7b_plans["ep"].predicted_step_time)
    assert all(b[1] == "R" for b in _expert_layouts(mixtral_8x7b_plans["replicate"]))
    assert all(b[1] in ("S1", "S2") for b in _expert_layouts(mixtral_8x7b_plans["tp"]))
    dispatch = [c for c in auto.collectives if c.reason == "expert dispatch"]
    # per layer: 2 forward matmuls x (dispatch + combine); backward 2 grad-x x 2 + 2 grad-w x 2
    assert Counter((c.kind, c.phase) for c in dispatch) == {("all_to_all", "forward"): 8,
                                                             ("all_to_all", "backward"): 16}
    assert all(c.predicted_time > 0 and c.bytes > 0 for c in dispatch)
    assert not [c for c in mixtral_8x7b_plans["replicate"].collectives if c.reason == "expert dispatch"]


def test_the_forced_ep_plan_emits_its_all_to_alls(mixtral):
    """Lowered for rank 0 of 2 (verify on: local shapes propagate through the dispatch), the EP plan's
    graph holds exactly the plan's collectives, its all_to_alls included, each with its wait."""
    case, captured, _ = mixtral
    captured = copy.copy(captured)
    captured.gm = copy.deepcopy(captured.gm)
    autopar.capture.canonicalize.canonicalize(captured.gm)
    with moe.force_experts("ep"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_captured(captured, case.model, case.example_inputs, mesh=autopar.Mesh((2,)), baselines=False)
    assert _expert_layouts(plan) == {("S0", "S0")}
    ctx = PassContext(plan, (2,), coords=(0,), group_names=("axis0",), grad_names=tuple(captured.grad_param_names))
    gm = run_passes(captured.gm, ctx, verify=True)
    emitted = Counter((c["kind"], c["phase"]) for c in emitted_collectives(gm))
    assert emitted == Counter((r.kind, r.phase) for r in plan.collectives)
    assert emitted[("all_to_all", "forward")] == 8 and emitted[("all_to_all", "backward")] == 16
    dispatched = [n for n in gm.graph.nodes if n.target is moe_dispatch.ep_dispatch]
    assert len(dispatched) == 12 and all(n.args[2] == 0 for n in dispatched)
