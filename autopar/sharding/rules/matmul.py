"""Matrix products: row split, column split, and contraction split (-> Partial), plus batch split.

For Y = A @ B with A (M, K), B (K, N):  S0 x R -> S0,  R x S1 -> S1,  S1 x S0 -> P,  P x R -> P,
R x P -> P. bmm adds the batch dimension. addmm is split into mm + add by canonicalisation so the
contraction split (Megatron's row-parallel linear) stays expressible with a bias.
"""
from __future__ import annotations

import torch

from autopar.placement import PAVG, P, R, S
from autopar.sharding.rules.registry import OpCall, register
from autopar.sharding.rules.strided import stridable

aten = torch.ops.aten


def _mm_like(call: OpCall, a, b, batch: bool) -> list:
    off = 1 if batch else 0
    strats = [
        call.strat(S(off), {a.idx: S(off), b.idx: R}),
        call.strat(S(off + 1), {a.idx: R, b.idx: S(off + 1)}),
        call.strat(P, {a.idx: S(off + 1), b.idx: S(off)}),
    ]
    for p in (P, PAVG):
        strats.append(call.strat(p, {a.idx: p, b.idx: R}))
        strats.append(call.strat(p, {a.idx: R, b.idx: p}))
    if batch:
        strats.append(call.strat(S(0), {a.idx: S(0), b.idx: S(0)}))
    if a.idx == b.idx:  # x @ x: one input cannot take two placements; stay replicated
        return []
    return strats


@register(aten.mm)
@stridable
def mm_rule(call: OpCall) -> list:
    return _mm_like(call, call.args[0], call.args[1], batch=False)


@register(aten.bmm)
@stridable
def bmm_rule(call: OpCall) -> list:
    return _mm_like(call, call.args[0], call.args[1], batch=True)


@register(aten.addmm)
@stridable
def addmm_rule(call: OpCall) -> list:
    """addmm(bias, A, B) = bias + A @ B: row and column splits (the bias follows the output)."""
    bias, a, b = call.args[0], call.args[1], call.args[2]
    bias_col = S(bias.ndim - 1) if bias.shape[-1] != 1 else R
    bias_row = S(0) if bias.ndim == 2 and bias.shape[0] != 1 else R
    return [
        call.strat(S(0), {a.idx: S(0), b.idx: R, bias.idx: bias_row}),
        call.strat(S(1), {a.idx: R, b.idx: S(1), bias.idx: bias_col}),
    ]
