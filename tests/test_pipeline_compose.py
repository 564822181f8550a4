"""Pipelined plans compose with the rest (autopar/pipeline/planning.py, runtime.py, passes/split_stages.py):
bf16 mixed precision, solver-chosen and forced activation recompute, sequence parallelism and ZeRO-3
inside the stages, meta-device models built per stage. Planning checks on one process; numerics at
world 4 (3 AdamW steps) against one process, in one spawn (`run_each`).

Tolerances: fp32 runs as tests/test_pipeline.py (rtol 1e-4, atol 1e-5). bf16 runs as
tests/test_mixed_precision.py, against the single-process `torch.autocast("cpu", torch.bfloat16)` run:
every loss within half a bf16 ulp (0.015); a plan that splits only the batch (pp x dp) computes each
micro-batch's forward as the reference computes those rows, so its first loss equals the autocast one
within fp32 summation order (2e-6), which the fp32 loss is not (checked to be > 1e-5 away).
"""
from __future__ import annotations

import copy
import warnings
from collections import Counter

import pytest
import torch

import autopar
from autopar._testing import models
from autopar._testing.dist_cases import EPS, assert_each, run_each, train_reference, train_steps
from autopar._testing.dist_utils import run_distributed
from autopar._testing.gpt import GPT, GPTConfig
from autopar.errors import InfeasiblePlanError

STEPS = 3
LR_BF16 = 3e-3      # the loss must move within 3 steps for bf16 rounding to show
LOSS_ATOL = 0.015   # half a bf16 ulp of a loss in [2, 8)
FIRST_ATOL = 2e-6   # step 0 of a batch-split bf16 plan: fp32 summation order only
PP_DP = autopar.Mesh((2, 2), axis_names=("pp", "dp"))
PP_TP = autopar.Mesh((2, 2), axis_names=("pp", "tp"))
PP_EP = autopar.Mesh((2, 2), axis_names=("pp", "ep"))


def _plan(case, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(case.model, case.args, baselines=False, **kw)


def _norm_specs(plan) -> list:
    return sorted(c.outs[0] for n, c in plan.nodes.items() if n.startswith("native_layer_norm") and c.phase == "forward")


# ---------------------------------------------------------------- one process: the plans

def test_bf16_pipelined_plan_records_policy_and_halves_activations():
    case = models.tiny_gpt(n_layer=4, batch=8, seq=16)
    fp32 = _plan(case, mesh=PP_DP, strategy="dp")
    reduce16 = autopar.MixedPrecision(reduce_dtype=torch.bfloat16)
    bf16 = _plan(case, mesh=PP_DP, strategy="dp", mixed_precision=reduce16)
    assert bf16.mixed_precision == {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}
    assert autopar.Plan.from_json(bf16.to_json()).mixed_precision == bf16.mixed_precision
    assert bf16.stages and bf16.schedule == fp32.schedule
    ratio = bf16.memory_breakdown["activations"] / fp32.memory_breakdown["activations"]
    assert 0.4 < ratio < 0.7, ratio
    grads = lambda p: sorted((c.source, c.bytes) for c in p.collectives if c.reason == "gradient")  # noqa: E731
    assert [(s, b / 2) for s, b in grads(fp32)] == grads(bf16)   # reduce_dtype bf16: half the gradient bytes


def test_recompute_in_pipelined_plans():
    """Forced recompute ("all", a list) is in the plan and its unit costs; under a budget that the plan
    without recompute exceeds, "auto" (the default) recomputes some layers and fits; "none" refuses."""
    case = models.tiny_gpt(n_layer=4, batch=8, seq=16)
    kw = dict(mesh=autopar.Mesh((2,)), num_stages=2)
    free = _plan(case, **kw)
    every = _plan(case, recompute="all", **kw)
    some = _plan(case, recompute=["transformer.h.1"], **kw)
    assert free.recompute == () and every.recompute == ("transformer.h.0", "transformer.h.1", "transformer.h.2")
    assert some.recompute == ("transformer.h.1",)
    assert every.memory_per_device < some.memory_per_device < free.memory_per_device
    assert every.predicted_step_time > free.predicted_step_time   # the re-run forward costs time
    assert sum(s.memory for s in every.stages) < sum(s.memory for s in free.stages)
    budget = (free.memory_per_device + every.memory_per_device) / 2
    auto = _plan(case, memory_budget=budget, **kw)
    assert auto.feasible and auto.recompute and len(auto.recompute) < 3
    assert auto.memory_per_device <= budget < free.memory_per_device
    assert auto.predicted_step_time < every.predicted_step_time
    assert autopar.Plan.from_json(auto.to_json()).recompute == auto.recompute
    with pytest.raises(InfeasiblePlanError, match="pipeline stages fits the memory budget"):
        _plan(case, memory_budget=budget, recompute="none", **kw)


def test_pipelined_recompute_is_only_what_the_split_needs():
    """GPipe keeps m micro-batches on both stages: under a budget between no recompute and all, each stage
    recomputes, and no chosen layer could be left out (without it the plan no longer fits)."""
    case = models.tiny_gpt(n_layer=4, batch=8, seq=16)
    kw = dict(mesh=autopar.Mesh((2,)), num_stages=2, schedule="gpipe", num_microbatches=4)
    free, every = _plan(case, **kw), _plan(case, recompute="all", **kw)
    budget = (free.memory_per_device + every.memory_per_device) / 2
    auto = _plan(case, memory_budget=budget, **kw)
    assert auto.feasible and auto.memory_per_device <= budget
    assert all(set(auto.recompute) & set(st.modules) for st in auto.stages), auto.recompute
    for path in auto.recompute:
        fewer = [p for p in auto.recompute if p != path]
        assert _plan(case, recompute=fewer or "none", **kw).memory_per_device > budget, path


def _saved_bytes_per_stage(case, plan) -> list[int]:
    """Bytes each stage's forward program keeps for its backward (one micro-batch), run on one process:
    the pipelined runtime's programs (`run_passes`, then `split_stages`) for a plan on a (2,) mesh."""
    from autopar.capture.canonicalize import canonicalize
    from autopar.capture.trace import capture
    from autopar.passes import PassContext, run_passes
    from autopar.passes.split_stages import split_stages
    from autopar.pipeline import planning as pp
    micro = pp.microbatch(case.args, plan.num_microbatches)
    cap = capture(case.model, micro)
    canonicalize(cap.gm)
    ctx = PassContext(pp.stage_plan(plan), (1,), coords=(0,), group_names=("g",),
                      grad_names=tuple(cap.grad_param_names))
    units = [list(s.modules) for s in plan.stages]
    programs = split_stages(run_passes(cap.gm, ctx), units, [u for s in units for u in s],
                            list(cap.grad_param_names))
    tensors = {**dict(case.model.named_parameters()), **dict(case.model.named_buffers())}
    env = {("input", n.name): x for n, x in zip(cap.placeholders("input"), micro)}
    out = []
    for prog in programs:
        res = prog.forward(*[tensors[k[1]].detach() if k[0] in ("param", "buffer") else env[k]
                             for k in prog.forward_args])
        sent = 1 if prog.index == len(programs) - 1 else len(prog.outputs)
        out.append(sum(t.numel() * t.element_size() for t in res[sent:]))
        env = {("input", name): v for name, v in zip(prog.outputs, res[:sent])}
    return out


def test_stage_programs_keep_what_the_unit_costs_predict():
    """Recompute shrinks what each stage's forward keeps for backward as its unit costs say: the
    activation bytes `layer_costs` gives each stage's units (with the plan's recompute) are within
    25% of what the stage programs keep, with and without recompute (measured 0.8-1.09x)."""
    from autopar.capture.canonicalize import canonicalize
    from autopar.capture.trace import capture
    from autopar.pipeline import planning as pp
    from autopar.pipeline.layer_profile import layer_costs
    from autopar.planning.problem import ProblemBuilder
    from autopar.planning.solver import solve
    case = models.tiny_gpt(n_layer=4, batch=8, seq=16)
    kw = dict(mesh=autopar.Mesh((2,)), num_stages=2)
    cap = capture(case.model, pp.microbatch(case.args, 2))
    canonicalize(cap.gm)
    prob = ProblemBuilder(cap, autopar.Mesh((1,), ("dp",))).build()
    choice = solve(prob.cg).choice   # one device per stage: the only placement
    measured = {}
    for rc in ("none", "all"):
        plan = _plan(case, recompute=rc, **kw)
        kept = _saved_bytes_per_stage(case, plan)
        act = {c.name: c.activation_bytes for c in layer_costs(prob, choice, cap, recompute=plan.recompute)}
        for stage, got in zip(plan.stages, kept):
            want = sum(act[u] for u in stage.modules)
            assert 0.75 * want <= got <= 1.25 * want, (rc, stage.modules, got, want)
        measured[rc] = kept
    assert all(a < b for a, b in zip(measured["all"], measured["none"])), measured


def test_a_tied_embedding_is_priced_on_every_stage_holding_it():
    """A tied embedding is read by the first and the last unit; the runtime holds, steps, ZeRO-gathers and
    reduces a copy on each device holding one of them. Its unit costs list it at both (`LayerCost.shared`),
    and the last stage of a split adds that copy's state and per-step seconds once; untied, nothing is shared.
    Two chunks per device: in a loop (interleaved zero bubble, chunk 3 on device 1) device 1 adds the copy; in a
    V (chunks 0 and 3 on device 0, which holds the first reader) no device does (`stages._Shared.excess`)."""
    import dataclasses

    from autopar.capture.canonicalize import canonicalize
    from autopar.capture.trace import capture
    from autopar.pipeline import planning as pp
    from autopar.pipeline.layer_profile import layer_costs
    from autopar.pipeline.stages import chunk_memory, partition, priced_split
    from autopar.planning import spmd as planner
    from autopar.planning.problem import ProblemBuilder
    from autopar.sharding import recipes
    sub = autopar.Mesh((2,), axis_names=("dp",))
    for tie in (True, False):
        case = models.tiny_gpt(n_layer=4, batch=8, seq=16, tie_weights=tie)
        cap = capture(case.model, pp.microbatch(case.args, 2))
        canonicalize(cap.gm)
        prob = ProblemBuilder(cap, sub).build()
        sol, _ = planner.solve_requested(prob, cap, sub, recipes.normalize("zero2", sub), {}, 10)
        layers = layer_costs(prob, sol.choice, cap)
        shared = [x for x in layers if x.shared]
        if not tie:
            assert not shared
            continue
        assert [x.name for x in shared] == ["<pre>", "<post>"] and shared[0].shared == shared[1].shared
        (_, state, seconds), = shared[0].shared
        assert state > 0 and seconds > 0   # master shard + gathered copy + gradient + AdamW; gather + update
        plain = [dataclasses.replace(x, shared=()) for x in layers]
        got, without = (partition(ls, 2, 2, "1f1b", p2p_time=lambda b: 0.0) for ls in (layers, plain))
        assert got.bounds == without.bounds
        assert got.stage_memory[0] == without.stage_memory[0]
        assert got.stage_memory[1] == pytest.approx(without.stage_memory[1] + state, rel=1e-12)
        assert got.step_time > without.step_time
        bounds = (0, 2, 3, 4)   # <pre> h.0 | h.1 | h.2 | h.3 <post>
        for schedule, device, copies in (("interleaved_zero_bubble", 1, 1), ("zero_bubble_v", 0, 0)):
            got, without = (priced_split(ls, bounds, 2, 4, schedule, p2p_time=lambda b: 0.0, v=2)
                            for ls in (layers, plain))
            assert got.stage_memory[1 - device] == pytest.approx(without.stage_memory[1 - device], rel=1e-12)
            assert got.stage_memory[device] == pytest.approx(without.stage_memory[device] + copies * state, rel=1e-12)
            assert (got.step_time > without.step_time) == bool(copies), schedule
            chunks = chunk_memory(layers, bounds, schedule, 2, 4, 2)   # the plan's stages: the split's devices
            on = (0, 3) if schedule == "zero_bubble_v" else (0, 2)
            assert chunks[on[0]] + chunks[on[1]] == pytest.approx(got.stage_memory[0], rel=1e-12)


def _sp_case():
    """Batch 2 of 32 tokens, width 64: under a budget 5% below the plan without one, the 2-way tensor-
    parallel stages fit by running every layer norm on sequence shards (no recompute needed)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=64))
    batches = []
    for seed in range(STEPS):
        gen = torch.Generator().manual_seed(300 + seed)
        ids = torch.randint(0, 64, (2, 32), generator=gen)
        batches.append(((ids, torch.randint(0, 64, (2, 32), generator=gen)), {}))
    return models.Case(model, batches[0][0]), batches


def _sp_plan(case):
    kw = dict(mesh=PP_TP, strategy="tp", mixed_precision="bf16", num_microbatches=2)
    free = _plan(case, **kw)
    plan = _plan(case, memory_budget=0.95 * free.memory_per_device, **kw)
    assert set(_norm_specs(free)) == {("R", "R")}
    return free, plan


def test_budget_puts_pipelined_tensor_parallel_stages_on_sequence_shards():
    free, plan = _sp_plan(_sp_case()[0])
    assert plan.feasible and not plan.recompute
    assert set(_norm_specs(plan)) == {("R", "S1")}   # every norm: replicated on pp, sequence-split on tp
    assert plan.memory_per_device < free.memory_per_device
    kinds = {(c.kind, c.phase) for c in plan.collectives if c.module.startswith("transformer.h.")}
    assert {("reduce_scatter", "forward"), ("all_gather", "forward")} <= kinds


# ---------------------------------------------------------------- world 4: equal to one process

def train_job(rank, world, model, batches, kw, lr=1e-3):
    """autoparallelize (pipelined) + AdamW, `STEPS` steps: what the checks compare."""
    from autopar import autoparallelize
    from autopar.passes import emitted_collectives
    args, kwargs = batches[0]
    example = tuple(args) + ((kwargs,) if kwargs else ())   # a trailing dict: keyword inputs (labels)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pmodel = autoparallelize(copy.deepcopy(model), example, verify=True, baselines=False, **kw)
    losses, _ = train_steps(pmodel, batches, STEPS, lr=lr)
    progs = [st.program for st in pmodel._stages]
    graphs = [gm for prog in progs for gm in (prog.forward, prog.backward, prog.gather) if gm is not None]
    ran = Counter()   # the logical collectives this rank's programs ran in the last step (runs x emitted)
    for st in pmodel._stages:
        for which, times in st.runs.items():
            for c in emitted_collectives(getattr(st.program, which)):
                ran[(c["kind"], c["phase"], c["reason"], c["source"])] += times
    return {"losses": losses, "state": pmodel.full_state_dict(), "plan": pmodel.plan.to_json(),
            "mm_dtypes": sorted({str(n.meta["val"].dtype) for gm in graphs for n in gm.graph.nodes
                                 if n.op == "call_function" and n.target is torch.ops.aten.mm.default}),
            "dtypes": sorted({str(t.dtype) for p in pmodel.parameters() for t in (p, p.grad) if t is not None}),
            "recomputed": sorted({n.meta["autopar_recompute_layer"] for prog in progs for n in prog.backward.graph.nodes
                                  if n.meta.get("autopar_pass") == "recompute"}),
            "emitted": [(c["kind"], c["phase"], c["reason"], c["source"]) for gm in graphs
                        for c in emitted_collectives(gm)],
            "ran": ran, "runs": [dict(st.runs) for st in pmodel._stages],
            "gather_emitted": [(c["kind"], c["phase"], c["reason"], c["source"]) for prog in progs
                               if prog.gather is not None for c in emitted_collectives(prog.gather)],
            "deferred": sorted({(d["param"], d["kind"], d["phase"], d["dtype"]) for prog in progs
                                for d in prog.deferred})}


def meta_job(rank, world, config, batches, kw):
    """A meta-device GPT, pipelined: which parameters this rank gave storage to (`init_fn` sees each
    module with real tensors), its own, the initial and the trained weights."""
    from autopar import autoparallelize
    with torch.device("meta"):
        model = GPT(config)
    path = {id(m): prefix for prefix, m in model.named_modules()}
    built = []

    def init(module):
        built.extend(f"{path[id(module)]}.{n}".lstrip(".") for n, p in module.named_parameters(recurse=False)
                     if not p.is_meta)
        GPT._init_weights(module)

    torch.manual_seed(rank)   # each rank its own seed: the runtime shares rank 0's, so tied copies agree
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pmodel = autoparallelize(model, batches[0][0], init_fn=init, baselines=False, **kw)
    assert all(p.is_meta for p in model.parameters()), "the user's model must stay on meta"
    initial = pmodel.full_state_dict()
    losses, _ = train_steps(pmodel, batches, STEPS)
    return {"built": sorted(built), "owned": sorted(n for n, _ in pmodel.named_parameters()), "initial": initial,
            "losses": losses, "state": pmodel.full_state_dict(), "plan": pmodel.plan.to_json()}


def resume_job(rank, world, model, batches, kw, folder):
    """Trains `STEPS` steps, saving model and AdamW state through torch.distributed.checkpoint after the
    first; then a module of other weights, made from the saved plan, loads it and trains the rest."""
    import torch.distributed.checkpoint as dcp

    from autopar import autoparallelize
    from autopar._testing.dist_cases import scramble
    from autopar.runtime import checkpoint

    def state(pmodel, opt):
        return {"model": pmodel.state_dict(), "optim": checkpoint.optimizer_state_dict(pmodel, opt)}

    def step(pmodel, opt, k):
        opt.zero_grad()
        loss = pmodel.train_step(*batches[k][0]).item()
        opt.step()
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pmodel = autoparallelize(copy.deepcopy(model), batches[0][0], baselines=False, **kw)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=LR_BF16, eps=EPS)
    losses = [step(pmodel, opt, 0)]
    dcp.save(state(pmodel, opt), checkpoint_id=folder)
    losses += [step(pmodel, opt, k) for k in range(1, STEPS)]
    other = copy.deepcopy(model)
    scramble(other)
    again = autoparallelize(other, batches[0][0], plan=pmodel.plan, mesh=kw["mesh"], baselines=False)
    opt2 = torch.optim.AdamW(again.parameters(), lr=LR_BF16, eps=EPS)
    saved = state(again, opt2)
    dcp.load(saved, checkpoint_id=folder)
    again.load_state_dict(saved["model"])
    checkpoint.load_optimizer_state_dict(again, opt2, saved["optim"])
    resumed = [step(again, opt2, k) for k in range(1, STEPS)]
    return {"losses": losses, "resumed": resumed, "state": pmodel.full_state_dict(),
            "resumed_state": again.full_state_dict(), "plan": pmodel.plan.to_json()}


def _equal_fp32(per_rank, model, batches):
    ref_losses, ref_state = train_reference(model, batches, STEPS)
    for rank, got in enumerate(per_rank):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"rank {rank} losses: {m}")
    for key, want in ref_state.items():
        torch.testing.assert_close(per_rank[0]["state"][key], want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")


def _equal_autocast(per_rank, model, batches, batch_split: bool):
    ref = train_reference(model, batches, STEPS, lr=LR_BF16, autocast=True)[0]
    fp32 = train_reference(model, batches, STEPS, lr=LR_BF16)[0]
    assert abs(ref[0] - fp32[0]) > 5 * FIRST_ATOL, "the first autocast and fp32 losses are too close to tell"
    for rank, got in enumerate(per_rank):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref), rtol=0, atol=LOSS_ATOL,
                                   msg=lambda m: f"rank {rank}: {m}")
        if batch_split:
            assert abs(got["losses"][0] - ref[0]) <= FIRST_ATOL, (rank, got["losses"][0], ref[0], fp32[0])
        assert got["mm_dtypes"] == ["torch.bfloat16"] and got["dtypes"] == ["torch.float32"], rank
    assert autopar.Plan.from_json(per_rank[0]["plan"]).mixed_precision["param_dtype"] == "bfloat16"


def _collectives_as_planned(per_rank):
    """Ranks 0 and 2 (one per pipeline rank, sub-mesh coordinate 0) ran the plan's collectives: the stage
    programs' (a tied gradient's reductions on each stage holding it count once) plus the deferred ones."""
    plan = autopar.Plan.from_json(per_rank[0]["plan"])
    ranks = [per_rank[0], per_rank[2]]
    emitted = [c for got in ranks for c in got["emitted"] if not _per_parameter(c)]
    emitted += sorted({c for got in ranks for c in got["emitted"] if _per_parameter(c)})
    deferred = {d for got in ranks for d in got["deferred"]}   # a tied parameter's: once
    got = Counter((c[0], c[1]) for c in emitted) + Counter((d[1], d[2]) for d in deferred)
    assert got == Counter((c.kind, c.phase) for c in plan.collectives), (got, plan.collectives)


def _per_parameter(c) -> bool:
    """A gradient's or a ZeRO-1/2 gather's collective: a tied parameter's runs on each stage holding it."""
    return c[2].startswith("gradient") or c[2] == "parameter gather (ZeRO-1/2)"


def _collectives_per_step(per_rank):
    """The collectives ranks 0 and 2 ran in their last step (program runs x each program's collectives,
    deferred all-reduces once) are the plan's, each as often per step as the cost model prices it:
    ZeRO-1/2 gathers and deferred gradient all-reduces once, the rest once per micro-batch (a tied
    parameter's collectives, which run on each stage holding it, count once: the most any rank ran)."""
    plan = autopar.Plan.from_json(per_rank[0]["plan"])
    m = plan.num_microbatches
    ran: Counter = Counter()
    for key in {k for got in (per_rank[0], per_rank[2]) for k in got["ran"]}:
        counts = [got["ran"].get(key, 0) for got in (per_rank[0], per_rank[2])]
        ran[key[:2]] += max(counts) if _per_parameter(key) else sum(counts)
    ran += Counter((d[1], d[2]) for d in {d for got in (per_rank[0], per_rank[2]) for d in got["deferred"]})
    once = lambda c: c.reason == "parameter gather (ZeRO-1/2)" or (  # noqa: E731
        c.kind == "all_reduce" and c.reason == "gradient")
    want = Counter()
    for c in plan.collectives:
        want[(c.kind, c.phase)] += 1 if once(c) else m
    assert ran == want, (ran, want)
    for got in per_rank:   # every program ran as the schedule says: gathers once, each micro-batch once
        assert all(r.get("forward") == m and r.get("backward") == m for r in got["runs"]), got["runs"]
    return want


def _check_bf16_dp(per_rank, model, batches):
    """reduce_dtype bf16: the once-per-step gradient all-reduces move bf16 (as the plan prices them)."""
    _equal_autocast(per_rank, model, batches, batch_split=True)
    _collectives_as_planned(per_rank)
    assert autopar.Plan.from_json(per_rank[0]["plan"]).mixed_precision["reduce_dtype"] == "bfloat16"
    wires = {d[3] for got in per_rank for d in got["deferred"]}
    assert wires == {"bfloat16"}, wires


def _check_bf16_sp(per_rank, model, batches, planned):
    _equal_autocast(per_rank, model, batches, batch_split=False)
    assert per_rank[0]["plan"] == planned.to_json() and set(_norm_specs(planned)) == {("R", "S1")}
    emitted = {(c[0], c[1]) for got in per_rank for c in got["emitted"]}
    assert {("reduce_scatter", "forward"), ("all_gather", "forward")} <= emitted   # onto / off sequence shards
    _collectives_as_planned(per_rank)


def _check_recompute(per_rank, model, batches, free, budget):
    _equal_fp32(per_rank, model, batches)
    plan = autopar.Plan.from_json(per_rank[0]["plan"])
    assert plan.recompute, "the solver recomputed nothing under the budget"
    assert plan.memory_per_device <= budget < free.memory_per_device
    ran = sorted({p for got in per_rank for p in got["recomputed"]})
    assert ran == sorted(plan.recompute), (ran, plan.recompute)   # the stage programs re-run exactly those
    _collectives_as_planned(per_rank)


def _searched_recompute_plan(case):
    """The plan the default search builds for pp2 x dp2, 2 micro-batches, 1F1B under 80% of the leaner of its
    budget-free plans' memory (the step's weighting's and least S + P's, which `candidates.price` tries before
    any row): no memory row's plan splits within it, so `candidates.price` prices the budget-free plan with
    full recompute (every layer but the last), then recomputes only the layers its stages need on that
    split (`candidates.fewest_recomputed`: two of the three), and `auto.pipelined_plan` builds exactly that."""
    from autopar.debug import PhaseTimer
    from autopar.pipeline.auto import pipelined_plan
    from autopar.pipeline.candidates import price
    from autopar.pipeline.search import Profiler
    from autopar.pipeline.stages import partition
    prof = Profiler(case.model, case.args, PP_DP.hardware, PP_DP.devices_per_node)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        [free] = price(prof, 2, 2, 1, 2, ("1f1b",), None)
        lean = partition(prof.layers(2, 2, 1, None), 2, 2, "1f1b", p2p_time=lambda nbytes: 0.0)
        budget = 0.8 * min(free.memory_per_device, max(lean.stage_memory))
        [searched] = price(prof, 2, 2, 1, 2, ("1f1b",), budget)
        plan = pipelined_plan(prof, searched, case.model, budget, PhaseTimer())
    every = {"transformer.h.0", "transformer.h.1", "transformer.h.2"}
    assert searched.feasible and searched.recompute and set(searched.recompute) < every
    assert plan.recompute == searched.recompute and plan.mesh == PP_DP and plan.memory_per_device <= budget
    return plan


def _check_searched_recompute(per_rank, model, batches, planned):
    """A plan the search found with recompute trains like one process, re-running exactly its layers."""
    _equal_fp32(per_rank, model, batches)
    assert per_rank[0]["plan"] == planned.to_json()
    ran = sorted({p for got in per_rank for p in got["recomputed"]})
    assert ran == sorted(planned.recompute), (ran, planned.recompute)
    _collectives_as_planned(per_rank)


def _check_interleaved(per_rank, model, batches):
    """Interleaved 1F1B (4 chunks, rank d holding chunks d and d+2) in bf16 with a forced recompute list."""
    _equal_autocast(per_rank, model, batches, batch_split=True)
    plan = autopar.Plan.from_json(per_rank[0]["plan"])
    assert plan.schedule == "interleaved_1f1b" and len(plan.stages) == 4
    ran = sorted({p for got in per_rank for p in got["recomputed"]})
    assert ran == sorted(plan.recompute) == ["transformer.h.0", "transformer.h.2"], ran
    _collectives_as_planned(per_rank)


def _check_zero3(per_rank, model, batches):
    _equal_fp32(per_rank, model, batches)
    plan = autopar.Plan.from_json(per_rank[0]["plan"])
    assert plan.recipes == ("pp", "zero3")
    sharded = [n for n, p in plan.params.items() if p.master[1].startswith("S")]
    assert len(sharded) >= len(plan.params) // 2, sharded   # master weights sharded over dp inside each stage
    assert ("all_gather", "forward") in {(c[0], c[1]) for c in per_rank[0]["emitted"]}
    _collectives_as_planned(per_rank)
    want = _collectives_per_step(per_rank)   # ZeRO-3 gathers: in every micro-batch's forward and backward
    assert want[("all_gather", "backward")] > 0 and not any(r.get("gather") for got in per_rank for r in got["runs"])


def _check_zero12(per_rank, model, batches, mode):
    """ZeRO-1/2 inside the stages: the gathered copies are made once per step by each stage's gather program
    (the forward and backward programs read them), as the plan prices them."""
    _equal_fp32(per_rank, model, batches)
    plan = autopar.Plan.from_json(per_rank[0]["plan"])
    assert plan.recipes == ("pp", mode)
    _collectives_as_planned(per_rank)
    want = _collectives_per_step(per_rank)
    gathers = sum(1 for c in plan.collectives if c.reason == "parameter gather (ZeRO-1/2)")
    assert gathers >= len(plan.params) // 2 and want[("all_gather", "forward")] == gathers, (gathers, want)
    for got in per_rank:
        assert all(r.get("gather") == 1 for r in got["runs"]), got["runs"]
        assert not [c for c in got["emitted"] if c[2] == "parameter gather (ZeRO-1/2)"
                    and c not in got["gather_emitted"]], "a micro-batch program gathers a ZeRO-1/2 parameter"


def _ep_plan(case):
    """pp2 x ep2: the tiny Mixtral's experts split by expert over the second axis (`force_experts("ep")`)."""
    from autopar.sharding.rules import moe
    with moe.force_experts("ep"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(case.model, case.example_inputs, mesh=PP_EP, baselines=False)


def _check_experts(per_rank, model, batches, planned):
    """Expert parallelism inside the stages: each stage's experts split by expert over "ep", tokens
    dispatched by all_to_all in every micro-batch's forward and backward, as the plan prices."""
    _equal_fp32(per_rank, model, batches)
    plan = autopar.Plan.from_json(per_rank[0]["plan"])
    assert per_rank[0]["plan"] == planned.to_json() and len(plan.stages) == 2
    experts = {n: p.master for n, p in plan.params.items() if ".experts." in n}
    assert experts and set(experts.values()) == {("R", "S0")}, experts
    assert {(c[0], c[1]) for got in per_rank for c in got["emitted"] if c[2].startswith("expert dispatch")} == {
        ("all_to_all", "forward"), ("all_to_all", "backward")}
    _collectives_as_planned(per_rank)
    _collectives_per_step(per_rank)


def _check_meta(per_rank, config, batches):
    """Each rank built exactly the parameters of its own stage's modules (a tied weight under both of its
    names, on both stages), the ranks of one stage the same ones, and training from the weights they
    built equals one process from the same weights."""
    everything = {n for n, _ in GPT(config).named_parameters(remove_duplicate=False)}
    tied = {"lm_head.weight": "transformer.wte.weight"}
    for rank, got in enumerate(per_rank):
        built = {tied.get(n, n) for n in got["built"]}
        assert built == {tied.get(n, n) for n in got["owned"]}, (rank, built ^ set(got["owned"]))
        assert built < {tied.get(n, n) for n in everything}, rank
    assert per_rank[0]["built"] == per_rank[1]["built"] and per_rank[2]["built"] == per_rank[3]["built"]
    assert set(per_rank[0]["owned"]) != set(per_rank[2]["owned"])
    assert set(per_rank[0]["built"]) | set(per_rank[2]["built"]) == everything
    model = GPT(config)
    model.load_state_dict(per_rank[0]["initial"])
    assert all(torch.isfinite(v).all() for v in per_rank[0]["initial"].values())
    _equal_fp32(per_rank, model, batches)


def _check_resume(per_rank, model, batches):
    """The resumed run equals the uninterrupted one (same programs on the same ranks: to fp32 rounding of
    the optimizer state's round trip), and both equal one autocast process."""
    plan = autopar.Plan.from_json(per_rank[0]["plan"])
    assert plan.recompute == ("transformer.h.1",) and plan.recipes == ("pp", "zero3") and plan.mixed_precision
    for rank, got in enumerate(per_rank):
        torch.testing.assert_close(torch.tensor(got["resumed"]), torch.tensor(got["losses"][1:]), rtol=1e-6,
                                   atol=1e-7, msg=lambda m: f"rank {rank}: {m}")
    for key, want in per_rank[0]["state"].items():
        torch.testing.assert_close(per_rank[0]["resumed_state"][key], want, rtol=1e-6, atol=1e-7, msg=key)
    ref = train_reference(model, batches, STEPS, lr=LR_BF16, autocast=True)[0]
    torch.testing.assert_close(torch.tensor(per_rank[0]["losses"]), torch.tensor(ref), rtol=0, atol=LOSS_ATOL)


def test_pipelines_compose_at_world_4(tmp_path):
    """pp2 x dp2 in bf16 (bf16 gradient reduction); pp2 x tp2 in bf16 with sequence parallelism; pp2 x dp2 with recompute chosen by
    the solver under a budget; pp2 x dp2 with ZeRO-3 inside the stages; pp2 x dp2 of a meta-built model;
    ZeRO-3 + bf16 + a forced recompute list, saved and resumed through torch.distributed.checkpoint;
    interleaved 1F1B in bf16 with a forced recompute list; the full-recompute plan the search builds."""
    gpt = models.tiny_gpt(n_layer=4, batch=8, seq=16)
    batches = models.zoo_batches(gpt, STEPS)
    sp_case, sp_batches = _sp_case()
    _, sp_plan = _sp_plan(sp_case)
    free = _plan(gpt, mesh=PP_DP, strategy="dp")
    every = _plan(gpt, mesh=PP_DP, strategy="dp", recompute="all")
    budget = (free.memory_per_device + every.memory_per_device) / 2
    searched = _searched_recompute_plan(gpt)
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    reduce16 = autopar.MixedPrecision(reduce_dtype=torch.bfloat16)
    jobs = [(train_job, gpt.model, batches, dict(mesh=PP_DP, strategy="dp", mixed_precision=reduce16), LR_BF16),
            (train_job, sp_case.model, sp_batches, dict(mesh=PP_TP, plan=sp_plan), LR_BF16),
            (train_job, gpt.model, batches, dict(mesh=PP_DP, strategy="dp", memory_budget=budget)),
            (train_job, gpt.model, batches, dict(mesh=PP_DP, strategy={"dp": "zero3"})),
            (meta_job, config, [((a[0], a[1]), {}) for a, _ in batches], dict(mesh=PP_DP, strategy="dp")),
            (resume_job, gpt.model, batches, dict(mesh=PP_DP, strategy={"dp": "zero3"}, mixed_precision="bf16",
                                                  recompute=["transformer.h.1"]), str(tmp_path / "ckpt")),
            (train_job, gpt.model, batches, dict(mesh=PP_DP, strategy="dp", schedule="interleaved_1f1b",
                                                 num_microbatches=4, mixed_precision="bf16",
                                                 recompute=["transformer.h.0", "transformer.h.2"]), LR_BF16),
            (train_job, gpt.model, batches, dict(mesh=PP_DP, plan=searched))]
    results = run_distributed(run_each, 4, jobs, timeout=1200)
    assert_each(results, [(0, "pp2 x dp2 bf16", _check_bf16_dp, gpt.model, batches),
                          (1, "pp2 x tp2 bf16 + sequence parallel", _check_bf16_sp, sp_case.model, sp_batches,
                           sp_plan),
                          (2, "pp2 x dp2 recompute under a budget", _check_recompute, gpt.model, batches, free,
                           budget),
                          (3, "pp2 x dp2 zero3", _check_zero3, gpt.model, batches),
                          (4, "pp2 x dp2 meta", _check_meta, config, [((a[0], a[1]), {}) for a, _ in batches]),
                          (5, "pp2 x dp2 zero3 bf16 recompute, resumed", _check_resume, gpt.model, batches),
                          (6, "pp2 x dp2 interleaved bf16 recompute", _check_interleaved, gpt.model, batches),
                          (7, "pp2 x dp2 full recompute found by the search", _check_searched_recompute, gpt.model,
                           batches, searched)])


def test_zero_and_experts_in_stages_at_world_4():
    """pp2 x dp2 with ZeRO-1 and ZeRO-2 inside the stages, and a tiny Mixtral pp2 x ep2 (experts split by
    expert inside each stage): equal to one process over 3 AdamW steps, and the collectives each rank ran
    per step are the plan's as priced (a ZeRO-1/2 gather once per step, not per micro-batch)."""
    gpt = models.tiny_gpt(n_layer=4, batch=8, seq=16)
    batches = models.zoo_batches(gpt, STEPS)
    moe = models.ZOO_CASES["mixtral"]()
    moe_batches = models.zoo_batches(moe, STEPS)
    ep_plan = _ep_plan(moe)
    jobs = [(train_job, gpt.model, batches, dict(mesh=PP_DP, strategy={"dp": mode})) for mode in ("zero1", "zero2")]
    jobs.append((train_job, moe.model, moe_batches, dict(mesh=PP_EP, plan=ep_plan)))
    results = run_distributed(run_each, 4, jobs, timeout=900)
    assert_each(results, [(0, "pp2 x dp2 zero1", _check_zero12, gpt.model, batches, "zero1"),
                          (1, "pp2 x dp2 zero2", _check_zero12, gpt.model, batches, "zero2"),
                          (2, "pp2 x ep2 mixtral", _check_experts, moe.model, moe_batches, ep_plan)])
