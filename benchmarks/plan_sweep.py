"""Does the default call plan every dense transformer from 1B to 1T parameters on 32-4,096 devices?

    python benchmarks/plan_sweep.py                       # every size x device count, full depth (hours)
    python benchmarks/plan_sweep.py --layers 2            # the same widths with 2 layers each (proxies)
    python benchmarks/plan_sweep.py --sizes 1b 8b --devices 32 128 --hardware a100

Each case is the default call in a fresh subprocess, on the meta device:
`autopar.plan(model, inputs, mesh=Mesh((N // 8, 8), hardware=HW), memory_budget="80GB",
mixed_precision="bf16")`, one 4,096-token sequence per device (global batch N). Llama-shaped configs
(GQA, SwiGLU, vocab 128,256): Llama-3.2-1B, Llama-3-8B, Llama-3-70B, Llama-3.1-405B, and a 1T model
(hidden 24,576, 128 layers, 192 heads, MLP 98,304). A case ends in a plan (its layout, step, MFU), an
InfeasiblePlanError (nothing fits 80 GB per device: a result, with the bound it reports), or an error
(anything else: a defect). Prints one row per case and the count of each; exits 1 if any case errored.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import warnings

SIZES = ("1b", "8b", "70b", "405b", "1t")
DEVICES = (32, 128, 512, 2048, 4096)
SEQ = 4096


def config(size: str, layers: int | None):
    from transformers import LlamaConfig

    from autopar._testing import models
    if size == "8b":
        return models.llama3_8b_config(layers or 32)
    if size == "70b":
        return models.llama3_70b_config(layers or 80)
    if size == "405b":
        return models.llama3_405b_config(layers or 126)
    shape = {"1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, intermediate_size=8192),
             "1t": dict(hidden_size=24576, num_hidden_layers=128, num_attention_heads=192,
                        intermediate_size=98304)}[size]
    shape["num_hidden_layers"] = layers or shape["num_hidden_layers"]
    return LlamaConfig(num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                       rope_theta=500000.0, **shape)


def run_case(size: str, devices: int, layers: int | None, hardware: str) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    import autopar
    from autopar.errors import InfeasiblePlanError
    with torch.device("meta"):
        model = LlamaForCausalLM(config(size, layers))
    ids = torch.zeros(devices, SEQ, dtype=torch.long, device="meta")
    params = sum(p.numel() for p in model.parameters())
    mesh = autopar.Mesh((devices // 8, 8), axis_names=("dp", "tp"), hardware=hardware, devices_per_node=8)
    row = {"size": size, "devices": devices, "params": params}
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = autopar.plan(model, (ids,), mesh=mesh, memory_budget="80GB", mixed_precision="bf16",
                                example_kwargs={"labels": ids})
        stages = len(plan.stages) if plan.stages else 1
        row.update(result="plan", layout=f"pp{stages} x {plan.mesh.shape}" if stages > 1 else f"SPMD {plan.mesh.shape}",
                   step=plan.predicted_step_time, memory=plan.memory_per_device, mfu=plan.predicted_mfu)
    except InfeasiblePlanError as e:
        row.update(result="infeasible", bound=e.min_memory_per_device)
    except Exception as e:  # noqa: BLE001 - the sweep reports every other outcome as a defect
        row.update(result="error", error=f"{type(e).__name__}: {e}"[:300])
    row.update(wall=time.perf_counter() - wall, cpu=time.process_time() - cpu,
               rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", choices=SIZES, default=list(SIZES))
    ap.add_argument("--devices", nargs="+", type=int, default=list(DEVICES))
    ap.add_argument("--layers", type=int, help="layers per model (default: each model's own depth)")
    ap.add_argument("--hardware", default="h100", choices=("h100", "a100"))
    ap.add_argument("--case", nargs=2, metavar=("SIZE", "DEVICES"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case[0], int(args.case[1]), args.layers, args.hardware)))
        return
    print(f"{'size':<6}{'params':>9}{'devices':>9}  {'result':<11}{'layout':<26}{'step s':>9}{'GB':>7}"
          f"{'MFU':>7}{'wall s':>8}{'cpu s':>8}{'RSS GB':>8}", flush=True)
    counts: dict[str, int] = {}
    for size in args.sizes:
        for n in args.devices:
            cmd = [sys.executable, __file__, "--case", size, str(n), "--hardware", args.hardware]
            cmd += ["--layers", str(args.layers)] if args.layers else []
            out = subprocess.run(cmd, capture_output=True, text=True)
            try:
                row = json.loads(out.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                row = {"size": size, "devices": n, "params": 0, "result": "error",
                       "error": (out.stderr.strip().splitlines() or ["no output"])[-1][:300], "wall": 0, "cpu": 0,
                       "rss_mb": 0}
            counts[row["result"]] = counts.get(row["result"], 0) + 1
            if row["result"] == "plan":
                what = f"{row['layout']:<26}{row['step']:>9.3f}{row['memory'] / 1e9:>7.1f}{row['mfu']:>7.1%}"
            elif row["result"] == "infeasible":
                what = f"{'needs >= %.1f GB' % (row['bound'] / 1e9):<26}{'':>23}"
            else:
                what = row["error"]
            print(f"{size:<6}{row['params'] / 1e9:>8.1f}B{n:>9}  {row['result']:<11}{what}{row['wall']:>8.0f}"
                  f"{row['cpu']:>8.0f}{row['rss_mb'] / 1024:>8.2f}", flush=True)
    print(", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    sys.exit(1 if counts.get("error") else 0)


if __name__ == "__main__":
    main()
