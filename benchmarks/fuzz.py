"""Longer fuzzing than CI's fixed set: hypothesis draws random small transformer configurations and
meshes (autopar/_testing/fuzz_cases.py), each is planned and trained 3 AdamW steps at world 2 and compared with one
process of the unmodified model.

Run:  python benchmarks/fuzz.py [--cases 40] [--seed 7] [--batch-size 10]
Prints every case with its outcome (ok / refused with autopar's error / FAIL with the error) and a
summary line; exits 1 when any case failed. Cases run in jobs of --batch-size so one hung case costs
one job's timeout, not the run.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict

from autopar._testing.dist_utils import run_distributed
from autopar._testing.fuzz_cases import draw_cases, run_cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=40, help="how many configurations to draw (default 40)")
    ap.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0; CI uses 2026)")
    ap.add_argument("--batch-size", type=int, default=10, help="cases per world-2 job (default 10)")
    args = ap.parse_args(argv)
    cases = draw_cases(args.cases, args.seed)
    start, tally, failures = time.perf_counter(), {"ok": 0, "refused": 0, "FAIL": 0}, []
    for first in range(0, len(cases), args.batch_size):
        chunk = [asdict(c) for c in cases[first:first + args.batch_size]]
        try:
            results = run_distributed(run_cases, 2, chunk, timeout=120 * len(chunk))[0]
        except AssertionError as e:  # a crashed or hung job: every case in it counts as failed
            results = [(c, "FAIL", f"job failed: {str(e).splitlines()[0]}") for c in chunk]
        for case, outcome, detail in results:
            tally[outcome] += 1
            line = f"{outcome:8s} {case}"
            print(line + (f"\n         {detail.strip().splitlines()[-1]}" if detail else ""), flush=True)
            if outcome == "FAIL":
                failures.append(line)
    print(f"\n{len(cases)} cases (seed {args.seed}) in {time.perf_counter() - start:.0f} s: "
          f"{tally['ok']} ok, {tally['refused']} refused with an autopar error, {tally['FAIL']} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
