"""Convolution forward and backward: split the batch, the output channels or the input channels.

For y = conv(x, w) + b with x (N, C_in, *spatial), w (C_out, C_in / groups, *kernel), b (C_out):
  batch:           x S0, w R,  b R   -> y S0
  output channels: x R,  w S0, b S0  -> y S1
  input channels:  x S1, w S1, b P   -> y P   (a contraction split, like a row-parallel linear)
  linear in x:     x P,  w R,  b P   -> y P   (and Partial("avg") with b replicated)
Channel splits need groups == 1 and a non-transposed conv (a transposed weight is (C_in, C_out, ...)).
Spatial splits would need halo exchange and are not offered.

convolution_backward(g, x, w, bias_sizes, ..., output_mask) -> (grad_x, grad_w, grad_b) mirrors them:
  batch:           g S0, x S0, w R  -> (S0, P, P)
  output channels: g S1, x R,  w S0 -> (P, S0, S0)
  input channels:  g R,  x S1, w S1 -> (S1, S1, R)
  linear in g:     g P,  x R,  w R  -> (P, P, P)
`bias_sizes` keeps the global C_out under an output-channel split: the CPU and CUDA kernels size
grad_b from g, only the meta kernel reads bias_sizes.
"""
from __future__ import annotations

import torch

from autopar.placement import PAVG, P, R, S
from autopar.sharding.rules.registry import OpCall, register

aten = torch.ops.aten


def _channel_splits_ok(transposed: bool, groups: int) -> bool:
    return not transposed and groups == 1


@register(aten.convolution)
def convolution_rule(call: OpCall) -> list:
    x, w, bias = call.args[0], call.args[1], call.args[2]
    transposed, groups = call.args[6], call.args[8]
    has_bias = hasattr(bias, "idx")  # bias is None or a tensor

    def ins(px, pw, pb) -> dict:
        return {x.idx: px, w.idx: pw, **({bias.idx: pb} if has_bias else {})}

    strats = [call.strat(S(0), ins(S(0), R, R)),
              call.strat(P, ins(P, R, P)),
              call.strat(PAVG, ins(PAVG, R, R))]
    if _channel_splits_ok(transposed, groups):
        strats.append(call.strat(S(1), ins(R, S(0), S(0))))
        strats.append(call.strat(P, ins(S(1), S(1), P)))
    return strats


@register(aten.convolution_backward)
def convolution_backward_rule(call: OpCall) -> list:
    g, x, w = call.args[0], call.args[1], call.args[2]
    transposed, groups = call.args[7], call.args[9]

    def strat(outs, pg, px, pw):
        return call.strat(outs, {g.idx: pg, x.idx: px, w.idx: pw})

    strats = [strat((S(0), P, P), S(0), S(0), R),
              strat((P, P, P), P, R, R),
              strat((PAVG, PAVG, PAVG), PAVG, R, R)]
    if _channel_splits_ok(transposed, groups):
        strats.append(strat((P, S(0), S(0)), S(1), R, S(0)))
        strats.append(strat((S(1), S(1), R), R, S(1), S(1)))
    return strats
