"""`Mesh`: the devices a plan runs on, as an n-D grid with named axes and known links.

Devices are numbered row-major (the last axis is contiguous) and filled node by node, so an axis
whose groups stay inside one node uses the intra-node link and any other axis the inter-node link:
axis i is intra-node iff prod(shape[i:]) <= devices_per_node and devices_per_node is a multiple of
that product. On a (2, 4) mesh with 4 devices per node, axis 1 (groups {0,1,2,3}, {4,5,6,7}) is
intra-node and axis 0 (groups {0,4}, {1,5}, ...) crosses nodes.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any

from autopar.costmodel import comm
from autopar.costmodel.hardware import PRESETS, HardwareSpec, LinkSpec, get_hardware
from autopar.errors import MeshError


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


@dataclass(frozen=True, init=False, repr=False)
class Mesh:
    """An immutable device mesh: shape, axis names, hardware and devices per node."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    hardware: HardwareSpec
    devices_per_node: int

    def __init__(self, shape: int | tuple[int, ...] | list[int], axis_names: Any = None,
                 hardware: str | HardwareSpec | os.PathLike = "cpu",
                 devices_per_node: int | None = None) -> None:
        shape = _normalize_shape(shape)
        axis_names = _normalize_names(axis_names, len(shape))
        hw = get_hardware(hardware)
        if devices_per_node is None:
            # A spec without a node size (the CPU preset) holds the whole mesh in one node.
            devices_per_node = hw.devices_per_node or math.prod(shape)
        if not _positive_int(devices_per_node):
            raise MeshError(f"devices_per_node must be a positive int, got {devices_per_node!r}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis_names", axis_names)
        object.__setattr__(self, "hardware", hw)
        object.__setattr__(self, "devices_per_node", devices_per_node)
        # Derived, not a field: the planner asks for link kinds millions of times.
        object.__setattr__(self, "_link_kinds", tuple(
            "inter" if _crosses_nodes(math.prod(shape[i:]), devices_per_node) else "intra"
            for i in range(len(shape))))

    def for_program(self, compiled: bool) -> "Mesh":
        """This mesh with its hardware pricing the compiled per-rank program (`compiled=True`, Inductor) or
        the eager one (`HardwareSpec.for_program`)."""
        hw = self.hardware.for_program(compiled)
        return self if hw is self.hardware else Mesh(self.shape, self.axis_names, hw, self.devices_per_node)

    # --- sizes --------------------------------------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        """Total number of devices."""
        return math.prod(self.shape)

    @property
    def num_nodes(self) -> int:
        return -(-self.size // self.devices_per_node)

    def axis_index(self, axis: int | str) -> int:
        """The position of an axis given by name or index (negative indices count from the end)."""
        if isinstance(axis, str):
            if axis not in self.axis_names:
                raise MeshError(f"unknown mesh axis {axis!r}; this mesh has axes {self.axis_names}")
            return self.axis_names.index(axis)
        if isinstance(axis, int) and not isinstance(axis, bool) and -self.ndim <= axis < self.ndim:
            return axis % self.ndim
        raise MeshError(f"mesh axis must be a name in {self.axis_names} or an int in "
                        f"[{-self.ndim}, {self.ndim}), got {axis!r}")

    def axis_size(self, axis: int | str) -> int:
        return self.shape[self.axis_index(axis)]

    # --- links and costs ----------------------------------------------------------------------------

    def is_inter_node(self, axis: int | str) -> bool:
        """True if the device groups along `axis` span more than one node."""
        return self.link_kind(axis) == "inter"

    def link_kind(self, axis: int | str) -> str:
        """"inter" or "intra", the key into `HardwareSpec.link`."""
        return self._link_kinds[self.axis_index(axis)]

    def link(self, axis: int | str) -> LinkSpec:
        """The generic link an axis communicates over (calibrated fits: see `collective_time`)."""
        return self.hardware.link(self.link_kind(axis))

    def collective_time(self, kind: str, nbytes: float, axis: int | str) -> float:
        """Seconds for one collective along `axis` (B = `nbytes` as in `costmodel.comm`)."""
        index = self.axis_index(axis)
        return comm.hardware_collective_time(kind, nbytes, self.shape[index], self.hardware,
                                             self._link_kinds[index])

    def p2p_time(self, nbytes: float, axis: int | str) -> float:
        """Seconds of one blocking point-to-point transfer along `axis` between pipeline stages: the
        send_recv fit plus the hardware's `sync_latency` (the receiver reaches it from compute)."""
        return self.collective_time("send_recv", nbytes, axis) + self.hardware.sync_latency

    def explain_collective(self, kind: str, nbytes: float, axis: int | str) -> str:
        """The formula and numbers behind `collective_time`, one line."""
        index = self.axis_index(axis)
        link = self.hardware.link(self.link_kind(index), kind)
        return f"axis {self.axis_names[index]}: " + comm.explain(kind, nbytes, self.shape[index], link)

    # --- identity and serialisation -----------------------------------------------------------------

    def __str__(self) -> str:
        dims = "x".join(str(s) for s in self.shape)
        return (f"Mesh({dims}, axes=({','.join(self.axis_names)}), {self.hardware.name}, "
                f"{self.devices_per_node} devices/node)")

    __repr__ = __str__

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; hardware is a preset name when it is an unmodified preset."""
        hw = self.hardware
        return {
            "shape": list(self.shape),
            "axis_names": list(self.axis_names),
            "hardware": hw.name if PRESETS.get(hw.name) == hw else hw.to_json(),
            "devices_per_node": self.devices_per_node,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | str) -> "Mesh":
        """Rebuild a mesh from `to_json()` output (a dict or its JSON text)."""
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as e:
                raise MeshError(f"mesh JSON is not valid JSON: {e}") from e
        fields = ("shape", "axis_names", "hardware", "devices_per_node")
        if not isinstance(data, dict) or set(data) != set(fields):
            raise MeshError(f"mesh JSON must be an object with exactly the fields {fields}, "
                            f"got {data!r}")
        hardware = data["hardware"]
        if isinstance(hardware, dict):
            hardware = HardwareSpec.from_json(hardware)
        elif not isinstance(hardware, str) or hardware.lower() not in PRESETS:
            raise MeshError(f"mesh JSON 'hardware' must be a preset name {tuple(PRESETS)} "
                            f"or a hardware spec object, got {hardware!r}")
        shape = tuple(data["shape"]) if isinstance(data["shape"], list) else data["shape"]
        return cls(shape, data["axis_names"], hardware, data["devices_per_node"])

    def fingerprint(self) -> str:
        """A stable short hash of shape, names, node size and every hardware figure."""
        key = {"shape": list(self.shape), "axis_names": list(self.axis_names),
               "devices_per_node": self.devices_per_node, "hardware": self.hardware.to_json()}
        text = json.dumps(key, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _crosses_nodes(span: int, devices_per_node: int) -> bool:
    """Whether a block of `span` consecutive devices can straddle a node boundary."""
    return span > devices_per_node or devices_per_node % span != 0


def _normalize_shape(shape: Any) -> tuple[int, ...]:
    if _positive_int(shape):
        return (shape,)
    if isinstance(shape, (tuple, list)) and shape and all(_positive_int(s) for s in shape):
        return tuple(shape)
    raise MeshError(f"mesh shape must be a positive int or a non-empty tuple of positive ints, "
                    f"e.g. 8 or (2, 4); got {shape!r}")


def _normalize_names(names: Any, ndim: int) -> tuple[str, ...]:
    if names is None:
        return tuple(f"axis{i}" for i in range(ndim))
    if isinstance(names, str):
        names = (names,)
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, str) and n for n in names):
        raise MeshError(f"axis_names must be a tuple of non-empty strings, got {names!r}")
    if len(names) != ndim:
        raise MeshError(f"{len(names)} axis names {tuple(names)} for a {ndim}-D mesh; "
                        f"give one name per axis")
    if len(set(names)) != len(names):
        raise MeshError(f"axis names must be unique, got {tuple(names)}")
    return tuple(names)
