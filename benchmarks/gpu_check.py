"""One CUDA device: autopar's NCCL path against PyTorch, eager and compiled, and the cost model against the clock.

    torchrun --nproc_per_node 1 benchmarks/gpu_check.py --hardware h200      # the whole check, ~8 min on an H200
    torchrun --nproc_per_node 1 benchmarks/gpu_check.py --device cpu --tiny  # CPU/gloo dry run of every code path

1. Numerics: a small GPT in fp32 through `autoparallelize(device="cuda")` (NCCL, world 1), eager and with
   `compile=True`, against the unmodified model with the same AdamW, 3 steps (rtol 1e-4 / atol 1e-5).
2. Step time, world 1, for GPT-2 124M (autopar's GPT, batch 8 x 1024) and a 1B Llama shape (transformers'
   LlamaForCausalLM with Llama-3.2-1B's config: 16 layers, hidden 2048, 32 heads, 8 kv heads, MLP 8192,
   vocabulary 128256, tied embeddings; batch 4 x 1024), each in bf16 (autocast) and fp32, a row per program:
     eager     autopar's eager FX program            against the unmodified model in eager PyTorch
     compiled  autopar compile=True (Inductor)       against the unmodified model under torch.compile
     cudagraphs autopar compile="cudagraphs"         against torch.compile(mode="reduce-overhead") (CUDA only)
   Both sides step with fused AdamW (autopar: `pmodel.optimizer`, planned as "fused_adamw"). Each row prints
   the plan's predicted step (`--hardware`; a compiled row's plan is priced as the compiled program),
   autopar's measured median step, predicted / measured (target within +-15%), the reference's median and
   autopar / reference (targets: eager <= 1.05x, compiled <= 1.00x), and the first (compiling) steps.
   A table of all rows follows.

Every variant compiles once (its first step) and is timed over `--steps` steps after `--warmup`; the Llama
rows run the fewest steps that give a median. `--budget` (seconds, default 300) stops starting new rows once
spent, so the job ends in about 8 minutes on an H200 whatever the compile times; a skipped row says so.
`--device cpu --tiny` runs every path (both models, both precisions, eager and compiled, numerics) at tiny
sizes on CPU/gloo, to check the script before a GPU is lent.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

import autopar
from autopar import autoparallelize
from autopar._testing.gpt import GPT, GPTConfig

DEV = "cuda"


@dataclass
class Workload:
    """A model to train and its batches: `build()` a fresh module, `batches[i] = (args, kwargs)`, `loss(model,
    args, kwargs)` the unmodified model's loss."""

    name: str
    build: Callable[[], torch.nn.Module]
    batches: list
    loss: Callable
    steps: int


def gpt2(tiny: bool, steps: int) -> Workload:
    # GPT-2 124M: 12 layers, 768 wide, 50304 vocabulary, tied embeddings
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64) if tiny else GPTConfig()
    b, t = (2, 64) if tiny else (8, 1024)
    batches = [((x, y), {}) for x, y in (tokens(cfg.vocab_size, b, t, s) for s in range(2))]
    return Workload("GPT 2x64" if tiny else "GPT-2 124M", lambda: GPT(cfg), batches,
                    lambda m, args, kw: m(*args), steps)


def llama_1b(tiny: bool, steps: int) -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM
    if tiny:
        cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=128, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=True)
    else:   # Llama-3.2-1B
        cfg = LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                          intermediate_size=8192, vocab_size=128256, max_position_embeddings=8192,
                          rope_theta=500000.0, tie_word_embeddings=True)
    b, t = (2, 64) if tiny else (4, 1024)
    batches = [((x,), {"labels": y}) for x, y in (tokens(cfg.vocab_size, b, t, s) for s in range(2))]
    return Workload("Llama 2x64" if tiny else "Llama-1B", lambda: LlamaForCausalLM(cfg), batches,
                    lambda m, args, kw: m(*args, **kw).loss, max(3, steps // 2))


def tokens(vocab: int, b: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (b, t + 1), generator=g)
    return x[:, :-1].contiguous().to(DEV), x[:, 1:].contiguous().to(DEV)


def check_numerics(compile: bool | str = False) -> str:
    """3 AdamW steps of autopar (world 1; `compile`: its program compiled by Inductor) and of the unmodified
    model; largest differences."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)
    ref = GPT(cfg).to(DEV)
    model = copy.deepcopy(ref)
    batches = [tokens(cfg.vocab_size, 4, 64, s) for s in range(3)]
    pmodel = autoparallelize(model, batches[0], device=DEV, compile=compile)
    opt_p = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    loss_diff = 0.0
    for x, y in batches:
        lp = pmodel.train_step(x, y)
        opt_p.step(); opt_p.zero_grad()
        lr_ = ref(x, y)
        lr_.backward()
        opt_r.step(); opt_r.zero_grad()
        loss_diff = max(loss_diff, abs(lp.item() - lr_.item()))
    full = pmodel.full_state_dict()
    param_diff = max((full[k].float().to(DEV) - v.float()).abs().max().item() for k, v in ref.state_dict().items()
                     if k in full)
    ok = loss_diff <= 1e-5 + 1e-4 * abs(lr_.item()) and param_diff <= 2e-5
    return (f"numerics (GPT 2x64, fp32, 3 AdamW steps, world 1, compile={compile}): max |loss diff| {loss_diff:.2e}, "
            f"max |param diff| {param_diff:.2e} -> {'OK' if ok else 'MISMATCH'}")


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(step, batches, warmup: int, steps: int) -> tuple[float, float]:
    """(first step's seconds, compile included; median of `steps` steps after `warmup` more)."""
    t0 = time.perf_counter()
    step(*batches[0])
    sync()
    first = time.perf_counter() - t0
    for i in range(warmup):
        step(*batches[(i + 1) % len(batches)])
    sync()
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        step(*batches[i % len(batches)])
        sync()
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


@dataclass
class Row:
    workload: str
    precision: str
    program: str      # "eager" | "compiled" | "cudagraphs"
    predicted: float
    measured: float
    reference: float
    first: float
    reference_first: float
    setup: float

    def line(self) -> str:
        ref = REFERENCE[self.program]
        target = 1.05 if self.program == "eager" else 1.00
        return (f"{self.workload} {self.precision} {self.program}: predicted {self.predicted * 1e3:.1f} ms, autopar "
                f"{self.measured * 1e3:.1f} ms (predicted/measured {self.predicted / self.measured:.2f}, target "
                f"0.85-1.15), {ref} {self.reference * 1e3:.1f} ms (autopar/{ref} {self.measured / self.reference:.2f}, "
                f"target <= {target:.2f}); plan+rewrite {self.setup:.0f} s, first step {self.first:.1f} s "
                f"({ref}: {self.reference_first:.1f} s)")


def run_row(w: Workload, precision: str, compile: bool | str, hardware: str, warmup: int) -> Row:
    """autopar (`compile`: its compiled program; "cudagraphs": replayed as CUDA graphs) against the unmodified
    model (under torch.compile; "cudagraphs": mode="reduce-overhead"), both in `precision` with fused AdamW,
    and the plan's prediction."""
    torch.manual_seed(0)
    base = w.build().to(DEV)
    mp = "bf16" if precision == "bf16" else None
    mesh = autopar.Mesh((1,), hardware=hardware)
    args, kwargs = w.batches[0]
    t0 = time.perf_counter()
    pmodel = autoparallelize(copy.deepcopy(base), args, example_kwargs=kwargs or None, mesh=mesh, device=DEV,
                             mixed_precision=mp, compile=compile, optimizer="fused_adamw")
    setup = time.perf_counter() - t0
    opt = pmodel.optimizer(torch.optim.AdamW, lr=1e-4, fused=DEV == "cuda")

    def ap_step(args, kwargs):
        pmodel.train_step(*args, **kwargs)
        opt.step(); opt.zero_grad(set_to_none=True)
    first, measured = timed(ap_step, w.batches, warmup, w.steps)
    predicted = pmodel.plan.predicted_step_time
    pmodel = opt = None  # free the device memory before the reference runs
    if DEV == "cuda":
        torch.cuda.empty_cache()

    ref_opt = torch.optim.AdamW(base.parameters(), lr=1e-4, fused=DEV == "cuda")
    run = torch.compile(base, mode="reduce-overhead" if compile == "cudagraphs" else "default") if compile else base

    def ref_step(args, kwargs):
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=mp is not None):
            loss = w.loss(run, args, kwargs)
        loss.backward()
        ref_opt.step(); ref_opt.zero_grad(set_to_none=True)
    ref_first, reference = timed(ref_step, w.batches, warmup, w.steps)
    base = run = ref_opt = None
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return Row(w.name, precision, program_name(compile), predicted, measured, reference, first, ref_first, setup)


REFERENCE = {"eager": "eager PyTorch", "compiled": "torch.compile", "cudagraphs": "torch.compile reduce-overhead"}


def program_name(compile: bool | str) -> str:
    return {False: "eager", True: "compiled", "cudagraphs": "cudagraphs"}[compile]


def table(rows: list[Row]) -> str:
    head = (f"{'workload':<12}{'prec':<6}{'program':<10}{'predicted ms':>13}{'autopar ms':>11}{'pred/meas':>10}"
            f"{'reference ms':>13}{'autopar/ref':>12}{'first s':>9}{'ref first s':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.workload:<12}{r.precision:<6}{r.program:<10}{r.predicted * 1e3:>13.1f}{r.measured * 1e3:>11.1f}"
                     f"{r.predicted / r.measured:>10.2f}{r.reference * 1e3:>13.1f}{r.measured / r.reference:>12.2f}"
                     f"{r.first:>9.1f}{r.reference_first:>12.1f}")
    lines.append("reference: eager PyTorch for eager rows, torch.compile for compiled rows (mode='reduce-overhead' for "
                 "cudagraphs rows); targets: predicted/measured 0.85-1.15, autopar/ref <= 1.05 (eager), <= 1.00 (compiled)")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hardware", default="h200", help="preset or calibrated profile JSON (default h200)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant (median; Llama: half, >= 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the first (compiling) one")
    p.add_argument("--budget", type=float, default=300.0, help="seconds after which no new row starts")
    p.add_argument("--models", default="gpt2,llama", help="comma list of gpt2, llama")
    p.add_argument("--precisions", default="bf16,fp32", help="comma list of bf16, fp32")
    p.add_argument("--skip-numerics", action="store_true")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of this script")
    p.add_argument("--tiny", "--small", action="store_true", help="2-layer models instead of GPT-2 124M / Llama-1B")
    p.add_argument("--no-compile", action="store_true",
                   help="skip the compiled rows (compile=True and 'cudagraphs', torch.compile)")
    args = p.parse_args(argv)
    global DEV
    DEV = args.device
    if DEV == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to measure")
        return
    if "RANK" not in os.environ:
        sys.exit("run under torchrun: torchrun --nproc_per_node 1 benchmarks/gpu_check.py")
    start = time.perf_counter()
    print(f"{torch.cuda.get_device_name() if DEV == 'cuda' else 'CPU'} torch {torch.__version__}, hardware "
          f"{args.hardware}", flush=True)
    # CUDA graphs need CUDA (autoparallelize raises InputError on CPU; tested in tests/test_compile.py)
    programs = (False,) if args.no_compile else (False, True) + (("cudagraphs",) if DEV == "cuda" else ())
    if not args.skip_numerics:
        for compile in programs:
            print(check_numerics(compile), flush=True)
    makers = {"gpt2": gpt2, "llama": llama_1b}
    workloads = [makers[m](args.tiny, args.steps) for m in args.models.split(",")]
    rows = []
    for precision in args.precisions.split(","):
        for w in workloads:
            for compile in programs:
                label = f"{w.name} {precision} {program_name(compile)}"
                if time.perf_counter() - start > args.budget:
                    print(f"{label}: skipped (--budget {args.budget:.0f} s spent)", flush=True)
                    continue
                try:
                    rows.append(run_row(w, precision, compile, args.hardware, args.warmup))
                    print(rows[-1].line(), flush=True)
                except Exception as e:  # a failure is a finding: print it and go on to the next row
                    print(f"{label}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
                    if DEV == "cuda":
                        torch.cuda.empty_cache()
    print(table(rows), flush=True)
    print(f"gpu_check: {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
