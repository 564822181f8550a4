"""Mixture-of-experts: the strategies of autopar's grouped matmul ops, expert parallelism included.

The ops are `autopar/capture/moe_ops.py`; how transformers' experts are captured into them is
`autopar/capture/moe_rewrite.py`; the run-time routing of expert parallelism is
`passes/moe_dispatch.py`.

Strategies of grouped_mm(x [S, K], w [E, K, N], offs [E]) on one mesh axis, besides Replicate:
    tp column   w S(2)            -> out S(1)      (experts split on their intermediate dim)
    tp row      x S(1), w S(1)    -> out Partial
    rows        x S(0), w R       -> out S(0)      (data parallel: my rows, all experts)
    ep          x S(0), w S(0)    -> out S(0)      (expert parallel)
and of grouped_mm_wgrad(x [S, K], g [S, N], offs) -> [E, K, N]: tp column (g S(1) -> S(2)), tp row
(x S(1) -> S(1)), rows (x, g S(0) -> Partial) and ep (x, g S(0) -> S(0)).
Under `ep` a rank holds an equal chunk of the expert-sorted rows and the experts [e0, e1) of the
axis; the lowering (passes/lower_collectives.py) sends each row to the rank holding its expert and
brings the results back with two all_to_all_single calls whose split sizes come from `offs` at run
time (the per-rank program runs eagerly). `in_op_collectives` prices them: under uniform routing an
expert range starts, in expectation, exactly where an equal chunk does, so the rows that move are
the boundary misfit, |Binomial(S, q/n) - qS/n| at each of the two ends: E ~ sqrt(2/pi) sqrt(S/4)
rows per end (p(1-p) <= 1/4), capped by the chunk. The bulk of the token dispatch is the model's own
sort + gather (index by `perm`), which the planner prices as a reshard of the hidden states.
`force_experts(mode)` restricts these strategies to compare plans: "replicate" (Replicate or rows),
"tp" or "ep" (only those: Replicate too is ruled out where they divide).
"""
from __future__ import annotations

import contextlib
import contextvars
import math

import torch
import torch.fx as fx

from autopar.capture.moe_ops import GROUPED_MM, GROUPED_MM_WGRAD
from autopar.graph import VAL
from autopar.placement import P, S, is_shard
from autopar.planning.reshard import Step
from autopar.sharding.rules.registry import OpCall, register, register_in_op_collectives

aten = torch.ops.aten

MODES = ("auto", "replicate", "tp", "ep")
_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("autopar_experts_mode", default="auto")


@contextlib.contextmanager
def force_experts(mode: str):
    """Within the block, plans split grouped-matmul experts only as `mode` says: "replicate" (weights
    whole; tokens may still be split by rows), "tp" (intermediate dim), "ep" (expert dim), "auto".
    Used to price the alternatives the solver weighs (tests, benchmarks); plans made inside keep it."""
    if mode not in MODES:
        raise ValueError(f"experts mode must be one of {MODES}, got {mode!r}")
    token = _MODE.set(mode)
    try:
        yield
    finally:
        _MODE.reset(token)


class Exclusive(list):
    """Strategies that replace Replicate too (StrategyEnumerator): a forced "tp" or "ep" layout."""
    exclusive = True


def _forced(strats: list) -> list:
    return Exclusive(strats) if _MODE.get() in ("tp", "ep") else strats


@register(GROUPED_MM)
def grouped_mm_rule(call: OpCall) -> list:
    x, w, offs = call.args[:3]
    mode, out = _MODE.get(), []
    if mode in ("auto", "tp"):
        out += [call.strat(S(1), {w.idx: S(2)}), call.strat(P, {x.idx: S(1), w.idx: S(1)})]
    if mode in ("auto", "replicate"):
        out.append(call.strat(S(0), {x.idx: S(0)}))
    if mode in ("auto", "ep"):
        out.append(call.strat(S(0), {x.idx: S(0), w.idx: S(0)}))
    return _forced(out)


@register(GROUPED_MM_WGRAD)
def grouped_mm_wgrad_rule(call: OpCall) -> list:
    x, g, offs = call.args[:3]
    mode, out = _MODE.get(), []
    if mode in ("auto", "tp"):
        out += [call.strat(S(2), {g.idx: S(1)}), call.strat(S(1), {x.idx: S(1)})]
    if mode in ("auto", "replicate"):
        out.append(call.strat(P, {x.idx: S(0), g.idx: S(0)}))
    if mode in ("auto", "ep"):
        out.append(call.strat(S(0), {x.idx: S(0), g.idx: S(0)}))
    return _forced(out)


@register(aten.histc)
def histc_rule(call: OpCall) -> list:
    """histc counts elements (tokens per expert in MoE routing): any split of the input sums."""
    x = call.args[0]
    return [call.strat(P, {x.idx: S(d)}) for d in range(x.ndim) if x.shape[d] > 1]


def ep_axes(target, ins: tuple, outs: tuple) -> list[int]:
    """Mesh axes on which a grouped-matmul strategy is expert parallel (rows and experts split)."""
    if target is GROUPED_MM:
        return [a for a, (p, q) in enumerate(zip(ins[0], ins[1])) if is_shard(p, 0) and is_shard(q, 0)]
    return [a for a, o in enumerate(outs[0]) if is_shard(o, 0)]


def expected_misrouted_rows(num_rows: int, local_rows: int) -> float:
    """Rows of an equal chunk of the expert-sorted rows that belong to another rank's experts, in
    expectation under uniform routing: two boundaries, each E|Binomial - mean| <= sqrt(2/pi) sqrt(S/4)."""
    return min(float(local_rows), 2.0 * math.sqrt(2.0 / math.pi) * math.sqrt(num_rows / 4.0))


def _in_op_steps(node: fx.Node, strategy, axis_sizes: tuple) -> list[Step]:
    """The all_to_all pairs an expert-parallel grouped matmul runs: dispatch + combine (forward op)
    or dispatch of x and g (weight gradient). B is the local buffer of the formula ((n-1)/n moves)."""
    steps = []
    for a in ep_axes(node.target, strategy.ins, strategy.outs):
        n = axis_sizes[a]
        if n == 1:
            continue
        vals = [i.meta[VAL] for i in node.all_input_nodes[:2]]
        num_rows = vals[0].shape[0]
        local_rows = num_rows // math.prod(m for p, m in zip(strategy.ins[0], axis_sizes) if is_shard(p, 0))
        moved = expected_misrouted_rows(num_rows, local_rows) * n / (n - 1)
        if node.target is GROUPED_MM:
            out = node.meta[VAL]
            widths = [vals[0].shape[1] * vals[0].element_size(), out.shape[1] * out.element_size()]
        else:
            widths = [v.shape[1] * v.element_size() for v in vals]
        steps += [Step("all_to_all", a, moved * width) for width in widths]
    return steps


register_in_op_collectives((GROUPED_MM, GROUPED_MM_WGRAD), _in_op_steps)
