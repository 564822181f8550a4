"""Pricing a plan as the Inductor-compiled program (compile=True): the fusion model against the kernels Inductor
emits, the planner's node costs under it, and the compiled figures in profiles and plans."""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

import autopar
from autopar._testing.gpt import GPT, GPTConfig
from autopar.calibration.compiled import kernel_calls, layered_program, trace_aten
from autopar.capture.canonicalize import canonicalize
from autopar.capture.trace import capture
from autopar.costmodel import hardware
from autopar.costmodel.hardware import HardwareSpec
from autopar.errors import HardwareError, InputError
from autopar.graph import PHASE, packet
from autopar.planning.fusion import FREE_OPS, compiled_kernels, count_kernels
from autopar.planning.problem import ProblemBuilder
from autopar.runtime.compile import CompiledProgram

# a calibrated-like CPU: eager dispatch 4 µs per op, a compiled kernel 1.5 µs
HW = dataclasses.replace(hardware.CPU, name="cpu-test", op_overhead=4e-6, compiled_op_overhead=1.5e-6,
                         compiled_mem_bandwidth=15e9)


def _captured_gpt():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32)
    x = torch.randint(0, 128, (4, 32))
    captured = capture(GPT(cfg), (x, x))
    canonicalize(captured.gm)
    return captured


def test_a_pointwise_chain_between_matmuls_is_one_kernel_and_matches_inductor():
    """relu(x @ w) * 0.5 + 0.1, K times: K matmuls (extern) and K fused chains, each read once (the matmul's
    output) and written once (the next matmul's input); Inductor emits exactly those 2K kernels."""
    x, w = torch.randn(8, 8), torch.randn(8, 8) / 8
    gm = trace_aten(layered_program(8), x, w)
    kernels = compiled_kernels(gm)
    assert count_kernels(kernels) == 16
    chain = [n for n in gm.graph.nodes if n.op == "call_function" and kernels[n].role == "fused"]
    assert [packet(n).__name__ for n in chain[:3]] == ["relu", "mul", "add"]
    relu, mul, add = (kernels[n] for n in chain[:3])
    assert relu.reads == (True,) and relu.writes == (False,) and not relu.launches
    assert mul.reads == (False,) and not mul.launches
    assert add.writes == (True,) and add.launches
    # a constant new to Inductor's caches, so that it compiles (and keeps the source) rather than loads
    shift = random.random()

    def fresh(x, w):
        for _ in range(8):
            x = torch.relu(x @ w) * 0.5 + shift
        return x
    gm = trace_aten(fresh, x, w)
    assert count_kernels(compiled_kernels(gm)) == 16
    program = CompiledProgram(gm, "test")
    torch.testing.assert_close(program(x, w), fresh(x, w))
    assert kernel_calls(program.source) == 16


def test_a_gpt_joint_graph_views_are_free_and_fused_chains_cross_no_phase():
    captured = _captured_gpt()
    kernels = compiled_kernels(captured.gm)
    roles = {k.role for k in kernels.values()}
    assert roles == {"free", "extern", "fused"}
    for node, k in kernels.items():
        if packet(node) in FREE_OPS:
            assert k.role == "free" and not k.launches
        if k.role != "fused":
            continue
        for a, read in zip(node.all_input_nodes, k.reads):
            src = a
            while src.op == "call_function" and packet(src) in FREE_OPS:
                src = src.all_input_nodes[0]
            same = src in kernels and kernels[src].role == "fused" and src.meta.get(PHASE) == node.meta.get(PHASE)
            if src.op == "call_function" and src.target.__name__ != "getitem":
                assert read == (not same), (node, a)
    # fewer kernels than ops: every view and every chain interior goes
    ops = sum(1 for n in captured.gm.graph.nodes if n.op == "call_function")
    assert count_kernels(kernels) < ops / 2


def test_compiled_pricing_views_free_chains_one_pass_and_faster_than_eager():
    """Under compile=True a view costs 0 (eager: op_overhead), a chain interior pays no launch and no bytes,
    an extern op (matmul) costs its eager roofline with the compiled launch; with equal in-step scales the
    step is priced below the eager one (calibration: a kernel 1.7-3.5 µs against 7-15 µs per eager op, 2
    loaded ranks). Whether the compiled step is faster on a machine is up to its compiled in-step scale."""
    captured = _captured_gpt()
    mesh = autopar.Mesh((2,), hardware=HW)
    eager = ProblemBuilder(captured, mesh).build()
    comp = ProblemBuilder(captured, mesh.for_program(True)).build()
    kernels = compiled_kernels(captured.gm)
    for i, node in enumerate(eager.nodes):
        k = kernels.get(node)
        if k is None:
            continue
        if k.role == "free":
            assert (comp.compute[i] == 0).all() and (eager.compute[i] == HW.op_overhead).all()
        elif k.role == "fused" and not any(k.reads) and not k.launches and not any(k.writes):
            assert (comp.compute[i] <= eager.compute[i] - HW.op_overhead + 1e-15).all()
        elif k.role == "extern":
            diff = eager.compute[i] - comp.compute[i]
            assert diff == pytest.approx(np.full(len(diff), HW.op_overhead - HW.compiled_op_overhead))
    assert sum(c.min() for c in comp.compute) < sum(c.min() for c in eager.compute)


def test_plan_compile_flag_prices_and_says_it_and_round_trips():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32)
    x = torch.randint(0, 128, (4, 32))
    plans = {c: autopar.plan(GPT(cfg), (x, x), mesh=autopar.Mesh((2,), hardware=HW), strategy="dp", compile=c,
                             baselines=False) for c in (False, True)}
    assert plans[True].predicted_step_time < plans[False].predicted_step_time
    assert "; compiled program" in str(plans[True]) and "; eager program" in str(plans[False])
    again = autopar.Plan.from_json(plans[True].to_json())
    assert again.mesh.hardware.compiled and again.predicted_step_time == plans[True].predicted_step_time
    with pytest.raises(InputError, match="compile="):
        autopar.plan(GPT(cfg), (x, x), mesh=autopar.Mesh((2,), hardware=HW), compile="yes")


def test_the_compiled_in_step_scale_multiplies_compiled_ops_only():
    """calibrate's reference step run compiled (`compiled_in_step_scale`) scales a compiled plan's ops, not an
    eager plan's; unmeasured (0) a compiled plan takes the eager `in_step_scale`."""
    captured = _captured_gpt()
    scaled = dataclasses.replace(HW, in_step_scale=1.2, compiled_in_step_scale=1.8)
    unmeasured = dataclasses.replace(HW, in_step_scale=1.2)

    def total(hw, compiled):
        prob = ProblemBuilder(captured, autopar.Mesh((1,), hardware=hw).for_program(compiled)).build()
        return sum(c.min() for c, n in zip(prob.compute, prob.nodes) if n.op != "placeholder")
    assert total(scaled, True) == pytest.approx(1.8 * total(HW, True))
    assert total(scaled, False) == pytest.approx(1.2 * total(HW, False))
    assert total(unmeasured, True) == pytest.approx(1.2 * total(HW, True))
    assert scaled.for_program(True).step_scale == 1.8 and scaled.step_scale == 1.2


def test_compiled_figures_round_trip_are_validated_and_fall_back():
    spec = HardwareSpec.from_json(HW.for_program(True).to_json())
    assert spec == HW.for_program(True) and spec.compiled and spec.kernel_overhead == 1.5e-6
    assert HW.kernel_overhead == 4e-6   # eager pricing: the dispatch overhead
    assert "compiled" not in hardware.H200.to_json()   # unset: profiles written before keep their fingerprints
    assert hardware.H200.for_program(True).kernel_overhead == hardware.H200.op_overhead   # unmeasured: eager's
    assert hardware.H200.for_program(True).fused_bandwidth == hardware.H200.mem_bandwidth
    assert hardware.H200.for_program(False) is hardware.H200
    for field, bad in (("compiled_op_overhead", -1.0), ("compiled_mem_bandwidth", -1.0), ("compiled", "yes"),
                       ("compiled_in_step_scale", -1.0)):
        data = HW.to_json()
        data[field] = bad
        with pytest.raises(HardwareError, match=field):
            HardwareSpec.from_json(data)
