"""defer_grad_reductions: a pipelined program leaves its gradient all-reduces to the runtime, which
runs them once per step (after the schedule's last backward) instead of once per micro-batch.

The cost model counts a gradient's all-reduce once per step (`autopar.pipeline.layer_profile`: `per_step`),
as DDP's no_sync and torchtitan's pipelines run it. This pass, run by the pipelined
runtime after `run_passes` and before `split_stages` (it is not in `PIPELINE`), removes each
all-reduce (sum) that lowering put on the path from a gradient to the program's output
(reason "gradient of <param>"), so the program returns that gradient still Partial on the axis. The
runtime sums the micro-batches' partial gradients locally (p.grad accumulation) and all-reduces
each once, bucketed (`autopar/pipeline/runtime.py`). The sum over ranks commutes with the
micro-batch sum and with the linear ops after the removed collective (slices, copies, other axes'
reductions), so the step's numbers are unchanged but for the order of floating-point additions.

Reduce-scatters (ZeRO-1/2 gradients, ZeRO-3 weights) stay in the program and run once per
micro-batch, unbucketed (`bucket_collectives` is off under pipelines): deferring them would hold an
unsharded gradient across micro-batches, the memory ZeRO-2/3 save. The cost model counts them per
micro-batch too (`layer_profile.layer_costs` files a gradient edge's all-reduce seconds under
per_step, its other collectives under backward), though at the bucketed latency share.

Under a mixed-precision plan whose `reduce_dtype` is narrower than the gradient, lowering wrapped
the gradient's collectives in a cast down and back (`lower_collectives._reduce_dtype`): the record
then says the dtype the all-reduce moves ("dtype"), the runtime reduces in it, and a cast pair left
with nothing between it (every collective inside deferred) is removed, so the micro-batches'
gradients are summed in fp32 and rounded once, at the step's reduction.

Each removed collective's record (the `autopar_collective` dict of its wait node, plus the parameter
and the process-group name) goes to gm.meta["autopar_deferred"], so the program's collectives plus
the deferred ones are still `Plan.collectives` (tests/test_pipeline.py checks it).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autopar.graph import COLLECTIVE, DEFERRED, OUTS, PASS, VAL
from autopar.placement import P

from .context import PassContext

c10d = torch.ops._c10d_functional
LOWERED = "lower_collectives"


def _chain(g: fx.Node) -> list[fx.Node]:
    """The nodes lowering made for one gradient's redistribute, from the output backwards, each the
    single user's input of the next (so nothing else reads an intermediate value)."""
    chain, node = [], g
    while (node.op == "call_function" and node.meta.get(PASS) == LOWERED and node.args
           and isinstance(node.args[0], fx.Node) and len(node.users) == 1):
        chain.append(node)
        node = node.args[0]
    return chain


def _deferrable(wait: fx.Node, name: str) -> bool:
    info = wait.meta.get(COLLECTIVE, {})
    coll = wait.args[0] if wait.target is c10d.wait_tensor.default else None
    return (coll is not None and coll.target is c10d.all_reduce.default and coll.args[1] == "sum"
            and len(coll.users) == 1 and info.get("kind") == "all_reduce"
            and info.get("reason") == f"gradient of {name}")


def _wire_cast(chain: list[fx.Node]) -> fx.Node | None:
    """The cast down to the reduce dtype that lowering put first in a gradient's chain, if any."""
    first = chain[-1] if chain else None
    if first is not None and first.target is torch.ops.aten._to_copy.default and "dtype" in first.kwargs:
        return first
    return None


def _drop_cast_pair(gm: fx.GraphModule, down: fx.Node) -> None:
    """down -> up back to the gradient's dtype, with nothing left between them: both removed."""
    up = next(iter(down.users))
    if len(down.users) == 1 and up.target is torch.ops.aten._to_copy.default and \
            up.kwargs.get("dtype") == down.args[0].meta[VAL].dtype:
        up.replace_all_uses_with(down.args[0])
        gm.graph.erase_node(up)
        gm.graph.erase_node(down)


def defer_grad_reductions_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Gradient all-reduces -> gm.meta["autopar_deferred"] (see the module docstring)."""
    deferred = []
    out = gm.graph.output_node()
    for k, name in enumerate(ctx.grad_names, start=1):
        chain = _chain(out.args[0][k])
        down = _wire_cast(chain)
        wire = str(down.kwargs["dtype"]).removeprefix("torch.") if down is not None else None
        waits = [n for n in chain if _deferrable(n, name)]
        for wait in waits:
            coll = wait.args[0]
            info = wait.meta[COLLECTIVE]
            axis = ctx.axis_names.index(info["axis"])
            deferred.append(dict(info, param=name, group=coll.args[2], axis_index=axis, dtype=wire))
            wait.replace_all_uses_with(coll.args[0])
            gm.graph.erase_node(wait)
            gm.graph.erase_node(coll)
        if waits and down is not None:
            _drop_cast_pair(gm, down)
            end = out.args[0][k]   # the gradient the program now returns: Partial on that axis
            if end.meta.get(PASS) == LOWERED and OUTS in end.meta:
                spec = list(end.meta[OUTS][0])
                spec[axis] = P
                end.meta[OUTS] = (tuple(spec),)
    if not deferred:
        return gm  # nothing to defer: the graph is returned unchanged
    gm.meta[DEFERRED] = deferred
    gm.graph.lint()
    gm.recompile()
    return gm
