"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models"): between the tensor-parallel regions of a layer, layer norms, dropouts and
residual adds run on a sequence shard, so the row-parallel output (Partial) is reduce-scattered to
Shard(seq) and all-gathered back to Replicate before the next column-parallel matmul.

What is checked: the rules offer those strategies and the cost model prices them (reduce_scatter +
all_gather moves the all-reduce's bytes; sequence-split activations cost 1/t), the cost model's
activation memory per layer matches the paper's formulas, the solver picks sequence parallelism
under a tight budget and the summary says so, and such a plan trains equal to one process.

Shapes: s sequence, b batch, h hidden, a heads, t tensor-parallel ways; `sbh` = s*b*h.
"""
from __future__ import annotations

import math
import re
import warnings
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar._testing import models
from autopar._testing.dist_cases import train_many, train_reference
from autopar._testing.dist_utils import run_distributed
from autopar.capture.canonicalize import canonicalize
from autopar.capture.trace import capture
from autopar.costmodel.memory import layer_activation_bytes
from autopar.errors import InputError
from autopar.graph import node_path
from autopar.placement import P, R, S, is_shard
from autopar.planning.problem import ProblemBuilder
from autopar.planning.reshard import LAUNCH_FRACTION, ReshardCost
from autopar.planning.solver import solve

T = 4  # tensor-parallel ways of the meta-model checks
COLUMN = re.compile(r"layers\.\d+\.(qkv|fc1)\.weight$")
ROW = re.compile(r"layers\.\d+\.(o_proj|fc2)\.weight$")
BETWEEN = re.compile(r"layers\.\d+(\.(ln_1|ln_2|drop_1|drop_2))?$")  # outside the tensor-parallel regions


# ------------------------------------------------------------------ a Megatron-style GPT (test helper)

class MegatronGPTBlock(nn.Module):
    """Megatron's GPT layer as the paper counts it: pre-norm attention with explicit softmax and
    dropout on the attention probabilities, a 4h GeLU MLP, dropout after each block, 2 layer norms.
    The fused QKV projection has Megatron's per-head layout ([q k v] of head 0, then head 1, ...), so a
    column split gives every rank whole heads."""

    def __init__(self, hidden: int, num_heads: int, p: float, seq: int):
        super().__init__()
        self.num_heads = num_heads
        self.ln_1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attn_drop = nn.Dropout(p)
        self.o_proj = nn.Linear(hidden, hidden)
        self.drop_1 = nn.Dropout(p)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.drop_2 = nn.Dropout(p)
        self.register_buffer("causal", torch.ones(seq, seq, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        B, T_, C = x_BTC.shape
        h = self.ln_1(x_BTC)
        qkv_BHTD = self.qkv(h).view(B, T_, self.num_heads, -1).transpose(1, 2)
        q, k, v = qkv_BHTD.split(C // self.num_heads, dim=-1)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // self.num_heads))
        probs = self.attn_drop(torch.softmax(scores.masked_fill(self.causal[:T_, :T_], float("-inf")), dim=-1))
        y = (probs @ v).transpose(1, 2).reshape(B, T_, C)
        x_BTC = x_BTC + self.drop_1(self.o_proj(y))
        return x_BTC + self.drop_2(self.fc2(F.gelu(self.fc1(self.ln_2(x_BTC)))))


class MegatronGPT(nn.Module):
    def __init__(self, vocab: int, hidden: int, num_heads: int, num_layers: int, seq: int, p: float):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(MegatronGPTBlock(hidden, num_heads, p, seq) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.ln_f(x)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def meta_megatron_gpt(hidden=1024, heads=8, seq=128, batch=2, layers=2, p=0.1, vocab=512):
    """The helper in bf16 (2-byte activations, as the paper assumes) on the meta device."""
    with torch.device("meta"):
        model = MegatronGPT(vocab, hidden, heads, layers, seq, p).to(torch.bfloat16)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return model, (ids, ids)


def _problem(model, inputs, mesh):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(model, inputs)
    canonicalize(captured.gm)
    return ProblemBuilder(captured, mesh).build()


def _scheme(prob, seq_split: bool) -> dict[int, list[int]]:
    """Megatron tensor parallelism forced: qkv/fc1 column-split (their matmuls output Shard(-1)),
    o_proj/fc2 row-split (Partial), the attention and MLP ops between them split; the norms, dropouts
    and residual adds (and the dropout masks' 1-byte copies) between the regions Replicate, or Shard(seq)
    when `seq_split`."""
    want = (S(1),) if seq_split else (R,)
    fixed = {}
    for i, (node, strats) in enumerate(zip(prob.nodes, prob.strategies)):
        path, op = node_path(node), str(node.target).split(".")[1] if node.op == "call_function" else ""
        if node.op != "call_function" or node.meta.get("phase") != "forward" or not path.startswith("layers."):
            continue
        if BETWEEN.search(path) and op in ("native_layer_norm", "add", "mul", "div", "_to_copy"):
            fixed[i] = [k for k, s in enumerate(strats) if s.outs[0] == want]
        elif op == "mm":
            fixed[i] = [k for k, s in enumerate(strats) if s.outs[0] == ((S(1),) if COLUMN.search(path + ".weight")
                                                                          else (P,))]
        elif op in ("bmm", "_softmax", "gelu", "clone", "mul", "div", "_to_copy"):
            fixed[i] = [k for k, s in enumerate(strats) if is_shard(s.outs[0][0])]
        assert fixed.get(i, [0]), f"no strategy of {node.name} fits the scheme"
    return fixed


def _layer_activations(prob, choice, layer: str) -> float:
    """Saved-for-backward bytes per device of the nodes whose module path lies in `layer`."""
    return sum(float(prob.memory[i]["activations"][choice[i]]) for i, node in enumerate(prob.nodes)
               if node_path(node) == layer or node_path(node).startswith(layer + "."))


# ------------------------------------------------------------------ 1. rules and prices

def test_rules_offer_sequence_split_norms_dropout_and_residual():
    """Every op between the tensor-parallel regions (layer norm and its backward, the dropout mask's
    scale and multiply, the residual add) can run on a sequence shard; the random draw itself stays
    whole and the mask is sliced for free (R -> S), so a rank's mask equals one device's slice."""
    model, inputs = meta_megatron_gpt(hidden=256, heads=4, seq=64, batch=1, layers=1)
    prob = _problem(model, inputs, autopar.Mesh((T,), hardware="a100"))
    found = {}
    for node, strats in zip(prob.nodes, prob.strategies):
        if node.op != "call_function" or not BETWEEN.search(node_path(node)):
            continue
        op = str(node.target).split(".")[1]
        seq = [s for s in strats if s.outs[0] == (S(1),)]
        if seq:
            found.setdefault((op, node.meta["phase"]), []).append(node.name)
        if op == "native_layer_norm_backward":  # gamma/beta gradients are partial sums over the shards
            assert any(s.outs[1] == (P,) and s.ins[0] == (S(1),) for s in seq), node.name
        if op == "bernoulli":
            assert [s.outs[0] for s in strats] == [(R,)], "a sharded draw would not match one device"
    for key in [("native_layer_norm", "forward"), ("native_layer_norm_backward", "backward"),
                ("div", "forward"), ("mul", "forward"), ("add", "forward"), ("mul", "backward"),
                ("_to_copy", "forward")]:  # the 1-byte mask kept for backward
        assert key in found, key
    assert prob.reshard.time((R,), (S(1),), 1e6) == 0.0  # the whole draw -> a rank's mask slice


def test_reduce_scatter_plus_all_gather_is_one_all_reduce():
    """P -> S(seq) -> R moves exactly the bytes and hops of P -> R; only the launch overhead of the
    second collective (LAUNCH_FRACTION * alpha) differs, so with no memory pressure the costs decide."""
    mesh = autopar.Mesh((T,), hardware="a100")
    rc = ReshardCost(mesh)
    b = 64 * 2**20
    split = rc.time((P,), (S(1),), b) + rc.time((S(1),), (R,), b)
    alpha = mesh.hardware.link(mesh.link_kind(0), "all_reduce").latency
    assert split == pytest.approx(rc.time((P,), (R,), b) + LAUNCH_FRACTION * alpha, rel=1e-9)
    assert [s.kind for s in rc.steps((P,), (S(1),), b) + rc.steps((S(1),), (R,), b)] == ["reduce_scatter",
                                                                                          "all_gather"]


# ------------------------------------------------------------------ 3. Korthikanti's activation formulas

HID, HEADS, SEQ, BATCH = 1024, 8, 128, 2


def _measured(mesh_shape, seq_split=None) -> float:
    model, inputs = meta_megatron_gpt(HID, HEADS, SEQ, BATCH)
    prob = _problem(model, inputs, autopar.Mesh(mesh_shape, hardware="a100"))
    fixed = _scheme(prob, seq_split) if seq_split is not None else None
    return _layer_activations(prob, solve(prob.cg, fixed=fixed).choice, "layers.1")


@pytest.fixture(scope="module")
def activations() -> dict[str, float]:
    return {"none": _measured((1,)), "tp": _measured((T,), False), "tp+sp": _measured((T,), True)}


def test_activation_memory_matches_korthikanti(activations):
    """Per layer and device, Megatron counts sbh(34 + 5as/h) bytes without parallelism, sbh(10 + 24/t +
    5as/(ht)) under t-way tensor parallelism and sbh(34 + 5as/h)/t with sequence parallelism too.

    Our saved-tensor accounting (layer 1 of 2: its two layer-norm inputs are its residual adds, read
    by its ln_2 and by ln_f) agrees with it term by term, save the first item:
      * layer-norm statistics: mean and rstd, (b, s, 1) each in bf16, 2 layer norms: +8sb (1/t with
        sequence parallelism, like the norms);
      * dropout masks are kept as 1-byte booleans, as Megatron's (`autopar/capture/dropout_masks.py`; the
        captured graph alone keeps mask/(1-p) in bf16: +2sbh + as^2b, +13% under tensor parallelism);
      * the causal mask is a buffer (counted with parameters), the softmax saves its output (as
        Megatron counts it), GeLU its input, every matmul its inputs: as the paper.
    With h=1024, a=8, s=128 (as/h = 1): 39.008sbh vs Megatron's 39sbh (+0.02%) without parallelism,
    17.258sbh vs 17.25sbh (+0.05%) under t=4 tensor parallelism and 9.752sbh vs 9.75sbh (+0.02%) with
    sequence parallelism (2-byte masks gave 42.0, 19.5 and 10.5sbh: +7.7%, +13%, +7.7%)."""
    s, b, h, a, t = SEQ, BATCH, HID, HEADS, T
    sbh = s * b * h
    megatron = {scheme: layer_activation_bytes(s, b, h, a, t, name) for scheme, name in
                (("none", "none"), ("tp", "tensor"), ("tp+sp", "tensor+sequence"))}
    assert megatron["tp"] == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / h / t))
    stats = {"none": 8 * s * b, "tp": 8 * s * b, "tp+sp": 8 * s * b / t}
    for scheme, got in activations.items():
        print(f"{scheme:6s} {got / sbh:.3f} sbh, Megatron {megatron[scheme] / sbh:.3f} sbh "
              f"({100 * (got / megatron[scheme] - 1):+.2f}%)")
        assert got == pytest.approx(megatron[scheme] + stats[scheme], rel=1e-9), scheme
        assert got == pytest.approx(megatron[scheme], rel=0.10), scheme
    assert activations["tp+sp"] == pytest.approx(activations["none"] / t, rel=1e-9)
    with pytest.raises(InputError):
        layer_activation_bytes(s, b, h, a, t, "pipeline")


# ------------------------------------------------------------------ 2 and 4. the solver picks it; the summary says so

def _layer_norms(plan) -> dict[str, tuple]:
    """Module path -> output spec of each layer's native_layer_norm."""
    return {c.module: c.outs[0] for name, c in plan.nodes.items()
            if name.startswith("native_layer_norm") and c.phase == "forward"
            and re.fullmatch(r"layers\.\d+\.ln_[12]", c.module)}


@pytest.fixture(scope="module")
def budget_plans():
    """The same bf16 GPT (fused Megatron QKV, dropout 0.1; SGD so that activations weigh) on 4 devices,
    planned without a budget and with 95% of the memory that plan takes, on the mesh as given (num_stages=None:
    the default search would also price the 2 x 2 grid of the same devices)."""
    model, inputs = meta_megatron_gpt(hidden=2048, heads=16, seq=512, batch=1)
    mesh = autopar.Mesh((T,), axis_names=("tp",), hardware="a100")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        free = autopar.plan(model, inputs, mesh=mesh, optimizer="sgd", baselines=False, num_stages=None)
        tight = autopar.plan(model, inputs, mesh=mesh, optimizer="sgd", baselines=False, num_stages=None,
                             memory_budget=0.95 * free.memory_per_device)
    return free, tight


def test_tight_budget_plan_is_megatron_with_sequence_parallelism(budget_plans):
    """Under the budget the solver keeps Megatron's column/row splits and moves every layer norm (and
    the dropouts and residual adds around it) onto sequence shards: the row-parallel outputs are
    reduce-scattered, the column-parallel inputs all-gathered, no forward all-reduce is left in a layer,
    and no activation is recomputed (sequence parallelism alone fits)."""
    free, tight = budget_plans
    assert tight.feasible and tight.memory_per_device <= tight.memory_budget and not tight.recompute
    for name, p in tight.params.items():
        if COLUMN.search(name):
            assert p.use == ("S0",), name
        if ROW.search(name):
            assert p.use == ("S1",), name
    norms = _layer_norms(tight)
    assert len(norms) == 4 and all(spec == ("S1",) for spec in norms.values()), norms
    layer_fwd = [c for c in tight.collectives if c.phase == "forward" and c.module.startswith("layers.")]
    assert not [c for c in layer_fwd if c.kind == "all_reduce"]
    for block in ("o_proj", "fc2"):
        assert [c for c in layer_fwd if c.kind == "reduce_scatter" and c.module.endswith(block)], block
    for block in ("qkv", "fc1"):
        assert [c for c in layer_fwd if c.kind == "all_gather" and c.module.endswith(block)], block
    assert tight.memory_breakdown["activations"] < free.memory_breakdown["activations"]


def test_without_budget_pressure_the_costs_decide(budget_plans):
    """Without a budget: ln_2 (and the bias add, dropout and residual add before it) already run on
    sequence shards, because those ops' compute shrinks t-fold for the price of one launch overhead
    (reduce_scatter + all_gather = all_reduce bytes). ln_1 stays whole: splitting it means gathering
    its output again in the backward for the QKV weight gradient, which only pays under memory
    pressure. So the tight plan is slower and the free plan holds more activations."""
    free, tight = budget_plans
    norms = _layer_norms(free)
    assert norms == {"layers.0.ln_1": ("R",), "layers.0.ln_2": ("S1",), "layers.1.ln_1": ("R",),
                     "layers.1.ln_2": ("S1",)}
    assert free.predicted_step_time < tight.predicted_step_time


def test_summary_says_where_the_sequence_is_split(budget_plans):
    free, tight = budget_plans
    line = "sequence  4 of 4 norms in 2 layers split on the sequence over axis tp (sequence parallelism)"
    assert line in tight.summary(rich=False).splitlines()
    assert "sequence  2 of 4 norms in 2 layers split" in free.summary(rich=False)  # ln_2 only
    assert line in autopar.Plan.from_json(tight.to_json()).summary(rich=False).splitlines()


# ------------------------------------------------------------------ 5. numerics at world 2

def _tiny_gpt(dropout: float):
    torch.manual_seed(0)
    model = models.GPT(models.GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=64,
                                        dropout=dropout))
    batches = []
    for seed in range(3):
        gen = torch.Generator().manual_seed(100 + seed)
        ids = torch.randint(0, 64, (1, 32), generator=gen)
        batches.append(((ids, torch.randint(0, 64, (1, 32), generator=gen)), {}))
    return model, batches


def _sequence_parallel_plan(model, batches, mesh):
    """A 2-way tensor-parallel plan squeezed by a budget until every layer norm runs on a sequence shard."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        free = autopar.plan(model, batches[0][0], mesh=mesh, strategy="tp", baselines=False)
        plan = autopar.plan(model, batches[0][0], mesh=mesh, strategy="tp", baselines=False,
                            memory_budget=0.95 * free.memory_per_device)  # tighter: recompute wins
    norms = {c.module: c.outs[0] for n, c in plan.nodes.items() if n.startswith("native_layer_norm")
             and c.phase == "forward"}
    assert len(norms) == 5 and all(spec == ("S1",) for spec in norms.values()), norms
    assert not plan.recompute
    kinds = {(c.kind, c.phase) for c in plan.collectives if c.module.startswith("transformer.h.")}
    assert {("reduce_scatter", "forward"), ("all_gather", "forward")} <= kinds, kinds
    return plan


def _seeded_train_many(rank, world, seed, *args):
    torch.manual_seed(seed)  # every rank draws what one process draws
    return train_many(rank, world, *args)


def _assert_trains_equal(dropout: float):
    model, batches = _tiny_gpt(dropout)
    mesh = autopar.Mesh((2,), axis_names=("tp",))
    plan = _sequence_parallel_plan(model, batches, mesh)
    torch.manual_seed(7)
    ref_losses, ref_state = train_reference(model, batches, 3)
    results = run_distributed(_seeded_train_many, 2, 7, model, batches, 3, [dict(plan=plan, mesh=mesh)],
                              timeout=600)
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(results[rank][0]["losses"]), torch.tensor(ref_losses),
                                   rtol=1e-4, atol=1e-5)
    for key, want in ref_state.items():
        torch.testing.assert_close(results[0][0]["state"][key], want, rtol=1e-4, atol=1e-5, msg=key)
    assert Counter(results[0][0]["emitted"]) == Counter((c.kind, c.phase) for c in plan.collectives)


def test_sequence_parallel_plan_trains_equal_to_one_process():
    """The hand-written GPT (dropout 0, batch 1 so the batch cannot be split) under a 2-way tensor-
    parallel plan whose layer norms run on sequence shards: losses and parameters after 3 AdamW steps
    equal one process's, and the graph runs exactly the plan's collectives."""
    _assert_trains_equal(0.0)


def test_sequence_parallel_dropout_draws_what_one_process_draws():
    """Dropout 0.1: each rank draws the whole mask (random draws stay replicated) and keeps its
    sequence slice for free, so with the same seed the run equals one process's, draw for draw."""
    _assert_trains_equal(0.1)
