"""Pretrained weights at any size (autopar/runtime/safetensors_io.py): a Llama built on the meta device,
parallelized over 2 gloo ranks (zero3, and a 2-stage pipeline), loads transformers' own sharded
safetensors checkpoint with each rank reading only its slices; the next steps equal one process
loaded from the same files; the weights written back load with transformers' `from_pretrained`.

The model (54M parameters, 216 MB in fp32) is sized so that reading it whole would break the per-rank
limit the test asserts on the resident-memory growth of a load (a quarter of the model): each rank
already holds its shards, and the load may add only what it reads at a time (one tensor's pages).
Growth is measured as the peak resident memory (VmHWM, reset through /proc/self/clear_refs) over the
resident memory before the call. Writing back is bounded the same way on every rank (rank 0 writes,
one gathered tensor at a time). Single-file and strict-key cases are tests/test_state_dict.py's.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from autopar._testing.dist_cases import train_reference, train_steps
from autopar._testing.dist_utils import run_distributed

STEPS = 3
CONFIG = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
              num_key_value_heads=8, vocab_size=4096, max_position_embeddings=64, bos_token_id=0,
              eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
PLANS = {"zero3": dict(strategy="zero3"), "pp2": dict(num_stages=2, num_microbatches=2)}


def _config():
    from transformers import LlamaConfig
    return LlamaConfig(**CONFIG)


def _memory_kb() -> dict[str, int]:
    status = Path("/proc/self/status").read_text()
    return {key: int(re.search(rf"{key}:\s+(\d+)", status).group(1)) for key in ("VmRSS", "VmHWM")}


def _growth_bytes(fn) -> int:
    """Peak resident memory during fn() above the resident memory before it (Linux)."""
    Path("/proc/self/clear_refs").write_text("5")   # VmHWM := VmRSS
    before = _memory_kb()["VmRSS"]
    fn()
    return (_memory_kb()["VmHWM"] - before) * 1024


def _load_train_save(rank, world, path, batches, out):
    """Per plan: meta-built Llama, parallelized, loaded from `path`, trained, written back to out/<plan>."""
    from transformers import LlamaForCausalLM

    from autopar import autoparallelize
    results = {}
    for label, kw in PLANS.items():
        with torch.device("meta"):
            model = LlamaForCausalLM(_config())
        args, kwargs = batches[0]
        # init_fn: transformers' own (it computes the rotary tables, buffers no checkpoint holds)
        pmodel = autoparallelize(model, (*args, kwargs), init_fn=model._init_weights, baselines=False, **kw)
        load = _growth_bytes(lambda: pmodel.load_safetensors(path))
        losses, _ = train_steps(pmodel, batches, STEPS)
        save = _growth_bytes(lambda: pmodel.save_safetensors(Path(out) / label, max_shard_bytes=64 * 2**20))
        mine = {k: t.to_local().clone() for k, t in pmodel.state_dict().items()}
        pmodel.load_safetensors(Path(out) / label)   # what it wrote, read back: bit for bit its own shards
        same = all(torch.equal(t.to_local(), mine[k]) for k, t in pmodel.state_dict().items())
        shards = sum(t.numel() * t.element_size() for t in mine.values())
        results[label] = {"losses": losses, "load": load, "save": save, "shards": shards, "same": same}
    return results


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resident-memory peaks need Linux /proc")
def test_pretrained_llama_loads_by_slices_and_saves_for_transformers(tmp_path):
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config())
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(tmp_path / "pretrained", max_shard_size="64MB")   # sharded, with an index
    assert (tmp_path / "pretrained" / "model.safetensors.index.json").exists()
    gen = torch.Generator().manual_seed(1)
    batches = [((ids,), {"labels": ids}) for ids in torch.randint(0, 4096, (STEPS, 4, 32), generator=gen)]
    ref_losses, ref_state = train_reference(model, batches, STEPS)
    del model

    results = run_distributed(_load_train_save, 2, str(tmp_path / "pretrained"), batches, str(tmp_path / "out"),
                              timeout=900)
    limit = model_bytes // 4   # a rank that read the model whole would grow by all of it
    print({label: [(r[label]["load"] >> 20, r[label]["save"] >> 20, r[label]["shards"] >> 20) for r in results]
           for label in PLANS}, "MB (load growth, save growth, shards) per rank; model", model_bytes >> 20, "MB")
    for label in PLANS:
        for rank, result in enumerate(results):
            got = result[label]
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{label} rank {rank} losses: {m}")
            assert got["shards"] < 0.6 * model_bytes and got["same"], (label, rank, got["shards"], model_bytes)
            for what in ("load", "save"):
                assert got[what] < limit, f"{label} rank {rank}: {what} grew {got[what] / 2**20:.0f} MB " \
                                          f"(limit {limit / 2**20:.0f} MB, model {model_bytes / 2**20:.0f} MB)"
        saved = tmp_path / "out" / label
        assert (saved / "model.safetensors.index.json").exists() and len(list(saved.glob("*.safetensors"))) > 1
        _config().save_pretrained(saved)
        back = LlamaForCausalLM.from_pretrained(saved)
        assert back.state_dict().keys() == ref_state.keys()
        for key, want in ref_state.items():   # atol 1e-4: AdamW turns a gradient's rounding near eps into ~lr
            torch.testing.assert_close(back.state_dict()[key], want, rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"{label} {key}: {m}")
