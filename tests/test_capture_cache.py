"""The capture cache (autopar/capture/cache.py): the same model, inputs and options are traced once;
any change to what the trace depends on traces again; callers get copies they may rewrite; results
are the same with and without the cache."""
from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import autopar
from autopar.capture import trace as capture_module
from autopar.capture.cache import clear_capture_cache
from autopar.capture.canonicalize import canonicalize
from autopar.capture.trace import capture


class MLP(nn.Module):
    def __init__(self, width: int = 8, hidden: int = 8):
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        x = x.to(self.up.weight.dtype)   # any input dtype: a changed one changes only the graph
        return self.down(self.drop(torch.relu(self.up(x)))).square().mean()


@pytest.fixture()
def traces(monkeypatch):
    """Counts real traces (calls of capture's tracing step), on an empty cache."""
    clear_capture_cache()
    count = {"n": 0}
    real = capture_module._capture

    def counting(*args, **kwargs):
        count["n"] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(capture_module, "_capture", counting)
    monkeypatch.delenv("AUTOPAR_CAPTURE_CACHE", raising=False)
    yield count
    clear_capture_cache()


def _mlp_case():
    torch.manual_seed(0)
    return MLP(), (torch.randn(4, 8),)


def test_same_model_and_inputs_are_traced_once(traces):
    model, inputs = _mlp_case()
    first = capture(model, inputs)
    second = capture(model, inputs)
    assert traces["n"] == 1
    assert first.gm is not second.gm and first.gm.code == second.gm.code
    assert first.param_names == second.param_names and first.param_names is not second.param_names


def _grow_hidden(model, inputs):
    model.up, model.down = nn.Linear(8, 16), nn.Linear(16, 8)
    return inputs


def _replace_forward(model, inputs):
    model.forward = lambda x: model.down(torch.relu(model.up(x))).abs().mean()
    return inputs


def _hook(model, inputs):
    model.up.register_forward_hook(lambda mod, args, out: out * 2)
    return inputs


def _freeze(model, inputs):
    model.up.weight.requires_grad_(False)
    return inputs


def _tie(model, inputs):
    model.down.weight = model.up.weight    # same names, shapes and dtypes: only the tie is new
    return inputs


CHANGES = {
    "input shape": lambda model, inputs: (torch.randn(2, 8),),
    "input dtype": lambda model, inputs: (inputs[0].double(),),
    "training flag": lambda model, inputs: (model.eval(), inputs)[1],
    "submodule training flag": lambda model, inputs: (model.drop.eval(), inputs)[1],
    "dropout p": lambda model, inputs: (setattr(model.drop, "p", 0.5), inputs)[1],
    "parameter shape": _grow_hidden,
    "parameter dtype": lambda model, inputs: (model.double(), inputs)[1],
    "requires_grad": _freeze,
    "tied weights": _tie,
    "forward replaced": _replace_forward,
    "forward hook": _hook,
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_change_traces_again(traces, change):
    model, inputs = _mlp_case()
    before = capture(model, inputs)
    inputs = CHANGES[change](model, inputs)
    after = capture(model, inputs)
    assert traces["n"] == 2, change
    assert before.gm is not after.gm
    torch.testing.assert_close(_run(after, model, inputs), _run(capture(model, inputs, cache=False), model, inputs))


def test_options_are_part_of_the_key(traces):
    model, inputs = _mlp_case()
    loss_a = lambda out, x: out  # noqa: E731
    capture(model, inputs)
    capture(model, inputs, loss_fn=loss_a)
    capture(model, inputs, loss_fn=loss_a)
    capture(model, inputs, loss_fn=lambda out, x: out * 2)
    capture(model, inputs, stamp_layers=False)
    capture(model, inputs, mixed_precision=autopar.MixedPrecision())
    assert traces["n"] == 5


def test_callers_get_copies_the_cache_never_sees_rewritten(traces):
    model, inputs = _mlp_case()
    first = capture(model, inputs)
    code = first.gm.code
    canonicalize(first.gm)                     # rewrites in place (addmm -> mm + add)
    first.param_names.append("junk")
    assert first.gm.code != code
    again = capture(model, inputs)
    assert traces["n"] == 1 and again.gm.code == code and "junk" not in again.param_names


def test_opt_out_and_clear(traces, monkeypatch):
    model, inputs = _mlp_case()
    capture(model, inputs)
    capture(model, inputs, cache=False)
    monkeypatch.setenv("AUTOPAR_CAPTURE_CACHE", "0")
    capture(model, inputs)
    monkeypatch.delenv("AUTOPAR_CAPTURE_CACHE")
    capture(model, inputs)                     # the first capture is still cached
    clear_capture_cache()
    capture(model, inputs)
    assert traces["n"] == 4


def test_the_cache_does_not_keep_models_alive(traces):
    model, inputs = _mlp_case()
    capture(model, inputs)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def _run(c, model, inputs):
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    torch.manual_seed(1)
    return c.gm(*(params[n].detach() for n in c.param_names), *(buffers[n] for n in c.buffer_names), *inputs)


def _without_timings(plan) -> dict:
    """The plan as data, less the wall-clock figures (planning phases, solver seconds)."""
    data = json.loads(plan.to_json())
    del data["timings"], data["solver"]["seconds"]
    return data


def test_plan_and_numerics_are_the_same_with_and_without_the_cache(traces, monkeypatch, gpt_case):
    model, (ids, targets) = gpt_case
    mesh = autopar.Mesh((2,))
    monkeypatch.setenv("AUTOPAR_CAPTURE_CACHE", "0")
    plans = [autopar.plan(model, (ids, targets), mesh=mesh, strategy="tp", baselines=False)]
    monkeypatch.delenv("AUTOPAR_CAPTURE_CACHE")
    plans += [autopar.plan(model, (ids, targets), mesh=mesh, strategy="tp", baselines=False) for _ in range(2)]
    assert traces["n"] == 2    # uncached, then traced once for both cached plans
    assert _without_timings(plans[2]) == _without_timings(plans[1]) == _without_timings(plans[0])
    try:   # a world of one: the rewritten program runs; loss and gradients equal the uncached program's
        pmodels = [autopar.autoparallelize(model, (ids, targets), mesh=autopar.Mesh((1,)), baselines=False)]
        assert traces["n"] == 2    # plan's graph (the mesh is not in the key)
        monkeypatch.setenv("AUTOPAR_CAPTURE_CACHE", "0")
        pmodels.append(autopar.autoparallelize(model, (ids, targets), mesh=autopar.Mesh((1,)), baselines=False))
        assert traces["n"] == 3
        losses = [(torch.manual_seed(0), p.train_step(ids, targets))[1] for p in pmodels]
        grads = [[q.grad.full_tensor() for q in p.parameters()] for p in pmodels]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert torch.equal(losses[0], losses[1])
    assert len(grads[0]) == len(grads[1]) and all(torch.equal(a, b) for a, b in zip(*grads))
