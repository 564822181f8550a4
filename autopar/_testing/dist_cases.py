"""Workers for the multi-process tests (importable by spawned processes)."""
from __future__ import annotations

import contextlib
import copy
import itertools
import weakref
from collections import Counter

import torch

# Adam turns a tiny gradient into a step of about ±lr, so float-rounding differences between a sharded
# and an unsharded run show up in parameters in proportion to lr: lr 1e-3 keeps them under 1e-5. eps sits
# well above fp noise: a mathematically zero gradient (e.g. a key bias under softmax shift invariance)
# computes as ~1e-9 noise that Adam with eps 1e-8 would blow up to a full ±lr step.
LR, EPS = 1e-3, 1e-6


def _loss(out):
    """The loss in a model's output, by the conventions capture reads (a tensor, .loss, (logits, loss), ...)."""
    from autopar.capture.loss import extract_loss
    return extract_loss(out)


def train_reference(model, batches, steps: int, lr: float = LR, autocast: bool = False):
    """Single-process run of the unmodified model (optionally under torch.autocast("cpu", torch.bfloat16)):
    losses per step and final parameters."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=EPS)
    losses = []
    for step in range(steps):
        args, kwargs = batches[step % len(batches)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = _loss(model(*args, **kwargs))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def train_steps(pmodel, batches, steps: int, lr: float = LR) -> tuple[list[float], torch.optim.Optimizer]:
    """`steps` AdamW steps of a parallelized module on `batches` (cycled): its losses and optimizer."""
    opt = torch.optim.AdamW(pmodel.parameters(), lr=lr, eps=EPS)
    losses = []
    for step in range(steps):
        args, kwargs = batches[step % len(batches)]
        opt.zero_grad()
        losses.append(pmodel.train_step(*args, **kwargs).item())
        opt.step()
    return losses, opt


_private: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def private_copy(model):
    """This process's own copy of `model`, one per model object (jobs that share a model share its copy).
    A model handed to a spawn arrives in shared memory (torch.multiprocessing), one storage for all ranks:
    a rank must not parallelize it directly, since replicated parameters keep the model's storage."""
    if model not in _private:
        _private[model] = copy.deepcopy(model)
    return _private[model]


@contextlib.contextmanager
def weights_restored(model):
    """Puts `model`'s parameters and buffers back as they were on exit: replicated parameters of a
    parallelized module share storage with the model, so its training moves them."""
    saved = [(t, t.detach().clone()) for t in itertools.chain(model.parameters(), model.buffers())]
    try:
        yield model
    finally:
        with torch.no_grad():
            for t, value in saved:
                t.copy_(value)


def scramble(model) -> dict:
    """Move `model`'s parameters away from their values (the same way on every rank); returns its state
    dict before, as plain tensors: the "pretrained" weights a parallelized module then loads."""
    pretrained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5).add_(0.01)
    return pretrained


def train_parallel(rank, world, model, batches, steps, kw, *, copy_model: bool = True, pretrained: bool = False):
    """autoparallelize + AdamW for `steps` steps; returns what the tests compare. `copy_model=False`
    parallelizes `model` itself (its weights may move: see `weights_restored`). `pretrained`: parallelize
    it with other weights, then load its own with `load_state_dict` (the unmodified model's plain tensors)."""
    from autopar import autoparallelize
    args, kwargs = batches[0]
    example = tuple(args) + ((kwargs,) if kwargs else ())
    model = copy.deepcopy(model) if copy_model else model
    weights = scramble(model) if pretrained else None
    # the IR checks run no collective and every rank's local shapes are the same: rank 0 checks for all
    pmodel = autoparallelize(model, example, verify=rank == 0, baselines=False, **kw)
    state_keys = sorted(pmodel.state_dict())
    if pretrained:
        pmodel.load_state_dict(weights)   # strict, as torch's
    losses, opt = train_steps(pmodel, batches, steps)
    memory = {"params": sum(_local_bytes(p) for p in pmodel.parameters()),   # sizes are fixed after step 0
              "buffers": sum(_local_bytes(b) for b in pmodel.buffers()),
              "optimizer": sum(_local_bytes(v) for s in opt.state.values() for k, v in s.items() if k != "step")}
    from autopar.passes import emitted_collectives
    emitted = Counter((c["kind"], c["phase"]) for c in emitted_collectives(pmodel.gm))
    state = {k: v.clone() for k, v in pmodel.full_state_dict().items()}  # replicated ones are the model's tensors
    return {"losses": losses, "state": state, "plan": pmodel.plan.to_json(),
            "emitted": dict(emitted), "memory": memory, "state_keys": state_keys}


def train_many(rank, world, model, batches, steps, kws, pretrained: bool = False):
    """train_parallel under each of `kws`, all on one private copy of `model` (its weights restored after
    each run): autopar's capture cache then traces it once per rank, not once per run."""
    model, out = private_copy(model), []
    for kw in kws:
        with weights_restored(model):
            out.append(train_parallel(rank, world, model, batches, steps, kw, copy_model=False,
                                      pretrained=pretrained))
    return out


def assert_state_dicts(results, model, labels) -> None:
    """Each run's `pmodel.state_dict()` had exactly `model.state_dict()`'s keys on every rank, and its full
    state dict loads into a fresh copy of the unmodified model with strict=True."""
    want = sorted(model.state_dict())
    for i, label in enumerate(labels):
        for rank, result in enumerate(results):
            assert result[i]["state_keys"] == want, (label, rank, set(result[i]["state_keys"]) ^ set(want))
        try:
            copy.deepcopy(model).load_state_dict(results[0][i]["state"], strict=True)
        except RuntimeError as e:   # torch's key and size errors: a failed check, reported with the others
            raise AssertionError(f"{label}: {e}") from None


def run_each(rank, world, jobs):
    """Worker running several jobs `(fn, *args)` in one spawn (a spawn of 4 ranks costs seconds of imports):
    each job's `fn(rank, world, *args)`, or its traceback, so one failing job does not hide the others."""
    import traceback
    out = []
    for fn, *args in jobs:
        try:
            out.append(fn(rank, world, *args))
        except Exception:  # the caller fails the test with it
            out.append(traceback.format_exc())
    return out


def assert_each(results, checks) -> None:
    """Check `run_each`'s results: each `(job index, label, check, *args)` runs `check(that job's result on
    every rank, *args)`; a job that raised on a rank fails its check; every failure is reported together,
    each under its label, so one failing model does not hide the others."""
    failures = []
    for j, label, check, *args in checks:
        per_rank = [r[j] for r in results]
        errors = [f"rank {rank}: {e}" for rank, e in enumerate(per_rank) if isinstance(e, str)]
        try:
            assert not errors, "\n".join(errors)
            check(per_rank, *args)
        except AssertionError as e:
            failures.append(f"{label}: {e}")
    assert not failures, "\n\n".join(failures)


def assert_matches(results, ref_losses, ref_state, labels, *, rtol=1e-4, atol=1e-5, check_plan=True) -> None:
    """`results[rank][i]` (train_parallel's dicts, case `labels[i]`) equal one process: losses on every rank,
    full parameters on rank 0 (rtol 1e-4 / atol 1e-5); with `check_plan`, the plan is feasible and the graph
    emitted exactly the collectives the plan priced, per kind and phase."""
    from autopar.plan import Plan
    for i, label in enumerate(labels):
        for rank, result in enumerate(results):
            torch.testing.assert_close(torch.tensor(result[i]["losses"]), torch.tensor(ref_losses), rtol=rtol,
                                       atol=atol, msg=lambda m: f"{label} rank {rank} losses: {m}")
        for key, want in ref_state.items():
            torch.testing.assert_close(results[0][i]["state"][key], want, rtol=rtol, atol=atol,
                                       msg=lambda m: f"{label} {key}: {m}")
        if check_plan:
            plan = Plan.from_json(results[0][i]["plan"])
            assert plan.feasible, label
            assert Counter(results[0][i]["emitted"]) == Counter((c.kind, c.phase) for c in plan.collectives), label


def build_from_meta(rank, world, config, strategy, seed):
    """A meta-device GPT materialised by autoparallelize: each rank keeps only its shards."""
    from autopar import autoparallelize
    from autopar._testing.gpt import GPT
    with torch.device("meta"):
        model = GPT(config)
    ids = torch.zeros(4, config.block_size, dtype=torch.long)
    torch.manual_seed(seed)
    pmodel = autoparallelize(model, (ids, ids), strategy=strategy, init_fn=GPT._init_weights, baselines=False)
    local = {n: tuple(p.to_local().shape) for n, p in pmodel.named_parameters()}
    assert all(p.is_meta for p in model.parameters()), "the user's model must stay on meta"
    return {"state": pmodel.full_state_dict(), "local": local,
            "params": {n: (p.shape, p.master) for n, p in pmodel.plan.params.items()}}


def lowered_for_rank0_of_2(case, strategy, disabled=frozenset()):
    """(plan, PassContext, program) of `case` = (model, inputs) planned for 2 ranks and rewritten by
    the pass pipeline for rank 0, IR verified between passes; `disabled` switches passes off."""
    import autopar
    from autopar.capture.canonicalize import canonicalize
    from autopar.capture.trace import capture
    from autopar.passes import PassContext, run_passes
    model, inputs = case
    plan = autopar.plan(model, inputs, mesh=autopar.Mesh((2,)), strategy=strategy, baselines=False)
    captured = capture(model, inputs)
    canonicalize(captured.gm)
    ctx = PassContext(plan, (2,), coords=(0,), group_names=("axis0",), grad_names=tuple(captured.grad_param_names),
                      disabled=frozenset(disabled))
    return plan, ctx, run_passes(captured.gm, ctx, verify=True)
