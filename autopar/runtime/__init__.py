"""Runtime: the per-rank module under torchrun.

`module` (ParallelModule: DTensor parameters, the rewritten joint graph, train_step), `launch` (the
process group, this rank's device, one plan broadcast to every rank), `tensors` (DTensor helpers
both runtimes use), `materialize` (meta-device models built one module at a time), `checkpoint`
(DCP-ready state dicts), `cpu_memory` (allocator settings on CPU), `memtrack` (measured activation peaks).
"""
