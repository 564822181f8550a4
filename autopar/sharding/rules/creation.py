"""Tensor factories: a constant can be made directly as any shard; zeros also as a Partial.

`full(size, c)` sharded makes its local shard (the localize pass rewrites `size`). Every rank holding
c is also Partial("avg") of c; every rank holding 0 is Partial("sum") of 0.
"""
from __future__ import annotations

import torch

from autopar.placement import PAVG, P, R, S
from autopar.sharding.rules.registry import OpCall, register

aten = torch.ops.aten


def _constant_partials(call: OpCall, value, ins=None) -> list:
    strats = [call.strat(PAVG, ins or {})]
    if value == 0:
        strats.append(call.strat(P, ins or {}))
    return strats


@register(aten.full, aten.zeros, aten.ones, aten.empty, aten.new_zeros, aten.new_ones, aten.new_full,
          aten.new_empty, aten.empty_permuted, aten.empty_strided)
def full_rule(call: OpCall) -> list:
    packet = call.target.overloadpacket
    value = {aten.full: call.args[1] if len(call.args) > 1 else None, aten.new_full: call.args[2]
             if len(call.args) > 2 else None, aten.ones: 1, aten.new_ones: 1}.get(packet, 0)
    src = {t.idx: R for t in call.tensor_args()}  # new_* read only the dtype/device of their input
    strats = [call.strat(S(d), src) for d in range(call.out.ndim) if call.out.shape[d] > 1]
    if not isinstance(value, (int, float)):
        return strats
    return strats + _constant_partials(call, value, src)


@register(aten.scalar_tensor)
def scalar_tensor_rule(call: OpCall) -> list:
    return _constant_partials(call, call.args[0])


@register(aten.full_like, aten.zeros_like, aten.ones_like, aten.empty_like)
def full_like_rule(call: OpCall) -> list:
    x = call.args[0]
    packet = call.target.overloadpacket
    value = {aten.full_like: call.args[1] if len(call.args) > 1 else None, aten.ones_like: 1}.get(packet, 0)
    strats = [call.strat(S(d), {x.idx: S(d)}) for d in range(x.ndim) if x.shape[d] > 1]
    if isinstance(value, (int, float)):
        strats += _constant_partials(call, value, {x.idx: R})
        strats += [call.strat(R, {x.idx: p}) for p in (P, PAVG)]  # only the shape of x matters
    return strats


@register(aten.arange, aten.rand, aten.randn, aten.randint, aten.bernoulli, aten.native_dropout, aten.rand_like,
          aten.randn_like)
def replicated_only_rule(call: OpCall) -> list:
    """Index ranges and random draws stay replicated: a sharded draw would not match one device."""
    return []
