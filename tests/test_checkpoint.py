"""Strided shards through torch.distributed.checkpoint (autopar/runtime/checkpoint.py), on 2 gloo ranks.

DCP cannot save a `_StridedShard` DTensor (rank r's [q_r; k_r; v_r] is no contiguous chunk: its save
fails with "overlapping chunks"); a parallelized module hands such parameters and their optimizer
states out as plain shards of the same global tensor and takes them back on load. The full training
path (save under one plan and world size, resume under strided tp) is tests/test_examples.py's."""
from __future__ import annotations

import torch
import torch.nn as nn

from autopar._testing.dist_utils import run_distributed


def _round_trip(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from autopar._torch_compat import strided_shard
    from autopar.placement import is_strided
    from autopar.runtime import checkpoint

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24.0).reshape(12, 2)   # [q; k; v], 4 rows each
    module = nn.Module()
    module.w = nn.Parameter(distribute_tensor(full, mesh, [strided_shard(0, 3)]))
    checkpoint.register_hooks(module)
    state = module.state_dict()
    assert state["w"].placements == (Shard(0),) and torch.equal(state["w"].full_tensor(), full)
    dcp.save(state, checkpoint_id=path)   # fails with "overlapping chunks" on the strided DTensor itself

    with torch.no_grad():
        module.w.zero_()
    target = module.state_dict()
    dcp.load(target, checkpoint_id=path)
    module.load_state_dict(target)
    assert is_strided(module.w.placements[0])
    local = full.view(3, world, 4 // world, 2)[:, rank].reshape(-1, 2)  # rank r: [q_r; k_r; v_r]
    assert torch.equal(module.w.to_local(), local)
    return True


def test_strided_parameters_survive_a_dcp_round_trip(tmp_path):
    assert run_distributed(_round_trip, 2, str(tmp_path / "ckpt")) == [True, True]
