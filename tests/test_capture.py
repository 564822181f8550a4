"""Tests of autopar.capture.trace: joint graphs of small and real-size (meta) models, their numerics
against eager autograd, their names and node meta, and the errors a user can hit."""
from __future__ import annotations

import functools
import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar._testing import models
from autopar.capture.trace import Captured, capture
from autopar.errors import InputError, NoLossError, TraceError

_MM = ("mm", "addmm", "bmm")


def _capture(case: models.Case, **kw) -> Captured:
    return capture(case.model, case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn, **kw)


def _run(c: Captured, case: models.Case) -> tuple:
    params = dict(case.model.named_parameters())
    buffers = dict(case.model.named_buffers())
    inputs = [*case.args, *(v for v in case.kwargs.values() if isinstance(v, torch.Tensor))]
    return c.gm(*(params[n].detach() for n in c.param_names), *(buffers[n] for n in c.buffer_names), *inputs)


def _check_numerics(c: Captured, case: models.Case) -> None:
    out = _run(c, case)
    case.model.zero_grad(set_to_none=True)
    loss = case.eager_loss()
    loss.backward()
    torch.testing.assert_close(out[0], loss.detach(), rtol=1e-5, atol=1e-6)
    params = dict(case.model.named_parameters())
    assert len(out) == 1 + len(c.grad_param_names)
    for name, grad in zip(c.grad_param_names, out[1:]):
        expected = params[name].grad
        expected = torch.zeros_like(grad) if expected is None else expected
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _calls(c: Captured) -> list[torch.fx.Node]:
    return [n for n in c.gm.graph.nodes if n.op == "call_function"]


@functools.lru_cache(maxsize=None)
def _captured(name: str) -> tuple[models.Case, Captured]:
    """One capture per tiny model for the whole module (captures take seconds)."""
    case = models.TINY_CASES[name]()
    return case, _capture(case)


@pytest.fixture(params=sorted(models.TINY_CASES))
def tiny(request) -> tuple[models.Case, Captured]:
    return _captured(request.param)


def test_tiny_models_match_eager(tiny):
    case, c = tiny
    _check_numerics(c, case)


def test_signature_and_meta(tiny):
    case, c = tiny
    placeholders = c.placeholders()
    roles = [n.meta["autopar_role"] for n in placeholders]
    expected = ["param"] * len(c.param_names) + ["buffer"] * len(c.buffer_names) + ["input"] * len(c.input_names)
    assert roles == expected
    assert [n.meta["autopar_name"] for n in placeholders] == c.param_names + c.buffer_names + c.input_names
    assert set(c.grad_nodes) == set(c.grad_param_names)
    assert c.loss_node.meta["val"].shape == ()
    for name, node in c.grad_nodes.items():
        assert node.meta["val"].shape == c.param_shapes[name]
    for node in c.gm.graph.nodes:
        if node.op != "output":
            assert "val" in node.meta, node.format_node()
    assert all(n.meta["phase"] in ("forward", "backward") for n in _calls(c))
    assert c.loss_node.meta["phase"] == "forward"
    summary = c.summary()
    assert summary["forward_ops"] > 0 and summary["backward_ops"] > summary["forward_ops"] / 2


def test_module_paths_on_matmuls(tiny):
    case, c = tiny
    module_names = {name for name, _ in case.model.named_modules()}
    mms = [n for n in _calls(c) if n.target.__name__.split(".")[0] in _MM]
    for phase in ("forward", "backward"):
        nodes = [n for n in mms if n.meta["phase"] == phase]
        named = [n for n in nodes if n.meta["module_path"]]
        assert nodes and len(named) / len(nodes) > 0.9, (phase, len(named), len(nodes))
        assert all(n.meta["module_path"] in module_names for n in named)


def test_gpt_module_paths_follow_nanogpt_names():
    case, c = _captured("gpt")
    paths = {(n.meta["phase"], n.meta["module_path"]) for n in _calls(c) if n.target.__name__.split(".")[0] in _MM}
    for phase in ("forward", "backward"):
        for module in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            assert (phase, f"transformer.h.0.{module}") in paths


def test_gpt2_tied_weights_one_param_summed_grad():
    case, c = _captured("gpt2")
    assert c.tied == {"transformer.wte.weight": ["lm_head.weight"]}
    assert "lm_head.weight" not in c.param_names
    assert c.param_names.count("transformer.wte.weight") == 1
    _check_numerics(c, case)  # eager's wte.grad is already the sum of both uses


def test_unused_pooler_gets_zero_grad():
    case = models.tiny_bert_encoder()
    c = _capture(case)
    assert set(c.unused_params) == {"pooler.dense.weight", "pooler.dense.bias"}
    assert "pooler.dense.weight" in c.grad_param_names
    out = dict(zip(c.grad_param_names, _run(c, case)[1:]))
    assert torch.count_nonzero(out["pooler.dense.weight"]) == 0
    _check_numerics(c, case)


def test_loss_fn_on_logits():
    case = models.tiny_gpt()
    idx, targets = case.args

    def loss_fn(logits, idx_):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    c = capture(case.model, (idx,), loss_fn=loss_fn)
    assert c.input_names == ["idx"]
    out = c.gm(*(dict(case.model.named_parameters())[n].detach() for n in c.param_names), idx)
    torch.testing.assert_close(out[0], case.model(idx, targets).detach(), rtol=1e-5, atol=1e-6)


def test_kwargs_in_trailing_dict():
    case = models.tiny_gpt2()
    c = capture(case.model, case.example_inputs)
    assert c.input_names == ["input_ids", "labels"]


def test_non_float_and_frozen_params_get_no_grad():
    case = models.tiny_gpt(n_layer=1)
    case.model.transformer.wpe.weight.requires_grad_(False)
    c = _capture(case)
    assert "transformer.wpe.weight" in c.param_names
    assert "transformer.wpe.weight" not in c.grad_param_names
    _check_numerics(c, case)


def test_meta_gpt2_124m_full_depth_allocates_nothing():
    case = models.meta_gpt2_124m(batch=2, seq=128)
    c = _capture(case)
    assert all(p.is_meta for p in case.model.parameters())
    assert c.summary()["param_numel"] == 124_439_808
    assert c.tied == {"transformer.wte.weight": ["lm_head.weight"]}
    assert sum(1 for n in _calls(c) if n.target.__name__.split(".")[0] in _MM) >= 12 * 4 * 3  # fwd + 2 bwd
    for node in _calls(c):
        assert node.kwargs.get("device") != torch.device("meta")  # graph runs on real tensors


def test_meta_llama3_8b_shape_two_layers():
    case = models.meta_llama3_8b(num_layers=2, seq=256)
    c = _capture(case)
    assert all(p.is_meta for p in case.model.parameters())
    assert c.param_shapes["model.layers.0.mlp.gate_proj.weight"] == (14336, 4096)
    assert c.param_shapes["model.layers.0.self_attn.k_proj.weight"] == (1024, 4096)
    assert c.param_shapes["model.embed_tokens.weight"] == (128256, 4096)
    mms = [n for n in _calls(c) if n.target.__name__.split(".")[0] in _MM]
    assert all(n.meta["module_path"] for n in mms)


def test_gpt_materializes_from_meta_with_tie_and_same_init():
    from autopar._testing.gpt import GPT
    config = models.tiny_gpt().model.config
    with torch.device("meta"):
        lazy = GPT(config)
    lazy.to_empty(device="cpu")
    torch.manual_seed(0)
    lazy.reset_parameters()
    eager = GPT(config)
    torch.manual_seed(0)
    eager.reset_parameters()
    assert lazy.lm_head.weight is lazy.transformer.wte.weight
    for a, b in zip(lazy.state_dict().values(), eager.state_dict().values()):
        assert torch.equal(a, b)


def test_meta_model_graph_runs_on_real_tensors():
    meta = models.tiny_gpt()
    with torch.device("meta"):
        meta_model = type(meta.model)(meta.model.config)
    c = capture(meta_model, tuple(a.to("meta") for a in meta.args))
    _check_numerics(c, meta)  # same names and shapes: run with the real tiny model's weights


class _BatchNormMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x).pow(2).mean()


def test_buffer_updates_are_kept():
    torch.manual_seed(0)
    model, x = _BatchNormMLP(), torch.randn(16, 4)
    c = capture(model, (x,))
    assert c.buffer_names == ["net.1.running_mean", "net.1.running_var", "net.1.num_batches_tracked"]
    buffers = [b.clone() for b in model.buffers()]
    params = dict(model.named_parameters())
    out = c.gm(*(params[n].detach() for n in c.param_names), *buffers, x)
    torch.testing.assert_close(out[0], model(x).detach())  # eager also updates its buffers once
    for mine, eager in zip(buffers, model.buffers()):
        torch.testing.assert_close(mine, eager)


# ---------------------------------------------------------------- user errors

def test_no_loss_error():
    case = models.tiny_gpt()
    with pytest.raises(NoLossError, match="loss_fn"):
        capture(case.model, case.args[:1])  # no targets: the model returns logits


def test_hf_model_without_labels_raises_no_loss():
    case = models.tiny_gpt2()
    with pytest.raises(NoLossError, match="loss_fn"):
        capture(case.model, case.args)


@pytest.mark.parametrize("bad", [torch.zeros(2, 8, dtype=torch.long), [torch.zeros(2, 8, dtype=torch.long)],
                                 (torch.zeros(2, 8, dtype=torch.long), "labels")])
def test_wrong_input_types(bad):
    case = models.tiny_gpt()
    with pytest.raises(InputError, match="expected|tuple"):
        capture(case.model, bad)


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:
            y = y * 2
        return y.sum()


def test_trace_error_names_user_line():
    lines, first = inspect.getsourcelines(_Branchy.forward)
    line = first + next(i for i, text in enumerate(lines) if "if y.sum()" in text)
    with pytest.raises(TraceError) as info:
        capture(_Branchy(), (torch.randn(2, 4),))
    message = str(info.value)
    assert f"test_capture.py:{line}" in message
    assert info.value.__cause__ is None and info.value.original is not None
    assert "Traceback" not in message and len(message) < 1000
