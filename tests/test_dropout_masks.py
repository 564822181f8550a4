"""Dropout masks saved as 1-byte booleans (`autopar/capture/dropout_masks.py`, a canonicalisation step): the
backward reads the same values bit for bit, the saved bytes drop, recompute keeps the boolean mask,
the rules never make a bool cast Partial, and a graph without dropout is left as it is."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from autopar._testing import models
from autopar._testing.gpt import GPT, GPTConfig
from autopar.capture.canonicalize import canonicalize
from autopar.capture.dropout_masks import save_bool_masks
from autopar.capture.trace import capture
from autopar.graph import nbytes_of, val_of
from autopar.placement import PAVG, P
from autopar.planning.problem import saved_values
from autopar.planning.recompute import copied_nodes, layer_nodes
from autopar.runtime.memtrack import peak_activation_bytes
from autopar.sharding.rules import OpCall
from autopar.sharding.strategies import StrategyEnumerator

aten = torch.ops.aten
KEEP = 0.75  # 1 - p


# ---------------------------------------------------------------------------- hand-built graphs
def _hand_graph(mask: str) -> tuple[fx.GraphModule, tuple]:
    """loss = sum(relu(x @ w) * scaled_mask) in layer "layers.0", with its hand-written backward, which
    reads the scaled mask. mask: "bernoulli" (bernoulli(KEEP) / KEEP, in float32), "compare"
    ((rand < KEEP).float() * (1 / KEEP)) or "bool" (rand > 0.5 used as is: already 1 byte)."""
    g = fx.Graph()

    def op(target, *args, phase="forward", path="layers.0", **kwargs):
        n = g.call_function(target, args, kwargs)
        n.meta.update(phase=phase, module_path=path)
        return n

    w, x = g.placeholder("w"), g.placeholder("x")
    w.meta.update(autopar_role="param", autopar_name="layers.0.w")
    x.meta.update(autopar_role="input", autopar_name="x")
    h = op(aten.relu.default, op(aten.mm.default, x, w))
    if mask == "bernoulli":
        scaled = op(aten.div.Scalar, op(aten.bernoulli.p, h, KEEP), KEEP)
    elif mask == "compare":
        drawn = op(aten.lt.Scalar, op(aten.rand_like.default, h), KEEP)
        scaled = op(aten.mul.Tensor, op(aten._to_copy.default, drawn, dtype=torch.float32), 1 / KEEP)
    else:
        scaled = op(aten.gt.Scalar, op(aten.rand_like.default, h), 0.5)
    loss = op(aten.sum.default, op(aten.mul.Tensor, h, scaled), path="")
    gy = op(aten.ones_like.default, h, phase="backward")
    gh = op(aten.threshold_backward.default, op(aten.mul.Tensor, gy, scaled, phase="backward"), h, 0,
            phase="backward")
    g.output((loss, op(aten.mm.default, op(aten.t.default, x, phase="backward"), gh, phase="backward")))
    gm = fx.GraphModule(torch.nn.Module(), g)
    args = (torch.randn(6, 6), torch.randn(4, 6))
    FakeTensorProp(gm).propagate(*args)
    return gm, args


def _run(gm: fx.GraphModule, *args) -> tuple:
    torch.manual_seed(0)
    return gm(*args)


def _transformed(gm: fx.GraphModule) -> int:
    count = save_bool_masks(gm)
    gm.graph.lint()
    gm.recompile()
    return count


@pytest.mark.parametrize("mask", ["bernoulli", "compare"])
def test_saves_the_mask_as_bool_and_rebuilds_it_bit_for_bit(mask):
    gm, args = _hand_graph(mask)
    before = _run(gm, *args)
    scaled = next(n for n in gm.graph.nodes if n.target in (aten.div.Scalar, aten.mul.Tensor) and len(n.users) == 2)
    assert scaled in {b for b, _ in saved_values(gm)}  # the float32 scaled mask is kept for backward
    assert _transformed(gm) == 1
    saved = {b for b, _ in saved_values(gm)}
    masks = [b for b in saved if b.meta["val"].dtype == torch.bool]
    assert len(masks) == 1 and scaled not in saved
    assert masks[0].meta["phase"] == "forward" and masks[0].meta["module_path"] == "layers.0"
    if mask == "bernoulli":  # a new 1-byte copy of the draw; a comparison already is one
        assert masks[0].meta["autopar_mask"] and masks[0].args[0].target is aten.bernoulli.p
    rebuilt = [n for n in gm.graph.nodes if n.meta.get("autopar_pass") == "dropout_masks"
               and n.meta["phase"] == "backward"]
    assert [n.target for n in rebuilt][-1] is scaled.target and rebuilt[-1].args[1:] == scaled.args[1:]
    assert all(u.meta["phase"] == "forward" for u in scaled.users)
    after = _run(gm, *args)
    assert any(v.abs().sum() > 0 for v in after)
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_bool_mask_read_as_is_and_no_mask_leave_the_graph_unchanged():
    gm, _ = _hand_graph("bool")
    code = gm.code
    assert _transformed(gm) == 0 and gm.code == code
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = capture(model, (models._tokens(64, 2, 16), models._tokens(64, 2, 16, seed=1))).gm
    code = gm.code
    assert _transformed(gm) == 0 and gm.code == code


def test_canonicalize_runs_it():
    gm, _ = _hand_graph("bernoulli")
    assert canonicalize(gm)["bool_masks"] == 1


def test_recompute_keeps_the_bool_mask():
    """A recomputed layer re-runs the ops that rebuild nothing random: the bool mask is kept (1 byte),
    the draw and its float copy die in forward."""
    gm, _ = _hand_graph("bernoulli")
    _transformed(gm)
    copies = copied_nodes(layer_nodes(gm)["layers.0"])
    assert not [n for n in copies if n.meta.get("autopar_mask") or n.target is aten.bernoulli.p]
    kept = {b for b, _ in saved_values(gm, frozenset(copies))}
    assert [b.meta["val"].dtype for b in kept if b.meta.get("autopar_mask")] == [torch.bool]
    assert not [b for b in kept if b.target is aten.bernoulli.p]


def test_bool_casts_take_no_partial():
    """Casting to or from bool is not linear: the rules offer shards and Replicate, never Partial."""
    gm, _ = _hand_graph("bernoulli")
    _transformed(gm)
    casts = [n for n in gm.graph.nodes if n.target is aten._to_copy.default]
    assert len(casts) == 2  # the forward's bool copy, the backward's float copy of it
    enum = StrategyEnumerator((4,))
    for node in casts:
        outs = [s.outs[0] for s in enum._axis_strategies(OpCall(node, val_of))]
        assert outs and P not in outs and PAVG not in outs, node.name


# ---------------------------------------------------------------------------- a captured GPT
@pytest.fixture(scope="module")
def gpt_dropout():
    """autopar/_testing/gpt.py with dropout 0.2 (embedding, attention probabilities, both residual branches),
    captured in float32 on CPU tensors, and one step of it run eagerly with seed 0."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.2))
    ids, targets = models._tokens(64, 4, 16), models._tokens(64, 4, 16, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(model, (ids, targets))
    torch.manual_seed(0)
    loss = model(ids, targets)
    loss.backward()
    named = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    args = [named[n].detach() for n in cap.param_names] + [buffers[n] for n in cap.buffer_names] + [ids, targets]
    eager = (loss.detach(), *[named[n].grad for n in cap.grad_param_names])
    return cap.gm, args, eager


def _saved_bytes(gm: fx.GraphModule) -> float:
    vals = {b: b.meta["val"] if isinstance(b.meta["val"], (tuple, list)) else (b.meta["val"],)
            for b, _ in saved_values(gm)}
    return sum(nbytes_of(vals[b][i]) for b, i in saved_values(gm))


def test_gpt_with_dropout_trains_the_same_and_keeps_fewer_bytes(gpt_dropout):
    """Loss and gradients equal the untransformed graph's bit for bit and eager PyTorch's; the cost
    model's saved bytes and the measured live bytes at the end of forward (memtrack) drop by 3 bytes
    per mask element (float32 -> bool)."""
    gm, args, eager = gpt_dropout
    before, predicted_before = _run(gm, *args), _saved_bytes(gm)
    torch.manual_seed(0)
    measured_before = peak_activation_bytes(gm, *args).end_of_forward
    assert _transformed(gm) == 1 + 3 * 2  # the embedding's, then 3 per layer
    masks = [n for n in gm.graph.nodes if n.meta.get("autopar_mask")]
    mask_elements = sum(n.meta["val"].numel() for n in masks)
    after = _run(gm, *args)
    for a, b, e in zip(before, after, eager):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        torch.testing.assert_close(b, e, rtol=1e-5, atol=1e-6)
    assert predicted_before - _saved_bytes(gm) == 3 * mask_elements
    torch.manual_seed(0)
    measured = peak_activation_bytes(gm, *args).end_of_forward
    print(f"saved for backward: {predicted_before:.0f} -> {_saved_bytes(gm):.0f} bytes predicted, "
          f"{measured_before} -> {measured} bytes measured at the end of forward")
    assert measured_before - measured == 3 * mask_elements
