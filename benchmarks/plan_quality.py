"""Plan quality: the default `autopar.plan`'s predicted step beside the best hand-written recipe, same cost model.

    python benchmarks/plan_quality.py --quick                  # a few small rows, fp32 and bf16
    python benchmarks/plan_quality.py                          # the default set (below)
    python benchmarks/plan_quality.py --model llama-70b/4 --devices 512 --precision bf16
    python benchmarks/plan_quality.py --full-depth             # the 70B / 405B rows at their real depth (slow)

Models (meta device, no weights): GPT-2 124M / 350M / 1.5B (seq 1024), Llama 7B / 13B (seq 4096),
Llama-3-70B (seq 4096) and Llama-3.1-405B (seq 8192). `NAME/L` is NAME's width with L layers: the
proxy the default set uses for 70B and 405B on 512-2,048 devices, where planning the full depth takes
too long on a 2-core machine (`--full-depth` runs them). A proxy's per-layer choices are those of the
full model; its step, memory and the recipe it is compared with are its own (fewer layers: less state,
fewer stages possible). Global batch = one sequence per device; H100s, 8 per node; budgets 80 GB and
40 GB; precision fp32, or bf16 (`mixed_precision="bf16"`; recompute decided by the solver).

"auto" is the default call, nothing forced: `autopar.plan(model, inputs, mesh=Mesh((N // 8, 8),
hardware="h100"), memory_budget=..., mixed_precision=...)` (`--search exact` prices every pipeline).
Hand recipes, each priced by `autopar.pipeline.search` with the recipe forced on the SPMD sub-mesh
(`--ac` variants: every layer recomputed, priced as the forced pipelined planner prices
recompute="all": `recompute.solve_recompute` then `stages.partition`):
  dp, zero1, zero2, zero3   one 1-D mesh over every device, gradient accumulation m in {1, 2, 4}
  tp+dp                     tensor parallel inside a node (tp 2, 4 or 8) x data parallel, m in {1, 2, 4}
  titan, titan+ac           torchtitan's grid: FSDP (ZeRO-3) x TP (1, 2, 4, 8, inside a node) x PP (every
                            stage count dividing N, 1 included), every schedule the runtime has (GPipe,
                            1F1B, interleaved 1F1B, zero bubble on 1 or 2 chunks per device; no V
                            schedule), m in {pp, 2pp,
                            4pp} (pp = 1: {1, 2, 4}), without and with activation checkpointing
  megatron+ac               Megatron-LM: TP 8 inside the node, PP across nodes (every stage count), DP
                            outside, 1F1B or interleaved 1F1B, m in {pp, 2pp, 4pp}, full recompute
Prints one row per case: auto's step, memory, MFU and layout; the best recipe and its step; auto / best;
auto's plan time (wall, CPU) and the row's.
"""
from __future__ import annotations

import argparse
import time
import warnings

from autopar.pipeline import stages

DEVICES = (8, 16, 64, 256)
BUDGETS = ("80GB", "40GB")
PER_NODE = 8
QUICK = [("gpt2-124m", 8, "fp32"), ("gpt2-124m", 8, "bf16"), ("gpt2-350m", 16, "fp32"), ("gpt2-350m", 16, "bf16")]
SMALL = ("gpt2-124m", "gpt2-350m", "gpt2-1.5b", "llama-7b", "llama-13b", "llama-70b")
# the default set beyond SMALL x DEVICES (fp32): bf16 rows, and 70B / 405B widths on 512-2,048 devices
LARGE = [("llama-7b", 64, "bf16"), ("llama-13b", 256, "bf16"), ("llama-70b/4", 512, "bf16"),
         ("llama-70b/4", 1024, "bf16"), ("llama-405b/2", 1024, "bf16"), ("llama-405b/2", 2048, "bf16")]
FULL_DEPTH = [("llama-70b", 512, "bf16"), ("llama-70b", 1024, "bf16"), ("llama-405b", 2048, "bf16")]
SCHEDULES = stages.SCHEDULES   # the runtime's
# auto within this relative margin of a recipe counts as a tie (<=): the SPMD solver minimises the
# micro-batch graph's seconds, not the split's step time, so among plans equal to ~1e-6 it may pick one
# whose split is microseconds slower (Llama 13B x 8 at 40 GB: 12.689222 s against the recipe's 12.689207 s)
TIE = 1e-5


def build(name: str, batch: int):
    """(model, example_inputs) on the meta device; `name` may end in /L (L layers of that width)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from autopar._testing import models
    base, _, depth = name.partition("/")
    gpt = {"gpt2-124m": (12, 768, 12), "gpt2-350m": (24, 1024, 16), "gpt2-1.5b": (48, 1600, 25)}
    if base in gpt:
        layers, width, heads = gpt[base]
        config = GPT2Config(n_layer=int(depth or layers), n_embd=width, n_head=heads, vocab_size=50257,
                            n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cls, seq = GPT2LMHeadModel, 1024
    else:
        llama = {"llama-7b": (4096, 32, 32, 11008), "llama-13b": (5120, 40, 40, 13824)}
        if base in llama:
            width, layers, heads, ffn = llama[base]
            config = LlamaConfig(hidden_size=width, num_hidden_layers=int(depth or layers), num_attention_heads=heads,
                                 intermediate_size=ffn, vocab_size=32000, max_position_embeddings=4096)
            seq = 4096
        elif base == "llama-70b":
            config, seq = models.llama3_70b_config(int(depth or 80)), 4096
        elif base == "llama-405b":
            config, seq = models.llama3_405b_config(int(depth or 126)), 8192
        else:
            raise SystemExit(f"unknown model {name!r}")
        cls = LlamaForCausalLM
    with torch.device("meta"):
        model = cls(config)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return model, (ids, {"labels": ids})


def recipes(n: int) -> dict[str, dict]:
    """Hand recipe name -> search restrictions (meshes as (pp, dp, tp), SPMD strategy, schedules, ac:
    every layer recomputed). Each recipe gets every layout and micro-batch count it admits, so the best
    of them is a strong baseline."""
    tps = [t for t in (2, 4, 8) if t <= min(PER_NODE, n) and n % t == 0]
    pps = [p for p in range(1, n + 1) if n % p == 0]
    accumulate = dict(num_microbatches=[1, 2, 4])          # gradient accumulation where memory needs it
    out = {r: dict(meshes=[(1, n, 1)], strategy={"dp": r}, **accumulate) for r in ("dp", "zero1", "zero2", "zero3")}
    out["tp+dp"] = dict(meshes=[(1, n // t, t) for t in tps], strategy={"dp": "dp", "tp": "tp"}, **accumulate)
    titan = [(p, n // (p * t), t) for p in pps for t in [1] + tps if n % (p * t) == 0]
    out["titan"] = dict(meshes=titan, strategy={"dp": "zero3", "tp": "tp"}, schedules=SCHEDULES)
    out["titan+ac"] = dict(out["titan"], ac=True)
    tp = min(PER_NODE, n)
    out["megatron+ac"] = dict(meshes=[(p, n // (p * tp), tp) for p in pps if n % (p * tp) == 0],
                              strategy={"dp": "dp", "tp": "tp"}, schedules=("1f1b", "interleaved_1f1b"), ac=True)
    return out


def _try(fn):
    from autopar.errors import InfeasiblePlanError
    try:
        return fn()
    except InfeasiblePlanError:
        return None


def best_recipe(prof, model, inputs, mesh, budget, kw: dict, cutoff: float = float("inf")):
    """(step seconds, layout label) of the fastest layout of one recipe that fits, or None. `cutoff`: the
    best recipe's step so far; an --ac layout whose lower bound exceeds it is not priced."""
    from autopar.pipeline.search import search
    if not kw.get("ac"):
        res = _try(lambda: search(model, inputs, mesh=mesh, memory_budget=budget, profiler=prof, **kw))
        if res is None:
            return None
        c = res.best
        return c.step_time, f"pp{c.pp} dp{c.dp} tp{c.tp} m{c.num_microbatches} {c.schedule}"
    return best_recomputed(prof, budget, kw, cutoff)


def best_recomputed(prof, budget, kw: dict, cutoff: float):
    """A recipe with every layer recomputed (activation checkpointing): for each (pp, dp, tp), m and
    schedule, the forced strategy's SPMD plan with recompute="all" (solved once per micro-batch size,
    dp, tp) split into stages under the budget, as the forced pipelined planner does. Layouts are priced
    in the order of `stages.step_lower_bound` (recompute only adds time, so it bounds these too) and
    skipped once the bound exceeds the fastest found or `cutoff`: the best is exact, not every layout's."""
    from autopar.costmodel.memory import parse_bytes
    from autopar.mesh import Mesh
    from autopar.pipeline.search import batch_size, microbatch_counts
    from autopar.pipeline.stages import INTERLEAVE, chunks_per_device, partition, step_lower_bound
    limit, batch, best = parse_bytes(budget), batch_size(prof.inputs), None
    units, jobs = prof.num_units(), []
    for pp, dp, tp in kw["meshes"]:
        for m in microbatch_counts(batch, pp, dp, None if pp > 1 else [1, 2, 4]):
            for schedule in (kw["schedules"] if pp > 1 else ("1f1b",)):
                v = chunks_per_device(schedule)
                if (v > 1 and m % pp) or pp * v > units:
                    continue
                bound = step_lower_bound(*prof.seconds_bound(m, dp * tp), pp, m, schedule, INTERLEAVE)
                jobs.append((bound, pp, dp, tp, m, schedule, v))
    for bound, pp, dp, tp, m, schedule, v in sorted(jobs):
        if bound > min(cutoff, best[0] if best else float("inf")):
            break
        layers = _try(lambda: _recomputed_layers(prof, pp, m, dp, tp, kw["strategy"]))
        if layers is None:
            continue
        full = Mesh((pp, dp, tp), ("pp", "dp", "tp"), prof.hardware, prof.dpn)
        split = _try(lambda: partition(layers, pp, m, schedule, memory_budget=limit, v=v,
                                       p2p_time=lambda b: full.p2p_time(b, "pp") if pp > 1 else 0.0))
        if split is not None and (best is None or split.step_time < best[0]):
            best = (split.step_time, f"pp{pp} dp{dp} tp{tp} m{m} {schedule}")
    return best


def _recomputed_layers(prof, pp, m, dp, tp, strategy):
    """The unit costs of the (m, dp, tp) SPMD plan of `strategy` with every layer recomputed, cached: solved,
    as the search solves its stage plans, for the pipeline's weighting of per-step seconds
    (`stages.step_weight`; pp = devices / (dp tp), so (m, dp, tp) fixes it), priced unweighted."""
    from autopar.pipeline.search import unit_costs
    from autopar.pipeline.stages import step_weight
    from autopar.planning import recompute
    key = ("ac", m, dp, tp, repr(sorted(strategy.items())))
    if key not in prof.profiles:
        prob = prof.problem(m, dp, tp, strategy)   # the three-layer graph's where it stands for the full one
        # solved on the weighted view (no memory row: the split enforces the budget), priced on prob
        view = prof.weighted(m, dp, tp, strategy, step_weight=step_weight(pp, m))
        sol, rc = recompute.solve_recompute(view, "all", fixed=None, time_limit=prof.time_limit)
        prof.profiles[key] = tuple(unit_costs(prob, sol.choice, rc.paths))
    return prof.profiles[key]


def auto_plan(model, inputs, n: int, budget: str, precision: str, search: str):
    import autopar
    shape = (n // PER_NODE, PER_NODE) if n > PER_NODE else (n,)
    mesh = autopar.Mesh(shape, hardware="h100", devices_per_node=PER_NODE)
    return _try(lambda: autopar.plan(model, inputs, mesh=mesh, memory_budget=budget, baselines=False, search=search,
                                     mixed_precision="bf16" if precision == "bf16" else None))


def layout(plan) -> str:
    if plan is None:
        return "-"
    pp = len(plan.stages) if plan.stages else 1
    sub = "x".join(str(s) for a, s in zip(plan.mesh.axis_names, plan.mesh.shape) if a != "pp")
    rc = f", rc {len(plan.recompute)}" if plan.recompute else ""
    if pp > 1:
        return f"pp{plan.mesh.shape[0]} x ({sub}) m{plan.num_microbatches} {plan.schedule}{rc}"
    if plan.stages:   # one stage of several micro-batches: gradient accumulation
        return f"accumulate ({sub}) m{plan.num_microbatches}{rc}"
    return f"spmd {sub}{rc}"


def run(name: str, n: int, precision: str, budgets, search: str, verbose: bool = False) -> list[dict]:
    import autopar
    from autopar.pipeline.search import Profiler
    model, inputs = build(name, n)
    mesh = autopar.Mesh((n,), hardware="h100", devices_per_node=PER_NODE)
    policy = "bf16" if precision == "bf16" else None
    prof = Profiler(model, inputs, mesh.hardware, PER_NODE, mixed_precision=policy)   # shared by every recipe
    rows = []
    for budget in budgets:
        start, cpu = time.perf_counter(), time.process_time()
        auto = auto_plan(model, inputs, n, budget, precision, search)
        t_auto, c_auto = time.perf_counter() - start, time.process_time() - cpu
        hand, cutoff = {}, float("inf")
        for r, kw in sorted(recipes(n).items(), key=lambda item: bool(item[1].get("ac"))):   # --ac ones last
            hand[r] = best_recipe(prof, model, inputs, mesh, budget, kw, cutoff)
            if verbose:
                print(f"    {r:<12} {hand[r][0] * 1e3 if hand[r] else float('nan'):10.1f} ms  "
                      f"{hand[r][1] if hand[r] else 'infeasible or pruned'}", flush=True)
            cutoff = min([cutoff] + [hand[r][0]] if hand[r] else [cutoff])
        fits = {r: h for r, h in hand.items() if h is not None}
        best = min(fits, key=lambda r: fits[r][0], default=None)
        rows.append({"model": name, "devices": n, "precision": precision, "budget": budget, "auto": auto,
                     "best_recipe": best, "hand": fits.get(best), "seconds": time.perf_counter() - start,
                     "cpu": time.process_time() - cpu, "auto_seconds": t_auto, "auto_cpu": c_auto})
        _print(rows[-1])
    return rows


def _print(row: dict) -> None:
    auto, hand = row["auto"], row["hand"]
    a = f"{auto.predicted_step_time * 1e3:10.1f}" if auto else f"{'infeasible':>10}"
    h = f"{hand[0] * 1e3:10.1f}" if hand else f"{'infeasible':>10}"
    ratio = f"{auto.predicted_step_time / hand[0]:6.3f}" if auto and hand else f"{'-':>6}"
    mem = f"{auto.memory_per_device / 1e9:5.1f}" if auto else f"{'-':>5}"
    mfu = f"{auto.predicted_mfu * 100:5.1f}%" if auto and auto.predicted_mfu else f"{'-':>6}"
    recipe = f"{row['best_recipe']} {hand[1]}" if hand else "-"
    print(f"{row['model']:<13}{row['devices']:>5} {row['precision']:<5}{row['budget']:>5} {a} {mem} {mfu} "
          f"{layout(auto):<34}{h} {ratio}  {recipe:<44}{row['auto_seconds']:6.0f}s{row['auto_cpu']:6.0f}s"
          f"{row['seconds']:6.0f}s{row['cpu']:6.0f}s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help=f"only {QUICK}")
    ap.add_argument("--full-depth", action="store_true", help=f"only {FULL_DEPTH}: slow (tens of minutes per row)")
    ap.add_argument("--model", action="append", help="a model name, or NAME/L for L layers of its width")
    ap.add_argument("--devices", type=int, action="append")
    ap.add_argument("--precision", action="append", choices=("fp32", "bf16"))
    ap.add_argument("--budget", action="append", help=f"memory budget per device (default: {', '.join(BUDGETS)})")
    ap.add_argument("--search", default="fast", choices=("fast", "exact"), help="auto's search= (default: fast)")
    ap.add_argument("--verbose", action="store_true", help="print every recipe's best layout")
    args = ap.parse_args()
    if args.quick:
        cases = QUICK
    elif args.full_depth:
        cases = FULL_DEPTH
    elif args.model or args.devices or args.precision:
        cases = [(m, n, p) for m in (args.model or SMALL) for n in (args.devices or DEVICES)
                 for p in (args.precision or ["fp32"])]
    else:
        cases = [(m, n, "fp32") for m in SMALL for n in DEVICES] + LARGE
    print(f"{'model':<13}{'dev':>5} {'prec':<5}{'budg':>5} {'auto ms':>10} {'GB':>5} {'MFU':>6} {'auto layout':<34}"
          f"{'hand ms':>10} {'ratio':>6}  {'best recipe':<44}{'plan':>7}{'cpu':>7}{'row':>7}{'cpu':>7}")
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, n, precision in cases:
            rows += run(name, n, precision, tuple(args.budget or BUDGETS), args.search, args.verbose)
    both = [r for r in rows if r["auto"] and r["hand"]]
    at_most = sum(r["auto"].predicted_step_time <= r["hand"][0] * (1 + TIE) for r in both)
    better = sum(r["auto"].predicted_step_time <= 0.9 * r["hand"][0] for r in both)
    only_auto = sum(1 for r in rows if r["auto"] and not r["hand"])
    only_hand = sum(1 for r in rows if r["hand"] and not r["auto"])
    print(f"{len(rows)} rows; both feasible in {len(both)}: auto <= best recipe in {at_most}, >= 10% faster in "
          f"{better}; only auto fits in {only_auto}; only a recipe fits in {only_hand}")


if __name__ == "__main__":
    main()
