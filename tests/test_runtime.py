"""Multi-process tests of the runtime (gloo): numerics equal one process, the emitted collectives
are the plan's, and parameter/optimizer memory is what the plan says."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar._testing import models
from autopar._testing.dist_cases import assert_matches, run_each, train_many, train_reference
from autopar._testing.dist_utils import run_distributed
from autopar.placement import is_strided

STEPS = 3
STRATEGIES = ["auto", "dp", "zero1", "zero2", "zero3", "tp"]
MODELS = {
    "gpt": lambda: models.tiny_gpt(batch=4, seq=16),
    "gpt2": lambda: models.tiny_gpt2(batch=4, seq=16),
    "llama": lambda: models.tiny_llama(batch=4, seq=16),
    "bert": lambda: models.tiny_bert(batch=4, seq=16),
}


def _batches(case):
    """Three different batches of the example's shapes (same vocab range)."""
    out = []
    for seed in range(STEPS):
        gen = torch.Generator().manual_seed(100 + seed)
        vocab = int(max(int(a.max()) for a in case.args if a.dtype == torch.long)) + 1
        args = tuple(torch.randint(0, vocab, a.shape, generator=gen) if a.dtype == torch.long else a
                     for a in case.args)
        kwargs = {k: args[0] if k == "labels" else v for k, v in case.kwargs.items()}
        out.append((args, kwargs))
    return out


def _kws(world):
    kws = [dict(strategy=s) for s in STRATEGIES]
    if world == 4:
        mesh = autopar.Mesh((2, 2), axis_names=("dp", "tp"))
        kws.append(dict(mesh=mesh, strategy={"dp": "dp", "tp": "tp"}))
    return kws


@pytest.fixture(scope="module", params=[2, 4], ids=lambda world: f"world{world}")
def runs(request):
    """Every model's runs at one world in one spawn (dist_cases.run_each): starting `world` ranks costs each
    of them seconds of imports. (world, {model name: (case, batches, every rank's result)}, every rank's
    results of the jobs after the models': gradient_placements)."""
    world = request.param
    cases = {name: make() for name, make in MODELS.items()}
    batches = {name: _batches(case) for name, case in cases.items()}
    jobs = [(train_many, cases[name].model, batches[name], STEPS, _kws(world)) for name in MODELS]
    jobs.append((gradient_placements, cases["gpt"].model, batches["gpt"][0]))
    results = run_distributed(run_each, world, jobs, timeout=1800)
    out = {name: (cases[name], batches[name], [r[j] for r in results]) for j, name in enumerate(MODELS)}
    return world, out, [r[len(MODELS):] for r in results]


def gradient_placements(rank, world, model, batch):
    """After a train_step under tp (Shard, strided Shard and Replicate parameters): per parameter, whether
    p.grad is a DTensor with p's placements, global shape and local shape; and what a hook saw."""
    import copy

    from torch.distributed.tensor import DTensor
    pmodel = autopar.autoparallelize(copy.deepcopy(model), batch[0], example_kwargs=batch[1], strategy="tp")
    hooked = []
    for p in pmodel.parameters():  # gradients still pass through autograd (hooks run, once each)
        p.register_hook(lambda g: hooked.append(isinstance(g, DTensor)))
    pmodel.train_step(*batch[0], **batch[1])
    return {"grads": {name: isinstance(p.grad, DTensor) and p.grad.placements == p.placements
                      and p.grad.shape == p.shape and p.grad.to_local().shape == p.to_local().shape
                      for name, p in pmodel.named_parameters()},
            "hooked": hooked, "num_params": len(list(pmodel.parameters())),
            "placements": sorted({str(p.placements) for p in pmodel.parameters()})}


@pytest.mark.parametrize("name", list(MODELS))
def test_matches_single_process(runs, name):
    world, by_name, _ = runs
    case, batches, results = by_name[name]
    errors = [f"rank {rank}: {e}" for rank, e in enumerate(results) if isinstance(e, str)]
    assert not errors, "\n".join(errors)
    ref_losses, ref_state = train_reference(case.model, batches, STEPS)
    kws = _kws(world)
    assert_matches(results, ref_losses, ref_state, [f"{name} world={world} {kw}" for kw in kws])  # + collectives
    for i, kw in enumerate(kws):
        label = f"{name} world={world} {kw}"
        plan = autopar.Plan.from_json(results[0][i]["plan"])
        # stored parameters and optimizer state are the plan's figures, read from the real tensors
        mem = results[0][i]["memory"]
        assert mem["params"] + mem["buffers"] == pytest.approx(plan.memory_breakdown["params"]), label
        assert mem["optimizer"] == pytest.approx(plan.memory_breakdown["optimizer"]), label
        if kw == {"strategy": "tp"} and world == 2 and name in ("gpt", "gpt2"):  # fused q;k;v: whole heads (#3)
            assert is_strided(plan.placement("transformer.h.0.attn.c_attn.weight")[0]), label


def test_gradients_are_dtensors_placed_like_their_parameters(runs):
    """JointStepFunction hands autograd DTensor gradients built from the graph's local ones (no to_local node)."""
    world, _, extra = runs
    for rank, (res,) in enumerate(extra):
        assert not isinstance(res, str), f"rank {rank}: {res}"
        assert all(res["grads"].values()), f"rank {rank}: {[n for n, ok in res['grads'].items() if not ok]}"
        assert res["hooked"] == [True] * res["num_params"], rank
        assert any("Shard" in p for p in res["placements"]) and any("Replicate" in p for p in res["placements"])


def test_meta_model_materialises_only_local_shards():
    from autopar._testing.dist_cases import build_from_meta
    from autopar._testing.gpt import GPT, GPTConfig
    from autopar.placement import from_str, local_shape
    config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    results = run_distributed(build_from_meta, 2, config, "zero3", 123, timeout=600)
    with torch.device("meta"):
        ref = GPT(config)
    ref.to_empty(device="cpu")
    ref.lm_head.weight = ref.transformer.wte.weight
    torch.manual_seed(123)
    ref.apply(GPT._init_weights)  # the same random draws, in the same order, on one device
    for res in results:
        for key, want in ref.state_dict().items():
            torch.testing.assert_close(res["state"][key], want, rtol=0, atol=0)
        for name, (shape, master) in res["params"].items():
            spec = tuple(from_str(s) for s in master)
            assert res["local"][name] == local_shape(spec, tuple(shape), (2,)), name
    sharded = [n for n, (shape, master) in results[0]["params"].items() if master != ("R",)]
    assert sharded, "zero3 shards parameters"


def accumulated_gradients(rank, world, model, batches):
    """Gradients summed over batches without zero_grad between them, then after zero_grad(set_to_none=
    False) and one more batch: full tensors, rank 0's. A dp step's gradients are views of its flat
    bucket buffers; autograd must add the next step's into them, not the other way round."""
    from autopar import autoparallelize
    from autopar._testing.dist_cases import private_copy
    args, kwargs = batches[0]
    pmodel = autoparallelize(private_copy(model), args, example_kwargs=kwargs or None, strategy="dp")
    out = []
    for b in (0, 1, 2):
        pmodel.train_step(*batches[b][0], **batches[b][1])
        out.append({n: p.grad.full_tensor().clone() for n, p in pmodel.named_parameters()})
    for p in pmodel.parameters():
        p.grad.zero_()
    pmodel.train_step(*batches[0][0], **batches[0][1])
    out.append({n: p.grad.full_tensor().clone() for n, p in pmodel.named_parameters()})
    # train_step puts the graph's gradients into p.grad itself unless something watches the step; with a
    # forward hook on the module it goes through self(...) and autograd, which run the hook
    by_path, calls = [], []
    for watch in (False, True):
        pmodel.zero_grad(set_to_none=True)
        handle = pmodel.register_forward_hook(lambda *a: calls.append(watch)) if watch else None
        assert pmodel._backward_is_watched() == watch  # (the first round takes the direct path)
        pmodel.train_step(*batches[1][0], **batches[1][1])
        by_path.append({n: p.grad.full_tensor().clone() for n, p in pmodel.named_parameters()})
        if handle is not None:
            handle.remove()
    return out, by_path, calls


def test_gradients_accumulate_across_steps_without_zero_grad():
    import copy

    from autopar._testing.dist_cases import _loss
    case = MODELS["gpt"]()
    batches = _batches(case)
    got, (direct, through_autograd), calls = run_distributed(accumulated_gradients, 2, case.model, batches,
                                                            timeout=600)[0]
    assert calls == [True], "a forward hook on the module runs once per train_step"
    assert direct.keys() == through_autograd.keys()
    for name, grad in direct.items():  # the same graph's gradients, whichever way they reach p.grad
        assert torch.equal(grad, through_autograd[name]), name
    ref = copy.deepcopy(case.model)
    want = []
    for b in (0, 1, 2):
        _loss(ref(*batches[b][0], **batches[b][1])).backward()
        want.append({n: p.grad.clone() for n, p in ref.named_parameters()})
    ref.zero_grad(set_to_none=False)
    _loss(ref(*batches[0][0], **batches[0][1])).backward()
    want.append({n: p.grad.clone() for n, p in ref.named_parameters()})
    for step, (g, w) in enumerate(zip(got, want)):
        for name, grad in w.items():
            torch.testing.assert_close(g[name], grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"step {step} {name}: {m}")


def test_backward_hands_each_parameter_its_own_gradient_tensor():
    """loss.backward() seeds 1, so gradients are passed on unscaled, but never one tensor twice
    (autograd may accumulate into p.grad in place)."""
    from autopar.runtime.tensors import distinct, is_unit_seed
    a, b = torch.ones(3), torch.zeros(2)
    out = distinct([a, None, b, a])
    assert out[0] is a and out[1] is None and out[2] is b and out[3] is not a
    torch.testing.assert_close(out[3], a)
    assert is_unit_seed(torch.tensor(1.0)) and not is_unit_seed(torch.tensor(2.0))
