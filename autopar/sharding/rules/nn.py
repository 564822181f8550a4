"""Softmax, layer norm, attention, embedding and cumsum: shard the dims the op treats independently."""
from __future__ import annotations

import torch

from autopar.placement import PAVG, P, R, S
from autopar.sharding.rules.registry import OpCall, normalize_dim, register

aten = torch.ops.aten


def _except_dim(call: OpCall, tensors, dim: int) -> list:
    strats = []
    for d in range(call.out.ndim):
        if d != dim and call.out.shape[d] > 1 and all(t.shape[d] == call.out.shape[d] for t in tensors):
            strats.append(call.strat(S(d), {t.idx: S(d) for t in tensors}))
    return strats


@register(aten._softmax, aten._log_softmax, aten.cumsum, aten.logcumsumexp)
def softmax_rule(call: OpCall) -> list:
    x = call.args[0]
    return _except_dim(call, [x], normalize_dim(call.args[1], x.ndim))


@register(aten._softmax_backward_data, aten._log_softmax_backward_data)
def softmax_backward_rule(call: OpCall) -> list:
    g, y = call.args[0], call.args[1]
    return _except_dim(call, [g, y], normalize_dim(call.args[2], g.ndim))


@register(aten.nll_loss_backward)
def nll_loss_backward_rule(call: OpCall) -> list:
    """(grad_output, log_probs (N, C), target (N,), weight, reduction, ignore_index, total_weight): split
    the rows with their targets; the loss's gradient (a scalar, or per row without reduction), the class
    weights and the total weight (the whole batch's count) are whole on every rank."""
    g, x, target = call.args[0], call.args[1], call.args[2]
    if x.ndim != 2 or x.shape[0] == 1:
        return []
    ins = {x.idx: S(0), target.idx: S(0)}
    if g.ndim == 1:  # reduction="none": one gradient per row
        ins[g.idx] = S(0)
    return [call.strat(S(0), ins)]


@register(aten.native_layer_norm)
def layer_norm_rule(call: OpCall) -> list:
    """Shard the leading (non-normalized) dims; weight and bias stay replicated."""
    x, k = call.args[0], call.args[0].ndim - len(call.args[1])
    return [call.strat((S(d), S(d), S(d)), {x.idx: S(d)}) for d in range(k) if x.shape[d] > 1]


@register(aten.native_layer_norm_backward)
def layer_norm_backward_rule(call: OpCall) -> list:
    gout, x, mean, rstd = call.args[0], call.args[1], call.args[3], call.args[4]
    k = x.ndim - len(call.args[2])
    outs_p = tuple(P if o is not None else None for o in call.outs[1:])
    return [call.strat((S(d),) + outs_p, {gout.idx: S(d), x.idx: S(d), mean.idx: S(d), rstd.idx: S(d)})
            for d in range(k) if x.shape[d] > 1]


def _attn_shards(call: OpCall, main, extra_outs: int) -> list:
    """Batch (dim 0) and head (dim 1) splits of (B, H, S, D) attention tensors; masks broadcast."""
    strats = []
    q = main[0]
    for d in (0, 1):
        if q.shape[d] == 1 or any(t.shape[d] != q.shape[d] for t in main):
            continue
        ins = {t.idx: S(d) for t in main}
        for t in call.tensor_args():
            if t.idx not in ins:  # attn_mask: shard where it is not broadcast
                ins[t.idx] = S(d) if t.ndim == 4 and t.shape[d] == q.shape[d] else R
        strats.append(call.strat(tuple(_attn_out(o, j <= extra_outs, d, q.shape[d]) for j, o in enumerate(call.outs)),
                                 ins))
    return strats


def _attn_out(o, main: bool, d: int, n: int):
    """An attention output's placement under a split of dim d (size n): the main outputs (out, logsumexp,
    the input gradients) split with it; the CUDA kernels' other tensors are a bias gradient (split where
    the bias is, else a partial sum over the split) or small RNG state (philox seed and offset: replicated)."""
    if o is None:
        return None
    if main:
        return S(d) if o.ndim > d else R
    if o.ndim == 4:
        return S(d) if o.shape[d] == n else P
    return R


@register(aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention,
          aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention)
def sdpa_rule(call: OpCall) -> list:
    """CPU flash, and the CUDA flash, memory-efficient and cuDNN kernels: (q, k, v[, bias]) -> (out, lse, ...)."""
    q, k, v = call.args[:3]
    return _attn_shards(call, [q, k, v], extra_outs=1)


@register(aten._scaled_dot_product_flash_attention_for_cpu_backward, aten._scaled_dot_product_flash_attention_backward,
          aten._scaled_dot_product_cudnn_attention_backward)
def sdpa_backward_rule(call: OpCall) -> list:
    """(grad_out, q, k, v, out, logsumexp, ...) -> (grad_q, grad_k, grad_v)."""
    g, q, k, v, out, lse = call.args[:6]
    return _attn_shards(call, [g, q, k, v, out, lse], extra_outs=2)


@register(aten._scaled_dot_product_efficient_attention_backward)
def sdpa_efficient_backward_rule(call: OpCall) -> list:
    """CUDA memory-efficient attention: (grad_out, q, k, v, attn_bias?, out, logsumexp, ...); its logsumexp is
    padded along the sequence (a multiple of 32), which a batch or head split leaves alone."""
    a = call.args
    return _attn_shards(call, [a[0], a[1], a[2], a[3], a[5], a[6]], extra_outs=2)


@register(aten.embedding)
def embedding_rule(call: OpCall) -> list:
    """Lookup rows of weight (V, H): split the indices (batch) or the hidden dim of the table."""
    w, idx = call.args[0], call.args[1]
    strats = [call.strat(S(d), {w.idx: R, idx.idx: S(d)}) for d in range(idx.ndim) if idx.shape[d] > 1]
    if w.shape[1] > 1:
        strats.append(call.strat(S(call.out.ndim - 1), {w.idx: S(1), idx.idx: R}))
    return strats


@register(aten.embedding_dense_backward)
def embedding_backward_rule(call: OpCall) -> list:
    g, idx = call.args[0], call.args[1]
    strats = [call.strat(P, {g.idx: S(d), idx.idx: S(d)}) for d in range(idx.ndim) if idx.shape[d] > 1]
    strats.append(call.strat(S(1), {g.idx: S(g.ndim - 1), idx.idx: R}))
    strats += [call.strat(p, {g.idx: p, idx.idx: R}) for p in (P, PAVG)]
    return strats
