"""Pretrained weights in and out of a parallelized module as safetensors, never the whole model on a rank.

Load (`ParallelModule.load_safetensors`, `PipelinedModule.load_safetensors`): a safetensors file, or a
folder as transformers' `save_pretrained` writes it (`model.safetensors`, or shards listed by
`model.safetensors.index.json`). Every rank reads the headers, checks the keys against the model's
(torch's strict rule; a tied key may be absent, as transformers and `safetensors.torch.save_model`
write a tied tensor once), then, tensor by tensor, memory-maps the file holding it
(`safetensors.safe_open`) and reads only the blocks it owns (`get_slice(name)[...]`, one per piece of
a strided shard) into its local shard. The file is opened per tensor so that the mapped pages of at
most one tensor count in a rank's resident memory: a rank's peak is its shards, not the model (reading
half of each of 48 4-MB tensors of one file, measured: one safe_open for all of them grew the resident
memory by 191-194 MB, the file's size; one per tensor by 3 MB).

Save: the full model in that same layout, under the first key of each tensor. Rank 0 writes the format
itself (safetensors' own writers take every tensor at once), streamed: the header first (keys, dtypes, shapes and offsets are known from the model), then each
tensor's bytes as the ranks gather it (one all-gather per tensor, or a send from the pipeline stage that
holds it), so no rank holds more than one full tensor beyond its shards. `max_shard_bytes` splits the
tensors, in state-dict order, into files `model-0000k-of-0000n.safetensors` with an index, as
`save_pretrained(max_shard_size=...)` does. transformers' `from_pretrained` reads the result (save the
config beside it); `safetensors.torch.load_file` does too.

Why the `safetensors` package: it is the format transformers' hubs publish weights in, and its lazy
slices are what lets a rank read its share of a tensor without reading the tensor.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar import _torch_compat as compat
from autopar.errors import CheckpointError
from autopar.placement import local_ranges
from autopar.runtime.state import StateEntry, holds
from autopar.runtime.tensors import get_tensor

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


# ---------------------------------------------------------------- load

def load(module: torch.nn.Module, entries: list[StateEntry], path, *, strict: bool = True) -> None:
    """Copy this rank's slices of each tensor `module` holds from the checkpoint at `path` (no collective)."""
    where = _weight_map(Path(path))
    found = _check_keys(entries, where, path, strict)
    with torch.no_grad():
        for entry in entries:
            if entry.name in found and holds(module, entry.name):
                key = found[entry.name]
                _load_one(get_tensor(module, entry.name), entry, key, where[key])


def _weight_map(path: Path) -> dict[str, Path]:
    """{key: file holding it} for a safetensors file, an index file, or a folder with either."""
    if path.is_dir():
        path = path / INDEX if (path / INDEX).exists() else path / SINGLE
    if not path.exists():
        raise CheckpointError(f"no safetensors checkpoint at {path}: pass a .safetensors file, an index "
                              f"({INDEX}) or a folder holding {SINGLE} or {INDEX}")
    if path.name.endswith(".json"):
        weight_map = json.loads(path.read_text())["weight_map"]
        return {key: path.parent / file for key, file in weight_map.items()}
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return dict.fromkeys(f.keys(), path)


def _check_keys(entries: list[StateEntry], where: dict, path, strict: bool) -> dict[str, str]:
    """{placed name: the key the checkpoint has it under}; with `strict`, missing and unexpected keys
    raise as torch's load_state_dict reports them (the same error on every rank: no collective needed)."""
    found, known = {}, set()
    for entry in entries:
        known.update(entry.names)
        present = [n for n in entry.names if n in where]
        if present:
            found[entry.name] = present[0]
    missing = [e.name for e in entries if e.name not in found]
    unexpected = [k for k in where if k not in known]
    if strict and (missing or unexpected):
        raise CheckpointError(f"{path} does not match the model: missing keys {_few(missing)}, unexpected keys "
                              f"{_few(unexpected)}; load a checkpoint of this model, or pass strict=False to "
                              "load the keys both have")
    return found


def _few(keys: list[str]) -> str:
    return "[" + ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "") + "]"


def _load_one(target: DTensor, entry: StateEntry, key: str, file: Path) -> None:
    """Read this rank's block of tensor `key` from `file` into `target` (a DTensor: its local shard)."""
    from safetensors import safe_open
    with safe_open(str(file), framework="pt") as f:   # opened per tensor: its pages unmapped after
        piece = f.get_slice(key)
        shape = tuple(piece.get_shape())
        if shape != entry.shape:
            raise CheckpointError(f"{file}: {key} has shape {shape} but the model's {entry.name} has "
                                  f"{entry.shape}; load a checkpoint of this model (its config)")
        mesh = target.device_mesh
        ranges = local_ranges(target.placements, shape, tuple(mesh.get_coordinate()), tuple(mesh.shape))
        compat.local_tensor(target).copy_(read_blocks(piece, ranges) if shape else f.get_tensor(key))


def read_blocks(piece, ranges: list[list[tuple[int, int]]]) -> torch.Tensor:
    """The blocks `ranges` (per dim, ranges stacked in order) of a lazy safetensors slice, as one tensor."""
    for d, dim_ranges in enumerate(ranges):
        if len(dim_ranges) > 1:   # a strided shard: one read per piece
            return torch.cat([read_blocks(piece, [*ranges[:d], [r], *ranges[d + 1:]]) for r in dim_ranges], dim=d)
    return piece[tuple(slice(a, b) for ((a, b),) in ranges)]


# ---------------------------------------------------------------- save

def save(entries: list[StateEntry], gather: Callable[[StateEntry], torch.Tensor | None], path, *,
         max_shard_bytes: int | None = None) -> None:
    """Write the model in `save_pretrained`'s safetensors layout; `gather(entry)` is a collective every
    rank calls in the same order, returning the full tensor on rank 0 (the writer)."""
    path = Path(path)
    single = path.suffix == ".safetensors"
    if single and max_shard_bytes is not None:
        raise CheckpointError(f"max_shard_bytes={max_shard_bytes} writes shards and an index into a folder; "
                              f"pass a folder, not the file {path}")
    for entry in entries:
        if entry.dtype not in DTYPES:
            raise CheckpointError(f"{entry.name} has dtype {entry.dtype}, which safetensors does not store")
    shards = _shards(entries, max_shard_bytes)
    names = [path.name] if single else _shard_names(len(shards))
    folder = path.parent if single else path
    writer = not dist.is_initialized() or dist.get_rank() == 0
    if writer:
        folder.mkdir(parents=True, exist_ok=True)
        if not single:
            _remove_old_weights(folder)
    for shard, name in zip(shards, names):
        _write_file(shard, gather, folder / name if writer else None)
    if writer and len(names) > 1:
        _write_index(folder, shards, names)
    if dist.is_initialized():
        dist.barrier()   # the files are complete when any rank returns


def _nbytes(entry: StateEntry) -> int:
    numel = 1
    for n in entry.shape:
        numel *= n
    return numel * entry.dtype.itemsize


def _shards(entries: list[StateEntry], max_bytes: int | None) -> list[list[StateEntry]]:
    """Entries in order, cut into files of at most `max_bytes` (a larger tensor alone in its file)."""
    if max_bytes is None:
        return [list(entries)]
    shards: list[list[StateEntry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + _nbytes(entry) > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += _nbytes(entry)
    return shards


def _shard_names(n: int) -> list[str]:
    return [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _write_file(entries: list[StateEntry], gather, file: Path | None) -> None:
    """One safetensors file: 8-byte header length, JSON header (space-padded to 8 bytes), then the
    tensors' bytes in header order, each gathered when its turn comes. Larger elements first, so
    every tensor starts aligned to its element size."""
    entries = sorted(entries, key=lambda e: -e.dtype.itemsize)   # stable: state-dict order otherwise
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for entry in entries:
        header[entry.name] = {"dtype": DTYPES[entry.dtype], "shape": list(entry.shape),
                              "data_offsets": [offset, offset + _nbytes(entry)]}
        offset += _nbytes(entry)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    out = open(file, "wb") if file is not None else None
    try:
        if out:
            out.write(struct.pack("<Q", len(text)) + text)
        for entry in entries:
            full = gather(entry)
            if out:
                out.write(full.to("cpu", entry.dtype).contiguous().reshape(-1).view(torch.uint8).numpy())
            del full   # one full tensor at a time
    finally:
        if out:
            out.close()


def _remove_old_weights(folder: Path) -> None:
    """A previous save's weights in `folder` (as save_pretrained does): a stale model.safetensors would
    shadow new shards, a stale index new files."""
    for file in [folder / SINGLE, folder / INDEX, *folder.glob("model-*-of-*.safetensors")]:
        if file.exists():
            os.remove(file)


def _write_index(folder: Path, shards: list[list[StateEntry]], names: list[str]) -> None:
    """transformers' index of a sharded checkpoint: which file holds each key, and the total bytes."""
    weight_map = {e.name: name for shard, name in zip(shards, names) for e in shard}
    total = sum(_nbytes(e) for shard in shards for e in shard)
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
