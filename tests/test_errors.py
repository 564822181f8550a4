"""The error catalogue: each user mistake gets autopar's own exception, a message that says what is
wrong and what to do, and no internal traceback. (Cases tested elsewhere are listed in README's
"Guarantees".)"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import DeviceError, HardwareError, InfeasiblePlanError, InputError, NoLossError, TraceError


@pytest.fixture(scope="module")
def gpt():
    from autopar._testing.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    return model, torch.randint(0, 64, (4, 16))


MESH = autopar.Mesh((2,))


def _plan(model, inputs, **kw):
    return autopar.plan(model, inputs, mesh=kw.pop("mesh", MESH), baselines=False, **kw)


CASES = {
    "inputs not a tuple": (lambda m, ids: _plan(m, [ids, ids]), InputError, r"must be a tuple.*wrap"),
    "input of the wrong dtype": (lambda m, ids: _plan(m, (ids.float(), ids)), TraceError,
                                 r"autopar/_testing/gpt\.py:\d+.*wte\(idx\).*scalar types"),
    "input of the wrong rank": (lambda m, ids: _plan(m, (ids[0], ids[0])), TraceError,
                                r"autopar/_testing/gpt\.py:\d+: `T = idx\.shape\[1\]`"),
    "unknown axis in a strategy dict": (lambda m, ids: _plan(m, (ids, ids), strategy={"tensor": "tp"}), InputError,
                                        r"mesh axis 'tensor'.*axes are \('axis0',\)"),
    "unknown strategy": (lambda m, ids: _plan(m, (ids, ids), strategy="fsdp"), InputError,
                         r"unknown strategy 'fsdp'; choose one of auto, dp"),
    "batch not divisible by dp": (lambda m, ids: _plan(m, (ids[:3], ids[:3]), strategy="zero3"), InputError,
                                  r"batch \(3\) does not divide over the 2 data-parallel ranks.*multiple of 2"),
    "budget no plan meets": (lambda m, ids: _plan(m, (ids, ids), memory_budget="10kB"), InfeasiblePlanError,
                             r"no plan fits the memory budget .*the smallest plan needs"),
    "unknown hardware preset": (lambda m, ids: autopar.Mesh((2,), hardware="tpu9"), HardwareError,
                                r"unknown hardware 'tpu9': use a preset name \(cpu, a100, h100, h200\)"),
    "schedule without stages": (lambda m, ids: _plan(m, (ids, ids), schedule="gpipe", num_stages=None), InputError,
                                r"schedule='gpipe' applies to pipelined plans only: pass num_stages=2"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_user_mistakes_raise_autopar_errors_with_advice(case, gpt):
    fn, error, message = CASES[case]
    with pytest.raises(error, match=message) as info:
        fn(*gpt)
    assert isinstance(info.value, autopar.errors.AutoparError)
    assert info.value.__suppress_context__ or info.value.__cause__ is None or case.startswith("input")


def test_unknown_option_is_refused_by_the_signature(gpt):
    """Every option of plan() and autoparallelize() is in their signatures (autopar/api.py): a misspelt
    one fails at the call, before any work."""
    model, ids = gpt
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'pipelines'"):
        _plan(model, (ids, ids), pipelines=2)


class _NoLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)  # a (4, 4) output, not a loss


def test_model_without_loss_says_how_to_pass_one():
    with pytest.raises(NoLossError, match=r"\(4, 4\).*not a scalar floating loss.*loss_fn="):
        _plan(_NoLoss(), (torch.randn(4, 4),))
    plan = _plan(_NoLoss(), (torch.randn(4, 4),), loss_fn=lambda out, x: out.square().mean())
    assert plan.feasible


class _MutatesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2)
        return self.lin(x).sum()


def test_model_mutating_its_input_is_refused_with_the_line():
    with pytest.raises(InputError, match=r"modifies its input 'x' in place .*test_errors\.py\", line \d+.*"
                                         r"`x\.mul_\(2\)`.*work on a copy"):
        _plan(_MutatesInput(), (torch.randn(4, 4),))


class _IntParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.steps = nn.Parameter(torch.zeros((), dtype=torch.long), requires_grad=False)

    def forward(self, x):
        return self.lin(x).sum() + self.steps


def test_non_floating_parameter_is_kept_without_gradient_or_optimizer_state():
    from autopar.capture.trace import capture
    c = capture(_IntParam(), (torch.randn(4, 4),))
    assert "steps" in c.param_names and "steps" not in c.grad_param_names
    plan = _plan(_IntParam(), (torch.randn(4, 4),))
    assert plan.feasible and "steps" in plan.params


def _runtime_mistakes(rank, world):
    """Inside a job: a mesh that does not match the world, and a batch of another shape than planned."""
    from autopar._testing.gpt import GPT, GPTConfig
    from autopar.errors import MeshError
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    ids = torch.randint(0, 64, (4, 16))
    out = {}
    try:
        autopar.autoparallelize(model, (ids, ids), mesh=autopar.Mesh((2,)), baselines=False)
    except MeshError as e:
        out["mesh"] = str(e)
    pmodel = autopar.autoparallelize(model, (ids, ids), baselines=False)
    try:
        pmodel.train_step(ids[:2], ids[:2])
    except InputError as e:
        out["shape"] = str(e)
    return out


def test_runtime_mistakes_inside_a_job():
    from autopar._testing.dist_utils import run_distributed
    out = run_distributed(_runtime_mistakes, 1, timeout=300)[0]
    assert "the mesh has 2 devices" in out["mesh"] and "this job has 1 ranks" in out["mesh"]
    assert "has shape (2, 16) but the plan was made for (4, 16)" in out["shape"]
    assert "re-plan for the new shape" in out["shape"]


def test_cuda_requested_but_absent(gpt, monkeypatch):
    """Refused before any process group is made, naming the cause and the way out (CUDA hidden here so
    the test means the same on a GPU machine)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match=r"device='cuda' was requested but torch.cuda.is_available\(\) is False"
                                          r".*use device='cpu' \(gloo\)"):
        autopar.autoparallelize(*gpt[:1], (gpt[1], gpt[1]), device="cuda", baselines=False)
    with pytest.raises(InputError, match=r"device='tpu': use 'cpu' \(gloo\), 'cuda' \(NCCL\)"):
        autopar.autoparallelize(*gpt[:1], (gpt[1], gpt[1]), device="tpu", baselines=False)
    assert not torch.distributed.is_initialized()


def _planning_failures(rank, world):
    """Errors found while rank 0 plans reach every rank (before the fix, rank 1 waited forever)."""
    from autopar._testing.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    ids = torch.randint(0, 64, (3, 16))
    out = {}
    for label, kw in (("batch", dict(strategy="zero3")), ("budget", dict(memory_budget="10kB"))):
        try:
            autopar.autoparallelize(model, (ids, ids), baselines=False, **kw)
        except autopar.errors.AutoparError as e:
            out[label] = (type(e).__name__, str(e), getattr(e, "min_memory_per_device", None))
    return out


def test_a_planning_error_on_rank_0_is_raised_on_every_rank():
    from autopar._testing.dist_utils import run_distributed
    results = run_distributed(_planning_failures, 2, timeout=300)
    assert results[0] == results[1]
    assert results[1]["batch"][0] == "InputError" and "batch (3) does not divide" in results[1]["batch"][1]
    assert results[1]["budget"][0] == "InfeasiblePlanError" and results[1]["budget"][2] > 10_000
