"""Known result on a 2-D mesh: data parallel across the slow (inter-node) axis, Megatron tensor
parallel on the fast (intra-node) axis.

Why these sizes. With an honest cost model the textbook answer is not unconditional:
  * splitting the batch over the slow axis pays a gradient all-reduce there; it beats keeping that
    axis replicated only when the compute saved (half the step) exceeds it — many tokens per step;
  * on the fast axis, when the batch divides by the whole mesh, data parallel + ZeRO (reduce-scatter
    on the fast axis first, so the slow axis moves 1/4 of the gradient, the same bytes as under TP)
    beats TP, which adds activation all-reduces and keeps layer-norm/residual activations whole.
Megatron's regime is the one where TP is needed: few sequences (batch 2 < 8 devices), long ones
(16k tokens each, so compute is large and data parallelism over the slow axis pays), attention that
cannot split the sequence — so the fast axis can only split heads (column / row linears).
"""
from __future__ import annotations

import dataclasses
import warnings

import pytest

import autopar
from autopar._testing import models
from autopar.costmodel.hardware import A100, LinkSpec
from autopar.placement import R, S


def slow_inter_node_mesh() -> autopar.Mesh:
    """(2, 4) A100s, 4 per node: axis "node" crosses nodes over a link 100x slower than "gpu"'s."""
    intra = A100.intra_node
    hw = dataclasses.replace(A100, name="a100-slow-inter", devices_per_node=4,
                             inter_node=LinkSpec(intra.bandwidth / 100, intra.latency * 100))
    return autopar.Mesh((2, 4), axis_names=("node", "gpu"), hardware=hw, devices_per_node=4)


@pytest.fixture(scope="module")
def plan_2d():
    mesh = slow_inter_node_mesh()
    assert (mesh.link_kind("node"), mesh.link_kind("gpu")) == ("inter", "intra")
    case = models.meta_megatron_lm(hidden=4096, num_heads=16, batch=2, seq=16384)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(case.model, case.example_inputs, mesh=mesh, baselines=False)


def test_slow_axis_is_data_parallel(plan_2d):
    p = plan_2d
    assert p.placement("embedding")[0] == S(0)          # activations split along the batch on "node"
    for name, pp in p.params.items():
        if name.startswith("layers.0.") and name.endswith("weight"):
            assert pp.use[0] == "R" and pp.modes[0] in ("dp", "zero1", "zero2"), name
    grads = [c for c in p.collectives if c.reason == "gradient" and c.axis == "node"]
    assert {c.module for c in grads} >= {"layers.0.q_proj", "layers.0.fc1", "layers.0.fc2"}


def test_fast_axis_is_megatron_tensor_parallel(plan_2d):
    p = plan_2d
    for name in ("q_proj", "k_proj", "v_proj", "fc1"):      # column-parallel: weight (out, in) split on out
        assert p.params[f"layers.0.{name}.weight"].use == ("R", "S0"), name
    for name in ("o_proj", "fc2"):                          # row-parallel: split on in -> Partial sums
        assert p.params[f"layers.0.{name}.weight"].use == ("R", "S1"), name
    assert p.placement("layers.0.q_proj")[1] == S(0) and p.placement("layers.0.fc2")[1] == S(1)
    assert p.placement("layers.0.fc2")[0] in (R, S(0))      # replicated or ZeRO-sharded on "node"


@pytest.mark.parametrize("make", [lambda: models.meta_megatron_lm(vocab=64, hidden=64, num_heads=4, batch=4, seq=8),
                                  lambda: models.tiny_gpt(n_layer=1, batch=4, seq=8)], ids=["megatron", "gpt"])
def test_strategy_pruning_keeps_the_optimum(make):
    """`prune_partials` (sharding.strategies) and dominance pruning (solver) are exact: the same optimum as the
    full strategy space. A 1-D mesh keeps the unpruned solve fast (a (2, 2) mesh agrees, in ~1 min)."""
    from autopar.capture.canonicalize import canonicalize
    from autopar.capture.trace import capture
    from autopar.planning.problem import ProblemBuilder
    from autopar.planning.solver import solve

    case = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(case.model, case.example_inputs)
    canonicalize(captured.gm)
    mesh = autopar.Mesh((4,), hardware="a100")
    pruned = ProblemBuilder(captured, mesh).build()
    full = ProblemBuilder(captured, mesh, prune=False).build()
    assert sum(len(s) for s in pruned.strategies) < sum(len(s) for s in full.strategies)
    a, b = solve(pruned.cg, backend="highs"), solve(full.cg, backend="highs")
    assert a.status == b.status == "optimal"
    assert a.time == pytest.approx(b.time, rel=1e-6)
