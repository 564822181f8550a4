"""The README shows what the code does: its Llama-3-8B plan summary is what examples/inspect_plan.py
prints today (timings aside), and every ```python block in it runs as it stands."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_LINES = 200
# The one reason a README block may be left unrun; the comment goes on the line before its fence.
NOT_RUN = "<!-- not run: needs torchrun -->"
TIMEOUT = 600


def _stable(text: str) -> list[str]:
    lines, skip_next = [], False
    for line in text.strip("\n").splitlines():
        if line.startswith("planning"):
            skip_next = True  # the planning line wraps onto the next one
            continue
        if skip_next and line.startswith(" "):
            skip_next = False
            continue
        skip_next = False
        if line.startswith("solver"):
            line = re.sub(r"[\d.]+ (s|ms)\b", "<t>", line)
        lines.append(line.rstrip())
    return lines


def test_readme_shows_the_summary_the_example_prints():
    from examples.inspect_plan import summary_text
    block = re.search(r"<!-- inspect_plan:begin -->\n```\n(.*?)\n```\n<!-- inspect_plan:end -->",
                      README.read_text(), re.S).group(1)
    assert _stable(summary_text()) == _stable(block)


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """(line number of the opening fence, code, whether it is marked not to run) for every ```python
    block. A block is marked when the last non-blank line before its fence is exactly NOT_RUN."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        if lines[i].strip() != "```python":
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        blocks.append((i + 1, "\n".join(lines[i + 1:end]) + "\n", before == NOT_RUN))
        i = end + 1
    return blocks


BLOCKS = python_blocks(README.read_text())


def test_readme_is_short_and_its_blocks_are_found():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES, f"README.md has {len(text.splitlines())} lines (at most {MAX_LINES})"
    assert sum(not skipped for _, _, skipped in BLOCKS) >= 2, "the README's runnable ```python blocks were not found"
    assert sum(skipped for _, _, skipped in BLOCKS) <= 1, f"only one README block may be marked {NOT_RUN}"
    # any other "not run" comment would silently run its block: refuse it rather than guess
    assert all(m == NOT_RUN for m in re.findall(r"<!--\s*not run.*?-->", text)), \
        f"the only reason for leaving a README block unrun is {NOT_RUN!r}"


@pytest.mark.parametrize(
    "lineno, code",
    [pytest.param(n, code, id=f"README.md:{n}",
                  marks=[pytest.mark.skip(reason="needs torchrun")] if skipped else [])
     for n, code, skipped in BLOCKS])
def test_readme_python_block_runs(lineno, code, tmp_path):
    """Each block runs alone in a fresh interpreter, in an empty folder, as a reader would paste it."""
    script = tmp_path / f"readme_line_{lineno}.py"
    script.write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, (f"README.md block at line {lineno} failed (exit {proc.returncode}):\n"
                                  f"{proc.stderr[-4000:]}")
