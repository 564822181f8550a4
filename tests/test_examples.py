"""Runs examples/train_gpt.py as a user would: under torchrun on 2 ranks, and as a plain script (a
world of one). Checks the exit code, that the loss falls, and that a resumed checkpoint replays the
same losses. Small settings keep each run to seconds of compute; never asserts on time."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import free_port

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "train_gpt.py"
SMALL = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--block", "32", "--batch", "8", "--lr", "1e-2",
         "--threads", "1"]
TIMEOUT = 300


def run_example(args: list[str], world: int | None, cwd: Path) -> str:
    """Runs the example (under torch.distributed.run when `world`), returns stdout; fails on rc != 0."""
    launcher = [] if world is None else ["-m", "torch.distributed.run", "--nproc_per_node", str(world),
                                         "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    cmd = [sys.executable, *launcher, str(SCRIPT), *SMALL, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:  # subprocess.run kills the launcher; its workers follow it
        pytest.fail(f"timed out after {TIMEOUT}s: {' '.join(cmd)}\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, f"rc {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def logged_losses(stdout: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^step\s+(\d+)\s+loss\s+([0-9.]+)", stdout, re.M)}


@pytest.mark.parametrize("world", [2, None], ids=["torchrun-2", "world-1"])
def test_train_gpt_loss_falls(world, tmp_path):
    out = run_example(["--steps", "30", "--log-every", "10", "--out", str(tmp_path / "final.pt")], world, tmp_path)
    losses = logged_losses(out)
    final = float(re.search(r"^final loss ([0-9.]+)", out, re.M).group(1))
    assert sorted(losses) == [0, 10, 20, 29]
    assert final == losses[29] and final < losses[0] - 0.5, out
    assert len(re.findall(r"^world \d+, vocab", out, re.M)) == 1, "rank 0 alone prints"
    assert "step time" in out, "the plan summary is printed"
    assert (tmp_path / "final.pt").exists()


def test_train_gpt_checkpoint_resume(tmp_path):
    """A run resumed from the step-10 checkpoint (model + AdamW state through DCP) replays the
    uninterrupted run's losses for steps 10..19."""
    ckpt = tmp_path / "ckpt"
    common = ["--steps", "20", "--log-every", "1", "--checkpoint-every", "10", "--checkpoint-dir", str(ckpt)]
    full = logged_losses(run_example(common, 2, tmp_path))
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_10", "step_20"]
    import shutil
    shutil.rmtree(ckpt / "step_20")
    out = run_example(common, 2, tmp_path)
    assert "resumed from" in out and "at step 10" in out, out
    resumed = logged_losses(out)
    assert sorted(resumed) == list(range(10, 20))
    for step, loss in resumed.items():
        assert loss == pytest.approx(full[step], abs=1e-4), (step, loss, full[step])
