"""Property-based fuzzing of the whole product: random small transformer configurations and meshes,
planned and executed at world 2, must train exactly like one process of the unmodified model.

`fuzz_case()` is a hypothesis strategy over `FuzzCase`s (family, layers, heads, head width, vocabulary,
sequence, batch, tied or untied embeddings, mesh shape, strategy). `run_cases` is the worker each rank
of a world-2 job runs: for every case it builds the model, trains 3 AdamW steps single-process and
under autopar, and reports "ok", "refused" (an AutoparError where one is the right answer, e.g. a
data-parallel recipe on a batch that does not divide) or "FAIL" with the error. Used by
tests/test_fuzz.py (a fixed-seed set in CI) and benchmarks/fuzz.py (longer runs).
"""
from __future__ import annotations

import copy
import traceback
from dataclasses import asdict, dataclass

import torch
from hypothesis import strategies as st

from autopar._testing.dist_cases import assert_matches, train_reference, train_steps

STRATEGIES = ("auto", "dp", "zero1", "zero2", "zero3", "tp")
DATA_PARALLEL = ("dp", "zero1", "zero2", "zero3")
STEPS = 3


@dataclass(frozen=True)
class FuzzCase:
    family: str            # "gpt" (autopar/_testing/gpt.py) or "llama" (transformers LlamaForCausalLM)
    n_layer: int
    n_head: int
    kv_heads: int          # llama: grouped-query attention (divides n_head); gpt: n_head
    head_dim: int
    vocab: int
    seq: int
    batch: int
    tied: bool
    mesh: tuple            # (2,), (1, 2) or (2, 1)
    strategy: str          # one recipe, applied to the axis of size 2 (a size-1 axis gets "dp")

    def kwargs(self) -> dict:
        """autoparallelize's mesh and strategy arguments for this case."""
        import autopar
        if len(self.mesh) == 1:
            return dict(mesh=autopar.Mesh(self.mesh, axis_names=("x",)), strategy=self.strategy)
        names = ("a", "b")
        strategy = {n: (self.strategy if size == 2 else "dp") for n, size in zip(names, self.mesh)}
        if self.strategy == "auto":
            strategy = "auto"
        return dict(mesh=autopar.Mesh(self.mesh, axis_names=names), strategy=strategy)

    def may_refuse(self) -> bool:
        """A data-parallel recipe must refuse a batch that does not divide over its 2 ranks."""
        return self.strategy in DATA_PARALLEL and self.batch % 2 == 1


@st.composite
def fuzz_case(draw) -> FuzzCase:
    family = draw(st.sampled_from(("gpt", "llama")))
    n_head = draw(st.integers(1, 4))
    kv_heads = draw(st.sampled_from([k for k in range(1, n_head + 1) if n_head % k == 0])) if family == "llama" \
        else n_head
    head_dim = draw(st.sampled_from((2, 4, 8))) if family == "gpt" else draw(st.sampled_from((4, 8)))  # rotary: even
    return FuzzCase(
        family=family, n_layer=draw(st.integers(1, 3)), n_head=n_head, kv_heads=kv_heads, head_dim=head_dim,
        # a causal LM shifts its labels: at sequence length 1 it has no token to predict (its loss is NaN)
        vocab=draw(st.integers(5, 97)), seq=draw(st.integers(1 if family == "gpt" else 2, 12)),
        batch=draw(st.integers(1, 6)),
        tied=draw(st.booleans()), mesh=draw(st.sampled_from(((2,), (1, 2), (2, 1)))),
        strategy=draw(st.sampled_from(STRATEGIES)))


def build(case: FuzzCase, seed: int = 0):
    """The model and three batches of the case (tokens in the vocabulary; labels = inputs)."""
    torch.manual_seed(seed)
    hidden = case.n_head * case.head_dim
    if case.family == "gpt":
        from autopar._testing.gpt import GPT, GPTConfig
        model = GPT(GPTConfig(vocab_size=case.vocab, block_size=max(case.seq, 1), n_layer=case.n_layer,
                              n_head=case.n_head, n_embd=hidden, tie_weights=case.tied))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(
            hidden_size=hidden, num_hidden_layers=case.n_layer, num_attention_heads=case.n_head,
            num_key_value_heads=case.kv_heads, head_dim=case.head_dim, intermediate_size=2 * hidden + 4,
            vocab_size=case.vocab, max_position_embeddings=max(case.seq, 2), tie_word_embeddings=case.tied,
            bos_token_id=0, eos_token_id=0, pad_token_id=0))
    batches = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, case.vocab, (case.batch, case.seq), generator=gen)
        batches.append(((ids, ids), {}) if case.family == "gpt" else ((ids,), {"labels": ids}))
    return model, batches


def _train_parallel(model, batches, kw) -> tuple[list[float], dict]:
    from autopar import autoparallelize
    args, kwargs = batches[0]
    example = tuple(args) + ((kwargs,) if kwargs else ())
    pmodel = autoparallelize(copy.deepcopy(model), example, verify=True, baselines=False, **kw)
    losses, _ = train_steps(pmodel, batches, STEPS)
    return losses, pmodel.full_state_dict()


def check_case(case: FuzzCase) -> tuple[str, str]:
    """("ok" | "refused" | "FAIL", detail). Every rank runs it; collectives keep the ranks in step."""
    from autopar.errors import AutoparError
    model, batches = build(case)
    try:
        losses, state = _train_parallel(model, batches, case.kwargs())
    except AutoparError as e:
        if case.may_refuse():
            return "refused", f"{type(e).__name__}: {e}"
        return "FAIL", f"{type(e).__name__}: {e}"
    except Exception:
        return "FAIL", traceback.format_exc(limit=8)
    if case.may_refuse():
        return "FAIL", f"a {case.strategy} plan accepted a batch of {case.batch} on 2 ranks"
    ref_losses, ref_state = train_reference(model, batches, STEPS)
    try:
        assert_matches([[{"losses": losses, "state": state}]], ref_losses, ref_state, [case.strategy], check_plan=False)
    except AssertionError as e:
        return "FAIL", str(e).splitlines()[0] + " ... " + str(e).splitlines()[-1]
    return "ok", ""


def run_cases(rank: int, world: int, cases: list[dict]) -> list[tuple[dict, str, str]]:
    """Worker: every case in order on this rank; results (case, outcome, detail)."""
    out = []
    for raw in cases:
        case = FuzzCase(**{**raw, "mesh": tuple(raw["mesh"])})
        outcome, detail = check_case(case)
        out.append((asdict(case), outcome, detail))
    return out


def draw_cases(n: int, seed: int) -> list[FuzzCase]:
    """`n` cases drawn by hypothesis from `fuzz_case()`, the same ones for the same seed (its first draws
    are the simplest configurations, later ones spread over the space)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as fixed_seed
    drawn: list[FuzzCase] = []

    @fixed_seed(seed)
    @settings(max_examples=n, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(fuzz_case())
    def collect(case):
        if case not in drawn:
            drawn.append(case)

    collect()
    return drawn
