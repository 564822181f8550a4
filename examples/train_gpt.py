"""Train the hand-written GPT (autopar/_testing/gpt.py) on a small shipped text, character-level, with autopar.

    torchrun --nproc_per_node 2 examples/train_gpt.py                 # auto plan on 2 ranks
    torchrun --nproc_per_node 2 examples/train_gpt.py --strategy zero3
    python examples/train_gpt.py --steps 50                           # a world of one, no torchrun

Each rank loads only its own slice of every global batch: a DataLoader whose DistributedSampler is built
from the module's data-parallel rank and size (`pmodel.distributed_sampler`; ranks that differ only on a
tensor-parallel axis read the same slice, and under a pipeline only the first stage's ranks load data).
Rank 0 prints the plan once, then the loss every `--log-every` steps.
`--checkpoint-every K --checkpoint-dir D` saves model and optimizer state with
torch.distributed.checkpoint (sharded: every rank writes its own DTensor shards) and resumes from
the newest checkpoint in D when one exists — also under another strategy or world size (DCP
reshards the saved DTensors into the new plan's placements; every step's global batch is the same set
of windows whatever the world size, so a resumed run sees the batches the uninterrupted one saw).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.utils.data import DataLoader, Dataset

HERE = Path(__file__).resolve().parent

from autopar import autoparallelize
from autopar._testing.gpt import GPT, GPTConfig
from autopar.runtime import checkpoint
from autopar.runtime.launch import leave_job


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=str(HERE / "data" / "tiny.txt"))
    p.add_argument("--strategy", default="auto", help="auto | dp | zero1 | zero2 | zero3 | tp")
    p.add_argument("--num-stages", type=_stages, default=None,
                   help="pipeline stages (an int >= 2 forces a pipeline; 'auto' searches pp x dp x tp)")
    p.add_argument("--schedule", default=None, help="pipeline schedule: gpipe | 1f1b (default 1f1b)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16,
                   help="global batch; each rank loads batch / data-parallel size of it")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads per rank (0: torch's default; torchrun sets OMP_NUM_THREADS=1)")
    p.add_argument("--out", default=None, help="torch.save the full (unsharded) state dict here on rank 0")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--fail-at-step", type=int, default=None,
                   help="fault injection for tests: on torchrun's first attempt the last rank SIGKILLs itself "
                        "before this step (run with --max-restarts 1 to see the job resume from a checkpoint)")
    return p.parse_args(argv)


def _stages(text: str):
    return text if text == "auto" else int(text)


class CharData(Dataset):
    """Character-level tokens of a text file; item i is the window at offset i: (x, y = x shifted by one)."""

    def __init__(self, path: str, block: int):
        text = Path(path).read_text(encoding="utf-8")
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        self.tokens = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.block = block

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def __len__(self) -> int:
        return len(self.tokens) - self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[i:i + self.block], self.tokens[i + 1:i + 1 + self.block]


def rank_batches(data: CharData, pmodel, args, start: int):
    """This rank's slice of every global batch from step `start` on: a DataLoader of
    `batch / data_parallel_size` windows drawn by the module's DistributedSampler, reshuffled each epoch
    (`set_epoch`); a resumed run skips the steps already taken. Yields None on ranks that feed nothing."""
    if not pmodel.needs_inputs:   # a later pipeline stage: its inputs arrive from the previous stage
        while True:
            yield None
    sampler = pmodel.distributed_sampler(data, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch // pmodel.data_parallel_size, sampler=sampler, drop_last=True)
    epoch, skip = divmod(start, len(loader))
    while True:
        sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if i >= skip:
                yield batch
        epoch, skip = epoch + 1, 0


def describe_plan(plan) -> str:
    """The plan's own summary, or a short manual one if the renderer is unavailable."""
    try:
        return str(plan)
    except Exception as e:  # the summary renderer is optional for training
        modes = {}
        for name, p in plan.params.items():
            modes.setdefault("/".join(p.modes), []).append(name)
        lines = [f"plan ({type(e).__name__} in summary): strategy={plan.strategy} "
                 f"predicted step {plan.predicted_step_time * 1e3:.2f} ms, "
                 f"memory/device {plan.memory_per_device / 2**20:.1f} MiB"]
        lines += [f"  {mode}: {len(names)} parameters" for mode, names in modes.items()]
        return "\n".join(lines)


def latest_checkpoint(ckpt_dir: str | None) -> Path | None:
    if not ckpt_dir or not Path(ckpt_dir).is_dir():
        return None
    done = [d for d in Path(ckpt_dir).glob("step_*") if (d / ".metadata").exists()]
    return max(done, key=lambda d: int(d.name.split("_")[1]), default=None)


def _state(pmodel, opt) -> dict:
    """What a checkpoint holds: the model's DTensor state dict and the optimizer's (DTensor states)."""
    return {"model": pmodel.state_dict(), "optim": checkpoint.optimizer_state_dict(pmodel, opt)}


def save_checkpoint(pmodel, opt, ckpt_dir: str, step: int) -> Path:
    path = Path(ckpt_dir) / f"step_{step}"
    dcp.save({**_state(pmodel, opt), "step": torch.tensor(step)}, checkpoint_id=str(path))
    return path


def load_checkpoint(pmodel, opt, path: Path) -> int:
    """Loads in place into the DTensor shards; returns the step the checkpoint was taken after."""
    state = {**_state(pmodel, opt), "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=str(path))
    pmodel.load_state_dict(state["model"])
    checkpoint.load_optimizer_state_dict(pmodel, opt, state["optim"])
    return int(state["step"])


def setup(args):
    """Data, model and the parallelized module with its optimizer, resumed from a checkpoint if any."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # every rank builds the same initial model
    data = CharData(args.data, args.block)
    config = GPTConfig(vocab_size=data.vocab_size, block_size=args.block, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd, dropout=0.0)
    model = GPT(config)
    x, y = zip(*(data[i] for i in range(args.batch)))
    example = (torch.stack(x), torch.stack(y))  # the global batch's shapes: what the plan splits
    # optimizer="fused_adamw": the plan prices the step pmodel.optimizer takes below (local shards, fused kernel)
    pmodel = autoparallelize(model, example, strategy=args.strategy, num_stages=args.num_stages,
                             schedule=args.schedule, optimizer="fused_adamw")
    log = print if dist.get_rank() == 0 else (lambda *a, **k: None)
    log(f"world {dist.get_world_size()}, vocab {data.vocab_size}, {len(data.tokens)} tokens, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    log(describe_plan(pmodel.plan))
    log(f"data: each rank loads {args.batch // pmodel.data_parallel_size} of the {args.batch} windows of a step "
        f"(data_parallel_size {pmodel.data_parallel_size})")
    opt = pmodel.optimizer(torch.optim.AdamW, lr=args.lr, weight_decay=0.0)   # AdamW on the local shards
    start, ckpt = 0, latest_checkpoint(args.checkpoint_dir)
    if ckpt is not None:
        start = load_checkpoint(pmodel, opt, ckpt)
        log(f"resumed from {ckpt} at step {start}")
    return data, pmodel, opt, start, log


def _maybe_fail(args, step: int) -> None:
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if args.fail_at_step == step and first_attempt and dist.get_rank() == dist.get_world_size() - 1:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv=None) -> list[float]:
    """Trains, returns this rank's losses (the same on every rank)."""
    args = parse_args(argv)
    data, pmodel, opt, start, log = setup(args)
    batches = rank_batches(data, pmodel, args, start)
    losses, t0 = [], time.perf_counter()
    for step in range(start, args.steps):
        _maybe_fail(args, step)
        batch = next(batches)
        opt.zero_grad(set_to_none=True)
        losses.append(pmodel.train_step(*(batch or ())).item())
        opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            ms = (time.perf_counter() - t0) / len(losses) * 1e3
            log(f"step {step:4d}  loss {losses[-1]:.4f}  ({ms:.0f} ms/step)")
        if args.checkpoint_every and args.checkpoint_dir and (step + 1) % args.checkpoint_every == 0:
            log(f"saved checkpoint {save_checkpoint(pmodel, opt, args.checkpoint_dir, step + 1)}")
    if losses:
        log(f"final loss {losses[-1]:.4f}")
    if args.out:
        state = pmodel.full_state_dict()  # a collective: every rank takes part
        if dist.get_rank() == 0:
            torch.save(state, args.out)
            log(f"wrote {args.out}")
    dist.barrier()
    dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
    # without the interpreter's shutdown, which can abort a gloo rank whose threads still release a collective
    # (its docstring); everything is written and the process group destroyed by now
    leave_job()
