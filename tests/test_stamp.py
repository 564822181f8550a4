"""Stamped capture (three layers traced, the rest copied) equals tracing every layer, node for node
and in numbers; layers that are not provably alike are traced in full."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from autopar._testing.dist_cases import train_many, train_reference
from autopar._testing.dist_utils import run_distributed
from autopar.capture.stamp import find_stacks
from autopar.capture.trace import capture

LAYERS = 6


def _gpt(n_layer=LAYERS):
    from autopar._testing.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=n_layer, n_head=2, n_embd=32))
    ids = torch.randint(0, 64, (2, 16))
    return model, (ids, ids)


def _hf(kind: str):
    import transformers
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 8))
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                          bos_token_id=0, eos_token_id=0)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "gpt2":
        config = transformers.GPT2Config(n_layer=LAYERS, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.BertConfig(hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                                         intermediate_size=64, vocab_size=64, max_position_embeddings=32,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
        model = transformers.BertForMaskedLM(config)
    return model, (ids, {"labels": ids})


def _structure(c) -> list[tuple]:
    """Every node's op, target, arguments (nodes by position), name, module path and phase."""
    index = {n: i for i, n in enumerate(c.gm.graph.nodes)}
    out = []
    for n in c.gm.graph.nodes:
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: ("node", index[a]))
        out.append((n.op, "" if n.op == "placeholder" else str(n.target), repr(args), n.meta.get("autopar_name"),
                    n.meta.get("autopar_role"), n.meta.get("module_path"), n.meta.get("phase")))
    return out


def _run(c, model, inputs):
    named = dict(model.named_parameters())
    bufs = dict(model.named_buffers())
    flat_inputs = [*inputs[:-1], *inputs[-1].values()] if isinstance(inputs[-1], dict) else list(inputs)
    return c.gm(*(named[n].detach() for n in c.param_names), *(bufs[n] for n in c.buffer_names), *flat_inputs)


@pytest.mark.parametrize("kind", ["gpt", "gpt2", "llama", "bert"])
def test_stamped_capture_equals_full_trace(kind):
    model, inputs = _gpt() if kind == "gpt" else _hf(kind)
    stamped = capture(model, inputs)
    full = capture(model, inputs, stamp_layers=False)
    assert list(stamped.stamped.values()) == [LAYERS] and not full.stamped
    assert _structure(stamped) == _structure(full)
    for field in ("param_names", "buffer_names", "input_names", "grad_param_names", "unused_params", "tied",
                  "param_shapes"):
        assert getattr(stamped, field) == getattr(full, field), field
    with torch.no_grad():
        got, want = _run(stamped, model, inputs), _run(full, model, inputs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_short_stacks_are_traced_whole():
    model, _ = _gpt(n_layer=4)
    assert find_stacks(model) == []


class _Block(nn.Module):
    def __init__(self, index: int, scale: float | None = None):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.index = index  # counts the layers: allowed to differ...
        self.scale = scale if scale is not None else 1.0

    def forward(self, x):
        return torch.tanh(self.lin(x)) * self.scale + x


class _Stack(nn.Module):
    def __init__(self, blocks, aux: bool = False):
        super().__init__()
        self.embed = nn.Linear(8, 8)  # the first layer's input needs a gradient, as every other's
        self.blocks = nn.ModuleList(blocks)
        self.aux = aux

    def forward(self, x):
        x = self.embed(x)
        aux = 0.0
        for b in self.blocks:
            x = b(x)
            if self.aux:
                aux = aux + x.mean()  # reads every layer: stamping must refuse
        return x.pow(2).mean() + aux


class _IndexedBlock(_Block):
    def forward(self, x):
        return torch.tanh(self.lin(x)) * (self.index + 1) + x  # ...but not change what the layer computes


@pytest.mark.parametrize("make", [
    lambda: _Stack([_Block(i, scale=1.0 + i) for i in range(6)]),      # an attribute differs: not a stack
    lambda: _Stack([_IndexedBlock(i) for i in range(6)]),              # the index changes the graph
    lambda: _Stack([_Block(i) for i in range(6)], aux=True),           # a loss term reads every layer
])
def test_layers_not_provably_alike_are_traced_whole(make):
    torch.manual_seed(0)
    model = make()
    x = torch.randn(4, 8)
    c = capture(model, (x,))
    assert not c.stamped
    assert _structure(c) == _structure(capture(model, (x,), stamp_layers=False))


def test_alike_toy_stack_is_stamped_and_exact():
    torch.manual_seed(0)
    model = _Stack([_Block(i) for i in range(7)])
    x = torch.randn(4, 8)
    c = capture(model, (x,))
    assert c.stamped == {"blocks": 7}
    loss = model(x)
    loss.backward()
    with torch.no_grad():
        out = _run(c, model, (x,))
    torch.testing.assert_close(out[0], loss.detach())
    for name, grad in zip(c.grad_param_names, out[1:]):
        torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad)


def test_stamped_model_trains_like_one_process():
    """The runtime executes the stamped graph: zero3 and tp at world 2 match one process."""
    from autopar._testing.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=5, n_head=2, n_embd=32))
    batches = []
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 64, (4, 16), generator=gen)
        batches.append(((ids, ids), {}))
    ref_losses, ref_state = train_reference(model, batches, 3)
    kws = [dict(strategy="zero3"), dict(strategy="tp")]
    results = run_distributed(train_many, 2, model, batches, 3, kws, timeout=600)
    for i, kw in enumerate(kws):
        torch.testing.assert_close(torch.tensor(results[0][i]["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
        for key, want in ref_state.items():
            torch.testing.assert_close(results[0][i]["state"][key], want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{kw} {key}: {m}")
