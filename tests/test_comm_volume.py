"""Per-device communication volume of forced plans equals the textbook formulas.

Bytes moved per device by one collective are `collective_bytes_moved(kind, B, n)` (all-reduce
2(n-1)/n·B, all-gather and reduce-scatter (n-1)/n·B). P = parameter bytes (GPT's tied wte/lm_head
counted once). Where the textbook ignores something, the test says what and asserts the exact number.
"""
from __future__ import annotations

import warnings

import pytest

import autopar
from autopar._testing import models
from autopar.costmodel.comm import collective_bytes_moved

N = 4
MESH = autopar.Mesh((N,), hardware="a100")
F32 = 4


def _plan(case, strategy):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(case.model, case.example_inputs, mesh=MESH, strategy=strategy, baselines=False)


def _moved(records) -> float:
    return sum(collective_bytes_moved(c.kind, c.bytes, N) for c in records)


@pytest.fixture(scope="module")
def gpt():
    return models.meta_gpt(n_layer=2, n_embd=256, n_head=4, batch=8, seq=256)


def test_dp_moves_2_n_minus_1_over_n_of_the_parameters(gpt):
    p = _plan(gpt, "dp")
    P = p.model["parameters"] * F32
    assert _moved(c for c in p.collectives if c.reason == "gradient") == pytest.approx(2 * (N - 1) / N * P, rel=1e-9)
    # Not in the textbook: the loss, 4 bytes, all-reduced with the gradients at the end of the step.
    # Cross-entropy's denominator (the count of non-ignored targets) moves nothing: every rank holds
    # the whole batch and counts it itself. No activation moves, nothing blocks in the forward.
    others = [c for c in p.collectives if c.reason != "gradient"]
    assert [(c.bytes, c.reason) for c in others] == [(F32, "loss to every rank")]


def test_zero3_is_one_and_a_half_dp(gpt):
    p = _plan(gpt, "zero3")
    P = p.model["parameters"] * F32
    wte, wpe = 50304 * 256 * F32, 1024 * 256 * F32
    biases = sum(t.numel() for n, t in gpt.model.named_parameters() if n.endswith(".bias")) * F32
    grads = [c for c in p.collectives if c.reason == "gradient"]
    assert all(c.kind == "reduce_scatter" for c in grads)
    assert _moved(grads) == pytest.approx((N - 1) / N * P, rel=1e-9)
    gathers = [c for c in p.collectives if c.kind == "all_gather" and c.source.startswith("arg")]  # parameters
    fwd = _moved(c for c in gathers if c.phase == "forward")
    bwd = _moved(c for c in gathers if c.phase == "backward")
    # Forward gathers every parameter once, the tied wte twice (embedding and lm_head are two uses).
    # Backward re-gathers what backward reads: not wpe (its gradient needs only the positions) and
    # not the linear biases; a norm's weight/bias the solver may re-gather or keep from forward (a
    # few KB, so both plans cost the same to 1e-7). Without these deviations (the biases: 1e-4 of
    # P) the total is exactly 3(n-1)/n·P = 1.5x DP.
    assert fwd == pytest.approx((N - 1) / N * (P + wte), rel=1e-9)
    assert (N - 1) / N * (P - wpe - biases) <= bwd <= (N - 1) / N * (P - wpe)
    dp = 2 * (N - 1) / N * P
    assert fwd + bwd + _moved(grads) - (N - 1) / N * (wte - wpe) == pytest.approx(1.5 * dp, rel=2e-4)


def test_tp_moves_four_activation_all_reduces_per_layer():
    """Megatron (separate q/k/v, so column splits give whole heads): per layer and step two forward
    and two backward all-reduces of B = b·s·h. The planner picks the sequence-parallel form (norms
    and residuals split along the sequence; reduce-scatter after each row-parallel linear,
    all-gather before each column-parallel one): the same 2(n-1)/n·B bytes per all-reduce, so
    bytes are counted, not kinds. Records are attributed to the module of the op that needs them."""
    layers, b, s, h, vocab = 3, 4, 64, 1024, 512
    p = _plan(models.meta_megatron_lm(vocab=vocab, hidden=h, num_heads=16, num_layers=layers, batch=b, seq=s), "tp")
    B = b * s * h * F32
    one_all_reduce = 2 * (N - 1) / N * B
    acts = [c for c in p.collectives if c.reason != "gradient" and c.source not in p.params and c.bytes == B]
    assert {c.kind for c in acts} == {"reduce_scatter", "all_gather"}

    def in_layer(c, layer):
        return c.module == f"layers.{layer}" or c.module.startswith(f"layers.{layer}.")

    # Layer 0 too: the embedding table is split like every weight matrix (never gathered whole), so
    # its output is a hidden shard, gathered whole for the first norm as later layers gather their
    # sequence shards (its all-to-all onto the sequence shards for the residual moves B/n).
    for layer in range(layers):
        assert _moved(c for c in acts if in_layer(c, layer)) == pytest.approx(4 * one_all_reduce, rel=1e-9)
    # Outside the layers, the column-split LM head adds one (gather its input in forward,
    # reduce-scatter its input gradient in backward).
    assert _moved(acts) == pytest.approx((4 * layers + 1) * one_all_reduce, rel=1e-9)
    # Not in the textbook: layer-norm parameters stay replicated, so their gradients (h floats each:
    # 2 per norm, 2 norms per layer + ln_f) are all-reduced; the loss scalar is all-reduced once.
    ln = [c for c in p.collectives if c.reason == "gradient" and ".ln_" in f".{c.source}"]
    assert len(ln) == 2 * (2 * layers + 1) and _moved(ln) == pytest.approx(len(ln) * 2 * (N - 1) / N * h * F32)
    assert [c.bytes for c in p.collectives if c.reason.startswith("loss")] == [F32]
