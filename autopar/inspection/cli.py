"""The `autopar` command: plan a model, show/explain/diff saved plans.

    autopar plan my_model.py:make --mesh 8x8 --hardware h100 --budget 80GB --out plan.json   # make() -> (model, inputs)
    autopar show plan.json
    autopar explain plan.json transformer.h.0.attn.c_attn
    autopar diff a.json b.json
    torchrun --nproc_per_node 8 -m autopar calibrate --mesh 8 --out profile.json
    autopar scaling my_model.py:make --devices 1-64 --hardware h100 --plot scaling.png

A user mistake (bad mesh string, unknown hardware, missing file, bad factory, bad budget) exits with
status 2 and one line `autopar: error: ...` on stderr, never a traceback. Plans are read as JSON
only: a plan file is data and can never run code (no pickle, no eval).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path

from autopar.errors import AutoparError

EXIT_USER_ERROR = 2


class CliError(Exception):
    """A bad command line; printed as one line."""


class _Parser(argparse.ArgumentParser):
    """argparse without its multi-line usage dump on errors: raise, and let main print one line."""

    def error(self, message: str):
        raise CliError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autopar", description="Auto-parallelize PyTorch training: plan, inspect and compare "
                                                 "sharding plans.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    p = sub.add_parser("plan", help="plan a model on a mesh and print the summary",
                       description="Plan the model returned by FACTORY on a device mesh, print the summary and "
                                   "optionally save the plan as JSON.")
    p.add_argument("factory", metavar="MODULE:FACTORY",
                   help="a callable returning (model, example_inputs): 'package.module:make_model' or "
                        "'path/to/file.py:make_model'")
    p.add_argument("--mesh", required=True, help="mesh shape, e.g. 8 or 8x8 or 2x4x8")
    p.add_argument("--hardware", default="cpu", help="preset (cpu, a100, h100, h200) or a JSON profile path")
    p.add_argument("--budget", help="memory budget per device, e.g. 80GB or 80GiB (default: none)")
    p.add_argument("--strategy", default="auto",
                   help="auto | dp | zero1 | zero2 | zero3 | tp, or per axis 'dp=zero1,tp=tp' (default auto)")
    p.add_argument("--axis-names", help="comma-separated mesh axis names, e.g. dp,tp")
    p.add_argument("--devices-per-node", type=int, help="devices per node (default: the hardware's)")
    p.add_argument("--time-limit", type=float, metavar="S", help="solver time limit in seconds")
    p.add_argument("--out", help="save the plan as JSON to this path")
    p.add_argument("--no-rich", action="store_true", help="plain-text summary (no rich tables)")
    p.set_defaults(run=_cmd_plan)
    s = sub.add_parser("show", help="print the summary of a saved plan")
    s.add_argument("plan_file", metavar="PLAN.json")
    s.add_argument("--no-rich", action="store_true", help="plain-text summary")
    s.set_defaults(run=_cmd_show)
    e = sub.add_parser("explain", help="why a parameter, module or node is placed as it is")
    e.add_argument("plan_file", metavar="PLAN.json")
    e.add_argument("name", help="parameter FQN, module path or graph node name")
    e.set_defaults(run=_cmd_explain)
    d = sub.add_parser("diff", help="compare two saved plans")
    d.add_argument("plan_a", metavar="A.json")
    d.add_argument("plan_b", metavar="B.json")
    d.set_defaults(run=_cmd_diff)
    _add_calibrate(sub)
    _add_scaling(sub)
    return parser


def _add_calibrate(sub) -> None:
    c = sub.add_parser("calibrate", help="measure links and compute under torchrun; write a hardware profile",
                       description="Time collectives on every mesh axis and matmul/attention/pointwise ops on "
                                   "this job's devices (run under torchrun; gloo on CPU, NCCL on CUDA), fit "
                                   "alpha-beta per collective and link, and write a JSON profile for "
                                   "Mesh(hardware=PATH) / --hardware PATH.")
    c.add_argument("--out", required=True, help="where to write the profile (JSON)")
    c.add_argument("--mesh", help="mesh shape whose axes to measure, e.g. 2x4 (default: the world, 1-D)")
    c.add_argument("--base", help="preset giving peak FLOP/s and capacity (default: from the device)")
    c.add_argument("--devices-per-node", type=int, help="default: torchrun's LOCAL_WORLD_SIZE")
    c.add_argument("--min-bytes", default="1K", help="smallest message (default 1K)")
    c.add_argument("--max-bytes", default="64M", help="largest message (default 64M; sizes step x4)")
    c.add_argument("--iters", type=int, default=5, help="timed repetitions per size (median)")
    c.add_argument("--quick", action="store_true", help="small compute benchmarks (a smoke test)")
    c.set_defaults(run=_cmd_calibrate)


def _add_scaling(sub) -> None:
    s = sub.add_parser("scaling", help="plan for 1, 2, 4, ... devices and find where scaling stops paying",
                       description="Plan the model returned by FACTORY for each device count (global batch "
                                   "fixed) and print predicted step time, throughput, memory and efficiency, "
                                   "and the stop point with its reason.")
    s.add_argument("factory", metavar="MODULE:FACTORY", help="a callable returning (model, example_inputs)")
    s.add_argument("--devices", default="1-64", help="e.g. 1,2,4,8 or 1-64 (powers of two; default 1-64)")
    s.add_argument("--hardware", default="cpu", help="preset (cpu, a100, h100, h200) or a JSON profile path")
    s.add_argument("--budget", help="memory budget per device, e.g. 80GB")
    s.add_argument("--threshold", type=float, default=0.5, help="efficiency under which to stop (default 0.5)")
    s.add_argument("--devices-per-node", type=int, help="devices per node (default: the hardware's)")
    s.add_argument("--plot", help="save a PNG plot here (needs matplotlib)")
    s.set_defaults(run=_cmd_scaling)


def parse_mesh_shape(text: str) -> tuple[int, ...]:
    """ "8x8" -> (8, 8); "8" -> (8,)."""
    parts = text.lower().replace("×", "x").split("x")
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise CliError(f"bad --mesh {text!r}: use positive sizes joined by 'x', e.g. 8 or 8x8")
    return tuple(int(p) for p in parts)


def parse_strategy(text: str):
    if "=" not in text:
        return text
    out = {}
    for item in text.split(","):
        axis, sep, name = item.partition("=")
        if not sep or not axis.strip() or not name.strip():
            raise CliError(f"bad --strategy {text!r}: use a recipe name or 'axis=recipe,axis=recipe'")
        out[axis.strip()] = name.strip()
    return out


def load_factory(spec: str):
    """The callable named by 'module:attr' or 'path/file.py:attr'."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise CliError(f"bad factory {spec!r}: use 'module:function' or 'path/to/file.py:function'")
    if target.endswith(".py") or os.sep in target or "/" in target:
        path = Path(target)
        if not path.is_file():
            raise CliError(f"factory file {target!r} does not exist")
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(mod_spec)
        sys.path.insert(0, str(path.resolve().parent))   # let the file import its neighbours
        mod_spec.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            raise CliError(f"cannot import module {target!r} ({e})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CliError(f"{target!r} has no callable {attr!r}")
    return factory


def _call_factory(factory, spec: str):
    result = factory()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise CliError(f"factory {spec!r} must return (model, example_inputs), got {type(result).__name__}")
    model, inputs = result
    return model, inputs if isinstance(inputs, tuple) else (inputs,)


def load_plan(path: str):
    """A saved plan, read as JSON text only (never unpickled or evaluated)."""
    from autopar.plan import Plan, PlanFileError

    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise PlanFileError(f"{path} is not a plan file (binary data, not JSON); autopar reads JSON plans only "
                            "and never unpickles") from None
    try:
        return Plan.from_json(text)
    except PlanFileError as e:
        raise PlanFileError(f"{path}: {e}") from None


def _cmd_plan(args) -> int:
    import autopar
    from autopar.costmodel.memory import parse_bytes

    shape = parse_mesh_shape(args.mesh)
    names = tuple(n.strip() for n in args.axis_names.split(",")) if args.axis_names else None
    mesh = autopar.Mesh(shape, axis_names=names, hardware=args.hardware, devices_per_node=args.devices_per_node)
    budget = parse_bytes(args.budget) if args.budget is not None else None
    strategy = parse_strategy(args.strategy)
    model, inputs = _call_factory(load_factory(args.factory), args.factory)
    plan = autopar.plan(model, inputs, mesh=mesh, strategy=strategy, memory_budget=budget,
                        time_limit=args.time_limit)
    print(plan.summary(rich=False if args.no_rich else None))
    if args.out:
        plan.save(args.out)
        print(f"saved {args.out}")
    return 0 if plan.feasible else 1


def _cmd_show(args) -> int:
    print(load_plan(args.plan_file).summary(rich=False if args.no_rich else None))
    return 0


def _cmd_explain(args) -> int:
    print(load_plan(args.plan_file).explain(args.name))
    return 0


def _cmd_diff(args) -> int:
    from autopar.inspection.diff import diff

    print(diff(load_plan(args.plan_a), load_plan(args.plan_b)))
    return 0


def _cmd_calibrate(args) -> int:
    import torch
    import torch.distributed as dist

    from autopar.calibration.measure import calibrate, size_range

    job = False   # this process is a torchrun rank that only runs this command
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ:      # under torchrun
            dist.init_process_group(backend)
            job = True
        else:  # a plain process: a world of one (compute only, no links), with no port and no
            # environment left behind (a later torchrun-less process would read RANK/MASTER_PORT)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        result = calibrate(parse_mesh_shape(args.mesh) if args.mesh else None,
                           sizes=size_range(args.min_bytes, args.max_bytes), iters=args.iters,
                           base=args.base, devices_per_node=args.devices_per_node, quick_compute=args.quick)
        if dist.get_rank() == 0:
            result.spec.save(args.out)
            print(result.summary())
            print(f"saved {args.out}")
    finally:
        dist.destroy_process_group()
    if job:   # no interpreter shutdown while gloo's threads may still release a collective's tensors
        from autopar.runtime.launch import leave_job
        leave_job()
    return 0


def _cmd_scaling(args) -> int:
    from autopar.api import scaling
    from autopar.planning.scaling import parse_devices

    model, inputs = _call_factory(load_factory(args.factory), args.factory)
    report = scaling(model, inputs, devices=parse_devices(args.devices), hardware=args.hardware,
                     memory_budget=args.budget, threshold=args.threshold,
                     devices_per_node=args.devices_per_node)
    print(report)
    if args.plot:
        report.plot(args.plot)
        print(f"saved {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `autopar` console script and `python -m autopar`; returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except SystemExit as e:          # --help, --version: argparse printed and exits 0
        return e.code if isinstance(e.code, int) else 0
    except (CliError, AutoparError, OSError, ValueError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"autopar: error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
