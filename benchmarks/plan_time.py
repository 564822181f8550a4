"""Planning time and peak memory per phase for real-size model shapes (meta device, no weights).

    python benchmarks/plan_time.py                 # every case, each in a fresh subprocess
    python benchmarks/plan_time.py --case gpt2-8   # one case in this process
    python benchmarks/plan_time.py --profile llama3-8b-64   # cProfile, top 30 by cumulative time
    python benchmarks/plan_time.py --case llama3-70b-bf16-64 --summary out.txt   # and the plan's summary

Prints capture / canonicalize / strategies+costs / baselines / solve / search / total seconds
(plan.timings), the wall and CPU seconds of the whole `autopar.plan` call (plan_wall, plan_cpu: what
the phases leave out, and a figure less sensitive to a loaded machine than wall time), the CPU seconds and
peak RSS of the layout search's bound worker, a forked process on the second CPU (worker_cpu, worker_rss_mb:
`autopar/pipeline/bound_worker.py`; AUTOPAR_PLAN_WORKER=0 plans without it) and peak RSS (ru_maxrss of the
case's own process). Every case is the default call
(`autopar.plan(model, inputs, mesh=Mesh((N // 8, 8)), memory_budget="80GB")`, the layout search
included); the "-bf16" cases add mixed_precision="bf16" (issue 27's targets: Llama-3-8B (batch 64 x 4096)
on 64 < 15 s; Llama-3-70B (32 x 4096) on 64 < 30 s and on 512 < 60 s; Llama-3.1-405B (2048 x 8192)
on 2048 < 180 s; peak RSS < 8 GB).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import warnings

PHASES = ("capture", "canonicalize", "strategies+costs", "baselines", "solve", "search", "total", "plan_wall",
          "plan_cpu", "worker_cpu")
CASES = ("gpt2-8", "gpt2-64", "llama3-8b-8", "llama3-8b-64", "llama3-70b-512", "llama3-405b-512",
         "llama3-8b-bf16-64", "llama3-70b-bf16-64", "llama3-70b-bf16-512", "llama3-405b-bf16-2048")


def _mesh(devices: int):
    import autopar
    if devices == 8:
        return autopar.Mesh((8,), hardware="h100")
    return autopar.Mesh((devices // 8, 8), axis_names=("dp", "tp"), hardware="h100", devices_per_node=8)


def run_case(name: str, summary: str | None = None) -> dict:
    import autopar
    from autopar._testing import models
    model_name, devices = name.rsplit("-", 1)
    bf16 = model_name.endswith("-bf16")
    model_name = model_name.removesuffix("-bf16")
    builders = {"gpt2": models.meta_gpt2_124m, "llama3-8b": models.meta_llama3_8b,
                "llama3-70b": lambda: models.meta_llama3_70b(batch=64, seq=4096),
                "llama3-405b": lambda: models.meta_llama3_405b(batch=16, seq=4096)}
    if bf16:   # issue 27's shapes
        builders.update({"llama3-8b": lambda: models.meta_llama3_8b(batch=64, seq=4096),
                         "llama3-70b": lambda: models.meta_llama3_70b(batch=32, seq=4096),
                         "llama3-405b": lambda: models.meta_llama3_405b(batch=2048, seq=8192)})
    case = builders[model_name]()
    wall, cpu = time.perf_counter(), time.process_time()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)   # the search's bound worker (a forked process)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(case.model, case.example_inputs, mesh=_mesh(int(devices)), memory_budget="80GB",
                            mixed_precision="bf16" if bf16 else None)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    worker_cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    search = plan.solver.get("search", {})
    if summary:   # the plan on one screen, as a user reads it (plain text)
        with open(summary, "w") as f:
            f.write(plan.summary(rich=False) + "\n")
    return {"case": name, **plan.timings, "plan_wall": wall, "plan_cpu": cpu, "worker_cpu": worker_cpu,
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "worker_rss_mb": after.ru_maxrss / 1024,
            "step_ms": plan.predicted_step_time * 1e3, "mem_gb": plan.memory_per_device / 1e9,
            "solver": plan.solver.get("status", ""), "mesh": str(tuple(plan.mesh.shape)),
            "layout": "x".join(f"{a}{n}" for a, n in zip(plan.mesh.axis_names, plan.mesh.shape)),
            "mfu": plan.predicted_mfu, "schedule": plan.schedule, "microbatches": plan.num_microbatches,
            "recomputed": len(plan.recompute), "priced": search.get("priced", 0), "unexplored": search.get("unexplored", 0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=CASES)
    ap.add_argument("--profile", choices=CASES)
    ap.add_argument("--summary", metavar="FILE", help="with --case: write the plan's summary() to FILE")
    args = ap.parse_args()
    if args.profile:
        import cProfile
        import pstats
        cProfile.runctx("run_case(args.profile)", globals(), {"args": args, "run_case": run_case}, "/tmp/plan.prof")
        pstats.Stats("/tmp/plan.prof").sort_stats("cumulative").print_stats(30)
        return
    if args.case:
        print(json.dumps(run_case(args.case, args.summary)))
        return
    print(f"{'case':<22}" + "".join(f"{p:>17}" for p in PHASES) + f"{'peak RSS MB':>13}{'step ms':>9}{'GB/dev':>8}"
          f"{'MFU':>7}  layout (pipelines priced / left)")
    for name in CASES:
        out = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{name:<22} failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name:<22}" + "".join(f"{row.get(p, 0.0):>17.2f}" for p in PHASES)
              + f"{row['rss_mb']:>13.0f}{row['step_ms']:>9.2f}{row['mem_gb']:>8.2f}{row['mfu'] or 0.0:>7.1%}"
              f"  {row['layout']} ({row['priced']} / {row['unexplored']})", flush=True)


if __name__ == "__main__":
    main()
