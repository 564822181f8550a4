"""Token routing of an expert-parallel grouped matmul, run inside the per-rank program.

`passes/lower_collectives.py` calls these from the graph it emits: `local_offsets` re-bases a rank's
expert offsets onto the rows it holds, `ep_dispatch` computes the split sizes of the two
all_to_all_single calls from `offs` at run time (the per-rank program runs eagerly).
"""
from __future__ import annotations

import torch

from autopar._torch_compat import FakeTensor


def local_offsets(offs: torch.Tensor, lo, hi, e0: int, e1: int) -> torch.Tensor:
    """Offsets of experts [e0, e1) within the global sorted rows [lo, hi) held locally."""
    return (offs[e0:e1].clamp(lo, hi) - lo).to(offs.dtype)


def ep_dispatch(offs: torch.Tensor, members: list, me: int) -> tuple[list, list, torch.Tensor]:
    """Split sizes of the expert-dispatch all_to_all and the offsets of the rows received.

    members[q] = ((lo, hi) sorted rows held by rank q of the axis, (e0, e1) its experts). Rank q's
    experts own the sorted rows [start_q, end_q); I send it my rows there, and receive from each rank,
    in rank order, its rows among mine: ascending rows, so still grouped by expert."""
    (my_lo, my_hi), (e0, e1) = members[me]
    if isinstance(offs, FakeTensor):  # shape propagation (verify): no data, pretend every row is home
        send = recv = [my_hi - my_lo if q == me else 0 for q in range(len(members))]
        return send, recv, local_offsets(offs, my_lo, my_hi, e0, e1)
    bounds = [0, *offs.tolist()]

    def overlap(a: tuple, b: tuple) -> int:
        return max(0, min(a[1], b[1]) - max(a[0], b[0]))

    expert_rows = [(bounds[q_e0], bounds[q_e1]) for _, (q_e0, q_e1) in members]
    send = [overlap((my_lo, my_hi), rows) for rows in expert_rows]
    recv = [overlap(q_rows, expert_rows[me]) for q_rows, _ in members]
    received = [sum(overlap(q_rows, (bounds[e0], bounds[e + 1])) for q_rows, _ in members) for e in range(e0, e1)]
    return send, recv, torch.tensor(received, dtype=offs.dtype, device=offs.device)
