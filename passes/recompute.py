"""recompute: re-run the forward ops of each layer in `plan.recompute` right before backward needs
them, so the originals die at the end of forward (activation checkpointing, chosen by the solver).

Which ops are copied is `autopar.planning.recompute.copied_nodes`: what backward reads of the layer, and
their inputs inside it; the layer's outputs (read by later layers) stay the checkpoints. Random ops
(dropout) are never copied: the copies read the original mask, so recompute reproduces it exactly
(the mask is kept, the RNG is not replayed). The copies carry the originals' meta (value, planned
placement, module path) with phase "backward" and meta["autopar_pass"] = "recompute"; later passes
treat them as any op, so their input reshards (TP all-reduces, ZeRO-3 gathers) run again too.

FX frees each value after its last use (the generated code sets it to None; `fx.Interpreter`
deletes it), so once backward reads the copies, the originals' last use is in forward.
"""
from __future__ import annotations

import torch.fx as fx

from autopar.graph import reads_in_backward
from autopar.planning.recompute import copied_nodes, layer_nodes

from .context import PassContext


def rematerialize(gm: fx.GraphModule, copies: list[fx.Node], path: str) -> dict[fx.Node, fx.Node]:
    """Insert copies of `copies` (graph order) before the first backward op that reads one of them
    and point every backward reader at the copies; returns original -> copy."""
    if not copies:
        return {}
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    readers = [u for v in copies for u in v.users if reads_in_backward(u)]
    anchor = min(readers, key=order.__getitem__)
    env: dict[fx.Node, fx.Node] = {}
    with gm.graph.inserting_before(anchor):
        for v in copies:
            c = gm.graph.node_copy(v, lambda a: env.get(a, a))
            c.meta = {**v.meta, "phase": "backward", "autopar_pass": "recompute", "autopar_recompute_of": v.name,
                      "autopar_recompute_layer": path}
            env[v] = c
    for v, c in env.items():
        for u in [u for u in v.users if reads_in_backward(u) and u is not c]:
            u.replace_input_with(v, c)
    return env


def recompute_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Copy each recomputed layer's forward ops into backward; no layer to recompute: unchanged."""
    paths = tuple(getattr(ctx.plan, "recompute", ()) or ())
    if not paths:
        return gm
    layers = layer_nodes(gm)
    for path in paths:
        assert path in layers, f"plan recomputes {path!r}, which has no forward op in this graph"
        rematerialize(gm, copied_nodes(layers[path]), path)
    gm.graph.lint()
    gm.recompile()
    return gm
