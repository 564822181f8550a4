"""SPMD plans on other factorizations of the same N devices: the default search's last resort.

The layout search (`autopar.pipeline.auto`) prices SPMD on the caller's mesh, its 1-D flattening and
the grids whose inner axis divides a node, and pipelines (pp x dp x tp, tp inside a node, dp dividing the micro-batch). On many devices and a
small batch none of those may fit where fewer devices do: a batch of 64 on 1,024 devices leaves a
1-D SPMD plan no axis to split activations over (64 does not divide 1,024 ways), and no pipeline of
a few units splits the batch into 1,024 parts, while 64 devices fit as a pipeline. Feasibility must
not fall as devices are added, so when nothing else fits the search also plans SPMD on every 2-D
grid (N / k) x k, k > 1 dividing N: e.g. 64 x 16, whose outer axis splits the batch and whose inner
one the weights and activations (tensor parallel, or anything else the solver chooses). Every
device is used (no idle ranks) and each axis is priced with the link it really crosses
(`Mesh`: an axis whose groups span more than one node uses the inter-node link).

This adds only SPMD solves of the capture the search already holds, and only when every other
candidate failed, so the plans and plan times of everything that fits today are unchanged. The grids
are tried most promising first (an outer axis that divides the batch) up to the first that fits: the
result is a plan that fits, not proven the fastest grid.
"""
from __future__ import annotations

from autopar.errors import InfeasiblePlanError
from autopar.mesh import Mesh
from autopar.planning import spmd


def other_factorizations(mesh: Mesh, batch: int | None = None, skip=()) -> list[Mesh]:
    """The 2-D grids (N / k) x k of `mesh`'s N devices (same hardware and devices per node), k > 1 and
    N / k > 1, other than `mesh` itself and the shapes in `skip`, most promising first: those whose outer axis divides `batch`
    (it can split the batch), by smaller inner axis; then the others, inner axis nearest one node's
    size first (an inner axis inside a node is priced at the fast link)."""
    n, dpn = mesh.size, mesh.devices_per_node
    ks = [k for k in range(2, n // 2 + 1) if n % k == 0 and (n // k, k) != tuple(mesh.shape) and (n // k, k) not in skip]
    ks.sort(key=lambda k: (batch is None or batch % (n // k) != 0,
                           k if batch is not None and batch % (n // k) == 0 else abs(k - dpn) + (k > dpn) * k))
    return [Mesh((n // k, k), ("dp", "tp"), mesh.hardware, dpn) for k in ks]


def plan_regridded(captured, model, example_inputs, mesh: Mesh, batch: int | None = None, skip=(),
                   **spmd_options) -> tuple[list, list]:
    """(Plans, InfeasiblePlanErrors) of the SPMD solver (`spmd.plan_captured` with `spmd_options`) on
    `other_factorizations(mesh, batch, skip)` in that order, up to the first feasible plan: a last resort that
    finds a plan where none other fits, at the cost of one solve per grid tried, not the fastest grid."""
    plans, floors = [], []
    for grid in other_factorizations(mesh, batch, skip):
        try:
            plans.append(spmd.plan_captured(captured, model, example_inputs, mesh=grid, **spmd_options))
        except InfeasiblePlanError as e:
            floors.append(e)
            continue
        if plans[-1].feasible:
            break
    return plans, floors
