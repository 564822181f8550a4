"""A stamped layer's CostProblem is built from its template's (issue 27, "Fast"): the shortcut is compared
against enumerating every node afresh on stamped meta-device models, down to the solver's plan and the
pipeline search's unit profile. Planning only: one process."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import autopar
from autopar._testing import models
from autopar.capture import precision
from autopar.capture.canonicalize import canonicalize
from autopar.capture.stamp import stamped_templates
from autopar.capture.trace import capture
from autopar.costmodel.memory import optimizer_state_bytes_per_param
from autopar.graph import STAMPED_FROM
from autopar.mesh import Mesh
from autopar.pipeline.layer_profile import layer_costs, unit_names
from autopar.pipeline.search import Profiler
from autopar.planning.problem import ProblemBuilder
from autopar.planning.solver import min_memory, solve

LAYERS = 6


def _llama() -> models.Case:
    import transformers
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.zeros((8, 32), dtype=torch.long, device="meta")
    return models.Case(model, (ids,), {"labels": ids})


def _case(kind: str) -> models.Case:
    return models.meta_gpt(n_layer=LAYERS, n_embd=64, n_head=4, batch=8, seq=32) if kind == "gpt" else _llama()


def _captured(case: models.Case, bf16: bool):
    cap = capture(case.model, case.example_inputs,
                  mixed_precision=precision.as_policy("bf16" if bf16 else None))
    canonicalize(cap.gm)
    assert list(cap.stamped.values()) == [LAYERS]
    return cap


def _same_problem(a, b) -> None:
    assert [n.name for n in a.nodes] == [n.name for n in b.nodes]
    assert a.strategies == b.strategies
    assert [a.signatures.get(n) for n in a.nodes] == [b.signatures.get(n) for n in b.nodes]
    for x, y in zip(a.compute, b.compute):
        assert np.array_equal(x, y)
    for x, y in zip(a.local_comm, b.local_comm):
        assert np.array_equal(x, y)
    for x, y in zip(a.memory, b.memory):
        assert x.keys() == y.keys() and all(np.array_equal(x[c], y[c]) for c in x)
    assert a.edges == b.edges and a.loss_index == b.loss_index
    for x, y in zip(a.cg.nodes, b.cg.nodes):
        assert np.array_equal(x.time, y.time) and np.array_equal(x.memory, y.memory)
    assert len(a.cg.edges) == len(b.cg.edges)
    for x, y in zip(a.cg.edges, b.cg.edges):
        assert (x.src, x.dst) == (y.src, y.dst) and np.array_equal(x.time, y.time)
    assert a.cg.layer_groups == b.cg.layer_groups


@pytest.mark.parametrize("kind,bf16,shape", [("gpt", False, (2, 4)), ("llama", True, (2, 4)), ("llama", False, (8,))])
def test_stamped_problem_equals_enumerating_every_node(kind, bf16, shape):
    """The CostProblem built with stamped nodes taking their template's strategies equals the one built by
    enumerating every node: strategies, signatures, node costs, edges and matrices, layer classes; so do
    the solver's plans (with and without a memory row) and the unit profile read off them."""
    cap = _captured(_case(kind), bf16)
    mesh = Mesh(shape, hardware="h100", devices_per_node=8)
    templates = stamped_templates(cap.gm.graph)
    stamped = [n for n in cap.gm.graph.nodes if n.meta.get(STAMPED_FROM)]
    # LAYERS - 3 stamped copies of a layer; nearly every copied op makes its template's call
    assert len(templates) > 0.9 * len(stamped) > 0
    fast_builder = ProblemBuilder(cap, mesh)
    fast = fast_builder.build()
    full = ProblemBuilder(cap, mesh, reuse_stamped=False).build()
    assert fast_builder.enumerate.cache_hits >= len(templates)
    _same_problem(fast, full)
    opt = optimizer_state_bytes_per_param("adamw", torch.float32)
    for i, node in enumerate(full.nodes):   # placeholders priced once per kind: each equals its own pricing
        if node.op == "placeholder":
            mem = {c: np.zeros(len(full.strategies[i])) for c in full.memory[i]}
            comm = np.zeros(len(full.strategies[i]))
            trainable = node.meta["autopar_role"] == "param" and node.meta["autopar_name"] in cap.grad_param_names
            times = fast_builder._price_placeholder(node, full.strategies[i], mem, comm, opt, trainable)
            assert np.array_equal(times, full.compute[i]) and np.array_equal(comm, full.local_comm[i])
            # (activations: an input backward reads is counted after, as for any node)
            assert all(np.array_equal(mem[c], full.memory[i][c]) for c in mem if c != "activations")
    # a memory row on the 1-D mesh only: on the 2-D one it is a MIP of many seconds
    for budget in (None,) if len(shape) > 1 else (None, min_memory(full.cg) * 1.1):
        fast.cg.memory_budget = full.cg.memory_budget = budget
        a = solve(fast.cg, dedup_layers=True, cache=fast.solver_cache)
        b = solve(full.cg, dedup_layers=True, cache=full.solver_cache)
        # the same objective; among equal optima the solver may pick either (ties): the profiles read off
        # each plan agree whichever problem they are read from
        assert (a.time, a.memory, a.status) == (b.time, b.memory, b.status)
        for choice in (a.choice, b.choice):
            assert layer_costs(fast, choice, cap) == layer_costs(full, choice, cap)


def test_profiler_layers_equal_the_full_path():
    """`Profiler.layers` (stamped reuse, unit names kept per CostProblem) gives the unit profile of the
    full path: a fresh capture, a Problem built node by node, solved, its units read twice."""
    case = _case("llama")
    hw = autopar.Mesh((8,), hardware="h100").hardware
    # the full graph's path (stamped reuse); the three-layer graph's prices: tests/test_depth.py
    prof = Profiler(case.model, case.example_inputs, hw, 8, mixed_precision="bf16", shallow=False)
    prof.problem(4, 2, 4)   # another micro-batch size first: its priced reshard matrices are shared
    cap, _ = prof.captured(2)
    full = ProblemBuilder(cap, prof.sub_mesh(2, 4), reuse_stamped=False).build()
    _same_problem(prof.problem(2, 2, 4), full)
    for budget in (None,):
        got = prof.layers(2, 2, 4, budget)
        full.cg.memory_budget = budget
        sol = solve(full.cg, dedup_layers=True, cache=full.solver_cache)
        mine = prof.solution(2, 2, 4, budget)
        assert (mine.time, mine.memory) == (sol.time, sol.memory)
        assert got == tuple(layer_costs(full, mine.choice, cap))
        assert layer_costs(prof.problem(2, 2, 4), sol.choice, cap) == layer_costs(full, sol.choice, cap)
    prob = prof.problem(2, 2, 4)
    assert unit_names(prob) == unit_names(full) and len(unit_names(prob)[0]) == LAYERS + 2
