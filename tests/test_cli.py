"""The `autopar` command: plan/show/explain/diff, and one-line errors (exit 2) for bad arguments."""
from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopar.inspection.cli import main
from autopar.plan import Plan

REPO = Path(__file__).resolve().parents[1]
FACTORY = f"{Path(__file__).resolve()}:tiny_gpt"


def tiny_gpt():
    """The factory the CLI tests plan: (model, example_inputs)."""
    from autopar._testing.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64))
    x = torch.randint(0, 128, (4, 32))
    return model, (x, x)


def not_a_pair():
    return 3


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, str]:
    """One `autopar plan ... --out` run: the plan file and what it printed."""
    import io
    from contextlib import redirect_stdout

    path = tmp_path_factory.mktemp("cli") / "plan.json"
    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["plan", FACTORY, "--mesh", "2", "--hardware", "a100", "--budget", "80GB",
                   "--axis-names", "dp", "--time-limit", "30", "--out", str(path), "--no-rich"])
    assert rc == 0, out.getvalue()
    return path, out.getvalue()


def run(argv, capsys) -> tuple[int, str, str]:
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_plan_prints_summary_and_saves_json(saved):
    path, out = saved
    assert "transformer.h.{0..1} ×2" in out and "budget 80.0 GB" in out and f"saved {path}" in out
    plan = Plan.load(path)
    assert plan.mesh.axis_names == ("dp",) and plan.memory_budget == 80e9


def test_show_explain_diff(saved, capsys, tmp_path):
    path, out = saved
    rc, shown, _ = run(["show", str(path), "--no-rich"], capsys)
    assert rc == 0 and shown.splitlines()[:10] == out.splitlines()[:10]
    rc, text, _ = run(["explain", str(path), "transformer.h.0.attn.c_attn.weight"], capsys)
    assert rc == 0 and "chosen" in text and "verdict" in text
    plan = Plan.load(path)
    name = "transformer.h.1.mlp.c_fc.weight"
    other = dataclasses.replace(plan, strategy="dp", params={
        **plan.params, name: dataclasses.replace(plan.params[name], master=("S1",), modes=("shard",))})
    other.save(tmp_path / "b.json")
    rc, text, _ = run(["diff", str(path), str(tmp_path / "b.json")], capsys)
    assert rc == 0 and "transformer.h.1" in text and "mlp.c_fc" in text and "-> S1 (zero3)" in text


BAD = [
    (["plan", FACTORY, "--mesh", "8y8"], "bad --mesh"),
    (["plan", FACTORY, "--mesh", "2", "--hardware", "tpu9"], "unknown hardware"),
    (["plan", FACTORY, "--mesh", "2", "--budget", "80 parsecs"], "byte count"),
    (["plan", FACTORY, "--mesh", "2", "--strategy", "megatron"], "unknown strategy"),
    (["plan", FACTORY, "--mesh", "2x2", "--axis-names", "dp"], "axis names"),
    (["plan", "no_such_module_xyz:make", "--mesh", "2"], "cannot import"),
    (["plan", "missing/file.py:make", "--mesh", "2"], "does not exist"),
    (["plan", f"{Path(__file__).resolve()}:nope", "--mesh", "2"], "no callable"),
    (["plan", f"{Path(__file__).resolve()}:not_a_pair", "--mesh", "2"], "must return (model, example_inputs)"),
    (["plan", "just_a_module", "--mesh", "2"], "bad factory"),
    (["plan", FACTORY], "--mesh"),
    (["show", "/no/such/plan.json"], "No such file"),
    (["explain", "/no/such/plan.json", "x"], "No such file"),
    (["frobnicate"], "invalid choice"),
    ([], "required"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a[:1] + a[2:4]) or "empty" for a, _ in BAD])
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    rc, out, err = run(argv, capsys)
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("autopar: error: ") and message in err


def test_explain_unknown_name(saved, capsys):
    rc, _, err = run(["explain", str(saved[0]), "transformer.h.0.atn"], capsys)
    assert rc == 2 and "close matches" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("protocol", [0, pickle.HIGHEST_PROTOCOL])
def test_pickle_plan_file_is_refused(tmp_path, capsys, protocol):
    marker = tmp_path / "pwned"
    path = tmp_path / "plan.json"
    path.write_bytes(pickle.dumps(_Evil(str(marker)), protocol=protocol))
    rc, _, err = run(["show", str(path)], capsys)
    assert rc == 2 and "not a plan file" in err and not marker.exists()


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


def test_python_dash_m_help_and_error_without_traceback():
    helped = subprocess.run([sys.executable, "-m", "autopar", "plan", "--help"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert helped.returncode == 0 and "--mesh" in helped.stdout and "MODULE:FACTORY" in helped.stdout
    bad = subprocess.run([sys.executable, "-m", "autopar", "show", "/no/such.json"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
