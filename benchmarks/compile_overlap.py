"""Compiled programs: which collective overlap is fastest, and what each does to a ZeRO-3 step's gathers and memory.

    torchrun --nproc_per_node 2 benchmarks/compile_overlap.py [--only dp,zero3,tp] [--rounds 4 --steps 4]

For each strategy, `autoparallelize(..., compile=True)` once per overlap mode of `autopar.runtime.compile.OVERLAP`
(AUTOPAR_COMPILE_OVERLAP while it is built):
  inductor  Inductor buckets every collective kind (25 MB) and reorders comm against compute
  layers    ZeRO-3 gathers one per layer and phase, as the plan prices (autopar's bucket_layer_gathers);
            Inductor buckets the reductions and reorders
  program   autopar's emitted order and per-layer gathers; Inductor's bucketing and reordering off
Same GPT, batches and timing as benchmarks/step_time.py (its Variant, warm-up and slowest-rank timing;
rounds rotate the variants). Prints per variant the median step (wall and CPU, slowest rank), the paired
median ratio against the `inductor` mode of the same strategy, the collectives the generated code starts
(all_gather / reduce_scatter / all_reduce) against the physical ones the plan prices, and the step's peak
of CPU memory allocated above the parameters (torch.profiler's memory events, rank 0, one step).
"""
from __future__ import annotations

import argparse
import copy
import os
import re
import statistics

import torch
import torch.distributed as dist
from step_time import Variant, timed_step, warm_up

from autopar import autoparallelize
from autopar._testing.gpt import GPT, GPTConfig
from autopar.graph import layer_of
from autopar.mesh import Mesh
from autopar.runtime.compile import OVERLAP

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
STARTED = re.compile(r"_c10d_functional\.(all_gather|reduce_scatter|all_reduce)\w*\.default\(")


def started(pmodel) -> dict[str, int]:
    """Collectives the generated code starts, by kind."""
    found = STARTED.findall(pmodel.program.source)
    return {k: found.count(k) for k in KINDS}


def planned_gathers(plan) -> int:
    """The all-gathers the plan prices: one per (phase, axis, layer) for a numbered layer's parameters, one per
    use elsewhere (autopar/planning/problem.py's gather_share)."""
    return len({(c.phase, c.axis, layer_of(c.module) or (c.module, c.source)) for c in plan.collectives
                if c.kind == "all_gather"})


def peak_step_bytes(v: Variant, x, y, repeats: int = 3) -> int:
    """Peak CPU bytes allocated during a step above what was allocated before it (torch.profiler; the median
    of `repeats` steps)."""
    return int(statistics.median(_peak_once(v, x, y) for _ in range(repeats)))


def _peak_once(v: Variant, x, y) -> int:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        v.step(x, y)
    live = peak = 0
    leaves = [e for e in prof.events() if not e.cpu_children]   # an op's figure includes its children's
    for e in sorted(leaves, key=lambda e: e.time_range.start):
        live += e.cpu_memory_usage
        peak = max(peak, live)
    return peak


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="dp,zero3,tp")
    p.add_argument("--modes", default=",".join(OVERLAP), help=f"of {list(OVERLAP)} and eager (compile=False)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=2048, block_size=args.block, n_layer=args.layers, n_head=4, n_embd=args.embd))
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 2048, (args.batch, args.block), generator=gen),
                torch.randint(0, 2048, (args.batch, args.block), generator=gen)) for _ in range(4)]
    variants = []
    for strategy in args.only.split(","):
        for mode in args.modes.split(","):
            os.environ["AUTOPAR_COMPILE_OVERLAP"] = "inductor" if mode == "eager" else mode
            pm = autoparallelize(copy.deepcopy(model), batches[0], mesh=Mesh((world,), hardware="cpu"),
                                 strategy=strategy, compile=mode != "eager")
            v = Variant(f"{strategy} [{mode}]", strategy, pm, lambda x, y, m=pm: m.train_step(x, y).item(),
                        foreach=True, compiled=True)
            v.mode, v.plan = mode, pm.plan
            variants.append(v)
    os.environ.pop("AUTOPAR_COMPILE_OVERLAP")
    variants = [v for v in variants if warm_up(v, batches, 2, rank)]
    for v in variants:
        v.peak = peak_step_bytes(v, *batches[0])
    for r in range(args.rounds):
        turn = r % len(variants)
        for v in variants[turn:] + variants[:turn]:
            for i in range(args.steps):
                timed_step(v, *batches[i % len(batches)])
    if rank == 0:
        print(f"world {world}, GPT {args.layers}L {args.embd}d, batch {args.batch}x{args.block}, load "
              f"{os.getloadavg()}")
        print(f"{'variant':<20}{'median s':>9}{'cpu s':>8}{'paired vs inductor':>20}{'first s':>8}"
              f"{'peak MB':>9}  started AG/RS/AR (plan's AG)")
        for v in variants:
            base = next(b for b in variants if b.kind == v.kind and b.mode == "inductor")
            ratios = [a / b for a, b in zip(v.times, base.times)]
            wins = sum(r < 1 for r in ratios)
            counts = started(v.module) if v.mode != "eager" else {k: 0 for k in KINDS}
            planned = planned_gathers(v.plan)
            print(f"{v.name:<20}{statistics.median(v.times):>9.3f}{statistics.median(v.cpu_times):>8.3f}"
                  f"{statistics.median(ratios):>12.3f}, {wins:>2}/{len(ratios)}{v.first_s:>8.1f}"
                  f"{v.peak / 2**20:>9.1f}  {counts['all_gather']}/{counts['reduce_scatter']}/{counts['all_reduce']}"
                  f" ({planned})")
        print(f"load at the end {os.getloadavg()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
