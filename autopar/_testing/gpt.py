"""A small nanoGPT-style GPT (Karpathy's nanoGPT layout and module names), used as autopar's
reference model in tests and examples.

Tensor names carry their shapes: B batch, T sequence, C embedding (n_embd), V vocabulary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50304
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        B, T, C = x_BTC.shape
        q, k, v = self.c_attn(x_BTC).split(self.n_embd, dim=2)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x_BTC))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        x_BTC = x_BTC + self.attn(self.ln_1(x_BTC))
        return x_BTC + self.mlp(self.ln_2(x_BTC))


class GPT(nn.Module):
    """GPT language model. `forward(idx, targets)` returns the mean cross-entropy loss, or the
    logits when `targets` is None."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Deterministic GPT-2 init: normal(0, 0.02), residual projections scaled by 1/sqrt(2L).
        Also (re)ties lm_head to wte, which `to_empty()` after a meta-device build unties."""
        if self.config.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        T = idx.shape[1]
        assert T <= self.config.block_size, f"sequence length {T} > block_size {self.config.block_size}"
        pos_T = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x_BTC = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos_T))
        for block in self.transformer.h:
            x_BTC = block(x_BTC)
        logits_BTV = self.lm_head(self.transformer.ln_f(x_BTC))
        if targets is None:
            return logits_BTV
        return F.cross_entropy(logits_BTV.view(-1, logits_BTV.size(-1)), targets.view(-1))
