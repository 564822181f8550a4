"""The default layout search reuses work across layouts (issue 27, "Fast"): each reuse path is compared
against the full path it replaces on a small meta-device model. Planning only: one process."""
from __future__ import annotations

import numpy as np

import autopar
from autopar._testing import models
from autopar.mesh import Mesh
from autopar.pipeline.layer_profile import unit_names
from autopar.pipeline.search import Profiler
from autopar.planning.problem import ProblemBuilder


def _case():
    return models.meta_gpt(n_layer=4, n_embd=128, n_head=4, batch=8, seq=64)


def test_one_device_bound_from_node_costs_equals_a_full_build():
    """`Profiler.seconds_bound` reads node costs only (`ProblemBuilder.build_nodes`): its bounds and unit
    count are those of a full build's CostProblem (edges and the loss's all-reduce included) bit for bit."""
    case = _case()
    hw = autopar.Mesh((8,), hardware="h100").hardware
    prof = Profiler(case.model, case.example_inputs, hw, 4)
    cap, _ = prof.captured(1)
    full = ProblemBuilder(cap, Mesh((1,), ("dp",), hw, 4)).build()
    seconds = np.array([float(np.min(c + lc)) for c, lc in zip(full.compute, full.local_comm)])
    param = np.array([n.op == "placeholder" for n in full.nodes])
    launch = np.minimum(seconds, np.where(param, hw.param_step_overhead, hw.op_overhead))
    for m, k in ((1, 1), (2, 4), (8, 8)):
        per, once = np.maximum(seconds / (m * k), launch), np.maximum(seconds / k, launch)
        assert prof.seconds_bound(m, k) == (float(per[~param].sum()), float(once[param].sum()))
    assert prof.num_units() == len(set(unit_names(full)[1])) == 6   # <pre>, 4 layers, <post>
