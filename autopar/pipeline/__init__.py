"""Pipelines: stages, schedules, the pp x dp x tp layout search, and the pipelined runtime.

`stages` (schedule formulas and the exact contiguous split into stages), `layer_profile` (per-layer
costs of a solved SPMD plan), `planning` (forced pipelined plans), `candidates` and `search` (the
layout search with its branch and bound), `runtime` (the PipelinedModule on torch.distributed.pipelining).
"""
