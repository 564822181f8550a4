"""Measured training step time: autopar's plans against PyTorch's own parallelism, same GPT.

    torchrun --nproc_per_node 2 benchmarks/step_time.py                  # ~3-5 minutes on 2 shared cores
    torchrun --nproc_per_node 2 benchmarks/step_time.py --profile dp,DDP  # + torch.profiler: time by
                                                                          # category, then by op
    torchrun --nproc_per_node 2 benchmarks/step_time.py --compile         # compiled programs (below)

One step = zero_grad + forward + backward + AdamW step. Every variant is built once, then the
variants take turns (`--rounds` rounds of `--steps` timed steps each, after `--warmup` untimed
steps; each round starts one variant later than the one before) so that load from other processes
on a shared machine hits them all alike. A step's time is
the slowest rank's (all_reduce MAX), and the table shows the median over all timed steps, of wall
time and of CPU time (process time: on an oversubscribed machine wall time mostly measures the other
jobs, CPU time only this step's own work; a rank waiting in a collective sleeps). Below the table,
"paired" sets each autopar step against its counterpart's step of the same round and index, seconds
apart, so that load drift cancels: the median of those ratios and how many steps autopar won; then
what auto chose (its weights' modes) and every recipe's predicted step, cheapest first.

autopar plans for this machine as measured by `autopar calibrate` in the same job (`--hardware`
calibrate, the default; a preset name such as `cpu` or a saved profile instead): the choice of plan
("auto") and the "predicted" column come from that profile. Under the uncalibrated `cpu` preset auto
picks ZeRO-1 over dp (the preset prices an all-gather plus a reduce-scatter like one all-reduce), which
gloo here runs 5-10% slower.

Variants (same seeded GPT, same global batch):
  autopar dp / zero3 / tp / auto   `autoparallelize(model, (x, y), strategy=...)`; every rank passes
                                   the global batch, the plan keeps each rank's slice.
  DDP                              DistributedDataParallel over this rank's half of the batch.
  FSDP2                            `fully_shard` on every block, then the root; this rank's half.
  TP                               `parallelize_module`: ColwiseParallel c_attn / c_fc, RowwiseParallel
                                   attn.c_proj / mlp.c_proj, everything else replicated; full batch.
                                   autopar/_testing/gpt.py's attention reshapes with the global n_head and
                                   splits the fused qkv output in thirds, both wrong on a column
                                   shard, so for TP each block's attention is swapped for
                                   `LocalHeadAttention` (same Linear modules, head count read from
                                   the local width) and c_attn's rows are reordered so that rank r's
                                   contiguous shard holds [q_r; k_r; v_r] (its own heads).

--compile adds, per autopar strategy, `autoparallelize(..., compile=True)` ("autopar dp c": each rank's
program compiled by Inductor, autopar/runtime/compile.py) and puts each native variant under
`torch.compile` ("DDP c", "FSDP2 c", "TP c": forward and backward compiled; Dynamo's DDP optimizer splits
DDP's graph at its buckets, FSDP2's hooks stay eager). A compiled autopar variant is paired with the
compiled native counterpart and with its own eager program; the optimizer step stays eager everywhere.
"first s" is the first (untimed) step: for compiled variants, the compile (Inductor's FX graph cache
serves a rerun: run twice to see the warm figure).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from autopar import autoparallelize
from autopar._testing.gpt import GPT, GPTConfig
from autopar.calibration.measure import calibrate, size_range
from autopar.inspection.summary import header_lines
from autopar.mesh import Mesh

AUTOPAR = ("dp", "zero3", "tp", "auto")
NATIVE = {"dp": "DDP", "zero3": "FSDP2", "tp": "TP"}


class LocalHeadAttention(nn.Module):
    """Causal attention over this rank's heads: widths come from c_attn's (local) output."""

    def __init__(self, attn: nn.Module, head_size: int):
        super().__init__()
        self.c_attn, self.c_proj, self.head_size = attn.c_attn, attn.c_proj, head_size

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTC.shape
        qkv = self.c_attn(x_BTC)
        width = qkv.shape[-1] // 3
        q, k, v = (t.view(B, T, width // self.head_size, self.head_size).transpose(1, 2)
                   for t in qkv.split(width, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, width))


def _interleave_qkv(linear: nn.Linear, world: int) -> None:
    """Reorder the fused [q; k; v] rows so that a contiguous 1/world chunk is [q_r; k_r; v_r]."""
    with torch.no_grad():
        for p in (linear.weight, linear.bias):
            if p is None:
                continue
            q, k, v = (t.chunk(world) for t in p.chunk(3))
            p.copy_(torch.cat([torch.cat([q[r], k[r], v[r]]) for r in range(world)]))


def build_native(kind: str, model: GPT, world: int):
    """The PyTorch-native variant of `model`: (module, takes_local_half_of_batch)."""
    from torch.distributed.device_mesh import init_device_mesh
    model = copy.deepcopy(model)
    if kind == "DDP":
        return nn.parallel.DistributedDataParallel(model), True
    mesh = init_device_mesh("cpu", (world,))
    if kind == "FSDP2":
        from torch.distributed.fsdp import fully_shard
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh), True
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    head_size = model.config.n_embd // model.config.n_head
    for block in model.transformer.h:
        _interleave_qkv(block.attn.c_attn, world)
        block.attn = LocalHeadAttention(block.attn, head_size)
        parallelize_module(block, mesh, {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                                         "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
    return model, False


def _param_groups(module: nn.Module) -> list[dict]:
    """DTensor and plain parameters in separate groups: one foreach call cannot mix them (native TP
    leaves the embeddings and norms outside the blocks as plain tensors)."""
    from torch.distributed.tensor import DTensor
    params = list(module.parameters())
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return [{"params": g} for g in groups if g]


class Variant:
    """One way of training the model: a step function over the global batch, and its timings."""

    def __init__(self, name: str, kind: str, module: nn.Module, step_fn, lr: float = 1e-3, foreach=None,
                 compiled: bool = False):
        self.name, self.kind, self.module, self.compiled = name, kind, module, compiled
        self.first_s = float("nan")
        self.opt = torch.optim.AdamW(_param_groups(module), lr=lr, foreach=foreach)
        self._step_fn = step_fn
        self.times: list[float] = []
        self.cpu_times: list[float] = []   # CPU seconds the step used (slowest rank): robust to load
        self.opt_times: list[float] = []   # this rank's optimizer step alone
        self.losses: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = self._step_fn(x, y)
        t0 = time.perf_counter()
        self.opt.step()
        self.opt_times.append(time.perf_counter() - t0)
        return loss


def make_variants(model: GPT, example, world: int, rank: int, which: list[str], foreach=None,
                  hardware="cpu", compile_modes: tuple = (False,)) -> list[Variant]:
    """autopar's variants (each in every mode of `compile_modes`), then the native ones (under torch.compile
    when True is among the modes)."""
    out = []
    mesh = Mesh((world,), hardware=hardware)
    for strategy, compiled in [(s, c) for s in AUTOPAR if s in which for c in compile_modes]:
        t0 = time.perf_counter()
        pmodel = autoparallelize(copy.deepcopy(model), example, mesh=mesh, strategy=strategy, compile=compiled)
        v = Variant(f"autopar {strategy}" + (" c" if compiled else ""), strategy, pmodel,
                    lambda x, y, m=pmodel: m.train_step(x, y).item(), foreach=foreach, compiled=compiled)
        v.setup_s = time.perf_counter() - t0
        v.predicted = pmodel.plan.predicted_step_time
        v.plan = pmodel.plan
        out.append(v)
    native_compiled = True in compile_modes
    for strategy, kind in NATIVE.items():
        if kind not in which:
            continue
        t0 = time.perf_counter()
        module, local = build_native(kind, model, world)
        if native_compiled:
            module = torch.compile(module)

        def fn(x, y, m=module, local=local):
            if local:
                x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            loss = m(x, y)
            loss.backward()
            return loss.item()
        v = Variant(kind + (" c" if native_compiled else ""), strategy, module, fn, foreach=foreach,
                    compiled=native_compiled)
        v.setup_s, v.predicted = time.perf_counter() - t0, None
        out.append(v)
    return out


def warm_up(v: Variant, batches, steps: int, rank: int) -> bool:
    """Untimed steps; a variant that raises (on every rank alike: same plan, same shapes) is dropped
    from the table with its error, so one broken plan does not hide the other figures."""
    error = ""
    try:
        for i in range(steps):
            t0 = time.perf_counter()
            v.step(*batches[i % len(batches)])
            if i == 0:
                v.first_s = time.perf_counter() - t0
    except Exception as e:  # reported, not hidden: the table says which variant failed and why
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    failed = torch.tensor([1.0 if error else 0.0])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item() and rank == 0:
        print(f"{v.name} FAILED and is left out: {error or 'on another rank'}", flush=True)
    return not failed.item()


def timed_step(v: Variant, x, y) -> None:
    """Wall time barrier to barrier and this process's CPU time (all threads), each the slowest rank's.
    On a shared, oversubscribed machine the wall time mostly measures the other jobs; CPU time
    counts only the work this step did (waits in collectives sleep and are not counted)."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    v.losses.append(v.step(x, y))
    dt = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    v.times.append(dt[0].item())
    v.cpu_times.append(dt[1].item())


def profile_step(v: Variant, x, y, rank: int, top: int = 22, steps: int = 3) -> str:
    """torch.profiler over `steps` steps of `v` on every rank; returns rank 0's split by category
    (`categories`) and its table of ops by own CPU time (aten kernels, collectives and their waits,
    Python-level wrappers)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            for phase, fn in (("zero_grad", lambda: v.opt.zero_grad(set_to_none=True)),
                              ("forward+backward", lambda: v._step_fn(x, y)), ("optimizer", v.opt.step)):
                with record_function(PHASE + phase):
                    fn()
    if rank != 0:
        return ""
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=48)
    return categories(prof.events(), steps) + "\n\n" + table


PHASE = "step_time: "
COLLECTIVE = ("c10d::", "_c10d_functional::", "gloo:", "nccl:")
WRAP = ("_ToTorchTensor", "_FromTorchTensor", "AccumulateGrad", "PythonSubclass")
LAYOUT = {"copy_", "clone", "detach", "alias", "view", "_unsafe_view", "t", "permute", "transpose", "as_strided",
          "expand", "reshape", "contiguous", "slice", "select", "unsqueeze", "squeeze", "split", "split_with_sizes",
          "empty", "empty_like", "empty_strided", "zeros", "fill_", "zero_", "unflatten", "flatten", "narrow",
          "_to_copy", "to", "lift_fresh"}
OWNERS = ("collectives and their waits", "DTensor wrapping, gradient accumulation")


def _category(name: str, phase: str) -> str:
    if phase != "forward+backward":
        return f"{phase}: " + ("aten kernels" if name.startswith("aten::") else "Python, DTensor dispatch")
    if name.startswith(COLLECTIVE):
        return OWNERS[0]
    if any(w in name for w in WRAP):
        return OWNERS[1]
    if name.startswith("aten::"):
        return "copies, views, fills" if name[6:] in LAYOUT else "compute kernels"
    return "Python, autograd, other"


def categories(events, steps: int) -> str:
    """Own time per step by category. In forward+backward, events inside a collective or a DTensor
    wrapper count as it; time no event covers (Python, DDP's gradient wait) has its own line."""
    total: dict[str, float] = {}
    for e in events:
        if e.name.startswith(PHASE):
            phase = e.name[len(PHASE):]
            cat = "forward+backward: untraced (Python, DDP's wait)" if phase == "forward+backward" else \
                f"{phase}: Python, DTensor dispatch"
        else:
            phase, owner, anc = "?", None, e.cpu_parent
            while anc is not None:
                if anc.name.startswith(PHASE):
                    phase = anc.name[len(PHASE):]
                elif owner is None and _category(anc.name, "forward+backward") in OWNERS:
                    owner = anc.name  # the innermost: DDP's all-reduce runs inside AccumulateGrad
                anc = anc.cpu_parent
            cat = _category(e.name, phase)
            if owner and phase == "forward+backward" and cat not in OWNERS:
                cat = _category(owner, phase)
        total[cat] = total.get(cat, 0.0) + e.self_cpu_time_total / 1e3 / steps
    width = max(map(len, total)) + 2
    lines = [f"{cat:<{width}}{ms:>9.1f} ms" for cat, ms in sorted(total.items(), key=lambda kv: -kv[1]) if ms >= 0.05]
    return "\n".join(lines + [f"{'total':<{width}}{sum(total.values()):>9.1f} ms  (own time per step, rank 0)"])


def _counterpart(v: Variant, natives: list[Variant], med: dict) -> Variant | None:
    """The native variant an autopar variant is compared with, compiled or not as it is (auto: the native
    with the least `med`)."""
    natives = [n for n in natives if n.compiled == v.compiled]
    if v.kind in NATIVE:
        return next((n for n in natives if n.kind == v.kind), None)
    return min(natives, key=lambda n: med[n.name]) if v.kind == "auto" and natives else None


def _eager_twin(v: Variant, variants: list[Variant]) -> Variant | None:
    """A compiled autopar variant's eager program (same strategy)."""
    if not v.compiled:
        return None
    return next((e for e in variants if e.name.startswith("autopar") and e.kind == v.kind and not e.compiled), None)


def _ratio(v: Variant, med: dict, natives: list[Variant]) -> str:
    n = _counterpart(v, natives, med) if v.name.startswith("autopar") else None
    return f"{med[v.name] / med[n.name]:.2f}x {n.name}" if n is not None else ""


def chosen_plan(plan) -> str:
    """What auto chose (its weights' modes per mesh axis), and every recipe's predicted step, cheapest first."""
    chosen = next(line for line in header_lines(plan) if line.startswith("strategy")).split("-> ", 1)[1]
    priced = sorted((b["time"], r) for r, b in plan.baselines.items() if b.get("feasible", True))
    return (f"autopar auto's plan: {chosen}, predicted {plan.predicted_step_time:.4f} s; recipes priced: "
            + ", ".join(f"{r} {t:.4f}" for t, r in priced))


def paired(variants: list[Variant]) -> str:
    """Each autopar variant's step k of a round against its counterpart's step k of the same round:
    the two ran seconds apart, so load drift cancels, which comparing two medians does not do."""
    natives = [n for n in variants if not n.name.startswith("autopar")]
    medians = {v.name: statistics.median(v.times) for v in variants}
    lines = []
    for v in (v for v in variants if v.name.startswith("autopar")):
        for n in (_counterpart(v, natives, medians), _eager_twin(v, variants)):
            if n is None or len(v.times) < 2:
                continue
            ratios = [a / b for a, b in zip(v.times, n.times)]
            q1, med, q3 = statistics.quantiles(ratios, n=4)
            lines.append(f"  {v.name:<15} / {n.name:<15} median {med:.3f} (q1-q3 {q1:.3f}-{q3:.3f}); {v.name} "
                         f"faster in {sum(r < 1 for r in ratios)} of {len(ratios)} pairs")
    return "paired steps (wall, same round and step index):\n" + "\n".join(lines) if lines else ""


def report(variants: list[Variant]) -> str:
    med = {v.name: statistics.median(v.times) for v in variants}
    cpu = {v.name: statistics.median(v.cpu_times) for v in variants}
    natives = [v for v in variants if not v.name.startswith("autopar")]
    lines = [f"{'variant':<15}{'median s':>9}{'min':>8}{'cpu s':>8}{'cpu q1-q3':>14}{'optim':>8}{'predicted':>10}"
             f"{'setup':>7}{'first s':>8}   {'ratio (wall)':<18}ratio (cpu)", "-" * 118]
    for v in variants:
        pred = f"{v.predicted:.4f}" if v.predicted is not None else "-"
        opt = statistics.median(v.opt_times)
        q1, _, q3 = statistics.quantiles(v.cpu_times, n=4) if len(v.cpu_times) > 1 else [cpu[v.name]] * 3
        lines.append(f"{v.name:<15}{med[v.name]:>9.4f}{min(v.times):>8.4f}{cpu[v.name]:>8.4f}{f'{q1:.3f}-{q3:.3f}':>14}"
                     f"{opt:>8.4f}{pred:>10}{v.setup_s:>7.1f}{v.first_s:>8.1f}   {_ratio(v, med, natives):<18}{_ratio(v, cpu, natives)}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="autopar vs PyTorch-native step time")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed steps per variant per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--only", default=",".join(AUTOPAR + tuple(NATIVE.values())),
                   help="comma list of variants: dp,zero3,tp,auto,DDP,FSDP2,TP")
    p.add_argument("--foreach", choices=("default", "on"), default="default",
                   help="AdamW(foreach=...) for every variant: torch's default on CPU is the per-parameter "
                        "loop, where each op on a DTensor parameter (autopar, FSDP2, TP) pays DTensor dispatch; "
                        "'on' is what torchtitan uses")
    p.add_argument("--hardware", default="calibrate",
                   help="what autopar plans for: 'calibrate' (default: `autopar calibrate`'s measurements, taken in "
                        "this job before building, ~15 s), a preset name (e.g. cpu) or a saved profile (JSON)")
    p.add_argument("--compile", action="store_true",
                   help="also autopar with compile=True (Inductor), and the native variants under torch.compile")
    p.add_argument("--profile", default=None, help="profile 3 steps of these variants, e.g. dp,DDP: time by category, then by op")
    args = p.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    hardware = args.hardware
    if hardware == "calibrate":
        cal = calibrate(sizes=size_range("1K", "16M"), progress=lambda msg: None)
        hardware = cal.spec
        if rank == 0:
            print(cal.summary(), flush=True)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads,
                       n_embd=args.embd)
    model = GPT(config)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, args.vocab, (args.batch, args.block), generator=gen),
                torch.randint(0, args.vocab, (args.batch, args.block), generator=gen)) for _ in range(4)]
    variants = make_variants(model, batches[0], world, rank, args.only.split(","),
                             foreach=True if args.foreach == "on" else None, hardware=hardware,
                             compile_modes=(False, True) if args.compile else (False,))
    if rank == 0:
        print(f"world {world}, threads/rank {torch.get_num_threads()}, GPT {args.layers}L {args.embd}d "
              f"{args.heads}h vocab {args.vocab}, batch {args.batch}x{args.block}, "
              f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, AdamW foreach {args.foreach}",
              flush=True)
    load0 = os.getloadavg()
    variants = [v for v in variants if warm_up(v, batches, args.warmup, rank)]
    for r in range(args.rounds):
        turn = r % len(variants) if variants else 0   # each round starts one variant later: no variant
        for v in variants[turn:] + variants[:turn]:   # always runs right after the same one
            for i in range(args.steps):
                timed_step(v, *batches[i % len(batches)])
    if rank == 0:
        print(report(variants))
        print(paired(variants))
        for v in variants:
            if v.name == "autopar auto":
                print(chosen_plan(v.plan))
            if v.compiled and v.name.startswith("autopar"):   # compile seconds, FX graph cache hits, overlap
                print(f"{v.name}: {v.module.extra_repr()}")
        print(f"load average (1, 5, 15 min) at the start: {load0}, at the end: {os.getloadavg()}")
        print("median s: slowest rank, barrier to barrier; cpu s: median CPU time of the slowest rank (what "
              "to compare on a loaded machine); optim: rank 0's AdamW step alone; predicted: the plan's "
              f"cost-model estimate ({hardware if isinstance(hardware, str) else hardware.name})")
        print("first timed loss on rank 0 (same init and batches; DDP/FSDP2: rank 0's half of the batch):",
              {v.name: round(v.losses[0], 4) for v in variants})
    for name in filter(None, (args.profile or "").split(",")):
        target = next(v for v in variants if v.name in (name, f"autopar {name}"))
        text = profile_step(target, *batches[0], rank)
        if rank == 0:
            print(f"\ntorch.profiler, {target.name}, rank 0, by category then by op (own CPU time, mean of 3 "
                  f"steps; load {os.getloadavg()}):\n{text}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
