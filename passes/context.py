"""What every rewrite pass may read: the plan, this rank's place on the mesh, its process groups."""
from __future__ import annotations

from dataclasses import dataclass, field

from autopar.graph import OUTS
from autopar.placement import from_str


@dataclass
class PassContext:
    plan: object                       # autopar.Plan
    axis_sizes: tuple[int, ...]
    coords: tuple[int, ...] = ()       # this rank's coordinate along each mesh axis
    group_names: tuple = ()            # functional-collective group name per mesh axis
    grad_names: tuple = ()             # parameter FQN of each gradient output, in output order
    device: str = "cpu"                # where this rank computes ("cuda:3" under NCCL)
    disabled: frozenset = frozenset()  # pass names switched off (debugging)
    timings: dict = field(default_factory=dict)

    def plan_master(self, param_name: str) -> tuple:
        return parse_spec(self.plan.params[param_name].master)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self.plan.mesh.axis_names)


def parse_spec(strs) -> tuple | None:
    return None if strs is None else tuple(from_str(s) for s in strs)


def value_spec(node) -> tuple:
    """The spec a node's (single) output value has in the rewritten graph."""
    return node.meta[OUTS][0]
