"""split_weight_grads: a stage's backward program -> an input-gradient program (B) and a weight-gradient one (W).

Zero-bubble schedules (`schedule="zero_bubble"`, torch.distributed.pipelining's ScheduleInterleavedZeroBubble:
the ZB-H1 schedule of Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) run a micro-batch's backward in
two parts: B, the gradients of the stage's boundary inputs, which the previous stage waits for, as soon as the
schedule can; W, the parameter gradients, later, in what would be the pipeline's bubble.

The backward program (`split_stages`) returns (*parameter gradients, *input gradients). B is every op an input
gradient depends on; W every other op a parameter gradient depends on. B returns (*input gradients, *carried),
`carried` being the values W reads that B computes (the gradient of a layer's output, which its weight gradient
multiplies with the saved input); W reads the backward program's arguments it needs and the carried values and
returns the parameter gradients, in the backward program's order. Every op of the backward program runs in
exactly one of the two, so the pair computes the same values as the whole, once (`check_split`). A program
without input gradients (the first stage's) has an empty B: its whole backward is W. Collectives stay where
their values go: a tensor-parallel all-reduce of an activation gradient in B, a ZeRO reduce-scatter of a
parameter gradient in W; every rank of a sub-mesh group runs the same programs in the same order.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.graph import ancestors


@dataclass
class SplitBackward:
    """B and W of one backward program. `input_args` / `weight_args`: indices of the backward program's
    arguments each reads (W's carried values come after its arguments)."""
    input_program: fx.GraphModule
    weight_program: fx.GraphModule
    input_args: list[int]
    weight_args: list[int]
    num_carried: int


def split_weight_grads(gm: fx.GraphModule, num_param_grads: int) -> SplitBackward:
    """Cut `gm` (returning num_param_grads parameter gradients, then the input gradients) into B and W."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    results = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    param_grads, input_grads = results[:num_param_grads], results[num_param_grads:]
    need_b = set().union(*[ancestors(x) for x in input_grads if isinstance(x, fx.Node)])
    need_w = set().union(*[ancestors(x) for x in param_grads if isinstance(x, fx.Node)])
    ops = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    for n in ops:
        assert n in need_b or n in need_w or not n.is_impure(), \
            f"split_weight_grads: {n.name} ({n.target}) has an effect but no gradient reads it"
    # an output of a multi-output op that B runs is picked in B (a getitem): B hands W tensors, not tuples
    need_b |= {n for n in ops if n in need_w and n.target is operator.getitem and n.args[0] in need_b}
    in_w = [n for n in ops if n in need_w and n not in need_b]
    w_set = set(in_w)
    # B's values W reads: operands of W's ops, and parameter gradients B already made
    carried = [n for n in ops if n in need_b and (any(u in w_set for u in n.users) or n in param_grads)]
    assert not any(isinstance(n.meta.get("val"), (tuple, list)) for n in carried), "split_weight_grads: a tuple carried"
    b_ops = [n for n in ops if n in need_b]
    b_gm, b_args = _program(placeholders, b_ops, [], list(input_grads) + carried)
    w_gm, w_args = _program(placeholders, in_w, carried, param_grads)
    return SplitBackward(b_gm, w_gm, b_args, w_args, len(carried))


def with_weight_split(program):
    """A `split_stages.StageProgram` with its backward also as B and W (`backward_input`, `backward_weight`,
    their argument keys; W's carried values follow its arguments)."""
    cut = split_weight_grads(program.backward, len(program.grad_params))
    check_split(program.backward, cut)
    keys = program.backward_args
    return dataclasses.replace(program, backward_input=cut.input_program, backward_weight=cut.weight_program,
                               backward_input_args=[keys[i] for i in cut.input_args],
                               backward_weight_args=[keys[i] for i in cut.weight_args], num_carried=cut.num_carried)


def _program(placeholders: list[fx.Node], ops: list[fx.Node], carried: list[fx.Node],
             results: list) -> tuple[fx.GraphModule, list[int]]:
    """A graph of `ops` (in order) reading the placeholders they use, then `carried`, returning `results`."""
    used = {a for n in ops for a in n.all_input_nodes} | {r for r in results if isinstance(r, fx.Node)}
    graph, env, args = fx.Graph(), {}, []
    for i, ph in enumerate(placeholders):
        if ph in used:
            env[ph] = graph.placeholder(ph.name)
            env[ph].meta.update(ph.meta)
            args.append(i)
    for i, n in enumerate(carried):
        env[n] = graph.placeholder(f"carried_{i}")
        env[n].meta.update({k: v for k, v in n.meta.items() if k == "val"})
    for n in ops:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[r] if isinstance(r, fx.Node) else r for r in results))
    out = fx.GraphModule(torch.nn.Module(), graph)
    out.graph.lint()
    out.recompile()
    return out, args


def check_split(gm: fx.GraphModule, split: SplitBackward) -> None:
    """Every op of `gm` runs in exactly one of B and W (none twice, none dropped that has an effect)."""
    def targets(g: fx.GraphModule) -> list:
        return [n.name for n in g.graph.nodes if n.op not in ("placeholder", "output")]
    b, w = targets(split.input_program), targets(split.weight_program)
    assert not set(b) & set(w), f"split_weight_grads: ops in both B and W: {sorted(set(b) & set(w))[:5]}"
    assert set(b) | set(w) <= set(targets(gm))
