"""Tests of autopar.costmodel: collective formulas, hardware profiles, FLOP counts, memory units."""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import sympy as sp
import torch

from autopar.costmodel import comm, compute, hardware, memory
from autopar.costmodel.hardware import HardwareSpec, LinkSpec, get_hardware
from autopar.errors import HardwareError, InputError
from autopar.graph import layer_of, nbytes_of, packet, val_of

aten = torch.ops.aten
LINK = LinkSpec(bandwidth=450e9, latency=5e-6)
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


# --- communication ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, volume", [
    ("all_reduce", lambda n: 2 * (n - 1) / n),
    ("all_gather", lambda n: (n - 1) / n),
    ("reduce_scatter", lambda n: (n - 1) / n),
    ("all_to_all", lambda n: (n - 1) / n),
    ("send_recv", lambda n: 1.0),
])
@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_bytes_moved_are_textbook_volumes(kind, volume, n):
    assert comm.collective_bytes_moved(kind, 1e6, n) == pytest.approx(volume(n) * 1e6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [2, 3, 8, 1000])
def test_fast_path_equals_sympy(kind, n):
    nbytes, link = 12345678.0, LinkSpec(bandwidth=25e9, latency=7e-6)
    s = comm.SYM_N, comm.SYM_B, comm.SYM_ALPHA, comm.SYM_BETA
    exact = comm.formula(kind).subs(dict(zip(s, (n, nbytes, link.latency, link.bandwidth))))
    assert comm.collective_time(kind, nbytes, n, link) == pytest.approx(float(exact), rel=1e-12)


def test_all_reduce_closed_form_and_single_device():
    t = comm.collective_time("all_reduce", 8e6, 4, LINK)
    assert t == pytest.approx(2 * 3 / 4 * 8e6 / 450e9 + 2 * 3 * 5e-6)
    for kind in KINDS:
        assert comm.collective_time(kind, 8e6, 1, LINK) == 0.0
        assert comm.collective_bytes_moved(kind, 8e6, 1) == 0.0


def test_formulas_are_sympy_and_explain_prints_numbers():
    assert isinstance(comm.formula("all_gather"), sp.Expr)
    text = comm.explain("all_reduce", 4194304, 4, LINK)
    assert text.startswith("all_reduce: 2·(n-1)/n·B/β + 2·(n-1)·α")
    assert "4.19 MB" in text and "450 GB/s" in text and text.endswith("44.0 µs")


def test_unknown_collective_and_bad_n():
    with pytest.raises(ValueError, match="broadcast"):
        comm.collective_time("broadcast", 1.0, 4, LINK)
    with pytest.raises(ValueError):
        comm.formula("gather")
    with pytest.raises(ValueError):
        comm.collective_time("all_reduce", 1.0, 0, LINK)


def test_calibrated_collective_link_overrides_generic():
    fit = LinkSpec(bandwidth=100e9, latency=20e-6)
    hw = dataclasses.replace(hardware.H100, name="h100-fit", collectives={"intra": {"all_reduce": fit}})
    t = comm.hardware_collective_time("all_reduce", 1e6, 8, hw, "intra")
    assert t == comm.collective_time("all_reduce", 1e6, 8, fit)
    assert comm.hardware_collective_time("all_gather", 1e6, 8, hw, "intra") == \
        comm.collective_time("all_gather", 1e6, 8, hw.intra_node)


# --- hardware -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["cpu", "a100", "H100", "h200"])
def test_presets_load(name):
    hw = get_hardware(name)
    assert hw.name == name.lower() and hw.intra_node.bandwidth > 0
    assert get_hardware(hw) is hw


def test_preset_figures():
    assert hardware.A100.peak_flops["bfloat16"] == 312e12
    assert hardware.H100.intra_node.bandwidth == 450e9 and hardware.H100.inter_node.bandwidth == 50e9
    assert hardware.H200.mem_capacity == 141e9 and hardware.H200.mem_bandwidth == 4.8e12
    assert hardware.CPU.devices_per_node is None


def test_int_and_float_figures_hash_alike():
    as_ints = dataclasses.replace(hardware.A100, mem_capacity=80_000_000_000,
                                  intra_node=LinkSpec(bandwidth=300_000_000_000, latency=5e-6))
    assert as_ints == hardware.A100 and hash(as_ints) == hash(hardware.A100)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(HardwareError, match="a100.*h100"):
        get_hardware("v100")


def test_json_round_trip(tmp_path):
    hw = dataclasses.replace(hardware.A100, name="a100-calibrated",
                             collectives={"inter": {"all_reduce": LinkSpec(20e9, 12e-6)}})
    assert HardwareSpec.from_json(hw.to_json()) == hw
    assert HardwareSpec.from_json(json.dumps(hw.to_json())) == hw
    path = tmp_path / "cluster.json"
    hw.save(path)
    loaded = get_hardware(path)
    assert loaded == hw and hash(loaded) == hash(hw) and loaded.fingerprint() == hw.fingerprint()
    assert get_hardware(str(path)) == hw


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("mem_bandwidth"), "mem_bandwidth"),
    (lambda d: d.update(mem_capacity="80GB"), "mem_capacity"),
    (lambda d: d.update(intra_node={"bandwidth": 1e9}), "intra_node"),
    (lambda d: d["inter_node"].update(latency=-1.0), "latency"),
    (lambda d: d.update(peak_flops={"bfloat16": 1e12}), "peak_flops"),
    (lambda d: d.update(devices_per_node=0), "devices_per_node"),
    (lambda d: d.update(collectives={"intra": {"gossip": {"bandwidth": 1.0, "latency": 0.0}}}),
     "collectives"),
    (lambda d: d.update(bandwith=1.0), "unknown field"),
])
def test_bad_profile_names_the_field(tmp_path, edit, message):
    data = hardware.H100.to_json()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HardwareError, match=message):
        get_hardware(path)


def test_corrupt_profile(tmp_path):
    path = tmp_path / "corrupt.json"
    path.write_text('{"name": "x", "peak_flops": ')
    with pytest.raises(HardwareError, match="not valid JSON"):
        get_hardware(path)
    path.write_text("[1, 2]")
    with pytest.raises(HardwareError, match="JSON object"):
        get_hardware(path)


# --- compute ------------------------------------------------------------------------------------

def test_mm_addmm_bmm_flops():
    m, k, n = 8, 16, 32
    a, b = torch.empty(m, k, device="meta"), torch.empty(k, n, device="meta")
    assert compute.node_flops(aten.mm.default, (a, b)) == 2 * m * k * n
    assert compute.node_flops(aten.addmm.default, (torch.empty(n), a, b)) == 2 * m * k * n
    x, y = torch.empty(3, m, k), torch.empty(3, k, n)
    assert compute.node_flops(aten.bmm.default, (x, y)) == 3 * 2 * m * k * n


def test_sdpa_flops_cpu_and_efficient_kernels_agree():
    b, h, s, d = 2, 4, 16, 8
    q = torch.empty(b, h, s, d, device="meta")
    forward = 4 * b * h * s * s * d                  # q @ k^T and scores @ v
    cpu = compute.node_flops(aten._scaled_dot_product_flash_attention_for_cpu.default,
                             (q, q, q, 0.0, True))
    eff = compute.node_flops(aten._scaled_dot_product_efficient_attention.default,
                             (q, q, q, None, True))
    assert cpu == eff == forward
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q, 0.0, True)
    backward = compute.node_flops(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                                  (q, q, q, q, out, lse, 0.0, True))
    assert backward == pytest.approx(2.5 * forward)


def test_memory_bound_ops_count_zero_and_bytes():
    a = torch.empty(4, 8)
    assert compute.node_flops(aten.add.Tensor, (a, a), {}, a) == 0.0
    assert compute.node_flops(len, (a,)) == 0.0
    assert compute.node_bytes((a, [a, 2.0]), (a,)) == 3 * (4 * 8 * 4)   # two reads, one write


def test_roofline():
    hw = hardware.H100
    flops, nbytes = 2 * 4096**3, 3 * 4096**2 * 2
    assert compute.op_time(flops, nbytes, hw, torch.bfloat16) == pytest.approx(flops / (989e12 * 0.6))
    assert compute.op_time(0.0, 1e9, hw, torch.float32) == pytest.approx(1e9 / 3.35e12)
    assert compute.op_time(1e12, 0.0, hw, torch.int64) == pytest.approx(1e12 / (67e12 * 0.6))


# --- memory -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("512MB", 512 * 10**6), ("1.5TB", 15 * 10**11),
    ("80 gb", 80 * 10**9), ("1024", 1024), (1e9, 10**9), (4096, 4096), ("2e3KiB", 2000 * 1024),
])
def test_parse_bytes(text, expected):
    assert memory.parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["80 GBs", "lots", "", "-1GB", -5, True, None, "80Gb/s"])
def test_parse_bytes_rejects_with_example(bad):
    with pytest.raises(InputError, match="80GB"):
        memory.parse_bytes(bad)


def test_format_bytes_and_seconds():
    assert memory.format_bytes(4194304) == "4.19 MB"
    assert memory.format_bytes(999_999) == "1.00 MB"
    assert memory.format_bytes(12) == "12 B"
    assert memory.format_seconds(0.0123) == "12.3 ms"
    assert memory.format_seconds(450e-6) == "450 µs"
    assert memory.format_seconds(1.2) == "1.20 s"


def test_optimizer_state_bytes():
    osb = memory.optimizer_state_bytes_per_param
    assert osb("adamw", torch.float32) == osb("Adam", torch.bfloat16) == 8
    assert osb("sgd", torch.float32) == 0
    assert osb("sgd_momentum", torch.float32) == osb("momentum", torch.float16) == 4
    assert osb("adamw", torch.bfloat16, master_weights=True) == 12
    assert osb("adamw", torch.float64) == 16
    assert osb(6, torch.float32) == 6.0
    with pytest.raises(InputError, match="adamw"):
        osb("adamx", torch.float32)
    with pytest.raises(InputError):
        osb(-1, torch.float32)
    assert math.isfinite(osb("adafactor", torch.float32))


# --- symbolic formulas with numbers (issue 5) ---------------------------------------------------

def test_coefficients_are_the_textbook_factors():
    assert comm.coefficients("all_reduce", 4) == (1.5, 6.0)
    assert comm.coefficients("all_gather", 8) == (7 / 8, 7.0)
    assert comm.coefficients("send_recv", 2) == (1.0, 1.0)


def test_explain_all_reduce_prints_formula_and_numbers():
    text = comm.explain("all_reduce", 8e6, 4, LINK)
    assert text.startswith("all_reduce: 2·(n-1)/n·B/β + 2·(n-1)·α = 3/2·8.00 MB")
    assert "6·5.00 µs" in text and text.endswith(memory.format_seconds(comm.collective_time("all_reduce", 8e6, 4, LINK)))


def test_roofline_formula_and_launch_overhead():
    hw = dataclasses.replace(hardware.H100, op_overhead=4e-6)
    flops, nbytes = 2 * 4096 ** 3, 3 * 4096 ** 2 * 2
    expected = flops / (989e12 * 0.6) + 4e-6
    assert compute.op_time(flops, nbytes, hw, torch.bfloat16) == pytest.approx(expected)
    sym = compute.ROOFLINE.subs({compute.SYM_F: flops, compute.SYM_M: nbytes, compute.SYM_P: 989e12,
                                 compute.SYM_ETA: 0.6, compute.SYM_W: hw.mem_bandwidth, compute.SYM_O: 4e-6,
                                 compute.SYM_E: 0, compute.SYM_T: hw.transcendental_rate})
    assert float(sym) == pytest.approx(expected)
    text = compute.explain_compute(flops, nbytes, hw, torch.bfloat16)
    assert text.startswith("max(F/(η·P), M/W) + o = max(") and "compute bound" in text
    assert "memory bound" in compute.explain_compute(0, 1e9, hw)
    assert compute.op_time(0, 0, hardware.H100, "float32") == 0   # presets: no launch overhead


def _two_weight_mlp() -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.ReLU(), torch.nn.Linear(16, 4, bias=False))
    return model, (torch.randn(4, 8),)


@pytest.mark.parametrize("strategy", ["dp", "zero3"])
def test_optimizer_step_pays_its_overhead_once_per_parameter_tensor(strategy):
    """Two weight matrices: the optimizer's fixed cost adds exactly 2 × param_step_overhead to the
    step, whatever the split (it is the same for every placement, so no plan changes)."""
    import autopar
    model, args = _two_weight_mlp()
    base = dataclasses.replace(hardware.CPU, name="cpu-no-step-overhead", param_step_overhead=0.0)
    slow = dataclasses.replace(base, name="cpu-slow-step", param_step_overhead=1e-3)
    plans = [autopar.plan(model, args, mesh=autopar.Mesh((2,), hardware=hw), strategy=strategy, baselines=False,
                          loss_fn=lambda out, x: out.square().mean()) for hw in (base, slow)]
    assert plans[1].predicted_step_time - plans[0].predicted_step_time == pytest.approx(2e-3, rel=1e-9)
    assert plans[1].predicted_compute_time - plans[0].predicted_compute_time == pytest.approx(2e-3, rel=1e-9)
    assert plans[1].params == plans[0].params and plans[1].nodes == plans[0].nodes


def test_param_step_overhead_round_trips_and_is_validated():
    hw = dataclasses.replace(hardware.CPU, name="cpu-calibrated", param_step_overhead=150e-6)
    assert HardwareSpec.from_json(json.dumps(hw.to_json())) == hw
    assert hardware.H100.param_step_overhead == hardware.A100.param_step_overhead == 10e-6
    assert hardware.H200.param_step_overhead == 10e-6
    data = hw.to_json()
    data["param_step_overhead"] = "150us"
    with pytest.raises(HardwareError, match="param_step_overhead"):
        HardwareSpec.from_json(data)
    old = hardware.CPU.to_json()   # a profile written before the fields existed still loads
    for name in ("param_step_overhead", "transcendental_rate"):
        old.pop(name, None)
    loaded = HardwareSpec.from_json(old)
    assert loaded.param_step_overhead == loaded.transcendental_rate == 0.0
    for name in ("transcendental_rate",):
        with pytest.raises(HardwareError, match=name):
            HardwareSpec.from_json({**hw.to_json(), name: -1.0})


def test_exp_class_ops_are_bound_by_their_elements_on_a_cpu_not_on_a_gpu():
    """gelu of 1M fp32 elements: 8 MB. A CPU at 20 GB/s and 100 M elements/s needs 10 ms for the
    elements, not 0.4 ms for the bytes; an H100 needs 8 MB / 3.35 TB/s = 2.39 µs, its SFUs 0.25 µs."""
    cpu = dataclasses.replace(hardware.CPU, mem_bandwidth=20e9, transcendental_rate=100e6, op_overhead=0.0)
    assert compute.op_time(0, 8e6, cpu, "float32", elements=2 ** 20) == pytest.approx(2 ** 20 / 100e6)
    assert compute.op_time(0, 8e6, cpu, "float32") == pytest.approx(8e6 / 20e9)   # add: bytes alone
    assert compute.op_time(0, 8e6, hardware.H100, "float32", elements=2 ** 20) == pytest.approx(8e6 / 3.35e12)
    unmeasured = dataclasses.replace(cpu, transcendental_rate=0.0)
    assert compute.op_time(0, 8e6, unmeasured, "float32", elements=2 ** 20) == pytest.approx(8e6 / 20e9)
    assert "transcendental bound" in compute.explain_compute(0, 8e6, cpu, elements=2 ** 20)
    assert compute.is_transcendental(torch.ops.aten.gelu.default)
    assert not compute.is_transcendental(torch.ops.aten.add.Tensor)


def test_planner_prices_gelu_by_its_elements():
    """A hand-built MLP's gelu on one device: the planned step time grows by exactly E/T - M/W
    when exp-class ops become element bound (E = 4×16 outputs, 1 per element)."""
    import autopar
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.GELU(), torch.nn.Linear(16, 4, bias=False))
    args = (torch.randn(4, 8),)
    fast = dataclasses.replace(hardware.CPU, name="cpu-bytes-only", transcendental_rate=0.0, op_overhead=0.0)
    slow = dataclasses.replace(fast, name="cpu-slow-exp", transcendental_rate=1e6)
    plans = [autopar.plan(model, args, mesh=autopar.Mesh((1,), hardware=hw), baselines=False,
                          loss_fn=lambda out, x: out.square().mean()) for hw in (fast, slow)]
    # forward gelu writes 4×16 elements and reads 4×16; gelu_backward writes 4×16 and reads 2×4×16
    elements, nbytes = 2 * 64, (2 * 64 + 3 * 64) * 4
    expected = elements / 1e6 - nbytes / fast.mem_bandwidth
    assert plans[1].predicted_step_time - plans[0].predicted_step_time == pytest.approx(expected, rel=1e-6)


def test_view_ops_pay_the_dispatch_overhead_alone():
    """A view (alias) moves no bytes but is a dispatched call in the per-rank graph: every strategy of
    a view node costs exactly op_overhead, and each op node (views included) adds one op_overhead to
    the step; the presets' overhead is 0, so their view ops stay free."""
    import autopar
    from autopar.capture.canonicalize import canonicalize
    from autopar.capture.trace import capture
    from autopar.planning.problem import FREE_OPS, ProblemBuilder
    model, args = _two_weight_mlp()
    captured = capture(model, args, loss_fn=lambda out, x: out.square().mean())
    canonicalize(captured.gm)
    free = dataclasses.replace(hardware.CPU, name="cpu-no-overhead", op_overhead=0.0)
    costly = dataclasses.replace(free, name="cpu-overhead", op_overhead=1e-3)
    probs = [ProblemBuilder(captured, autopar.Mesh((2,), hardware=hw)).build() for hw in (free, costly)]
    views = [i for i, n in enumerate(probs[0].nodes) if n.op == "call_function" and packet(n) in FREE_OPS]
    ops = [i for i, n in enumerate(probs[0].nodes) if n.op == "call_function"]
    assert views, "the MLP's joint graph has view ops (t, view)"
    for i in views:
        assert (probs[0].compute[i] == 0).all() and (probs[1].compute[i] == 1e-3).all()
    for i in ops:
        assert probs[1].compute[i] - probs[0].compute[i] == pytest.approx(np.full(len(probs[0].compute[i]), 1e-3))
    assert compute.view_time(hardware.H100) == 0 and compute.view_time(costly) == 1e-3


# --- attention efficiency and layout copies --------------------------------------------------------

def test_attention_kernels_run_at_their_calibrated_efficiency():
    """F = 1 GFLOP at η·P = 0.8 × 50 GFLOP/s takes 25 ms as a matmul; an attention forward at
    efficiency 0.75 takes 25/0.75 ms, its backward at 0.5 takes 50 ms; other ops keep 1."""
    cpu = dataclasses.replace(hardware.CPU, op_overhead=0.0, attention_efficiency=0.75,
                              attention_backward_efficiency=0.5)
    fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    assert compute.flop_efficiency(fwd, cpu) == 0.75 and compute.flop_efficiency(bwd, cpu) == 0.5
    assert compute.flop_efficiency(aten._scaled_dot_product_efficient_attention_backward.default, cpu) == 0.5
    assert compute.flop_efficiency(aten.mm.default, cpu) == 1.0
    assert compute.op_time(1e9, 0, cpu, "float32") == pytest.approx(25e-3)
    assert compute.op_time(1e9, 0, cpu, "float32", efficiency=0.75) == pytest.approx(25e-3 / 0.75)
    assert compute.op_time(1e9, 0, cpu, "float32", efficiency=0.5) == pytest.approx(50e-3)
    assert "0.4·0.05 TFLOP/s" in compute.explain_compute(1e9, 0, cpu, efficiency=0.5)


def test_attention_efficiencies_round_trip_and_are_validated():
    hw = dataclasses.replace(hardware.CPU, name="cpu-calibrated", attention_efficiency=0.7,
                             attention_backward_efficiency=0.45)
    assert HardwareSpec.from_json(json.dumps(hw.to_json())) == hw
    old = hardware.CPU.to_json()   # a profile written before the fields existed prices attention as a matmul
    old.pop("attention_efficiency"), old.pop("attention_backward_efficiency")
    loaded = HardwareSpec.from_json(old)
    assert loaded.attention_efficiency == loaded.attention_backward_efficiency == 1.0
    default = dataclasses.replace(hardware.H100, attention_efficiency=1.0)
    assert "attention_efficiency" not in default.to_json()   # the default (1) stays out of the JSON
    assert hardware.H100.to_json()["attention_backward_efficiency"] == 0.59
    for name, bad in (("attention_efficiency", 0.0), ("attention_backward_efficiency", -0.5),
                      ("attention_backward_efficiency", "half")):
        with pytest.raises(HardwareError, match=name):
            HardwareSpec.from_json({**hw.to_json(), name: bad})


def test_sync_latency_round_trips_and_is_validated():
    hw = dataclasses.replace(hardware.CPU, name="cpu-calibrated", sync_latency=1.1e-3)
    assert HardwareSpec.from_json(json.dumps(hw.to_json())) == hw
    assert "sync_latency" not in hardware.CPU.to_json()   # presets: 0, left out (fingerprints unchanged)
    assert HardwareSpec.from_json(hardware.CPU.to_json()).sync_latency == 0.0
    for bad in (-1e-3, "1ms"):
        with pytest.raises(HardwareError, match="sync_latency"):
            HardwareSpec.from_json({**hw.to_json(), "sync_latency": bad})


def test_each_collective_pays_the_sync_latency_once_bucketed_gradients_their_share():
    """A 1 MB all-reduce on 2 ranks pays sync_latency once (not per hop); a bucketed gradient of
    B bytes min(1, B / BUCKET_BYTES) of it, as of alpha; a pipeline transfer pays it once on top of
    its send_recv fit."""
    import autopar
    from autopar.placement import P, R
    from autopar.planning.reshard import BUCKET_BYTES, ReshardCost
    sync = 1e-3
    base, slow = (autopar.Mesh((2,), hardware=dataclasses.replace(hardware.CPU, sync_latency=s)) for s in (0.0, sync))
    fast_rc, slow_rc = ReshardCost(base), ReshardCost(slow)
    partial, rep = (P,), (R,)
    for nbytes in (4.0, 1e6):
        assert slow_rc.time(partial, rep, nbytes) - fast_rc.time(partial, rep, nbytes) == pytest.approx(sync)
        assert slow_rc.time(partial, rep, nbytes, bucketed=True) - fast_rc.time(partial, rep, nbytes, bucketed=True) \
            == pytest.approx(sync * nbytes / BUCKET_BYTES)
        step = fast_rc.steps(partial, rep, nbytes)[0]
        assert slow_rc.step_time(step) - fast_rc.step_time(step) == pytest.approx(sync)
        assert slow.p2p_time(nbytes, 0) - base.p2p_time(nbytes, 0) == pytest.approx(sync)
        assert base.p2p_time(nbytes, 0) == base.collective_time("send_recv", nbytes, 0)


def test_a_gather_share_scales_the_latencies_of_all_gathers_only():
    """An all-gather riding in a layer's flat all-gather pays `gather_share` of one collective's
    latency, launch overhead and sync latency, and all of its bandwidth term; other collectives of
    the same edge (an all-reduce) pay in full. step_time and time agree."""
    import autopar
    from autopar.costmodel.comm import collective_time
    from autopar.placement import P, R, S
    from autopar.planning.reshard import LAUNCH_FRACTION, ReshardCost
    hw = dataclasses.replace(hardware.CPU, sync_latency=1e-3)
    rc = ReshardCost(autopar.Mesh((4,), hardware=hw))
    link = hw.link("intra", "all_gather")
    nbytes, share = 1e6, 0.25
    bandwidth_only = collective_time("all_gather", nbytes, 4, dataclasses.replace(link, latency=0.0))
    whole = rc.time((S(0),), (R,), nbytes)
    assert whole == pytest.approx(bandwidth_only + 3 * link.latency + LAUNCH_FRACTION * link.latency + 1e-3)
    assert rc.time((S(0),), (R,), nbytes, gather_share=share) == pytest.approx(
        bandwidth_only + share * (whole - bandwidth_only))
    assert rc.time((P,), (R,), nbytes, gather_share=share) == rc.time((P,), (R,), nbytes)
    for s in (1.0, share):
        step, = rc.steps((S(0),), (R,), nbytes)
        assert rc.step_time(step, gather_share=s) == pytest.approx(rc.time((S(0),), (R,), nbytes, gather_share=s))


def test_a_parameter_gathered_with_its_layer_pays_its_share_of_one_collective():
    """passes/bucket_layer_gathers.py gathers a numbered layer's parameters in one collective: each
    parameter's data edges carry max(its bytes over the layer's, 1 / the layer's parameter count) as
    `gather_share`; parameters outside the numbered layers (embeddings, final norm) and activations
    pay a whole one."""
    import autopar
    from autopar._testing.models import tiny_gpt
    from autopar.capture.canonicalize import canonicalize
    from autopar.capture.trace import capture
    from autopar.planning.problem import ProblemBuilder
    case = tiny_gpt()
    captured = capture(case.model, case.example_inputs)
    canonicalize(captured.gm)
    prob = ProblemBuilder(captured, autopar.Mesh((2,), hardware="cpu")).build()
    params = {i: n for i, n in enumerate(prob.nodes) if n.meta.get("autopar_role") == "param"}
    totals: dict = {}
    counts: dict = {}
    for n in params.values():
        layer = layer_of(n.meta["autopar_name"])
        totals[layer] = totals.get(layer, 0.0) + nbytes_of(val_of(n))
        counts[layer] = counts.get(layer, 0) + 1
    assert len([k for k in totals if k is not None]) >= 2
    seen_bytes = seen_count = seen_outside = 0
    for e in prob.edges:
        if e.kind != "data":
            continue
        node = params.get(e.src)
        layer = None if node is None else layer_of(node.meta["autopar_name"])
        if layer is None:
            assert e.gather_share == 1.0
            seen_outside += node is not None
        else:
            by_bytes, by_count = e.nbytes / totals[layer], 1 / counts[layer]
            assert e.gather_share == pytest.approx(max(by_bytes, by_count)) and e.gather_share < 1
            seen_bytes += by_bytes > by_count
            seen_count += by_count > by_bytes
    assert seen_bytes and seen_count and seen_outside
