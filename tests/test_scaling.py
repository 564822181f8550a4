"""`autopar.planning.scaling`: the table, the plot, and a stop point that moves the right way.

The model is GPT-2 1.5B's shape (d 1600, 25 heads, vocab 50257, sequence 1024) on the meta device,
2 layers instead of 48 so that planning stays fast (every layer is identical, so the per-layer
figures and the stop point's direction do not depend on depth)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from autopar import scaling
from autopar._testing.gpt import GPT, GPTConfig
from autopar.costmodel.hardware import H100, LinkSpec
from autopar.errors import InputError
from autopar.planning.scaling import ScalingReport, default_mesh_shape, parse_devices

DEVICES = [1, 2, 4, 8, 16, 32, 64]


def gpt2_xl_shape(batch: int, n_layer: int = 2):
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=50257, block_size=1024, n_layer=n_layer, n_head=25, n_embd=1600))
    ids = torch.empty(batch, 1024, dtype=torch.long, device="meta")
    return model, (ids, ids)


def one_link(bandwidth: float):
    """H100 with every device in one node on a link of `bandwidth`: 1-D meshes, quick to plan."""
    return dataclasses.replace(H100, name=f"h100-{bandwidth / 1e9:.0f}GBps",
                               intra_node=LinkSpec(bandwidth, 10e-6))


def test_h100_table_and_plot(tmp_path):
    report = scaling(*gpt2_xl_shape(8), devices=[1, 2, 4, 8, 16], hardware="h100", memory_budget="80GB")
    assert isinstance(report, ScalingReport)
    assert [r.devices for r in report.rows] == [1, 2, 4, 8, 16]
    assert report.rows[-1].mesh_shape == (2, 8)   # two nodes of 8
    assert report.rows[0].efficiency == pytest.approx(1.0)
    assert all(r.feasible and r.memory_per_device <= 80e9 for r in report.rows)
    text = str(report)
    assert "samples/s" in text and "efficiency" in text and report.reason in text
    path = tmp_path / "scaling.png"
    report.plot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.stop_at = 3


def test_stop_point_moves_with_link_and_batch():
    slow = scaling(*gpt2_xl_shape(32), devices=DEVICES, hardware=one_link(50e9), devices_per_node=64)
    fast = scaling(*gpt2_xl_shape(32), devices=DEVICES, hardware=one_link(500e9), devices_per_node=64)
    big = scaling(*gpt2_xl_shape(128), devices=DEVICES, hardware=one_link(50e9), devices_per_node=64)
    print(slow, fast, big, sep="\n")
    assert slow.stop_at is not None and slow.stopped_by is not None
    assert slow.cause == "communication" and "communication" in slow.reason
    assert (fast.stop_at or 10 ** 9) > slow.stop_at
    assert (big.stop_at or 10 ** 9) > slow.stop_at


def test_memory_budget_too_small_for_one_device():
    report = scaling(*gpt2_xl_shape(8), devices=[1, 2, 4], hardware="h100", memory_budget="3GB")
    first = report.rows[0]
    assert not first.feasible and first.memory_per_device > 3e9
    assert "no plan fits" in str(report)
    assert report.rows[-1].feasible


def test_arguments():
    assert parse_devices("1-16") == [1, 2, 4, 8, 16] and parse_devices("1,3") == [1, 3]
    assert default_mesh_shape(64, H100) == (8, 8) and default_mesh_shape(4, H100) == (4,)
    with pytest.raises(InputError):
        parse_devices("many")
    with pytest.raises(InputError, match="devices"):
        scaling(torch.nn.Linear(2, 2), (torch.ones(2, 2),), devices=[0])


def _row(devices: int, throughput: float | None, efficiency: float | None):
    """A synthetic row: `throughput` None means no plan fits on that count."""
    from types import SimpleNamespace

    from autopar.planning.scaling import ScalingRow
    if throughput is None:
        return ScalingRow(devices, (devices,), None, None, 1e12, None, None)
    plan = SimpleNamespace(stages=(), predicted_compute_time=0.5, predicted_comm_time=0.5, collectives=(),
                           predicted_mfu=None)
    return ScalingRow(devices, (devices,), 8 / throughput, throughput, 1e9, efficiency, plan)


def test_a_count_where_nothing_fits_does_not_end_the_scan():
    """Issue 27's case: one count without a plan (16, once a false infeasibility on 2 x 8) in the middle
    of counts that scale at 82-98% must not make the verdict stop at 8."""
    from autopar.planning.scaling import _verdict
    rows = (_row(8, 100, 1.0), _row(16, None, None), _row(32, 380, 0.95), _row(64, 700, 0.88), _row(128, 720, 0.45))
    report = _verdict(rows, "h100", 8, 0.5)
    assert report.stop_at == 64 and report.stopped_by == 128 and "no plan fits on 16" in report.reason
    paying = [r for r in rows if r.feasible and r.efficiency >= 0.5]
    assert not [r for r in paying if r.devices > report.stop_at and r.throughput > 700]
    flat = _verdict((_row(1, 10, 1.0), _row(2, 19, 0.95), _row(4, 18, 0.9), _row(8, 30, 0.8)), "h100", 8, 0.5)
    assert flat.stop_at == 8 and flat.stopped_by is None   # 4 dips, 8 pays again: the scan goes on
    tail = _verdict((_row(1, 10, 1.0), _row(2, None, None)), "h100", 8, 0.5)
    assert tail.stop_at == 1 and tail.stopped_by == 2 and tail.cause == "memory"
