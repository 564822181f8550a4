"""Sharding: which placements each op and parameter may take on the mesh.

`rules` (per-op, per-axis sharding rules, one module per op family), `strategies` (multi-axis
candidates per node), `params` (how each parameter is stored, gathered and reduced: dp / ZeRO /
shard), `recipes` (the textbook strategies as restrictions of the search space).
"""
