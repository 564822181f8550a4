"""Pipelined plans (autopar/pipeline/planning.py, passes/split_stages.py, autopar/pipeline/runtime.py):
the stage split alone on one process, and pipelined training under gloo equal to one process."""
from __future__ import annotations

import copy
import dataclasses
from collections import Counter

import pytest
import torch

import autopar
from autopar._testing import models
from autopar._testing.dist_cases import train_reference, train_steps
from autopar._testing.dist_utils import run_distributed
from autopar.costmodel.hardware import get_hardware
from autopar.pipeline.stages import INTERLEAVED, chunk_device, chunks_per_device

STEPS = 3


def train_pipelined(rank, world, model, batches, steps, kws):
    """autoparallelize (pipelined) + AdamW for `steps` steps, once per option set in `kws`."""
    from autopar import autoparallelize
    from autopar.passes import emitted_collectives
    out = []
    for kw in kws:
        args, kwargs = batches[0]
        example = tuple(args) + ((kwargs,) if kwargs else ())
        pmodel = autoparallelize(copy.deepcopy(model), example, verify=True, baselines=False, **kw)
        losses, _ = train_steps(pmodel, batches, steps)
        runs = dict(sum((st.runs for st in pmodel._stages), Counter()))   # the last step's programs
        args, kwargs = batches[0]
        progs = [st.program for st in pmodel._stages]   # this rank's chunks
        emitted = [(which, c["kind"], c["phase"], c["reason"], c["source"]) for prog in progs
                   for which, gm in (("forward", prog.forward), ("backward", prog.backward))
                   for c in emitted_collectives(gm)]
        deferred = sorted({(d["param"], d["kind"], d["axis"], d["phase"]) for prog in progs for d in prog.deferred})
        out.append({"losses": losses, "state": pmodel.full_state_dict(), "plan": pmodel.plan.to_json(),
                    "eval": pmodel(*args, **kwargs).item(), "owned": sorted(n for n, _ in pmodel.named_parameters()),
                    "emitted": emitted, "deferred": deferred, "runs": runs})
    return out


# ---------------------------------------------------------------- one process: the split and the plan

def _run_programs(programs, case, captured, split_backward=False):
    """Run the stage programs in pipeline order on one process: (loss, summed parameter gradients);
    `split_backward`: each backward as its B then its W program (passes/split_weight_grads.py)."""
    params, buffers = dict(case.model.named_parameters()), dict(case.model.named_buffers())
    flat_inputs = list(case.args) + [v for v in case.kwargs.values() if isinstance(v, torch.Tensor)]
    env = {("input", n.name): x for n, x in zip(captured.placeholders("input"), flat_inputs)}
    state = lambda key, env: params[key[1]].detach() if key[0] == "param" else (  # noqa: E731
        buffers[key[1]] if key[0] == "buffer" else env[key])
    saved = []
    for prog in programs:
        out = prog.forward(*[state(k, env) for k in prog.forward_args])
        sent = 1 if prog.index == len(programs) - 1 else len(prog.outputs)
        saved.append(out[sent:])
        env = {("input", n): v for n, v in zip(prog.outputs, out[:sent])}
    loss, grads, env = out[0], {}, {}
    for prog in reversed(programs):
        env.update({("saved", i): v for i, v in enumerate(saved[prog.index])})
        if split_backward:
            b = prog.backward_input(*[state(k, env) for k in prog.backward_input_args])
            carried = list(b[len(b) - prog.num_carried:])
            w = prog.backward_weight(*[state(k, env) for k in prog.backward_weight_args], *carried)
            out = list(w) + list(b[:len(b) - prog.num_carried])
        else:
            out = prog.backward(*[state(k, env) for k in prog.backward_args])
        for name, g in zip(prog.grad_params, out):
            grads[name] = grads.get(name, 0) + g   # a shared parameter: summed across its stages
        env = {("grad", n): g for n, g in zip(prog.input_grads, out[len(prog.grad_params):])}
    return loss, grads


@pytest.mark.parametrize("name,cut", [("gpt", 1), ("gpt", 3), ("llama", 2)])
def test_split_stages_computes_the_joint_graph(name, cut):
    """Forward programs in stage order, then backward programs in reverse, give the joint graph's loss and
    gradients, and so do the backward programs cut into B and W (zero bubble); the tied wte/lm_head weight
    lives on both stages of the GPT."""
    from autopar.capture.canonicalize import canonicalize
    from autopar.capture.trace import capture
    from autopar.passes.split_stages import graph_units, split_stages
    from autopar.passes.split_weight_grads import with_weight_split
    case = models.tiny_gpt(batch=2, seq=8) if name == "gpt" else models.tiny_llama(batch=2, seq=8)
    captured = capture(case.model, case.args, example_kwargs=case.kwargs)
    canonicalize(captured.gm)
    units = graph_units(captured.gm)
    programs = split_stages(captured.gm, [units[:cut], units[cut:]], units, list(captured.grad_param_names))
    tensors = {**dict(case.model.named_parameters()), **dict(case.model.named_buffers())}
    flat = [tensors[n].detach() for n in captured.param_names + captured.buffer_names] + list(case.args) + \
        [v for v in case.kwargs.values() if isinstance(v, torch.Tensor)]
    with torch.no_grad():
        want = captured.gm(*flat)
    for split_backward in (False, True):   # each backward whole, then as B and W (zero bubble)
        if split_backward:
            programs = [with_weight_split(p) for p in programs]
        loss, grads = _run_programs(programs, case, captured, split_backward)
        torch.testing.assert_close(loss, want[0])
        assert set(grads) == set(captured.grad_param_names)
        for n, g in zip(captured.grad_param_names, want[1:]):
            torch.testing.assert_close(grads[n], g, msg=lambda m: f"{n}: {m}")
    # B holds the input gradients' ops only (stage 0 has none: its B is empty), W the rest, none twice
    ops = [[n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
           for p in programs for gm in (p.backward, p.backward_input, p.backward_weight)]
    for whole, b, w in zip(ops[0::3], ops[1::3], ops[2::3]):
        assert not set(b) & set(w) and len(b) + len(w) <= len(whole) and w
    assert not ops[1] and ops[4] and programs[1].num_carried > 0
    assert programs[0].outputs == programs[1].inputs and programs[1].input_grads
    shared = [p.shared_params for p in programs]
    assert shared == ([["transformer.wte.weight"]] * 2 if name == "gpt" else [[], []])
    assert not set(programs[0].params) & set(programs[1].params) - set(shared[0])


def test_layer_costs_weight_is_the_parameter_gradients_part_of_backward():
    """LayerCost.weight (zero bubble's W): of each unit's backward, the ops whose values reach no earlier
    unit. Every block's weight-gradient matmuls are there and its input-gradient ones are not (0 < weight <
    backward); the tied lm_head's contribution to wte's gradient is W of <post>; <pre> (the embedding's
    backward: parameter gradients only) is all W."""
    from autopar.capture.canonicalize import canonicalize
    from autopar.capture.trace import capture
    from autopar.graph import PHASE
    from autopar.pipeline.layer_profile import _weight_only, layer_costs, unit_names
    from autopar.planning import spmd as planner
    from autopar.planning.problem import ProblemBuilder
    from autopar.sharding import recipes
    case = models.tiny_gpt(batch=2, seq=8)
    cap = capture(case.model, case.args)
    canonicalize(cap.gm)
    sub = autopar.Mesh((1,), axis_names=("dp",))
    prob = ProblemBuilder(cap, sub).build()
    sol, _ = planner.solve_requested(prob, cap, sub, recipes.normalize("dp", sub), {}, 10)
    units = layer_costs(prob, sol.choice)
    blocks = [u for u in units if u.name.startswith("transformer.h.")]
    assert blocks and all(0 < u.weight < u.backward for u in blocks)
    assert units[0].name == "<pre>" and units[0].weight == pytest.approx(units[0].backward)
    assert units[-1].name == "<post>" and 0 < units[-1].weight < units[-1].backward
    # a block's backward matmuls: one input gradient (B) and one weight gradient (W) per linear layer
    names, unit = unit_names(prob)
    w = _weight_only(prob, unit)
    for b in range(len(blocks)):
        mm = [w[i] for i, n in enumerate(prob.nodes) if n.target is torch.ops.aten.mm.default
              and n.meta.get(PHASE) == "backward" and names[unit[i]] == f"transformer.h.{b}"]
        assert len(mm) == 8 and sum(mm) == 4, (b, mm)   # c_attn, c_proj, c_fc, mlp c_proj


@pytest.mark.parametrize("name,cut", [("gpt", 2), ("llama", 3)])
def test_layer_costs_carried_bytes_are_what_the_runtime_hands_from_b_to_w(name, cut):
    """LayerCost.carried_bytes (zero bubble's gradients held from B to W): summed over a later stage's units,
    the bytes of the carried values its W program reads (passes/split_weight_grads.py), on one device;
    the first stage carries none at run time (its B is empty), and the stage split charges it none."""
    from autopar.capture.canonicalize import canonicalize
    from autopar.capture.trace import capture
    from autopar.passes.split_stages import graph_units, split_stages
    from autopar.passes.split_weight_grads import with_weight_split
    from autopar.pipeline.layer_profile import layer_costs
    from autopar.pipeline.stages import memory_counts
    from autopar.planning import spmd as planner
    from autopar.planning.problem import ProblemBuilder
    from autopar.sharding import recipes
    case = models.tiny_gpt(batch=2, seq=8) if name == "gpt" else models.tiny_llama(batch=2, seq=8)
    cap = capture(case.model, case.args, example_kwargs=case.kwargs)
    canonicalize(cap.gm)
    sub = autopar.Mesh((1,), axis_names=("dp",))
    prob = ProblemBuilder(cap, sub).build()
    sol, _ = planner.solve_requested(prob, cap, sub, recipes.normalize("dp", sub), {}, 10)
    costs = layer_costs(prob, sol.choice)
    units = graph_units(cap.gm)
    assert [c.name for c in costs] == list(units)
    programs = [with_weight_split(p) for p in split_stages(cap.gm, [units[:cut], units[cut:]], units,
                                                           list(cap.grad_param_names))]
    carried = [sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in p.backward_weight.graph.nodes
                   if n.op == "placeholder" and n.name.startswith("carried_")) for p in programs]
    assert carried[0] == 0 and carried[1] > 0
    assert sum(c.carried_bytes for c in costs[cut:]) == pytest.approx(carried[1], rel=1e-9)
    assert [w for _, w in memory_counts("zero_bubble", 2, 4, 1)] == [0, 2]
    assert [w for _, w in memory_counts("1f1b", 2, 4, 1)] == [0, 0]


def test_layer_costs_count_gradient_all_reduces_once_and_reduce_scatters_per_microbatch():
    """The pipelined runtime all-reduces a gradient once per step (passes/defer_grad_reductions.py) but
    reduce-scatters a ZeRO gradient in every micro-batch's backward: layer_costs files the first under
    per_step, the second under backward (the gradient edges' seconds, all of them, in one or the other)."""
    from autopar.capture.canonicalize import canonicalize
    from autopar.capture.trace import capture
    from autopar.pipeline.layer_profile import layer_costs
    from autopar.planning import spmd as planner
    from autopar.planning.problem import ProblemBuilder
    from autopar.sharding import recipes
    case = models.tiny_gpt(batch=2, seq=8)
    cap = capture(case.model, case.args)
    canonicalize(cap.gm)
    sub = autopar.Mesh((2,), axis_names=("dp",))
    prob = ProblemBuilder(cap, sub).build()
    for strategy in ("dp", "zero2"):
        sol, _ = planner.solve_requested(prob, cap, sub, recipes.normalize(strategy, sub), {}, 10)
        k = sol.choice
        params = sum(float(prob.compute[i][k[i]] + prob.local_comm[i][k[i]]) for i, n in enumerate(prob.nodes)
                     if n.op == "placeholder")   # optimizer update (+ ZeRO gathers): once per step
        grads = sum(float(ce.time[k[e.src], k[e.dst]]) for e, ce in zip(prob.edges, prob.cg.edges)
                    if e.kind == "grad")
        assert grads > 0, strategy
        want = params + grads if strategy == "dp" else params   # all-reduces once; reduce-scatters per micro-batch
        assert sum(x.per_step for x in layer_costs(prob, k, cap)) == pytest.approx(want, rel=1e-9), strategy


def test_pipelined_plan_widens_the_mesh_and_round_trips():
    case = models.tiny_gpt(batch=4, seq=16)
    # without the per-step optimizer overhead the step is fill + steady state + drain only, so the
    # printed bubble is the textbook (p-1)/(m+p-1) of the balanced split
    hardware = dataclasses.replace(get_hardware("cpu"), param_step_overhead=0.0)
    plan = autopar.plan(case.model, case.args, mesh=autopar.Mesh((2,), hardware=hardware), num_stages=2,
                        num_microbatches=2, schedule="gpipe", baselines=False)
    assert plan.mesh.axis_names[0] == "pp" and tuple(plan.mesh.shape) == (2, 1)
    assert plan.recipes[0] == "pp" and plan.schedule == "gpipe" and plan.num_microbatches == 2
    assert all(p.master[0] == "R" and p.use[0] == "R" for p in plan.params.values())
    assert all(o is None or o[0] == "R" for c in plan.nodes.values() for o in c.outs)
    units = [u for st in plan.stages for u in st.modules]
    assert units == ["<pre>", "transformer.h.0", "transformer.h.1", "<post>"]   # each unit once, in order
    assert [st.ranks for st in plan.stages] == [(0,), (1,)]
    assert all(st.predicted_time > 0 and st.memory > 0 for st in plan.stages)
    assert plan.predicted_step_time >= sum(st.predicted_time for st in plan.stages)  # fill and drain at least
    assert plan.memory_per_device == max(st.memory for st in plan.stages)
    again = autopar.Plan.from_json(plan.to_json())
    assert again.stages == plan.stages and again.to_json() == plan.to_json()
    text = str(plan)
    assert "2 stages, 2 micro-batches, schedule gpipe" in text and "predicted bubble 33%" in text
    assert "stage 1  ranks 1" in text


def test_interleaved_plan_places_chunks_round_robin():
    """schedule="interleaved_1f1b": p*v = 4 chunks of the 4-layer GPT, chunk k on device k % 2, each unit
    once and in order; a device's memory is the sum of its chunks'; the summary lists chunks per device."""
    from autopar.pipeline.planning import chunks_per_device
    case = models.tiny_gpt(n_layer=4, batch=4, seq=16)
    plan = autopar.plan(case.model, case.args, mesh=autopar.Mesh((2,)), num_stages=2, schedule="interleaved_1f1b",
                        baselines=False)
    assert plan.schedule == "interleaved_1f1b" and plan.num_microbatches == 2 and chunks_per_device(plan) == 2
    assert [st.index for st in plan.stages] == [0, 1, 2, 3]
    assert [st.ranks for st in plan.stages] == [(0,), (1,), (0,), (1,)]
    units = [u for st in plan.stages for u in st.modules]
    assert units == ["<pre>"] + [f"transformer.h.{i}" for i in range(4)] + ["<post>"]
    per_device = [sum(st.memory for st in plan.stages[d::2]) for d in range(2)]
    assert plan.memory_per_device == pytest.approx(max(per_device), rel=1e-9)
    assert autopar.Plan.from_json(plan.to_json()).to_json() == plan.to_json()
    text = str(plan)
    assert "2 stages x 2 chunks per device, 2 micro-batches, schedule interleaved_1f1b" in text
    assert "chunk 0 <pre>" in text and "chunk 3 transformer.h.3, <post>" in text
    # the search's interleaved candidate becomes the same runnable plan (num_stages="auto"'s path)
    from autopar.pipeline.search import search, to_plan
    res = search(case.model, case.args, mesh=autopar.Mesh((2,)), num_stages=2, num_microbatches=2,
                 schedules=("interleaved_1f1b",))
    searched = to_plan(res, case.model)
    assert [(st.modules, st.ranks) for st in searched.stages] == [(st.modules, st.ranks) for st in plan.stages]
    assert [st.modules for st in searched.stages] == list(res.best.stage_modules)
    assert searched.predicted_step_time == pytest.approx(res.best.step_time, rel=1e-6)


def test_zero_bubble_v_plan_places_chunks_in_a_v():
    """schedule="zero_bubble_v": 2p = 4 chunks of the 4-layer GPT, chunk k on device `chunk_device` (0, 1, 1, 0:
    device 0 holds the embedding's chunk and the loss's), each unit once and in order; a device's memory is the
    sum of its chunks'; any micro-batch count (torch's ZB-V has no rounds), virtual_stages other than 2 refused;
    the search's candidate becomes the same plan, at the search's price."""
    from autopar.errors import InputError
    from autopar.pipeline.planning import chunks_per_device
    case = models.tiny_gpt(n_layer=4, batch=6, seq=16)
    plan = autopar.plan(case.model, case.args, mesh=autopar.Mesh((2,)), num_stages=2, schedule="zero_bubble_v",
                        num_microbatches=3, baselines=False)
    assert plan.schedule == "zero_bubble_v" and plan.num_microbatches == 3 and chunks_per_device(plan) == 2
    assert [st.ranks for st in plan.stages] == [(0,), (1,), (1,), (0,)]
    assert [u for st in plan.stages for u in st.modules] == ["<pre>"] + [f"transformer.h.{i}" for i in range(4)] + ["<post>"]
    per_device = [plan.stages[0].memory + plan.stages[3].memory, plan.stages[1].memory + plan.stages[2].memory]
    assert plan.memory_per_device == pytest.approx(max(per_device), rel=1e-9)
    assert autopar.Plan.from_json(plan.to_json()).to_json() == plan.to_json()
    assert "schedule zero_bubble_v" in str(plan)
    with pytest.raises(InputError, match="two chunks per device"):
        autopar.plan(case.model, case.args, mesh=autopar.Mesh((2,)), num_stages=2, schedule="zero_bubble_v",
                     virtual_stages=3, baselines=False)
    from autopar.pipeline.search import search, to_plan
    res = search(case.model, case.args, mesh=autopar.Mesh((2,)), num_stages=2, num_microbatches=3,
                 schedules=("zero_bubble_v",))
    searched = to_plan(res, case.model)
    assert [(st.modules, st.ranks) for st in searched.stages] == [(st.modules, st.ranks) for st in plan.stages]
    assert searched.predicted_step_time == pytest.approx(res.best.step_time, rel=1e-6)


def test_pipelined_plan_refuses_bad_requests():
    from autopar.errors import InputError, MeshError
    case = models.tiny_gpt(batch=4, seq=16)
    with pytest.raises(InputError, match="micro-batches"):
        autopar.plan(case.model, case.args, mesh=autopar.Mesh((2,)), num_stages=2, num_microbatches=3)
    with pytest.raises(InputError, match="schedule"):
        autopar.plan(case.model, case.args, mesh=autopar.Mesh((2,)), num_stages=2, schedule="zigzag")
    with pytest.raises(InputError, match="whole rounds of 2 micro-batches.*num_microbatches=2 or 4"):
        autopar.plan(case.model, case.args, mesh=autopar.Mesh((2,)), num_stages=2, schedule="interleaved_1f1b",
                     num_microbatches=3)
    with pytest.raises(InputError, match="virtual_stages=2 applies to the interleaved schedules only"):
        autopar.plan(case.model, case.args, mesh=autopar.Mesh((2,)), num_stages=2, schedule="1f1b",
                     virtual_stages=2)
    with pytest.raises(InputError, match="zero_bubble.*2 rounds for 5 micro-batches.*multiple of 2"):
        autopar.plan(case.model, case.args, mesh=autopar.Mesh((2,)), num_stages=2, schedule="zero_bubble",
                     num_microbatches=5)
    with pytest.raises(MeshError, match="first axis"):
        autopar.plan(case.model, case.args, mesh=autopar.Mesh((1, 2), axis_names=("dp", "pp")))
    with pytest.raises(MeshError, match="do not split"):
        autopar.plan(case.model, case.args, mesh=autopar.Mesh((3,)), num_stages=2)


# ---------------------------------------------------------------- multi-process: equal to one process

def _reference_eval(model, state, batch) -> float:
    ref = copy.deepcopy(model)
    ref.load_state_dict(state)
    args, kwargs = batch
    with torch.no_grad():
        out = ref(*args, **kwargs)
    return float(out if isinstance(out, torch.Tensor) else out.loss)


def _compare(results, case, batches, kws, world):
    ref_losses, ref_state = train_reference(case.model, batches, STEPS)
    ref_eval = _reference_eval(case.model, ref_state, batches[0])
    for i, kw in enumerate(kws):
        label = f"world={world} {kw}"
        for rank in range(world):
            got = results[rank][i]
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{label} rank {rank} losses: {m}")
            assert got["eval"] == pytest.approx(ref_eval, rel=1e-4, abs=1e-5), label
        state = results[0][i]["state"]
        assert set(ref_state) <= set(state), label   # (plus non-persistent buffers such as rotary tables)
        for key, want in ref_state.items():
            torch.testing.assert_close(state[key], want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{label} {key}: {m}")
        plan = autopar.Plan.from_json(results[0][i]["plan"])
        v = kw.get("virtual_stages", 2) if kw.get("schedule") in INTERLEAVED else chunks_per_device(kw["schedule"])
        assert plan.mesh.axis_names[0] == "pp" and len(plan.stages) == 2 * v, label   # p*v chunks
        assert [st.ranks for st in plan.stages] == [plan.stages[chunk_device(kw["schedule"], 2, k)].ranks
                                                    for k in range(2 * v)], label
        # each rank registers only its own stage's parameters; together they are the whole model
        first, last = set(results[0][i]["owned"]), set(results[world - 1][i]["owned"])
        assert first and last and first != last, label
        assert first | last == {n for n, _ in case.model.named_parameters()}, label


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_pp2_matches_single_process(name):
    """pp=2 at world 2, GPipe and 1F1B (and, on the 4-layer GPT, interleaved 1F1B: 4 chunks, rank d
    holding chunks d and d+2): losses of 3 AdamW steps, every parameter afterwards, and a forward-only
    evaluation equal one process. The hand-written GPT ties lm_head to wte (chunks 0 and 3: two ranks)
    and here also h.2's fc weight to h.0's (chunks 0 and 2: one rank, one copy, gradient scaled once)."""
    case = models.tiny_gpt(n_layer=4, batch=4, seq=16) if name == "gpt" else models.tiny_llama(batch=4, seq=16)
    if name == "gpt":   # a second tie, inside the stack (interleaved: h.0 and h.2 both in rank 0's chunks)
        case.model.transformer.h[2].mlp.c_fc.weight = case.model.transformer.h[0].mlp.c_fc.weight
    batches = models.zoo_batches(case, STEPS)
    kws = [dict(num_stages=2, schedule="gpipe"), dict(num_stages=2, schedule="1f1b", num_microbatches=4)]
    if name == "gpt":
        kws.append(dict(num_stages=2, schedule="interleaved_1f1b", virtual_stages=2, num_microbatches=4))
    results = run_distributed(train_pipelined, 2, case.model, batches, STEPS, kws, timeout=600)
    _compare(results, case, batches, kws, 2)
    if name == "gpt":   # the tied blocks really shared one rank (else the split moved: pick other blocks)
        plan = autopar.Plan.from_json(results[0][2]["plan"])
        assert {"transformer.h.0", "transformer.h.2"} <= {u for st in plan.stages[0::2] for u in st.modules}


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_zero_bubble_matches_single_process(name):
    """schedule="zero_bubble" (torch's ScheduleInterleavedZeroBubble, ZB-H1): each stage's backward runs as B
    (input gradients) and, later, W (parameter gradients; passes/split_weight_grads.py). pp=2 at world 2, 2 and
    4 micro-batches, "interleaved_zero_bubble" (the same schedule on 2 chunks per device: 4 chunks, rank d
    holding d and d + 2), 4 micro-batches, and "zero_bubble_v" (torch's ScheduleZBVZeroBubble: rank 0 holds
    chunks 0 and 3, the embedding and the loss; on the GPT the tied lm_head's copy is rank 0's wte), 2 and 4
    micro-batches (2 < 2p - 1: torch's order drops the micro-batches it pads with): losses of 3 AdamW steps,
    every parameter and a forward-only evaluation equal one process, and every micro-batch ran one B and one W
    on each chunk, never the whole backward."""
    case = models.tiny_gpt(n_layer=4, batch=4, seq=16) if name == "gpt" else models.tiny_llama(batch=4, seq=16)
    batches = models.zoo_batches(case, STEPS)
    kws = [dict(num_stages=2, schedule="zero_bubble", num_microbatches=m) for m in (2, 4)]
    kws.append(dict(num_stages=2, schedule="interleaved_zero_bubble", num_microbatches=4))
    kws += [dict(num_stages=2, schedule="zero_bubble_v", num_microbatches=m) for m in (2, 4)]
    results = run_distributed(train_pipelined, 2, case.model, batches, STEPS, kws, timeout=600)
    _compare(results, case, batches, kws, 2)
    for rank in range(2):
        for i, kw in enumerate(kws):
            m = kw["num_microbatches"] * chunks_per_device(kw["schedule"])   # per chunk
            assert results[rank][i]["runs"] == {"forward": m, "backward_input": m, "backward_weight": m}, (rank, kw)


def accumulate_pipelined(rank, world, model, batches):
    """Two train_step calls with no zero_grad between them: the losses and the gradients left."""
    from autopar import autoparallelize
    args, kwargs = batches[0]
    pmodel = autoparallelize(copy.deepcopy(model), tuple(args) + ((kwargs,) if kwargs else ()), num_stages=2,
                             schedule="1f1b", num_microbatches=2, baselines=False)
    losses = [pmodel.train_step(*a, **k).item() for a, k in batches[:2]]
    grads = {n: p.grad.full_tensor() for n, p in pmodel.named_parameters() if p.grad is not None}
    return losses, grads


def test_pipelined_train_step_adds_to_earlier_gradients():
    """Like loss.backward(), train_step adds its gradients to those already in p.grad: two calls without
    zero_grad leave the sum of both batches' gradients on every stage (the tied embedding too)."""
    case = models.tiny_gpt(batch=4, seq=16)
    batches = models.zoo_batches(case, 2)
    ref = copy.deepcopy(case.model)
    want = []
    for args, kwargs in batches:
        loss = ref(*args, **kwargs)
        loss = loss if isinstance(loss, torch.Tensor) else loss.loss
        loss.backward()
        want.append(loss.item())
    results = run_distributed(accumulate_pipelined, 2, case.model, batches, timeout=600)
    names = set()
    for losses, grads in results:
        assert losses == pytest.approx(want, rel=1e-4, abs=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref.get_parameter(name).grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{name}: {m}")
        names |= set(grads)
    assert names == {n for n, _ in case.model.named_parameters()}


def test_pp2_with_dp_and_tp_matches_single_process():
    """World 4: pp=2 x dp=2 (GPipe, and interleaved 1F1B: 4 one-unit chunks) and pp=2 x tp=2 (1F1B) on
    the tied GPT; the stage programs leave the gradient all-reduces to the runtime (once per step)."""
    case = models.tiny_gpt(batch=8, seq=16)
    batches = models.zoo_batches(case, STEPS)
    kws = [dict(mesh=autopar.Mesh((2, 2), axis_names=("pp", "dp")), strategy="dp", schedule="gpipe"),
           dict(mesh=autopar.Mesh((2, 2), axis_names=("pp", "tp")), strategy="tp", schedule="1f1b"),
           dict(mesh=autopar.Mesh((2, 2), axis_names=("pp", "dp")), strategy="dp", schedule="interleaved_1f1b")]
    results = run_distributed(train_pipelined, 4, case.model, batches, STEPS, kws, timeout=900)
    _compare(results, case, batches, kws, 4)
    for i, kw in enumerate(kws):
        _check_deferred_reductions(autopar.Plan.from_json(results[0][i]["plan"]), [results[0][i], results[2][i]],
                                   f"world=4 {kw}")


def test_zero_bubble_with_zero3_and_tp_matches_single_process():
    """World 4, schedule="zero_bubble": pp=2 x dp=2 with ZeRO-3 inside the stages (each parameter gathered in
    B and W where they read it, its gradient reduce-scattered in W) and pp=2 x tp=2 (the activation gradients'
    all-reduces in B), and pp=2 x dp=2 with ZeRO-3 under zero bubble V (two chunks per rank in a V): equal one
    process, and W ran every micro-batch's parameter gradients."""
    case = models.tiny_gpt(batch=8, seq=16)
    batches = models.zoo_batches(case, STEPS)
    kws = [dict(mesh=autopar.Mesh((2, 2), axis_names=("pp", "dp")), strategy="zero3", schedule="zero_bubble",
                num_microbatches=4),
           dict(mesh=autopar.Mesh((2, 2), axis_names=("pp", "tp")), strategy="tp", schedule="zero_bubble"),
           dict(mesh=autopar.Mesh((2, 2), axis_names=("pp", "dp")), strategy="zero3", schedule="zero_bubble_v",
                num_microbatches=4)]
    results = run_distributed(train_pipelined, 4, case.model, batches, STEPS, kws, timeout=900)
    _compare(results, case, batches, kws, 4)
    for rank in range(4):
        for i, kw in enumerate(kws):
            m = kw.get("num_microbatches", 2) * chunks_per_device(kw["schedule"])   # per chunk
            assert results[rank][i]["runs"] == {"forward": m, "backward_input": m, "backward_weight": m}, (rank, kw)


def _check_deferred_reductions(plan, ranks, label):
    """`ranks`: one rank per pipeline rank at one sub-mesh coordinate (together every chunk, m >= 2
    micro-batches). Their stage programs run no gradient all-reduce (the runtime runs each once per
    step, passes/defer_grad_reductions.py); their collectives plus the deferred ones are the plan's,
    by kind and phase (a tied parameter's gradient is reduced on each stage holding it, once in the plan)."""
    assert plan.num_microbatches >= 2, label
    emitted = [c for got in ranks for c in got["emitted"] if not c[3].startswith("gradient")]
    emitted += sorted({c for got in ranks for c in got["emitted"] if c[3].startswith("gradient")})
    assert not [c for c in emitted if c[1] == "all_reduce" and c[3].startswith("gradient")], label
    deferred = {d for got in ranks for d in got["deferred"]}
    reduced = {c.source for c in plan.collectives if c.reason == "gradient" and c.kind == "all_reduce"}
    assert {d[0] for d in deferred} == reduced, label
    if "dp" in plan.mesh.axis_names:   # data parallel: every parameter's gradient, over dp
        assert reduced and {d[2] for d in deferred} == {"dp"}, label
    got = Counter((c[1], c[2]) for c in emitted) + Counter((d[1], d[3]) for d in deferred)
    assert got == Counter((c.kind, c.phase) for c in plan.collectives), label


def test_num_stages_auto_searches_layouts_and_trains_like_one_process():
    """num_stages="auto": rank 0 searches pp x dp x tp layouts (runnable schedules only), every rank
    runs the chosen plan on the plan's own mesh; the runners-up are kept in the plan's baselines.
    search="exact": pipelines are priced even though an SPMD plan fits (by default they are not)."""
    case = models.tiny_gpt(batch=4, seq=16)
    searched = autopar.plan(case.model, case.example_inputs, mesh=autopar.Mesh((2,)), num_stages="auto",
                            search="exact")
    spmd = autopar.plan(case.model, case.example_inputs, mesh=autopar.Mesh((2,)), baselines=False, num_stages=None)
    assert searched.predicted_step_time <= spmd.predicted_step_time * (1 + 1e-9)
    assert any(name.startswith("pp2") for name in searched.baselines), searched.baselines   # pp=2 was priced
    batches = models.zoo_batches(case, STEPS)
    kws = [dict(num_stages="auto", search="exact")]
    results = run_distributed(train_pipelined, 2, case.model, batches, STEPS, kws, timeout=600)
    ref_losses, ref_state = train_reference(case.model, batches, STEPS)
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(results[rank][0]["losses"]), torch.tensor(ref_losses),
                                   rtol=1e-4, atol=1e-5)
    for key, want in ref_state.items():
        torch.testing.assert_close(results[0][0]["state"][key], want, rtol=1e-4, atol=1e-5)
    assert autopar.Plan.from_json(results[0][0]["plan"]).mesh == searched.mesh
