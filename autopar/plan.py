"""The Plan: what the solver chose, what it costs, and why — frozen data with a JSON round-trip.

A Plan is made once by `autopar.plan()` and read by people (`str(plan)`, `plan.explain`) and by the
runtime (the per-node strategies in `nodes`, the parameter placements in `params`). Placements are
stored as compact strings per mesh axis ("S0", "R", "P", "Pavg") and returned as DTensor placements.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from autopar.errors import AutoparError, PlanMismatchError
from autopar.mesh import Mesh
from autopar.placement import from_str

FORMAT_VERSION = 1


@dataclass(frozen=True)
class CollectiveRecord:
    kind: str             # all_reduce | all_gather | reduce_scatter | all_to_all | send_recv
    axis: str             # mesh axis name
    bytes: float          # B of the collective formula (the full tensor for all_reduce)
    predicted_time: float  # seconds
    phase: str            # forward | backward | optimizer
    source: str           # graph node (or parameter FQN) whose value moves
    module: str = ""      # module path it belongs to
    reason: str = ""      # e.g. "gradient", "parameter gather", "reshard S1->R"


@dataclass(frozen=True)
class ParamPlacement:
    name: str
    shape: tuple
    use: tuple            # spec the graph reads, one string per axis
    master: tuple         # spec the optimizer steps on (the DTensor parameter)
    grad: tuple           # spec the gradient is held in before the step
    modes: tuple          # per axis: dp | zero1 | zero2 | shard
    read_sharded: tuple = ()  # per axis: does a forward op compute on a shard of it (tp), rather than
                              # on it whole (dp, ZeRO: gathered first)? () when unknown (older plans)


@dataclass(frozen=True)
class NodeChoice:
    outs: tuple           # per output: tuple of strings per axis, or None
    ins: tuple            # per tensor input: tuple of strings per axis
    module: str = ""
    phase: str = ""


@dataclass(frozen=True)
class StagePlan:
    index: int
    modules: tuple
    ranks: tuple
    predicted_time: float
    memory: float


@dataclass(frozen=True)
class Plan:
    mesh: Mesh
    strategy: Any                       # what was asked: "auto", "dp", ... or {axis: name}
    recipes: tuple                      # per axis, the recipe in force
    feasible: bool
    predicted_step_time: float
    predicted_compute_time: float
    predicted_comm_time: float
    memory_per_device: float
    memory_breakdown: dict
    memory_budget: float | None
    collectives: tuple
    gap: float
    params: dict                        # FQN -> ParamPlacement
    nodes: dict                         # graph node name -> NodeChoice
    fingerprint: str
    stages: tuple = ()
    schedule: str | None = None
    num_microbatches: int = 1
    recompute: tuple = ()
    infeasible_reason: str = ""
    baselines: dict = field(default_factory=dict)   # recipe -> {"time", "memory", "feasible", "reason"}
    solver: dict = field(default_factory=dict)      # backend, status, seconds, sizes
    timings: dict = field(default_factory=dict)     # planning phase -> seconds
    model: dict = field(default_factory=dict)       # name, parameter count, input shapes, tied
    candidates: dict = field(default_factory=dict)  # param FQN / node -> rows of the choices it had
    mixed_precision: dict | None = None  # {"param_dtype", "reduce_dtype"} (autopar.capture.precision), None = fp32

    # ------------------------------------------------------------------ reading
    @property
    def predicted_mfu(self) -> float | None:
        """Model FLOPs utilisation: the step's model FLOPs (forward and backward of the global batch,
        recompute not counted) / (peak FLOP/s of the compute dtype x devices x predicted step time).
        None for plans saved before FLOPs were recorded."""
        flops = self.model.get("flops")
        if not flops or not self.predicted_step_time:
            return None
        dtype = self.mixed_precision["param_dtype"] if self.mixed_precision else "float32"
        return flops / (self.mesh.hardware.flops(dtype) * self.mesh.size * self.predicted_step_time)

    def placement(self, name: str) -> tuple:
        """DTensor placements (one per mesh axis) of a parameter FQN, a module's weight, or a node."""
        if name in self.params:
            return tuple(from_str(s) for s in self.params[name].master)
        if f"{name}.weight" in self.params:
            return self.placement(f"{name}.weight")
        if name in self.nodes and self.nodes[name].outs and self.nodes[name].outs[0] is not None:
            return tuple(from_str(s) for s in self.nodes[name].outs[0])
        close = [p for p in self.params if name.split(".")[-1] in p][:5]
        raise KeyError(f"{name!r} is not a parameter, module or graph node of this plan"
                       + (f"; did you mean one of {close}?" if close else ""))

    def summary(self, *, rich: bool | None = None, width: int = 100) -> str:
        """The plan on one screen (`autopar.inspection.summary`); `rich=None` uses rich when installed."""
        from autopar.inspection.summary import render_summary
        return render_summary(self, rich=rich, width=width)

    def __str__(self) -> str:
        return self.summary()

    def explain(self, name: str) -> str:
        from autopar.inspection.summary import explain
        return explain(self, name)

    def to_html(self, path) -> None:
        from autopar.inspection.html import to_html
        to_html(self, path)

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> str:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["mesh"] = self.mesh.to_json()
        data["params"] = {k: asdict(v) for k, v in self.params.items()}
        data["nodes"] = {k: asdict(v) for k, v in self.nodes.items()}
        data["collectives"] = [asdict(c) for c in self.collectives]
        data["stages"] = [asdict(s) for s in self.stages]
        return json.dumps({"autopar_plan": FORMAT_VERSION, **data}, indent=1, default=_jsonable)  # graph order kept

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as e:
            raise PlanFileError(f"not a plan file (invalid JSON: {e}); save plans with plan.save(path)") from None
        if not isinstance(data, dict) or data.pop("autopar_plan", None) != FORMAT_VERSION:
            raise PlanFileError("not an autopar plan (missing or unknown 'autopar_plan' version); "
                                "re-plan with this autopar version")
        try:
            return _decode(cls, data)
        except (KeyError, TypeError, ValueError) as e:
            raise PlanFileError(f"plan file is incomplete or corrupt ({type(e).__name__}: {e}); re-plan and save again") from None

    def save(self, path) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path) -> "Plan":
        with open(path, "rb") as f:
            raw = f.read()
        try:
            return cls.from_json(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise PlanFileError(f"{path} is not a plan file (not UTF-8 JSON); save plans with plan.save(path)") from None

    def check_matches(self, fingerprint: str, mesh: Mesh) -> None:
        """Refuse a plan made for another graph (model, input shapes) or mesh."""
        if self.mesh.fingerprint() != mesh.fingerprint():
            raise PlanMismatchError(f"this plan was made for {self.mesh}, not {mesh}; re-plan for this mesh")
        if self.fingerprint != fingerprint:
            raise PlanMismatchError("this plan was made for another model or other input shapes "
                                    f"(plan {self.fingerprint[:12]}, model {fingerprint[:12]}); re-plan")


class PlanFileError(AutoparError, ValueError):
    """A plan file that is not valid JSON of this format."""


def _jsonable(x):
    if isinstance(x, tuple):
        return list(x)
    if isinstance(x, float) and x != x:
        return None
    raise TypeError(f"cannot store {type(x).__name__} in a plan")


def _tuplify(x):
    if isinstance(x, list):
        return tuple(_tuplify(i) for i in x)
    return x


def _decode(cls, data: dict) -> Plan:
    data = dict(data)
    data["mesh"] = Mesh.from_json(data["mesh"])
    data["params"] = {k: ParamPlacement(**{kk: _tuplify(vv) for kk, vv in v.items()}) for k, v in data["params"].items()}
    data["nodes"] = {k: NodeChoice(**{kk: _tuplify(vv) for kk, vv in v.items()}) for k, v in data["nodes"].items()}
    data["collectives"] = tuple(CollectiveRecord(**c) for c in data["collectives"])
    data["stages"] = tuple(StagePlan(**{kk: _tuplify(vv) for kk, vv in s.items()}) for s in data["stages"])
    for key in ("recipes", "recompute"):
        data[key] = _tuplify(data[key])
    names = {f.name for f in fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    for f in fields(cls):
        if f.name in data and f.type in ("float", "float | None") and data[f.name] is not None:
            data[f.name] = float(data[f.name])
    return cls(**data)
