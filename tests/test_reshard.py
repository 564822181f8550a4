"""`ReshardCost.time` (cached per (kind, axis) link terms and per spec pair) is bit-for-bit the sum of
`step_time` over `steps()`: the planner's fast path prices exactly what the explained steps say."""
from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from autopar.costmodel.hardware import LinkSpec
from autopar.mesh import Mesh
from autopar.placement import PAVG, SS, P, R, S
from autopar.planning.reshard import ReshardCost

PLACEMENTS = [R, P, PAVG, S(0), S(1), SS(1, 3)]


@pytest.mark.parametrize("shape", [(8,), (4, 8), (2, 2, 4)])
def test_cached_time_equals_the_sum_of_its_steps(shape):
    mesh = Mesh(shape, hardware="h100", devices_per_node=8)
    rc = ReshardCost(mesh)
    specs = list(itertools.product(PLACEMENTS, repeat=len(shape)))
    pairs = random.Random(0).sample(list(itertools.product(specs, specs)), min(400, len(specs) ** 2))
    moved = 0
    for (src, dst), nbytes, bucketed in itertools.product(pairs, (1.0, 3e6, 7.7e8), (False, True)):
        want = sum(rc.step_time(st, bucketed, nbytes) for st in rc.steps(src, dst, nbytes)) or 0.0
        assert rc.time(src, dst, nbytes, bucketed) == want, (src, dst, nbytes, bucketed)
        moved += want > 0
    assert moved > len(pairs)   # most pairs move data: the comparison is not between zeros


def test_cached_time_uses_a_calibrated_collective_fit():
    mesh = Mesh((4,), hardware="h100", devices_per_node=8)
    fitted = LinkSpec(bandwidth=1e9, latency=1e-3)   # far slower than the preset's intra-node link
    hw = dataclasses.replace(mesh.hardware, collectives={"intra": {"all_gather": fitted}})
    calibrated = Mesh((4,), hardware=hw, devices_per_node=8)
    plain, fit = ReshardCost(mesh).time((S(0),), (R,), 1e6), ReshardCost(calibrated).time((S(0),), (R,), 1e6)
    assert fit == 3 / 4 * 1e6 / 1e9 + 3 * 1e-3 + 0.1 * 1e-3
    assert plain < fit
