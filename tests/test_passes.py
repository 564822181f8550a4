"""Pass tests: small graphs, structure after each pass, numerics of the lowering on real gloo ranks."""
from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar._testing.dist_utils import run_distributed
from autopar.capture.canonicalize import canonicalize
from autopar.capture.trace import capture
from autopar.ir import verify
from autopar.passes import PIPELINE, PassContext, emitted_collectives, run_passes
from autopar.passes.lower_collectives import lower_collectives_pass
from autopar.passes.ops import redistribute
from autopar.placement import PAVG, SS, P, R, S, local_shape, spec_str

aten = torch.ops.aten


class MLP(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, h), nn.Linear(h, h)

    def forward(self, x, labels):
        return F.cross_entropy(self.fc2(torch.relu(self.fc1(x))), labels)


def _mlp_case(batch=128, hidden=1024):
    with torch.device("meta"):
        model = MLP(hidden)
    return model, (torch.empty(batch, hidden, device="meta"), torch.zeros(batch, dtype=torch.long, device="meta"))


def _ctx(plan, captured, coords=None):
    sizes = tuple(plan.mesh.shape)
    return PassContext(plan, sizes, coords=coords or (0,) * len(sizes),
                       group_names=tuple(f"axis{a}" for a in range(len(sizes))),
                       grad_names=tuple(captured.grad_param_names))


def _captured(model, inputs):
    c = capture(model, inputs)
    canonicalize(c.gm)
    return c


def test_megatron_mlp_passes_structure():
    """Column-then-row MLP: one redistribute (the forward all-reduce) plus gradient/loss moves."""
    model, inputs = _mlp_case()
    plan = autopar.plan(model, inputs, mesh=autopar.Mesh((4,), hardware="a100"), num_stages=None)   # on (4,) as given
    c = _captured(model, inputs)
    ctx = _ctx(plan, c)
    gm = c.gm
    verify(gm, "captured", ctx)
    for name, fn in PIPELINE:
        gm = fn(gm, ctx)
        verify(gm, name, ctx)
        redists = [n for n in gm.graph.nodes if n.target is redistribute]
        if name == "insert_redistribute":
            # the only forward reduction is the row-parallel output's partial sum
            fwd = [n for n in redists if n.meta["phase"] == "forward" and spec_str(n.meta["autopar_src"]) == "(P)"]
            assert len(fwd) == 1
        if name == "lower_collectives":
            assert not redists
        if name == "fuse_addmm":  # fc1's bias joins its mm again; fc2's is added after the all-reduce
            fwd = [n for n in gm.graph.nodes if n.op == "call_function" and n.meta.get("phase") == "forward"]
            assert [str(n.target) for n in fwd if n.target in (aten.addmm.default, aten.mm.default)] == \
                ["aten.addmm.default", "aten.mm.default"]
            (mm,) = [n for n in fwd if n.target is aten.mm.default]
            assert [str(u.target) for u in mm.users] == ["_c10d_functional.all_reduce.default"]
    emitted = Counter((c["kind"], c["phase"]) for c in emitted_collectives(gm))
    assert emitted == Counter((r.kind, r.phase) for r in plan.collectives)
    assert emitted[("all_reduce", "forward")] == 1
    # parameters enter the per-rank program as the plan's local shards
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.meta["autopar_role"] == "param":
            p = plan.params[node.meta["autopar_name"]]
            assert local_shape(node.meta["autopar_outs"][0], p.shape, (4,)) == tuple(
                s // 4 if m == "S0" and d == 0 or m == "S1" and d == 1 else s
                for d, (s, m) in enumerate(zip(p.shape, p.master * len(p.shape))))


def test_passes_with_nothing_to_do_leave_the_graph_unchanged():
    model, inputs = _mlp_case(batch=8, hidden=16)
    plan = autopar.plan(model, inputs, mesh=autopar.Mesh((1,), hardware="a100"))
    c = _captured(model, inputs)
    ctx = _ctx(plan, c)
    gm = PIPELINE[0][1](c.gm, ctx)
    before = gm.code
    for name, fn in PIPELINE[1:]:
        if name in ("fuse_addmm", "tidy"):  # not distribution passes: they rejoin the split addmm and
            continue                          # cancel capture's transposes at any world size
        gm = fn(gm, ctx)
        verify(gm, name, ctx)
        assert gm.code == before, name


def test_run_passes_dumps_and_skips(tmp_path, monkeypatch):
    model, inputs = _mlp_case(batch=8, hidden=16)
    plan = autopar.plan(model, inputs, mesh=autopar.Mesh((1,), hardware="a100"))
    c = _captured(model, inputs)
    ctx = _ctx(plan, c)
    ctx.disabled = frozenset({"localize_shapes"})
    monkeypatch.setenv("AUTOPAR_DUMP_DIR", str(tmp_path))
    run_passes(c.gm, ctx, verify=True)
    dumped = sorted(p.name for p in tmp_path.iterdir())
    ran = [(i, name) for i, (name, _) in enumerate(PIPELINE, start=1) if name != "localize_shapes"]
    assert dumped == sorted(f"{i:02d}_{name}_{when}.py" for i, name in ran for when in ("before", "after"))
    assert "01_apply_plan_before.py" in dumped and not any("localize_shapes" in d for d in dumped)
    assert set(ctx.timings) == {name for _, name in ran}


def test_env_switches_off_optional_passes_only(monkeypatch):
    """AUTOPAR_DISABLE_PASSES skips the named optimisation passes; unknown or required names are refused."""
    from autopar.errors import InputError
    model, inputs = _mlp_case(batch=8, hidden=16)
    plan = autopar.plan(model, inputs, mesh=autopar.Mesh((2,), hardware="a100"), strategy="dp")
    c = _captured(model, inputs)
    ctx = _ctx(plan, c)
    monkeypatch.setenv("AUTOPAR_DISABLE_PASSES", " schedule_overlap,bucket_collectives,fuse_addmm ")
    gm = run_passes(c.gm, ctx, verify=True)
    assert set(ctx.timings) == {name for name, _ in PIPELINE} - {"schedule_overlap", "bucket_collectives", "fuse_addmm"}
    targets = Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    assert not any("fused" in t or "start_" in t for t in targets), targets  # nothing bucketed or started early
    assert sorted(c["kind"] for c in emitted_collectives(gm)) == sorted(c.kind for c in plan.collectives)
    assert not any("addmm" in t for t in targets), targets  # the mm + add that canonicalize split stay apart
    for bad, says in (("lower_colectives", "unknown passes"), ("localize_shapes", "program is wrong")):
        monkeypatch.setenv("AUTOPAR_DISABLE_PASSES", bad)
        with pytest.raises(InputError, match=says):
            run_passes(_captured(model, inputs).gm, _ctx(plan, c))

def test_fuse_addmm_joins_only_an_mm_whose_sole_user_is_a_1d_bias_add():
    """add(mm, b) and add(b, mm) become addmm with the same values; an mm used twice, a bias add with
    alpha or of another dtype, and a 2-D addend stay apart."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopar.passes.fuse_addmm import fuse_addmm_pass

    def f(x, w, b, b16, g):
        y1 = aten.add.Tensor(aten.mm.default(x, aten.t.default(w)), b)         # fused
        y2 = aten.add.Tensor(b, aten.mm.default(x, w))                         # fused (bias first)
        m = aten.mm.default(x, w)
        y3 = aten.add.Tensor(m, b) + m                                         # mm used twice
        y4 = aten.add.Tensor(aten.mm.default(x, w), b, alpha=2)                # alpha
        y5 = aten.add.Tensor(aten.mm.default(x, w), b16)                       # promotes to float64
        y6 = aten.add.Tensor(aten.mm.default(x, w), g)                         # a 2-D operand (a gradient)
        return y1, y2, y3, y4, y5, y6

    args = (torch.randn(6, 4), torch.randn(4, 4), torch.randn(4), torch.randn(4, dtype=torch.float64),
            torch.randn(6, 4))
    gm = make_fx(f)(*args)
    want = gm(*args)
    gm = fuse_addmm_pass(gm, None)
    ops = Counter(n.target for n in gm.graph.nodes if n.op == "call_function")
    assert ops[aten.addmm.default] == 2 and ops[aten.mm.default] == 4, ops
    assert all(n.meta["autopar_pass"] == "fuse_addmm" and n.meta["val"].shape == (6, 4)
               for n in gm.graph.nodes if n.target is aten.addmm.default)
    for got, ref in zip(gm(*args), want):
        torch.testing.assert_close(got, ref)
    assert fuse_addmm_pass(gm, None).code == gm.code  # nothing left to do


def test_tidy_cancels_permute_pairs_merges_views_and_duplicates_with_the_same_values():
    """Each rewrite on a hand-built graph: values unchanged, fewer nodes; random ops, other phases and
    values a later in-place write may change are never merged; a tidy graph is left unchanged."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopar.passes.tidy import tidy_pass

    def f(x, w, labels):
        wt = aten.permute.default(w, [1, 0])
        wt2 = aten.permute.default(w, [1, 0])                                      # duplicate of wt
        y = aten.mm.default(x, wt)
        back = aten.mm.default(y, aten.permute.default(wt2, [1, 0]))                # permute pair -> w
        p3 = aten.permute.default(aten.permute.default(x.view(2, 3, 4), [1, 0, 2]), [0, 2, 1])  # -> [1, 2, 0]
        flat = aten.view.default(aten.view.default(y, [2, 3, 4]), [24])            # -> view(y, [24])
        ne1, ne2 = aten.ne.Scalar(labels, -100), aten.ne.Scalar(labels, -100)     # merged
        ints, floats = aten.full.default([3], 1), aten.full.default([3], 1.0)     # other dtypes: kept apart
        drop1, drop2 = aten.rand_like.default(y), aten.rand_like.default(y)        # random: kept apart
        return back, p3, flat, ne1 & ne2, drop1, drop2, ints, floats

    args = (torch.randn(6, 4), torch.randn(4, 4), torch.tensor([1, -100, 3]))
    gm = make_fx(f)(*args)
    for n in gm.graph.nodes:
        n.meta["phase"] = "forward"
    before = Counter(n.target for n in gm.graph.nodes if n.op == "call_function")
    torch.manual_seed(0)
    want = gm(*args)
    gm = tidy_pass(gm, None)
    after = Counter(n.target for n in gm.graph.nodes if n.op == "call_function")
    assert after[aten.permute.default] == 2 and before[aten.permute.default] == 5, after  # wt, p3
    assert after[aten.view.default] == 2 and after[aten.ne.Scalar] == 1 and after[aten.rand_like.default] == 2
    assert after[aten.full.default] == 2
    (p3,) = [n for n in gm.graph.nodes if n.target is aten.permute.default and len(n.args[1]) == 3]
    assert list(p3.args[1]) == [1, 2, 0]
    torch.manual_seed(0)
    for got, ref in zip(gm(*args), want):
        assert torch.equal(got, ref) and got.dtype == ref.dtype
    assert tidy_pass(gm, None).code == gm.code  # nothing left to do

    # duplicates of different phases, or reading a bucket buffer (written in place later), stay apart
    from autopar.passes.ops import bucket_buffer, mm_into
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    t_fwd = graph.call_function(aten.permute.default, (a, [1, 0]))
    t_bwd = graph.call_function(aten.permute.default, (a, [1, 0]))
    flat = graph.call_function(bucket_buffer, (16, torch.float32, "cpu"))
    slot = graph.call_function(mm_into, (t_fwd, b, flat, 0))
    v1, v2 = (graph.call_function(aten.view.default, (slot, [16])) for _ in range(2))
    graph.output((t_fwd, t_bwd, v1, v2))
    for node, phase in zip(graph.nodes, ["forward"] * 3 + ["backward"] * 5):
        node.meta["phase"] = phase
    gm = fx.GraphModule({}, graph)
    assert tidy_pass(gm, None).code == gm.code


# ------------------------------------------------------------------ lowering numerics on gloo ranks

def _redistribute_graph(src, dst, shape) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    r = g.call_function(redistribute, (x, spec_str(src), spec_str(dst)))
    g.output(r)
    val = torch.empty(shape)
    x.meta.update(val=val, autopar_outs=(src,))
    r.meta.update(val=val, autopar_outs=(dst,), autopar_ins=(src,), autopar_src=src, phase="forward",
                  autopar_reason="test")
    return fx.GraphModule(nn.Module(), g)


def _shard_of(full: torch.Tensor, spec, coords, sizes, rank) -> torch.Tensor:
    """This rank's local value of `full` under `spec` (Partial: rank-dependent summands)."""
    from autopar.runtime.tensors import local_slice
    x = local_slice(full, spec, coords, sizes)
    for axis, p in enumerate(spec):
        if p == P:
            x = x * (0.25 + coords[axis]) / (0.25 * sizes[axis] + sum(range(sizes[axis])))
    return x


def _lowering_worker(rank, world, shape, cases):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    sizes = (2, 2) if world == 4 else (2,)
    mesh = init_device_mesh("cpu", sizes)
    coords = tuple(mesh.get_coordinate())
    groups = tuple(mesh.get_group(a).group_name for a in range(len(sizes)))
    full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    bad = []
    for src, dst in cases:
        gm = _redistribute_graph(src, dst, shape)
        ctx = PassContext(plan=None, axis_sizes=sizes, coords=coords, group_names=groups)
        ctx_names = type("N", (), {"axis_names": tuple(f"a{i}" for i in range(len(sizes)))})
        ctx.plan = type("Pl", (), {"mesh": ctx_names})()
        gm = lower_collectives_pass(gm, ctx)
        got = gm(_shard_of(full, src, coords, sizes, rank).clone()).clone()
        # reassemble Partial outputs across ranks before comparing with the expected shard
        for axis, p in enumerate(dst):
            if p == P:
                dist.all_reduce(got, group=mesh.get_group(axis))
            elif p == PAVG:
                dist.all_reduce(got, group=mesh.get_group(axis))
                got = got / sizes[axis]
        want = _shard_of(full, tuple(R if p in (P, PAVG) else p for p in dst), coords, sizes, rank)
        if got.shape != want.shape or not torch.allclose(got, want):
            bad.append(f"{spec_str(src)}->{spec_str(dst)}: got {tuple(got.shape)} want {tuple(want.shape)}")
    return bad


PLACEMENTS = [R, S(0), S(1), P, PAVG]


def test_lowering_numerics_1d():
    cases = [(a, b) for a, b in itertools.product(PLACEMENTS, PLACEMENTS) if a != b and a != PAVG]
    cases = [((a,), (b,)) for a, b in cases]
    bad = run_distributed(_lowering_worker, 2, (4, 6), cases, timeout=300)
    assert bad == [[], []]


def test_lowering_numerics_3d_middle_dims():
    """Gathers and reduce-scatters along a middle or last dim (one permute-copy each way), and to and
    from strided shards (k pieces of a dim, each split over the ranks: a fused qkv column split)."""
    placements = [R, S(0), S(1), S(2), P, SS(1, 3), SS(2, 2)]
    cases = [((a,), (b,)) for a, b in itertools.product(placements, placements) if a != b]
    bad = run_distributed(_lowering_worker, 2, (2, 6, 4), cases, timeout=300)
    assert bad == [[], []]


def test_lowering_numerics_2d_mesh_nested_shards():
    specs = [(R, R), (S(0), S(0)), (S(0), S(1)), (S(1), S(0)), (S(0), R), (R, S(0)), (P, S(0)), (S(0), P), (P, P)]
    cases = [(a, b) for a, b in itertools.product(specs, specs) if a != b and P not in b[:1] + b[1:]]
    cases += [((S(0), S(0)), (P, R)), ((R, R), (P, S(1)))]
    bad = run_distributed(_lowering_worker, 4, (8, 4), cases, timeout=600)
    assert bad == [[]] * 4


# ------------------------------------------------------------------ what each recipe emits

def _emitted(plan, captured):
    gm = run_passes(captured.gm, _ctx(plan, captured), verify=True)
    return emitted_collectives(gm)


def test_dp_emits_gradient_all_reduces_and_no_forward_tensor_traffic(gpt_case):
    model, inputs = gpt_case
    plan = autopar.plan(model, inputs, mesh=autopar.Mesh((2,)), strategy="dp", baselines=False)
    emitted = _emitted(plan, _captured(model, inputs))
    # no collective in the forward: every rank counts the whole batch's targets itself (the exact
    # global mean's denominator), so the loss's sum is all-reduced once, with the gradients
    assert [c for c in emitted if c["phase"] == "forward"] == []
    assert not any(r.phase == "forward" for r in plan.collectives)
    others = [c for c in emitted if not c["reason"].startswith("gradient")]
    assert [(c["kind"], c["phase"], c["reason"]) for c in others] == [("all_reduce", "backward", "loss to every rank")]
    grads = [c for c in emitted if c["reason"].startswith("gradient")]
    assert len(grads) == len(plan.params) and {c["kind"] for c in grads} == {"all_reduce"}


def test_zero3_gathers_weights_in_forward_and_backward_and_reduce_scatters_gradients(gpt_case):
    model, inputs = gpt_case
    plan = autopar.plan(model, inputs, mesh=autopar.Mesh((2,)), strategy="zero3", baselines=False)
    emitted = _emitted(plan, _captured(model, inputs))
    sharded = {n for n, p in plan.params.items() if p.master != ("R",)}
    assert len(sharded) == len(plan.params)  # every parameter divides by 2 here
    grads = [c for c in emitted if c["reason"].startswith("gradient")]
    assert len(grads) == len(sharded) and {c["kind"] for c in grads} == {"reduce_scatter"}
    weight_gathers = {ph: sum(1 for c in emitted if c["kind"] == "all_gather" and c["phase"] == ph
                              and c["reason"].startswith("(S0)->(R)")) for ph in ("forward", "backward")}
    matrices = [n for n, p in plan.params.items() if len(p.shape) == 2]
    assert weight_gathers["forward"] >= len(matrices) and weight_gathers["backward"] >= len(matrices) - 1


def test_zero3_gathers_stay_next_to_their_use_and_verify_catches_hoisting(gpt_case):
    """Fusing gradient collectives re-sorts the graph; that sort must not hoist every ZeRO-3 gather to
    the top (all weights gathered at once, many async collectives in flight)."""
    from torch.fx.passes.tools_common import legalize_graph

    from autopar.ir import IRError, verify
    model, inputs = gpt_case
    plan = autopar.plan(model, inputs, mesh=autopar.Mesh((2,)), strategy="zero3", baselines=False)
    captured = _captured(model, inputs)
    ctx = _ctx(plan, captured)
    gm = run_passes(captured.gm, ctx, verify=True)
    nodes = list(gm.graph.nodes)
    gathers = [i for i, n in enumerate(nodes) if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default]
    # every gather is used right after its wait (a few view/copy nodes at most), not at the top
    for i in gathers:
        wait = nodes[i + 1]
        first_use = min(nodes.index(u) for u in wait.users)
        assert first_use - i <= 4, nodes[i].name
    legalize_graph(gm)  # an unstable topological sort (what the pass used to call) hoists them
    with pytest.raises(IRError, match="in flight"):
        verify(gm, "bucket_collectives", ctx)


def test_zero1_parameter_gathers_are_bucketed_like_the_cost_model_prices_them(gpt_case):
    """ZeRO-1/2 masters are gathered once per step: one fused all-gather (flat buckets) that still
    lists every logical gather, as autopar.planning.problem prices them (bucketed latency)."""
    from autopar.passes.ops import fused_all_gather
    model, inputs = gpt_case
    plan = autopar.plan(model, inputs, mesh=autopar.Mesh((2,)), strategy="zero1", baselines=False)
    gm = run_passes(_captured(model, inputs).gm, _ctx(plan, _captured(model, inputs)), verify=True)
    fused = [n for n in gm.graph.nodes if n.target is fused_all_gather]
    planned = [r for r in plan.collectives if r.reason == "parameter gather (ZeRO-1/2)"]
    assert len(fused) == 1 and len(fused[0].meta["autopar_fused"]) == len(planned) > 1
    assert not any(n.target is torch.ops._c10d_functional.all_gather_into_tensor.default for n in gm.graph.nodes)
    emitted = Counter((c["kind"], c["phase"]) for c in emitted_collectives(gm))
    assert emitted == Counter((r.kind, r.phase) for r in plan.collectives)


def test_fused_all_gather_matches_one_gather_per_tensor():
    bad = run_distributed(_fused_gather_worker, 2, timeout=300)
    assert bad == [[], []]


def _fused_gather_worker(rank, world):
    import torch.distributed as dist

    from autopar.passes.ops import fused_all_gather
    group = dist.group.WORLD.group_name
    tensors = [torch.arange(6.0).reshape(3, 2) + 10 * rank, torch.full((2,), float(rank)),
               torch.arange(8.0).reshape(1, 2, 4) - rank]
    got = fused_all_gather(tensors, world, group)
    bad = []
    for t, g in zip(tensors, got):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        if not torch.equal(g, torch.cat(parts)):
            bad.append(tuple(t.shape))
    return bad


def test_tp_mlp_emits_exactly_the_plans_activation_all_reduces():
    model, inputs = _mlp_case()
    plan = autopar.plan(model, inputs, mesh=autopar.Mesh((4,), hardware="a100"), strategy="tp", baselines=False)
    emitted = _emitted(plan, _captured(model, inputs))
    act = [c for c in emitted if not c["reason"].startswith("gradient") and c["reason"] != "loss to every rank"]
    planned = [r for r in plan.collectives if r.reason != "gradient" and r.reason != "loss to every rank"]
    assert Counter((c["kind"], c["phase"]) for c in act) == Counter((r.kind, r.phase) for r in planned)
    assert [c["kind"] for c in act if c["phase"] == "forward"] == ["all_reduce"]
