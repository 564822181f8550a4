"""README's Llama-3-8B plan summary is what examples/inspect_plan.py prints today (timings aside)."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"



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
