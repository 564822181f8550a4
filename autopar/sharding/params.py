"""Strategies of graph inputs: how each parameter, buffer and user input is stored and used.

A parameter's strategy, per mesh axis, is one of four modes:
    dp      use R,    master R,    gradient all-reduced to R           (data parallel)
    zero1   use R,    master S(d), full gradient held, reduce-scattered (ZeRO-1: optimizer state 1/n)
    zero2   use R,    master S(d), gradient reduce-scattered as made    (ZeRO-2: + gradients 1/n)
    shard   use S(d), master S(d), gradient local S(d)                  (tensor parallel, or ZeRO-3
            when its consumers need R and gather it at each use); also a strided SS(d, k) where the
            graph splits a dim of that size into k equal pieces (a fused qkv weight)
`master` is what the optimizer steps on (a DTensor parameter on the runtime mesh); `use` is what the
graph reads. zero1/zero2 gather the master once per step (all_gather, forward phase).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from autopar.placement import SS, R, S, divides, local_fraction
from autopar.sharding.strategies import NodeStrategy

MODES = ("dp", "zero1", "zero2", "shard")


@dataclass(frozen=True)
class ParamStrategy(NodeStrategy):
    master: tuple = ()      # spec of the stored parameter (and its optimizer state)
    grad_hold: tuple = ()   # spec of the gradient while it is accumulated
    modes: tuple = ()       # per axis: dp | zero1 | zero2 | shard

    def __str__(self) -> str:
        from autopar.placement import spec_str
        return f"{'/'.join(self.modes)} use{spec_str(self.outs[0])} master{spec_str(self.master)}"


def zero_dim(shape: tuple[int, ...], n: int) -> int | None:
    """The dim ZeRO shards a parameter along: the first that divides by n (dim 0 if it can)."""
    for d, size in enumerate(shape):
        if size % n == 0 and size >= n:
            return d
    return None


def _axis_options(shape, n: int, trainable: bool,
                  split_factors=frozenset()) -> list[tuple[str, object, object, object]]:
    """(mode, use, master, grad_hold) choices on one axis of size n; `split_factors` ((size, k) pairs,
    autopar/sharding/rules/strided.py) add strided shards of dims of that size (a fused [q; k; v] weight)."""
    opts = [("dp", R, R, R)]
    if n == 1:
        return opts
    dz = zero_dim(shape, n)
    if trainable and dz is not None:
        opts += [("zero1", R, S(dz), R), ("zero2", R, S(dz), S(dz))]
    opts += [("shard", S(d), S(d), S(d)) for d in range(len(shape)) if shape[d] % n == 0 and shape[d] >= n]
    opts += [("shard", SS(d, k), SS(d, k), SS(d, k)) for d in range(len(shape)) for size, k in sorted(split_factors)
             if shape[d] == size and size % (k * n) == 0]
    return opts


def param_strategies(shape: tuple[int, ...], axis_sizes: tuple[int, ...], trainable: bool,
                     split_factors=frozenset()) -> list[ParamStrategy]:
    per_axis = [_axis_options(shape, n, trainable, split_factors) for n in axis_sizes]
    out = []
    for combo in itertools.product(*per_axis):
        use = tuple(c[1] for c in combo)
        master = tuple(c[2] for c in combo)
        hold = tuple(c[3] for c in combo)
        if not (divides(use, shape, axis_sizes) and divides(master, shape, axis_sizes)):
            continue
        out.append(ParamStrategy(outs=(use,), ins=(), master=master, grad_hold=hold,
                                 modes=tuple(c[0] for c in combo)))
    return out


def param_memory(strat: ParamStrategy, nbytes: float, numel: int, axis_sizes, opt_bytes_per_elem: float,
                 trainable: bool) -> dict[str, float]:
    """Bytes per device by category for one parameter under `strat`."""
    master = nbytes * local_fraction(strat.master, axis_sizes)
    use = nbytes * local_fraction(strat.outs[0], axis_sizes)
    gathered = use if strat.outs[0] != strat.master else 0.0  # zero1/2: the step's gathered copy
    if not trainable:
        return {"params": master, "gathered_params": gathered, "grads": 0.0, "optimizer": 0.0}
    grads = nbytes * local_fraction(strat.grad_hold, axis_sizes)
    optimizer = numel * opt_bytes_per_elem * local_fraction(strat.master, axis_sizes)
    return {"params": master, "gathered_params": gathered, "grads": grads, "optimizer": optimizer}


def input_strategies(shape: tuple[int, ...], axis_sizes: tuple[int, ...]) -> list[NodeStrategy]:
    """Buffers and user inputs: replicated, or sharded along any dim that divides."""
    per_axis = [[R] + [S(d) for d in range(len(shape)) if shape[d] % n == 0 and shape[d] >= n and n > 1]
                for n in axis_sizes]
    return [NodeStrategy(outs=(spec,), ins=()) for spec in itertools.product(*per_axis)
            if divides(spec, shape, axis_sizes)]
