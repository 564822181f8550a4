"""A saved plan is reused without solving; a plan made for another model or mesh is refused."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar._testing.gpt import GPT, GPTConfig
from autopar.errors import PlanMismatchError


@pytest.fixture()
def world_of_one():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _gpt(n_layer=1, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=n_layer, n_head=2, n_embd=16))


def test_saved_plan_is_reused_without_solving(tmp_path, monkeypatch, world_of_one):
    model, ids = _gpt(), torch.randint(0, 32, (4, 8))
    mesh = autopar.Mesh((1,))
    autopar.plan(model, (ids, ids), mesh=mesh, baselines=False).save(tmp_path / "p.json")
    loaded = autopar.Plan.load(tmp_path / "p.json")

    def no_solving(*a, **k):
        raise AssertionError("a given plan must not be re-solved")
    monkeypatch.setattr("autopar.runtime.module.plan_captured", no_solving)
    pmodel = autopar.autoparallelize(model, (ids, ids), mesh=mesh, plan=loaded)
    assert pmodel.plan == loaded
    torch.testing.assert_close(pmodel.train_step(ids, ids), model(ids, ids).detach())


def test_plan_for_another_model_or_mesh_is_refused(tmp_path, world_of_one):
    ids = torch.randint(0, 32, (4, 8))
    plan = autopar.plan(_gpt(n_layer=1), (ids, ids), mesh=autopar.Mesh((1,)), baselines=False)
    with pytest.raises(PlanMismatchError, match="another model"):
        autopar.autoparallelize(_gpt(n_layer=2), (ids, ids), mesh=autopar.Mesh((1,)), plan=plan)
    with pytest.raises(PlanMismatchError, match="re-plan for this mesh"):
        autopar.autoparallelize(_gpt(n_layer=1), (ids, ids), mesh=autopar.Mesh((1,), hardware="a100"), plan=plan)
