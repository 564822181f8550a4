"""split_stages: one rank's rewritten joint graph -> the forward and backward program of its stage.

A pipelined plan cuts the micro-batch graph between units (`autopar.pipeline.layer_profile`: "<pre>", one
unit per layer of the stack, "<post>"); `Plan.stages[k].modules` lists the units of stage k. This
pass runs after `run_passes` (the graph is already this rank's SPMD program on the sub-mesh) and is
called by the runtime, not listed in `PIPELINE`: it returns several graphs, not one.

Where a node goes (`assign_units`):
  forward   a node of layer i of the stack -> that layer's unit; another module -> "<pre>" before the
            stack, "<post>" after; no module path (root ops, pass-made nodes) -> the latest unit of
            its inputs (data flow).
  backward  a layer's node -> that layer; another module -> the unit of that module's forward; the
            node of a forward op (same seq_nr) -> that op's unit; otherwise (autograd's gradient
            accumulation, pass-made reductions) the earliest unit among its backward inputs
            (gradients flow towards earlier stages), else the latest among its forward inputs.
            A recomputed layer's forward copies (`passes/recompute.py`: phase "backward", the
            layer's module path) go to that layer, so its stage's backward re-runs them and its
            forward keeps only what they read (the layer's checkpoints).
  floating  nodes computed from parameters and buffers only (views, ZeRO-3 gathers, factories such
            as arange) belong to no stage: every program that needs one recomputes it.
  per step  a ZeRO-1/2 parameter gather (insert_redistribute's "parameter gather (ZeRO-1/2)": the
            master shard gathered whole, with the local ops its lowering made) is floating too, but
            runs once per step: each stage's `gather` program makes the gathered copies from the
            parameters, and its forward and backward programs read them as ("gathered", name)
            arguments (the runtime keeps them for the step's micro-batches, as the cost model
            prices: one gather per step, the gathered copy in the state bytes). A ZeRO-3 parameter
            (stored and used sharded, gathered at each use) stays per program: re-gathering in every
            micro-batch's forward and backward is what saves its memory, and the cost model prices
            those gathers per micro-batch (they are the plan's forward and backward edges).

Between stages travel (in graph order): forward values made at or before stage s and read by a later
stage (inputs such as labels included), and the gradients of the differentiable ones. A backward
value that crosses stages is either the gradient of such a boundary value (identified by shape and
dtype among the receiving stage's differentiable inputs; stage t sends the sum of its contributions)
or one stage's contribution to the gradient of a parameter used by several stages (a tied
embedding): the accumulation that sums those contributions is copied into every owner stage with
the other stages' contributions left out, and the runtime all-reduces that gradient between them.

Gradient all-reduces that `defer_grad_reductions` took out of the graph (the runtime runs them once
per step) are listed with the stage whose parameters they reduce (`StageProgram.deferred`).

Interleaved plans cut the graph into p*v chunks (`Plan.stages` lists one per chunk); the split is the
same as for p*v stages: which rank runs a chunk is the runtime's business (autopar/pipeline/runtime.py).

Invariants (`check_programs`): every original op runs in exactly one stage or is floating; forward
units never decrease along data flow; each stage's boundary outputs are the next stage's inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.errors import AutoparError
from autopar.graph import (
    COLLECTIVE,
    DEFERRED,
    FUSED,
    MODULE_PATH,
    NAME,
    OUTS,
    PASS,
    PHASE,
    ROLE,
    UNSCOPED,
    VAL,
    ancestors,
    layer_of,
)

from .bucket_collectives import ZERO_GATHER

PRE, POST = "<pre>", "<post>"
_FOREIGN = object()   # another stage's contribution to a shared parameter's gradient: left out


class StageSplitError(AutoparError):
    """The graph cannot be cut at the planned stage boundaries (an unidentifiable crossing gradient)."""


@dataclass
class StageProgram:
    """The forward and backward graphs of one pipeline stage, with the key of every argument.

    Argument keys: ("param", fqn), ("buffer", fqn), ("input", node name) for a boundary value
    received, ("saved", i) for a value the forward kept, ("grad", node name) for the gradient of a
    boundary value sent, ("gathered", node name) for a ZeRO-1/2 parameter's gathered copy.
    Forward returns (*outputs, *saved) (the last stage: (loss, *saved)); backward returns
    (*param grads, *input grads); `gather` (None if the stage has no ZeRO-1/2 parameter), run once
    per step on `gather_args` (params), returns the copies named in `gathered`, in that order."""
    index: int
    forward: fx.GraphModule
    backward: fx.GraphModule
    forward_args: list
    backward_args: list
    inputs: list                 # node names of the boundary values received (stage 0: user inputs)
    outputs: list                # node names of the boundary values sent ([] for the last stage)
    differentiable: dict         # boundary node name -> True if it carries a gradient
    num_saved: int
    grad_params: list            # param FQNs, in the order backward returns their gradients
    input_grads: list            # boundary input names, in the order backward returns their gradients
    shared_params: list = field(default_factory=list)  # params whose gradient is summed across stages
    values: dict = field(default_factory=dict)  # boundary name -> (global shape, dtype, spec or None)
    # boundary name -> spec of its gradient where the plan lays it out unlike the value (e.g. a replicated
    # activation whose gradient is split on the sequence): the runtime converts at the stage boundary
    grad_specs: dict = field(default_factory=dict)
    # gradient all-reduces left to the runtime, once per step (passes/defer_grad_reductions.py): the
    # records of this stage's grad_params, each with its "param", "group" and "axis_index"
    deferred: list = field(default_factory=list)
    gather: fx.GraphModule | None = None   # once per step: the ZeRO-1/2 gathered copies (module docstring)
    gather_args: list = field(default_factory=list)
    gathered: list = field(default_factory=list)   # node names, in the order `gather` returns them
    # zero-bubble schedules (passes/split_weight_grads.py): the backward as B, returning (*input grads,
    # *carried), and W, reading its arguments then the carried values and returning the parameter grads
    backward_input: fx.GraphModule | None = None
    backward_weight: fx.GraphModule | None = None
    backward_input_args: list = field(default_factory=list)
    backward_weight_args: list = field(default_factory=list)
    num_carried: int = 0

    @property
    def params(self) -> list[str]:
        return sorted({k[1] for k in self._state_args if k[0] == "param"})

    @property
    def buffers(self) -> list[str]:
        return sorted({k[1] for k in self._state_args if k[0] == "buffer"})

    @property
    def _state_args(self) -> list:
        return self.forward_args + self.backward_args + self.gather_args


# ---------------------------------------------------------------- where each node goes

def _phase(node: fx.Node, phase: dict) -> str:
    if PHASE in node.meta:
        return node.meta[PHASE]
    return "backward" if any(phase.get(a) == "backward" for a in node.all_input_nodes) else "forward"


@dataclass
class Units:
    """Where the ops of a joint graph go: a unit per non-floating op, each op's phase, the floating
    ops, and the ops placed by data flow alone (gradient accumulation, pass-made reductions)."""
    unit: dict
    phase: dict
    floating: set
    by_flow: set


def assign_units(gm: fx.GraphModule, unit_names: list[str]) -> Units:
    """The unit index of every op (`unit_names` as layer_profile's); rules in the module docstring."""
    rules = _UnitRules(gm, unit_names)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            rules.place(node)
    for node in reversed(list(rules.pending)):  # made from forward values only: where they are read
        readers = [rules.unit[r] for r in node.users if r in rules.unit]
        rules.unit[node] = max(rules.unit[node], min(readers, default=rules.unit[node]))
    return Units(rules.unit, rules.phase, rules.floating, rules.by_flow)


class _UnitRules:
    def __init__(self, gm: fx.GraphModule, unit_names: list[str]):
        self.index = {n: i for i, n in enumerate(unit_names)}
        self.stack = next((n.rsplit(".", 1)[0] for n in unit_names if n not in (PRE, POST)), "")
        self.post = self.index.get(POST, len(unit_names) - 1)
        self.loss_side = ancestors(gm.graph.output_node().args[0][0])  # capture's definition of forward
        self.unit, self.phase, self.floating, self.by_flow = {}, {}, set(), set()
        self.by_path, self.by_seq, self.seen_stack = {}, {}, False
        self.pending: dict = {}   # an ordered set

    def place(self, node: fx.Node) -> None:
        self.phase[node] = "forward" if node in self.loss_side else _phase(node, self.phase)
        if all(_is_state(a) or a in self.floating for a in node.all_input_nodes):
            self.floating.add(node)
            return
        path = node.meta.get(MODULE_PATH, "") or ""
        key = layer_of(path)
        block = self.index.get(f"{key[0]}.{key[1]}") if key is not None and key[0] == self.stack else None
        if self.phase[node] == "forward":
            self.unit[node] = self._forward(node, path, block)
        else:
            self.unit[node] = self._backward(node, path, block)

    def _forward(self, node: fx.Node, path: str, block: int | None) -> int:
        self.seen_stack |= block is not None
        if block is not None:
            u = block
        elif path:
            u = self.post if self.seen_stack else 0
        else:
            u = max((self.unit.get(a, 0) for a in node.all_input_nodes if a not in self.floating), default=0)
        self.by_path.setdefault(path, u)
        seq = node.meta.get("seq_nr")
        self.by_seq[seq] = max(self.by_seq.get(seq, u), u)  # one autograd op may span units (targets' ops)
        return u

    def _backward(self, node: fx.Node, path: str, block: int | None) -> int:
        seq = node.meta.get("seq_nr")
        if block is not None:
            return block
        if path and path in self.by_path:
            return self.by_path[path]
        if seq is not None and seq in self.by_seq and not node.meta.get(UNSCOPED):
            return self.by_seq[seq]
        self.by_flow.add(node)
        inputs = [a for a in node.all_input_nodes if a in self.unit]
        back = [self.unit[a] for a in inputs if self.phase[a] == "backward" and a not in self.pending]
        if back:  # gradients flow towards earlier units
            return min(back)
        self.pending[node] = None
        return max((self.unit[a] for a in inputs), default=self.post)


def graph_units(gm: fx.GraphModule) -> list[str]:
    """Unit names of a joint graph, as layer_profile names them: "<pre>", each layer of the stack
    (the container with the most numbered layers), "<post>"."""
    layers: dict[str, set[int]] = {}
    for node in gm.graph.nodes:
        key = layer_of(node.meta.get(MODULE_PATH, "") or "") if node.op == "call_function" else None
        if key is not None:
            layers.setdefault(key[0], set()).add(key[1])
    stack = max(layers, key=lambda c: len(layers[c]), default="")
    return [PRE] + [f"{stack}.{i}" for i in sorted(layers.get(stack, ()))] + [POST]


def _is_state(node: fx.Node) -> bool:
    return node.op == "placeholder" and node.meta.get(ROLE) in ("param", "buffer")


def _role(node: fx.Node) -> str:
    return node.meta.get(ROLE, "") if node.op == "placeholder" else ""


# ---------------------------------------------------------------- the split

class _Split:
    """The bookkeeping of one split: stages, boundaries, crossing gradients, shared parameters."""

    def __init__(self, gm: fx.GraphModule, stage_units: list[list[str]], unit_names: list[str], grad_names):
        self.gm, self.num_stages = gm, len(stage_units)
        units = assign_units(gm, unit_names)
        self.phase, self.floating, self.by_flow = units.phase, units.floating, units.by_flow
        stage_of_unit = {unit_names.index(u): k for k, names in enumerate(stage_units) for u in names}
        self.stage = {n: stage_of_unit[u] for n, u in units.unit.items()}
        out = gm.graph.output_node().args[0]
        self.loss, self.grads = out[0], dict(zip(grad_names, out[1:]))
        self.placeholders = {n.meta[NAME]: n for n in gm.graph.nodes if n.op == "placeholder"}
        self.inputs = [n for n in gm.graph.nodes if _role(n) == "input"]
        self.diff = self._differentiable()
        self.owners = self._owners()
        self.cones = self._cones()
        self.crossing = self._crossing_gradients()
        self.gathered = _gathered_copies(gm, self.floating)

    def is_forward(self, node: fx.Node) -> bool:
        return _role(node) == "input" or (node in self.stage and self.phase[node] == "forward")

    def where(self, node: fx.Node) -> int:
        return -1 if _role(node) == "input" else self.stage[node]

    def _differentiable(self) -> set:
        grads = {self.placeholders[n] for n in self.grads}
        diff: set = set()
        for node in self.gm.graph.nodes:
            if node in grads or any(a in diff for a in node.all_input_nodes):
                if node.op == "placeholder" or self.phase.get(node) == "forward":
                    diff.add(node)
        return diff

    def _needs(self) -> dict:
        """Stages that use each floating node or state placeholder (through floating chains)."""
        need: dict = {}
        for node in reversed(list(self.gm.graph.nodes)):
            if node in self.floating or _is_state(node):
                s = set()
                for u in node.users:
                    s |= need.get(u, set()) if u in self.floating else ({self.stage[u]} if u in self.stage else set())
                need[node] = s
        return need

    def _owners(self) -> dict:
        need = self._needs()
        return {name: sorted(need.get(p, set())) for name, p in self.placeholders.items() if _is_state(p)}

    def _cones(self) -> dict:
        """param -> nodes accumulating its gradient from several stages (copied into every owner)."""
        cones = {}
        for name, g in self.grads.items():
            if len(self.owners.get(name, ())) < 2:
                continue
            cone, stack = set(), [g]
            while stack:
                n = stack.pop()
                if n in self.by_flow and n not in cone:
                    cone.add(n)
                    stack.extend(n.all_input_nodes)
            cones[name] = cone
        return cones

    def in_cone(self, node: fx.Node) -> bool:
        return any(node in c for c in self.cones.values())

    def _crossing_gradients(self) -> dict:
        """backward value u made in stage t and read in an earlier stage -> the boundary value it is
        the gradient of (outside the shared-parameter cones)."""
        out = {}
        for n in self.gm.graph.nodes:
            if n not in self.stage or self.phase[n] != "backward" or self.in_cone(n):
                continue
            for u in n.all_input_nodes:
                if u in self.stage and self.phase[u] == "backward" and self.stage[u] > self.stage[n]:
                    out.setdefault(u, self._boundary_of(u, self.stage[n], self.stage[u]))
        return out

    def _boundary_of(self, u: fx.Node, s: int, t: int) -> fx.Node:
        val = u.meta[VAL]
        found = [b for b in self.boundary(s) if b in self.diff and _same(b.meta[VAL], val)
                 and any(self.stage.get(x, -1) >= t and self.phase[x] == "forward" for x in b.users)]
        if len(found) != 1:
            raise StageSplitError(
                f"the gradient {u.name} (shape {tuple(val.shape)}) crosses from stage {t} to stage {s} but matches "
                f"{len(found)} of the activations sent between them ({[b.name for b in found]}); cut the model "
                "elsewhere (num_stages) or report the model")
        return found[0]

    def boundary(self, s: int) -> list[fx.Node]:
        """Values made at or before stage s (or inputs) read by a later stage, in graph order."""
        out = []
        for node in self.gm.graph.nodes:
            if not self.is_forward(node) or self.where(node) > s:
                continue
            users = [u for u in node.users if u in self.stage and self.stage[u] > s and not self.in_cone(u)]
            if users:
                out.append(node)
        return out


def _gathered_copies(gm: fx.GraphModule, floating: set) -> set:
    """The floating nodes whose values are ZeRO-1/2 gathered copies (made once per step, module docstring):
    the last node of each such gather's lowering, or any node of it another node reads."""
    made: set = set()
    for node in gm.graph.nodes:
        if node not in floating:
            continue
        records = node.meta.get(FUSED) or [node.meta.get(COLLECTIVE, {})]   # a layer's fused gather: all its
        if all(r.get("reason") == ZERO_GATHER for r in records):         # members (bucket_layer_gathers)
            made |= {a for a in ancestors(node) if a in floating}
        elif (node.meta.get(PASS) in ("lower_collectives", "bucket_layer_gathers")
              and any(a in made for a in node.all_input_nodes)
              and all(a in made or _is_state(a) for a in node.all_input_nodes)):
            made.add(node)   # the gather's local ops after the collective (a fused gather's getitem, a permute back)
    return {n for n in made if any(u not in made for u in n.users)}


def _same(a, b) -> bool:
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype


class _Builder:
    """Copies the nodes of one program into a new graph; floating nodes are copied on demand."""

    def __init__(self, split: _Split, per_step: bool = False):
        self.split, self.graph, self.per_step = split, fx.Graph(), per_step
        self.env: dict = {}
        self.args: list = []
        self._last_placeholder = None

    def arg(self, key: tuple, like: fx.Node | None) -> fx.Node:
        if key in self.args:
            return self.env[key]
        first = next(iter(self.graph.nodes), None)
        where = (self.graph.inserting_after(self._last_placeholder) if self._last_placeholder is not None
                 else self.graph.inserting_before(first))
        with where:
            ph = self.graph.placeholder(f"{key[0]}_{len(self.args)}")
        if like is not None:
            ph.meta.update({k: v for k, v in like.meta.items() if k in ("val", "autopar_role", "autopar_name")})
        self._last_placeholder, self.env[key] = ph, ph
        self.args.append(key)
        return ph

    def value(self, node: fx.Node):
        if node in self.env:
            return self.env[node]
        if _is_state(node):
            return self.arg((node.meta[ROLE], node.meta[NAME]), node)
        if node in self.split.gathered and not self.per_step:
            return self.arg(("gathered", node.name), node)
        if node in self.split.floating:
            return self.copy(node)
        raise AssertionError(f"split_stages: {node.name} is not available in this program")

    def copy(self, node: fx.Node):
        args = [self.value(a) for a in node.all_input_nodes]
        if any(a is _FOREIGN for a in args):
            self.env[node] = self._drop_foreign(node)
            return self.env[node]
        new = self.graph.node_copy(node, lambda a: self.env[a] if a in self.env else self.value(a))
        self.env[node] = new
        return new

    def _drop_foreign(self, node: fx.Node):
        """x + (another stage's contribution) -> x: that stage adds it in the all-reduce."""
        vals = [self.value(a) if isinstance(a, fx.Node) else a for a in node.args]
        own = [v for v in vals if isinstance(v, fx.Node)]
        if not own:
            return _FOREIGN
        assert node.target is torch.ops.aten.add.Tensor and len(own) == 1, \
            f"split_stages: {node.name} ({node.target}) mixes stages' contributions to a shared gradient"
        return own[0]

    def output(self, values: list) -> fx.GraphModule:
        self.graph.output(tuple(values))
        gm = fx.GraphModule(torch.nn.Module(), self.graph)
        gm.graph.lint()
        gm.recompile()
        return gm


def _forward_program(split: _Split, s: int, inputs: list, outputs: list, saved: list) -> tuple:
    b = _Builder(split)
    for x in inputs:
        b.env[x] = b.arg(("input", x.name), x)
    for node in split.gm.graph.nodes:
        if node in split.stage and split.stage[node] == s and split.phase[node] == "forward":
            b.copy(node)
    first = [b.value(split.loss)] if s == split.num_stages - 1 else [b.value(o) for o in outputs]
    return b.output(first + [b.value(x) for x in saved]), b.args


def _gather_program(split: _Split, programs_args: list) -> tuple:
    """The once-per-step program making the gathered copies that a stage's programs read (or None)."""
    names = sorted({k[1] for args in programs_args for k in args if k[0] == "gathered"})
    if not names:
        return None, [], []
    nodes = {n.name: n for n in split.gathered}
    b = _Builder(split, per_step=True)
    return b.output([b.value(nodes[n]) for n in names]), b.args, names


def _saved(split: _Split, s: int, inputs: list) -> list[fx.Node]:
    """Forward values (this stage's or received) that this stage's backward reads."""
    known = set(inputs)
    out = []
    for node in split.gm.graph.nodes:
        if node in split.stage and split.stage[node] == s and split.phase[node] == "forward":
            known.add(node)
    for node in split.gm.graph.nodes:
        if node in known and any(_runs_backward(split, u, s) for u in node.users):
            out.append(node)
    return out


def _runs_backward(split: _Split, node: fx.Node, s: int) -> bool:
    if node in split.stage and split.phase[node] == "backward":
        return split.stage[node] == s or any(node in c and s in split.owners[p] for p, c in split.cones.items())
    return False


def _backward_program(split: _Split, s: int, inputs: list, outputs: list, saved: list) -> tuple:
    b = _Builder(split)
    for i, x in enumerate(saved):
        b.env[x] = b.arg(("saved", i), x)
    received = {o: b.arg(("grad", o.name), o) for o in outputs if o in split.diff}
    used: set = set()
    for u, target in split.crossing.items():
        if split.stage[u] > s and any(split.stage.get(n) == s for n in u.users):
            if target in used:
                b.env[u] = b.graph.call_function(torch.ops.aten.zeros_like.default, (received[target],))
            else:
                b.env[u], _ = received[target], used.add(target)
    owned = [p for p, c in split.cones.items() if s in split.owners[p]]
    for p in owned:
        for n in split.cones[p]:
            for leaf in n.all_input_nodes:
                if leaf not in split.cones[p] and split.stage.get(leaf, s) != s:
                    b.env[leaf] = _FOREIGN
    for node in split.gm.graph.nodes:
        if _runs_backward(split, node, s) and node not in b.env:
            b.copy(node)
    grad_params = [p for p, g in split.grads.items() if s in split.owners.get(p, ())]
    input_grads = [x for x in inputs if x in split.diff and s > 0]
    outs = [b.value(split.grads[p]) for p in grad_params]
    for x in input_grads:
        terms = [b.env[u] for u, t in split.crossing.items() if t is x and split.stage[u] == s and u in b.env]
        if x in received and x not in used:
            terms.append(received[x])
        outs.append(_sum(b.graph, terms))
    return b.output(outs), b.args, grad_params, [x.name for x in input_grads]


def _spec(node: fx.Node):
    outs = node.meta.get(OUTS)
    return outs[0] if outs else None


def _grad_specs(split: _Split, values: list) -> dict:
    """Boundary values whose crossing gradient has another layout than the value (see StageProgram)."""
    out = {}
    for x in values:
        specs = {_spec(u) for u, t in split.crossing.items() if t is x}
        if len(specs) > 1:
            raise StageSplitError(f"the gradient of {x.name} crosses stages in {len(specs)} layouts; cut the model "
                                  "elsewhere (num_stages) or report the model")
        if specs and specs != {_spec(x)} and None not in specs | {_spec(x)}:
            out[x.name] = specs.pop()
    return out


def _value_meta(node: fx.Node) -> tuple:
    val, outs = node.meta[VAL], node.meta.get(OUTS)
    return tuple(val.shape), val.dtype, (outs[0] if outs else None)


def _sum(graph: fx.Graph, terms: list):
    if not terms:
        return None
    total = terms[0]
    for t in terms[1:]:
        total = graph.call_function(torch.ops.aten.add.Tensor, (total, t))
    return total


def split_stages(gm: fx.GraphModule, stage_units: list[list[str]], unit_names: list[str],
                 grad_names: list[str]) -> list[StageProgram]:
    """Cut this rank's joint program into one StageProgram per stage (see the module docstring)."""
    split = _Split(gm, stage_units, unit_names, grad_names)
    programs, inputs = [], list(split.inputs)
    for s in range(split.num_stages):
        last = s == split.num_stages - 1
        outputs = [] if last else split.boundary(s)
        saved = _saved(split, s, inputs)
        fwd, fwd_args = _forward_program(split, s, inputs, outputs, saved)
        bwd, bwd_args, grad_params, input_grads = _backward_program(split, s, inputs, outputs, saved)
        gather, gather_args, gathered = _gather_program(split, [fwd_args, bwd_args])
        programs.append(StageProgram(
            index=s, forward=fwd, backward=bwd, forward_args=fwd_args, backward_args=bwd_args,
            inputs=[x.name for x in inputs], outputs=[o.name for o in outputs],
            differentiable={x.name: x in split.diff for x in inputs + outputs}, num_saved=len(saved),
            grad_params=grad_params, input_grads=input_grads,
            shared_params=[p for p in split.cones if s in split.owners[p]],
            values={x.name: _value_meta(x) for x in inputs + outputs},
            grad_specs=_grad_specs(split, inputs + outputs),
            deferred=[d for d in gm.meta.get(DEFERRED, ()) if d["param"] in grad_params],
            gather=gather, gather_args=gather_args, gathered=gathered))
        inputs = outputs
    check_programs(programs)
    return programs


def check_programs(programs: list[StageProgram]) -> None:
    """The split's own invariants: boundaries line up, every program's arguments are known keys."""
    for a, b in zip(programs, programs[1:]):
        assert a.outputs == b.inputs, f"stage {a.index} sends {a.outputs} but stage {b.index} expects {b.inputs}"
    for prog in programs:
        for key in prog.forward_args + prog.backward_args:
            assert key[0] in ("param", "buffer", "input", "saved", "grad", "gathered"), key
        assert {k[1] for k in prog.forward_args + prog.backward_args if k[0] == "gathered"} == set(prog.gathered)
        assert all(k[0] in ("param", "buffer") for k in prog.gather_args), prog.gather_args
        assert len(prog.input_grads) <= len(prog.inputs)
