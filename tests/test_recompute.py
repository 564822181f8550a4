"""Activation recompute (issue #10): the solver's keep/recompute decision per layer, the pass that
re-runs a layer's forward in backward, and measured activation memory against the prediction."""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.fx as fx

import autopar
from autopar._testing import models
from autopar._testing.dist_cases import train_parallel, train_reference
from autopar._testing.dist_utils import run_distributed
from autopar._testing.gpt import GPT, GPTConfig
from autopar.capture.canonicalize import canonicalize
from autopar.capture.trace import capture
from autopar.errors import InfeasiblePlanError, InputError
from autopar.graph import is_random
from autopar.passes import PassContext
from autopar.passes.recompute import recompute_pass
from autopar.plan import Plan
from autopar.planning.problem import saved_values
from autopar.planning.recompute import copied_nodes, layer_nodes, normalize
from autopar.planning.spmd import plan_captured

aten = torch.ops.aten
N_LAYER = 4


# ---------------------------------------------------------------------------- the pass, by hand
def _hand_graph() -> fx.GraphModule:
    """loss = sum(dropout(relu(x @ w)) + x) in layer "layers.0", with its hand-written backward."""
    g = fx.Graph()

    def op(target, *args, phase="forward", path="layers.0"):
        n = g.call_function(target, args)
        n.meta.update(phase=phase, module_path=path)
        return n

    w, x = g.placeholder("w"), g.placeholder("x")
    w.meta.update(autopar_role="param", autopar_name="layers.0.w")
    x.meta.update(autopar_role="input", autopar_name="x")
    h = op(aten.mm.default, x, w)
    r = op(aten.rand_like.default, h)
    mask = op(aten.gt.Scalar, r, 0.5)
    d = op(aten.mul.Tensor, op(aten.relu.default, h), mask)
    y = op(aten.add.Tensor, d, x)
    loss = op(aten.sum.default, y, path="")
    gy = op(aten.ones_like.default, y, phase="backward")
    gh = op(aten.threshold_backward.default, op(aten.mul.Tensor, gy, mask, phase="backward"), h, 0,
            phase="backward")
    gw = op(aten.mm.default, op(aten.t.default, x, phase="backward"), gh, phase="backward")
    g.output((loss, gw))
    return fx.GraphModule(torch.nn.Module(), g)


def _run(gm, w, x):
    torch.manual_seed(0)
    return gm(w, x)


def _ctx(paths) -> PassContext:
    return PassContext(SimpleNamespace(recompute=tuple(paths)), (1,))


def test_pass_recomputes_the_layer_and_keeps_the_dropout_mask():
    gm = _hand_graph()
    w, x = torch.randn(6, 6), torch.randn(4, 6)
    before = _run(gm, w, x)
    layer = layer_nodes(gm)["layers.0"]
    copies = copied_nodes(layer)
    assert [n.name for n in copies] == ["mm_default", "gt_scalar"]  # what backward reads; not the output, not the rand
    predicted = {(b.name, i) for b, i in saved_values(gm, frozenset(copies))}
    gm = recompute_pass(gm, _ctx(["layers.0"]))
    redone = [n for n in gm.graph.nodes if n.meta.get("autopar_pass") == "recompute"]
    assert [n.meta["autopar_recompute_of"] for n in redone] == ["mm_default", "gt_scalar"]
    assert all(n.meta["phase"] == "backward" for n in redone)
    by_name = {n.name: n for n in gm.graph.nodes}
    for name in ("mm_default", "gt_scalar"):  # the originals now die in forward
        assert all(u.meta["phase"] == "forward" for u in by_name[name].users)
    assert sum(n.target is aten.rand_like.default for n in gm.graph.nodes) == 1  # the mask is not redrawn
    code = gm.code  # FX's generated code drops the original once forward is done with it
    assert code.index("mm_default = None") < code.index("ones_like")
    assert redone[1].args[0] is by_name["rand_like_default"]
    assert {(b.name, i) for b, i in saved_values(gm)} == predicted == {("x", 0), ("rand_like_default", 0), ("add_tensor", 0)}
    after = _run(gm, w, x)
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_pass_with_nothing_to_do_leaves_the_graph_unchanged():
    gm = _hand_graph()
    code = gm.code
    assert recompute_pass(gm, _ctx([])).code == code


def test_normalize_checks_layer_paths():
    assert normalize(None, ["h.0"]) == "auto"
    assert normalize(["h.0"], ["h.0"]) == ("h.0",)
    with pytest.raises(InputError, match="not layers"):
        normalize(["h.7"], ["h.0"])
    with pytest.raises(InputError):
        normalize("sometimes", ["h.0"])


# ---------------------------------------------------------------------------- planning the GPT
@pytest.fixture(scope="module")
def gpt():
    """autopar/_testing/gpt.py with layers wide enough (64) next to its vocabulary (64) that the activations
    kept for backward, not the logits' transients, set the peak (as in any real model)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=N_LAYER, n_head=2, n_embd=64))
    return models.Case(model, (models._tokens(64, 8, 32), models._tokens(64, 8, 32, seed=1)))


@pytest.fixture(scope="module")
def captured(gpt):
    """One capture serves every plan of the module (`autopar.plan` = capture + `plan_captured`)."""
    c = capture(gpt.model, gpt.args)
    canonicalize(c.gm)
    return c


def _plan(case, captured, **kw) -> Plan:
    return plan_captured(captured, case.model, case.args, baselines=False, **kw)


@pytest.fixture(scope="module")
def world1(gpt, captured):
    """(nothing recomputed, everything recomputed, a budget halfway between) on one device."""
    keep = _plan(gpt, captured, mesh=(1,))
    every = _plan(gpt, captured, mesh=(1,), recompute="all")
    budget = int((keep.memory_per_device + every.memory_per_device) / 2)
    return keep, every, _plan(gpt, captured, mesh=(1,), memory_budget=budget), budget


def test_without_a_budget_nothing_recomputes(world1):
    keep, every, _, _ = world1
    assert keep.recompute == ()
    assert every.recompute == tuple(f"transformer.h.{i}" for i in range(N_LAYER - 1))  # the last never
    assert every.memory_breakdown["activations"] < keep.memory_breakdown["activations"]
    assert every.predicted_compute_time > keep.predicted_compute_time
    assert "recompute" not in str(keep)


def test_budget_between_recomputes_some_layers(world1):
    keep, every, mid, budget = world1
    assert 0 < len(mid.recompute) < N_LAYER - 1
    assert mid.recompute == tuple(f"transformer.h.{i}" for i in range(len(mid.recompute)))  # the lowest
    assert mid.feasible and mid.memory_per_device <= budget
    assert keep.predicted_step_time < mid.predicted_step_time < every.predicted_step_time
    assert "recompute" in str(mid) and "transformer.h." in str(mid)
    assert Plan.from_json(mid.to_json()).recompute == mid.recompute


def test_budget_below_everything_recomputed_raises_with_the_minimum(gpt, captured, world1):
    _, every, _, _ = world1
    budget = int(every.memory_per_device * 0.8)
    with pytest.raises(InfeasiblePlanError, match="recompute") as info:
        _plan(gpt, captured, mesh=(1,), memory_budget=budget)
    least = info.value.min_memory_per_device
    assert budget < least <= every.memory_per_device * 1.001


def test_auto_is_never_slower_than_a_recipe_with_recompute(gpt, captured):
    """Under a budget only recompute meets, on a 2-D mesh, the unrestricted solve starts from each
    textbook recipe's own plan with recompute and is never slower than one that fits (each found under
    the same time limit), even when its ILP gets no time to improve on its least-memory fallback
    (time_limit ~0). Before, it raised InfeasiblePlanError while recipes fitted, as it did for a
    16-layer Llama on (2, 8) at 80 GB with the default time limit."""
    mesh = autopar.Mesh((2, 2), axis_names=("dp", "tp"))
    with pytest.raises(InfeasiblePlanError) as info:
        _plan(gpt, captured, mesh=mesh, recompute="none", memory_budget=1)
    least_without = info.value.min_memory_per_device
    every = _plan(gpt, captured, mesh=mesh, recompute="all", strategy="zero3")
    budget = int((every.memory_per_device + least_without) / 2)   # only plans with recompute fit
    assert every.memory_per_device < budget < least_without
    fitting = [p for p in (_plan(gpt, captured, mesh=mesh, memory_budget=budget, strategy=name, time_limit=1e-3)
                           for name in ("dp", "zero1", "zero2", "zero3", "tp")) if p.feasible]
    assert fitting and all(p.recompute for p in fitting)
    auto = _plan(gpt, captured, mesh=mesh, memory_budget=budget, time_limit=1e-3)   # each solve gets ~0 s
    assert auto.feasible and auto.recompute and auto.memory_per_device <= budget
    assert auto.predicted_step_time <= min(p.predicted_step_time for p in fitting) * (1 + 1e-9)



def test_a_solved_plan_reports_what_its_assembled_plan_holds(gpt, captured, world1):
    """`spmd.solve_captured` (the layout search solves every shape of the devices and assembles the Plan of
    the one it keeps): the step, memory, gap, recompute and feasibility it reports, which the search compares
    and lists, are those of the Plan it assembles, with recompute and without, and over the budget."""
    from autopar.planning import spmd
    _, _, mid, budget = world1
    kinds = set()
    for mesh, kw in (((2,), {}), ((1,), {"memory_budget": budget}), ((2,), {"recompute": "all"}),
                     ((2,), {"memory_budget": 1, "recompute": "none", "strategy": "dp"})):
        solved = spmd.solve_captured(captured, gpt.model, gpt.args, mesh=autopar.Mesh(mesh), baselines=False, **kw)
        plan = solved.plan()
        assert solved.predicted_step_time == pytest.approx(plan.predicted_step_time, rel=1e-12)
        assert solved.memory_per_device == pytest.approx(plan.memory_per_device, rel=1e-12)
        assert (solved.feasible, solved.gap, solved.recompute, solved.mesh) == \
            (plan.feasible, plan.gap, plan.recompute, plan.mesh)
        kinds.add((plan.feasible, len(plan.recompute) > 0))
    assert kinds == {(True, False), (True, True), (False, False)}   # the cases above cover each
    assert solved.memory_per_device > 1 and mid.recompute   # mid: the one-device plan under `budget`


def test_recipes_slower_than_the_ceiling_do_not_warm_start_the_solve(gpt, captured, monkeypatch):
    """`plan_captured(ceiling=c)` (the layout search's best plan so far): a recipe whose fastest plan without
    the memory row is slower than c cannot give the plan kept, so its plan with recompute is not solved
    (Llama-7B on 4 x 2 H100s under 40 GB: tensor parallelism's, ~70 CPU s for a 3.97 s plan against the
    search's 673.5 ms); the recipes under c still warm-start it, and the plan is the one without a ceiling."""
    from autopar.planning import recompute, spmd
    mesh = autopar.Mesh((2, 2), axis_names=("dp", "tp"))
    with pytest.raises(InfeasiblePlanError) as info:
        _plan(gpt, captured, mesh=mesh, recompute="none", memory_budget=1)
    every = _plan(gpt, captured, mesh=mesh, recompute="all", strategy="zero3")
    budget = int((every.memory_per_device + info.value.min_memory_per_device) / 2)   # only recompute fits
    free = {name: _plan(gpt, captured, mesh=mesh, strategy=name).predicted_step_time for name in spmd.BASELINES}
    assert len(set(free.values())) > 1
    ceiling = sorted(free.values())[len(free) // 2]   # some recipes' bounds above it, some at or below
    warm: list[int] = []
    solve = recompute.solve_recompute
    monkeypatch.setattr(recompute, "solve_recompute",
                        lambda *a, recipes=(), **k: warm.append(len(recipes)) or solve(*a, recipes=recipes, **k))
    plain = _plan(gpt, captured, mesh=mesh, memory_budget=budget)
    ceiled = _plan(gpt, captured, mesh=mesh, memory_budget=budget, ceiling=ceiling)
    assert warm == [len(spmd.BASELINES), sum(t <= ceiling * (1 + 1e-9) for t in free.values())]
    assert 0 < warm[1] < warm[0]
    assert plain.recompute and ceiled.recompute
    assert ceiled.predicted_step_time == pytest.approx(plain.predicted_step_time, rel=1e-9)

def _measure(rank, world, model, args, plan_jsons):
    from autopar import autoparallelize
    from autopar.runtime.memtrack import measure_step
    out = []
    for pj in plan_jsons:
        pmodel = autoparallelize(model, args, plan=Plan.from_json(pj), verify=True)
        out.append(measure_step(pmodel, *args).peak_bytes)
    return out


def test_measured_peak_activation_memory_matches_the_prediction(gpt, world1):
    keep, every, mid, _ = world1
    plans = (keep, mid, every)
    measured = run_distributed(_measure, 1, gpt.model, gpt.args, [p.to_json() for p in plans])[0]
    for plan, got in zip(plans, measured):
        want = plan.memory_breakdown["activations"]
        assert abs(got - want) <= 0.15 * want, (plan.recompute, got, want)
    assert measured[0] > measured[1] > measured[2]


# ---------------------------------------------------------------------------- training at world 2
def _least(case, captured, **kw) -> float:
    with pytest.raises(InfeasiblePlanError) as info:
        _plan(case, captured, mesh=(2,), memory_budget=1, **kw)
    return info.value.min_memory_per_device


def _train_plans(rank, world, model, batches, plan_jsons):
    return [train_parallel(rank, world, model, batches, 3, {"plan": Plan.from_json(pj)}) for pj in plan_jsons]


def test_recomputed_plans_train_like_one_process(gpt, captured):
    """The budget-forced plan, and recompute with tensor parallel and ZeRO-3, whose forward collectives
    (TP all-reduces, ZeRO-3 gathers) run again in backward: priced, emitted, and numerically exact."""
    budget = int((_least(gpt, captured, recompute="none") + _least(gpt, captured, recompute="all")) / 2)
    plans = [_plan(gpt, captured, mesh=(2,), memory_budget=budget),
             _plan(gpt, captured, mesh=(2,), strategy="tp", recompute=["transformer.h.1"]),
             _plan(gpt, captured, mesh=(2,), strategy="zero3", recompute="all")]
    assert plans[0].recompute and plans[0].memory_per_device <= budget
    for plan in plans[1:]:
        assert any(c.reason.startswith("recompute") for c in plan.collectives)
    batches = [((gpt.args[0].roll(s, 1), gpt.args[1].roll(s, 1)), {}) for s in range(3)]
    ref_losses, ref_state = train_reference(gpt.model, batches, 3)
    got = run_distributed(_train_plans, 2, gpt.model, batches, [p.to_json() for p in plans])
    for plan, result in zip(plans, got[0]):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
        for k, v in ref_state.items():
            torch.testing.assert_close(result["state"][k], v, rtol=1e-4, atol=1e-5)
        assert result["emitted"] == dict(Counter((c.kind, c.phase) for c in plan.collectives)), plan.recompute


def _step_with_seed(rank, world, model, args, plan_jsons):
    import copy

    from autopar import autoparallelize
    out = []
    for pj in plan_jsons:
        pmodel = autoparallelize(copy.deepcopy(model), args, plan=Plan.from_json(pj), verify=True)
        torch.manual_seed(5)
        loss = pmodel.train_step(*args)
        nodes = list(pmodel.gm.graph.nodes)
        out.append({"loss": loss.item(), "grads": {n: p.grad.full_tensor() for n, p in pmodel.named_parameters()},
                    "random": sum(is_random(n) for n in nodes),
                    "copies": sum(n.meta.get("autopar_pass") == "recompute" for n in nodes)})
    return out


def test_recompute_with_dropout_reuses_the_mask():
    """Dropout 0.2: the recomputed step draws the same masks (kept, not redrawn), so loss and
    gradients equal the step that keeps every activation, bit for bit."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32, dropout=0.2))
    args = (models._tokens(64, 4, 16), models._tokens(64, 4, 16, seed=1))
    plans = [autopar.plan(model, args, mesh=(1,), baselines=False, recompute=r) for r in ("none", "all")]
    keep, redo = run_distributed(_step_with_seed, 1, model, args, [p.to_json() for p in plans])[0]
    assert redo["copies"] > 0 and redo["random"] == keep["random"] > 0
    assert redo["loss"] == keep["loss"]
    for k, g in keep["grads"].items():
        torch.testing.assert_close(redo["grads"][k], g, rtol=0, atol=0)
