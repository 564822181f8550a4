"""A two-node launch on loopback: two `torch.distributed.run` agents (--nnodes 2 --nproc_per_node 2,
c10d rendezvous) run a tiny GPT through autopar on 4 ranks, on a 2x2 (dp, tp) mesh and on the
default 1-D mesh, 3 AdamW steps. Every rank must report the same losses, equal to one process's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from autopar._testing.dist_utils import free_port

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 420  # the 2x2 plan alone takes ~1-1.5 min on 2 shared cores (see report)
STEPS = 3

WORKER = """
import json, os, sys
import torch
import autopar
from autopar import autoparallelize
from autopar._testing.gpt import GPT, GPTConfig
sys.path.insert(0, {tests!r})
from test_launch import make_model_and_batches

mesh_kind, out_dir = sys.argv[1], sys.argv[2]
model, batches = make_model_and_batches()
kw = {{}}
if mesh_kind == "2d":
    kw = dict(mesh=autopar.Mesh((2, 2), axis_names=("dp", "tp"), devices_per_node=2),
              strategy={{"dp": "dp", "tp": "tp"}})
pmodel = autoparallelize(model, batches[0], **kw)
opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-2, eps=1e-6)
losses = []
for step in range({steps}):
    opt.zero_grad()
    losses.append(pmodel.train_step(*batches[step % len(batches)]).item())
    opt.step()
rank = int(os.environ["RANK"])
with open(os.path.join(out_dir, f"rank{{rank}}.json"), "w") as f:
    json.dump({{"rank": rank, "group_rank": int(os.environ["GROUP_RANK"]), "losses": losses}}, f)
"""


def make_model_and_batches():
    """The tiny GPT and its batches, identical in the workers and in the reference run."""
    from autopar._testing.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 64, (8, 16), generator=gen), torch.randint(0, 64, (8, 16), generator=gen))
               for _ in range(STEPS)]
    return model, batches


def reference_losses(model, batches) -> list[float]:
    """The unmodified model in this one process, with the workers' optimizer and batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)  # eps: as autopar/_testing/dist_cases.py
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(*batches[step % len(batches)])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def launch_two_nodes(script: Path, args: list[str], cwd: Path) -> None:
    """Starts both node agents, waits for both (killing both on timeout or on the first failure)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    procs, logs = [], []
    for node_rank in range(2):
        log = open(cwd / f"node{node_rank}.log", "w+")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
               "--node_rank", str(node_rank), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
               "--rdzv_id", f"autopar-test-{port}", "--max_restarts", "0", str(script), *args]
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
        logs.append(log)
    deadline = time.monotonic() + TIMEOUT
    try:  # poll both: a failed agent must not leave the other waiting in rendezvous until the deadline
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:  # the agent and its workers share the session we gave them
                os.killpg(p.pid, 9)
                p.wait()
    text = "\n".join(f"--- node {i} (rc {p.returncode})\n" + (log.seek(0) or log.read())[-4000:]
                     for i, (p, log) in enumerate(zip(procs, logs)))
    for log in logs:
        log.close()
    assert all(p.returncode == 0 for p in procs), text


@pytest.mark.parametrize("mesh_kind", ["2d", "1d"])
def test_two_node_launch_matches_one_process(mesh_kind, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(Path(__file__).resolve().parent), steps=STEPS))
    launch_two_nodes(script, [mesh_kind, str(tmp_path)], tmp_path)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert sorted(r["group_rank"] for r in reports) == [0, 0, 1, 1]
    ref_losses = reference_losses(*make_model_and_batches())
    for r in reports:
        assert r["losses"] == reports[0]["losses"], (r["rank"], r["losses"], reports[0]["losses"])
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-4), (r["rank"], r["losses"], ref_losses)
