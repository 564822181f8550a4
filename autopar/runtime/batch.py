"""Which slice of the batch a rank feeds, and what a rank passes turned into its program's inputs.

A plan splits the batch (dim 0 of the inputs) over the mesh axes on which an input, or an op reading
it, is placed Shard(0): those are the data-parallel axes (of the most split such placement, in mesh
order). An input is often planned whole (Replicate: cutting it after is free) while the ops reading it
work on slices of its rows, so the ops' placements count too. Ranks that differ only on other axes (tp)
compute on the same rows, so they read the same slice. `data_parallel_rank` numbers the slices over
those axes (the first axis outermost), `data_parallel_size` counts them.

A rank passes either
  * the global batch, the same tensors on every rank: it keeps its planned block of each; or
  * its own data-parallel slice, `global_batch_size // data_parallel_size` rows of every batched input
    (a DistributedSampler over data_parallel_rank / data_parallel_size gives one). Rank r's slice stands
    for rows [r*b, (r+1)*b) of the global batch, so feeding slices equals feeding their concatenation in
    rank order. Under a pipeline of m micro-batches, rank r's slice stands for its r-th part of each
    micro-batch, in micro-batch order: slice k of m of what it passes is its part of micro-batch k.
Which of the two is decided by the rows: the plan's global batch size or the slice's (the same when
`data_parallel_size` is 1); every rank must feed the same way (a rank cannot see how the others do). Inputs whose first dimension is not the batch (or that nothing splits) are
passed whole. An input the plan lays out unlike the slices (labels planned whole because every rank
counts the valid targets of the whole batch, say) is all-gathered from the slices over the
data-parallel axes (one all-gather of that input per step), then cut as planned.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from autopar.errors import InputError
from autopar.passes.context import parse_spec
from autopar.placement import R, is_shard, is_strided
from autopar.runtime.tensors import local_slice


def _batch_axes(spec) -> tuple[int, ...]:
    """Mesh axes on which `spec` is a plain Shard(0) of the rows."""
    return tuple(a for a, p in enumerate(spec) if is_shard(p, 0) and not is_strided(p))


class BatchLayout:
    """The inputs of one rank's program: their names, global shapes and plan specs (one placement per
    mesh axis of `mesh`; a pipeline's of one micro-batch, `shapes` of all `microbatches`), this rank's
    coordinates, and the data-parallel split that follows from them."""

    def __init__(self, names, shapes, specs, coords, axis_sizes, mesh=None, microbatches: int = 1, reads=None):
        self.names, self.shapes, self.specs = list(names), [tuple(s) for s in shapes], [tuple(s) for s in specs]
        self.coords, self.axis_sizes, self.mesh, self.microbatches = tuple(coords), tuple(axis_sizes), mesh, microbatches
        reads = reads or [[] for _ in self.names]   # per input: the specs the ops reading it read it in
        candidates = [(math.prod(axis_sizes[a] for a in _batch_axes(spec)), -i, -j, _batch_axes(spec), shape[0])
                      for i, shape in enumerate(self.shapes) if shape
                      for j, spec in enumerate([self.specs[i], *reads[i]])]
        split, *_, axes, rows = max(candidates, default=(1, 0, 0, (), None))
        self.axes = axes if split > 1 else ()
        self.size = math.prod(axis_sizes[a] for a in self.axes)
        self.rank = 0
        for a in self.axes:
            self.rank = self.rank * axis_sizes[a] + coords[a]
        self.batch = rows if self.axes else None
        self.batched = [bool(s) and s[0] == self.batch and self.batch % (self.size * microbatches) == 0
                        for s in self.shapes]

    @property
    def local_batch(self) -> int | None:
        """Rows of a data-parallel slice (None when nothing splits the batch)."""
        return None if self.batch is None else self.batch // self.size

    def local_inputs(self, inputs: tuple, device) -> list[torch.Tensor]:
        """This rank's program inputs from what it was passed (global batch or its slice), on `device`."""
        if len(inputs) != len(self.shapes):
            raise InputError(f"expected {len(self.shapes)} inputs ({', '.join(self.names)}), got {len(inputs)}")
        sliced = self._fed_as_slices(inputs)
        out = []
        for i, x in enumerate(inputs):
            x = self._from_slice(i, x.to(device)) if sliced and self.batched[i] else self._from_global(i, x)
            out.append(x.contiguous().to(device))
        return out

    # ------------------------------------------------------------------ checks
    def _fed_as_slices(self, inputs: tuple) -> bool:
        """True when the batched inputs are this rank's slices, False when they are the global batch;
        an input of neither shape, or a mix of the two, is refused."""
        kinds: dict[str, list[str]] = {"global": [], "slice": []}
        for i, (name, x, shape) in enumerate(zip(self.names, inputs, self.shapes)):
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else None
            if got == shape:
                kinds["global"].append(name)
            elif got is not None and self.batched[i] and got == (self.local_batch, *shape[1:]):
                kinds["slice"].append(name)
            else:
                raise InputError(self._wrong_shape(i, got if got is not None else type(x).__name__))
        batched_global = [n for i, n in enumerate(self.names) if self.batched[i] and n in kinds["global"]]
        if kinds["slice"] and batched_global and self.size > 1:
            raise InputError(
                f"rank {_rank()}: input(s) {', '.join(map(repr, batched_global))} hold the global batch "
                f"({self.batch} rows) but {', '.join(map(repr, kinds['slice']))} hold this rank's data-parallel "
                f"slice ({self.local_batch} rows): pass every input as the global batch or every one as the "
                f"slice of data_parallel_rank {self.rank} of {self.size}")
        return bool(kinds["slice"])

    def _wrong_shape(self, i: int, got) -> str:
        name, shape = self.names[i], self.shapes[i]
        micro = f" ({self.microbatches} micro-batches)" if self.microbatches > 1 else ""
        if self.batched[i] and self.size > 1:
            local = (self.local_batch, *shape[1:])
            return (f"rank {_rank()}: input {name!r} has shape {got}; the plan expects the global batch {shape}"
                    f"{micro} on every rank, or this rank's data-parallel slice {local} (data_parallel_rank "
                    f"{self.rank} of data_parallel_size {self.size}); re-plan for another shape or pad/crop the batch")
        return (f"rank {_rank()}: input {name!r} has shape {got} but the plan was made for {shape}{micro}; "
                "re-plan for the new shape or pad/crop the batch")

    # ------------------------------------------------------------------ slicing
    def _from_global(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """This rank's block of a global input (of each micro-batch, re-joined along dim 0: the schedule
        cuts it again into the same micro-batches)."""
        spec = self.specs[i]
        if self.microbatches == 1:
            return local_slice(x, spec, self.coords, self.axis_sizes)
        return torch.cat([local_slice(c, spec, self.coords, self.axis_sizes) for c in x.chunk(self.microbatches)])

    def _from_slice(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """This rank's block of an input passed as its data-parallel slice."""
        spec = self.specs[i]
        if _batch_axes(spec) == self.axes and not any(is_strided(p) for p in spec if is_shard(p, 0)):
            return local_slice(x, tuple(R if is_shard(p, 0) else p for p in spec), self.coords, self.axis_sizes)
        return self._from_global(i, self._gather(x))

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """The global batch of one input from every data-parallel rank's slice (all-gather over the
        data-parallel axes; under a pipeline, micro-batch k is the slices' k-th parts in rank order)."""
        placements = [Shard(0) if a in self.axes else Replicate() for a in range(len(self.axis_sizes))]
        full = DTensor.from_local(x, self.mesh, placements, run_check=False).full_tensor()
        m = self.microbatches
        if m == 1:
            return full
        return full.unflatten(0, (self.size, m, -1)).transpose(0, 1).flatten(0, 2)


def input_reads(captured, plan) -> list[list[tuple]]:
    """Per input placeholder of `captured` (before the passes rewrite it), the specs of `plan` in which the
    ops using it read it (`NodeChoice.ins`, in `all_input_nodes` order)."""
    out = []
    for node in captured.placeholders("input"):
        specs = []
        for user in node.users:
            choice = plan.nodes.get(user.name)
            if choice is not None and user.op == "call_function":
                specs.append(parse_spec(choice.ins[list(user.all_input_nodes).index(node)]))
        out.append(specs)
    return out


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class DataParallelInputs:
    """The data-parallel view of a parallel module (mixed into ParallelModule and PipelinedModule, which
    set `batch_layout`): which slice of the batch this rank may feed, and a sampler that yields it."""

    batch_layout: BatchLayout

    @property
    def data_parallel_rank(self) -> int:
        """This rank's slice among `data_parallel_size` (ranks that differ only on non-batch axes share one)."""
        return self.batch_layout.rank

    @property
    def data_parallel_size(self) -> int:
        """How many distinct slices the plan cuts the batch into (1: every rank reads the whole batch)."""
        return self.batch_layout.size

    def distributed_sampler(self, dataset, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        """A `torch.utils.data.DistributedSampler` over `dataset` yielding this rank's data-parallel share:
        pair it with `DataLoader(dataset, batch_size=global_batch // data_parallel_size, sampler=...)` and
        call `sampler.set_epoch(epoch)` each epoch. The union of the ranks' batches of one step is a
        global batch, whatever the world size or plan."""
        from torch.utils.data import DistributedSampler
        return DistributedSampler(dataset, num_replicas=self.data_parallel_size, rank=self.data_parallel_rank,
                                  shuffle=shuffle, seed=seed, drop_last=drop_last)
