"""Cost-model fidelity: each plan's predicted step time beside its measured one, same GPT, gloo.

    torchrun --nproc_per_node 2 benchmarks/costmodel_fidelity.py                     # calibrate, then measure
    torchrun --nproc_per_node 2 benchmarks/costmodel_fidelity.py --profile p.json    # reuse a profile
    torchrun --nproc_per_node 2 benchmarks/costmodel_fidelity.py --hardware cpu      # the uncalibrated preset

The job first calibrates this machine (`autopar.calibrate.calibrate`, the same code as
`autopar calibrate`) unless given a profile, then plans dp, zero3, tp and auto on a mesh of the
world with that profile, builds each with `autoparallelize(..., plan=...)`, and times
zero_grad + train_step + AdamW step (warm-up steps, then the variants take turns; a step is the
slowest rank's; the median is shown). It prints prediction, measurement, signed error and the
Spearman rank correlation of the two orderings. Pipelined plans do not exist yet and are skipped.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import autopar  # noqa: E402
from autopar.calibrate import calibrate, size_range  # noqa: E402
from autopar.costmodel.hardware import get_hardware  # noqa: E402
from autopar.runtime import autoparallelize  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from step_time import Variant, timed_step, warm_up  # noqa: E402

PLANS = ("dp", "zero3", "tp", "auto")


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho: Pearson correlation of the ranks (ties share their mean rank)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def hardware(args, rank: int):
    """The profile to plan with: loaded, a preset, or calibrated now (and optionally saved)."""
    if args.profile:
        return get_hardware(args.profile)
    if args.hardware:
        return get_hardware(args.hardware)
    result = calibrate(sizes=size_range("1K", args.max_bytes), iters=args.calib_iters)
    if rank == 0:
        print(result.summary(), flush=True)
        if args.save_profile:
            result.spec.save(args.save_profile)
    return result.spec


def build(model, example, mesh, strategy: str) -> Variant:
    pmodel = autoparallelize(copy.deepcopy(model), example, mesh=mesh, strategy=strategy, baselines=False)
    v = Variant(strategy, strategy, pmodel, lambda x, y, m=pmodel: m.train_step(x, y).item())
    v.predicted = pmodel.plan.predicted_step_time
    v.plan = pmodel.plan
    return v


def report(variants: list[Variant]) -> str:
    lines = [f"{'plan':<8}{'predicted s':>12}{'measured s':>12}{'error':>9}   compute / comm predicted",
             "-" * 70]
    for v in variants:
        med = statistics.median(v.times)
        lines.append(f"{v.name:<8}{v.predicted:>12.4f}{med:>12.4f}{(v.predicted - med) / med:>+9.1%}   "
                     f"{v.plan.predicted_compute_time:.4f} / {v.plan.predicted_comm_time:.4f}")
    pred = [v.predicted for v in variants]
    meas = [statistics.median(v.times) for v in variants]
    worst = max(abs(p - m) / m for p, m in zip(pred, meas))
    lines.append(f"max |error| {worst:.1%} (target 25%); Spearman rank correlation {spearman(pred, meas):.2f} "
                 f"(target 0.8); pipelined plans: not implemented yet, skipped")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="predicted vs measured step time per plan")
    p.add_argument("--profile", help="a saved hardware profile (JSON); default: calibrate now")
    p.add_argument("--hardware", help="a preset instead of calibrating (e.g. cpu)")
    p.add_argument("--save-profile", help="write the calibrated profile here")
    p.add_argument("--max-bytes", default="16M", help="largest calibration message")
    p.add_argument("--calib-iters", type=int, default=5)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps per plan per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--plans", default=",".join(PLANS))
    args = p.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    hw = hardware(args, rank)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads,
                       n_embd=args.embd)
    model = GPT(config)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, args.vocab, (args.batch, args.block), generator=gen),
                torch.randint(0, args.vocab, (args.batch, args.block), generator=gen)) for _ in range(4)]
    mesh = autopar.Mesh((world,), hardware=hw)
    variants = [build(model, batches[0], mesh, s) for s in args.plans.split(",")]
    variants = [v for v in variants if warm_up(v, batches, args.warmup, rank)]
    for _ in range(args.rounds):
        for v in variants:
            v.times += [timed_step(v, *batches[i % len(batches)]) for i in range(args.steps)]
    if rank == 0:
        print(f"world {world}, threads/rank {torch.get_num_threads()}, hardware {hw.name}, GPT {args.layers}L "
              f"{args.embd}d {args.heads}h vocab {args.vocab}, batch {args.batch}x{args.block}, "
              f"median of {args.rounds * args.steps} steps")
        print(report(variants), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
