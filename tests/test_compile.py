"""compile=True: each rank's program compiled by Inductor (autopar/runtime/compile.py) trains exactly as the eager
FX program does, and the whole step is one compiled program with its collectives inside.

World 2, 3 AdamW steps, for dp, zero3, tp, auto and a 2-stage pipeline, on the hand-written GPT and on
transformers' Llama: fp32 losses and every parameter afterwards within rtol 1e-4 / atol 1e-5 of the eager
program's (Inductor reorders fp32 sums: ~1e-6 here); bf16 (autocast) as tests/test_mixed_precision.py allows
(losses within half a bf16 ulp, 0.015; parameters within the 3 Adam steps of lr each that a gradient of
another rounding may take: 2 * 3 * lr).

"No graph break": a compiled program is the whole per-rank GraphModule handed to Inductor without Dynamo,
so the honest count is of Inductor graphs per program (one) and of Dynamo's graph breaks (none: Dynamo
never runs); the generated code itself must hold the step's collectives (start and wait), not call back
into Python for them.

Inductor compiles on 2 shared cores are slow (C++ codegen and g++ per kernel): tiny models only, and one
Inductor cache for every rank and test (TORCHINDUCTOR_CACHE_DIR, set below unless the caller set one; its
FX graph cache also serves a later session). Measured for this file: 1 min 47 s with a warm cache (load 3-5;
first compiles 1-7 s), 11 min from a cold one at load 10-15 (first compiles 40-80 s each).
"""
from __future__ import annotations

import copy
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "autopar_inductor_cache"))

from autopar._testing import models  # noqa: E402
from autopar._testing.dist_cases import LR, train_steps  # noqa: E402
from autopar._testing.dist_utils import run_distributed  # noqa: E402

STEPS = 3
BF16_LOSS_ATOL = 0.015      # half a bf16 ulp of a loss in [4, 8), as tests/test_mixed_precision.py
BF16_PARAM_ATOL = 2 * STEPS * LR
COLLECTIVE = re.compile(r"_c10d_functional\.(\w+)\.default")
KERNEL = re.compile(r"^\s+(cpp_fused_\w+|extern_kernels\.\w+)\(", re.M)

MODELS = {"gpt": lambda: models.tiny_gpt(batch=4, seq=16), "llama": lambda: models.tiny_llama(batch=4, seq=16)}
CONFIGS = {"dp": dict(strategy="dp"), "zero3": dict(strategy="zero3"), "tp": dict(strategy="tp"),
           "auto": dict(strategy="auto"), "pp2": dict(num_stages=2, schedule="1f1b", num_microbatches=2)}


# ---------------------------------------------------------------- helpers (also run in spawned ranks)

def _programs(pmodel) -> list:
    if hasattr(pmodel, "program"):
        return [pmodel.program]
    return [g for s in pmodel._stages for g in (s.program.forward, s.program.backward)]


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
    from autopar import _torch_compat as compat
    from autopar import autoparallelize
    args, kwargs = batches[0]
    example = tuple(args) + ((kwargs,) if kwargs else ())
    out = {}
    for label, kw in configs.items():
        runs = {}
        for compile in (False, True):
            pmodel = autoparallelize(copy.deepcopy(model), example, baselines=False, compile=compile, **kw)
            losses, _ = train_steps(pmodel, batches, STEPS)
            runs[compile] = losses, {k: v.clone() for k, v in pmodel.full_state_dict().items()}
        bf16 = kw.get("mixed_precision") == "bf16"
        rtol, atol = (0.0, BF16_PARAM_ATOL) if bf16 else (1e-4, 1e-5)
        loss_tol = dict(rtol=0.0, atol=BF16_LOSS_ATOL) if bf16 else dict(rtol=1e-4, atol=1e-5)
        programs = _programs(pmodel)
        out[label] = {
            "losses": (runs[False][0], runs[True][0]), "loss_tol": loss_tol,
            "param_mismatches": _mismatches(runs[False][1], runs[True][1], rtol, atol),
            "graphs_per_program": [p.graphs for p in programs],
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
            assert r["graphs_per_program"] and all(g == [1] for g in r["graphs_per_program"]), (label, r)
            assert r["compile_seconds"] is not None and r["compile_seconds"] > 0
            assert "program=Inductor" in r["repr"], r["repr"]
            # every collective kind of the eager program is called by the generated code itself
            compiled_kinds = {k for src in r["sources"] for k in COLLECTIVE.findall(src)}
            for kind in r["eager_collectives"]:
                assert any(k.startswith(kind) for k in compiled_kinds), (label, kind, compiled_kinds)  # or its _out/_ form
        # no Dynamo anywhere: nothing for a graph break to cut
        assert not res["counters"].get("graph_break"), res["counters"]["graph_break"]
        assert not res["counters"].get("stats", {}).get("unique_graphs"), res["counters"]["stats"]


@pytest.mark.parametrize("name", list(MODELS))
def test_compiled_equals_eager(name):
    case = MODELS[name]()
    batches = models.zoo_batches(case, STEPS)
    configs = dict(CONFIGS)
    if name == "gpt":
        configs["dp bf16"] = dict(strategy="dp", mixed_precision="bf16")
    results = run_distributed(compiled_vs_eager, 2, case.model, batches, configs, timeout=1500)
    _check(results, configs)
    print({label: [round(r[label]["compile_seconds"], 1) for r in results] for label in configs})


def test_collectives_stay_asynchronous():
    """zero3 on GPT: in the generated code, compute runs between a parameter gather's start and its wait
    (the wait is sunk to the first use), so the collective overlaps the step's kernels."""
    case = MODELS["gpt"]()
    batches = models.zoo_batches(case, STEPS)
    results = run_distributed(compiled_vs_eager, 2, case.model, batches, {"zero3": CONFIGS["zero3"]}, timeout=900)
    src = results[0]["zero3"]["sources"][0]
    lines = src.splitlines()
    starts = [i for i, line in enumerate(lines) if re.search(r"_c10d_functional\.(all_gather|reduce_scatter|all_reduce)",
                                                                line)]
    waits = [i for i, line in enumerate(lines) if "_c10d_functional.wait_tensor" in line]
    assert starts and waits
    overlapped = [s for s in starts if any(KERNEL.match(line) for line in lines[s:min(w for w in waits if w > s)])]
    assert overlapped, "every collective is waited on right after it starts"


def test_compile_option_is_checked():
    from autopar.errors import InputError
    from autopar.runtime.compile import DEFAULT, resolve
    assert resolve(None, "cpu") is DEFAULT["cpu"] and resolve(None, "cuda") is DEFAULT["cuda"]
    assert resolve(True, "cpu") is True and resolve(False, "cuda") is False
    with pytest.raises(InputError, match="compile="):
        resolve("yes", "cpu")
