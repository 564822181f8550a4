"""Identical layers are traced once and stamped out: capture time stops growing with depth.

Tracing costs ~0.5 s per decoder layer on fake tensors (torch.export and the joint retrace both
dispatch every op), so a 32-layer Llama took 17 s and an 80-layer one would take 45 s. Most of a
transformer is one `nn.ModuleList` of layers that are alike. For such a stack of L layers, capture
traces a shallow copy of the model holding only the first TRACED = 3 layers, then builds the graph
of all L layers from it: layer 1, which has a layer on both sides, is the template; L - 3 copies of
it go between layers 1 and 2, and layer 2 becomes layer L - 1.

This is exact, not an approximation, when (checked here; any failure falls back to tracing
everything):
  * the layers are alike: same classes, parameter and buffer shapes, and plain attributes (an int
    attribute equal to the layer's index, like HF's `layer_idx`, may differ);
  * the three traced layers are alike in the graph: node for node the same op, arguments, shapes,
    and references (to its own nodes, to the layer before, the layer after, or shared nodes
    outside the stack) — layer 1 against layer 2 and layer 0 against layer 1, so by induction every
    inserted copy connects as a traced layer does;
  * nothing outside the stack reads the middle layer (e.g. a loss summed over every layer).
The result has the same nodes in the same order as tracing all L layers (tests compare both).
A model whose layers behave differently by index in ways no attribute shows (`if self.idx % 4`)
is out of reach of these checks: `capture(..., stamp_layers=False)` traces every layer.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.graph import MODULE_PATH, NAME, STAMPED_FROM, UNSCOPED, VAL, val_of

log = logging.getLogger(__name__)
TRACED = 3      # first layer, the template (a layer on each side), last layer
MIN_LAYERS = 5  # below this, stamping saves too little to be worth its checks
_PLAIN = (bool, int, float, str, type(None))


class StampError(Exception):
    """The layers are not provably alike; capture falls back to tracing every layer."""


@dataclass(frozen=True)
class LayerStack:
    path: str        # FQN of the nn.ModuleList in the user's model, e.g. "model.layers"
    num_layers: int


# ---------------------------------------------------------------- finding stacks

def find_stacks(model: nn.Module) -> list[LayerStack]:
    """Outermost ModuleLists of at least MIN_LAYERS alike layers with their own parameters."""
    stacks: list[LayerStack] = []
    for name, mod in model.named_modules():
        if not name or any(name.startswith(s.path + ".") for s in stacks):
            continue
        if isinstance(mod, nn.ModuleList) and len(mod) >= MIN_LAYERS and _alike(list(mod)):
            stacks.append(LayerStack(name, len(mod)))
    return stacks


def _alike(layers: list[nn.Module]) -> bool:
    if len({id(m) for m in layers}) < len(layers):
        return False  # one module repeated (ALBERT-style sharing) is not a stack of layers
    params = [{id(p) for p in m.parameters()} for m in layers]
    if sum(len(p) for p in params) != len(set().union(*params)):
        return False  # parameters shared between layers
    sigs = [_signature(m) for m in layers]
    if any(s is None for s in sigs):
        return False
    attrs = [s.pop("attrs") for s in sigs]
    index_like = {k for k in attrs[0] if [a.get(k) for a in attrs] == list(range(len(layers)))}
    attrs = [{k: v for k, v in a.items() if k not in index_like} for a in attrs]
    return all(s == sigs[0] for s in sigs[1:]) and all(a == attrs[0] for a in attrs[1:])


def _signature(layer: nn.Module) -> dict | None:
    """Classes and tensor shapes per submodule, and plain attributes (compared separately: one that
    counts the layers, like HF's `layer_idx`, may differ). None when hooks make it unknowable."""
    structure, attrs = [], {}
    for name, mod in layer.named_modules():
        if mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks:
            return None  # a hook may close over anything
        attrs.update({(name, k): v for k, v in vars(mod).items() if not k.startswith("_") and isinstance(v, _PLAIN)})
        tensors = tuple((n, tuple(t.shape), t.dtype, t.requires_grad)
                        for n, t in (*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)))
        structure.append((name, type(mod), tensors))
    return {"structure": tuple(structure), "attrs": attrs}


def shallow_model(model: nn.Module, stacks: list[LayerStack]) -> nn.Module:
    """A copy of `model` sharing every module and tensor, each stack cut to its first TRACED layers.
    Only the modules on the path to a stack are copied; the user's model is not touched."""
    root = _copy(model)
    for stack in stacks:
        *parents, leaf = stack.path.split(".")
        mod = root
        for part in parents:
            child = _copy(mod._modules[part])
            mod._modules[part] = child
            mod = child
        mod._modules[leaf] = nn.ModuleList(list(mod._modules[leaf])[:TRACED])
    return root


def _copy(mod: nn.Module) -> nn.Module:
    new = copy.copy(mod)
    object.__setattr__(new, "_modules", dict(mod._modules))
    return new


# ---------------------------------------------------------------- stamping one stack

@dataclass
class _Layers:
    """The traced layers of one stack: per layer, its placeholders (by name relative to the layer),
    forward nodes and backward nodes, each in graph order; and where each node sits."""
    prefix: str
    params: list[dict[str, fx.Node]]
    fwd: list[list[fx.Node]]
    bwd: list[list[fx.Node]]
    where: dict[fx.Node, tuple[int, str, int | str]]  # node -> (layer, part, position or name)

    def at(self, layer: int, part: str, key) -> fx.Node:
        return self.params[layer][key] if part == "P" else getattr(self, part)[layer][key]


def _layer_of(path: str, prefix: str) -> int | None:
    if not path.startswith(prefix + "."):
        return None
    head = path[len(prefix) + 1:].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _split_layers(gm: fx.GraphModule, prefix: str, loss: fx.Node) -> _Layers:
    """Assign nodes to traced layers: by module path, and a node with no module at all (autograd's
    gradient accumulation) to the layer of the node before it."""
    params: list[dict] = [{} for _ in range(TRACED)]
    fwd: list[list] = [[] for _ in range(TRACED)]
    bwd: list[list] = [[] for _ in range(TRACED)]
    current, backward = None, False
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            name = node.meta[NAME]
            i = _layer_of(name, prefix)
            if i is not None:
                params[i][name[len(f"{prefix}.{i}."):]] = node
            continue
        if node.op != "call_function":
            continue
        if not node.meta.get(UNSCOPED):  # unscoped nodes join the layer before them
            current = _layer_of(node.meta.get(MODULE_PATH, ""), prefix)
        if current is not None:
            (bwd if backward else fwd)[current].append(node)
        if node is loss:
            backward, current = True, None
    where = {}
    for i in range(TRACED):
        where.update({n: (i, "P", k) for k, n in params[i].items()})
        where.update({n: (i, "fwd", k) for k, n in enumerate(fwd[i])})
        where.update({n: (i, "bwd", k) for k, n in enumerate(bwd[i])})
    layers = _Layers(prefix, params, fwd, bwd, where)
    _check_shape(gm, layers)
    return layers


def _check_shape(gm: fx.GraphModule, layers: _Layers) -> None:
    """Same sizes, contiguous runs in the expected order, and nothing outside reads layer 1."""
    for part in ("fwd", "bwd"):
        runs = getattr(layers, part)
        if len({len(r) for r in runs}) != 1 or not runs[0]:
            raise StampError(f"traced layers differ in size ({part}: {[len(r) for r in runs]})")
    if len({tuple(sorted(p)) for p in layers.params}) != 1:
        raise StampError("traced layers have different parameters")
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for part, seq in (("fwd", (0, 1, 2)), ("bwd", (2, 1, 0))):
        runs = [getattr(layers, part)[i] for i in seq]
        for run in runs:
            if order[run[-1]] - order[run[0]] + 1 != len(run):
                raise StampError(f"a layer's {part} nodes are interleaved with other nodes")
        if not all(order[a[-1]] < order[b[0]] for a, b in zip(runs, runs[1:])):
            raise StampError(f"layers' {part} nodes are out of order")
    for node in gm.graph.nodes:
        if node not in layers.where and node.op != "output":
            if any(layers.where.get(a, (None,))[0] == 1 for a in node.all_input_nodes):
                raise StampError(f"{node.name}, outside the stack, reads the middle layer")


def _check_alike(layers: _Layers) -> None:
    """Layer i+1 is layer i shifted by one, for i = 0 (references to the next layer exact) and
    i = 1 (references to the previous layer exact); only the stack's ends may read shared nodes."""
    for i in (0, 1):
        for part in ("fwd", "bwd"):
            for a, b in zip(getattr(layers, part)[i], getattr(layers, part)[i + 1]):
                if a.target != b.target or a.op != b.op or not _same_val(a, b):
                    raise StampError(f"{a.name} and {b.name} differ")
                try:
                    _match(a.args, b.args, i, layers, part)
                    _match(a.kwargs, b.kwargs, i, layers, part)
                except StampError as e:
                    raise StampError(f"{a.name} vs {b.name}: {e}") from None
    for k, n in layers.params[1].items():
        if not _same_val(n, layers.params[0][k]) or not _same_val(n, layers.params[2][k]):
            raise StampError(f"parameter {k} differs between layers")


def _same_val(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get(VAL), b.meta.get(VAL)
    if isinstance(va, (tuple, list)) and isinstance(vb, (tuple, list)):
        return len(va) == len(vb) and all(_same_tensor(x, y) for x, y in zip(va, vb))
    return _same_tensor(va, vb)


def _same_tensor(x, y) -> bool:
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return (x.shape, x.dtype, x.stride(), x.device) == (y.shape, y.dtype, y.stride(), y.device)
    return type(x) is type(y) and (x == y if isinstance(x, _PLAIN) else True)


def _match(x, y, i: int, layers: _Layers, part: str) -> None:
    if isinstance(x, (tuple, list)):
        if not isinstance(y, (tuple, list)) or len(x) != len(y):
            raise StampError("argument structure")
        for u, v in zip(x, y):
            _match(u, v, i, layers, part)
    elif isinstance(x, dict):
        if not isinstance(y, dict) or x.keys() != y.keys():
            raise StampError("keyword structure")
        for k in x:
            _match(x[k], y[k], i, layers, part)
    elif isinstance(x, fx.Node) and isinstance(y, fx.Node):
        _match_ref(x, y, i, layers, part)
    elif isinstance(x, fx.Node) or isinstance(y, fx.Node):
        raise StampError(f"{x!r} vs {y!r}: a node against a constant")
    elif type(x) is not type(y) or x != y:
        raise StampError(f"constant {x!r} vs {y!r}")


def _match_ref(x: fx.Node, y: fx.Node, i: int, layers: _Layers, part: str) -> None:
    wx, wy = layers.where.get(x), layers.where.get(y)
    if wx is None and wy is None:
        if x is not y:
            raise StampError(f"shared inputs {x} vs {y}")
        return
    if wx is not None and wy is not None:
        if wx[1:] != wy[1:] or wx[0] - i != wy[0] - (i + 1) or abs(wx[0] - i) > 1:
            raise StampError(f"{x} and {y} are not the same node of neighbouring layers")
        if part == "fwd" and wx[0] > i:
            raise StampError("a forward node reads the next layer")
        return
    if i == 0 and wx is None and wy is not None and wy[0] == 0:
        return  # the first layer reads from before the stack where layer 1 reads layer 0
    if i == 1 and wy is None and wx is not None and wx[0] == 2:
        return  # the last layer reads from after the stack where layer 1 reads layer 2
    raise StampError(f"{x} vs {y}: unmatched reference")


def check_stack(gm: fx.GraphModule, stack: LayerStack, loss: fx.Node) -> dict[fx.Node, tuple[int, fx.Node]]:
    """The checks of `stamp_stack` alone (StampError when they fail): the traced graph's layer 1 then
    stands for each of the stack's middle layers, node for node (a shallow capture's promise).
    Returns each traced layer's node -> (its layer, layer 1's node in the same place)."""
    layers = _split_layers(gm, stack.path, loss)
    _check_alike(layers)
    return {n: (w[0], layers.at(1, w[1], w[2])) for n, w in layers.where.items()}


def stamp_stack(gm: fx.GraphModule, stack: LayerStack, loss: fx.Node,
                grads: dict[str, fx.Node]) -> dict[str, fx.Node]:
    """Insert copies of layer 1 so the stack has stack.num_layers layers; rename layer 2 to the last.
    `grads` maps parameter names to gradient nodes; returns it for the full stack."""
    layers = _split_layers(gm, stack.path, loss)
    _check_alike(layers)
    copies = stack.num_layers - TRACED
    envs: dict[int, dict[fx.Node, fx.Node]] = {}  # copy k (1..copies) -> template node -> its copy

    def resolve(k: int):
        def fn(a: fx.Node) -> fx.Node:
            w = layers.where.get(a)
            if w is None:
                return a
            layer, part, key = w
            t = layers.at(1, part, key)  # the template's node in the same position
            if layer == 1:
                return envs[k][a]
            if layer == 0:
                return t if k == 1 else envs[k - 1][t]
            return layers.at(2, part, key) if k == copies else envs[k + 1][t]
        return fn

    _insert_params(gm, layers, copies, envs)
    for k in range(1, copies + 1):                    # forward: copies in order, before layer 2
        with gm.graph.inserting_before(layers.fwd[2][0]):
            for n in layers.fwd[1]:
                envs[k][n] = _copy_node(gm, n, resolve(k), stack.path, k + 1)
    for k in range(copies, 0, -1):                    # backward: last copy first, before layer 1
        with gm.graph.inserting_before(layers.bwd[1][0]):
            for n in layers.bwd[1]:
                envs[k][n] = _copy_node(gm, n, resolve(k), stack.path, k + 1)
    if copies:
        _rewire(layers, envs, copies)
    _rename_layer(layers, 2, stack.num_layers - 1)
    return _stack_grads(grads, layers, envs, stack)


def _insert_params(gm: fx.GraphModule, layers: _Layers, copies: int, envs: dict) -> None:
    first = layers.params[1]
    anchor = next(iter(first.values())) if first else None
    for k in range(1, copies + 1):
        envs[k] = {}
        for rel, ph in first.items():
            with gm.graph.inserting_after(anchor):
                new = gm.graph.placeholder(f"{ph.name}_stamp{k}")
            new.meta.update(ph.meta)
            new.meta[NAME] = f"{layers.prefix}.{k + 1}.{rel}"
            envs[k][ph] = new


def _copy_node(gm: fx.GraphModule, n: fx.Node, fn, prefix: str, index: int) -> fx.Node:
    new = gm.graph.node_copy(n, fn)
    new.meta[MODULE_PATH] = _renumber(n.meta.get(MODULE_PATH, ""), prefix, 1, index)
    new.meta[STAMPED_FROM] = n.name
    return new


def _renumber(path: str, prefix: str, old: int, new: int) -> str:
    head = f"{prefix}.{old}"
    if path == head or path.startswith(head + "."):
        return f"{prefix}.{new}" + path[len(head):]
    return path


def _rewire(layers: _Layers, envs: dict, copies: int) -> None:
    """Layer 2 now follows the last copy; layer 1's backward reads the first copy's gradients."""
    def to_last(a: fx.Node) -> fx.Node:
        w = layers.where.get(a)
        return envs[copies][a] if w is not None and w[0] == 1 else a

    def to_first(a: fx.Node) -> fx.Node:
        w = layers.where.get(a)
        return envs[1][layers.at(1, w[1], w[2])] if w is not None and w[0] == 2 else a

    for n in (*layers.fwd[2], *layers.bwd[2]):
        n.args, n.kwargs = fx.node.map_arg(n.args, to_last), fx.node.map_arg(n.kwargs, to_last)
    for n in (*layers.fwd[1], *layers.bwd[1]):
        n.args, n.kwargs = fx.node.map_arg(n.args, to_first), fx.node.map_arg(n.kwargs, to_first)


def _rename_layer(layers: _Layers, old: int, new: int) -> None:
    for rel, ph in layers.params[old].items():
        ph.meta[NAME] = f"{layers.prefix}.{new}.{rel}"
    for n in (*layers.fwd[old], *layers.bwd[old]):
        n.meta[MODULE_PATH] = _renumber(n.meta.get(MODULE_PATH, ""), layers.prefix, old, new)


def _stack_grads(grads: dict[str, fx.Node], layers: _Layers, envs: dict, stack: LayerStack) -> dict[str, fx.Node]:
    """Gradient nodes by full parameter name: layer 2's renamed, the copies' from the template's."""
    out = {}
    last = stack.num_layers - 1
    for name, node in grads.items():
        i = _layer_of(name, stack.path)
        if i == 2:
            name = f"{stack.path}.{last}." + name[len(f"{stack.path}.2."):]
        out[name] = node
    for rel in layers.params[1]:
        template = grads.get(f"{stack.path}.1.{rel}")
        if template is None:
            continue  # no gradient (frozen or non-float)
        w = layers.where.get(template)
        if w is None or w[0] != 1 or w[1] != "bwd":
            raise StampError(f"the gradient of {stack.path}.1.{rel} is not computed inside its layer")
        for k in envs:
            out[f"{stack.path}.{k + 1}.{rel}"] = envs[k][template]
    return out


def finish(gm: fx.GraphModule, loss: fx.Node, grads: dict[str, fx.Node], order: list[str],
           grad_names: list[str]) -> None:
    """Placeholders in the full model's order (`order`: params, buffers, inputs by name) and the
    output (loss, *grads in `grad_names` order)."""
    by_name = {n.meta[NAME]: n for n in gm.graph.nodes if n.op == "placeholder"}
    if sorted(by_name) != sorted(order):
        raise StampError("stamped placeholders do not match the model's parameters")
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    for name in order:
        first.prepend(by_name[name])
    out = gm.graph.output_node()
    out.args = ((loss, *(grads[n] for n in grad_names)),)
    out.meta[VAL] = tuple(n.meta[VAL] for n in out.args[0])
    gm.graph.lint()
    gm.recompile()


# ---------------------------------------------------------------- stamped copies after capture

def stamped_templates(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Stamped op node -> the traced node it was copied from (`stamp_stack`, meta STAMPED_FROM),
    where the two still make the same call: the same target, argument and keyword structure with the same
    scalars, and inputs and outputs of the same shapes and dtypes. Stamping makes them so by construction;
    this check keeps it exact after later rewrites (canonicalize), and a node failing it is enumerated
    as any other. Same call, same strategies and costs (`StrategyEnumerator.like`)."""
    by_name: dict[str, fx.Node] | None = None
    out: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        src = node.meta.get(STAMPED_FROM)
        if src is None or node.op != "call_function":
            continue
        if by_name is None:
            by_name = {n.name: n for n in graph.nodes}
        t = by_name.get(src)
        if t is not None and t is not node and _same_call(node, t):
            out[node] = t
    return out


def _same_call(a: fx.Node, b: fx.Node) -> bool:
    """Rules see a call as its target, its arguments with each input node replaced by (position among
    the node's distinct inputs, shape, dtype), and its outputs' shapes and dtypes (`rules.OpCall`)."""
    if a.op != b.op or a.target is not b.target or not _same_tensor(val_of(a), val_of(b)):
        return False
    ia = {n: i for i, n in enumerate(a.all_input_nodes)}
    ib = {n: i for i, n in enumerate(b.all_input_nodes)}
    return len(ia) == len(ib) and _same_args(a.args, b.args, ia, ib) and _same_args(a.kwargs, b.kwargs, ia, ib)


def _same_args(x, y, ix: dict, iy: dict) -> bool:
    if isinstance(x, fx.Node) or isinstance(y, fx.Node):
        return (isinstance(x, fx.Node) and isinstance(y, fx.Node) and ix[x] == iy[y]
                and _same_tensor(val_of(x), val_of(y)))
    if isinstance(x, (tuple, list)):
        return type(x) is type(y) and len(x) == len(y) and all(_same_args(p, q, ix, iy) for p, q in zip(x, y))
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_same_args(x[k], y[k], ix, iy) for k in x)
    return type(x) is type(y) and x == y


def _same_tensor(u, v) -> bool:
    """The same value description: tensors of one shape and dtype, tuples of such, or equal scalars."""
    if u is v:
        return True
    if isinstance(u, torch.Tensor):
        return isinstance(v, torch.Tensor) and u.shape == v.shape and u.dtype == v.dtype
    if isinstance(u, (tuple, list)):
        return isinstance(v, (tuple, list)) and len(u) == len(v) and all(_same_tensor(p, q) for p, q in zip(u, v))
    return type(u) is type(v) and u == v
