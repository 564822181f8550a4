"""Capture cache: what a second capture of the same model costs against the first (a real trace).

Run:  python benchmarks/capture_cache.py [family ...]      (default: mistral bart t5 mixtral)
Per zoo family (autopar/_testing/models.py, ZOO_CASES): the first capture (torch.export + joint trace), the second
(a cache hit: the key and a deep copy of the graph), the key alone, and whether the copy's code equals
the first graph's. Prints one table; asserts nothing about time.
"""
from __future__ import annotations

import sys
import time
import warnings

from autopar._testing import models
from autopar.capture import cache as capture_cache
from autopar.capture.trace import capture


def measure(name: str) -> tuple:
    case = models.ZOO_CASES[name]()
    capture_cache.clear_capture_cache()
    times, graphs = [], []
    for _ in range(2):
        start = time.perf_counter()
        graphs.append(capture(case.model, case.args, example_kwargs=case.kwargs, loss_fn=case.loss_fn))
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    capture_cache._model_key(case.model)
    key_s = time.perf_counter() - start
    stats = capture_cache.capture_cache_stats()
    same = graphs[0].gm.code == graphs[1].gm.code
    return name, len(graphs[0].gm.graph.nodes), times[0], times[1], key_s, stats["misses"], same


def main() -> None:
    warnings.filterwarnings("ignore")
    names = sys.argv[1:] or ["mistral", "bart", "t5", "mixtral"]
    print(f"{'family':10} {'nodes':>6} {'first s':>8} {'second s':>9} {'key ms':>7} {'traces':>6} same")
    for row in map(measure, names):
        name, nodes, first, second, key_s, traces, same = row
        print(f"{name:10} {nodes:6d} {first:8.2f} {second:9.3f} {key_s * 1e3:7.1f} {traces:6d} {same}")


if __name__ == "__main__":
    main()
