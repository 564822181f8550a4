"""The sharding rules added for the model zoo (autopar/sharding/rules/conv.py, misc.py) are numerically valid.

As in tests/test_rules.py: every 1-D strategy a rule offers (that shards evenly), run on 2 virtual
ranks' local shards and reassembled, equals the op's real value in a real joint graph. Checked on a
hand-built conv/repeat model (strides, padding, no bias, groups, transposed) and on the zoo models
that use these ops (ViT's patch embedding, BLOOM's alibi repeat, Mixtral's top-k routing).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from test_rules import N, _close, _real_values, fitting_strategies

from autopar._testing import models
from autopar._testing.simulate import run_local
from autopar.capture.canonicalize import canonicalize
from autopar.capture.trace import capture
from autopar.errors import UnsupportedOpWarning
from autopar.graph import val_of
from autopar.mesh import Mesh
from autopar.placement import P, R, S
from autopar.planning.problem import ProblemBuilder
from autopar.sharding.rules import OpCall
from autopar.sharding.strategies import StrategyEnumerator

aten = torch.ops.aten
ZOO_OPS = (aten.convolution.default, aten.convolution_backward.default, aten.repeat.default, aten.topk.default,
           aten.sort.default, aten.sort.stable)


class ConvRepeat(nn.Module):
    """Every conv variant the rules treat differently, repeats with and without new dims, topk, sort."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)                       # bias, stride 1
        self.conv2 = nn.Conv2d(4, 6, 3, stride=2, padding=1, bias=False)  # no bias, strided
        self.up = nn.ConvTranspose2d(6, 4, 2, stride=2)                   # transposed
        self.grouped = nn.Conv2d(4, 4, 3, groups=2)                       # grouped
        self.conv1d = nn.Conv1d(4, 4, 1)

    def forward(self, x):
        h = self.grouped(self.up(self.conv2(torch.relu(self.conv1(x)))))   # (B, 4, 6, 6)
        h = h.flatten(2)                                                   # (B, 4, 36)
        h = self.conv1d(h).repeat(1, 2, 1) + h.repeat(1, 2, 1)            # (B, 8, 36)
        tiled = h.repeat(2, 1, 1, 1).mean(-1)                              # new leading dim
        return tiled + h.topk(4, dim=-1).values.mean(-1) + h.sort(dim=1).values.mean(-1)


def _sin_mean(out, *inputs):
    return out.sin().mean()


def conv_case() -> models.Case:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, 8)
    return models.Case(ConvRepeat(), (x,), loss_fn=_sin_mean)


def _check_ops(case, ops=ZOO_OPS) -> tuple[int, list[str], set]:
    """Check every strategy of every node whose target is in `ops`; also return the targets seen."""
    gm, values = _real_values(case)
    enum = StrategyEnumerator((N,))
    gen = torch.Generator().manual_seed(0)
    checked, failures, seen = 0, [], set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in ops:
            continue
        seen.add(node.target)
        call = OpCall(node, val_of)
        for strat in fitting_strategies(enum, call):
            checked += 1
            if not _close(run_local(node, strat, values, N, gen), values[node]):
                failures.append(f"{node.name} {node.target} outs={strat.outs} ins={strat.ins}")
    return checked, failures, seen


def test_conv_and_repeat_rules_match_the_real_value():
    checked, failures, seen = _check_ops(conv_case())
    assert set(ZOO_OPS[:4]) <= seen and seen & set(ZOO_OPS[4:])
    assert checked > 30
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", ["vit", "bloom", "mixtral"])
def test_zoo_model_rules_match_the_real_value(name):
    checked, failures, seen = _check_ops(models.ZOO_CASES[name]())
    assert seen and checked >= 3
    assert not failures, "\n".join(failures)


def _conv_node(gm, target):
    return next(n for n in gm.graph.nodes if n.target == target)


def test_channel_splits_only_for_plain_convs():
    """groups > 1 and transposed convs get batch and Partial splits, never channel splits."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = capture(ConvRepeat(), (torch.randn(4, 3, 8, 8),), loss_fn=_sin_mean).gm
    enum = StrategyEnumerator((N,))
    for node in gm.graph.nodes:
        if node.target != aten.convolution.default:
            continue
        strats = enum._axis_strategies(OpCall(node, val_of))
        plain = not node.args[6] and node.args[8] == 1
        assert any(s.outs == (S(0),) for s in strats)
        assert any(s.outs == (S(1),) for s in strats) == plain
        if plain:  # the contraction split over input channels
            assert any(s.outs == (P,) and s.ins[:2] == (S(1), S(1)) for s in strats)


def test_constants_and_zoo_ops_raise_no_unsupported_warning():
    """Graph constants (get_attr: T5's; Falcon's in older transformers) are replicated by rule, not reported as ops."""
    for name in ("falcon", "vit", "bloom", "t5"):
        case = models.ZOO_CASES[name]()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            captured = capture(case.model, case.args, example_kwargs=case.kwargs)
        canonicalize(captured.gm)
        enum = StrategyEnumerator((2,))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ProblemBuilder(captured, Mesh((2,)), "adamw", enumerator=enum).build()
        assert enum.unsupported == {}, name
        assert not [w for w in caught if issubclass(w.category, UnsupportedOpWarning)], name
        constants = [n for n in captured.gm.graph.nodes if n.op == "get_attr"]
        if name == "t5":   # (Falcon's alibi slopes were a tensor literal in older transformers; 5.25 builds them by ops)
            assert constants   # a tensor literal of its forward, lifted into the graph
        for node in constants:
            assert enum(node)[0].outs == ((R,),)
