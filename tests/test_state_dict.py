"""State dicts with the unmodified model's keys (autopar/runtime/state.py) and safetensors in and out
(autopar/runtime/safetensors_io.py): the slice and writer helpers in one process, then a parallelized
GPT-2 (tied head, fused [q; k; v] split by strided shards under tp) and a pipelined GPT built on the
meta device on 2 gloo ranks. Every zoo family and strategy loads a pretrained state dict in
tests/test_zoo.py; a model larger than a rank's share, tests/test_safetensors.py."""
from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from autopar._testing import models
from autopar._testing.dist_cases import run_each, scramble, train_reference, train_steps
from autopar._testing.dist_utils import run_distributed
from autopar.errors import CheckpointError
from autopar.placement import SS, local_ranges
from autopar.runtime import safetensors_io
from autopar.runtime.state import StateEntry
from autopar.runtime.tensors import local_slice

STEPS = 3
SPECS = [((2,), (Shard(0),)), ((2,), (Shard(1),)), ((2,), (SS(0, 3),)), ((2,), (Replicate(),)),
         ((2, 2), (Shard(0), Shard(1))), ((2, 2), (Shard(1), Shard(1))), ((2, 2), (Replicate(), SS(1, 2))),
         ((2, 2), (SS(0, 3), Replicate()))]


def _blocks(x: torch.Tensor, ranges) -> torch.Tensor:
    """x indexed by per-dim ranges (the block a rank reads from a checkpoint)."""
    for d, dim_ranges in enumerate(ranges):
        x = torch.cat([x.narrow(d, a, b - a) for a, b in dim_ranges], dim=d)
    return x


@pytest.mark.parametrize("axis_sizes,spec", SPECS)
def test_local_ranges_are_the_local_slice(axis_sizes, spec):
    x = torch.arange(12 * 8).reshape(12, 8)
    for coords in [(i,) if len(axis_sizes) == 1 else (i // 2, i % 2) for i in range(len(axis_sizes) * 2)]:
        ranges = local_ranges(spec, x.shape, coords, axis_sizes)
        assert torch.equal(_blocks(x, ranges), local_slice(x, spec, coords, axis_sizes)), (spec, coords)


def _entries(tensors: dict) -> list[StateEntry]:
    return [StateEntry((k,), tuple(t.shape), t.dtype, True) for k, t in tensors.items()]


def test_streamed_writer_is_read_by_safetensors(tmp_path):
    """One process (no process group: the writer is rank 0): a file, then shards of at most 300 bytes with an
    index; safetensors reads both, and a lazy slice read by ranges is the rank's block."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    tensors = {"a.weight": torch.randn(6, 4), "b.bias": torch.randn(5, dtype=torch.bfloat16),
               "c.ids": torch.arange(7), "d.mask": torch.tensor([True, False, True]), "e.scale": torch.tensor(2.5),
               "f.big": torch.randn(30, 3, dtype=torch.float64)}
    gather = lambda entry: tensors[entry.name]  # noqa: E731
    safetensors_io.save(_entries(tensors), gather, tmp_path / "one.safetensors")
    loaded = load_file(tmp_path / "one.safetensors")
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], t) for k, t in tensors.items())

    safetensors_io.save(_entries(tensors), gather, tmp_path / "sharded", max_shard_bytes=300)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert index["weight_map"].keys() == tensors.keys()
    assert len(files) == 2 and [k for k, f in index["weight_map"].items() if f == files[1]] == ["f.big"]  # 720 B
    for file in files:
        for k, t in load_file(tmp_path / "sharded" / file).items():
            assert index["weight_map"][k] == file and torch.equal(t, tensors[k])
    with safe_open(str(tmp_path / "one.safetensors"), framework="pt") as f:
        ranges = local_ranges((SS(0, 3),), (6, 4), (1,), (2,))
        assert torch.equal(safetensors_io.read_blocks(f.get_slice("a.weight"), ranges),
                           local_slice(tensors["a.weight"], (SS(0, 3),), (1,), (2,)))
    safetensors_io.save(_entries(tensors), gather, tmp_path / "sharded")   # one file now: the shards go
    assert sorted(p.name for p in (tmp_path / "sharded").iterdir()) == ["model.safetensors"]


def _keys_in(message: str, kind: str) -> set[str]:
    found = re.search(rf"{kind} key\(s\) in state_dict: ([^\n]*?)\. ", message)
    return set(re.findall(r'"([^"]+)"', found.group(1))) if found else set()


def _load_report(load, state: dict) -> dict:
    """What `load(state, strict)` (a load_state_dict) says: strict's error keys and non-strict's lists."""
    try:
        load(state, True)
        message = ""
    except RuntimeError as e:
        message = str(e)
    loose = load(state, False)
    return {"strict": (_keys_in(message, "Missing"), _keys_in(message, "Unexpected")),
            "loose": (set(loose.missing_keys), set(loose.unexpected_keys))}


def spmd_round_trips(rank, world, model, batches, bad_state, folder):
    """GPT-2 under tp: keys, torch's key errors, plain and DCP loads, safetensors out and back in."""
    import torch.distributed.checkpoint as dcp

    from autopar import autoparallelize
    args, kwargs = batches[0]
    model = copy.deepcopy(model)
    pretrained = scramble(model)
    pmodel = autoparallelize(model, (*args, kwargs), strategy="tp", baselines=False)
    report = _load_report(lambda state, strict: pmodel.load_state_dict(state, strict=strict), bad_state)
    out = {"keys": sorted(pmodel.state_dict()), "report": report}
    pmodel.load_state_dict(pretrained)
    out["loaded"] = pmodel.full_state_dict()
    dcp.save(pmodel.state_dict(), checkpoint_id=f"{folder}/dcp")   # tied keys and strided shards: DCP-savable
    pmodel.save_safetensors(f"{folder}/model.safetensors")
    scramble(pmodel)
    state = pmodel.state_dict()
    dcp.load(state, checkpoint_id=f"{folder}/dcp")
    pmodel.load_state_dict(state)
    out["dcp"] = pmodel.full_state_dict()
    scramble(pmodel)
    pmodel.load_safetensors(f"{folder}/model.safetensors")
    out["safetensors"] = pmodel.full_state_dict()
    try:
        pmodel.load_safetensors(f"{folder}/nothing-here")
    except CheckpointError as e:
        out["no_file"] = str(e)
    return out


def pipelined_from_meta(rank, world, config, pretrained, batches, folder):
    """A meta-built GPT in 2 stages: load the full state dict (each rank its stages' part), train, save."""
    from autopar import autoparallelize
    from autopar._testing.gpt import GPT
    with torch.device("meta"):
        model = GPT(config)
    pmodel = autoparallelize(model, batches[0][0], num_stages=2, num_microbatches=2, init_fn=GPT._init_weights,
                             baselines=False)
    keys = sorted(pmodel.state_dict())
    pmodel.load_state_dict(pretrained)
    losses, _ = train_steps(pmodel, batches, STEPS)
    pmodel.save_safetensors(f"{folder}/pipelined", max_shard_bytes=40_000)
    full = pmodel.full_state_dict()
    pmodel.load_safetensors(f"{folder}/pipelined")   # what it wrote, read back by slices
    return {"keys": keys, "losses": losses, "state": full, "reloaded": pmodel.full_state_dict()}


def test_state_dicts_round_trip_with_the_unmodified_model(tmp_path):
    gpt2 = models.tiny_gpt2(batch=4, seq=16)
    gpt2_batches = [((ids,), {"labels": ids}) for ids in torch.randint(0, 128, (STEPS, 4, 16))]
    bad = dict(gpt2.model.state_dict())
    del bad["lm_head.weight"], bad["transformer.h.0.attn.c_attn.weight"]   # a tied alias, a strided parameter
    bad["transformer.h.9.mlp.c_fc.weight"] = torch.zeros(1)
    gpt = models.tiny_gpt(batch=4, seq=16)
    gpt_batches = [((ids, ids.roll(1, 1)), {}) for ids in torch.randint(0, 64, (STEPS, 4, 16))]
    ref_losses, ref_state = train_reference(gpt.model, gpt_batches, STEPS)
    jobs = [(spmd_round_trips, gpt2.model, gpt2_batches, bad, str(tmp_path)),
            (pipelined_from_meta, gpt.model.config, gpt.model.state_dict(), gpt_batches, str(tmp_path))]
    results = run_distributed(run_each, 2, jobs, timeout=600)
    for rank, result in enumerate(results):
        assert not any(isinstance(r, str) for r in result), f"rank {rank}:\n" + "\n".join(
            r for r in result if isinstance(r, str))

    spmd = [r[0] for r in results]
    want = gpt2.model.state_dict()
    assert all(r["keys"] == sorted(want) for r in spmd)
    report = _load_report(lambda state, strict: copy.deepcopy(gpt2.model).load_state_dict(state, strict=strict), bad)
    assert report["strict"][0] == {"lm_head.weight", "transformer.h.0.attn.c_attn.weight"}
    assert all(r["report"] == report for r in spmd), (spmd[0]["report"], report)
    for what in ("loaded", "dcp", "safetensors"):
        assert spmd[0][what].keys() == want.keys()
        for key, value in want.items():
            torch.testing.assert_close(spmd[0][what][key], value, rtol=0, atol=0, msg=lambda m: f"{what} {key}: {m}")
    fresh = copy.deepcopy(gpt2.model)
    fresh.load_state_dict(spmd[0]["safetensors"], strict=True)
    from safetensors.torch import load_file, load_model
    assert load_file(tmp_path / "model.safetensors").keys() == want.keys() - {"lm_head.weight"}   # tied: once
    load_model(fresh, tmp_path / "model.safetensors", strict=True)
    assert "no safetensors checkpoint" in spmd[0]["no_file"]

    pipelined = [r[1] for r in results]
    assert set(pipelined[0]["keys"]) | set(pipelined[1]["keys"]) == set(ref_state)
    assert set(pipelined[0]["keys"]) != set(pipelined[1]["keys"])   # each rank: its stage's tensors
    for result in pipelined:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    copy.deepcopy(gpt.model).load_state_dict(pipelined[0]["state"], strict=True)
    for key, value in ref_state.items():
        torch.testing.assert_close(pipelined[0]["state"][key], value, rtol=1e-4, atol=1e-5, msg=key)
        assert torch.equal(pipelined[0]["reloaded"][key], pipelined[0]["state"][key]), key
    index = json.loads((tmp_path / "pipelined" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
