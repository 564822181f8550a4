"""The loss a captured training step differentiates: found in the model's output, or `loss_fn`'s.

The conventions models already follow are read without a `loss_fn`: a scalar tensor; a dict (or a
transformers `ModelOutput`) with "loss"; an object with a `.loss` tensor; a tuple or list in which exactly
one item is a scalar floating tensor (nanoGPT's `(logits, loss)`, or `(loss, logits)`). An output with
no such item, or with several (`(loss, aux_loss)`), raises NoLossError showing the `loss_fn=` to pass.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from autopar.errors import NoLossError

_HINT = ("Return the loss from forward (e.g. pass labels/targets) or pass "
         "loss_fn=lambda output, *inputs: ... to plan() / autoparallelize() / capture().")


class LossModule(nn.Module):
    """Calls the user's model (as `model`, so parameter names keep a "model." prefix) on flat tensors
    through `call` and returns its scalar loss."""

    def __init__(self, model: nn.Module, call: Callable, loss_fn: Callable | None, num_args: int):
        super().__init__()
        self.model = model
        self._call, self._loss_fn, self._num_args = call, loss_fn, num_args

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        out = self._call(*tensors)
        if self._loss_fn is None:
            return extract_loss(out)
        loss = self._loss_fn(out, *tensors[: self._num_args])
        if not isinstance(loss, torch.Tensor):
            raise NoLossError(f"loss_fn returned {type(loss).__name__}, not a scalar floating tensor. {_HINT}")
        return _as_scalar(loss, "loss_fn's result")


def extract_loss(out: Any) -> torch.Tensor:
    """The scalar loss in a model's output, by the conventions of the module docstring."""
    if isinstance(out, torch.Tensor):
        return _as_scalar(out, "the model's output")
    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        return _as_scalar(out["loss"], 'output["loss"]')
    if isinstance(getattr(out, "loss", None), torch.Tensor):
        return _as_scalar(out.loss, "output.loss")
    if isinstance(out, (tuple, list)):
        return _loss_in_sequence(out)
    raise NoLossError(f"the model returned {type(out).__name__} with no loss (checked: a scalar tensor, "
                      f'.loss, ["loss"], one scalar item of a tuple). {_HINT}')


def _is_loss(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.numel() == 1 and x.is_floating_point()


def _loss_in_sequence(out: tuple | list) -> torch.Tensor:
    """The one scalar floating item of a tuple/list output: `(logits, loss)` and `(loss, logits)` alike."""
    found = [i for i, x in enumerate(out) if _is_loss(x)]
    if len(found) == 1:
        return out[found[0]].reshape(())
    kinds = ", ".join(_describe(x) for x in out)
    if not found:
        raise NoLossError(f"the model returned a {type(out).__name__} ({kinds}) with no scalar floating "
                          f"tensor to train on. {_HINT}")
    choices = " or ".join(f"loss_fn=lambda output, *inputs: output[{i}]" for i in found)
    raise NoLossError(f"the model returned a {type(out).__name__} ({kinds}) with {len(found)} scalar floating "
                      f"tensors (items {', '.join(map(str, found))}): autopar cannot tell which is the loss. "
                      f"Pass {choices} to plan() / autoparallelize() / capture().")


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
    return type(x).__name__


def _as_scalar(loss: torch.Tensor, what: str) -> torch.Tensor:
    if loss.numel() != 1 or not loss.is_floating_point():
        raise NoLossError(f"{what} is a {tuple(loss.shape)} {loss.dtype} tensor, not a scalar floating loss. {_HINT}")
    return loss.reshape(())
