"""repeat, topk/sort, and constants held by the graph (get_attr nodes).

repeat(x, repeats) tiles x: a dim repeated once keeps its shards (output dim = input dim + the number
of new leading dims); a tiled dim would interleave shards, so it stays whole. Tiling is linear, so
Partial passes through. topk and sort (MoE routing) treat every dim but `dim` independently: values
and indices shard alike there. A graph constant (alibi slopes, a position table folded in by export) lives
whole on every rank: Replicate is its only placement, and a consumer that wants a shard slices it
locally for free.
"""
from __future__ import annotations

import torch

from autopar.placement import PAVG, P, S
from autopar.sharding.rules.registry import OpCall, normalize_dim, register, register_fallback

aten = torch.ops.aten


@register(aten.repeat)
def repeat_rule(call: OpCall) -> list:
    x, repeats = call.args[0], call.args[1]
    off = len(repeats) - x.ndim
    strats = [call.strat(S(d + off), {x.idx: S(d)}) for d in range(x.ndim)
              if x.shape[d] > 1 and repeats[d + off] == 1]
    return strats + [call.strat(p, {x.idx: p}) for p in (P, PAVG)]


@register(aten.topk, aten.sort)
def topk_rule(call: OpCall) -> list:
    """topk(x, k, dim=-1) / sort(x, dim=-1): shard any other dim; both outputs follow."""
    x = call.args[0]
    pos = 2 if call.target.overloadpacket is aten.topk else 1
    dim = normalize_dim(call.args[pos] if len(call.args) > pos else call.kwargs.get("dim", -1), x.ndim)
    return [call.strat((S(d), S(d)), {x.idx: S(d)}) for d in range(x.ndim) if d != dim and x.shape[d] > 1]


@register_fallback("get_attr")
def constant_rule(call: OpCall) -> list:
    """A get_attr constant: Replicate only (added by the enumerator); no warning, it is not an op."""
    return []
