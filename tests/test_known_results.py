"""Known results the planner must reproduce (DESIGN.md, from Alpa and Megatron-LM), on meta models."""
from __future__ import annotations

import warnings

import autopar
from autopar._testing import models
from autopar.placement import S


def _plan(case, mesh, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(case.model, case.example_inputs, mesh=mesh, **{"num_stages": None, **kw})


def test_mlp_small_batch_wide_hidden_is_column_then_row():
    """Alpa: batch 128, hidden 1024 on 4 devices -> fc1 column-split, fc2 row-split, one all-reduce."""
    p = _plan(models.meta_mlp(128, 1024), autopar.Mesh((4,), hardware="a100"))
    assert p.params["fc1.weight"].use == ("S0",)   # nn.Linear weight is (out, in): column split
    assert p.params["fc2.weight"].use == ("S1",)   # row split: the contraction -> Partial
    fwd = [c for c in p.collectives if c.phase == "forward" and c.kind == "all_reduce" and c.reason != "gradient"]
    assert len(fwd) == 1 and fwd[0].module == "fc2"


def test_mlp_large_batch_narrow_hidden_is_data_parallel():
    """Alpa: batch 1024, hidden 128 -> data parallel. Every matmul is split along the batch, weights are
    used whole, and the only collectives are the weight-gradient sums (and the master gathers).

    The cost model prices ZeRO-1 (reduce-scatter + all-gather: the same bytes and hops as one
    all-reduce, but a 1/n optimizer step) no worse than plain dp, so the data-parallel family is
    accepted here; see the report for why plain "dp" mode needs an overlap model to win."""
    p = _plan(models.meta_mlp(1024, 128), autopar.Mesh((4,), hardware="a100"))
    for name, pp in p.params.items():
        assert pp.use == ("R",) and pp.modes[0] in ("dp", "zero1", "zero2"), name
    fwd_mms = [c for n, c in p.nodes.items() if n.startswith("mm_default")]
    assert fwd_mms and all(c.outs[0] == ("S0",) for c in fwd_mms)
    grads = {c.module for c in p.collectives if c.reason == "gradient"}
    assert grads == {"fc1", "fc2"}
    assert not [c for c in p.collectives if c.phase == "forward" and "ZeRO" not in c.reason]


def test_transformer_layer_under_memory_pressure_is_megatron():
    """Megatron-LM: with a budget data parallelism cannot meet, QKV and the first FFN linear are
    column-split, the attention output and the second FFN linear row-split."""
    p = _plan(models.meta_megatron_lm(hidden=2048, batch=4, seq=64), autopar.Mesh((4,), hardware="a100"),
              memory_budget="0.3GB")
    assert not p.baselines["dp"]["feasible"]
    assert p.feasible and p.memory_per_device <= 0.3e9
    for name in ("q_proj", "k_proj", "v_proj", "fc1"):
        assert p.placement(f"layers.0.{name}") == (S(0),), name
    for name in ("o_proj", "fc2"):
        assert p.placement(f"layers.0.{name}") == (S(1),), name
    assert p.predicted_step_time <= min(b["time"] for b in p.baselines.values() if b["feasible"])
