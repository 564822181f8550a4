"""Workers for tests/test_data_parallel.py: each rank feeding its own data-parallel slice of the batch."""
from __future__ import annotations

import copy

import torch

from autopar._testing.dist_cases import train_steps


def rank_slice(pmodel, x: torch.Tensor) -> torch.Tensor:
    """This rank's data-parallel slice of a global batch, as documented in autopar/runtime/batch.py: rows
    [r*b, (r+1)*b) (r = data_parallel_rank, b = batch / data_parallel_size); under a pipeline of m
    micro-batches, its r-th part of each micro-batch, in order."""
    m = pmodel.plan.num_microbatches if pmodel.plan.stages else 1
    r, n = pmodel.data_parallel_rank, pmodel.data_parallel_size
    return torch.cat([c.chunk(n)[r] for c in x.chunk(m)])


def _example(batch) -> tuple:
    args, kwargs = batch
    return tuple(args) + ((kwargs,) if kwargs else ())


def feed_global_and_local(rank, world, model, batches, steps, kw) -> dict:
    """The same training twice from `model`: every rank passing the global batches, then every rank
    passing only its slice (ranks whose program reads no inputs pass nothing). Losses, final parameters,
    and what the module said about the split."""
    from autopar import autoparallelize
    from autopar.errors import InputError
    out = {}
    for mode in ("global", "local"):
        pmodel = autoparallelize(copy.deepcopy(model), _example(batches[0]), baselines=False, **kw)
        fed = batches
        if mode == "local":
            fed = [(tuple(rank_slice(pmodel, a) for a in args) if pmodel.needs_inputs else (), kwargs)
                   for args, kwargs in batches]
        losses, _ = train_steps(pmodel, fed, steps)
        out[mode] = {"losses": losses, "state": {k: v.clone() for k, v in pmodel.full_state_dict().items()}}
    out["split"] = (pmodel.data_parallel_rank, pmodel.data_parallel_size, pmodel.needs_inputs)
    out["sampler"] = list(pmodel.distributed_sampler(range(16), shuffle=False))
    out["rows"] = {mode: [tuple(a.shape) for a in args] for mode, (args, _) in
                   (("global", batches[0]), ("local", fed[0]))}
    errors = []
    if pmodel.needs_inputs:
        args, kwargs = batches[0]
        for bad in ([a[:3] for a in args], [args[0], rank_slice(pmodel, args[1])]):
            try:
                pmodel.train_step(*bad)
                errors.append(None)
            except InputError as e:
                errors.append(str(e))
    out["errors"] = errors
    return out


def gather_fallback(rank, world, microbatches: int) -> dict:
    """BatchLayout on a 1-D mesh of the world, inputs planned unlike the slices (x split on the batch,
    y whole, z split on dim 1): this rank's program inputs from the global batch and from the slices."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from autopar.runtime.batch import BatchLayout
    mesh = init_device_mesh("cpu", (world,))
    rows = 2 * world * microbatches
    x, y = torch.arange(rows * 3).view(rows, 3), torch.arange(rows) * 10
    z = torch.arange(rows * world).view(rows, world).float()
    layout = BatchLayout(["x", "y", "z"], [x.shape, y.shape, z.shape], [(Shard(0),), (Replicate(),), (Shard(1),)],
                         (rank,), (world,), mesh=mesh, microbatches=microbatches)
    whole = layout.local_inputs((x, y, z), "cpu")

    def part(t):
        return torch.cat([c.chunk(world)[rank] for c in t.chunk(microbatches)])

    sliced = layout.local_inputs((part(x), part(y), part(z)), "cpu")
    return {"whole": whole, "sliced": sliced, "split": (layout.rank, layout.size)}
