"""Compiled per-rank programs: `autoparallelize(..., compile=True)` lowers each rank's joint graph (SPMD) and
each pipeline stage's forward and backward programs through Inductor, functional collectives included.

A program is the ATen graph the passes emit, so it needs no Dynamo: `CompiledProgram` hands the GraphModule
itself to Inductor (`_torch_compat.inductor_compile`: aot_autograd's decompositions, then `compile_fx_inner`)
at its first call, for that call's shapes and dtypes, and runs the compiled code from then on. The whole
step is one compiled program (one Inductor graph per program: `CompiledProgram.outputs`), so there is
nothing for a graph break to cut.

Collectives stay asynchronous: Inductor lowers each `_c10d_functional` collective to a call that starts it
and a separate `wait_tensor`. How they are grouped and ordered against compute is an `Overlap` mode
(`OVERLAP`): Inductor's bucketing of every kind and its comm/compute reordering (waits sunk to their first
use), the same with ZeRO-3 gathers kept one per layer and phase as the plan prices them (autopar's functional
`bucket_layer_gathers`), or autopar's emitted order with Inductor's bucketing and reordering off. The default
per device type is the measured faster (`OVERLAP_DEFAULT`; AUTOPAR_COMPILE_OVERLAP overrides it for timing).
autopar's other eager bucketing passes are switched off for a compiled program: they write gradients in place
into flat buffers (`all_reduce_`, `mm(out=...)`), which a functional compiler cannot take.

The default (`compile=None`) is the faster measured choice per device type (`DEFAULT`: eager on CPU, where
compiling gains at most a few percent per step and costs a long first step; eager on CUDA until measured
there); the module's repr says which ran (`describe`). `compile="cudagraphs"` (CUDA only) replays the compiled
code as CUDA graphs (Inductor's cudagraph trees), for static shapes. First-call compile time is kept in
`compile_seconds` and shown in the repr; Inductor's FX graph cache (TORCHINDUCTOR_CACHE_DIR, default
/tmp/torchinductor_$USER) serves a restarted job with the same program.
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.fx as fx

from autopar import _torch_compat as compat
from autopar import config
from autopar.errors import InputError
from autopar.passes.ops import BUCKET_BYTES

# autopar's eager bucketing passes, off under the "inductor" overlap (its own bucketing replaces them); all are
# OPTIONAL. All but bucket_layer_gathers write in place into flat buffers, which Inductor cannot trace: they are
# off in every compiled mode. bucket_layer_gathers is functional ("layers" and "program" keep it).
EAGER_ONLY_PASSES = frozenset({"bucket_collectives", "bucket_layer_gathers", "schedule_overlap",
                               "grads_into_buckets"})


def _bucket_mb(bucket_index: int) -> float:
    """Inductor's bucket size (MB), as autopar's eager buckets (passes/ops.BUCKET_BYTES) and DDP's default: one
    bucket of everything (Inductor's 2,000 MB default) would start only after the last gradient."""
    return BUCKET_BYTES / 2**20


_REORDER = {
    "reorder_for_compute_comm_overlap": True,
    # Inductor's recommended order (its config.py): without a list the reordering pass does nothing
    "reorder_for_compute_comm_overlap_passes": ["reorder_communication_preserving_peak_memory",
                                                "sink_waits_iterative",
                                                "reorder_communication_preserving_peak_memory"],
}
_BUCKET_REDUCTIONS = {
    "bucket_all_reduces_fx": "all",
    "bucket_reduce_scatters_fx": "all",
    "bucket_all_reduces_fx_bucket_size_determinator": _bucket_mb,
    "bucket_reduce_scatters_fx_bucket_size_determinator": _bucket_mb,
}
# Inductor's own bucketing of the collectives and its comm/compute reordering (waits sunk to their first use).
INDUCTOR_PATCHES = {
    **_BUCKET_REDUCTIONS,
    "bucket_all_gathers_fx": "all",
    "bucket_all_gathers_fx_bucket_size_determinator": _bucket_mb,
    **_REORDER,
}


@dataclasses.dataclass(frozen=True)
class Overlap:
    """How a compiled program's collectives are grouped and ordered against its compute."""
    name: str
    disabled: frozenset      # autopar passes switched off before the program goes to Inductor
    patches: dict            # Inductor config for its compile
    about: str


OVERLAP = {o.name: o for o in (
    Overlap("inductor", EAGER_ONLY_PASSES, INDUCTOR_PATCHES,
            "Inductor buckets every collective kind (25 MB) and reorders (waits sunk to first use)"),
    Overlap("layers", EAGER_ONLY_PASSES - {"bucket_layer_gathers"}, {**_BUCKET_REDUCTIONS, **_REORDER},
            "ZeRO-3 gathers one per layer and phase as the plan prices (autopar's bucket_layer_gathers); "
            "Inductor buckets the reductions and reorders"),
    Overlap("program", EAGER_ONLY_PASSES - {"bucket_layer_gathers"}, {},
            "autopar's emitted order and per-layer gathers; Inductor's bucketing and reordering off"),
)}
# The overlap per device type (benchmarks/compile_overlap.py, RESULTS.md). CPU, measured: "inductor" is as fast as
# "layers" (CPU time per step within 3% for dp, zero3, tp) and faster than "program" (its unbucketed reductions
# cost 3-12%), and its ZeRO-3 step peaks lowest (68-81 MB on the benchmark GPT against the plan's 74 MB of
# activations; "layers" 118-196 MB: Inductor schedules gathers that read only parameters early). CUDA: the same
# until benchmarks/gpu_check.py measures it (Inductor's passes are tuned for GPUs; none was lent).
OVERLAP_DEFAULT = {"cpu": "inductor", "cuda": "inductor"}

# compile=None per device type. CPU: eager, measured (benchmarks/step_time.py --compile, two runs, docs/performance.md):
# the compiled step's CPU time is 0.97-1.00x eager autopar's (paired wall medians 0.81-1.05x, within the machine's
# noise), while its first step compiles for 20-130 s (2-28 s from a warm cache). CUDA: eager until
# benchmarks/gpu_check.py has measured the compiled program on a GPU (none was lent while this was built).
DEFAULT = {"cpu": False, "cuda": False}
CUDA_GRAPHS = "cudagraphs"   # compile="cudagraphs": Inductor, then its CUDA graph trees (static shapes, CUDA only)


def resolve(compile: bool | str | None, device_type: str) -> bool | str:
    """`compile` as given, or the measured default for this device type."""
    if compile is None:
        return DEFAULT.get(device_type, False)
    if compile == CUDA_GRAPHS:
        if device_type != "cuda":
            raise InputError(f"compile={CUDA_GRAPHS!r}: CUDA graphs need CUDA devices, and this job runs on "
                             f"{device_type}; pass compile=True (Inductor without CUDA graphs) or run on GPUs")
        return compile
    if not isinstance(compile, bool):
        raise InputError(f"compile={compile!r}: pass True (Inductor), {CUDA_GRAPHS!r} (Inductor and CUDA graphs, "
                         f"CUDA only), False (the eager FX program) or None (the default for the device: {DEFAULT})")
    return compile


def overlap_mode(compile: bool | str, device_type: str) -> Overlap | None:
    """The collective overlap a compiled program uses (AUTOPAR_COMPILE_OVERLAP, else the device's default); None
    for an eager program."""
    if not compile:
        return None
    name = config.compile_overlap() or OVERLAP_DEFAULT.get(device_type, "inductor")
    if name not in OVERLAP:
        raise InputError(f"{config.COMPILE_OVERLAP}={name!r}: one of {sorted(OVERLAP)}")
    return OVERLAP[name]


def disabled_passes(compile: bool | str, device_type: str) -> frozenset:
    """The autopar passes a program compiled in this mode runs without."""
    mode = overlap_mode(compile, device_type)
    return frozenset() if mode is None else mode.disabled


class CompiledProgram:
    """A drop-in for a per-rank GraphModule: `program(*args)` -> the graph's outputs, computed by the code
    Inductor generated for `gm` (compiled at the first call, again only if the arguments' shapes, strides
    or dtypes change). `cuda_graphs`: the code runs as CUDA graphs (Inductor's cudagraph trees), recorded for
    the first call's shapes; other shapes raise InputError, and each call's outputs are copied out of the
    graphs' memory pool (the next replay overwrites it: a gradient kept in p.grad, a pipeline stage's
    activations saved for a later micro-batch's backward)."""

    def __init__(self, gm: fx.GraphModule, name: str = "step", overlap: Overlap | None = None,
                 cuda_graphs: bool = False):
        self.gm, self.name, self.cuda_graphs = gm, name, cuda_graphs
        self.overlap = overlap or OVERLAP["inductor"]
        self.outputs: list = []              # Inductor's OutputCode of each compile that ran Inductor's backend
        self.graphs: list[int] = []          # Inductor graphs each compile made or loaded (one: no split)
        self.compile_seconds: float | None = None   # the first compile's wall time
        self.cache: dict = {}                # the first compile's FX graph cache counters (hit / miss)
        self.runs = 0                        # calls so far
        self._fn, self._key = None, None

    def __call__(self, *args):
        key = tuple((tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
        if key != self._key:
            if self.cuda_graphs:
                self._check_static(key, args)
            self._compile(args)
            self._key = key
        self.runs += 1
        if not self.cuda_graphs:
            return self._fn(*args)
        compat.cudagraph_step_begin()
        return [o.clone() if isinstance(o, torch.Tensor) else o for o in self._fn(*args)]

    def _check_static(self, key, args) -> None:
        if self._key is not None:
            changed = next((i for i, (a, b) in enumerate(zip(key, self._key)) if a != b), 0)
            raise InputError(f"compile={CUDA_GRAPHS!r} records the {self.name} program's CUDA graphs for static "
                             f"shapes; argument {changed} was {self._key[changed][:2]} and is now {key[changed][:2]}. "
                             "Feed every step the same shapes (pad or drop the last batch), or pass compile=True")
        if any(isinstance(a, torch.Tensor) and a.device.type != "cuda" for a in args):
            raise InputError(f"compile={CUDA_GRAPHS!r}: CUDA graphs need CUDA tensors; the {self.name} program got "
                             "CPU ones. Pass compile=True, or run on GPUs")

    def _compile(self, args) -> None:
        before = compat.compile_counters().get("inductor", {})
        start = time.perf_counter()
        patches = {**self.overlap.patches, **(compat.CUDA_GRAPH_PATCHES if self.cuda_graphs else {})}
        self._fn = compat.inductor_compile(self.gm, list(args), patches, self.outputs.append)
        after = compat.compile_counters().get("inductor", {})
        cache = {k.removeprefix("fxgraph_cache_"): after.get(k, 0) - before.get(k, 0)
                 for k in ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")}
        self.graphs.append(sum(cache.values()))   # each graph Inductor compiles or loads passes its FX graph cache
        if self.compile_seconds is None:
            self.compile_seconds, self.cache = time.perf_counter() - start, cache

    @property
    def source(self) -> str:
        """The Python wrapper Inductor generated (the last compile's; '' when aot_autograd's cache served the
        whole program, without calling Inductor's backend)."""
        return compat.output_source(self.outputs[-1]) if self.outputs else ""


def compile_stage(program, compile: bool | str, device_type: str):
    """A pipeline stage's program (`passes/split_stages.StageProgram`) with its forward and backward, and its
    once-per-step ZeRO-1/2 gather program and zero-bubble B and W programs where it has them, compiled (each
    on its first call: a zero-bubble stage never calls its whole backward)."""
    overlap, graphs = overlap_mode(compile, device_type), compile == CUDA_GRAPHS

    def compiled(gm, what):   # a program without ops (the first stage's B: no input gradient) stays as it is
        if gm is None or not runs_ops(gm):
            return gm
        return CompiledProgram(gm, f"stage {program.index} {what}", overlap, graphs)
    return dataclasses.replace(program, forward=compiled(program.forward, "forward"),
                               backward=compiled(program.backward, "backward"), gather=compiled(program.gather, "gather"),
                               backward_input=compiled(program.backward_input, "backward (input gradients)"),
                               backward_weight=compiled(program.backward_weight, "backward (weight gradients)"))


def runs_ops(program) -> bool:
    """Whether a program (a GraphModule, or its CompiledProgram) has any op to run."""
    return any(n.op == "call_function" for n in getattr(program, "gm", program).graph.nodes)


def compile_seconds(programs: list) -> float | None:
    """Total first-call compile time of the compiled ones among `programs` (None before any compiled)."""
    times = [p.compile_seconds for p in programs if isinstance(p, CompiledProgram) and p.compile_seconds is not None]
    return sum(times) if times else None


def describe(programs: list) -> str:
    """One line for a module's repr: which program runs (compiled or eager) and its compile time."""
    compiled = [p for p in programs if isinstance(p, CompiledProgram)]
    if not compiled:
        return "program=eager FX (compile=False)"
    how = "Inductor + CUDA graphs" if compiled[0].cuda_graphs else "Inductor"
    seconds = compile_seconds(compiled)
    when = "not yet compiled (at the first step)" if seconds is None else f"first-step compile {seconds:.1f} s"
    hits = sum(p.cache.get("hit", 0) for p in compiled)
    return (f"program={how} ({len(compiled)} graph(s), overlap {compiled[0].overlap.name}, {when}, "
            f"FX graph cache hits {hits})")
