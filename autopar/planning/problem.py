"""Build the solver's CostGraph from a canonical joint graph: seconds and bytes per choice.

Cost-graph nodes are the graph's placeholders and ops (getitem nodes select an output of their
producer and are folded into edges). For strategy s of node v:
    time[v, s]   = roofline(local FLOPs, local bytes)  + node-local collectives
                   (zero1/2 parameter all-gather, the loss all-reduce to Replicate); for a
                   trainable parameter, its optimizer step: state bytes / bandwidth + the
                   hardware's per-tensor `param_step_overhead` (`fused_step_overhead` for a
                   "fused_" optimizer: pmodel.optimizer); for a view op (an alias), the
                   hardware's `op_overhead` alone (a dispatched call, no bytes; the same for every s).
                   A plan priced as compiled (`HardwareSpec.compiled`, `compile=True`) prices each op as
                   its part of Inductor's kernels (`autopar.planning.fusion`): views free, fused chains
                   one pass over what enters and leaves them, one `kernel_overhead` per kernel
    memory[v, s] = parameter + gradient + optimizer bytes (parameters), or the local bytes of
                   outputs saved for backward (forward ops whose value a backward op reads)
Edge (u, v): time[a, b] = reshard(u's output spec under a -> v's required input spec under b).
Gradient edge (param p, grad producer g): reshard(g's output -> p's master spec): this is the
all-reduce (dp) or reduce-scatter (zero) of the gradient.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx

from autopar.capture import precision
from autopar.capture.stamp import stamped_templates
from autopar.costmodel import compute
from autopar.costmodel.memory import optimizer_state_bytes_per_param, steps_local_shards
from autopar.graph import (
    NAME,
    PHASE,
    ROLE,
    is_getitem,
    layer_of,
    nbytes_of,
    node_path,
    packet,
    producer_of,
    val_of,
)
from autopar.placement import kind, local_fraction, replicated
from autopar.planning.costgraph import CostEdge, CostGraph, CostNode
from autopar.planning.fusion import FREE_OPS, Kernel, compiled_kernels  # FREE_OPS: aliases, no kernel, no bytes
from autopar.planning.reshard import ReshardCost
from autopar.sharding.params import input_strategies, param_memory, param_strategies
from autopar.sharding.rules import IN_OP_COLLECTIVES, in_op_collectives
from autopar.sharding.rules.strided import split_factors
from autopar.sharding.strategies import NodeStrategy, StrategyEnumerator, prune_partials

# "params" are the stored (master) shards and buffers; "gathered_params" the whole copies ZeRO-1/2
# gather once per step; "activations" the forward values kept for backward.
CATEGORIES = ("params", "gathered_params", "grads", "optimizer", "activations")


@dataclass
class EdgeInfo:
    src: int          # cost-graph node index of the producer (or the parameter, for "grad" edges)
    out: int          # which output of the producer
    dst: int          # cost-graph node index of the consumer (or the gradient's producer)
    pos: int          # which tensor input of the consumer (-1 for "grad" edges)
    nbytes: float     # global bytes of the tensor moved
    kind: str         # "data" | "grad"
    no_reduce: bool = False  # a data edge inside a gradient's cast/view tail (mixed precision): no reductions
    gather_share: float = 1.0  # of one collective's latencies its all-gathers pay (reshard.py): a parameter
                               # in a numbered layer rides in its layer's flat all-gather


@dataclass
class CostProblem:
    """Everything the planner knows about one (graph, mesh) pair, aligned with `cg` indices."""
    gm: fx.GraphModule
    mesh: object
    nodes: list[fx.Node]
    strategies: list[list[NodeStrategy]]
    edges: list[EdgeInfo]
    compute: list[np.ndarray]          # seconds per strategy (roofline)
    local_comm: list[np.ndarray]       # seconds per strategy of node-local collectives
    memory: list[dict[str, np.ndarray]]  # category -> bytes per strategy
    cg: CostGraph = None
    index: dict = field(default_factory=dict)
    loss_index: int = -1
    param_index: dict = field(default_factory=dict)   # param FQN -> node index
    reshard: ReshardCost = None
    signatures: dict = field(default_factory=dict)    # op node -> signature (StrategyEnumerator.signature)
    solver_cache: dict = field(default_factory=dict)  # reused across the solves of one plan (planner)
    restrictions: dict = field(default_factory=dict)  # recipe names -> allowed strategies (spmd.restricted_choices)
    derived: dict = field(default_factory=dict)       # pure functions of the problem, kept (layer_profile.unit_names)


def model_flops(gm: fx.GraphModule) -> float:
    """FLOPs of one training step of the global batch as captured (forward and backward, no
    recompute): the numerator of MFU. Counted per op by `costmodel.compute.node_flops` (cached by
    shape, so a stack of identical layers costs one count per distinct op)."""
    total = 0.0
    for node in gm.graph.nodes:
        if node.op == "call_function" and compute.is_flop_counted(node.target):
            total += compute.node_flops(node.target, fx.node.map_arg(node.args, val_of),
                                        fx.node.map_arg(node.kwargs, val_of))
    return total


def split_factor(strat: NodeStrategy, axis_sizes) -> int:
    """Devices the work is divided among: axes where any operand is sharded."""
    f = 1
    specs = [s for s in (*strat.outs, *strat.ins) if s is not None]
    for axis, n in enumerate(axis_sizes):
        if any(kind(s[axis]) == "S" for s in specs):
            f *= n
    return f


def _node_compute(node: fx.Node, strats: list[NodeStrategy], hw, axis_sizes, kernel: Kernel | None = None) -> np.ndarray:
    """Seconds per strategy of `node`: as the eager FX program runs it (`kernel` None), or as its part of a
    compiled program's kernels (`kernel`: `autopar.planning.fusion`)."""
    if kernel is not None and kernel.role == "free":   # folded into its readers' indexing
        return np.zeros(len(strats))
    if kernel is None and packet(node) in FREE_OPS:  # an alias moves no bytes, but the per-rank graph still dispatches it
        return np.full(len(strats), compute.view_time(hw))
    args = fx.node.map_arg(node.args, val_of)
    kwargs = fx.node.map_arg(node.kwargs, val_of)
    out = val_of(node)
    flops = compute.node_flops(node.target, args, kwargs, out)
    in_bytes = [nbytes_of(val_of(a)) for a in node.all_input_nodes]
    outs = out if isinstance(out, (tuple, list)) else (out,)
    out_bytes = [nbytes_of(o) for o in outs]
    overhead = bandwidth = None
    if kernel is not None:   # a fused op moves only what enters or leaves its chain; a kernel's end launches it
        in_bytes = [b if read else 0.0 for b, read in zip(in_bytes, kernel.reads)]
        out_bytes = [b if write else 0.0 for b, write in zip(out_bytes, kernel.writes)]
        overhead = hw.kernel_overhead if kernel.launches else 0.0
        bandwidth = hw.fused_bandwidth if kernel.role == "fused" else hw.mem_bandwidth
    dtype = next((o.dtype for o in outs if isinstance(o, torch.Tensor)), torch.float32)
    # exp-class ops: one transcendental per output element
    out_elements = [float(o.numel()) if isinstance(o, torch.Tensor) and compute.is_transcendental(node.target)
                    else 0.0 for o in outs]
    efficiency = compute.flop_efficiency(node.target, hw)   # attention kernels: below matmul speed
    times = np.empty(len(strats))
    for k, s in enumerate(strats):
        local = sum(b * local_fraction(spec, axis_sizes) for b, spec in zip(in_bytes, s.ins))
        local += sum(b * local_fraction(spec, axis_sizes) for b, spec in zip(out_bytes, s.outs) if spec is not None)
        elements = sum(e * local_fraction(spec, axis_sizes) for e, spec in zip(out_elements, s.outs)
                       if spec is not None)
        times[k] = compute.op_time(flops / split_factor(s, axis_sizes), local, hw, dtype, elements, efficiency,
                                   overhead=overhead, bandwidth=bandwidth)
    return times


def saved_values(gm: fx.GraphModule, recomputed: frozenset = frozenset()) -> set[tuple[fx.Node, int]]:
    """Forward values read by backward ops, resolved through view-like ops to their base.
    `recomputed`: forward nodes that backward runs again (`autopar.planning.recompute`): they read their
    inputs in backward like backward ops do, and are themselves not kept."""
    saved = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or (node.meta.get(PHASE) != "backward" and node not in recomputed):
            continue
        for a in node.all_input_nodes:
            if a in recomputed:
                continue
            base, i = producer_of(a)
            while base.op == "call_function" and packet(base) in FREE_OPS and base.meta.get(PHASE) == "forward":
                base, i = producer_of(base.all_input_nodes[0])
            if base.op == "placeholder" and base.meta.get(ROLE) != "input":
                continue  # parameters and buffers are counted as such
            if base.op == "placeholder" or base.meta.get(PHASE) == "forward":
                saved.add((base, i))
    return saved


def _saved_outputs(gm: fx.GraphModule) -> dict[fx.Node, list[int]]:
    """`saved_values` by producer: node -> the indices of its outputs backward reads."""
    saved: dict[fx.Node, list[int]] = {}
    for base, i in saved_values(gm):
        saved.setdefault(base, []).append(i)
    return saved


class ProblemBuilder:
    def __init__(self, captured, mesh, optimizer: str = "adamw", enumerator: StrategyEnumerator | None = None,
                 prune: bool = True, reuse_stamped: bool = True):
        self.captured = captured
        self.gm = captured.gm
        self.mesh = mesh
        self.axis_sizes = tuple(mesh.shape)
        self.hw = mesh.hardware
        self.optimizer = optimizer
        self.fused_step = steps_local_shards(optimizer)   # pmodel.optimizer steps it: fused_step_overhead
        self.enumerate = enumerator or StrategyEnumerator(self.axis_sizes)
        self.reshard = ReshardCost(mesh)
        # a plan priced as compiled: each op's part of Inductor's kernels (autopar/planning/fusion.py)
        self.kernels = compiled_kernels(self.gm) if self.hw.compiled else {}
        self._matrices: dict[tuple, np.ndarray] = {}
        self._facts: dict[str, object] = {}   # pure functions of the graph (`share_graph_facts`)
        # Identical layers repeat (strategy list, op signature) pairs: costs are priced once per pair.
        # Keys hold id() of strategy lists; each entry also holds the lists, so an id is never reused.
        self._memo: dict[tuple, tuple[np.ndarray, tuple]] = {}
        self._placeholder_strategies: dict[tuple, list[NodeStrategy]] = {}
        self._specs: dict[tuple, tuple] = {}   # `_unique_specs`: (list id, side, index) -> (the list, its answer)
        self.prune = prune  # False keeps every rule strategy (tests compare the optima)
        # a stamped layer's op takes its template's strategies and signature (`stamped_templates`); False
        # enumerates every node afresh (tests compare the two)
        self.reuse_stamped = reuse_stamped

    def share_graph_facts(self, store: dict) -> None:
        """Keep what depends on the graph alone (`stamped_templates`, the saved values) in `store`, shared
        with every builder of the same graph, which none of them changes (other meshes of one capture:
        0.5-0.8 CPU s a build on Llama-3.1-405B)."""
        self._facts = store

    def _fact(self, name: str, make):
        if name not in self._facts:
            self._facts[name] = make()
        return self._facts[name]

    def share_matrices(self, store: dict) -> None:
        """Price reshard matrices into `store`, shared with other builders on the same mesh and hardware
        (`_spec_matrix`'s key holds everything the price depends on but the mesh)."""
        self._matrices = store

    def build(self, allowed=None) -> CostProblem:
        """`allowed(node, strategies) -> strategies` may restrict choices (forced recipes)."""
        prob = self.build_nodes(allowed)
        self._data_edges(prob)
        self._grad_edges(prob)
        self._loss(prob)
        prob.cg = self._cost_graph(prob)
        return prob

    def build_nodes(self, allowed=None) -> CostProblem:
        """The CostProblem's nodes, strategies and per-node costs only: no edges, no cost graph (and
        the loss's all-reduce not yet added). What `autopar.pipeline.search.Profiler.seconds_bound` reads,
        at about half the cost of `build`."""
        nodes, strats = [], []
        templates = self._fact("templates", lambda: stamped_templates(self.gm.graph)) if self.reuse_stamped else {}
        for node in self.gm.graph.nodes:
            if node.op == "output" or is_getitem(node) or val_of(node) is None:
                continue
            template = templates.get(node)
            cands = self._strategies(node) if template is None else self.enumerate.like(node, template)
            if allowed is not None:
                cands = allowed(node, cands)
            if not cands:
                raise AssertionError(f"no strategy left for {node.name}")
            nodes.append(node)
            strats.append(cands)
        if self.prune:
            strats = _same_across_layers(nodes, strats, prune_partials(nodes, strats))
        prob = CostProblem(self.gm, self.mesh, nodes, strats, [], [], [], [], reshard=self.reshard,
                       signatures=self.enumerate.signature)
        prob.index = {n: i for i, n in enumerate(nodes)}
        prob.param_index = {n.meta[NAME]: prob.index[n] for n in nodes
                            if n.op == "placeholder" and n.meta[ROLE] == "param"}
        self._node_costs(prob)
        return prob

    def _strategies(self, node: fx.Node) -> list[NodeStrategy]:
        if node.op != "placeholder":
            return self.enumerate(node)
        shape = tuple(int(s) for s in val_of(node).shape)
        is_param = node.meta[ROLE] == "param"
        trainable = is_param and node.meta[NAME] in self.captured.grad_param_names
        factors = split_factors(node.graph) if is_param else frozenset()  # strided shards of fused weights
        key = (shape, is_param, trainable, factors)  # one shared list per kind of input, as for ops
        if key not in self._placeholder_strategies:
            self._placeholder_strategies[key] = (
                param_strategies(shape, self.axis_sizes, trainable, factors) if is_param
                else input_strategies(shape, self.axis_sizes))
        return self._placeholder_strategies[key]

    def _node_costs(self, prob: CostProblem) -> None:
        saved = self._fact("saved", lambda: _saved_outputs(self.gm))
        opt_bytes = optimizer_state_bytes_per_param(self.optimizer, torch.float32)
        for node, strats in zip(prob.nodes, prob.strategies):
            k = len(strats)
            mem = {c: np.zeros(k) for c in CATEGORIES}
            comm = np.zeros(k)
            val = val_of(node)
            if node.op == "placeholder":
                prob.compute.append(self._placeholder_costs(node, strats, mem, comm, opt_bytes))
            else:
                kernel = self.kernels.get(node)
                prob.compute.append(self._memoized(("compute", id(strats), self.enumerate.signature[node], kernel),
                                                   (strats,),
                                                   lambda: _node_compute(node, strats, self.hw, self.axis_sizes, kernel)))
                if node.target in IN_OP_COLLECTIVES:  # collectives inside the op (MoE expert dispatch)
                    comm[:] = [sum(self.reshard.step_time(st) for st in in_op_collectives(node, s, self.axis_sizes))
                               for s in strats]
            if node in saved:
                key = ("saved", id(strats), self.enumerate.signature.get(node, node), tuple(saved[node]))
                mem["activations"] = self._memoized(key, (strats,), lambda: self._saved_bytes(val, strats, saved[node]))
            prob.local_comm.append(comm)
            prob.memory.append(mem)

    def _memoized(self, key: tuple, lists: tuple, make) -> np.ndarray:
        """make() once per key; the array is shared (read-only) by every node or edge with that key."""
        if key not in self._memo:
            arr = make()
            arr.flags.writeable = False
            self._memo[key] = (arr, lists)
        return self._memo[key][0]

    def _saved_bytes(self, val, strats: list[NodeStrategy], outputs: list[int]) -> np.ndarray:
        """Bytes per device, per strategy, of the outputs backward reads."""
        outs = val if isinstance(val, (tuple, list)) else (val,)
        act = np.zeros(len(strats))
        for i in outputs:
            for s_idx, s in enumerate(strats):
                act[s_idx] += nbytes_of(outs[i]) * local_fraction(s.outs[i], self.axis_sizes)
        return act

    def _placeholder_costs(self, node, strats, mem, comm, opt_bytes) -> np.ndarray:
        """Seconds per strategy of a placeholder (its optimizer step); fills its memory and node-local
        collectives. A pure function of (strategy list, role, trainable, bytes, elements): the same
        parameter of L identical layers is priced once and copied."""
        val = val_of(node)
        trainable = node.meta[ROLE] == "param" and node.meta[NAME] in self.captured.grad_param_names
        key = ("placeholder", id(strats), node.meta[ROLE], trainable, nbytes_of(val),
               val.numel() if isinstance(val, torch.Tensor) else 0)
        if key not in self._memo:
            fresh = {c: np.zeros(len(strats)) for c in CATEGORIES}
            fresh_comm = np.zeros(len(strats))
            times = self._price_placeholder(node, strats, fresh, fresh_comm, opt_bytes, trainable)
            self._memo[key] = ((times, fresh, fresh_comm), (strats,))
        times, found, found_comm = self._memo[key][0]
        for c, arr in found.items():
            mem[c][:] = arr
        comm[:] = found_comm
        return times.copy()

    def _price_placeholder(self, node, strats, mem, comm, opt_bytes, trainable: bool) -> np.ndarray:
        val = val_of(node)
        nbytes = nbytes_of(val)
        times = np.zeros(len(strats))
        if node.meta[ROLE] != "param":
            if node.meta[ROLE] == "buffer":
                mem["params"][:] = [nbytes * local_fraction(s.outs[0], self.axis_sizes) for s in strats]
            return times
        for k, s in enumerate(strats):
            for cat, b in param_memory(s, nbytes, val.numel(), self.axis_sizes, opt_bytes, trainable).items():
                mem[cat][k] = b
            if s.outs[0] != s.master:  # zero1/2: gather the updated master once per step (bucketed)
                comm[k] = self.reshard.time(s.master, s.outs[0], nbytes, bucketed=True)
            if trainable:  # optimizer step: read p, g, states; write p, states (memory bound), plus
                # the fixed per-tensor cost of a step on a DTensor parameter (the same for every spec)
                touched = (3 * nbytes + val.numel() * 2 * opt_bytes) * local_fraction(s.master, self.axis_sizes)
                times[k] = touched / self.hw.mem_bandwidth + self.hw.step_overhead(self.fused_step)
        return times

    def _data_edges(self, prob: CostProblem) -> None:
        tails = (precision.gradient_tails(list(self.captured.grad_nodes.values()))
                 if self.captured.mixed_precision is not None else set())
        # a numbered layer's parameters are all-gathered as one (passes/bucket_layer_gathers.py): each
        # pays its bytes' share of that collective's latencies, at least one over the layer's
        # parameter count (a layer's small vectors are not gathered for nothing)
        layer_bytes: dict[tuple[str, int], float] = {}
        layer_count: dict[tuple[str, int], int] = {}
        param_layer: dict[fx.Node, tuple[str, int]] = {}
        for node in prob.nodes:
            layer = layer_of(node.meta[NAME]) if node.meta.get(ROLE) == "param" else None
            if layer is not None:
                param_layer[node] = layer
                layer_bytes[layer] = layer_bytes.get(layer, 0.0) + nbytes_of(val_of(node))
                layer_count[layer] = layer_count.get(layer, 0) + 1
        for dst, node in enumerate(prob.nodes):
            if node.op == "placeholder":
                continue
            for pos, a in enumerate(node.all_input_nodes):
                producer, out = producer_of(a)
                if producer not in prob.index:
                    continue
                nbytes = nbytes_of(val_of(a))
                layer = param_layer.get(producer)
                share = max(nbytes / layer_bytes[layer], 1.0 / layer_count[layer]) if layer else 1.0
                prob.edges.append(EdgeInfo(prob.index[producer], out, dst, pos, nbytes, "data", no_reduce=node in tails,
                                           gather_share=share))

    def _grad_edges(self, prob: CostProblem) -> None:
        for name, g in self.captured.grad_nodes.items():
            producer, out = producer_of(g)
            if producer not in prob.index or name not in prob.param_index:
                continue
            val = val_of(g)  # mixed precision: the reduction moves `reduce_dtype` elements
            nbytes = val.numel() * precision.reduce_itemsize(self.captured.mixed_precision, val.dtype)
            prob.edges.append(EdgeInfo(prob.param_index[name], out, prob.index[producer], -1, float(nbytes), "grad"))

    def _loss(self, prob: CostProblem) -> None:
        producer, out = producer_of(self.captured.loss_node)
        prob.loss_index = prob.index[producer]
        nbytes = nbytes_of(val_of(self.captured.loss_node))
        rep = replicated(len(self.axis_sizes))
        for k, s in enumerate(prob.strategies[prob.loss_index]):
            # the loss all-reduce rides in the last gradient bucket (the runtime fuses it there)
            prob.local_comm[prob.loss_index][k] += self.reshard.time(s.outs[out], rep, nbytes, bucketed=True)

    def edge_matrix(self, prob: CostProblem, e: EdgeInfo) -> np.ndarray:
        """Seconds of resharding per (src strategy, dst strategy), priced once per unique spec pair;
        edges between the same strategy lists (identical layers) share one read-only matrix."""
        src_s, dst_s = prob.strategies[e.src], prob.strategies[e.dst]
        key = ("edge", e.kind, id(src_s), id(dst_s), e.out, e.pos, float(e.nbytes), e.no_reduce, e.gather_share)
        return self._memoized(key, (src_s, dst_s), lambda: self._edge_matrix(src_s, dst_s, e))

    def _edge_matrix(self, src_s: list[NodeStrategy], dst_s: list[NodeStrategy], e: EdgeInfo) -> np.ndarray:
        if e.kind == "grad":  # src is the parameter: its master spec; dst produces the gradient
            src, dst = self._unique_specs(src_s, "master"), self._unique_specs(dst_s, "outs", e.out)
            small = self._spec_matrix(dst, src, e.nbytes, bucketed=True).T
        else:
            src, dst = self._unique_specs(src_s, "outs", e.out), self._unique_specs(dst_s, "ins", e.pos)
            small = self._spec_matrix(src, dst, e.nbytes, bucketed=False, gather_share=e.gather_share)
            if e.no_reduce:
                small = np.where(self.reshard.reduces(src[0], dst[0]), np.inf, small)
        return small[np.ix_(src[2], dst[2])]

    def _unique_specs(self, strats: list[NodeStrategy], side: str, k: int = 0) -> tuple:
        """`ReshardCost.unique` of one spec of each strategy (its master spec, output k or input k), once per
        strategy list: identical layers share their lists, and an op's list meets many edges."""
        key = (id(strats), side, k)
        found = self._specs.get(key)
        if found is None:
            specs = [s.master for s in strats] if side == "master" else [getattr(s, side)[k] for s in strats]
            found = self._specs[key] = (strats, self.reshard.unique(specs))
        return found[1]

    def _spec_matrix(self, a: tuple, b: tuple, nbytes: float, bucketed: bool, gather_share: float = 1.0) -> np.ndarray:
        """reshard(a -> b) over the distinct specs of each side (`ReshardCost.unique`'s answers), in first-seen
        order; identical layers repeat the same (specs, specs, bytes), so each distinct matrix is priced once."""
        key = (a[1], b[1], float(nbytes), bucketed, gather_share)
        if key not in self._matrices:
            self._matrices[key] = self.reshard.matrix(a[0], b[0], nbytes, bucketed, gather_share)
        return self._matrices[key]

    def _cost_graph(self, prob: CostProblem) -> CostGraph:
        nodes = [CostNode(n.name, prob.compute[i] + prob.local_comm[i], sum(prob.memory[i].values()))
                 for i, n in enumerate(prob.nodes)]
        edges = []
        for e in prob.edges:
            src, dst, mat = e.src, e.dst, self.edge_matrix(prob, e)
            edges.append(CostEdge(src, dst, mat))
        return CostGraph(nodes, edges, layer_groups=layer_groups(prob))


def _same_across_layers(nodes: list[fx.Node], full: list[list], pruned: list[list]) -> list[list]:
    """`prune_partials` (exact) may keep different strategies at the same node of two identical
    layers (layer 0 reads the embedding, later layers a residual); keeping the union at every layer
    position restores identical layers, so the solver can still tile them (keeping more is exact)."""
    slots: dict[tuple, list[int]] = {}
    count: dict[tuple[str, int], int] = {}
    for i, node in enumerate(nodes):
        key = layer_of(node_path(node))
        if key is not None:
            pos = count[key] = count.get(key, -1) + 1
            slots.setdefault((key[0], pos, str(node.target), len(full[i])), []).append(i)
    out = list(pruned)
    for members in slots.values():
        kept = list({id(pruned[i]): pruned[i] for i in members}.values())  # identical layers share lists
        fulls = list({id(full[i]): full[i] for i in members}.values())
        if len(fulls) == 1:  # all pruned lists are sublists of one list (no duplicates): union by identity
            union_ids = set().union(*(map(id, lst) for lst in kept))
            shared = fulls[0] if len(union_ids) == len(fulls[0]) else [s for s in fulls[0] if id(s) in union_ids]
            for i in members:
                out[i] = shared
            continue
        union = set().union(*kept)
        by_full: dict[int, list] = {}  # one list object per distinct full list (recipes memoize by id)
        for i in members:
            if id(full[i]) not in by_full:
                by_full[id(full[i])] = [s for s in full[i] if s in union]
            out[i] = by_full[id(full[i])]
    return out


def layer_groups(prob: CostProblem) -> list[list[list[int]]]:
    """Classes of structurally identical layers, each layer a list of node indices in order."""
    layers: dict[tuple[str, int], list[int]] = {}
    for i, key in enumerate(_layer_keys(prob)):
        if key is not None:
            layers.setdefault(key, []).append(i)
    classes: dict[tuple, list[list[int]]] = {}
    for (container, _), idxs in sorted(layers.items()):
        sig = (container,) + tuple(_signature(prob, i) for i in idxs)
        classes.setdefault(sig, []).append(idxs)
    return [layers_ for layers_ in classes.values() if len(layers_) > 1]


def _layer_keys(prob: CostProblem) -> list[tuple[str, int] | None]:
    """Each node's layer. The gradient sums autograd inserts (backward adds, e.g. of the residual
    stream) have no module path; each joins the lowest layer among its inputs'. Otherwise those
    nodes, ~10 per layer, sit outside the tiled layers and stay separate nodes in the quotient."""
    keys: dict[fx.Node, tuple[str, int] | None] = {}
    for node in prob.nodes:
        key = layer_of(node_path(node))
        if key is None and node.target is torch.ops.aten.add.Tensor and node.meta.get(PHASE) == "backward":
            found = [keys[p] for p in (producer_of(a)[0] for a in node.all_input_nodes) if keys.get(p) is not None]
            key = min(found) if found else None
        keys[node] = key
    return [keys[n] for n in prob.nodes]


def _signature(prob: CostProblem, i: int) -> tuple:
    node = prob.nodes[i]
    val = val_of(node)
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
    target = node.meta.get(ROLE) if node.op == "placeholder" else str(node.target)
    return (target, node.op, shape, len(prob.strategies[i]), node.meta.get(PHASE))


