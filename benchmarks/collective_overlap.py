"""Do functional collectives run asynchronously under this backend? Prints figures, asserts nothing.

    torchrun --nproc_per_node 2 benchmarks/collective_overlap.py [--mb 25] [--matmuls 40]

Per rank: the start of an all-reduce of one flat bucket (`_c10d_functional.all_reduce_`, what
`passes/ops.start_all_reduce` issues) alone, its wait, a block of matmuls alone, and start -> matmuls
-> wait; medians of 5. Asynchronous: the start returns in well under a millisecond and the overlapped
row is below comm + compute (on an oversubscribed machine the process group's thread competes with
the matmuls for the same cores, so it may not be much below). tests/test_schedule_overlap.py checks
the asynchrony itself without timing (a rank joins only after its peer's start has returned).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def _median_ms(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=25.0, help="bucket size in MB")
    p.add_argument("--matmuls", type=int, default=40, help="512x512 matmuls of compute to overlap")
    args = p.parse_args()
    dist.init_process_group("gloo")
    c10d, group = torch.ops._c10d_functional, dist.group.WORLD.group_name
    flat = torch.randn(int(args.mb * 2**20) // 4)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    starts: list[float] = []

    def comm():
        t0 = time.perf_counter()
        pending = c10d.all_reduce_(flat, "sum", group)
        starts.append(time.perf_counter() - t0)
        c10d.wait_tensor(pending)

    def compute():
        for _ in range(args.matmuls):
            a @ b

    def both():
        pending = c10d.all_reduce_(flat, "sum", group)
        compute()
        c10d.wait_tensor(pending)

    rows = {name: _median_ms(fn) for name, fn in (("comm (start + wait)", comm), ("compute", compute),
                                                   ("start, compute, wait", both))}
    rows["start alone"] = 1e3 * statistics.median(starts)
    for rank in range(dist.get_world_size()):
        if rank == dist.get_rank():
            print(f"rank {rank}, {args.mb:g} MB bucket, threads {torch.get_num_threads()}: "
                  + ", ".join(f"{k} {v:.2f} ms" for k, v in rows.items()), flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
