"""Rewrite passes: a Plan applied to the joint graph, ending in one per-rank program.

Each pass is `name_pass(gm, ctx) -> gm` in its own file. `run_passes` applies them in order, times
each, checks the IR invariants after each when `verify=True` (always in tests), writes the graph
before/after each pass to $AUTOPAR_DUMP_DIR when set, and skips passes named in `ctx.disabled`
(internal: some passes are needed for a correct program). A user switches off optimisation passes,
for debugging or an A/B timing, with `AUTOPAR_DISABLE_PASSES=schedule_overlap,bucket_collectives`;
only `OPTIONAL` passes may be named there, since the program is correct without them. The
invariants are in `autopar/ir.py`.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch.fx as fx

from autopar.config import disabled_passes, dump_dir
from autopar.graph import COLLECTIVE, FUSED

from .apply_plan import apply_plan_pass
from .bucket_collectives import bucket_collectives_pass
from .bucket_layer_gathers import bucket_layer_gathers_pass
from .context import PassContext
from .fuse_addmm import fuse_addmm_pass
from .grads_into_buckets import grads_into_buckets_pass
from .insert_redistribute import insert_redistribute_pass
from .localize_shapes import localize_shapes_pass
from .lower_collectives import lower_collectives_pass
from .recompute import recompute_pass
from .schedule_overlap import schedule_overlap_pass
from .tidy import tidy_pass

PIPELINE = (
    ("apply_plan", apply_plan_pass),                    # plan -> node.meta specs
    ("recompute", recompute_pass),                      # recomputed layers' forward ops copied into backward
    ("insert_redistribute", insert_redistribute_pass),  # abstract redistribute at every mismatch
    ("lower_collectives", lower_collectives_pass),      # redistribute -> functional collectives
    ("bucket_collectives", bucket_collectives_pass),    # gradient (and ZeRO-1/2 gather) collectives -> 25 MB buckets
    ("bucket_layer_gathers", bucket_layer_gathers_pass),  # a layer's parameter gathers (ZeRO-3) -> one per phase
    ("schedule_overlap", schedule_overlap_pass),        # gradient buckets start in the backward, waited at the end
    ("localize_shapes", localize_shapes_pass),          # global size arguments -> local
    ("fuse_addmm", fuse_addmm_pass),                    # mm + bias add left together -> addmm (as eager)
    ("grads_into_buckets", grads_into_buckets_pass),    # weight gradients computed into their bucket's buffer
    ("tidy", tidy_pass),                                # permute pairs cancelled, view chains and duplicates merged
)


# Passes the program is correct without (they change memory or speed, not numbers); the only ones
# AUTOPAR_DISABLE_PASSES may name.
OPTIONAL = frozenset({"recompute", "bucket_collectives", "bucket_layer_gathers", "schedule_overlap", "fuse_addmm",
                      "grads_into_buckets", "tidy"})


def env_disabled() -> frozenset:
    """Pass names in $AUTOPAR_DISABLE_PASSES (comma-separated), checked against `OPTIONAL`."""
    from autopar.errors import InputError
    names = disabled_passes()
    known = {name for name, _ in PIPELINE}
    unknown = sorted(names - known)
    if unknown:
        raise InputError(f"AUTOPAR_DISABLE_PASSES names unknown passes {unknown}; the passes are "
                         f"{', '.join(n for n, _ in PIPELINE)}")
    required = sorted(names - OPTIONAL)
    if required:
        raise InputError(f"AUTOPAR_DISABLE_PASSES names {required}, without which the program is wrong; "
                         f"only these may be switched off: {', '.join(sorted(OPTIONAL))}")
    return names


def describe() -> str:
    return "\n".join(f"{i}. {name}" for i, (name, _) in enumerate(PIPELINE, start=1))


def run_passes(gm: fx.GraphModule, ctx: PassContext, *, verify: bool = False) -> fx.GraphModule:
    from autopar.debug import log
    from autopar.ir import verify as verify_ir
    dump = dump_dir()
    log(2, "passes:\n" + describe())
    disabled = ctx.disabled | env_disabled()
    for i, (name, fn) in enumerate(PIPELINE, start=1):
        if name in disabled:
            log(1, f"pass {name}: switched off")
            continue
        if dump:
            _dump(dump, f"{i:02d}_{name}_before.py", gm)
        start = time.perf_counter()
        gm = fn(gm, ctx)
        ctx.timings[name] = time.perf_counter() - start
        log(1, f"pass {name}: {ctx.timings[name] * 1e3:.1f} ms, {len(gm.graph.nodes)} nodes")
        log(4, f"graph after {name}:\n{gm.code}")
        if dump:
            _dump(dump, f"{i:02d}_{name}_after.py", gm)
        if verify:
            verify_ir(gm, name, ctx)
    return gm


def emitted_collectives(gm: fx.GraphModule) -> list[dict]:
    """The logical collectives a lowered program runs (fused buckets expanded), in graph order."""
    out = []
    for node in gm.graph.nodes:
        if COLLECTIVE in node.meta:
            out.append(node.meta[COLLECTIVE])
        out.extend(node.meta.get(FUSED, ()))  # fused nodes and overlap-scheduled starts
    return out


def _dump(folder: str, fname: str, gm: fx.GraphModule) -> None:
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / fname).write_text(gm.code)


__all__ = ["PIPELINE", "OPTIONAL", "PassContext", "run_passes", "env_disabled", "describe", "emitted_collectives", "apply_plan_pass", "insert_redistribute_pass",
           "lower_collectives_pass", "bucket_collectives_pass", "bucket_layer_gathers_pass",
           "localize_shapes_pass", "recompute_pass", "schedule_overlap_pass", "fuse_addmm_pass",
           "grads_into_buckets_pass", "tidy_pass"]
