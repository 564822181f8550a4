"""`pmodel.optimizer(...)` (autopar/runtime/optim.py): torch.optim stepping the local shards of DTensor
parameters gives the numbers of the same optimizer stepping the DTensors, keeps DTensor state (state_dict
round trips, LR schedulers), and its clip_grad_norm_ is the whole model's norm. One process for the
argument checks; 2 gloo ranks for hand-placed DTensors (every placement kind, Adam/AdamW/SGD options,
param groups) and for parallelized GPTs under dp, zero3, tp, auto and a 2-stage pipeline."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from autopar._testing.dist_cases import EPS, run_each
from autopar._testing.dist_utils import run_distributed
from autopar.errors import InputError
from autopar.placement import SS
from autopar.runtime.optim import local_shard_class, local_shard_optimizer

STEPS = 3
CASES = [  # (optimizer class, options): every flag that changes the update
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=1e-2, amsgrad=True, maximize=True, foreach=True)),
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.05, fused=True)),
    (torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.9), foreach=False)),
    (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, foreach=True)),
    (torch.optim.SGD, dict(lr=1e-2)),
]


def test_unsupported_optimizer_is_refused():
    with pytest.raises(InputError, match="Adam, AdamW, SGD"):
        local_shard_class(torch.optim.RMSprop)
    with pytest.raises(InputError, match="not"):
        local_shard_class("adamw")


def test_plain_tensors_step_as_torch_does():
    """No DTensor at all: the optimizer is torch's (isinstance, state_dict keys), fused by default on CPU."""
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    mine = copy.deepcopy(ref)
    a, b = torch.optim.AdamW(ref, lr=1e-2), local_shard_optimizer(torch.optim.AdamW, mine, lr=1e-2)
    assert isinstance(b, torch.optim.AdamW) and b.param_groups[0]["fused"] is True
    for _ in range(STEPS):
        for ps in (ref, mine):
            for p in ps:
                p.grad = torch.sin(p.detach() * 3)
        a.step()
        b.step()
    for x, y in zip(ref, mine):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=0)
    assert b.state_dict()["state"].keys() == a.state_dict()["state"].keys()


# ---------------------------------------------------------------- hand-placed DTensors, 2 ranks
PLACEMENTS = [[Shard(0)], [Shard(1)], [Replicate()], [SS(0, 2)], [Shard(0)]]
SHAPES = [(6, 4), (4, 6), (5,), (8, 3), (5, 2)]   # the last: an uneven shard (3 + 2 rows)


def _dtensor_params(mesh, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=gen), mesh, pl))
            for s, pl in zip(SHAPES, PLACEMENTS)]


def _set_grads(params, step: int) -> None:
    for p in params:
        full = torch.cos(p.full_tensor().detach() * (step + 2))
        p.grad = distribute_tensor(full, p.device_mesh, p.placements)


def _hand_placed(rank, world):
    """Each CASE, with two param groups, an LR scheduler and a state_dict round trip before the last step:
    the DTensor-stepping torch optimizer and the local-shard one, full parameters after every step."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    out = []
    for cls, options in CASES:
        runs = []
        for make in (cls, lambda groups, **kw: local_shard_optimizer(cls, groups, **kw)):
            params = _dtensor_params(mesh)
            groups = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}]
            opt = make(groups, **options)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            fulls = []
            for step in range(STEPS):
                if step == STEPS - 1:   # resume from a state dict into a fresh optimizer
                    saved = copy.deepcopy(opt.state_dict())
                    opt = make(groups, **options)
                    opt.load_state_dict(saved)
                _set_grads(params, step)
                opt.step()
                sched.step() if step < STEPS - 1 else None
                fulls.append([p.full_tensor().clone() for p in params])
            states = [type(v).__name__ for st in opt.state.values() for k, v in st.items() if k != "step"]
            runs.append((fulls, states))
        out.append(runs)
    # kept lists meet a step where one parameter has no gradient, then a new param group
    partial = []
    for make in (torch.optim.AdamW, lambda ps, **kw: local_shard_optimizer(torch.optim.AdamW, ps, **kw)):
        params, extra = _dtensor_params(mesh), _dtensor_params(mesh, seed=1)[:1]
        opt = make(params, lr=1e-2)
        for step in range(4):
            _set_grads(params, step)
            if step == 1:
                params[3].grad = None
            if step == 2:
                opt.add_param_group({"params": extra, "lr": 2e-2})
            if step >= 2:
                _set_grads(extra, step)
            opt.step()
        partial.append([p.full_tensor() for p in params + extra])
    out.append([(partial[0], []), (partial[1], [])])
    # a gradient with other placements than its parameter (a hook redistributed it): redistributed back
    params, ref = _dtensor_params(mesh), _dtensor_params(mesh)
    opt, ref_opt = local_shard_optimizer(torch.optim.AdamW, params, lr=1e-2), torch.optim.AdamW(ref, lr=1e-2)
    _set_grads(params, 0)
    _set_grads(ref, 0)
    params[0].grad = params[0].grad.redistribute(mesh, [Replicate()])
    opt.step()
    ref_opt.step()
    return out, [torch.equal(p.full_tensor(), q.full_tensor()) for p, q in zip(params, ref)]


def _clip(rank, world):
    """clip_grad_norm_ on hand-placed DTensors equals torch's over the DTensors (norm and clipped grads)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    out = []
    for norm_type, max_norm in ((2.0, 0.5), (float("inf"), 0.1), (1.0, 100.0)):
        params, ref = _dtensor_params(mesh), _dtensor_params(mesh)
        _set_grads(params, 0)
        _set_grads(ref, 0)
        total = local_shard_optimizer(torch.optim.AdamW, params).clip_grad_norm_(max_norm, norm_type)
        ref_total = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type)
        out.append((total, ref_total.full_tensor(), [p.grad.full_tensor() for p in params],
                    [p.grad.full_tensor() for p in ref]))
    return out


def test_hand_placed_dtensors_step_and_clip_as_torch_does():
    results = run_distributed(run_each, 2, [(_hand_placed,), (_clip,)], timeout=300)
    for rank, (steps, clips) in enumerate(results):
        assert not isinstance(steps, str), steps
        assert not isinstance(clips, str), clips
        cases, redistributed = steps
        (ref_partial, _), (partial, _) = cases.pop()
        for x, y in zip(ref_partial, partial):
            torch.testing.assert_close(y, x, rtol=1e-6, atol=0, msg="a step without a gradient, a new group")
        for (cls, options), ((ref, ref_states), (mine, states)) in zip(CASES, cases):
            assert states == ref_states and set(states) <= {"DTensor"}, (cls, options, states)
            for step, (a, b) in enumerate(zip(ref, mine)):
                for x, y in zip(a, b):
                    torch.testing.assert_close(y, x, rtol=1e-6, atol=0, msg=f"{cls.__name__} {options} step {step}")
        assert all(redistributed), redistributed
        for total, ref_total, grads, ref_grads in clips:
            torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=0)
            for g, r in zip(grads, ref_grads):
                torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-9)


# ---------------------------------------------------------------- parallelized GPTs, 2 ranks
def _gpt_case():
    from autopar._testing.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 64, (8, 16), generator=gen), torch.randint(0, 64, (8, 16), generator=gen))
               for _ in range(STEPS)]
    return model, batches


def _train(pmodel, make, batches) -> tuple[list, float]:
    """STEPS AdamW steps with a scheduler, the optimizer rebuilt from its state dict before the last;
    returns the full state dict after and the first step's clip norm (a huge max_norm: nothing clipped)."""
    opt = make(pmodel)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    norm = None
    for step, (x, y) in enumerate(batches):
        if step == STEPS - 1:
            saved = copy.deepcopy(opt.state_dict())
            opt = make(pmodel)
            opt.load_state_dict(saved)
        opt.zero_grad()
        pmodel.train_step(x, y)
        if step == 0 and hasattr(opt, "clip_grad_norm_"):
            norm = float(opt.clip_grad_norm_(1e9))
        opt.step()
        sched.step() if step < STEPS - 1 else None
    return {k: v.clone() for k, v in pmodel.full_state_dict().items()}, norm


def _gpt_strategy(rank, world, kw):
    """torch's fused AdamW on the DTensors against pmodel.optimizer's default (the fused kernel on local
    shards): the same kernel, so the same numbers (fused and torch's per-tensor loop differ in the last
    bits; every kernel is paired in `_hand_placed`)."""
    import autopar
    model, batches = _gpt_case()
    one = copy.deepcopy(model)   # the one-process gradient norm of the first batch
    one(*batches[0]).backward()
    one_norm = float(torch.nn.utils.get_total_norm([p.grad for p in one.parameters()]))
    # a copy each: replicated parameters share storage with the model they came from
    ref = _train(autopar.autoparallelize(copy.deepcopy(model), batches[0], mesh=autopar.Mesh((world,)), **kw),
                 lambda pm: torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=EPS, weight_decay=0.1, fused=True),
                 batches)
    mine = _train(autopar.autoparallelize(copy.deepcopy(model), batches[0], mesh=autopar.Mesh((world,)), **kw),
                  lambda pm: pm.optimizer(torch.optim.AdamW, lr=1e-3, eps=EPS, weight_decay=0.1), batches)
    return ref[0], mine[0], mine[1], one_norm, model.state_dict()


KWS = {"dp": dict(strategy="dp"), "zero3": dict(strategy="zero3"), "tp": dict(strategy="tp"),
       "auto": dict(strategy="auto"), "pp2": dict(num_stages=2, num_microbatches=2)}


def test_gpt_plans_step_as_torch_does_on_the_dtensors():
    jobs = [(_gpt_strategy, kw) for kw in KWS.values()]
    results = run_distributed(run_each, 2, jobs, timeout=600)
    for j, label in enumerate(KWS):
        for rank, per_job in enumerate(results):
            got = per_job[j]
            assert not isinstance(got, str), f"{label} rank {rank}:\n{got}"
            ref_state, state, norm, one_norm, initial = got
            assert ref_state.keys() == state.keys() == initial.keys()
            assert not torch.equal(state["lm_head.weight"], initial["lm_head.weight"]), label   # it trained
            for k in ref_state:
                torch.testing.assert_close(state[k], ref_state[k], rtol=1e-6, atol=1e-9, msg=f"{label} {k}")
            assert norm == pytest.approx(one_norm, rel=1e-4), (label, norm, one_norm)


# ---------------------------------------------------------------- cost model
def test_fused_optimizer_plans_price_fused_step_overhead():
    """optimizer="fused_adamw" (pmodel.optimizer) prices each parameter tensor's step with the profile's
    fused_step_overhead, "adamw" with param_step_overhead: two weight matrices, exactly 2 × the difference;
    same memory, same placements. Unmeasured (0, the presets), the fused plan prices as the other."""
    import dataclasses

    import autopar
    from autopar.costmodel import hardware
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.ReLU(), torch.nn.Linear(16, 4, bias=False))
    args = (torch.randn(4, 8),)
    measured = dataclasses.replace(hardware.CPU, name="cpu-fused", param_step_overhead=1e-3, fused_step_overhead=4e-5)

    def plan(hw, optimizer):
        return autopar.plan(model, args, mesh=autopar.Mesh((2,), hardware=hw), strategy="dp", baselines=False,
                            optimizer=optimizer, loss_fn=lambda out, x: out.square().mean())
    dtensor, fused = plan(measured, "adamw"), plan(measured, "fused_adamw")
    assert dtensor.predicted_step_time - fused.predicted_step_time == pytest.approx(2 * (1e-3 - 4e-5), rel=1e-9)
    assert fused.memory_breakdown == dtensor.memory_breakdown and fused.params == dtensor.params
    assert plan(hardware.CPU, "fused_adamw").predicted_step_time == plan(hardware.CPU, "adamw").predicted_step_time
    with pytest.raises(InputError, match="fused_"):
        plan(measured, "fused_lamb")


def test_fused_step_overhead_round_trips_and_is_validated():
    import dataclasses
    import json

    from autopar.calibration.measure import build_profile
    from autopar.costmodel import hardware
    from autopar.costmodel.hardware import HardwareSpec
    from autopar.errors import HardwareError
    assert "fused_step_overhead" not in hardware.H200.to_json()   # unset: profiles keep their fingerprints
    hw = dataclasses.replace(hardware.CPU, name="cpu-calibrated", fused_step_overhead=20e-6)
    assert HardwareSpec.from_json(json.dumps(hw.to_json())) == hw
    assert hw.step_overhead(True) == 20e-6 and hw.step_overhead(False) == hw.param_step_overhead
    with pytest.raises(HardwareError, match="fused_step_overhead"):
        HardwareSpec.from_json({**hw.to_json(), "fused_step_overhead": -1.0})
    spec = build_profile(hardware.CPU, [], matmul_flops=40e9, mem_bandwidth=2e10, op_overhead=8e-6,
                         devices_per_node=None, fused_step_overhead=7e-6)
    assert spec.fused_step_overhead == 7e-6
    assert build_profile(hw, [], matmul_flops=40e9, mem_bandwidth=2e10, op_overhead=8e-6,
                         devices_per_node=None).fused_step_overhead == 20e-6   # the base's when not measured
