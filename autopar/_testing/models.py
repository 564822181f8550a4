"""Model factories shared by the tests: tiny models that run in milliseconds on CPU, and real-size
configurations built on the meta device (no memory) for planning tests.

Every factory returns a `Case`: the model and its example inputs, ready for
`autopar.capture.trace.capture(case.model, case.args, example_kwargs=case.kwargs)` or
`autopar.plan(case.model, case.example_inputs, ...)` (a trailing dict holds keyword arguments).
Tiny models use a fixed seed and dropout 0, so eager and captured runs agree numerically.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from autopar._testing.gpt import GPT, GPTConfig


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
    """The hand-written nanoGPT (autopar/_testing/gpt.py): vocab 64, 2 layers, 2 heads, width 32."""
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


def tiny_llama(batch: int = 2, seq: int = 16, n_layer: int = 2) -> Case:
    """transformers LlamaForCausalLM with grouped-query attention (4 heads, 2 kv heads), 2 layers."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=n_layer, num_attention_heads=4,
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


def llama3_405b_config(num_layers: int = 126):
    """Llama-3.1-405B: hidden 16384, 126 layers, 128 heads, 8 kv heads, MLP 53248, vocab 128256."""
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=16384, num_hidden_layers=num_layers, num_attention_heads=128,
                       num_key_value_heads=8, intermediate_size=53248, vocab_size=128256,
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


def meta_llama3_405b(num_layers: int = 126, batch: int = 1, seq: int = 8192) -> Case:
    return _meta_llama(llama3_405b_config(num_layers), batch, seq)


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


# ---------------------------------------------------------------- model zoo (tiny, real weights)
# One builder per transformers family, chosen for variety (benchmarks/model_zoo.py, tests/test_zoo.py):
# hidden 32-64, 2 layers, vocab 128, dropout 0, fixed seed. Labels equal the inputs (the model shifts them).

def _zoo_lm(cls_name: str, config_name: str, batch: int, seq: int, **config) -> Case:
    """A causal/masked LM built from its config with random weights: `labels` = the input ids."""
    import transformers
    torch.manual_seed(0)
    cfg = getattr(transformers, config_name)(vocab_size=128, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                             **config)
    ids = _tokens(128, batch, seq)
    return Case(getattr(transformers, cls_name)(cfg), (ids,), {"labels": ids})


def tiny_mistral(batch: int = 4, seq: int = 16) -> Case:
    """Mistral: grouped-query attention (4 heads, 2 kv heads), gated SiLU MLP, RMSNorm, no sliding window."""
    return _zoo_lm("MistralForCausalLM", "MistralConfig", batch, seq, hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, head_dim=16,
                   max_position_embeddings=64, sliding_window=None)


def tiny_qwen2(batch: int = 4, seq: int = 16) -> Case:
    """Qwen2: GQA with q/k/v biases, tied embeddings, no sliding window."""
    return _zoo_lm("Qwen2ForCausalLM", "Qwen2Config", batch, seq, hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                   max_position_embeddings=64, use_sliding_window=False, tie_word_embeddings=True)


def tiny_gemma(batch: int = 4, seq: int = 16) -> Case:
    """Gemma: multi-query attention (1 kv head), GeGLU MLP, (1 + w) RMSNorm, scaled tied embeddings."""
    return _zoo_lm("GemmaForCausalLM", "GemmaConfig", batch, seq, hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=16, intermediate_size=128,
                   max_position_embeddings=64)


def tiny_gemma2(batch: int = 4, seq: int = 16) -> Case:
    """Gemma2: pre+post norms around attention and MLP, logit soft-capping, alternating sliding window."""
    return _zoo_lm("Gemma2ForCausalLM", "Gemma2Config", batch, seq, hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                   max_position_embeddings=64, sliding_window=8, attn_implementation="eager")


def tiny_phi(batch: int = 4, seq: int = 16) -> Case:
    """Phi: parallel attention + MLP from one LayerNorm, partial rotary (half the head dim), dense biases."""
    return _zoo_lm("PhiForCausalLM", "PhiConfig", batch, seq, hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, intermediate_size=128, partial_rotary_factor=0.5,
                   max_position_embeddings=64, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)


def tiny_gpt_neox(batch: int = 4, seq: int = 16) -> Case:
    """GPT-NeoX: parallel residual, fused QKV, partial rotary (rotary_pct 0.25), untied output embedding."""
    return _zoo_lm("GPTNeoXForCausalLM", "GPTNeoXConfig", batch, seq, hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, intermediate_size=128, rotary_pct=0.25, max_position_embeddings=64,
                   use_parallel_residual=True, hidden_dropout=0.0, attention_dropout=0.0)


def tiny_opt(batch: int = 4, seq: int = 16) -> Case:
    """OPT: learned positions (offset 2), ReLU MLP, projected word embeddings (word_embed_proj_dim 32)."""
    return _zoo_lm("OPTForCausalLM", "OPTConfig", batch, seq, hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, ffn_dim=128, max_position_embeddings=64, word_embed_proj_dim=32,
                   dropout=0.0, attention_dropout=0.0, do_layer_norm_before=True)


def tiny_opt_postnorm(batch: int = 4, seq: int = 16) -> Case:
    """OPT-350m style: post-norm (LayerNorm after each residual add)."""
    return _zoo_lm("OPTForCausalLM", "OPTConfig", batch, seq, hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, ffn_dim=128, max_position_embeddings=64, dropout=0.0,
                   attention_dropout=0.0, do_layer_norm_before=False)


def tiny_falcon(batch: int = 4, seq: int = 16) -> Case:
    """Falcon with alibi position biases, multi-query attention and a parallel attention + MLP block."""
    return _zoo_lm("FalconForCausalLM", "FalconConfig", batch, seq, hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, alibi=True, multi_query=True, parallel_attn=True,
                   hidden_dropout=0.0, attention_dropout=0.0)


def tiny_bloom(batch: int = 4, seq: int = 16) -> Case:
    """BLOOM: alibi position biases, embedding LayerNorm, fused QKV, GELU MLP."""
    return _zoo_lm("BloomForCausalLM", "BloomConfig", batch, seq, hidden_size=64, n_layer=2, n_head=4,
                   hidden_dropout=0.0, attention_dropout=0.0)


def tiny_t5(batch: int = 4, seq: int = 16) -> Case:
    """T5: encoder-decoder, cross-attention, bucketed relative position bias, RMSNorm, untied head."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                                tie_word_embeddings=False)
    ids = _tokens(128, batch, seq)
    return Case(transformers.T5ForConditionalGeneration(cfg), (ids,), {"labels": _tokens(128, batch, seq, seed=1)})


def tiny_bart(batch: int = 4, seq: int = 16) -> Case:
    """BART: encoder-decoder, learned positions, post-norm, cross-attention, tied shared embeddings."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.BartConfig(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                  decoder_ffn_dim=128, max_position_embeddings=64, dropout=0.0,
                                  attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1,
                                  bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    ids = _tokens(128, batch, seq)
    return Case(transformers.BartForConditionalGeneration(cfg), (ids,),
                {"labels": _tokens(128, batch, seq, seed=1)})


def tiny_vit(batch: int = 4, image: int = 16) -> Case:
    """ViT: conv patch embedding (4x4 patches), class token, learned positions, 10-way classifier."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                 image_size=image, patch_size=4, num_channels=3, num_labels=10,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randn(batch, 3, image, image, generator=gen)
    labels = torch.randint(0, 10, (batch,), generator=gen)
    return Case(transformers.ViTForImageClassification(cfg), (pixels,), {"labels": labels})


def tiny_mixtral(batch: int = 4, seq: int = 16, experts_implementation: str = "grouped_mm") -> Case:
    """Mixtral: 4 experts, top-2 routing, GQA. transformers' experts implementations: "grouped_mm" sorts
    the token-expert rows and runs one grouped matmul (autopar captures it, autopar/sharding/rules/moe.py);
    "eager" loops over the experts hit (data-dependent); "batched_mm" gathers each token's expert weights."""
    return _zoo_lm("MixtralForCausalLM", "MixtralConfig", batch, seq, hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, head_dim=16,
                   num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64, sliding_window=None,
                   experts_implementation=experts_implementation)


def tiny_qwen2_moe(batch: int = 4, seq: int = 16) -> Case:
    """Qwen2-MoE: 4 routed experts (top-2, grouped matmuls) plus an always-on shared expert behind a
    sigmoid gate, q/k/v biases."""
    return _zoo_lm("Qwen2MoeForCausalLM", "Qwen2MoeConfig", batch, seq, hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, moe_intermediate_size=64,
                   shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                   max_position_embeddings=64, experts_implementation="grouped_mm")


def tiny_olmoe(batch: int = 4, seq: int = 16) -> Case:
    """OLMoE: 4 experts, top-2 through grouped matmuls, RMS-normed q and k."""
    return _zoo_lm("OlmoeForCausalLM", "OlmoeConfig", batch, seq, hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, num_experts=4,
                   num_experts_per_tok=2, max_position_embeddings=64, experts_implementation="grouped_mm")


def meta_mixtral(num_layers: int = 2, batch: int = 1, seq: int = 4096) -> Case:
    """Mixtral-8x7B dimensions (hidden 4096, 8 experts of MLP 14336, top-2, 32 heads, 8 kv heads,
    vocab 32000) with few layers, on the meta device."""
    import transformers
    cfg = transformers.MixtralConfig(hidden_size=4096, num_hidden_layers=num_layers, num_attention_heads=32,
                                     num_key_value_heads=8, intermediate_size=14336, num_local_experts=8,
                                     num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=seq,
                                     sliding_window=None, experts_implementation="grouped_mm")
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(cfg)
    ids = _tokens(32000, batch, seq, device="meta")
    return Case(model, (ids,), {"labels": ids})


ZOO_CASES = {"mistral": tiny_mistral, "qwen2": tiny_qwen2, "gemma": tiny_gemma, "gemma2": tiny_gemma2,
             "phi": tiny_phi, "gpt_neox": tiny_gpt_neox, "opt": tiny_opt, "opt_postnorm": tiny_opt_postnorm,
             "falcon": tiny_falcon, "bloom": tiny_bloom, "t5": tiny_t5, "bart": tiny_bart, "vit": tiny_vit,
             "mixtral": tiny_mixtral, "qwen2_moe": tiny_qwen2_moe, "olmoe": tiny_olmoe,
             "mixtral_eager": lambda: tiny_mixtral(experts_implementation="eager"),
             "mixtral_batched_mm": lambda: tiny_mixtral(experts_implementation="batched_mm")}


def zoo_batches(case: Case, steps: int = 3) -> list:
    """`steps` different (args, kwargs) batches of the example's shapes: integer tensors redrawn in their
    value range, float tensors from a normal; a keyword that is a positional input (a causal LM's
    labels) stays that input."""
    out = []
    for seed in range(steps):
        gen = torch.Generator().manual_seed(100 + seed)

        def redraw(t):
            if not isinstance(t, torch.Tensor):
                return t
            if t.dtype == torch.long:
                return torch.randint(0, int(t.max()) + 1, t.shape, generator=gen)
            return torch.randn(t.shape, generator=gen, dtype=t.dtype)

        args = tuple(redraw(a) for a in case.args)
        same = {k: i for k, v in case.kwargs.items() for i, a in enumerate(case.args) if v is a}
        kwargs = {k: args[same[k]] if k in same else redraw(v) for k, v in case.kwargs.items()}
        out.append((args, kwargs))
    return out
