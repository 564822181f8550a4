"""Reductions: kept dims shard through; a sharded reduced dim leaves a Partial (sum, avg, max, min)."""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial

from autopar.placement import PAVG, P, S
from autopar.sharding.rules.registry import OpCall, normalize_dim, register
from autopar.sharding.rules.strided import stridable

aten = torch.ops.aten

PARTIAL_OF = {aten.sum: P, aten.mean: PAVG, aten.amax: Partial("max"), aten.amin: Partial("min")}
LINEAR = {aten.sum, aten.mean}


def _reduced_dims(call: OpCall) -> tuple[list[int], bool]:
    x = call.args[0]
    dims = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(x.ndim)), False
    dims = [dims] if isinstance(dims, int) else list(dims)
    keep = bool(call.args[2]) if len(call.args) > 2 else bool(call.kwargs.get("keepdim", False))
    return sorted(normalize_dim(d, x.ndim) for d in dims), keep


@register(aten.sum, aten.mean, aten.amax, aten.amin, aten.any, aten.all, aten.prod, aten.argmax, aten.argmin)
@stridable
def reduction_rule(call: OpCall) -> list:
    x = call.args[0]
    if not hasattr(x, "idx"):
        return []
    packet = call.target.overloadpacket
    dims, keep = _reduced_dims(call)
    strats = []
    for d in range(x.ndim):
        if x.shape[d] == 1:
            continue
        if d in dims:
            if packet in PARTIAL_OF:
                strats.append(call.strat(PARTIAL_OF[packet], {x.idx: S(d)}))
        else:
            od = d if keep else d - sum(1 for r in dims if r < d)
            strats.append(call.strat(S(od), {x.idx: S(d)}))
    if packet in LINEAR:
        strats += [call.strat(p, {x.idx: p}) for p in (P, PAVG)]
    return strats
