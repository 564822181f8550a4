"""CI's check of autopar as users install it: the built wheel, not the source tree (`.ci/run` calls it).

    python smoke_wheel.py --wheel dist/autopar-0.1.0-py3-none-any.whl --source /path/to/checkout

Run with the python of a fresh virtual environment the wheel was installed into, from a folder outside
the checkout. It checks, in order:
1. the wheel holds every module of autopar/, passes/ (as autopar/passes) and costmodel/ (as
   autopar/costmodel) and no other (a stale build/ folder would add some), and the `autopar` command;
2. `import autopar` (and its passes and costmodel) comes from this environment's site-packages;
3. planning a tiny model in one process, and `autopar --help`;
4. one training step on 2 ranks under torchrun, with autoparallelize's defaults (on CPU: this
   machine's profile, calibrated at first use into AUTOPAR_CACHE_DIR), whose loss equals one process's.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

FOLDERS = {"autopar": "autopar", "passes": "autopar/passes", "costmodel": "autopar/costmodel"}


def expected_modules(source: Path) -> set[str]:
    """Every .py file of the three source folders, at the path it must have in the wheel."""
    found = set()
    for folder, target in FOLDERS.items():
        for path in (source / folder).rglob("*.py"):
            found.add(f"{target}/{path.relative_to(source / folder).as_posix()}")
    return found


def check_wheel(wheel: Path, source: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    modules = {n for n in names if ".dist-info/" not in n}
    expected = expected_modules(source)
    missing, extra = sorted(expected - modules), sorted(modules - expected)
    assert not missing and not extra, f"wheel {wheel.name}: missing {missing}, not in the source tree {extra}"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "autopar = autopar.inspection.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    print(f"wheel: {len(modules)} modules, as in the source tree (autopar/passes: "
          f"{sum(m.startswith('autopar/passes/') for m in modules)}, autopar/costmodel: "
          f"{sum(m.startswith('autopar/costmodel/') for m in modules)})")


def check_import(source: Path) -> None:
    import autopar
    import autopar.costmodel
    import autopar.passes
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    for module in (autopar, autopar.passes, autopar.costmodel):
        where = Path(module.__file__).resolve()
        assert where.is_relative_to(site), f"{module.__name__} imported from {where}, not this environment's {site}"
        assert not where.is_relative_to(source.resolve()), f"{module.__name__} imported from the checkout: {where}"
    print(f"import: autopar from {Path(autopar.__file__).parent}")


def check_plan_and_cli() -> None:
    import torch

    import autopar
    from autopar._testing.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    ids = torch.randint(0, 64, (8, 16))
    plan = autopar.plan(model, (ids, ids), mesh=autopar.Mesh((2,)))
    assert plan.feasible and "step time" in str(plan)
    command = Path(sys.executable).parent / "autopar"
    shown = subprocess.run([str(command), "--help"], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "calibrate" in shown and "explain" in shown, shown
    print(f"plan: {plan.recipes} predicted {plan.predicted_step_time * 1e3:.2f} ms; `{command} --help` runs")


def check_training(here: Path) -> None:
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(here), "--train-rank"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"2-rank training step failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    print(proc.stdout.strip())
    print(f"torchrun: 2 ranks trained one step in {time.perf_counter() - start:.1f} s (launch included)")


def train_rank() -> None:
    """Under torchrun: one step of autoparallelize's defaults; its loss against one process's."""
    import torch
    import torch.distributed as dist

    import autopar
    from autopar._testing.gpt import GPT, GPTConfig
    from autopar.runtime.launch import leave_job
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    ids = torch.randint(0, 64, (8, 16))
    expected = model(ids, ids).item()
    pmodel = autopar.autoparallelize(model, (ids, ids))
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    loss = pmodel.train_step(ids, ids).item()
    opt.step()
    assert abs(loss - expected) < 1e-5, (loss, expected)
    if dist.get_rank() == 0:
        print(f"train: loss {loss:.6f} (one process: {expected:.6f}), mesh {pmodel.plan.mesh}")
    dist.destroy_process_group()
    leave_job()   # no interpreter shutdown while gloo's threads may still release a collective (its docstring)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheel", type=Path)
    parser.add_argument("--source", type=Path, help="the checkout the wheel was built from")
    parser.add_argument("--train-rank", action="store_true", help="(internal) one rank of the torchrun step")
    args = parser.parse_args()
    if args.train_rank:
        return train_rank()
    source = args.source.resolve()
    on_path = [p for p in sys.path if Path(p or ".").resolve() == source]
    assert not Path.cwd().resolve().is_relative_to(source) and not on_path, "run from outside the checkout"
    check_wheel(args.wheel, args.source)
    check_import(args.source)
    check_plan_and_cli()
    check_training(Path(__file__).resolve())
    print("smoke test of the wheel: ok")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
