"""Sharding rules are numerically valid, and the resharding / parameter-memory formulas are right.

The rule check is the executable meaning of `autopar.sharding.rules`: for every op of a real joint graph and
every 1-D strategy its rule offers (that shards evenly), running the op on 2 virtual ranks' local
shards (`autopar/_testing/simulate.py::run_local`) and reassembling the outputs gives the op's real value.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx as fx

from autopar._testing import models
from autopar._testing.simulate import run_local
from autopar.capture.trace import capture
from autopar.costmodel.comm import collective_time
from autopar.graph import is_getitem, val_of
from autopar.mesh import Mesh
from autopar.placement import SS, P, R, S, divides, from_str, is_strided, local_shape, to_str
from autopar.planning.reshard import ReshardCost, Step, steps
from autopar.sharding.params import param_memory, param_strategies
from autopar.sharding.rules import OpCall
from autopar.sharding.strategies import StrategyEnumerator

N = 2  # virtual ranks


class _Recorder(fx.Interpreter):
    """Runs the graph once and keeps every node's real value."""

    def __init__(self, gm):
        super().__init__(gm)
        self.values: dict = {}

    def run_node(self, n):
        out = super().run_node(n)
        self.values[n] = out
        return out


def _real_values(case) -> tuple[fx.GraphModule, dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(case.model, case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn)
    named = {**dict(case.model.named_parameters(remove_duplicate=False)),
             **dict(case.model.named_buffers(remove_duplicate=False))}
    inputs = iter([*case.args, *(v for v in case.kwargs.values() if isinstance(v, torch.Tensor))])
    flat = []
    for node in captured.placeholders():
        role = node.meta["autopar_role"]
        flat.append(next(inputs) if role == "input" else named[node.meta["autopar_name"]].detach())
    rec = _Recorder(captured.gm)
    with torch.no_grad():
        rec.run(*flat)
    return captured.gm, rec.values


def _close(got, want) -> bool:
    if isinstance(want, (tuple, list)):
        return all(w is None or g is None or _close(g, w) for g, w in zip(got, want))
    if not isinstance(want, torch.Tensor):
        return True
    if not want.dtype.is_floating_point:
        return torch.equal(got, want)
    return torch.allclose(got, want, rtol=1e-4, atol=1e-5, equal_nan=True)


def _check_graph(gm: fx.GraphModule, values: dict) -> tuple[int, list[str]]:
    enum = StrategyEnumerator((N,))
    gen = torch.Generator().manual_seed(0)
    checked, failures = 0, []
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_getitem(node) or "empty" in str(node.target):
            continue
        call = OpCall(node, val_of)
        for strat in fitting_strategies(enum, call):
            got = run_local(node, strat, values, N, gen)
            checked += 1
            if not _close(got, values[node] if call.multi else values[node]):
                failures.append(f"{node.name} {node.target} outs={strat.outs} ins={strat.ins}")
    return checked, failures


def fitting_strategies(enum, call: OpCall) -> list:
    """The op's 1-D rule strategies whose shards divide its shapes (what the planner would offer)."""
    in_info = [(tuple(val_of(a).shape), val_of(a).dtype) if isinstance(val_of(a), torch.Tensor)
               else (None, None) for a in call.inputs]
    return [s for s in enum._axis_strategies(call)
            if enum._fits(tuple((p,) if p is not None else None for p in s.outs), call.outs,
                          tuple((p,) for p in s.ins), in_info)]


@pytest.mark.parametrize("name", ["gpt", "gpt2", "llama", "bert"])
def test_every_rule_strategy_matches_the_real_value(name):
    gm, values = _real_values(models.TINY_CASES[name]())
    checked, failures = _check_graph(gm, values)
    assert checked > 100
    assert not failures, f"{len(failures)} of {checked} strategies disagree:\n" + "\n".join(failures[:20])


# ---------------------------------------------------------------- resharding costs (reshard.py)

def test_one_axis_collectives():
    sizes = (4,)
    assert steps((S(0),), (R,), 1000.0, sizes) == [Step("all_gather", 0, 1000.0)]
    assert steps((P,), (S(1),), 1000.0, sizes) == [Step("reduce_scatter", 0, 1000.0)]
    assert steps((P,), (R,), 1000.0, sizes) == [Step("all_reduce", 0, 1000.0)]
    assert steps((S(0),), (S(1),), 1000.0, sizes) == [Step("all_to_all", 0, 250.0)]
    assert steps((R,), (S(0),), 1000.0, sizes) == []  # a local slice
    assert steps((R,), (P,), 1000.0, sizes) == []


def test_two_axis_message_sizes_follow_the_tensor():
    sizes = (2, 4)
    # a gather on axis 0 while axis 1 stays sharded moves the axis-1 shard: B/4 bytes
    assert steps((S(0), S(1)), (R, S(1)), 800.0, sizes) == [Step("all_gather", 0, 200.0)]
    # processed in mesh order: axis 0 gathers a 1/4 shard, then axis 1 gathers the full tensor
    assert steps((S(0), S(1)), (R, R), 800.0, sizes) == [Step("all_gather", 0, 200.0),
                                                         Step("all_gather", 1, 800.0)]
    assert steps((P, P), (R, S(0)), 800.0, sizes) == [Step("all_reduce", 0, 800.0),
                                                      Step("reduce_scatter", 1, 800.0)]


def test_reshard_time_is_alpha_beta_on_the_axis_link():
    mesh = Mesh((2, 4), hardware="h100", devices_per_node=4)  # axis 0 crosses nodes
    rc = ReshardCost(mesh)
    hw = mesh.hardware
    b = 2.0 ** 30
    t = rc.time((R, S(0)), (R, R), b)
    want = collective_time("all_gather", b, 4, hw.intra_node)
    assert t == pytest.approx(want + 0.1 * hw.intra_node.latency)
    t0 = rc.time((S(0), R), (R, R), b, bucketed=True)
    assert t0 == pytest.approx(collective_time("all_gather", b, 2, hw.inter_node))
    assert rc.time((S(0), R), (S(0), R), b) == 0.0


# ---------------------------------------------------------------- parameter memory (params.py)

def _mem(mode_filter, shape=(64, 32), sizes=(4,)):
    nbytes, numel = 4.0 * 64 * 32, 64 * 32
    strats = [s for s in param_strategies(shape, sizes, True) if s.modes == mode_filter]
    return [param_memory(s, nbytes, numel, sizes, 8.0, True) for s in strats], nbytes, numel


def test_param_memory_per_mode():
    (dp,), nbytes, numel = _mem(("dp",))
    assert dp == {"params": nbytes, "gathered_params": 0.0, "grads": nbytes, "optimizer": 8.0 * numel}
    (z1,), _, _ = _mem(("zero1",))  # the stored shard, plus the whole copy gathered for the step
    assert z1 == {"params": nbytes / 4, "gathered_params": nbytes, "grads": nbytes, "optimizer": 2.0 * numel}
    (z2,), _, _ = _mem(("zero2",))
    assert z2 == {"params": nbytes / 4, "gathered_params": nbytes, "grads": nbytes / 4,
                  "optimizer": 2.0 * numel}
    shards, _, _ = _mem(("shard",))
    assert len(shards) == 2  # Shard(0) (ZeRO-3 / column) and Shard(1) (row)
    dp_total = sum(dp.values())
    for sh in shards:  # ZeRO-3 and tensor parallel hold 1/n of everything data parallel holds
        assert sum(sh.values()) == pytest.approx(dp_total / 4)


def test_frozen_parameters_hold_no_grads_or_state():
    s = param_strategies((8, 8), (2,), trainable=False)
    assert {m for st in s for m in st.modes} == {"dp", "shard"}
    mem = param_memory(s[0], 256.0, 64, (2,), 8.0, False)
    assert mem == {"params": 256.0, "gathered_params": 0.0, "grads": 0.0, "optimizer": 0.0}


# ---------------------------------------------------------------- strided shards (rules/strided.py)

def _fused_qkv_graph() -> tuple[fx.GraphModule, dict]:
    """y = x @ w.T split in 3 equal pieces (a fused q;k;v), and the backward's cat of 3 pieces."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w, b, a0, a1, a2, g):
        q, k, v = (torch.mm(x, w.t()) + b).split(4, dim=1)
        return q * 2, k, v, torch.cat([a0, a1, a2], dim=1), torch.mm(g, w)  # g @ w: the input gradient

    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=gen) for s in ((6, 5), (12, 5), (12,), (6, 4), (6, 4), (6, 4), (6, 12))]
    gm = make_fx(f, tracing_mode="fake")(*args)
    rec = _Recorder(gm)
    rec.run(*args)
    return gm, rec.values


def test_split_factors_come_from_equal_splits_and_cats():
    from autopar.sharding.rules.strided import split_factors
    gm, _ = _fused_qkv_graph()
    assert split_factors(gm.graph) == {(12, 3)}
    gpt, _ = _real_values(models.TINY_CASES["gpt"]())  # the hand-written GPT's fused c_attn
    llama, _ = _real_values(models.TINY_CASES["llama"]())  # separate q, k, v projections
    assert any(k == 3 for _, k in split_factors(gpt.graph))
    assert all(k != 3 for _, k in split_factors(llama.graph))


def test_strided_rules_and_their_numerics():
    """A weight strided on its output dim gives an output strided on its last dim; the split of it
    gives Shard pieces; the cat of Shard pieces gives a strided shard; each checked on 2 virtual ranks."""
    gm, values = _fused_qkv_graph()
    enum = StrategyEnumerator((N,))
    gen = torch.Generator().manual_seed(0)
    by_target, checked = {}, 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_getitem(node):
            continue
        strats = fitting_strategies(enum, OpCall(node, val_of))
        by_target.setdefault(node.target, []).extend(strats)
        for strat in strats:
            if any(is_strided(p) for p in (*strat.outs, *strat.ins) if p is not None):
                checked += 1
                assert _close(run_local(node, strat, values, N, gen), values[node]), (node.name, strat)
    aten = torch.ops.aten
    mm = {(s.outs, s.ins) for s in by_target[aten.mm.default]}
    assert ((SS(1, 3),), (R, SS(1, 3))) in mm  # column split, strided
    assert ((P,), (SS(1, 3), SS(0, 3))) in mm  # contraction split, both strided alike
    split = [s for s in by_target[aten.split.Tensor] if any(is_strided(p) for p in s.ins)]
    assert [(s.outs, s.ins) for s in split] == [((S(1),) * 3, (SS(1, 3),))]
    cat = [s for s in by_target[aten.cat.default] if any(is_strided(p) for p in s.outs)]
    assert [(s.outs, s.ins) for s in cat] == [((SS(1, 3),), (S(1),) * 3)]
    assert checked >= 8


def test_strided_placement_text_and_divisibility():
    p = SS(0, 3)
    assert to_str(p) == "S0k3" and from_str("S0k3") == p and p != S(0)
    assert divides((p,), (12, 5), (2,)) and not divides((p,), (12, 5), (3,))  # needs k * n pieces
    assert not divides((p, S(0)), (24, 5), (2, 2))  # a strided dim split again on another axis
    assert local_shape((p,), (12, 5), (2,)) == (6, 5)
    shard = [s for s in param_strategies((12, 5), (2,), True, frozenset({(12, 3)})) if s.master == (p,)]
    assert len(shard) == 1 and shard[0].modes == ("shard",)
    assert all(not is_strided(s.master[0]) for s in param_strategies((12, 5), (2,), True))


def test_strided_resharding_is_priced_as_gather_or_reduce_scatter():
    sizes, p = (2,), SS(1, 3)
    assert steps((p,), (R,), 1200.0, sizes) == [Step("all_gather", 0, 1200.0)]
    assert steps((P,), (p,), 1200.0, sizes) == [Step("reduce_scatter", 0, 1200.0)]
    assert steps((R,), (p,), 1200.0, sizes) == []  # a local slice of each piece
    assert steps((S(1),), (p,), 1200.0, sizes) == [Step("all_gather", 0, 1200.0)]  # through Replicate
    assert steps((p,), (S(0),), 1200.0, sizes) == [Step("all_gather", 0, 1200.0)]
