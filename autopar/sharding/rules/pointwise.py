"""Elementwise ops with broadcasting: shard any output dim that every non-broadcast input shares.

Linear ops also pass Partial through: add/sub of partials, mul/div of one partial by replicated
factors, casts, clones. Non-linear ops (exp, gelu, ...) never take Partial.
"""
from __future__ import annotations

import torch

from autopar.placement import PAVG, P, R, S
from autopar.sharding.rules.registry import OpCall, register, register_fallback
from autopar.sharding.rules.strided import stridable

aten = torch.ops.aten

# Ops linear in ALL their tensor inputs jointly: f(sum a_i, sum b_i) = sum f(a_i, b_i).
JOINTLY_LINEAR = {aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.clone.default,
                  aten.alias.default, aten._to_copy.default, aten.detach.default, aten.mul.Scalar,
                  aten.div.Scalar, aten.lift_fresh_copy.default, aten.copy.default}
# Ops linear in ONE chosen tensor input when the others are replicated.
LINEAR_IN = {aten.mul.Tensor: None, aten.div.Tensor: (0,)}  # None = any input; div only in numerator


def _shard_strats(call: OpCall, ignore_first: int = 0) -> list:
    out = call.out
    tensors = call.tensor_args()
    strats = []
    for d in range(out.ndim):
        if out.shape[d] == 1:
            continue
        ins = {}
        for t in tensors:
            a = d - (out.ndim - t.ndim)
            ins[t.idx] = S(a) if a >= 0 and t.shape[a] == out.shape[d] else R
        strats.append(call.strat(S(d), ins))
    return strats


def _partial_strats(call: OpCall) -> list:
    tensors = call.tensor_args()
    target = call.target
    strats = []
    if target is aten._to_copy.default and torch.bool in (call.out.dtype, *(t.dtype for t in tensors)):
        return []  # a cast to or from bool is not linear: bool(a + b) != bool(a) + bool(b)
    if target in JOINTLY_LINEAR and tensors:
        if target in (aten.add.Tensor, aten.sub.Tensor) and len(tensors) < 2 and not _scalar_zero_other(call):
            return []  # add(P, 3.0) is not partial
        for p in (P, PAVG):
            strats.append(call.strat(p, {t.idx: p for t in tensors}))
    elif target in LINEAR_IN:
        allowed = LINEAR_IN[target]
        for pos, a in enumerate(call.args):
            if not hasattr(a, "idx") or (allowed is not None and pos not in allowed):
                continue
            if sum(1 for t in tensors if t.idx == a.idx) > 1:  # x * x is not linear in x
                continue
            for p in (P, PAVG):
                strats.append(call.strat(p, {t.idx: (p if t.idx == a.idx else R) for t in tensors}))
    return strats


def _scalar_zero_other(call: OpCall) -> bool:
    return any(isinstance(a, (int, float)) and a == 0 for a in call.args[1:])


@register(aten.alias, aten._to_copy, aten.clone, aten.detach, aten.lift_fresh_copy, aten.copy,
          aten.alias_copy, aten.detach_copy)
@register_fallback(torch.Tag.pointwise)
@stridable
def pointwise_rule(call: OpCall) -> list:
    if call.out is None or call.multi:
        return []
    return _shard_strats(call) + _partial_strats(call)


@register(aten.where.self)
@stridable
def where_rule(call: OpCall) -> list:
    """where(c, a, b) is linear in (a, b) jointly when both are partial (or literal zero) and c replicated."""
    strats = _shard_strats(call)
    cond = call.args[0]
    values = [a for a in call.args[1:3] if hasattr(a, "idx")]
    literal_ok = all(hasattr(a, "idx") or (isinstance(a, (int, float)) and a == 0) for a in call.args[1:3])
    if values and literal_ok:
        for p in (P, PAVG):
            ins = {v.idx: p for v in values}
            if hasattr(cond, "idx"):
                ins.setdefault(cond.idx, R)
            strats.append(call.strat(p, ins))
    return strats
