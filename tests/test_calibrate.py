"""Calibration: alpha-beta fits from timings, profiles on disk, and a real 2-rank gloo run."""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from autopar._testing.dist_utils import run_distributed
from autopar.calibration.fit import Sample, fit_alpha_beta, fit_line, fit_links
from autopar.calibration.measure import build_profile, calibrate, parse_size, size_range
from autopar.costmodel import comm, compute
from autopar.costmodel.hardware import CPU, H100, HardwareSpec, LinkSpec, get_hardware
from autopar.errors import HardwareError, InputError
from autopar.inspection.cli import main
from autopar.mesh import Mesh
from autopar.runtime import cpu_memory

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
SIZES = [4 ** k * 1024 for k in range(8)]


def synthetic(kind: str, link: LinkSpec, ns=(2, 4, 8), noise: float = 0.0, seed: int = 0):
    rng = random.Random(seed)
    return [(n, b, comm.collective_time(kind, b, n, link) * (1 + noise * rng.uniform(-1, 1)))
            for n in ns for b in SIZES]


@pytest.mark.parametrize("kind", KINDS)
def test_fit_recovers_alpha_and_beta(kind):
    truth = LinkSpec(bandwidth=12.5e9, latency=7e-6)
    fit = fit_alpha_beta(kind, synthetic(kind, truth))
    assert fit.latency == pytest.approx(truth.latency, rel=1e-6)
    assert fit.bandwidth == pytest.approx(truth.bandwidth, rel=1e-6)


def test_fit_with_noise_and_clamps():
    truth = LinkSpec(bandwidth=1e9, latency=400e-6)
    fit = fit_alpha_beta("all_reduce", synthetic("all_reduce", truth, noise=0.05))
    assert fit.latency == pytest.approx(truth.latency, rel=0.2)
    assert fit.bandwidth == pytest.approx(truth.bandwidth, rel=0.2)
    # pure bandwidth (no latency): alpha would come out slightly negative; it is clamped to 0
    fit = fit_alpha_beta("all_gather", synthetic("all_gather", LinkSpec(1e9, 0.0)))
    assert fit.latency >= 0 and fit.bandwidth == pytest.approx(1e9, rel=1e-6)
    with pytest.raises(InputError, match="at least 2"):
        fit_alpha_beta("all_reduce", [(2, 1024, 1e-3)])


def test_an_outlying_timing_does_not_tilt_the_fit():
    """One 4 MiB all-reduce timed in a spell of load (3x its time): the plain relative least squares
    (the fit before) prices 16 MiB 13% too high; the robust fit weighs the outlier down."""
    truth = LinkSpec(bandwidth=1e9, latency=400e-6)
    rows = synthetic("all_reduce", truth, ns=(2,))
    rows[6] = (2, rows[6][1], 3 * rows[6][2])
    assert rows[6][1] == 4 * 2 ** 20
    fit = fit_alpha_beta("all_reduce", rows)
    for nbytes in (2 ** 20, 16 * 2 ** 20):
        assert comm.collective_time("all_reduce", nbytes, 2, fit) == pytest.approx(
            comm.collective_time("all_reduce", nbytes, 2, truth), rel=0.01)
    t = np.array([r[2] for r in rows])
    hops, volume = (np.array([comm.coefficients("all_reduce", 2)[i] * (1 if i else b) for _, b, _ in rows])
                    for i in (1, 0))
    alpha, inv_beta = np.linalg.lstsq(np.stack([hops, volume], 1) / t[:, None], np.ones_like(t), rcond=None)[0]
    plain = LinkSpec(1 / inv_beta, alpha)
    assert comm.collective_time("all_reduce", 16 * 2 ** 20, 2, plain) > 1.1 * comm.collective_time(
        "all_reduce", 16 * 2 ** 20, 2, truth)


def test_fit_line_recovers_op_overhead_and_bandwidth():
    """Pointwise ops of M bytes take o + M/W: the fit gives back o = 3 µs and W = 30 GB/s."""
    sizes = [3 * 4 * n for n in (64, 1024, 16384, 262144, 1 << 20)]
    overhead, per_byte = fit_line(sizes, [3e-6 + m / 30e9 for m in sizes])
    assert overhead == pytest.approx(3e-6, rel=1e-6) and 1 / per_byte == pytest.approx(30e9, rel=1e-6)
    rng = random.Random(0)
    overhead, per_byte = fit_line(sizes, [(3e-6 + m / 30e9) * (1 + 0.05 * rng.uniform(-1, 1)) for m in sizes])
    assert overhead == pytest.approx(3e-6, rel=0.2) and 1 / per_byte == pytest.approx(30e9, rel=0.2)


def test_fit_line_recovers_the_optimizer_cost_per_parameter_tensor_and_clamps():
    """AdamW over K tensors: 1 ms of fixed cost + 150 µs per tensor; the slope is the overhead."""
    counts = (4, 16, 64)
    fixed, per_tensor = fit_line(counts, [1e-3 + 150e-6 * k for k in counts])
    assert fixed == pytest.approx(1e-3, rel=1e-6) and per_tensor == pytest.approx(150e-6, rel=1e-6)
    assert fit_line(counts, [150e-6 * k - 1e-4 for k in counts])[0] == 0.0      # no negative overhead
    assert fit_line(counts, [1e-3 - 1e-6 * k for k in counts])[1] == 0.0       # nor negative slope
    with pytest.raises(InputError, match="2 or more distinct sizes"):
        fit_line([8, 8], [1e-3, 1e-3])


def test_profile_from_samples_round_trips_and_mesh_accepts_it(tmp_path):
    intra, inter = LinkSpec(300e9, 5e-6), LinkSpec(20e9, 15e-6)
    samples = [Sample(kind, lk, n, b, t) for lk, link in (("intra", intra), ("inter", inter))
               for kind in KINDS for n, b, t in synthetic(kind, link)]
    spec = build_profile(H100, samples, matmul_flops=40e12, mem_bandwidth=2e12, op_overhead=8e-6,
                         devices_per_node=8, param_step_overhead=30e-6)
    assert spec.compute_efficiency == pytest.approx(40e12 / 67e12)
    assert spec.link("inter", "all_gather").bandwidth == pytest.approx(20e9)
    assert spec.op_overhead == 8e-6 and set(spec.collectives) == {"intra", "inter"}
    assert spec.param_step_overhead == 30e-6
    path = tmp_path / "cluster.json"
    spec.save(path)
    assert get_hardware(path) == spec
    for hw in (path, str(path), spec):
        mesh = Mesh((2, 8), hardware=hw)
        assert mesh.hardware == spec
        assert mesh.collective_time("all_reduce", 1e8, 0) == pytest.approx(
            comm.collective_time("all_reduce", 1e8, 2, inter), rel=1e-6)
    assert set(fit_links(samples)) == {"intra", "inter"}
    # a faster-than-preset matmul raises the peak instead of an efficiency over 1
    unmeasured = build_profile(CPU, samples, matmul_flops=80e9, mem_bandwidth=1e10, op_overhead=0,
                               devices_per_node=None)
    assert unmeasured.compute_efficiency == 1.0
    assert unmeasured.param_step_overhead == CPU.param_step_overhead   # the base's when not measured
    assert unmeasured.attention_backward_efficiency == CPU.attention_backward_efficiency


def test_attention_efficiencies_are_attention_flops_over_matmul_flops(tmp_path):
    spec = build_profile(CPU, [], matmul_flops=40e9, mem_bandwidth=2e10, op_overhead=8e-6, devices_per_node=None,
                         attention_flops=30e9, attention_backward_flops=18e9)
    assert spec.attention_efficiency == pytest.approx(0.75)
    assert spec.attention_backward_efficiency == pytest.approx(0.45)
    spec.save(tmp_path / "p.json")
    assert get_hardware(tmp_path / "p.json") == spec


def test_in_step_scale_multiplies_every_op_and_round_trips(tmp_path):
    base = build_profile(CPU, [], matmul_flops=40e9, mem_bandwidth=2e10, op_overhead=8e-6, devices_per_node=None,
                         transcendental_rate=5e8)
    scaled = dataclasses.replace(base, in_step_scale=1.4)
    for flops, nbytes, elements in ((2e9, 1e6, 0), (0, 4e6, 0), (1e3, 4e5, 1e5)):   # compute, memory, exp bound
        assert compute.op_time(flops, nbytes, scaled, "float32", elements) == pytest.approx(
            1.4 * compute.op_time(flops, nbytes, base, "float32", elements))
    assert compute.view_time(scaled) == pytest.approx(1.4 * 8e-6)
    assert "× 1.40" in compute.explain_compute(2e9, 1e6, scaled) and "×" not in compute.explain_compute(2e9, 1e6, base)
    scaled.save(tmp_path / "p.json")
    assert get_hardware(tmp_path / "p.json") == scaled
    assert "in_step_scale" not in base.to_json()   # the default (presets: 1) stays out of the JSON


@pytest.mark.parametrize("text, message", [
    ('{"name": "x", ', "not valid JSON"),
    ('__import__("os").system("touch pwned")', "not valid JSON"),
    ('{"name": "x"}', "lacks field"),
])
def test_corrupt_or_incomplete_profile_is_a_clear_error(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(HardwareError, match=message):
        Mesh(2, hardware=path)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("field", ["op_overhead", "param_step_overhead", "sync_latency", "in_step_scale",
                                   "runtime_overhead"])
def test_bad_overheads_are_clear_errors(field):
    data = H100.to_json()
    assert "op_overhead" not in data   # unset fields stay out of the JSON
    data[field] = -1.0
    with pytest.raises(HardwareError, match=field):
        HardwareSpec.from_json(data)


def test_sizes():
    assert parse_size("64K") == 65536 and parse_size("4MiB") == 4 * 2 ** 20 and parse_size("100") == 100
    assert size_range("1K", "64K") == (1024, 4096, 16384, 65536)
    with pytest.raises(InputError):
        parse_size("lots")
    assert main(["calibrate", "--out", "x.json", "--max-bytes", "big"]) == 2


def _calibrate_worker(rank, world, out):
    result = calibrate(sizes=[1024, 16384, 262144], iters=1, quick_compute=True, progress=lambda m: None)
    assert cpu_memory._state is not None   # measured under the allocator settings programs run with
    if rank == 0:
        result.spec.save(out)
    reference, runtime = result.reference, result.runtime
    return result.spec.to_json(), (reference.measured, reference.priced, reference.ops), (runtime.measured,
                                                                                          runtime.priced)


def test_real_calibration_two_ranks(tmp_path):
    out = tmp_path / "profile.json"
    results = run_distributed(_calibrate_worker, 2, str(out), timeout=240)   # + compiling calibration programs
    specs = [spec for spec, _, _ in results]
    assert specs[0] == specs[1]   # every rank fits the same profile
    (measured, priced, ops), _ = results[0][1], results[1][1]
    assert results[0][1] == results[1][1]   # the slowest rank's reference step, on every rank
    assert ops > 100 and measured > 0 and priced > 0
    assert specs[0]["in_step_scale"] == pytest.approx(measured / priced)   # measured, not the preset's 1
    # the reference model trained by the runtime: its whole step (the slowest rank's) less its plan's price
    (step_measured, step_priced), _ = results[0][2], results[1][2]
    assert results[0][2] == results[1][2] and step_measured > 0 and step_priced > 0
    assert specs[0].get("runtime_overhead", 0.0) == pytest.approx(max(0.0, step_measured - step_priced))
    spec = get_hardware(out)
    assert set(spec.collectives["intra"]) == set(KINDS)
    assert all(link.latency >= 0 and link.bandwidth > 0 for link in spec.collectives["intra"].values())
    assert 0 < spec.compute_efficiency <= 1 and spec.op_overhead > 0 and spec.param_step_overhead > 0
    assert spec.fused_step_overhead > 0   # measured with pmodel.optimizer's step (autopar/runtime/optim.py)
    assert spec.transcendental_rate > 0 and spec.sync_latency >= 0
    assert spec.attention_efficiency > 0 and spec.attention_backward_efficiency > 0
    assert spec.attention_backward_efficiency != CPU.attention_backward_efficiency   # measured, not the preset's
    assert Mesh(2, hardware=out).collective_time("all_reduce", 1e6, 0) > 0
    # the compiled program's figures (autopar/calibration/compiled.py): a kernel of Inductor's code costs less
    # than an eager ATen dispatch; a fused chain streams its one pass at a positive rate
    assert 0 < spec.compiled_op_overhead < spec.op_overhead, (spec.compiled_op_overhead, spec.op_overhead)
    assert spec.compiled_mem_bandwidth > 0
    assert spec.compiled_in_step_scale > 0   # the reference step run compiled, measured over priced


def test_runtime_overhead_is_paid_once_per_step_by_every_plan():
    """`runtime_overhead` (calibration/in_step.py): every plan's step pays it once, SPMD or pipelined, the
    baselines too; it is a constant, so no choice changes; the summary names it."""
    import autopar
    from autopar._testing.gpt import GPT, GPTConfig

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    tokens = torch.randint(0, 64, (4, 17))
    inputs = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    base = build_profile(CPU, [], matmul_flops=40e9, mem_bandwidth=2e10, op_overhead=8e-6, devices_per_node=None)
    paying = dataclasses.replace(base, runtime_overhead=0.01)
    for kwargs in ({}, {"num_stages": 2, "num_microbatches": 2}):
        plain = autopar.plan(model, inputs, mesh=Mesh((2,), hardware=base), **kwargs)
        paid = autopar.plan(model, inputs, mesh=Mesh((2,), hardware=paying), **kwargs)
        assert paid.predicted_step_time == pytest.approx(plain.predicted_step_time + 0.01, rel=1e-9)
        assert bool(paid.stages) == bool(kwargs)   # SPMD, then two stages
        assert paid.nodes == plain.nodes and paid.stages == plain.stages   # the same plan, priced 10 ms more
        assert paid.predicted_compute_time == pytest.approx(plain.predicted_compute_time)
        for name, row in plain.baselines.items():
            if row["feasible"]:
                assert paid.baselines[name]["time"] == pytest.approx(row["time"] + 0.01, rel=1e-9), name
        assert "runtime 10.0 ms" in paid.summary(rich=False) and "runtime" not in plain.summary(rich=False)
