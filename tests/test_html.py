"""The HTML report: one self-contained file whose sections and script render (headless Chromium if present)."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

import autopar
from autopar._testing.gpt import GPT, GPTConfig
from autopar.plan import Plan, StagePlan

CHROMIUM = "/usr/bin/chromium"
SECTIONS = ("tree", "collectives", "memory", "baselines", "plan-data", "filter", "header")


@pytest.fixture(scope="module")
def plan() -> Plan:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64))
    x = torch.randint(0, 128, (4, 32))
    return autopar.plan(model, (x, x), mesh=autopar.Mesh((2,), hardware="a100"), memory_budget="40MB")


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids, self.tags, self.urls = set(), [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for key, value in attrs:
            if key == "id":
                self.ids.add(value)
            if key in ("src", "href") or (value and "://" in value and key != "xmlns"):
                self.urls.append((tag, key, value))


def _write(plan, tmp_path) -> tuple[Path, str]:
    path = tmp_path / "plan.html"
    plan.to_html(path)
    return path, path.read_text(encoding="utf-8")


def test_report_is_self_contained_with_every_section(plan, tmp_path):
    _, text = _write(plan, tmp_path)
    parser = _Collect()
    parser.feed(text)
    assert set(SECTIONS) <= parser.ids
    assert not parser.urls and "<link" not in text            # nothing fetched from the network
    assert "transformer.h.{0..1} ×2" in text and "rect" in text and "budget 40.0 MB" in text
    assert all(name in text for name in plan.baselines)


def test_stages_are_coloured(plan, tmp_path):
    stages = (StagePlan(0, ("transformer.wte", "transformer.wpe", "transformer.h.0"), (0,), 1e-4, 2e6),
              StagePlan(1, ("transformer.h.1", "transformer.ln_f", "lm_head", ""), (1,), 1e-4, 3e6))
    _, text = _write(dataclasses.replace(plan, stages=stages, num_microbatches=4, schedule="1f1b"), tmp_path)
    assert "<th>stage</th>" in text and "stage 0" in text and "stage 1" in text


def _script_and_data(text: str) -> tuple[str, str]:
    data = re.search(r"<script type='application/json' id='plan-data'>(.*?)</script>", text, re.S).group(1)
    script = re.search(r"<script>(.*?)</script>", text, re.S).group(1)
    json.loads(data)
    return script, data


STUB_DOM = """
const made = {};
function el(id) { return {id: id, textContent: '', style: {}, attrs: {'data-group': '0'},
  classList: {contains: () => false, toggle: () => {}}, addEventListener: () => {},
  getAttribute(k) { return this.attrs[k]; }}; }
global.document = {
  getElementById: (id) => id === 'plan-data' ? {textContent: DATA} : (made[id] = made[id] || el(id)),
  querySelectorAll: () => [el('a'), el('b')],
  createElement: () => el(''),
  body: {appendChild: (x) => console.log('APPENDED ' + x.id + ' ' + made['n-collectives'].textContent)},
};
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node.js not installed")
def test_script_runs_and_writes_marker_under_node(plan, tmp_path):
    script, data = _script_and_data(_write(plan, tmp_path)[1])
    js = tmp_path / "page.js"
    js.write_text(f"const DATA = {json.dumps(data)};\n{STUB_DOM}\n{script}")
    result = subprocess.run(["node", str(js)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"APPENDED autopar-ok {len(plan.collectives)}" in result.stdout


def _chromium_or_skip() -> None:
    """Skip without Debian's chromium, except where REQUIRE_CHROMIUM=1 (.ci/run installs it): fail there."""
    if Path(CHROMIUM).exists():
        return
    if os.environ.get("REQUIRE_CHROMIUM") == "1":
        pytest.fail(f"REQUIRE_CHROMIUM=1 but {CHROMIUM} is missing: apt-get install chromium")
    pytest.skip("Debian chromium not installed")


def test_headless_chromium_renders_without_script_error(plan, tmp_path):
    _chromium_or_skip()
    path, _ = _write(plan, tmp_path)
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
           "--dump-dom", path.as_uri()]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    assert 'id="autopar-ok"' in dom
    assert f'id="n-collectives">{len(plan.collectives)}<' in dom
    for section in SECTIONS:
        assert f'id="{section}"' in dom
