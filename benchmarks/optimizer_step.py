"""Optimizer step time over the DTensor parameters of a GPT plan, against torch's fused and foreach AdamW
on plain tensors of the same local shapes (the floor: what the step costs without DTensors).

    torchrun --nproc_per_node 2 benchmarks/optimizer_step.py --slow --rounds 10   # ~2 minutes, 2 shared cores
    torchrun --nproc_per_node 1 benchmarks/optimizer_step.py --hardware h200       # a GPU (NCCL)

For each GPT (`--models`: the step_time GPT, 4 layers 256 wide, and 8 layers 64 wide, many small
tensors where per-tensor costs show) and plan (dp, zero3, tp, auto, a 2-stage pipeline) the GPT is
parallelized, one train_step fills p.grad, then these optimizers take turns, `--rounds` rounds of
`--steps` timed `step()` calls each, in a seeded random order per round (load from other processes hits
them alike, and no variant always runs right after the same one: torch's default loop on the DTensors
churns the allocator and caches for whatever follows it):
  pm.optimizer fused      `pmodel.optimizer(torch.optim.AdamW)`: local shards, torch's fused kernel
  pm.optimizer foreach    the same with foreach=True
  DTensor foreach         `torch.optim.AdamW(pmodel.parameters(), foreach=True)`: DTensor dispatch
  DTensor default         `torch.optim.AdamW(pmodel.parameters())` (CPU: torch's per-tensor loop)
  plain fused / foreach   torch.optim.AdamW on plain tensors cloned from the local shards and gradients
A figure is the median over rounds of the slowest rank's median step in that round (all_reduce MAX); "×"
is paired: per round, the variant's time over the plain run of the same kernel in that round (fused by
fused, foreach by foreach; DTensor by plain foreach), median over rounds, so that load drift cancels.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.distributed as dist

from autopar import autoparallelize
from autopar._testing.gpt import GPT, GPTConfig
from autopar.calibration.timing import sync
from autopar.mesh import Mesh

STRATEGIES = ("dp", "zero3", "tp", "auto", "pp2")   # pp2: 2 pipeline stages, each rank steps its stage
LR = 1e-4   # small: the weights drift little over hundreds of timed steps


def variants(pmodel, slow: bool) -> dict[str, torch.optim.Optimizer]:
    """Every optimizer to time; the plain ones over clones of this rank's local shards and gradients."""
    params = list(pmodel.parameters())
    plain = [torch.nn.Parameter(p.to_local().detach().clone()) for p in params]
    plain_foreach = [torch.nn.Parameter(p.to_local().detach().clone()) for p in params]
    for copies in (plain, plain_foreach):
        for c, p in zip(copies, params):
            c.grad = p.grad.to_local().detach().clone()
    out = {"pm.optimizer fused": pmodel.optimizer(torch.optim.AdamW, lr=LR),
           "pm.optimizer foreach": pmodel.optimizer(torch.optim.AdamW, lr=LR, foreach=True),
           "DTensor foreach": torch.optim.AdamW(params, lr=LR, foreach=True),
           "plain fused": torch.optim.AdamW(plain, lr=LR, fused=True),
           "plain foreach": torch.optim.AdamW(plain_foreach, lr=LR, foreach=True)}
    if slow:
        out["DTensor default"] = torch.optim.AdamW(params, lr=LR)
    return out


def time_steps(opts: dict, rounds: int, steps: int, device: torch.device) -> dict[str, list[float]]:
    """Per round, the median seconds per step() of each optimizer, the slowest rank's."""
    names = list(opts)
    times: dict[str, list[list[float]]] = {n: [[] for _ in range(rounds)] for n in names}
    for opt in opts.values():   # warm-up: state allocated, kernels loaded
        opt.step()
    for r in range(rounds):
        order = list(names)
        random.Random(r).shuffle(order)   # the same order on every rank; no variant always follows the same one
        for name in order:
            for _ in range(steps):
                sync(device)
                t0 = time.perf_counter()
                opts[name].step()
                sync(device)
                times[name][r].append(time.perf_counter() - t0)
    medians = torch.tensor([[statistics.median(times[n][r]) for r in range(rounds)] for n in names],
                           dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(names, medians.tolist()))


def ratio(name: str, t: dict[str, list[float]]) -> float:
    """Paired: the median over rounds of this variant's round median over its plain counterpart's, same round."""
    base = "plain fused" if name.endswith("fused") else "plain foreach"
    return statistics.median(a / b for a, b in zip(t[name], t[base]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="4x256,8x64",
                   help="GPTs as LAYERSxWIDTH, comma-separated: the second has many small tensors (per-tensor costs)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=10, help="timed steps per optimizer per round")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--hardware", default="cpu", help="the preset (or saved profile) the plans are made for")
    p.add_argument("--slow", action="store_true", help="also time torch's default AdamW on the DTensors")
    args = p.parse_args(argv)

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    gen = torch.Generator().manual_seed(0)
    batch = tuple(torch.randint(0, args.vocab, (args.batch, args.block), generator=gen) for _ in range(2))
    mesh = Mesh((world,), hardware=args.hardware)
    if rank == 0:
        print(f"world {world}, {device.type}, threads/rank {torch.get_num_threads()}; "
              f"median of {args.rounds}x{args.steps} AdamW steps, slowest rank", flush=True)
        print(f"{'GPT':<8} {'strategy':<8} {'tensors':>7} {'MB/rank':>8}  " + "  ".join(
            f"{n:>22}" for n in ("pm.optimizer fused", "pm.optimizer foreach", "DTensor foreach",
                                 "plain fused", "plain foreach", *(["DTensor default"] if args.slow else []))))
    for shape in args.models.split(","):
        layers, width = (int(v) for v in shape.split("x"))
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=layers, n_head=args.heads,
                              n_embd=width))
        for strategy in args.strategies.split(","):
            run_one(model, batch, mesh, strategy, f"{layers}L {width}d", args, device, rank)
    if rank == 0:
        print("(×: paired per round, over plain fused for a fused variant, over plain foreach otherwise)")
    dist.destroy_process_group()


def run_one(model, batch, mesh, strategy: str, label: str, args, device, rank: int) -> None:
    """One row: the optimizers of one plan, timed in turns."""
    kw = dict(num_stages=2, num_microbatches=2) if strategy == "pp2" else dict(strategy=strategy)
    pmodel = autoparallelize(model, batch, mesh=mesh, **kw)
    pmodel.train_step(*batch)
    t = time_steps(variants(pmodel, args.slow), args.rounds, args.steps, device)
    mb = sum(q.to_local().numel() * q.element_size() for q in pmodel.parameters()) / 1e6
    if rank == 0:
        cells = [f"{statistics.median(t[n]) * 1e3:8.3f} ms" + (f" ({ratio(n, t):.2f}×)" if not n.startswith("plain") else " " * 8)
                 for n in t]
        print(f"{label:<8} {strategy:<8} {len(list(pmodel.parameters())):>7} {mb:>8.2f}  "
              + "  ".join(f"{c:>22}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
