"""compile=True: each rank's program compiled by Inductor (autopar/runtime/compile.py) trains exactly as the eager
FX program does, and the whole step is one compiled program with its collectives inside.

World 2, 3 AdamW steps, for dp, zero3, tp, auto and a 2-stage pipeline, on the hand-written GPT and on
transformers' Llama (one decoder layer for dp, zero3, tp, auto; two for the pipeline): fp32 losses and every parameter afterwards within rtol 1e-4 / atol 1e-5 of the eager
program's (Inductor reorders fp32 sums: ~1e-6 here); bf16 (autocast) as tests/test_mixed_precision.py allows
(losses within half a bf16 ulp, 0.015; parameters within the 3 Adam steps of lr each that a gradient of
another rounding may take: 2 * 3 * lr).

"No graph break": a compiled program is the whole per-rank GraphModule handed to Inductor without Dynamo,
so the honest count is of Inductor graphs per program (one), of programs run per step (one SPMD program;
a pipeline stage's gather once, forward and backward once per micro-batch) and of Dynamo's graph breaks
(none: Dynamo never runs); the generated code itself must hold the step's collectives (start and wait),
not call back into Python for them. A ZeRO-3 program's compiled code starts one parameter gather per layer
and phase, as the plan prices (`overlap` "layers", autopar/runtime/compile.py). A second process compiling
the same program loads it from Inductor's FX graph cache. CUDA graphs (compile="cudagraphs") cannot run
here: on CPU they raise InputError.

Inductor compiles on 2 shared cores are slow (Inductor's C++ codegen, in Python, grows with the graph's nodes;
g++ per new kernel): tiny models only, and one Inductor cache for every rank and test (TORCHINDUCTOR_CACHE_DIR,
set below unless the caller set one; its FX graph cache also serves a later session). Every world-2 case (GPT,
Llama) runs in one spawn, once for every test that reads it (the module fixture `world2`). Measured for this file: 7 min 50 s with a warm cache at load 6-8 (GPT 99 s, Llama 157 s, pp2 x dp2 at
world 4 103 s, the FX cache test 48 s: it compiles cold by design), about 13 min from a cold one at load 8-15
(GPT 366 s, Llama 272 s); 10 min 12 s at load 9 after compiled plans got their own pricing (some programs new). One world-2 spawn and a
1-layer Llama for the SPMD configs, cold cache, at load 7-11 (before and after at once): 39 min 7 s -> 34 min 59 s,
1,194 -> 1,148 s CPU (world-2 cases 1,983 s -> 1,843 s). Scalar kernels and no compile-worker pool
(`INDUCTOR_ENV` below), cold cache, load 4: 16 min 35 s, 678 s CPU (world-2 cases 819 s); main's file
before this change, cold, load 5-7: 27 min 26 s, 915 s CPU.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "autopar_inductor_cache"))

from autopar._testing import models  # noqa: E402
from autopar._testing.dist_cases import LR, run_each, train_steps  # noqa: E402
from autopar._testing.dist_utils import run_distributed  # noqa: E402

STEPS = 3
BF16_LOSS_ATOL = 0.015      # half a bf16 ulp of a loss in [4, 8), as tests/test_mixed_precision.py
BF16_PARAM_ATOL = 2 * STEPS * LR
COLLECTIVE = re.compile(r"_c10d_functional\.(\w+)\.default")
KERNEL = re.compile(r"^\s+(cpp_fused_\w+|extern_kernels\.\w+)\(", re.M)

PP_DP = {"pp2 x dp2 zero2": dict(mesh=((2, 2), ("pp", "dp")), strategy={"dp": "zero2"}, schedule="1f1b",
                                 num_microbatches=2)}
SPMD = {"dp": dict(strategy="dp"), "zero3": dict(strategy="zero3"), "tp": dict(strategy="tp"),
        "auto": dict(strategy="auto")}
PP2 = {"pp2": dict(num_stages=2, schedule="1f1b", num_microbatches=2)}
# zero bubble: each stage's backward compiled as two programs, B (input gradients) and W (weight gradients)
PP2_ZB = {"pp2 zero bubble": dict(num_stages=2, schedule="zero_bubble", num_microbatches=2)}
# The world-2 cases, all in one spawn (`world2`): name -> (model, configs). Llama's SPMD programs on one decoder
# layer (its ops, rotary embedding and grouped-query attention, are all in one layer; Inductor's codegen time grows
# with the layers, and per-layer gathers are the GPT's to show); its 2-stage pipeline on two, so that the stage cut
# falls between decoder layers (the rotary tables and the mask cross it, as in a deeper model).
CASES = {
    "gpt": (lambda: models.tiny_gpt(batch=4, seq=16),
            dict(SPMD, **PP2, **PP2_ZB, **{"dp bf16": dict(strategy="dp", mixed_precision="bf16"),
                                 "zero3 layers": dict(strategy="zero3", overlap="layers")})),
    "llama": (lambda: models.tiny_llama(batch=4, seq=16, n_layer=1), SPMD),
    "llama pp2": (lambda: models.tiny_llama(batch=4, seq=16), PP2),
}


# Inductor's C++ backend for this file's processes (the spawned ranks and the FX-cache probes read them from the
# environment; set while this module runs, unless the caller set them): scalar kernels (no AVX: g++ builds each
# kernel in about half the time, the ATen vector headers and templates unused) and compiles in the process itself
# (no pool of compile workers per rank, each importing torch, on 2 shared cores). autopar's side is unchanged (the
# same program handed to Inductor, the same generated wrapper with its collectives and waits); the compiled
# numerics are still checked against the eager program's. Tiny GPT, dp, one process, cold cache: compile 47 s ->
# 28 s, g++ 40 -> 22 CPU s.
INDUCTOR_ENV = {"TORCHINDUCTOR_VEC_ISA_OK": "0", "TORCHINDUCTOR_COMPILE_THREADS": "1"}


@pytest.fixture(scope="module", autouse=True)
def _cheap_inductor():
    saved = {k: os.environ.get(k) for k in INDUCTOR_ENV}
    os.environ.update({k: v for k, v in INDUCTOR_ENV.items() if saved[k] is None})
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)


# ---------------------------------------------------------------- helpers (also run in spawned ranks)

def _programs(pmodel) -> list:
    return [pmodel.program] if hasattr(pmodel, "program") else pmodel.programs()



@contextlib.contextmanager
def _overlap(mode):
    """AUTOPAR_COMPILE_OVERLAP=mode while a module is built (None: the device's default)."""
    if mode is None:
        yield
        return
    os.environ["AUTOPAR_COMPILE_OVERLAP"] = mode
    try:
        yield
    finally:
        del os.environ["AUTOPAR_COMPILE_OVERLAP"]


def _physical_gathers(gm) -> int:
    """All-gathers a program issues: each all_gather node, each layer's fused gather (bucket_layer_gathers: one
    25 MB bucket on these tiny models) once."""
    from autopar.passes.ops import fused_all_gather
    return sum(n.target in (torch.ops._c10d_functional.all_gather_into_tensor.default, fused_all_gather)
               for n in gm.graph.nodes)


def _planned_gathers(plan) -> int:
    """The all-gathers the plan prices: one per (phase, layer, axis) for a numbered layer's parameters
    (autopar/planning/problem.py's gather_share), one per parameter use elsewhere."""
    from autopar.graph import layer_of
    return len({(c.phase, c.axis, layer_of(c.module) or (c.module, c.source)) for c in plan.collectives
                if c.kind == "all_gather"})


def _mismatches(eager: dict, compiled: dict, rtol: float, atol: float) -> list[str]:
    out = []
    for key, value in eager.items():
        try:
            torch.testing.assert_close(compiled[key], value, rtol=rtol, atol=atol)
        except AssertionError as e:
            out.append(f"{key}: {str(e).splitlines()[-3:]}")
    return out


def compiled_vs_eager(rank, world, model, batches, configs):
    """Per config: train the eager program and the compiled one from the same weights; what the test checks."""
    import autopar
    from autopar import _torch_compat as compat
    from autopar import autoparallelize
    args, kwargs = batches[0]
    example = tuple(args) + ((kwargs,) if kwargs else ())
    out = {}
    for label, kw in configs.items():
        runs = {}
        kw = dict(kw, mesh=autopar.Mesh(*kw["mesh"])) if "mesh" in kw else kw
        for compile in (False, True):
            options = {k: v for k, v in kw.items() if k != "overlap"}
            with _overlap(kw.get("overlap")):
                pmodel = autoparallelize(copy.deepcopy(model), example, baselines=False, compile=compile, **options)
            if not compile:
                eager_gathers = _physical_gathers(pmodel.gm) if hasattr(pmodel, "gm") else None
            losses, _ = train_steps(pmodel, batches, STEPS)
            runs_per_step = [p.runs / STEPS for p in _programs(pmodel)] if compile else None
            runs[compile] = losses, {k: v.clone() for k, v in pmodel.full_state_dict().items()}
        bf16 = kw.get("mixed_precision") == "bf16"
        rtol, atol = (0.0, BF16_PARAM_ATOL) if bf16 else (1e-4, 1e-5)
        loss_tol = dict(rtol=0.0, atol=BF16_LOSS_ATOL) if bf16 else dict(rtol=1e-4, atol=1e-5)
        programs = _programs(pmodel)
        out[label] = {
            "losses": (runs[False][0], runs[True][0]), "loss_tol": loss_tol,
            "param_mismatches": _mismatches(runs[False][1], runs[True][1], rtol, atol),
            "graphs_per_program": [p.graphs for p in programs],
            "runs_per_step": runs_per_step, "programs": [p.name for p in programs],
            "gathers": {"eager": eager_gathers, "compiled": _physical_gathers(programs[0].gm),
                        "plan": _planned_gathers(pmodel.plan)},
            "sources": [p.source for p in programs],
            "eager_collectives": sorted({n.target.__name__.split(".")[0] for p in programs for n in p.gm.graph.nodes
                                         if n.op == "call_function" and "_c10d_functional" in str(n.target)}),
            "compile_seconds": pmodel.compile_seconds, "cache": [p.cache for p in programs],
            "repr": repr(pmodel),
        }
    out["counters"] = compat.compile_counters()
    return out


def _check(results, configs) -> None:
    for rank, res in enumerate(results):
        for label in configs:
            r = res[label]
            eager, compiled = r["losses"]
            assert torch.allclose(torch.tensor(compiled), torch.tensor(eager), **r["loss_tol"]), (label, rank, eager,
                                                                                                   compiled)
            assert not r["param_mismatches"], (label, rank, r["param_mismatches"])
            assert r["compile_seconds"] is not None and r["compile_seconds"] > 0
            assert "program=Inductor" in r["repr"] and "first-step compile" in r["repr"], r["repr"]
            # every collective kind of the eager program is called by the generated code itself
            compiled_kinds = {k for src in r["sources"] for k in COLLECTIVE.findall(src)}
            for kind in r["eager_collectives"]:
                assert any(k.startswith(kind) for k in compiled_kinds), (label, kind, compiled_kinds)  # or its _out/_ form


def _check_one_graph(results, configs) -> None:
    """The whole step is Inductor's code: one Inductor graph per program, compiled once; per step one SPMD
    program run (a pipeline stage: its gather once, forward and backward once per micro-batch, zero bubble's B
    and W too); no Dynamo."""
    for res in results:
        for label in configs:
            r = res[label]
            assert r["graphs_per_program"] and all(g == [1] for g in r["graphs_per_program"]), (label, r)
            expected = [1 if p == "step" or p.endswith("gather") else 2 for p in r["programs"]]   # 2 micro-batches
            assert r["runs_per_step"] == expected, (label, r["programs"], r["runs_per_step"])
        assert not res["counters"].get("graph_break"), res["counters"]["graph_break"]
        assert not res["counters"].get("stats", {}).get("unique_graphs"), res["counters"]["stats"]


@pytest.fixture(scope="module")
def world2():
    """Every world-2 case (`CASES`), trained eager and compiled in one spawn of 2 ranks (dist_cases.run_each:
    a spawn costs each rank seconds of imports and Inductor's start), once for every test that reads them:
    name -> (configs, every rank's result, or the traceback of the rank where it raised)."""
    cases = {name: (make(), configs) for name, (make, configs) in CASES.items()}
    jobs = [(compiled_vs_eager, case.model, models.zoo_batches(case, STEPS), configs)
            for case, configs in cases.values()]
    results = run_distributed(run_each, 2, jobs, timeout=2400)
    return {name: (configs, [r[i] for r in results]) for i, (name, (_, configs)) in enumerate(cases.items())}


def _results(world2, name):
    """`name`'s configs and per-rank results; a rank that raised fails the test with its traceback."""
    configs, results = world2[name]
    errors = [f"rank {rank}:\n{r}" for rank, r in enumerate(results) if isinstance(r, str)]
    assert not errors, f"{name}:\n" + "\n".join(errors)
    return configs, results


@pytest.fixture(scope="module")
def gpt_results(world2):
    return _results(world2, "gpt")


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_equals_eager(name, world2):
    configs, results = _results(world2, name)
    _check(results, configs)
    _check_one_graph(results, configs)
    print({label: [round(r[label]["compile_seconds"], 1) for r in results] for label in configs})


def test_whole_step_is_one_graph(gpt_results):
    _check_one_graph(gpt_results[1], gpt_results[0])


def test_zero3_gathers_as_planned(gpt_results):
    """Compiled ZeRO-3 against its plan. Default overlap ("inductor"): Inductor buckets the parameter gathers
    (fewer than the plan's, never more). Overlap "layers": the generated code starts exactly the plan's gathers,
    one per layer and phase. (Peak memory: benchmarks/compile_overlap.py measures it; on these tiny models a
    step's transients dominate and torch.profiler's peak varies by 1.7x between two ranks running one program.)"""
    for res in gpt_results[1]:
        for label in ("zero3", "zero3 layers"):
            r = res[label]
            gathers, src = r["gathers"], r["sources"][0]
            started = len(re.findall(r"_c10d_functional\.all_gather_into_tensor\w*\.default\(", src))
            assert gathers["plan"] > 4   # several layers, two phases
            if label == "zero3 layers":
                assert started == gathers["compiled"] == gathers["eager"] == gathers["plan"], (started, gathers)
            else:
                assert 1 <= started <= gathers["plan"], (started, gathers)


def test_collectives_stay_asynchronous(gpt_results):
    """zero3 on GPT: in the generated code, compute runs between a collective's start and its wait
    (the wait is sunk to the first use), so the collective overlaps the step's kernels."""
    src = gpt_results[1][0]["zero3"]["sources"][0]
    lines = src.splitlines()
    starts = [i for i, line in enumerate(lines) if re.search(r"_c10d_functional\.(all_gather|reduce_scatter|all_reduce)",
                                                                line)]
    waits = [i for i, line in enumerate(lines) if "_c10d_functional.wait_tensor" in line]
    assert starts and waits
    overlapped = [s for s in starts if any(KERNEL.match(line) for line in lines[s:min(w for w in waits if w > s)])]
    assert overlapped, "every collective is waited on right after it starts"


def test_pipeline_gathers_compiled():
    """pp2 x dp2 with ZeRO-2 inside the stages at world 4: each stage's once-per-step gather program is compiled
    too (one Inductor graph, run once a step) and training equals the eager program."""
    case = models.tiny_gpt(batch=4, seq=16)
    results = run_distributed(compiled_vs_eager, 4, case.model, models.zoo_batches(case, STEPS), PP_DP, timeout=1500)
    _check(results, PP_DP)
    _check_one_graph(results, PP_DP)
    for res in results:
        assert any(p.endswith("gather") for p in res["pp2 x dp2 zero2"]["programs"]), res["pp2 x dp2 zero2"]["programs"]


_CACHE_PROBE = """
import json, torch
from torch.fx.experimental.proxy_tensor import make_fx
from autopar.runtime.compile import CompiledProgram
def f(x, w):
    y = x @ w
    return (torch.relu(y) * 2).sum(), y.t()
x, w = torch.randn(8, 8), torch.randn(8, 8)
program = CompiledProgram(make_fx(f)(x, w), "probe")
torch.testing.assert_close(program(x, w)[0], f(x, w)[0])
print(json.dumps({"cache": program.cache, "graphs": program.graphs}))
"""


def test_second_process_hits_fx_graph_cache(tmp_path):
    """A restarted job compiling the same program loads it from Inductor's FX graph cache (a fresh cache dir:
    the first process misses and writes it, the second hits)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    runs = [json.loads(subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=env, capture_output=True, text=True,
                                      check=True, timeout=600).stdout.splitlines()[-1]) for _ in range(2)]
    assert runs[0]["cache"] == {"hit": 0, "miss": 1, "bypass": 0}, runs
    assert runs[1]["cache"] == {"hit": 1, "miss": 0, "bypass": 0}, runs
    assert runs[0]["graphs"] == runs[1]["graphs"] == [1]


def test_cuda_graphs_need_cuda():
    """compile="cudagraphs" runs only on CUDA: on CPU autopar says so (InputError), at resolve time and in the
    program itself; recorded graphs are for one set of shapes, another raises InputError."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopar.errors import InputError
    from autopar.runtime.compile import CompiledProgram, resolve
    assert resolve("cudagraphs", "cuda") == "cudagraphs"
    with pytest.raises(InputError, match="CUDA graphs need CUDA"):
        resolve("cudagraphs", "cpu")
    x = torch.randn(4, 4)
    program = CompiledProgram(make_fx(lambda a: (a * 2,))(x), cuda_graphs=True)
    with pytest.raises(InputError, match="CUDA graphs need CUDA tensors"):
        program(x)
    program._key = ((tuple(x.shape), x.stride(), x.dtype),)   # as if recorded for x's shapes
    with pytest.raises(InputError, match="static shapes"):
        program(torch.randn(8, 4))
def test_compile_option_is_checked():
    from autopar.errors import InputError
    from autopar.runtime.compile import DEFAULT, resolve
    assert resolve(None, "cpu") is DEFAULT["cpu"] and resolve(None, "cuda") is DEFAULT["cuda"]
    assert resolve(True, "cpu") is True and resolve(False, "cuda") is False
    with pytest.raises(InputError, match="compile="):
        resolve("yes", "cpu")
