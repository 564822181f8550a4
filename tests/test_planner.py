"""autopar.plan() end to end on meta models: auto never loses to a forced recipe, budgets hold,
and an impossible budget raises InfeasiblePlanError with the smallest memory any plan needs."""
from __future__ import annotations

import warnings

import pytest
import torch

import autopar
from autopar._testing import models
from autopar.errors import InfeasiblePlanError


def _plan(case, mesh, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(case.model, case.example_inputs, mesh=mesh, **kw)


H100x8 = autopar.Mesh((8,), hardware="h100")


@pytest.fixture(scope="module")
def gpt2_plan():
    return _plan(models.meta_gpt2_124m(n_layer=12), H100x8, memory_budget="80GB")


def test_gpt2_auto_beats_every_recipe(gpt2_plan):
    p = gpt2_plan
    # the recipes on the caller's mesh, then the SPMD plans of the devices' other shapes (`pipeline.auto`)
    assert {"dp", "zero1", "zero2", "zero3", "tp"} <= set(p.baselines) <= {"dp", "zero1", "zero2", "zero3", "tp",
                                                                         "spmd (8,)", "spmd (4, 2)", "spmd (2, 4)"}
    for name, b in p.baselines.items():
        assert b["feasible"], name
        assert p.predicted_step_time <= b["time"] * (1 + 1e-9), name
    assert p.memory_per_device <= 80e9
    assert p.model["parameters"] == 124_439_808   # GPT-2 124M, lm_head tied to wte


def test_budget_dp_cannot_meet_still_plans(gpt2_plan):
    dp_memory = gpt2_plan.baselines["dp"]["memory"]
    budget = 0.8 * dp_memory
    p = _plan(models.meta_gpt2_124m(n_layer=12), H100x8, memory_budget=int(budget))
    assert p.baselines["dp"]["feasible"] is False
    assert p.feasible and p.memory_per_device <= budget
    for b in p.baselines.values():
        if b["feasible"]:
            assert p.predicted_step_time <= b["time"] * (1 + 1e-9)


def test_llama3_8b_shape_plans_on_8_h100():
    """Llama-3-8B shape (hidden 4096, GQA 32/8 heads, MLP 14336, vocab 128256) at 2 layers for CI;
    benchmarks/plan_time.py plans the full 32 layers."""
    p = _plan(models.meta_llama3_8b(num_layers=2, batch=1, seq=2048), H100x8, memory_budget="80GB")
    assert p.memory_per_device <= 80e9
    for name, b in p.baselines.items():
        if b["feasible"]:
            assert p.predicted_step_time <= b["time"] * (1 + 1e-9), name


def test_impossible_budget_names_the_smallest_memory():
    """Without stages the SPMD solver's minimum is exact: that much is enough. (With the layout search
    it is a lower bound over pipelines too: tests/test_completeness.py.)"""
    case = models.meta_mlp(128, 1024)
    mesh = autopar.Mesh((4,), hardware="a100")
    with pytest.raises(InfeasiblePlanError) as info:
        _plan(case, mesh, memory_budget=1000, num_stages=None)
    least = info.value.min_memory_per_device
    assert 0 < least < float("inf")
    from autopar.costmodel.memory import format_bytes
    assert f"the smallest plan needs {format_bytes(least)}" in str(info.value)
    assert "raise memory_budget" in str(info.value)
    p = _plan(case, mesh, memory_budget=int(least * 1.001) + 1, num_stages=None)  # that much is enough
    assert p.memory_per_device <= least * 1.001 + 1


@pytest.fixture(scope="module")
def tiny_problem():
    from autopar.capture.canonicalize import canonicalize
    from autopar.capture.trace import capture
    from autopar.planning.problem import ProblemBuilder
    case = models.tiny_gpt(n_layer=3, batch=4, seq=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(case.model, case.example_inputs)
    canonicalize(captured.gm)
    mesh = autopar.Mesh((2, 2), axis_names=("a", "b"), hardware="a100", devices_per_node=2)
    builder = ProblemBuilder(captured, mesh)
    return captured, mesh, builder, builder.build()


def test_memoized_costs_equal_costs_priced_alone(tiny_problem):
    """Identical layers share (strategy list, op signature), so ProblemBuilder prices each pair once;
    every node's and edge's costs must equal pricing that node or edge on its own."""
    import numpy as np

    from autopar.planning.problem import ProblemBuilder, _node_compute, saved_values
    captured, mesh, builder, prob = tiny_problem
    assert prob.cg.layer_groups and len(builder._memo) < len(prob.nodes) + len(prob.edges)  # it did share
    fresh = ProblemBuilder(captured, mesh)
    saved: dict = {}
    for base, i in saved_values(captured.gm):
        saved.setdefault(base, []).append(i)
    for i, node in enumerate(prob.nodes):
        strats = prob.strategies[i]
        if node.op != "placeholder":
            assert np.array_equal(prob.compute[i], _node_compute(node, strats, mesh.hardware, tuple(mesh.shape)))
        if node in saved:
            alone = fresh._saved_bytes(node.meta["val"], strats, saved[node])
            assert np.array_equal(prob.memory[i]["activations"], alone), node.name
    for e, ce in zip(prob.edges, prob.cg.edges):
        assert np.array_equal(ce.time, fresh._edge_matrix(prob.strategies[e.src], prob.strategies[e.dst], e))


def test_shared_pruning_and_propagation_equal_per_node_results(tiny_problem):
    """prune_partials and recipes.batch_propagation memoize on list identity / op signature: giving
    every node its own list (no sharing possible) must give the same strategies and placements."""
    from autopar.sharding import recipes
    from autopar.sharding.strategies import prune_partials
    captured, mesh, builder, prob = tiny_problem
    full = [builder._strategies(n) for n in prob.nodes]
    shared = prune_partials(prob.nodes, full)
    alone = prune_partials(prob.nodes, [list(s) for s in full])
    assert [[str(s) for s in lst] for lst in shared] == [[str(s) for s in lst] for lst in alone]
    with_sigs = recipes.batch_propagation(captured.gm, 2, prob.signatures)
    enum = recipes.StrategyEnumerator((2,))
    whole = recipes._inputs_only(captured.gm)
    for node, place in with_sigs.items():
        if node.op == "call_function" and node in prob.signatures:
            have = [with_sigs.get(a, recipes.R) for a in node.all_input_nodes]
            best = recipes._best(enum, node, have)
            assert place == (recipes.whole_not_partial(best) if node in whole else best), node.name


@pytest.mark.parametrize("strategy", ["dp", "zero2"])
def test_batch_recipes_count_the_targets_whole_and_keep_the_images_split(strategy):
    """Under a batch recipe every rank counts the non-ignored labels of the whole batch itself (no
    all-reduce of the count in mid-step: nothing moves in the forward), while the images, which no
    such count reads, stay split: no rank holds more than its share of them."""
    from autopar.capture.trace import capture
    case = models.ZOO_CASES["vit"]()
    kw = {"loss_fn": case.loss_fn} if case.loss_fn else {}
    pixels, labels = (n.name for n in capture(case.model, case.example_inputs, **kw).placeholders("input"))
    plan = autopar.plan(case.model, case.example_inputs, mesh=autopar.Mesh((2,)), strategy=strategy,
                        baselines=False, **kw)
    assert plan.nodes[pixels].outs == (("S0",),) and plan.nodes[labels].outs == (("R",),)
    assert not [c for c in plan.collectives if c.phase == "forward" and c.kind == "all_reduce"]


@pytest.mark.parametrize("strategy", ["dp", "zero3", "tp"])
def test_batch_recipes_build_their_share_of_the_constants(strategy):
    """Values built from no input (SiLU backward's constant 1: `empty_permuted` then `full_like`, one
    [batch, seq, ffn] tensor per layer) are built by each rank: under a batch recipe the solver builds the
    rank's batch share (S0), not the whole batch on every rank (R, which priced Llama-3-70B-width x 512's
    zero3 recipe 575 ms of its 849 ms compute); tp, which splits no batch, does not split them along it."""
    case = models.tiny_llama(batch=4, seq=16)
    plan = autopar.plan(case.model, case.example_inputs, mesh=autopar.Mesh((2,)), strategy=strategy,
                        baselines=False, mixed_precision="bf16")
    built = {k: v.outs for k, v in plan.nodes.items() if k.startswith("empty_permuted")}
    assert len(built) == 2   # one per decoder layer
    if strategy == "tp":   # split like the MLP's hidden features, never along the batch
        assert (("S0",),) not in built.values(), built
    else:
        assert set(built.values()) == {(("S0",),)}, built


def test_same_inputs_give_the_same_plan_byte_for_byte():
    """Two plannings of the same model (fresh captures, stamped layers, a 2-D mesh with a memory
    budget) give the same JSON once the wall-clock fields are removed."""
    import json

    from autopar._testing.gpt import GPT, GPTConfig

    def planned() -> dict:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=6, n_head=2, n_embd=32))
        ids = torch.randint(0, 64, (8, 16))
        mesh = autopar.Mesh((2, 2), axis_names=("dp", "tp"))
        out = json.loads(autopar.plan(model, (ids, ids), mesh=mesh, memory_budget="3MB").to_json())
        out.pop("timings")
        out["solver"].pop("seconds")
        return out

    a, b = planned(), planned()
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_predicted_mfu_counts_the_model_flops_of_the_step():
    """MFU = model FLOPs / (peak FLOP/s x devices x step). Alpa's MLP (batch B, width H): fc2 runs
    forward, grad-input and grad-weight matmuls (3 x 2BH^2), fc1 no grad-input (its input is data):
    2 x 2BH^2, so 10 BH^2 matmul FLOPs a step; pipelining counts all m micro-batches."""
    b, h = 64, 256
    case = models.meta_mlp(b, h)
    mesh = autopar.Mesh((4,), hardware="h100")
    plan = autopar.plan(case.model, case.args, mesh=mesh, baselines=False)
    assert plan.model["flops"] == 10 * b * h * h
    want = plan.model["flops"] / (mesh.hardware.flops("float32") * 4 * plan.predicted_step_time)
    assert plan.predicted_mfu == pytest.approx(want) and 0 < plan.predicted_mfu < 1
    assert f"mfu       {plan.predicted_mfu:.1%}" in plan.summary(rich=False)
    assert autopar.Plan.from_json(plan.to_json()).predicted_mfu == plan.predicted_mfu
    piped = autopar.plan(case.model, case.args, mesh=mesh, num_stages=2, num_microbatches=4, baselines=False)
    assert piped.model["flops"] == plan.model["flops"]
