"""Test helper: run one op under a 1-D strategy on n virtual ranks in one process and reassemble.

This is the executable meaning of a sharding rule: local op on local shards == shard of global op.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from autopar.placement import is_strided, pieces
from autopar.sharding.rules.localize import localize_args


def split(x: torch.Tensor, p, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    if isinstance(p, Replicate):
        return [x.clone() for _ in range(n)]
    if is_strided(p):  # k pieces, each chunked over the ranks: rank r holds [piece0_r; piece1_r; ...]
        chunks = [piece.chunk(n, dim=p.dim) for piece in x.chunk(pieces(p), dim=p.dim)]
        return [torch.cat([c[r] for c in chunks], dim=p.dim) for r in range(n)]
    if isinstance(p, Shard):
        return [c.clone() for c in torch.chunk(x, n, dim=p.dim)]
    x = x.detach()
    if not x.is_floating_point():  # integer sums: rank 0 holds the value, the others zeros
        return [x.clone() if r == 0 else torch.zeros_like(x) for r in range(n)]
    finite = torch.isfinite(x)
    scale = float(x[finite].abs().max()) if finite.any() else 1.0  # keep noise at the data's scale
    noise = [torch.randn(x.shape, generator=gen, dtype=x.dtype) * scale * finite for _ in range(n)]
    mean = sum(noise) / n
    noise = [z - mean for z in noise]  # zero-sum noise
    if p.reduce_op == "sum":  # non-finite entries live on rank 0 only
        return [torch.where(finite, x / n, x if r == 0 else torch.zeros_like(x)) + z for r, z in enumerate(noise)]
    if p.reduce_op == "avg":
        return [x + z for z in noise]
    raise NotImplementedError(p)


def join(locals_: list, p):
    if isinstance(p, Replicate):
        return locals_[0]
    if is_strided(p):
        chunks = [t.chunk(pieces(p), dim=p.dim) for t in locals_]  # per rank: its block of each piece
        return torch.cat([chunks[r][j] for j in range(pieces(p)) for r in range(len(locals_))], dim=p.dim)
    if isinstance(p, Shard):
        return torch.cat(locals_, dim=p.dim)
    if p.reduce_op == "sum":
        return sum(locals_)
    if p.reduce_op == "avg":
        return sum(locals_) / len(locals_)
    if p.reduce_op == "max":
        return torch.stack(locals_).amax(0)
    return torch.stack(locals_).amin(0)


def run_local(node: fx.Node, strat, values: dict, n: int, gen: torch.Generator):
    """Execute `node` under 1-D strategy `strat` (AxisStrategy) on n ranks; return global outputs."""
    inputs = node.all_input_nodes
    shards = [split(values[a], p, n, gen) if isinstance(values[a], torch.Tensor) else [values[a]] * n
              for a, p in zip(inputs, strat.ins)]
    val = node.meta["val"]
    out_shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
    out_spec = (strat.outs[0],) if out_shape is not None else None
    in0 = inputs[0] if inputs else None
    in_shape = tuple(values[in0].shape) if in0 is not None and isinstance(values[in0], torch.Tensor) else None
    in_spec = (strat.ins[0],) if in_shape is not None else None
    args = localize_args(node.target, node.args, out_shape, out_spec, in_shape, in_spec, (n,))
    outs = []
    for r in range(n):
        env = {a: shards[i][r] for i, a in enumerate(inputs)}
        a = fx.node.map_arg(args, lambda x: env[x])
        k = fx.node.map_arg(node.kwargs, lambda x: env[x])
        outs.append(node.target(*a, **k))
    if isinstance(outs[0], (tuple, list)):
        return tuple(join([o[i] for o in outs], p) if p is not None else None for i, p in enumerate(strat.outs))
    return join(outs, strat.outs[0])
