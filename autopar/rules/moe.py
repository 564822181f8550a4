"""Mixture-of-experts: a traceable grouped matmul and its strategies, expert parallelism included.

Capture route. transformers' Mixtral keeps its experts as 3-D weights (gate_up_proj [E, 2I, H],
down_proj [E, H, I]) and offers three experts implementations: "eager" loops over the experts hit
(data-dependent `nonzero`: export guards fail), "batched_mm" gathers a whole [2I, H] weight per
token (captures, but its backward materializes S x 2I x H gradients: 3.8 TB per layer at 8x7B
size, and nothing to shard by expert), and "grouped_mm", which sorts the S = tokens x top_k rows by
expert and runs one grouped matmul over contiguous row groups (`offs` = cumulative rows per expert).
autopar captures "grouped_mm". On CPU and in float32 transformers calls its custom op
`transformers::grouped_mm_fallback` (aten._grouped_mm's fake kernel accepts bf16 only); neither its
autograd registration nor any Python autograd.Function survives the joint trace (functorch's grad
inside functionalize: "NYI: Functionalize rule for custom_function_call"). So `use_traceable_experts`
swaps that node of the exported graph for `standin`, mm(x, w.sum(0)): same shapes, a backward torch
knows (an mm for grad x, a broadcast mm(x.T, g) for grad w); after the joint trace `fuse_grouped_mm`
replaces those three matmuls by autopar's custom ops `autopar::grouped_mm` (forward and grad x) and
`autopar::grouped_mm_wgrad` (grad w), with the original `offs`. The model is not modified.

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
from torch.utils.flop_counter import register_flop_formula

from autopar._torch_compat import FakeTensor
from autopar.placement import P, S, is_shard
from autopar.reshard import Step
from autopar.rules import OpCall, register, register_in_op_collectives

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


# ---------------------------------------------------------------- the ops

@torch.library.custom_op("autopar::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out[rows of group i] = x[rows of group i] @ w[i]; rows past offs[-1] are zero."""
    out = x.new_zeros(x.shape[0], w.shape[2])
    start = 0
    for i, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(x[start:end], w[i], out=out[start:end])
        start = max(start, end)
    return out


@_grouped_mm_op.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("autopar::grouped_mm_wgrad", mutates_args=())
def _grouped_mm_wgrad_op(x: torch.Tensor, g: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Weight gradient of grouped_mm: out[i] = x[rows of i].T @ g[rows of i], shape [E, K, N]."""
    out = x.new_zeros(offs.shape[0], x.shape[1], g.shape[1])
    start = 0
    for i, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(x[start:end].T, g[start:end], out=out[i])
        start = max(start, end)
    return out


@_grouped_mm_wgrad_op.register_fake
def _(x, g, offs):
    return x.new_empty(offs.shape[0], x.shape[1], g.shape[1])


GROUPED_MM = torch.ops.autopar.grouped_mm.default
GROUPED_MM_WGRAD = torch.ops.autopar.grouped_mm_wgrad.default


def standin(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """What the joint trace differentiates in place of a grouped matmul: mm(x, w.sum(0)) has the same
    shapes and a backward of the same structure (mm for grad x, broadcast of mm(x.T, g) for grad w);
    `fuse_grouped_mm` then swaps the three matmuls for the grouped ones. `offs` rides along in a
    zero-valued term so the fused nodes can find it."""
    return torch.mm(x, w.sum(0)) + (offs[-1] * 0).to(x.dtype)


def use_traceable_experts(gm: fx.GraphModule) -> int:
    """Retarget transformers' CPU grouped-matmul custom op in an exported graph to `standin` (same
    arguments; `fuse_grouped_mm` restores the maths after the joint trace) and make histc count
    floats; returns how many grouped matmuls changed."""
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is None:
        return 0
    changed = 0
    for node in gm.graph.nodes:
        counted = node.args[0].meta.get("val") if node.target is torch.ops.aten.histc.default else None
        if counted is not None and not counted.is_floating_point():  # a meta-device export takes
            with gm.graph.inserting_before(node):                 # transformers' CUDA branch (no CPU kernel)
                as_float = gm.graph.call_function(torch.ops.aten._to_copy.default, (node.args[0],),
                                                  {"dtype": torch.float32})
            node.args = (as_float, *node.args[1:])
        if node.op == "call_function" and node.target in (fallback, getattr(fallback, "default", None)):
            x, w = node.args[:2]
            offs = node.args[2] if len(node.args) > 2 else node.kwargs["offs"]
            node.target, node.args, node.kwargs = standin, (x, w, offs), {}
            changed += 1
    return changed


aten = torch.ops.aten


def fuse_grouped_mm(gm: fx.GraphModule) -> int:
    """In a joint graph traced through `standin`, swap mm(x, w.sum(0)) and its two backward matmuls
    for grouped_mm / grouped_mm_wgrad on the 3-D weight; returns how many stand-ins were fused."""
    fused = 0
    for node in list(gm.graph.nodes):
        if node.target is aten.sum.dim_IntList and list(node.args[1]) == [0] and node.args[0].meta["val"].ndim == 3:
            fwd = [u for u in node.users if u.target is aten.mm.default and u.args[1] is node]
            if len(fwd) == 1 and _fuse_one(gm, node.args[0], node, fwd[0]):
                fused += 1
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return fused


def _fuse_one(gm: fx.GraphModule, w: fx.Node, summed: fx.Node, fwd: fx.Node) -> bool:
    marker = next((u for u in fwd.users if u.target is aten.add.Tensor), None)
    offs = _offs_of(marker.args[1]) if marker is not None else None
    if offs is None:
        return False
    x = fwd.args[0]
    _replace(gm, marker, GROUPED_MM, (x, w, offs))
    for t in [u for u in summed.users if u.target is aten.permute.default]:
        for grad_x in [u for u in t.users if u.target is aten.mm.default and u.args[1] is t]:
            with gm.graph.inserting_before(grad_x):
                wt = gm.graph.call_function(aten.permute.default, (w, [0, 2, 1]))
            wt.meta.update(grad_x.meta, val=w.meta["val"].permute(0, 2, 1))
            _replace(gm, grad_x, GROUPED_MM, (grad_x.args[0], wt, offs))
    for xt in [u for u in x.users if u.target is aten.permute.default]:
        for grad_w0 in [u for u in xt.users if u.target is aten.mm.default and u.args[0] is xt]:
            grad_w = _broadcast_over_experts(grad_w0, w.meta["val"].shape)
            if grad_w is not None:
                _replace(gm, grad_w, GROUPED_MM_WGRAD, (x, grad_w0.args[1], offs))
    return True


def _offs_of(n: fx.Node) -> fx.Node | None:
    """The 1-D integer tensor the stand-in's zero term `(offs[-1] * 0).to(dtype)` was made from."""
    while isinstance(n, fx.Node) and n.all_input_nodes:
        n = n.all_input_nodes[0]
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.ndim == 1 and not val.is_floating_point():
            return n
    return None


def _broadcast_over_experts(n: fx.Node, shape) -> fx.Node | None:
    """The node that expands grad(w.sum(0)) back to the [E, K, N] weight (sum's backward)."""
    while len(n.users) == 1:
        n = next(iter(n.users))
        if tuple(n.meta["val"].shape) == tuple(shape):
            return n
    return None


def _replace(gm: fx.GraphModule, old: fx.Node, target, args: tuple) -> None:
    with gm.graph.inserting_before(old):
        new = gm.graph.call_function(target, args)
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    with vals[0].fake_mode:
        val = target(*vals)
    new.meta.update(old.meta, val=val)
    old.replace_all_uses_with(new)
    gm.graph.erase_node(old)


@register_flop_formula(torch.ops.autopar.grouped_mm)
def _grouped_mm_flops(x_shape, w_shape, offs_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * w_shape[2]


@register_flop_formula(torch.ops.autopar.grouped_mm_wgrad)
def _grouped_mm_wgrad_flops(x_shape, g_shape, offs_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * g_shape[1]


# ---------------------------------------------------------------- run time (per-rank programs)

def local_offsets(offs: torch.Tensor, lo, hi, e0: int, e1: int) -> torch.Tensor:
    """Offsets of experts [e0, e1) within the global sorted rows [lo, hi) held locally."""
    return (offs[e0:e1].clamp(lo, hi) - lo).to(offs.dtype)


def ep_dispatch(offs: torch.Tensor, members: list, me: int) -> tuple[list, list, torch.Tensor]:
    """Split sizes of the expert-dispatch all_to_all and the offsets of the rows received.

    members[q] = ((lo, hi) sorted rows held by rank q of the axis, (e0, e1) its experts). Rank q's
    experts own the sorted rows [start_q, end_q); I send it my rows there, and receive from each rank,
    in rank order, its rows among mine: ascending rows, so still grouped by expert."""
    (my_lo, my_hi), (e0, e1) = members[me]
    if isinstance(offs, FakeTensor):  # shape propagation (verify): no data, pretend every row is home
        send = recv = [my_hi - my_lo if q == me else 0 for q in range(len(members))]
        return send, recv, local_offsets(offs, my_lo, my_hi, e0, e1)
    bounds = [0, *offs.tolist()]

    def overlap(a: tuple, b: tuple) -> int:
        return max(0, min(a[1], b[1]) - max(a[0], b[0]))

    expert_rows = [(bounds[q_e0], bounds[q_e1]) for _, (q_e0, q_e1) in members]
    send = [overlap((my_lo, my_hi), rows) for rows in expert_rows]
    recv = [overlap(q_rows, expert_rows[me]) for q_rows, _ in members]
    received = [sum(overlap(q_rows, (bounds[e0], bounds[e + 1])) for q_rows, _ in members) for e in range(e0, e1)]
    return send, recv, torch.tensor(received, dtype=offs.dtype, device=offs.device)


# ---------------------------------------------------------------- strategies

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
        vals = [i.meta["val"] for i in node.all_input_nodes[:2]]
        num_rows = vals[0].shape[0]
        local_rows = num_rows // math.prod(m for p, m in zip(strategy.ins[0], axis_sizes) if is_shard(p, 0))
        moved = expected_misrouted_rows(num_rows, local_rows) * n / (n - 1)
        if node.target is GROUPED_MM:
            out = node.meta["val"]
            widths = [vals[0].shape[1] * vals[0].element_size(), out.shape[1] * out.element_size()]
        else:
            widths = [v.shape[1] * v.element_size() for v in vals]
        steps += [Step("all_to_all", a, moved * width) for width in widths]
    return steps


register_in_op_collectives((GROUPED_MM, GROUPED_MM_WGRAD), _in_op_steps)
