"""mixed_precision="bf16": the autocast step is captured, priced in the dtypes it uses, and trains
like the single-process `torch.autocast("cpu", torch.bfloat16)` run of the unmodified model.

Tolerances of the multi-process runs against that run (20 AdamW steps, lr 3e-3, losses 3.5-5):
- every step: |loss - reference| <= 0.015, half a bf16 ulp of the loss (bf16 spacing is 2^-5 on
  [4, 8)). A sharded bf16 matmul rounds its output per shard (a data-parallel weight gradient is a
  bf16 sum over half the batch, a tensor-parallel partial sum is rounded before it is reduced), so
  every gradient differs at bf16 rounding level (2^-9 relative); Adam turns any gradient into a
  step of about lr, so these differences compound. Measured worst gaps: 0.007 (Llama), 0.0005
  (GPT); the single-process fp32 run drifts from the autocast one by 0.010 over the same steps by the
  same mechanism, so this check alone cannot tell bf16 from fp32 numerics. That is:
- step 0, plans that split only the batch (dp, zero3): each rank's forward is the reference's,
  element for element, so the first loss equals the autocast one within fp32 summation order (2e-6)
  while the fp32 loss is 1e-4 (GPT) / 1.4e-5 (Llama) away (checked to exceed 1e-5).
"""
from __future__ import annotations

import copy
import operator
from collections import Counter

import pytest
import torch

import autopar
from autopar._testing import models
from autopar._testing.dist_cases import train_reference, train_steps
from autopar._testing.dist_utils import run_distributed
from autopar.capture.precision import MixedPrecision, as_policy
from autopar.errors import InputError
from autopar.passes.ops import wait_buckets

STEPS = 20
LR = 3e-3  # the loss must move: 20 steps at lr 1e-3 barely leave ln(vocab); 1e-2 spikes Llama
LOSS_ATOL = 0.015  # half a bf16 ulp of a loss in [4, 8): see the module docstring
FIRST_ATOL = 2e-6  # step 0 of a batch-split plan: fp32 summation order only
BF16_REDUCE = MixedPrecision(reduce_dtype=torch.bfloat16)


# ---------------------------------------------------------------- helpers (also run in spawned ranks)

def _loss(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def _batches(case, num: int = 4) -> list:
    out = []
    for seed in range(num):
        gen = torch.Generator().manual_seed(200 + seed)
        args = tuple(torch.randint(0, 64, a.shape, generator=gen) for a in case.args)
        kwargs = {k: args[0] for k in case.kwargs}  # labels = input ids
        out.append((args, kwargs))
    return out


def _gradient_wire_dtypes(gm) -> Counter:
    """dtype of every tensor a gradient collective (fused or not) reads, from the cast feeding it."""
    dtypes = Counter()
    for node in gm.graph.nodes:
        fused = node.meta.get("autopar_fused")
        if fused is not None:
            for meta, x in zip(fused, node.args[0]):
                if meta["reason"].startswith("gradient"):
                    dtypes[_cast_dtype(x)] += 1
        elif node.meta.get("autopar_collective", {}).get("reason", "").startswith("gradient"):
            dtypes[_cast_dtype(node.args[0].args[0])] += 1
    return dtypes


def _cast_dtype(x) -> str:
    """The dtype of the value a collective reads: a cast's target dtype, else the graph value's. The
    second collective of a 2-D reduction reads the first one's output: followed back to its input."""
    while x.target is not torch.ops.aten._to_copy.default and "val" not in x.meta:
        if x.target is operator.getitem and "autopar_fused" in x.args[0].meta:
            x = x.args[0].args[0][x.args[1]]  # one tensor of a fused bucket
        elif x.target is operator.getitem and x.args[0].target is wait_buckets:
            x = x.args[0].args[0].args[0][x.args[1]]  # result k of an overlapped bucket: its k-th input
        else:
            x = x.all_input_nodes[0]  # contiguous / permute-copy / wait / collective: born local
    if x.target is torch.ops.aten._to_copy.default and "dtype" in x.kwargs:
        return str(x.kwargs["dtype"])
    return str(x.meta["val"].dtype)


def train_bf16(rank, world, model, batches, steps, kws):
    from autopar import autoparallelize
    from autopar.passes import emitted_collectives
    out = []
    for kw in kws:
        args, kwargs = batches[0]
        pmodel = autoparallelize(copy.deepcopy(model), tuple(args) + ((kwargs,) if kwargs else ()), verify=True,
                                 baselines=False, **kw)
        losses, _ = train_steps(pmodel, batches, steps, lr=LR)
        out.append({"losses": losses, "plan": pmodel.plan.to_json(),
                    "param_dtypes": sorted({str(p.dtype) for p in pmodel.parameters()}),
                    "grad_dtypes": sorted({str(p.grad.dtype) for p in pmodel.parameters() if p.grad is not None}),
                    "emitted": Counter((c["kind"], c["phase"]) for c in emitted_collectives(pmodel.gm)),
                    "wire": _gradient_wire_dtypes(pmodel.gm)})
    return out


# ---------------------------------------------------------------- the policy

def test_policy_values():
    assert as_policy(None) is None
    assert as_policy("bf16") == MixedPrecision(torch.bfloat16, torch.float32)
    assert as_policy(torch.bfloat16) == as_policy("bfloat16") == MixedPrecision()
    assert as_policy(BF16_REDUCE) is BF16_REDUCE
    for bad in ("fp8", torch.int32, torch.float16, 16):
        with pytest.raises(InputError, match="accepted: \"bf16\""):
            as_policy(bad)
    with pytest.raises(InputError, match="accepted: torch.bfloat16"):
        MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(InputError, match="accepted: torch.float32, torch.bfloat16"):
        MixedPrecision(reduce_dtype=torch.long)
    assert MixedPrecision.from_json(BF16_REDUCE.to_json()) == BF16_REDUCE


def test_plan_refuses_a_bad_policy():
    case = models.tiny_gpt(batch=4, seq=8)
    for bad in ("fp8", torch.int64):
        with pytest.raises(InputError, match="mixed_precision=.* is not supported; accepted"):
            autopar.plan(case.model, case.example_inputs, mesh=autopar.Mesh((2,)), mixed_precision=bad)


# ---------------------------------------------------------------- capture: the graph is the autocast step

def _gpt5(batch: int, seq: int):
    return models.tiny_gpt(n_layer=5, batch=batch, seq=seq)  # 5 alike layers: traced 3 deep, stamped


@pytest.mark.parametrize("factory", [models.tiny_gpt, models.tiny_llama, _gpt5])
def test_captured_step_equals_eager_autocast(factory):
    from autopar.capture.trace import capture
    case = factory(batch=2, seq=8)
    model = copy.deepcopy(case.model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _loss(model(*case.args, **case.kwargs))
    ref.backward()
    captured = capture(case.model, case.args, example_kwargs=case.kwargs, mixed_precision=as_policy("bf16"))
    tensors = {**dict(case.model.named_parameters()), **dict(case.model.named_buffers())}
    flat = [tensors[n].detach() for n in captured.param_names + captured.buffer_names]
    flat += list(case.args) + list(case.kwargs.values())
    loss, *grads = captured.gm(*flat)
    torch.testing.assert_close(loss, ref.detach(), rtol=0, atol=1e-6)
    ref_grads = dict(model.named_parameters())
    for name, g in zip(captured.grad_param_names, grads):
        assert g.dtype == torch.float32, name  # gradients of the fp32 master weights are fp32
        want = ref_grads[name].grad
        # decomposed bf16 pointwise ops (e.g. SiLU) round once more than eager's fused kernels, and on
        # a CPU with AVX512-BF16 eager's bf16 matmuls (oneDNN's native dot products) accumulate in
        # another order than the captured graph's: up to 1.3 bf16 ulps of the largest gradient entry
        # measured (tiny_llama's gate_proj; ~1 ulp on CPUs without it), so two ulps are allowed
        torch.testing.assert_close(g, want, rtol=0, atol=2 ** -6 * float(want.abs().max()) + 1e-8, msg=name)
    mm_dtypes = {str(n.meta["val"].dtype) for n in captured.gm.graph.nodes
                 if n.op == "call_function" and n.target is torch.ops.aten.mm.default}
    assert mm_dtypes == {"torch.bfloat16"}
    assert all(captured.param_dtypes[n] == torch.float32 for n in captured.param_names)
    assert bool(captured.stamped) == (factory is _gpt5)


# ---------------------------------------------------------------- the plan: bytes in the dtype that moves

@pytest.fixture(scope="module")
def gpt_plans():
    case = models.tiny_gpt(batch=4, seq=16)
    mesh = autopar.Mesh((2,))
    kw = dict(mesh=mesh, strategy="dp", baselines=False)
    return {mp: autopar.plan(case.model, case.example_inputs, mixed_precision=mp, **kw)
            for mp in (None, "bf16", BF16_REDUCE)}


def test_bf16_activations_about_half_master_state_unchanged(gpt_plans):
    fp32, bf16 = gpt_plans[None].memory_breakdown, gpt_plans["bf16"].memory_breakdown
    for cat in ("params", "grads", "optimizer"):  # fp32 master weights, fp32 gradients, fp32 AdamW state
        assert bf16[cat] == fp32[cat], cat
    ratio = bf16["activations"] / fp32["activations"]
    # not exactly 1/2: autocast keeps the residual stream (layer-norm inputs) and log-softmax in fp32
    assert 0.45 < ratio < 0.65, ratio


def test_reduce_dtype_sets_gradient_bytes(gpt_plans):
    def grads(plan):
        return [(c.source, c.kind, c.bytes) for c in plan.collectives if c.reason == "gradient"]
    fp32, bf16, wire16 = grads(gpt_plans[None]), grads(gpt_plans["bf16"]), grads(gpt_plans[BF16_REDUCE])
    assert fp32 and fp32 == bf16  # reduce_dtype fp32 (the default): the gradient moves 4 bytes/element
    assert [(s, k, b / 2) for s, k, b in fp32] == wire16
    assert all(c.kind in ("all_reduce", "reduce_scatter") for c in gpt_plans[BF16_REDUCE].collectives
               if c.reason == "gradient")
    assert gpt_plans[BF16_REDUCE].predicted_comm_time < gpt_plans["bf16"].predicted_comm_time


def test_plan_records_policy_and_json_round_trips(gpt_plans):
    plan = gpt_plans[BF16_REDUCE]
    assert plan.mixed_precision == {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}
    again = autopar.Plan.from_json(plan.to_json())
    assert again.mixed_precision == plan.mixed_precision
    assert MixedPrecision.from_json(again.mixed_precision) == BF16_REDUCE
    assert autopar.Plan.from_json(gpt_plans[None].to_json()).mixed_precision is None
    text = str(plan)
    assert "precision bfloat16 compute (autocast), fp32 master weights" in text
    assert "bfloat16 gradient reduction" in text
    assert "precision" not in str(gpt_plans[None]).split("feasible")[0]


def test_reused_plan_brings_its_policy(gpt_plans):
    """autoparallelize(plan=...) captures with the plan's policy; a contradicting value is refused."""
    from autopar.capture.precision import resolve_with_plan
    assert resolve_with_plan(None, gpt_plans[BF16_REDUCE]) == BF16_REDUCE
    assert resolve_with_plan(None, gpt_plans[None]) is None
    assert resolve_with_plan("bf16", gpt_plans["bf16"]) == MixedPrecision()
    with pytest.raises(InputError, match="contradicts the plan"):
        resolve_with_plan("bf16", gpt_plans[None])
    with pytest.raises(InputError, match="contradicts the plan"):
        resolve_with_plan("bf16", gpt_plans[BF16_REDUCE])


def test_bf16_plan_prices_matmuls_at_the_bf16_peak():
    """The "a100" preset's bf16 peak is 16x its fp32 peak: the bf16 plan's compute time drops."""
    case = models.meta_gpt(n_layer=2, n_embd=1024, n_head=16, batch=8, seq=512)
    kw = dict(mesh=autopar.Mesh((2,), hardware="a100"), strategy="dp", baselines=False)
    fp32 = autopar.plan(case.model, case.example_inputs, **kw)
    bf16 = autopar.plan(case.model, case.example_inputs, mixed_precision="bf16", **kw)
    assert bf16.predicted_compute_time < 0.5 * fp32.predicted_compute_time


# ---------------------------------------------------------------- training: world 2 and 4

MODELS = {"gpt": lambda: models.tiny_gpt(batch=4, seq=16), "llama": lambda: models.tiny_llama(batch=4, seq=16)}


@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_training_matches_single_process_autocast(name):
    case = MODELS[name]()
    batches = _batches(case)
    ref = train_reference(case.model, batches, STEPS, lr=LR, autocast=True)[0]
    ref_fp32 = train_reference(case.model, batches, STEPS, lr=LR)[0]
    kws = [dict(strategy="dp", mixed_precision="bf16"), dict(strategy="tp", mixed_precision="bf16"),
           dict(strategy="zero3", mixed_precision=BF16_REDUCE)]
    results = run_distributed(train_bf16, 2, case.model, batches, STEPS, kws, timeout=900)
    _check(results, kws, ref, ref_fp32, name)


def test_bf16_training_world4_2d_mesh():
    case = MODELS["gpt"]()
    batches = _batches(case)
    ref = train_reference(case.model, batches, STEPS, lr=LR, autocast=True)[0]
    ref_fp32 = train_reference(case.model, batches, STEPS, lr=LR)[0]
    mesh = autopar.Mesh((2, 2), axis_names=("dp", "tp"))
    kws = [dict(mesh=mesh, strategy={"dp": "dp", "tp": "tp"}, mixed_precision=BF16_REDUCE)]
    results = run_distributed(train_bf16, 4, case.model, batches, STEPS, kws, timeout=900)
    _check(results, kws, ref, ref_fp32, "gpt world=4")


def _check(results, kws, ref, ref_fp32, label):
    assert abs(ref[0] - ref_fp32[0]) > 5 * FIRST_ATOL, f"{label}: the first autocast and fp32 losses are too close"
    for i, kw in enumerate(kws):
        what = f"{label} {kw}"
        batch_split = set(recipes_of(kw)) <= {"dp", "zero3"}
        for rank_results in results:
            got = rank_results[i]
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref), rtol=0, atol=LOSS_ATOL,
                                       msg=lambda m: f"{what}: {m}")
            if batch_split:
                assert abs(got["losses"][0] - ref[0]) <= FIRST_ATOL, (what, got["losses"][0], ref[0], ref_fp32[0])
            assert got["param_dtypes"] == got["grad_dtypes"] == ["torch.float32"], what
        got = results[0][i]
        plan = autopar.Plan.from_json(got["plan"])
        assert plan.mixed_precision["param_dtype"] == "bfloat16", what
        assert got["emitted"] == Counter((c.kind, c.phase) for c in plan.collectives), what
        wire = f"torch.{plan.mixed_precision['reduce_dtype']}"
        assert got["wire"] and set(got["wire"]) == {wire}, (what, got["wire"])


def recipes_of(kw: dict) -> list[str]:
    strategy = kw["strategy"]
    return list(strategy.values()) if isinstance(strategy, dict) else [strategy]
