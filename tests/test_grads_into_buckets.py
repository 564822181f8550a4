"""grads_into_buckets: matmul weight gradients are computed into their all-reduce bucket's buffer.

Structure on a lowered tiny GPT, the rules on hand-built graphs (a second reader or a non-cancelling
permute keeps the copy), and the runtime ops' values; two-rank training with the pass on is covered
by tests/test_schedule_overlap.py and the runtime equivalence tests (it is in the default pipeline).
"""
from __future__ import annotations

import operator
from collections import Counter

import pytest
import torch
import torch.fx as fx

from autopar._testing.dist_cases import lowered_for_rank0_of_2 as _lowered
from autopar.passes import OPTIONAL, PIPELINE, PassContext, emitted_collectives
from autopar.passes.grads_into_buckets import grads_into_buckets_pass
from autopar.passes.ops import _fill, _flatten, bucket_buffer, mm_into, start_all_reduce, wait_buckets
from autopar.passes.schedule_overlap import local_numel_dtype
from autopar.placement import replicated

aten = torch.ops.aten


def _targets(gm) -> Counter:
    return Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def test_dp_weight_gradients_are_computed_in_their_bucket(gpt_case):
    plan, ctx, gm = _lowered(gpt_case, "dp")
    _, _, plain = _lowered(gpt_case, "dp", disabled={"grads_into_buckets"})
    model = gpt_case[0]
    weights = [n for n, p in model.named_parameters() if p.dim() == 2 and "wte" not in n and "wpe" not in n]
    into = [n for n in gm.graph.nodes if n.target is mm_into]
    assert len(into) == len(weights)  # every linear's weight gradient; the tied embedding's sum is copied
    # one mm fewer for each, nothing else changed
    diff = _targets(plain) - _targets(gm)
    assert diff == Counter({aten.mm.default: len(into)})
    assert _targets(gm) - _targets(plain) == Counter({mm_into: len(into), bucket_buffer: 1})
    buffer = next(n for n in gm.graph.nodes if n.target is bucket_buffer)
    start = next(n for n in gm.graph.nodes if n.target is start_all_reduce and n.kwargs.get("into") is buffer)
    at = {n: i for i, n in enumerate(gm.graph.nodes)}
    assert at[buffer] < min(at[n] for n in into) and max(at[n] for n in into) < at[start]
    # the layout is the start's: members one after another by their local sizes (dp: whole)
    numels = [local_numel_dtype(m, ctx)[0] for m in start.args[0]]
    assert buffer.args[0] == sum(numels)
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    for node in into:  # each slot's offset is its member's, and the member is that mm's result
        member = node
        while member not in start.args[0]:
            (member,) = member.users
            assert member.target is aten.permute.default
        assert node.args[3] == offsets[start.args[0].index(member)]
    key = lambda c: (c["kind"], c["phase"], c["reason"])  # noqa: E731
    assert sorted(map(key, emitted_collectives(gm))) == sorted(map(key, emitted_collectives(plain)))
    assert Counter((c["kind"], c["phase"]) for c in emitted_collectives(gm)) == \
        Counter((r.kind, r.phase) for r in plan.collectives)
    assert [name for name, _ in PIPELINE][-2:] == ["grads_into_buckets", "tidy"] and "grads_into_buckets" in OPTIONAL


@pytest.mark.parametrize("strategy", ["zero3", "tp"])
def test_nothing_to_lay_out_leaves_the_graph_unchanged(gpt_case, strategy):
    """zero3 reduce-scatters its gradients (strided slots); tp's are local: no all-reduce bucket."""
    _, ctx, gm = _lowered(gpt_case, strategy, disabled={"grads_into_buckets"})
    before = gm.code
    assert grads_into_buckets_pass(gm, ctx) is gm and gm.code == before


# ------------------------------------------------------------------ hand-built graphs

def _bucket_graph(second_reader: bool = False, perms=((1, 0), (1, 0)), mixed_dtype: bool = False):
    """grad = permutes(mm(a, b)); bias = sum(c); one all-reduce bucket of [bias, grad]; returns gm."""
    g = fx.Graph()
    spec = replicated(1)

    def node(n, val):
        n.meta.update(val=val, autopar_outs=(spec,))
        return n

    a = node(g.placeholder("a"), torch.empty(4, 6))
    b = node(g.placeholder("b"), torch.empty(6, 3))
    c = node(g.placeholder("c"), torch.empty(5, 2, dtype=torch.float64 if mixed_dtype else torch.float32))
    mm = node(g.call_function(aten.mm.default, (a, b)), torch.empty(4, 3))
    grad, shape = mm, (4, 3)
    for p in perms:
        shape = tuple(shape[d] for d in p)
        grad = node(g.call_function(aten.permute.default, (grad, list(p))), torch.empty(shape))
    bias = node(g.call_function(aten.sum.dim_IntList, (c, [0])), torch.empty(2, dtype=c.meta["val"].dtype))
    start = g.call_function(start_all_reduce, ([bias, grad], "sum", "0"))
    wait = g.call_function(wait_buckets, (start,))
    outs = [g.call_function(operator.getitem, (wait, k)) for k in range(2)]
    if second_reader:
        outs.append(g.call_function(aten.mul.Tensor, (grad, 2.0)))
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g)


def test_a_cancelling_permute_chain_is_computed_in_its_slot():
    gm = grads_into_buckets_pass(_bucket_graph(), PassContext(None, (2,), device="cpu"))
    (into,) = [n for n in gm.graph.nodes if n.target is mm_into]
    (buffer,) = [n for n in gm.graph.nodes if n.target is bucket_buffer]
    assert buffer.args == (2 + 12, torch.float32, "cpu") and into.args[2:] == (buffer, 2)
    assert aten.mm.default not in _targets(gm)
    start = next(n for n in gm.graph.nodes if n.target is start_all_reduce)
    assert start.kwargs["into"] is buffer


@pytest.mark.parametrize("kw", [dict(second_reader=True), dict(perms=((1, 0),)), dict(mixed_dtype=True)],
                         ids=["read-after-reduction", "transposed-slot", "mixed-dtypes"])
def test_the_copy_stays_where_the_slot_would_be_wrong(kw):
    gm = _bucket_graph(**kw)
    before = gm.code
    assert grads_into_buckets_pass(gm, PassContext(None, (2,), device="cpu")).code == before


# ------------------------------------------------------------------ the runtime ops

def test_fill_copies_only_what_is_not_in_its_slot():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 6, generator=gen), torch.randn(6, 3, generator=gen)
    bias, other = torch.randn(2, generator=gen), torch.randn(3, 5, generator=gen).t()
    flat = bucket_buffer(2 + 12 + 15, torch.float32, "cpu")
    grad = mm_into(a, b, flat, 2)
    assert grad.data_ptr() == flat[2:].data_ptr() and torch.equal(grad, a @ b)
    filled = _fill(flat, [bias, grad, other])
    assert filled is flat and torch.equal(flat, _flatten([bias, a @ b, other]))
    with pytest.raises(AssertionError, match="other local sizes"):
        _fill(bucket_buffer(3, torch.float32, "cpu"), [bias, grad])
    with pytest.raises(RuntimeError, match="single memory location"):  # a slot seen transposed: refused
        _fill(flat[:14], [bias, flat[2:14].view(3, 4).t()])


def test_memtrack_books_the_bucket_buffer_as_gradients_not_activations():
    """The buffer is the storage of the gradients the program returns (the plan's "grads"), as the
    flat buffer inside start_all_reduce was; only the activation counts."""
    from autopar.runtime.memtrack import peak_activation_bytes
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    flat = g.call_function(bucket_buffer, (24, torch.float32, "cpu"))
    grad = g.call_function(mm_into, (a, b, flat, 0))
    act = g.call_function(aten.relu.default, (a,))  # the buffer is live here: a later gradient needs it
    later = g.call_function(mm_into, (act, b, flat, 12))
    g.output((grad, later, g.call_function(aten.sum.default, (act,))))
    gm = fx.GraphModule(torch.nn.Module(), g)
    peak = peak_activation_bytes(gm, torch.randn(4, 6), torch.randn(6, 3))
    assert (peak.peak_bytes, peak.at_node) == (4 * 6 * 4, act.name)
