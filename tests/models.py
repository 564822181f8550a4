"""Model factories shared by the tests: tiny models that run in milliseconds on CPU, and real-size
configurations built on the meta device (no memory) for planning tests.

Every factory returns a `Case`: the model and its example inputs, ready for
`autopar.capture.capture(case.model, case.args, example_kwargs=case.kwargs)` or
`autopar.plan(case.model, case.example_inputs, ...)` (a trailing dict holds keyword arguments).
Tiny models use a fixed seed and dropout 0, so eager and captured runs agree numerically.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `examples` lives at the repo root

from examples.gpt import GPT, GPTConfig  # noqa: E402


@dataclass
class Case:
    """A model and the inputs of one training step (positional `args`, keyword `kwargs`)."""

    model: nn.Module
    args: tuple
    kwargs: dict = field(default_factory=dict)
    loss_fn: object = None

    @property
    def example_inputs(self) -> tuple:
        return self.args + ((self.kwargs,) if self.kwargs else ())

    def eager_loss(self) -> torch.Tensor:
        out = self.model(*self.args, **self.kwargs)
        if self.loss_fn is not None:
            return self.loss_fn(out, *self.args)
        return out if isinstance(out, torch.Tensor) else out.loss


def _tokens(vocab: int, batch: int, seq: int, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    if device == "meta":
        return torch.empty(batch, seq, dtype=torch.long, device="meta")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen)


def _no_dropout() -> dict:
    return dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


# ---------------------------------------------------------------- tiny models (real weights)

def tiny_gpt(n_layer: int = 2, batch: int = 2, seq: int = 8, tie_weights: bool = True) -> Case:
    """The hand-written nanoGPT (examples/gpt.py): vocab 64, 2 layers, 2 heads, width 32."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=n_layer, n_head=2, n_embd=32,
                       tie_weights=tie_weights)
    model = GPT(config)
    return Case(model, (_tokens(64, batch, seq), _tokens(64, batch, seq, seed=1)))


def tiny_gpt2(batch: int = 2, seq: int = 16) -> Case:
    """transformers GPT2LMHeadModel (Conv1D layers, lm_head tied to wte), 2 layers, width 64."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                        bos_token_id=0, eos_token_id=0, **_no_dropout())
    ids = _tokens(128, batch, seq)
    return Case(GPT2LMHeadModel(config), (ids,), {"labels": ids})


def tiny_llama(batch: int = 2, seq: int = 16) -> Case:
    """transformers LlamaForCausalLM with grouped-query attention (4 heads, 2 kv heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, vocab_size=128,
                         max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    ids = _tokens(128, batch, seq)
    return Case(LlamaForCausalLM(config), (ids,), {"labels": ids})


def _bert_config():
    from transformers import BertConfig
    return BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=128, vocab_size=128, max_position_embeddings=64,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      pad_token_id=0)


def tiny_bert(batch: int = 2, seq: int = 16) -> Case:
    """transformers BertForMaskedLM (decoder tied to the word embeddings), dropout 0."""
    from transformers import BertForMaskedLM
    torch.manual_seed(0)
    ids = _tokens(128, batch, seq)
    return Case(BertForMaskedLM(_bert_config()), (ids,), {"labels": ids})


def _mean_square_hidden(output, *inputs) -> torch.Tensor:
    return output.last_hidden_state.sin().mean()  # not LayerNorm-invariant, unlike mean(h**2)


def tiny_bert_encoder(batch: int = 2, seq: int = 16) -> Case:
    """transformers BertModel with its pooler, trained through `loss_fn` on the last hidden state:
    the pooler gets no gradient (a model with unused parameters)."""
    from transformers import BertModel
    torch.manual_seed(0)
    ids = _tokens(128, batch, seq)
    return Case(BertModel(_bert_config()), (ids,), loss_fn=_mean_square_hidden)


TINY_CASES = {"gpt": tiny_gpt, "gpt2": tiny_gpt2, "llama": tiny_llama, "bert": tiny_bert}


# ---------------------------------------------------------------- real-size models (meta device)

def gpt2_124m_config(n_layer: int = 12):
    from transformers import GPT2Config
    return GPT2Config(n_layer=n_layer, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                      **_no_dropout())


def llama3_8b_config(num_layers: int = 32):
    """Llama-3-8B: hidden 4096, 32 layers, 32 heads, 8 kv heads, MLP 14336, vocab 128256."""
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=4096, num_hidden_layers=num_layers, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                       max_position_embeddings=8192, rope_theta=500000.0)


def llama3_70b_config(num_layers: int = 80):
    """Llama-3-70B: hidden 8192, 80 layers, 64 heads, 8 kv heads, MLP 28672, vocab 128256."""
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=8192, num_hidden_layers=num_layers, num_attention_heads=64,
                       num_key_value_heads=8, intermediate_size=28672, vocab_size=128256,
                       max_position_embeddings=8192, rope_theta=500000.0)


def meta_gpt2_124m(n_layer: int = 12, batch: int = 8, seq: int = 1024) -> Case:
    """GPT-2 124M on the meta device (no weights allocated), inputs on meta too."""
    from transformers import GPT2LMHeadModel
    with torch.device("meta"):
        model = GPT2LMHeadModel(gpt2_124m_config(n_layer))
    ids = _tokens(50257, batch, seq, device="meta")
    return Case(model, (ids,), {"labels": ids})


def _meta_llama(config, batch: int, seq: int) -> Case:
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = _tokens(config.vocab_size, batch, seq, device="meta")
    return Case(model, (ids,), {"labels": ids})


def meta_llama3_8b(num_layers: int = 32, batch: int = 1, seq: int = 8192) -> Case:
    return _meta_llama(llama3_8b_config(num_layers), batch, seq)


def meta_llama3_70b(num_layers: int = 80, batch: int = 1, seq: int = 8192) -> Case:
    return _meta_llama(llama3_70b_config(num_layers), batch, seq)


def meta_gpt(n_layer: int = 12, n_embd: int = 768, n_head: int = 12, batch: int = 8,
             seq: int = 1024) -> Case:
    """The hand-written GPT at GPT-2 124M size on the meta device."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=50304, block_size=1024, n_layer=n_layer,
                              n_head=n_head, n_embd=n_embd))
    ids = _tokens(50304, batch, seq, device="meta")
    return Case(model, (ids, ids))


# ---------------------------------------------------------------- planner known results (meta)

class TwoLayerMLP(nn.Module):
    """Alpa's two-layer MLP: fc1 = Linear(h, h), relu, fc2 = Linear(h, h), cross-entropy loss."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, hidden)
        self.fc2 = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.fc2(torch.relu(self.fc1(x))), labels)


def meta_mlp(batch: int, hidden: int) -> Case:
    with torch.device("meta"):
        model = TwoLayerMLP(hidden)
    x = torch.empty(batch, hidden, device="meta")
    labels = torch.empty(batch, dtype=torch.long, device="meta")
    return Case(model, (x, labels))


class MegatronBlock(nn.Module):
    """A pre-norm transformer layer with separate q/k/v projections (Megatron's head-aligned layout:
    a contiguous column split of each projection gives every rank whole heads)."""

    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.ln_1 = nn.LayerNorm(hidden)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, hidden) for _ in range(3))
        self.o_proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def _heads(self, x_BTC: torch.Tensor) -> torch.Tensor:
        B, T, C = x_BTC.shape
        return x_BTC.view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        B, T, C = x_BTC.shape
        h = self.ln_1(x_BTC)
        y = nn.functional.scaled_dot_product_attention(
            self._heads(self.q_proj(h)), self._heads(self.k_proj(h)), self._heads(self.v_proj(h)), is_causal=True)
        x_BTC = x_BTC + self.o_proj(y.transpose(1, 2).reshape(B, T, C))
        return x_BTC + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln_2(x_BTC))))


class MegatronLM(nn.Module):
    """Embedding, `num_layers` MegatronBlocks, final norm, untied LM head, cross-entropy."""

    def __init__(self, vocab: int, hidden: int, num_heads: int, num_layers: int = 1):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(MegatronBlock(hidden, num_heads) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.ln_f(x))
        return nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def meta_megatron_lm(vocab: int = 512, hidden: int = 2048, num_heads: int = 16, num_layers: int = 1,
                     batch: int = 4, seq: int = 64) -> Case:
    with torch.device("meta"):
        model = MegatronLM(vocab, hidden, num_heads, num_layers)
    ids = _tokens(vocab, batch, seq, device="meta")
    return Case(model, (ids, ids))
