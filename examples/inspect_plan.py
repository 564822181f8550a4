"""Plan a Llama-3-8B-shaped model for 64 H100s (an 8x8 dp x tp mesh, 80 GB each) on paper and print
the plan summary. Nothing is allocated: the model and its inputs live on the meta device.

    python examples/inspect_plan.py            # the full 32 layers
    python examples/inspect_plan.py --layers 2 # quicker, same per-layer placements
"""
from __future__ import annotations

import argparse
import time

import torch

import autopar

BATCH, SEQ = 8, 2048


def llama_8b(layers: int = 32) -> tuple[torch.nn.Module, tuple]:
    """Llama-3-8B's shapes (hidden 4096, 32 heads, 8 KV heads, MLP 14336, vocab 128256) on meta."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                         rope_theta=500000.0, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    return model, (ids, ids)


def plan_llama(layers: int = 32) -> autopar.Plan:
    model, (ids, labels) = llama_8b(layers)
    mesh = autopar.Mesh((8, 8), axis_names=("dp", "tp"), hardware="h100")
    return autopar.plan(model, (ids, {"labels": labels}), mesh=mesh, memory_budget="80GB")


def summary_text(layers: int = 32) -> str:
    """The plain-text summary the README shows."""
    return plan_llama(layers).summary(rich=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (default 32, as Llama-3-8B)")
    args = parser.parse_args()
    start = time.perf_counter()
    text = summary_text(args.layers)
    print(text)
    print(f"\n(planned in {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
