"""The CUDA-only attention kernels and CUDA autocast, checked on a machine without a GPU.

A CUDA model's capture records the kernel SDPA picks there (flash, memory-efficient or cuDNN
attention), whose signatures differ from the CPU flash kernel's: the memory-efficient backward takes
an optional bias before `out`, and the forwards return RNG state (philox seed and offset) beside the
output. Their rules are checked here on meta tensors (the kernels need a GPU to run; the numerics are
checked on one by `benchmarks/gpu_check.py`). A GPU run found both failures below.
"""
from __future__ import annotations

import warnings

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.capture.precision import MixedPrecision, autocast_forward
from autopar.capture.trace import _device_type
from autopar.placement import R, S
from autopar.sharding.strategies import StrategyEnumerator

aten = torch.ops.aten
B, H, T, D = 2, 4, 64, 16


def _attention_step(q, k, v, g):
    out = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)
    grads = aten._scaled_dot_product_efficient_attention_backward(
        g, q, k, v, None, out[0], out[1], out[2], out[3], 0.0, [True, True, True, False], True)
    cudnn = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True)
    return out[0], grads[0], grads[1], grads[2], cudnn[0]


def _strategies(target) -> list:
    args = [torch.empty(B, H, T, D, device="meta") for _ in range(4)]
    gm = make_fx(_attention_step)(*args)
    node = next(n for n in gm.graph.nodes if n.target is target)
    return StrategyEnumerator((2,))(node)


def test_efficient_attention_backward_splits_batch_and_heads():
    """Inputs (grad_out, q, k, v, out, logsumexp) split together on the batch or the heads; the bias slot
    (None here) is skipped, the three input gradients split alike and the absent bias gradient has none."""
    strats = _strategies(aten._scaled_dot_product_efficient_attention_backward.default)
    split = {s.ins[0][0] for s in strats if s.ins[0][0] != R}
    assert split == {S(0), S(1)}
    for s in strats:
        assert str(s)  # every output's spec prints (a None inside a spec crashed the plan table)
        if s.ins[0][0] != R:
            assert len(set(s.ins[:6])) == 1 and set(s.ins[6:]) == {(R,)}  # philox seed and offset replicated
            assert s.outs[:3] == (s.ins[0],) * 3 and s.outs[3] is None


def test_cuda_attention_forwards_replicate_their_rng_state():
    for target in (aten._scaled_dot_product_efficient_attention.default,
                   aten._scaled_dot_product_cudnn_attention.default):
        strats = _strategies(target)
        sharded = [s for s in strats if s.ins[0][0] != R]
        assert {s.ins[0][0] for s in sharded} == {S(0), S(1)}, target
        for s in sharded:
            assert str(s)
            out, lse = s.outs[:2]
            assert out == lse == s.ins[0]  # output and logsumexp split with the inputs
            assert all(o == (R,) for o in s.outs[2:] if o is not None)  # philox seed/offset, debug mask


def test_autocast_follows_the_traced_device():
    """Capture traces a CUDA model on fake CUDA tensors: a CPU autocast there would trace an fp32 step."""
    assert _device_type([torch.empty(1, device="meta")]) == "cpu"
    assert _device_type([3, torch.empty(1)]) == "cpu"
    with warnings.catch_warnings():  # "CUDA is not available": the context is only inspected here
        warnings.simplefilter("ignore")
        ctx = autocast_forward(MixedPrecision(param_dtype=torch.bfloat16), "cuda")
    assert ctx.device == "cuda" and ctx.fast_dtype == torch.bfloat16
