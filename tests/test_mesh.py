"""Tests of autopar.mesh.Mesh: axis links, sizes, costs, serialisation and errors."""
from __future__ import annotations

import dataclasses

import pytest

from autopar.costmodel import comm, hardware
from autopar.costmodel.hardware import LinkSpec
from autopar.errors import HardwareError, MeshError
from autopar.mesh import Mesh


def test_2x4_with_4_per_node_outer_axis_crosses_nodes():
    mesh = Mesh((2, 4), ("dp", "tp"), hardware="h100", devices_per_node=4)
    assert mesh.size == 8 and mesh.ndim == 2 and mesh.num_nodes == 2
    assert mesh.is_inter_node("dp") and not mesh.is_inter_node("tp")
    assert mesh.link(0) == hardware.H100.inter_node and mesh.link(1) == hardware.H100.intra_node
    assert mesh.axis_size("tp") == 4 and mesh.axis_index("dp") == 0 and mesh.axis_index(-1) == 1


def test_1d_mesh_of_8_fits_one_gpu_node():
    mesh = Mesh(8, hardware="a100")
    assert mesh.shape == (8,) and mesh.axis_names == ("axis0",)
    assert mesh.devices_per_node == 8 and mesh.num_nodes == 1 and not mesh.is_inter_node(0)
    assert Mesh(16, hardware="a100").is_inter_node(0)


def test_node_size_must_divide_evenly():
    # 4 consecutive devices with 6 per node: devices 4..7 straddle nodes 0 and 1.
    mesh = Mesh((3, 4), hardware="h100", devices_per_node=6)
    assert mesh.is_inter_node(1) and mesh.is_inter_node(0)


def test_cpu_mesh_is_one_node():
    mesh = Mesh((2, 2))
    assert mesh.hardware is hardware.CPU and mesh.devices_per_node == 4 and mesh.num_nodes == 1
    assert not mesh.is_inter_node(0)


def test_collective_time_uses_axis_size_and_link():
    mesh = Mesh((2, 4), ("dp", "tp"), hardware="h100", devices_per_node=4)
    assert mesh.collective_time("all_reduce", 1e6, "tp") == \
        comm.collective_time("all_reduce", 1e6, 4, hardware.H100.intra_node)
    assert mesh.collective_time("all_reduce", 1e6, "dp") == \
        comm.collective_time("all_reduce", 1e6, 2, hardware.H100.inter_node)
    # a 100x slower outer axis: the known result the solver relies on
    slow, fast = (mesh.collective_time("all_gather", 1e8, axis) for axis in ("dp", "tp"))
    assert slow > 5 * fast
    assert "axis tp" in mesh.explain_collective("all_reduce", 1e6, "tp")


def test_calibrated_fit_is_used():
    fit = LinkSpec(bandwidth=1e9, latency=1e-3)
    hw = dataclasses.replace(hardware.H100, name="fit", collectives={"intra": {"all_gather": fit}})
    mesh = Mesh(4, hardware=hw)
    assert mesh.collective_time("all_gather", 1e6, 0) == comm.collective_time("all_gather", 1e6, 4, fit)


def test_json_round_trip_equality_and_hash():
    mesh = Mesh((2, 4), ("dp", "tp"), hardware="h100", devices_per_node=4)
    data = mesh.to_json()
    assert data["hardware"] == "h100"
    assert Mesh.from_json(data) == mesh and hash(Mesh.from_json(data)) == hash(mesh)
    custom = Mesh(4, hardware=dataclasses.replace(hardware.H100, mem_capacity=40e9))
    again = Mesh.from_json(custom.to_json())
    assert isinstance(custom.to_json()["hardware"], dict)
    assert again == custom and again.fingerprint() == custom.fingerprint()
    assert mesh.fingerprint() != Mesh((4, 2), ("dp", "tp"), "h100", 4).fingerprint()
    assert mesh != Mesh((2, 4), ("dp", "tp"), hardware="h200", devices_per_node=4)


def test_str():
    mesh = Mesh((2, 4), ("dp", "tp"), hardware="h100", devices_per_node=4)
    assert str(mesh) == "Mesh(2x4, axes=(dp,tp), h100, 4 devices/node)"


def test_immutable():
    mesh = Mesh(4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        mesh.shape = (8,)


@pytest.mark.parametrize("kwargs, message", [
    (dict(shape=0), "positive"),
    (dict(shape=(2, -1)), "positive"),
    (dict(shape=()), "positive"),
    (dict(shape=(2, 2), axis_names=("dp",)), "one name per axis"),
    (dict(shape=(2, 2), axis_names=("dp", "dp")), "unique"),
    (dict(shape=4, devices_per_node=0), "devices_per_node"),
    (dict(shape=4, devices_per_node=2.5), "devices_per_node"),
])
def test_invalid_meshes(kwargs, message):
    with pytest.raises(MeshError, match=message):
        Mesh(**kwargs)


def test_unknown_axis_and_hardware():
    mesh = Mesh((2, 2), ("dp", "tp"))
    with pytest.raises(MeshError, match="dp"):
        mesh.axis_index("pp")
    with pytest.raises(MeshError):
        mesh.axis_size(2)
    with pytest.raises(HardwareError, match="h100"):
        Mesh(4, hardware="tpu")
