"""Meta-device models get every tensor a value when materialised, or a warning naming those without.

Before, the default init ran only torch.nn layers' reset_parameters: a transformers model built on
meta kept uninitialised norm weights, GPT-2's Conv1D weights and non-persistent buffers (rotary
`inv_freq`, BERT's `position_ids`) — whatever the allocator returned, silently.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from autopar._testing import models
from autopar.runtime.materialize import UninitializedTensorWarning, stream_tensors


@pytest.mark.parametrize("make", [models.tiny_llama, models.tiny_bert, models.tiny_gpt2])
def test_transformers_models_get_their_own_init_at_any_depth(make):
    """The default init of a transformers model (here inside the user's wrapper) is its own
    `_init_weights`: every tensor set, every buffer equal to the real model's."""
    real = make().model

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

    with torch.device("meta"):
        meta = Wrapper(type(real)(real.config))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UninitializedTensorWarning)
        values = {names[0]: t for names, t in stream_tensors(meta)}
    for name, buf in real.named_buffers():
        torch.testing.assert_close(values[f"inner.{name}"], buf, rtol=0, atol=0)
    assert all(torch.isfinite(t).all() for t in values.values() if t.is_floating_point())
    assert all(t.is_meta for t in meta.parameters()), "the user's model stays on meta"


def test_a_tensor_no_init_sets_is_named_and_holds_nan():
    class Scale(nn.Module):   # a parameter its constructor sets, which no init_fn knows
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))
            self.register_buffer("steps", torch.zeros((), dtype=torch.long), persistent=False)
            self.lin = nn.Linear(4, 4)

    with torch.device("meta"):
        model = Scale()
    with pytest.warns(UninitializedTensorWarning, match=r"2 tensors uninitialised \(gain, steps\).*init_fn"):
        values = {names[0]: t for names, t in stream_tensors(model)}
    assert torch.isnan(values["gain"]).all() and values["steps"] == torch.iinfo(torch.long).min
    assert torch.isfinite(values["lin.weight"]).all()   # torch.nn layers: reset_parameters
