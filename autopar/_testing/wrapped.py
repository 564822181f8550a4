"""Zoo models held the way users hold them: inside their own wrapper module, built on the meta device.

`wrapped_case(name)` puts the zoo family `name` (autopar/_testing/models.py) inside a user module whose
forward returns `.loss` of a call that passes no `use_cache` (the wrapper's forward has no such
parameter): `WrapCausalLM.forward(ids) -> m(input_ids=ids, labels=ids).loss` for causal LMs,
`WrapWithLabels.forward(x, labels) -> m(x, labels=labels).loss` for the others. `meta_twin(model)`
builds the same structure on the meta device, and `copy_init(meta, real)` is an `init_fn` that
materialises it module by module with the real model's values (buffers such as rotary tables included),
so a run from meta can be compared with one process of the real model.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from autopar._testing import models
from autopar._testing.dist_cases import train_parallel

SEQ2SEQ_OR_LABELLED = ("t5", "bart", "vit")   # labels differ from the inputs


class WrapCausalLM(nn.Module):
    """The issue's wrapper: a causal LM trained on its own inputs, the loss read off its output."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=ids, labels=ids).loss


class WrapWithLabels(nn.Module):
    """A wrapper passing the inputs positionally and the labels by keyword."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(x, labels=labels).loss


def wrapped_case(name: str) -> models.Case:
    """Zoo family `name` (real weights, fixed seed) inside its user wrapper, with the zoo's inputs."""
    case = models.ZOO_CASES[name]()
    if name in SEQ2SEQ_OR_LABELLED:
        return models.Case(WrapWithLabels(case.model), (case.args[0], case.kwargs["labels"]))
    return models.Case(WrapCausalLM(case.model), (case.args[0],))


def wrapped_batches(name: str, case: models.Case, steps: int) -> list:
    """`steps` (args, kwargs) batches of `case`'s shapes, drawn as models.zoo_batches draws them."""
    inner = models.ZOO_CASES[name]()
    out = []
    for args, kwargs in models.zoo_batches(inner, steps):
        out.append(((args[0], kwargs["labels"]) if name in SEQ2SEQ_OR_LABELLED else (args[0],), {}))
    return out


def meta_twin(model: nn.Module) -> nn.Module:
    """`model`'s wrapper around the same transformers class and config, built on the meta device."""
    inner = model.m
    with torch.device("meta"):
        return type(model)(type(inner)(copy.deepcopy(inner.config)))


def copy_init(meta: nn.Module, real: nn.Module):
    """An `init_fn` for autoparallelize: each module of `meta` gets the values of the same module of
    `real` (its own parameters and buffers, not its children's)."""
    twins = {id(m): dict(real.named_modules())[name] for name, m in meta.named_modules()}

    def init(module: nn.Module) -> None:
        source = twins[id(module)]
        for table, theirs in ((module._parameters, source._parameters), (module._buffers, source._buffers)):
            for name, t in table.items():
                if t is not None:
                    t.copy_(theirs[name])

    return init


def train_wrapped_from_meta(rank, world, name: str, batches, steps: int, strategies) -> list:
    """Family `name` in its wrapper, built on meta and materialised with the real model's values by
    autoparallelize, trained under each strategy (dist_cases.train_parallel's results); the meta model
    must stay on meta."""
    real = wrapped_case(name).model
    meta = meta_twin(real)
    init = copy_init(meta, real)
    out = [train_parallel(rank, world, meta, batches, steps, dict(strategy=s, init_fn=init), copy_model=False)
           for s in strategies]
    assert all(t.is_meta for t in [*meta.parameters(), *meta.buffers()]), "the user's model must stay on meta"
    return out


def first_step_from_meta(rank, world, name: str, batch, strategy: str) -> tuple:
    """One autoparallelized step of the wrapped family built on meta: the loss and every full gradient."""
    from autopar import autoparallelize
    real = wrapped_case(name).model
    meta = meta_twin(real)
    args, _ = batch
    pmodel = autoparallelize(meta, tuple(args), strategy=strategy, init_fn=copy_init(meta, real), baselines=False,
                             verify=rank == 0)
    loss = pmodel.train_step(*args).item()
    return loss, {n: p.grad.full_tensor() for n, p in pmodel.named_parameters(remove_duplicate=False)
                  if p.grad is not None}   # every alias of a tied weight: the reference may name it first
