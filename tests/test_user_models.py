"""Models as users hold and write them: transformers models inside the user's own wrapper, built on the
meta device or with real weights (no KV cache at any depth during capture, configs restored after), the
loss conventions their forwards already follow (`(logits, loss)`, dict "loss", `ModelOutput`), and the
errors when a model keeps mutable state or its output names no single loss.

At world 2 (`test_wrapped_zoo_from_meta_trains_like_one_process`, `test_nanogpt_style_trains_without_loss_fn`):
every zoo family in its wrapper, built on meta and materialised with the real model's values by
autoparallelize, and a nanoGPT-style single-file GPT, train under auto, zero3 and tp like one process.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar._testing import models, nanogpt, wrapped
from autopar._testing.dist_cases import assert_each, assert_matches, run_each, train_many, train_reference
from autopar._testing.dist_utils import run_distributed
from autopar.capture.no_cache import configs_of
from autopar.capture.trace import capture
from autopar.errors import NoLossError, TraceError

STEPS = 3
STRATEGIES = ("auto", "zero3", "tp")


def _graph_loss_and_grads(model: nn.Module, args: tuple, real: nn.Module | None = None, **kw) -> tuple:
    """The captured step run on the real tensors (of `real`, when `model` is on meta): (loss, {param: grad})."""
    c = capture(model, args, **kw)
    real = model if real is None else real
    params, buffers = dict(real.named_parameters()), dict(real.named_buffers())
    inputs = [*args, *(v for v in kw.get("example_kwargs", {}).values() if isinstance(v, torch.Tensor))]
    out = c.gm(*(params[n].detach() for n in c.param_names), *(buffers[n] for n in c.buffer_names), *inputs)
    return out[0], dict(zip(c.grad_param_names, out[1:]))


def _eager_loss_and_grads(model: nn.Module, args: tuple, loss_of) -> tuple:
    model.zero_grad(set_to_none=True)
    loss = loss_of(model(*args))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_step(model: nn.Module, args: tuple, loss_of, **kw) -> None:
    loss, grads = _graph_loss_and_grads(model, args, **kw)
    want_loss, want_grads = _eager_loss_and_grads(model, args, loss_of)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert set(want_grads) <= set(grads)
    for name, want in want_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------- wrapped transformers models

@pytest.mark.parametrize("name", ["llama", "gpt_neox"])
def test_wrapped_meta_model_captures_and_configs_are_restored(name):
    """The issue's case: a causal LM inside `forward(ids) -> m(input_ids=ids, labels=ids).loss`, built on
    meta, used to fail on the KV cache (use_cache was passed only to a top-level forward that takes it)."""
    inner = models.tiny_llama().model if name == "llama" else models.ZOO_CASES["gpt_neox"]().model
    with torch.device("meta"):
        meta = wrapped.WrapCausalLM(type(inner)(inner.config))
    ids = torch.zeros(2, 16, dtype=torch.long)
    captured = capture(meta, (ids,), cache=False)
    assert captured.input_names == ["ids"] and captured.grad_param_names
    assert configs_of(meta) and all(c.use_cache for c in configs_of(meta)), "the user's configs are left as they were"


def test_wrapped_real_model_captures_like_eager():
    case = wrapped.wrapped_case("gpt_neox")
    _assert_same_step(case.model, case.args, lambda loss: loss, cache=False)
    assert all(c.use_cache for c in configs_of(case.model))


def test_meta_capture_keeps_constants_made_from_python_data():
    """Falcon indexes its fused qkv with Python lists (`x[..., [-2]]`): exported on meta, those index
    tensors had no values (NaN losses); the export now runs on fake CPU tensors and leaves the model on meta."""
    case = models.ZOO_CASES["falcon"]()
    with torch.device("meta"):
        meta = type(case.model)(case.model.config)
    loss, grads = _graph_loss_and_grads(meta, case.args, example_kwargs=case.kwargs, cache=False,
                                        real=case.model)
    torch.testing.assert_close(loss, case.eager_loss().detach(), rtol=1e-5, atol=1e-6)
    assert all(t.is_meta for t in [*meta.parameters(), *meta.buffers()])
    assert meta.lm_head.weight is meta.transformer.word_embeddings.weight, "still tied"


class _Cache(nn.Module):
    """Keeps a running cache in a plain tensor attribute, updated in place when `use_kv_cache` is on."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.use_kv_cache = True
        self.kv = torch.zeros(2, 4)

    def forward(self, x):
        y = self.proj(x)
        if self.use_kv_cache:
            self.kv.add_(y.detach())
        return y


class _HoldsCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Cache()

    def forward(self, x):
        return self.block(x).square().mean()


def test_mutated_state_error_names_the_module_and_the_setting():
    with pytest.raises(TraceError) as info:
        capture(_HoldsCache(), (torch.randn(2, 4),), cache=False)
    message = str(info.value)
    assert "in module `block` (_Cache)" in message, message
    assert "set `model.block.use_kv_cache = False`" in message, message
    model = _HoldsCache()
    model.block.use_kv_cache = False   # what the message says to do
    capture(model, (torch.randn(2, 4),), cache=False)


class _FailsInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.m = models.tiny_llama().model

    def forward(self, ids):
        assert all(not c.use_cache for c in configs_of(self)), "use_cache is off during the trace"
        raise RuntimeError("boom")


def test_configs_are_restored_after_a_failed_capture():
    model = _FailsInside()
    with pytest.raises(TraceError, match="boom"):
        capture(model, (torch.zeros(2, 8, dtype=torch.long),), cache=False)
    assert configs_of(model) and all(c.use_cache for c in configs_of(model))


# ---------------------------------------------------------------- loss conventions

class _Returns(nn.Module):
    """A tiny classifier whose forward returns its loss in the convention `style`."""

    def __init__(self, style: str):
        super().__init__()
        self.lin, self.style = nn.Linear(4, 3), style

    def forward(self, x, y):
        logits = self.lin(x)
        loss = F.cross_entropy(logits, y)
        aux = logits.square().mean()
        return {"logits_loss": (logits, loss), "loss_logits": (loss, logits), "dict": {"logits": logits, "loss": loss},
                "list": [logits, loss, y], "two_scalars": (loss, aux), "no_scalar": (logits, logits)}[self.style]


def _batch():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(6, 4, generator=gen), torch.randint(0, 3, (6,), generator=gen)


@pytest.mark.parametrize("style,pick", [("logits_loss", 1), ("loss_logits", 0), ("dict", "loss"), ("list", 1)])
def test_loss_conventions_without_loss_fn(style, pick):
    torch.manual_seed(0)
    _assert_same_step(_Returns(style), _batch(), lambda out: out[pick], cache=False)


class _ReturnsModelOutput(nn.Module):
    """A user model returning a transformers ModelOutput it built itself."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, y):
        from transformers.modeling_outputs import SequenceClassifierOutput
        logits = self.lin(x)
        return SequenceClassifierOutput(loss=F.cross_entropy(logits, y), logits=logits)


def test_hf_model_output_without_loss_fn():
    torch.manual_seed(0)
    _assert_same_step(_ReturnsModelOutput(), _batch(), lambda out: out.loss, cache=False)


def test_ambiguous_output_shows_the_loss_fn_to_pass():
    with pytest.raises(NoLossError) as info:
        capture(_Returns("two_scalars"), _batch(), cache=False)
    message = str(info.value)
    assert "2 scalar floating tensors" in message and "cannot tell which is the loss" in message, message
    assert "loss_fn=lambda output, *inputs: output[0]" in message and "output[1]" in message, message
    _assert_same_step(_Returns("two_scalars"), _batch(), lambda out: out[1], loss_fn=lambda out, *inputs: out[1],
                      cache=False)
    with pytest.raises(NoLossError, match=r"no scalar floating tensor.*loss_fn="):
        capture(_Returns("no_scalar"), _batch(), cache=False)


def _ids(batch: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (batch, 16), generator=torch.Generator().manual_seed(seed))


def test_nanogpt_style_model_captures_like_eager():
    torch.manual_seed(0)
    model = nanogpt.GPT(nanogpt.Config(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    ids = _ids(2, seed=0)
    _assert_same_step(model, (ids, ids), lambda out: out[1], cache=False)


# ---------------------------------------------------------------- world 2: train like one process

def _nanogpt_case() -> models.Case:
    torch.manual_seed(0)
    model = nanogpt.GPT(nanogpt.Config(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    return models.Case(model, (_ids(4, seed=0), _ids(4, seed=1)))


# the families in two spawns of about equal cost; t5 is compared on its first step (tests/test_zoo.py says why)
GROUPS = {"decoders": ["mistral", "qwen2", "gemma", "gemma2", "phi", "gpt_neox", "opt", "opt_postnorm"],
          "rest": ["bloom", "falcon", "bart", "vit", "mixtral", "qwen2_moe", "olmoe", "t5", "nanogpt"]}


def _jobs(names: list[str]) -> tuple[list, list]:
    """(jobs for dist_cases.run_each, checks (label, check, *args) of each job's per-rank results)."""
    jobs, checks = [], []
    for name in names:
        if name == "nanogpt":   # forward returns (logits, loss); no loss_fn
            case = _nanogpt_case()
            batches = models.zoo_batches(case, STEPS)
            jobs.append((train_many, case.model, batches, STEPS, [dict(strategy=s) for s in STRATEGIES]))
            checks.append(("nanogpt", assert_matches, *train_reference(case.model, batches, STEPS),
                           [f"nanogpt {s}" for s in STRATEGIES]))
            continue
        case = wrapped.wrapped_case(name)
        batches = wrapped.wrapped_batches(name, case, STEPS)
        if name == "t5":
            for s in STRATEGIES:
                jobs.append((wrapped.first_step_from_meta, name, batches[0], s))
                checks.append((f"t5 {s}", _check_first_step, case.model, batches[0]))
            continue
        jobs.append((wrapped.train_wrapped_from_meta, name, batches, STEPS, STRATEGIES))
        checks.append((name, assert_matches, *train_reference(case.model, batches, STEPS),
                       [f"wrapped meta {name} {s}" for s in STRATEGIES]))
    return jobs, checks


def _check_first_step(per_rank, model, batch) -> None:
    """The first step's loss and gradients equal one process (T5: see tests/test_zoo.py::_check_first_step)."""
    args, _ = batch
    model.zero_grad()
    want = model(*args)
    want.backward()
    for loss, grads in per_rank:
        torch.testing.assert_close(torch.tensor(loss), want.detach(), rtol=1e-5, atol=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("group", list(GROUPS))
def test_wrapped_zoo_from_meta_trains_like_one_process(group):
    """World 2, auto / zero3 / tp: every zoo family inside a user wrapper, built on meta (planned there) and
    materialised by autoparallelize with the real model's values, trains like one process of the real
    wrapped model; so does the nanoGPT-style GPT, whose forward returns (logits, loss), without loss_fn."""
    jobs, checks = _jobs(GROUPS[group])
    results = run_distributed(run_each, 2, jobs, timeout=1800)
    assert_each(results, [(j, *check) for j, check in enumerate(checks)])   # checks follow the jobs' order


def test_every_zoo_family_is_in_a_group():
    assert sorted(n for g in GROUPS.values() for n in g if n != "nanogpt") == sorted(
        n for n in models.ZOO_CASES if not n.startswith("mixtral_"))
