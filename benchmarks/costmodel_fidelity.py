"""Cost-model fidelity: each plan's predicted step time beside its measured one, same GPT, gloo.

    torchrun --nproc_per_node 2 benchmarks/costmodel_fidelity.py                     # calibrate, then measure
    torchrun --nproc_per_node 2 benchmarks/costmodel_fidelity.py --profile p.json    # reuse a profile
    torchrun --nproc_per_node 2 benchmarks/costmodel_fidelity.py --hardware cpu      # the uncalibrated preset
    torchrun --nproc_per_node 2 benchmarks/costmodel_fidelity.py --categories        # + ms per category of op
    torchrun --nproc_per_node 2 benchmarks/costmodel_fidelity.py --compile --plans dp,zero3,tp,auto
                                                   # + each plan compiled by Inductor, priced as compiled

The job first calibrates this machine (`autopar.calibration.measure.calibrate`, the same code as
`autopar calibrate`) unless given a profile, then plans dp, zero3, tp, auto and a 2-stage 1F1B
pipeline ("pp", 4 micro-batches) on a mesh of the world with that profile, builds each with
`autoparallelize`, and times zero_grad + train_step + AdamW step (warm-up steps, then the
variants take turns; a step is the slowest rank's; the median is shown).

On a shared machine the speed of the cores changes from minute to minute, so a calibration made
once and measurements made later disagree by the load's change, not by the model's error. By
default the job therefore calibrates again before every round (under the same load as that
round's steps) and prices every plan with one profile fitted from all the rounds' timings
(`--calibrate once`: the first calibration only). It prints prediction, measurement, signed error,
the Spearman rank correlation of the two orderings, and the load average.

`--compile` also builds every SPMD plan with `autoparallelize(compile=True)` ("dp/compiled", ...): each rank's
program compiled by Inductor (its first step compiles, untimed), planned and priced as the compiled program
(`autopar.plan(..., compile=True)`: views free, fused chains, the profile's compiled per-kernel figures).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
from step_time import Variant, timed_step, warm_up

import autopar
from autopar import autoparallelize
from autopar._testing.gpt import GPT, GPTConfig
from autopar.calibration.measure import Calibration, build_profile, calibrate, size_range
from autopar.costmodel.hardware import HardwareSpec, get_hardware

PLANS = ("dp", "zero3", "tp", "auto", "pp")
# plan name -> autoparallelize / plan keywords
PLAN_KWARGS = {"pp": dict(num_stages=2, schedule="1f1b", num_microbatches=4)}


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


def measure_hardware(args, quiet: bool = False) -> Calibration | None:
    """A calibration now (None when a profile or preset is given instead)."""
    if args.profile or args.hardware:
        return None
    return calibrate(sizes=size_range("1K", args.max_bytes), iters=args.calib_iters,
                     progress=(lambda msg: None) if quiet else None)


def pooled(calibrations: list[Calibration]) -> HardwareSpec:
    """One profile from several calibrations: links fitted to all their timings, compute figures and in-step
    scales (eager and compiled) the median of theirs."""
    first = calibrations[0]
    med = {name: statistics.median(getattr(c, name) for c in calibrations)
           for name in ("matmul_flops", "mem_bandwidth", "op_overhead", "param_step_overhead", "transcendental_rate",
                        "attention_flops", "attention_backward_flops", "sync_latency", "fused_step_overhead",
                        "compiled_op_overhead", "compiled_mem_bandwidth")}
    spec = build_profile(first.spec, [s for c in calibrations for s in c.samples], matmul_flops=med["matmul_flops"],
                         mem_bandwidth=med["mem_bandwidth"], op_overhead=med["op_overhead"],
                         devices_per_node=first.spec.devices_per_node, name=first.spec.name,
                         param_step_overhead=med["param_step_overhead"],
                         transcendental_rate=med["transcendental_rate"], attention_flops=med["attention_flops"],
                         attention_backward_flops=med["attention_backward_flops"], sync_latency=med["sync_latency"],
                         fused_step_overhead=med["fused_step_overhead"],
                         compiled_op_overhead=med["compiled_op_overhead"],
                         compiled_mem_bandwidth=med["compiled_mem_bandwidth"])
    return replace(spec, **{name: statistics.median(getattr(c.spec, name) for c in calibrations)
                            for name in ("in_step_scale", "compiled_in_step_scale")})


def build(model, example, mesh, name: str, compiled: bool = False) -> Variant:
    strategy = "auto" if name in PLAN_KWARGS else name
    pmodel = autoparallelize(copy.deepcopy(model), example, mesh=mesh, strategy=strategy, baselines=False,
                             compile=compiled, **PLAN_KWARGS.get(name, {}))
    v = Variant(name + ("/compiled" if compiled else ""), strategy, pmodel,
                lambda x, y, m=pmodel: m.train_step(x, y).item(), compiled=compiled)
    v.predicted = pmodel.plan.predicted_step_time
    v.plan = pmodel.plan
    v.compute_comm = (v.plan.predicted_compute_time, v.plan.predicted_comm_time)
    v.note = ""
    return v


def spmd_totals(model, example, plan, mesh) -> dict | None:
    """The cost model's totals for the very choices of the SPMD `plan`, priced on `mesh`: every
    node gets the strategy the plan names (planning again could break a near-tie differently).
    None when a choice is not among the node's candidates."""
    from autopar.planning import assemble
    found = spmd_choice(model, example, plan, mesh.for_program(plan.mesh.hardware.compiled))
    return None if found is None else assemble.totals(*found)


def spmd_choice(model, example, plan, mesh):
    """(CostProblem priced on `mesh`, the strategy index of every node that the SPMD `plan` names), or None."""
    from autopar.capture.canonicalize import canonicalize
    from autopar.capture.trace import capture
    from autopar.planning import assemble
    from autopar.planning.problem import ProblemBuilder
    captured = capture(copy.deepcopy(model), example)
    canonicalize(captured.gm)
    prob = ProblemBuilder(captured, mesh, prune=False).build()
    choice = []
    for i, node in enumerate(prob.nodes):
        want = plan.nodes[node.name]
        param = next((n for n, j in prob.param_index.items() if j == i), None)
        for k, st in enumerate(prob.strategies[i]):
            outs = tuple(assemble.spec_strs(o) for o in st.outs)
            ins = tuple(assemble.spec_strs(x) for x in st.ins)
            if (outs, ins) != (want.outs, want.ins):
                continue
            if param is not None:
                p = plan.params[param]
                if (assemble.spec_strs(st.master), tuple(st.modes)) != (p.master, p.modes):
                    continue
            choice.append(k)
            break
        else:
            return None
    return prob, np.array(choice)


def reprice(v: Variant, model, example, mesh) -> None:
    """Predict `v`'s plan on `mesh` (the pooled profile): SPMD plans by pricing their choices
    (`spmd_totals`), pipelines by planning again (same stages and choices required). Otherwise the
    prediction of the first calibration stays, and the note says so."""
    if len(v.plan.stages) <= 1:
        tot = spmd_totals(model, example, v.plan, mesh)
        if tot is not None:
            v.predicted = tot["step"]
            v.compute_comm = (tot["compute"], tot["comm"])
            return
    else:
        again = autopar.plan(copy.deepcopy(model), example, mesh=mesh, strategy=v.kind, baselines=False,
                             **PLAN_KWARGS.get(v.name, {}))
        same_stages = [(s.modules, s.ranks) for s in again.stages] == [(s.modules, s.ranks) for s in v.plan.stages]
        if same_stages and again.params == v.plan.params and again.nodes == v.plan.nodes:
            v.predicted = again.predicted_step_time
            v.compute_comm = (again.predicted_compute_time, again.predicted_comm_time)
            return
    v.note = " (not repriced: first calibration's prediction)"


def report(variants: list[Variant]) -> str:
    lines = [f"{'plan':<15}{'predicted s':>12}{'measured s':>12}{'error':>9}   compute / comm predicted",
             "-" * 77]
    for v in variants:
        med = statistics.median(v.times)
        lines.append(f"{v.name:<15}{v.predicted:>12.4f}{med:>12.4f}{(v.predicted - med) / med:>+9.1%}   "
                     f"{v.compute_comm[0]:.4f} / {v.compute_comm[1]:.4f}{v.note}")
    pred = [v.predicted for v in variants]
    meas = [statistics.median(v.times) for v in variants]
    worst = max(abs(p - m) / m for p, m in zip(pred, meas))
    lines.append(f"max |error| {worst:.1%} (target 25%); Spearman rank correlation {spearman(pred, meas):.2f} "
                 f"(target 0.8)")
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
    p.add_argument("--compile", action="store_true",
                   help="also run each SPMD plan compiled by Inductor (compile=True), priced as compiled")
    p.add_argument("--calibrate", choices=("every-round", "once"), default="every-round",
                   help="calibrate again before each round (default) or only before the first")
    p.add_argument("--categories", action="store_true",
                   help="after the rounds, profile a few steps of each plan and print predicted against measured "
                        "milliseconds per category (matmul, attention, collectives, copies, ...; step_categories.py)")
    args = p.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    load = [os.getloadavg()[0]]
    calibrations = [c for c in [measure_hardware(args)] if c is not None]
    hw = calibrations[0].spec if calibrations else get_hardware(args.profile or args.hardware)
    if rank == 0 and calibrations:
        print(calibrations[0].summary(), flush=True)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads,
                       n_embd=args.embd)
    model = GPT(config)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, args.vocab, (args.batch, args.block), generator=gen),
                torch.randint(0, args.vocab, (args.batch, args.block), generator=gen)) for _ in range(4)]
    mesh = autopar.Mesh((world,), hardware=hw)
    names = args.plans.split(",")
    variants = [build(model, batches[0], mesh, s) for s in names]
    if args.compile:
        variants += [build(model, batches[0], mesh, s, compiled=True) for s in names if s not in PLAN_KWARGS]
    variants = [v for v in variants if warm_up(v, batches, args.warmup, rank)]
    for r in range(args.rounds):
        if r and calibrations and args.calibrate == "every-round":
            calibrations.append(measure_hardware(args, quiet=True))
        load.append(os.getloadavg()[0])
        for v in variants:
            for i in range(args.steps):
                timed_step(v, *batches[i % len(batches)])   # appends the slowest rank's wall time
    if calibrations:
        hw = pooled(calibrations)
        if args.save_profile and rank == 0:
            hw.save(args.save_profile)
    if rank == 0:
        if len(calibrations) > 1:
            for v in variants:
                reprice(v, model, batches[0], autopar.Mesh((world,), hardware=hw))
            print(f"pooled profile of {len(calibrations)} calibrations: matmul "
                  f"{hw.flops('float32') * hw.compute_efficiency / 1e9:.1f} GFLOP/s, pointwise "
                  f"{hw.mem_bandwidth / 1e9:.1f} GB/s, exp/tanh/gelu {hw.transcendental_rate / 1e6:.0f} M elements/s, "
                  f"op overhead {hw.op_overhead * 1e6:.2f} µs (compiled: {hw.compiled_op_overhead * 1e6:.2f} µs per "
                  f"kernel, fused chains {hw.compiled_mem_bandwidth / 1e9:.1f} GB/s), in-step scales "
                  f"x{hw.in_step_scale:.2f} eager, x{hw.compiled_in_step_scale:.2f} compiled, "
                  f"{hw.param_step_overhead * 1e6:.0f} µs per parameter "
                  f"tensor per step, {hw.sync_latency * 1e6:.0f} µs per collective reached from compute, "
                  f"attention at {hw.attention_efficiency:.2f} (forward) and "
                  f"{hw.attention_backward_efficiency:.2f} (backward) of the matmul's FLOP/s", flush=True)
        print(f"world {world}, threads/rank {torch.get_num_threads()}, hardware {hw.name}, GPT {args.layers}L "
              f"{args.embd}d {args.heads}h vocab {args.vocab}, batch {args.batch}x{args.block}, "
              f"median of {args.rounds * args.steps} steps; load average (1 min) "
              f"{min(load):.1f}-{max(load):.1f} over the run")
        print(report(variants), flush=True)
    if args.categories:
        print_categories(variants, model, batches, autopar.Mesh((world,), hardware=hw), rank, world)
    dist.destroy_process_group()


def print_categories(variants, model, batches, mesh, rank: int, world: int) -> None:
    """Per plan, `step_categories.table`: the cost model's seconds per category of op (SPMD plans)
    beside each rank's profiled self CPU time, so a gap can be traced to what is mispriced."""
    import step_categories
    for v in variants:
        mine, _, faulted = step_categories.measured(v.step, batches)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, (mine, faulted))
        if rank == 0:
            found = spmd_choice(model, batches[0], v.plan, mesh) if len(v.plan.stages) <= 1 else None
            pred = step_categories.predicted(*found) if found is not None else None
            print(step_categories.table(v.name, pred, [m for m, _ in per_rank], [f for _, f in per_rank]), flush=True)


if __name__ == "__main__":
    main()
