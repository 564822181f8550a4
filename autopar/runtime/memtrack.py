"""Measure the activation memory of one run of a per-rank program: the peak of live activation bytes.

`ActivationTracker` runs the joint forward+backward graph with `torch.fx.Interpreter`, which frees
each value after its last use exactly as the generated code does, and after every op sums the bytes
of the distinct storages still referenced. Counted: every value an op produced (activations, their
gradients, recomputed copies, collective buffers). Not counted: storages of the placeholders
(parameters, buffers, inputs) and of the program's outputs (the gradients handed to the optimizer
and the loss), whose bytes the plan books as "params" and "grads"; a gradient bucket's buffer
(`grads_into_buckets`) is the storage of the gradients it returns, so it is not counted either. The
figure compares with `Plan.memory_breakdown["activations"]`, which counts the values kept for
backward; the transient values around the op that sets the peak come on top.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.graph import PHASE, VIEW_OPS, packet
from autopar.passes.ops import bucket_buffer


@dataclass(frozen=True)
class ActivationPeak:
    peak_bytes: int          # largest sum of live activation bytes after any op
    at_node: str             # the op after which it was reached
    at_phase: str            # that op's phase ("forward" / "backward")
    end_of_forward: int      # live activation bytes after the last forward op


def _storages(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value.untyped_storage()]
    if isinstance(value, (tuple, list)):
        return [s for v in value for s in _storages(v)]
    return []


def _output_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The program's outputs and the values they are views of (same storage)."""
    out, stack = set(), list(gm.graph.output_node().all_input_nodes)
    while stack:
        n = stack.pop()
        if n in out:
            continue
        out.add(n)
        if n.op == "call_function" and (packet(n) in VIEW_OPS or n.target.__name__ == "getitem"):
            stack.extend(n.all_input_nodes)
    return out


class ActivationTracker(fx.Interpreter):
    """`ActivationTracker(gm).measure(*args)` -> ActivationPeak (runs the program once)."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=True)
        self._excluded_nodes = _output_nodes(gm)
        self._last_forward = max((k for k, n in enumerate(gm.graph.nodes) if n.meta.get(PHASE) == "forward"),
                                 default=-1)

    def measure(self, *args) -> ActivationPeak:
        self._excluded = {s.data_ptr() for a in args for s in _storages(a)}
        self._peak, self._at, self._end_fwd, self._k = 0, None, 0, 0
        with torch.no_grad():
            self.run(*args)
        node = self._at
        return ActivationPeak(self._peak, node.name if node else "", node.meta.get(PHASE, "") if node else "",
                              self._end_fwd)

    def run_node(self, n: fx.Node):
        result = super().run_node(n)
        if n.op == "call_function" and n.target is bucket_buffer:  # the returned gradients' storage
            self._excluded.add(result.untyped_storage().data_ptr())
        live = self._live_bytes(n, result)
        if live > self._peak:
            self._peak, self._at = live, n
        if self._k == self._last_forward:
            self._end_fwd = live
        self._k += 1
        return result

    def _live_bytes(self, current: fx.Node, result) -> int:
        seen: dict[int, int] = {}
        for node, value in [*self.env.items(), (current, result)]:
            if node.op == "placeholder" or node in self._excluded_nodes:
                continue
            for s in _storages(value):
                ptr = s.data_ptr()
                if ptr not in self._excluded and ptr != 0:
                    seen[ptr] = s.nbytes()
        return sum(seen.values())


def peak_activation_bytes(gm: fx.GraphModule, *args) -> ActivationPeak:
    """Run `gm(*args)` once and return its activation-memory peak (see the module docstring)."""
    return ActivationTracker(gm).measure(*args)


def measure_step(pmodel, *inputs) -> ActivationPeak:
    """The activation-memory peak of one training step of `pmodel` on this rank (runs it once)."""
    return peak_activation_bytes(pmodel.gm, *pmodel.step_arguments(*inputs))
