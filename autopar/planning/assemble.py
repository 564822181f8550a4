"""Turn a solved CostProblem into a Plan: placements per node and parameter, collectives, totals."""
from __future__ import annotations

import dataclasses

import numpy as np

from autopar.graph import MODULE_PATH, NAME, PHASE, ROLE, VAL, is_view_like, producer_of
from autopar.placement import is_shard, replicated, to_str
from autopar.plan import CollectiveRecord, NodeChoice, ParamPlacement, Plan
from autopar.planning.problem import CATEGORIES, CostProblem
from autopar.sharding.params import ParamStrategy
from autopar.sharding.rules import IN_OP_COLLECTIVES, in_op_collectives


def spec_strs(spec) -> tuple | None:
    return None if spec is None else tuple(to_str(p) for p in spec)


def _module(node) -> str:
    if node.op == "placeholder":
        return node.meta.get(NAME, node.name).rsplit(".", 1)[0]
    return node.meta.get(MODULE_PATH, "") or ""


def collectives(prob: CostProblem, choice: np.ndarray, captured) -> list[CollectiveRecord]:
    """Every collective the plan runs, in graph order, with its phase and predicted seconds."""
    names = prob.mesh.axis_names
    rs = prob.reshard
    records = []

    def add(steps, phase, source, module, reason, bucketed, gather_share=1.0):
        for st in steps:
            records.append(CollectiveRecord(st.kind, names[st.axis], st.nbytes,
                                            rs.step_time(st, bucketed, gather_share=gather_share),
                                            phase, source, module, reason))

    for i, node in enumerate(prob.nodes):  # zero1/2 gathers of the master, once per step
        s = prob.strategies[i][choice[i]]
        if isinstance(s, ParamStrategy) and s.outs[0] != s.master:
            add(rs.steps(s.master, s.outs[0], _bytes(node)), "forward", node.meta[NAME],
                _module(node), "parameter gather (ZeRO-1/2)", True)
    for e in prob.edges:
        src_s, dst_s = prob.strategies[e.src][choice[e.src]], prob.strategies[e.dst][choice[e.dst]]
        src_node, dst_node = prob.nodes[e.src], prob.nodes[e.dst]
        if e.kind == "grad":
            add(rs.steps(dst_s.outs[e.out], src_s.master, e.nbytes), "backward", src_node.meta[NAME],
                _module(src_node), "gradient", True)
        else:
            a, b = src_s.outs[e.out], dst_s.ins[e.pos]
            reason = f"{_spec_text(a)}->{_spec_text(b)} for {dst_node.target}"
            add(rs.steps(a, b, e.nbytes), dst_node.meta.get(PHASE, "forward"), src_node.name, _module(dst_node),
                reason, False, e.gather_share)
    for i, node in enumerate(prob.nodes):  # collectives inside an op (MoE expert dispatch)
        if node.target in IN_OP_COLLECTIVES:
            steps = in_op_collectives(node, prob.strategies[i][choice[i]], prob.reshard.axis_sizes)
            add(steps, node.meta.get(PHASE, "forward"), node.name, _module(node), "expert dispatch", False)
    loss_i = prob.loss_index
    producer, out = producer_of(captured.loss_node)
    s = prob.strategies[loss_i][choice[loss_i]]
    add(rs.steps(s.outs[out], replicated(prob.mesh.ndim), 4.0), "backward", "loss", "", "loss to every rank", True)
    return records


def _spec_text(spec) -> str:
    return "(" + ",".join(to_str(p) for p in spec) + ")"


def _bytes(node) -> float:
    v = node.meta[VAL]
    return float(v.numel() * v.element_size())


def node_choices(prob: CostProblem, choice: np.ndarray) -> dict[str, NodeChoice]:
    out = {}
    for i, node in enumerate(prob.nodes):
        s = prob.strategies[i][choice[i]]
        out[node.name] = NodeChoice(tuple(spec_strs(o) for o in s.outs), tuple(spec_strs(x) for x in s.ins),
                                    _module(node), node.meta.get(PHASE, "input"))
    return out


def param_placements(prob: CostProblem, choice: np.ndarray) -> dict[str, ParamPlacement]:
    out = {}
    readers: dict[int, list] = {}
    for e in prob.edges:
        if e.kind == "data":
            readers.setdefault(e.src, []).append(e)
    for name, i in prob.param_index.items():
        s = prob.strategies[i][choice[i]]
        shape = tuple(int(x) for x in prob.nodes[i].meta[VAL].shape)
        read_sharded = tuple(_read_sharded(prob, choice, readers, i, a) for a in range(prob.mesh.ndim))
        out[name] = ParamPlacement(name, shape, spec_strs(s.outs[0]), spec_strs(s.master), spec_strs(s.grad_hold),
                                   tuple(s.modes), read_sharded)
    return out


def _read_sharded(prob: CostProblem, choice: np.ndarray, readers: dict, src: int, axis: int) -> bool:
    """Does some forward op compute on node `src`'s value sharded on `axis`, following views and casts
    (a view of a shard read whole was gathered: ZeRO-3)?"""
    todo, seen = [src], {src}
    while todo:
        for e in readers.get(todo.pop(), ()):
            node = prob.nodes[e.dst]
            if node.meta.get(PHASE, "forward") != "forward" or not is_shard(
                    prob.strategies[e.dst][choice[e.dst]].ins[e.pos][axis]):
                continue
            if not is_view_like(node):
                return True
            if e.dst not in seen:
                seen.add(e.dst)
                todo.append(e.dst)
    return False


def totals(prob: CostProblem, choice: np.ndarray) -> dict:
    compute = float(sum(prob.compute[i][k] for i, k in enumerate(choice)))
    local = float(sum(prob.local_comm[i][k] for i, k in enumerate(choice)))
    edges = float(sum(e.time[choice[e.src], choice[e.dst]] for e in prob.cg.edges))
    memory = {c: float(sum(prob.memory[i][c][k] for i, k in enumerate(choice))) for c in CATEGORIES}
    overhead = prob.mesh.hardware.runtime_overhead   # once per step, whatever the choices (HardwareSpec)
    return {"compute": compute, "comm": local + edges, "overhead": overhead, "step": compute + local + edges + overhead,
            "memory": memory}


EXPLAINED_OPS = ("mm", "bmm", "addmm", "embedding", "_scaled_dot_product", "native_layer_norm", "_log_softmax")


def _neighbour_time(prob: CostProblem, by_node: dict, i: int, k: int, choice: np.ndarray) -> float:
    """Edge seconds around node i if it took strategy k and every other node kept its choice."""
    t = 0.0
    for e in by_node.get(i, ()):
        a = k if e.src == i else choice[e.src]
        b = k if e.dst == i else choice[e.dst]
        t += e.time[a, b]
    return float(t)


def candidates(prob: CostProblem, choice: np.ndarray, budget: float | None) -> dict[str, list[dict]]:
    """For parameters and the main ops: every candidate with compute, comm and memory if only this
    node changed, and what ruled it out (slower by how much, or over the memory budget)."""
    by_node: dict[int, list] = {}
    for e in prob.cg.edges:
        by_node.setdefault(e.src, []).append(e)
        by_node.setdefault(e.dst, []).append(e)
    total_mem = sum(float(prob.cg.nodes[i].memory[k]) for i, k in enumerate(choice))
    out = {}
    for i, node in enumerate(prob.nodes):
        is_param = node.op == "placeholder" and node.meta.get(ROLE) == "param"
        if not is_param and not any(op in str(node.target) for op in EXPLAINED_OPS):
            continue
        rows = []
        chosen_cost = None
        for k, s in enumerate(prob.strategies[i]):
            comm = float(prob.local_comm[i][k]) + _neighbour_time(prob, by_node, i, k, choice)
            mem = float(prob.cg.nodes[i].memory[k])
            row = {"strategy": str(s), "compute": float(prob.compute[i][k]), "comm": comm, "memory": mem,
                   "chosen": bool(k == choice[i])}
            rows.append(row)
            if k == choice[i]:
                chosen_cost, chosen_mem = row["compute"] + comm, mem
        for row in rows:
            if row["chosen"]:
                row["verdict"] = "chosen"
                continue
            delta_t = row["compute"] + row["comm"] - chosen_cost
            new_mem = total_mem - chosen_mem + row["memory"]
            if not np.isfinite(delta_t):
                row["verdict"] = "impossible with its neighbours' placements"
            elif budget is not None and new_mem > budget:
                row["verdict"] = f"over the memory budget by {new_mem - budget:.0f} B"
            elif delta_t > 0:
                row["verdict"] = f"slower by {delta_t:.3g} s"
            elif delta_t == 0:
                row["verdict"] = "ties with the chosen strategy"
            else:
                row["verdict"] = (f"faster alone by {-delta_t:.3g} s, but identical layers share one choice "
                                  "(the solve tiles whole layers) or the solver stopped at its time limit")
        key = node.meta[NAME] if is_param else node.name
        out[key] = rows
    return out


def with_recompute(plan: Plan, prob: CostProblem, choice: np.ndarray, rc) -> Plan:
    """The plan with activation recompute (`autopar.planning.recompute.RecomputeDecision`, or None: unchanged):
    its layers, the re-run forward seconds and repeated collectives added, the activations it frees."""
    if rc is None:
        return plan
    memory = {**plan.memory_breakdown, "activations": plan.memory_breakdown["activations"] + rc.activations}
    return dataclasses.replace(
        plan, recompute=rc.paths, predicted_step_time=plan.predicted_step_time + rc.compute + rc.comm,
        predicted_compute_time=plan.predicted_compute_time + rc.compute,
        predicted_comm_time=plan.predicted_comm_time + rc.comm, memory_breakdown=memory,
        memory_per_device=plan.memory_per_device + rc.activations,
        collectives=plan.collectives + tuple(_repeated(prob, choice, rc.edges)))


def _repeated(prob: CostProblem, choice: np.ndarray, edges) -> list[CollectiveRecord]:
    """The reshards of re-run forward ops' inputs, run again in backward."""
    rs, names, out = prob.reshard, prob.mesh.axis_names, []
    for k in edges:
        e = prob.edges[k]
        a = prob.strategies[e.src][choice[e.src]].outs[e.out]
        b = prob.strategies[e.dst][choice[e.dst]].ins[e.pos]
        dst = prob.nodes[e.dst]
        for st in rs.steps(a, b, e.nbytes):
            out.append(CollectiveRecord(st.kind, names[st.axis], st.nbytes, rs.step_time(st, False), "backward",
                                        prob.nodes[e.src].name, _module(dst),
                                        f"recompute: {_spec_text(a)}->{_spec_text(b)} for {dst.target}"))
    return out
