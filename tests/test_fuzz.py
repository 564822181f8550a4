"""Fuzzing (issue #9): hypothesis draws random small transformer configurations and meshes (a fixed seed
here; `benchmarks/fuzz.py` runs longer with any seed); each is planned and executed at world 2 and must
train like one process of the unmodified model, or be refused with autopar's own error where refusing is
right. See autopar/_testing/fuzz_cases.py for the space."""
from __future__ import annotations

from dataclasses import asdict

from autopar._testing.dist_utils import run_distributed
from autopar._testing.fuzz_cases import draw_cases, run_cases

SEED, CASES = 2026, 8


def test_random_configs_and_meshes_train_like_one_process():
    cases = draw_cases(CASES, SEED)
    assert len(cases) >= CASES - 1 and len({c.family for c in cases}) == 2  # the set really varies
    results = run_distributed(run_cases, 2, [asdict(c) for c in cases], timeout=1200)
    failures = [f"{case}: {detail}" for rank in results for case, outcome, detail in rank if outcome == "FAIL"]
    assert not failures, "\n".join(failures)
    outcomes = [outcome for _, outcome, _ in results[0]]
    assert outcomes.count("ok") >= len(cases) // 2, outcomes
