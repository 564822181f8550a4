"""Planning: price every candidate in seconds and bytes, and choose one per op under the memory budget.

`problem` (the cost problem built from a captured graph), `fusion` (how a compiled program fuses it), `reshard` (the price of moving a tensor
between placements), `costgraph` (the solver's torch-free input), `simplify`, `dp_oracle`, `ilp`,
`forest_bound` and `solver` (exact simplification, DP and the ILP), `recompute` (activation recompute
as a solver decision), `assemble` (a solution -> a Plan), `spmd` (the SPMD planning steps in order),
`scaling` (where adding devices stops paying), `collector` (the garbage collector paused while planning).
"""
