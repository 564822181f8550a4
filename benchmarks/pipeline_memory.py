"""Measured against predicted memory of each pipeline schedule's stages, on this CPU (2 ranks, gloo).

    python benchmarks/pipeline_memory.py            # every schedule, each in a fresh torchrun of 2 ranks
    python benchmarks/pipeline_memory.py --schedules 1f1b zero_bubble

A GPT (4 layers x 512, batch 32 x 512) is planned as two stages with 8 micro-batches under each schedule
(`autoparallelize(num_stages=2, schedule=...)`; the interleaved and V schedules: two chunks per rank). Measured: each rank's peak resident memory during one
`train_step` above its resident memory before it (VmHWM after resetting it through /proc/self/clear_refs),
the third step of the process, with glibc's allocator told to map every block of 64 kB or more on its
own (MALLOC_MMAP_THRESHOLD_), so that a freed activation leaves the resident set at once and the peak is
the step's own: the gradients, the activations the schedule keeps and the step's temporaries. Predicted:
the plan's bytes of that rank's stage or chunks (parameters, gradients, optimizer state, in-flight activations). The
state the step does not allocate (parameters, optimizer state) and what every schedule allocates alike
cancel in the difference to 1F1B, which is what the table compares: the in-flight memory of the schedule.
Linux only (/proc).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

SCHEDULES = ("gpipe", "1f1b", "zero_bubble", "interleaved_zero_bubble", "zero_bubble_v")
MiB = 2 ** 20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rank_main(schedule: str, out_dir: str) -> None:
    """One rank of the torchrun job: plan, warm up, measure one step; writes OUT_DIR/rank<r>.json."""
    import warnings
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist

    import autopar
    from autopar._testing.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=512, n_layer=4, n_head=8, n_embd=512))
    batch = (torch.randint(0, 512, (32, 512)), torch.randint(0, 512, (32, 512)))
    pmodel = autopar.autoparallelize(model, batch, num_stages=2, schedule=schedule, num_microbatches=8,
                                     baselines=False)
    opt = pmodel.optimizer(torch.optim.AdamW, lr=1e-4)
    for _ in range(2):   # the optimizer state exists and every buffer of the schedule has been made once
        pmodel.train_step(*batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.barrier()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # VmHWM := VmRSS
    pmodel.train_step(*batch)
    growth = _status("VmHWM") - before
    rank = dist.get_rank()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        predicted = sum(st.memory for st in pmodel.plan.stages if rank in st.ranks)   # its chunks (interleaved: 2)
        json.dump({"schedule": schedule, "rank": rank, "measured": growth, "predicted": predicted}, f)
    dist.destroy_process_group()


def run(schedule: str) -> list[dict]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as out_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", __file__, "--rank-main",
               schedule, "--out-dir", out_dir]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if out.returncode:
            raise RuntimeError(f"{schedule}: torchrun failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
        rows = []
        for rank in range(2):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                rows.append(json.load(f))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    ap.add_argument("--rank-main", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        rank_main(args.rank_main, args.out_dir)
        return
    schedules = list(dict.fromkeys(["1f1b", *args.schedules]))   # the reference
    rows = {s: run(s) for s in schedules}
    ref = rows["1f1b"]
    print(f"{'schedule':12s} {'stage':>5s} {'predicted MiB':>14s} {'step growth MiB':>16s} "
          f"{'predicted - 1F1B':>17s} {'measured - 1F1B':>16s}")
    for s in schedules:
        for r, base in zip(rows[s], ref):
            print(f"{s:12s} {r['rank']:5d} {r['predicted'] / MiB:14.1f} {r['measured'] / MiB:16.1f} "
                  f"{(r['predicted'] - base['predicted']) / MiB:17.1f} {(r['measured'] - base['measured']) / MiB:16.1f}")


if __name__ == "__main__":
    main()
