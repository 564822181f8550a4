"""This machine's CPU profile (autopar/calibration/machine.py): measured at the first job, cached, read back;
the summary of a plan priced on the uncalibrated `cpu` preset says so."""
from __future__ import annotations

import json
import os

import torch

import autopar
from autopar import config
from autopar._testing.dist_utils import run_distributed
from autopar._testing.gpt import GPT, GPTConfig
from autopar.calibration import machine
from autopar.costmodel.hardware import CPU, H100, HardwareSpec


def _profile_worker(rank, world, cache):
    """First job (measures and caches), second job (reads the cache), then autoparallelize with and
    without AUTOPAR_CALIBRATE: what each rank planned on and what its summary says."""
    os.environ.update(AUTOPAR_CALIBRATE="1", AUTOPAR_CACHE_DIR=cache)
    path = machine.profile_path(machine.machine_key(world))
    torch.manual_seed(7)
    first = machine.machine_hardware(world)
    drawn_after_measuring = torch.rand(3)   # the calibration left the global RNG where it was
    torch.manual_seed(7)
    expected_draw = torch.rand(3)
    stamp = path.stat().st_mtime_ns if rank == 0 else None   # rank 0 writes the cache (the others may be ahead)
    second = machine.machine_hardware(world)
    assert rank != 0 or path.stat().st_mtime_ns == stamp   # read back, not measured again
    compiling = machine.machine_hardware(world, compiled=True)   # a job that compiles: its figures added, cached
    assert machine.machine_hardware(world, compiled=True) == compiling == machine.machine_hardware(world)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    ids = torch.randint(0, 64, (4, 16))
    calibrated = autopar.autoparallelize(model, (ids, ids))
    os.environ["AUTOPAR_CALIBRATE"] = "0"
    preset = autopar.autoparallelize(model, (ids, ids))
    return {"first": first.to_json(), "second": second.to_json(), "compiling": compiling.to_json(), "path": str(path),
            "rng_kept": bool(torch.equal(drawn_after_measuring, expected_draw)),
            "planned_on": calibrated.plan.mesh.hardware.to_json(), "summary": str(calibrated.plan),
            "preset_on": preset.plan.mesh.hardware.name, "preset_summary": str(preset.plan)}


def test_first_job_measures_and_caches_later_jobs_read_it(tmp_path):
    results = run_distributed(_profile_worker, 2, str(tmp_path), timeout=480)   # + compiling calibration programs
    r0, r1 = results
    assert r0["first"] == r1["first"] == r0["second"] == r1["second"]   # every rank, every job: one profile
    assert r0["rng_kept"] and r1["rng_kept"]
    spec = HardwareSpec.from_json(r0["first"])
    assert spec.name == "cpu-calibrated" and spec != CPU
    assert set(spec.collectives["intra"]) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                              "send_recv"}
    assert spec.param_step_overhead > 0 and spec.op_overhead > 0   # measured here, not the preset's
    assert spec.in_step_scale != 1.0   # the reference step ran (calibration/in_step.py)
    assert spec.compiled_op_overhead == 0 == spec.compiled_in_step_scale   # an eager job compiles nothing
    compiling = HardwareSpec.from_json(r0["compiling"])
    assert r1["compiling"] == r0["compiling"]
    assert compiling.compiled_op_overhead > 0 and compiling.compiled_in_step_scale > 0
    about = json.loads(open(r0["path"].removesuffix(".json") + ".key.json").read())
    assert about["measured_for"]["world"] == 2 and about["measured_for"]["torch"] == torch.__version__
    assert about["seconds"] > 0
    assert r0["planned_on"] == r0["compiling"]   # autoparallelize(mesh=None) priced on the cached profile
    assert "cpu-calibrated" in r0["summary"] and "uncalibrated" not in r0["summary"]
    assert r0["preset_on"] == "cpu" and "uncalibrated: the `cpu` preset's figures" in r0["preset_summary"]
    assert "torchrun --nproc_per_node 2 -m autopar calibrate" in r0["preset_summary"]


def test_cache_key_and_unreadable_files(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    key = machine.machine_key(2)
    assert {"host", "cpu", "torch", "world", "threads"} <= set(key) and key["cpu"]
    path = machine.profile_path(key)
    assert path.parent == tmp_path / "profiles"
    for other in (machine.machine_key(4), {**key, "torch": "0.0"}, {**key, "threads": 7}):
        assert machine.profile_path(other) != path   # another world, torch or thread count: measured again
    assert machine.read_profile(path) is None   # nothing cached yet
    machine.write_profile(path, key, CPU, 1.5)
    assert machine.read_profile(path) == CPU
    assert autopar.Mesh((2,), hardware=path).hardware == CPU   # a plain profile, usable as any other
    assert json.loads(path.with_suffix(".key.json").read_text())["measured_for"] == key
    assert not list(path.parent.glob("*.tmp"))   # written through renamed temporary files
    for text in ("{truncated", json.dumps({"name": "x"})):
        path.write_text(text)
        assert machine.read_profile(path) is None   # measured again, not trusted


def test_cache_folder_and_switch(monkeypatch, tmp_path):
    monkeypatch.delenv("AUTOPAR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert config.cache_dir() == tmp_path / "xdg" / "autopar"
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "mine"))
    assert config.cache_dir() == tmp_path / "mine"
    for value, on in (("0", False), ("off", False), ("1", True)):
        monkeypatch.setenv("AUTOPAR_CALIBRATE", value)
        assert config.calibrate_enabled() is on
    monkeypatch.setenv("AUTOPAR_CALIBRATE", "0")
    assert machine.machine_hardware(2) == CPU   # no process group needed: nothing is measured or read


def test_summary_says_when_it_is_uncalibrated(gpt_case):
    model, batch = gpt_case
    on_cpu = autopar.plan(model, batch, mesh=autopar.Mesh((2,)), baselines=False)
    text = str(on_cpu)
    assert "uncalibrated: the `cpu` preset's figures" in text
    lines = text.splitlines()
    step = next(i for i, line in enumerate(lines) if line.startswith("step time"))
    assert "uncalibrated" in lines[step + 1]   # right under the step time it qualifies
    assert "torchrun --nproc_per_node 2 -m autopar calibrate --out hw.json" in lines[step + 2]
    for hardware in (H100, HardwareSpec.from_json({**CPU.to_json(), "name": "cpu-calibrated", "op_overhead": 6e-6})):
        other = autopar.plan(model, batch, mesh=autopar.Mesh((2,), hardware=hardware), baselines=False)
        assert "uncalibrated" not in str(other)
