"""The default layout search (`autopar.plan` without `num_stages`): SPMD plans and every pipeline that could beat them.

One capture of the whole batch (under the mixed-precision policy, with `example_kwargs`), then:
  1. pp = 1: the SPMD plan on the caller's mesh, exactly `autopar.planning.spmd.plan_captured`
     (recompute decided by the solver, the textbook recipes as its baselines); then the SPMD plans on
     the other shapes of the same devices (hardware and devices per node): the 1-D flattening and the
     grids (N / t) x t with t > 1 dividing a node (data x tensor parallel, tp inside a node: the
     pipeline search's pp = 1 sub-meshes). Every shape of N devices prices the same set, so
     `Mesh((N,))` and `Mesh((N // k, k))` plan the same layouts (the caller's shape wins ties): a
     one-node `Mesh((8,))` plans dp 4 x tp 2 too, which one axis cannot express (GPT-2 1.5B on 8 H100s
     in bf16 under 20 GB: 74.8 ms on 4 x 2 against 82.3 ms on 8). `num_stages=None` plans on the
     caller's mesh as given. A mesh of several axes is solved under its memory row (with recompute:
     its costly MIPs; Llama-3-70B on 8 x 8 H100s, 60-100 s) only after the pipeline search, and only
     if its fastest plan without the row, which needs more than the budget, is faster than the best
     plan found (`spmd.PlanCutoff`); else the plan's table says so, with that bound. Where that plan
     fits, nothing waits.
  2. pp >= 2: the pipeline candidates of `autopar.pipeline.search` (pp x dp x tp with tp inside a
     node, micro-batch counts, the runtime's schedules, zero bubble in a loop and in a V included; GPipe only where 1F1B of the same candidate is
     not searched, which no GPipe plan beats: `search.dominated_by_1f1b`), and gradient accumulation
     (pp = 1 with m = 2 or 4 micro-batches on each dp x tp sub-mesh: one stage, the micro-batches one
     after another, their gradients reduced once per step; activations of one micro-batch held, no
     bubble; the pipelined runtime runs it on a mesh whose "pp" axis has one device), by branch and
     bound with the fastest SPMD plan's step as the incumbent: a candidate is priced (its micro-batch graph captured, its stage
     SPMD problem solved) only if a lower bound of its step is below the best found so far. The bound
     needs no further capture (`Profiler.one_device_seconds`: the whole batch's one-device seconds
     over m), so a model that SPMD already serves at near-linear scaling costs nothing more. Where the
     1-D SPMD plan says the fast search runs (below), a worker process is forked right then to work out the
     search's LP bounds on the second CPU while the other shapes are solved (`autopar.pipeline.bound_worker`:
     the same plan, sooner).
     With search="fast" (the default) pipelines are searched only when the SPMD plan of the
     devices as one axis does not fit, or fits only with activation recompute (a stage holds 1 / pp of
     the layers and their activations: Llama-13B on 16 H100s in bf16 under 40 GB planned 3,386 ms on
     one axis with 39 of 40 layers recomputed, torchtitan's pp4 x tp4 1,335 ms), or its step exceeds
     FAST_RATIO times the least lower bound of a pipeline's step (SPMD is far from the work's own
     time: a pipeline may win by a wide margin). The rule reads the 1-D plan and the device count
     only, so Mesh((N,)) and Mesh((N // k, k)) search the same pipelines; search="exact" always
     searches them. Where the rule searches none, fast still prices pipelines for a model that fills
     devices (an SPMD plan holds PROBE_MEMORY_SHARE of the budget or more): all of them where there are
     at most SMALL_SEARCH candidates (up to 16 devices: a few seconds more; GPT-2 350M on 2 x 8 H100s,
     103.4 -> 92.5 ms), else a probe (`probe_jobs`): the pipelines of one micro-batch count on 1-D
     sub-meshes, one capture and a few DP solves, under the same incumbent (Llama-3-8B on 8 x 8, 953 ->
     890 ms, 8 -> 11 CPU s).
     The fast search also solves no memory rows for a candidate whose budget-free plan, split without a
     budget, is 1.05x the best step found or slower (`candidates.price`'s cutoff: a heuristic; those
     MIPs were nearly all of a large model's search time). `plan.solver["search"]` says which ran,
     and how many rows it skipped. A candidate whose rows' plans split within the budget only with
     recompute is priced with every layer but a stack's last recomputed, then with only as many as its
     split's devices need (`candidates._recomputed`, `candidates.fewest_recomputed`), except with
     recompute="none".
  3. Only when nothing above fits: SPMD on every other 2-D grid (N / k) x k of the same devices
     (`autopar.pipeline.regrid`: k beyond a node too), so that feasibility never falls as devices are
     added (a batch of 64 that 64 devices run as a pipeline runs on 1,024 as 64 x 16).
  4. The fastest feasible candidate is the plan. A pipelined one is built from the very solution the
     search priced (`Profiler.solution`, with its recomputed layers: `Profiler.recomputed`;
     `stages.partition`'s split), mapped from the three-layer graph the search priced onto the full one
     (`Profiler.full_solution`): its predicted step and memory are the search's.
When nothing fits, InfeasiblePlanError.min_memory_per_device is a lower bound over the whole space:
the least of the SPMD solver's bound (with recompute) and, for pipelines, the model's state sharded
over every device (no split of any stage count holds less). The message also names the least
memory a candidate needed.
"""
from __future__ import annotations

import dataclasses

from autopar import _torch_compat as compat
from autopar.capture import precision
from autopar.capture.canonicalize import canonicalize
from autopar.capture.trace import capture
from autopar.costmodel.memory import format_bytes, format_seconds, parse_bytes
from autopar.debug import PhaseTimer, log
from autopar.errors import InfeasiblePlanError, InputError
from autopar.mesh import Mesh
from autopar.pipeline import planning as pipelined
from autopar.pipeline import regrid
from autopar.pipeline.bound_worker import BoundWorker
from autopar.pipeline.candidates import Candidate, branch_and_bound, lp_requests
from autopar.pipeline.search import DEFAULT_SCHEDULES, Profiler, batch_size, candidate_jobs, state_floor
from autopar.pipeline.stages import INTERLEAVE, V_SHAPED, chunks_per_device, step_lower_bound
from autopar.plan import Plan
from autopar.planning import assemble, collector, spmd
from autopar.sharding import recipes

SEARCHES = ("fast", "exact")
DEFER = 0.0   # `spmd.plan_captured`'s cutoff for a first pass that stops wherever the memory row bites
FAST_RATIO = 4.0   # search="fast" searches pipelines when the 1-D SPMD step exceeds this times their least bound
PROBE_MICROBATCHES = 8   # ... else it prices pipelines of this many micro-batches (or fewer) on 1-D sub-meshes
PROBE_MEMORY_SHARE = 0.05   # ... where an SPMD plan holds this share of the budget (the device's memory) or more
SMALL_SEARCH = 80   # ... and searches them all there when there are this few pipeline candidates, zero bubble V's
                    # aside (<= 16 devices)
GAP_NOTE = 0.01    # an SPMD row of the summary whose solver stopped further than this from its bound says so


@collector.paused()   # planning frees by reference counting; captures run with the collector (below)
def plan_auto(model, example_inputs, *, mesh: Mesh, memory_budget=None, optimizer: str = "adamw", loss_fn=None,
              time_limit=None, example_kwargs=None, baselines: bool = True, mixed_precision=None, recompute=None,
              num_microbatches=None, schedule=None, pipelines: bool = True, search: str = "fast", captured=None) -> Plan:
    """`autopar.plan`'s default: the fastest of the SPMD plans and the pipelined layouts (module docstring).
    `captured`: the whole batch's graph, already captured and canonicalized (autopar.scaling plans one
    capture on many meshes). `pipelines=False` prices the SPMD candidates only. `search`: "fast" (pipelines are searched when
    the SPMD plan of the devices as one axis does not fit) or "exact" (always)."""
    budget = parse_bytes(memory_budget) if memory_budget is not None else None
    if search not in SEARCHES:
        raise InputError(f"search={search!r}: pass one of {SEARCHES}")
    if schedule is not None and schedule not in pipelined.SCHEDULES:
        raise InputError(f"unknown pipeline schedule {schedule!r}; valid: {pipelined.SCHEDULES}")
    floor = state_floor(model, mesh.size, optimizer)
    if budget is not None and floor > budget:   # before any capture: no layout of mesh.size devices holds less
        raise InfeasiblePlanError(
            f"no plan fits the memory budget ({format_bytes(budget)} per device) on {mesh.size} devices: the model's "
            f"parameters, gradients and {optimizer} state need {format_bytes(floor)} per device even sharded over "
            f"all of them, so the smallest plan needs {format_bytes(floor)} or more: raise memory_budget or use "
            f"more devices", min_memory_per_device=floor, budget=budget)
    policy = precision.as_policy(mixed_precision)
    timer = PhaseTimer()
    if captured is None:   # only costed here, never run: no code generated per rewrite (as Profiler.captured)
        with compat.lazy_recompile(), collector.running(), timer("capture"):
            captured = capture(model, example_inputs, example_kwargs=example_kwargs, loss_fn=loss_fn,
                               mixed_precision=policy)
        with compat.lazy_recompile(), collector.running(), timer("canonicalize"):
            canonicalize(captured.gm)
    prof = Profiler(model, example_inputs, mesh.hardware, mesh.devices_per_node, optimizer, loss_fn, time_limit,
                    policy, example_kwargs)
    prof.captures[1] = (captured, tuple(example_inputs))   # the whole batch: the bounds' graph
    facts = prof.graph_facts.setdefault(id(captured), {})   # its stamped templates etc., once for every shape
    pipelines = pipelines and mesh.size > 1 and recompute in (None, "auto", "none") and _splits_batch(example_inputs)
    jobs: list[tuple] = []
    least = float("inf")   # the least lower bound of a pipeline's step
    if pipelines:
        schedules = (schedule,) if schedule else DEFAULT_SCHEDULES   # every runtime schedule, zero bubble included
        with timer("search"):   # the bounds' one-device problem of the whole batch (unit count included)
            # pp = 1 with m > 1 is gradient accumulation (one stage, the micro-batches one after another:
            # activations of one micro-batch held); pp = 1, m = 1 is the SPMD plan planned below
            # GPipe only where 1F1B of the same candidate is not searched (`search.dominated_by_1f1b`)
            jobs = [job for job in candidate_jobs(prof, mesh, batch_size(example_inputs), schedules, num_microbatches,
                                                  list(range(1, mesh.size + 1)), keep_dominated=False)
                    if job[0] > 1 or job[3] > 1]
            least = min((step_lower_bound(*prof.seconds_bound(m, dp * tp), pp, m, s, INTERLEAVE)
                         for pp, dp, tp, m, names in jobs if pp > 1 for s in names), default=float("inf"))
    worker = None   # works out the layout search's LP bounds while the other SPMD shapes are solved (`bound_worker`)
    plans, floors, deferred = [], [], []
    refused: dict = {}   # the recipes priced on the caller's mesh where its SPMD plan does not fit

    def plan_spmd(k: int, spmd_mesh: Mesh, cutoff: float | None, resume: spmd.PlanCutoff | None = None,
                  rc=recompute, ceiling: float | None = None) -> float:
        """Plans `spmd_mesh` into plans (`spmd.Solved`), floors or deferred; its step time, inf when it has no
        plan (yet)."""
        phases, step = PhaseTimer(), float("inf")
        try:
            plans.append(spmd.solve_captured(captured, model, example_inputs, mesh=spmd_mesh,
                                             memory_budget=memory_budget, optimizer=optimizer, time_limit=time_limit,
                                             baselines=baselines and k == 0, timer=phases, recompute=rc,
                                             cutoff=cutoff, resume=resume, ceiling=ceiling, graph_facts=facts))
            step = plans[-1].predicted_step_time if plans[-1].feasible else step
        except InfeasiblePlanError as e:
            floors.append(e)
            if k == 0:   # the caller's mesh: its recipes' table still goes in the summary
                refused.update(e.baselines)
        except spmd.PlanCutoff as e:
            deferred.append((k, spmd_mesh, e))
        for name, seconds in phases.items():
            if name != "total":
                timer[name] = timer.get(name, 0.0) + seconds
        return step

    def plan_flat(k: int, flat: Mesh) -> bool:
        """A 1-D mesh when pipelines are searched and the solver decides recompute: its fastest plan;
        where that exceeds the budget, the memory row without recompute (the solver's first try, cheap on
        one axis: with recompute "auto" the plan it would return). Where no plan fits without recompute,
        the recompute MIPs (CP-SAT: 19 CPU s on Llama-3-70B x 64 H100s, for a plan 7x slower than the
        pipeline found) wait in `deferred` like a 2-D mesh's row, solved only if its budget-free bound
        is below the best plan found; True then (the fast rule searches pipelines, as for a plan with
        recompute)."""
        before = len(deferred)
        plan_spmd(k, flat, DEFER)
        if len(deferred) == before:   # planned (its fastest plan fits) or infeasible outright
            return False
        cut = deferred.pop()[2]
        n_plans, n_floors = len(plans), len(floors)
        plan_spmd(k, flat, None, cut, rc="none")
        if len(plans) > n_plans and plans[-1].feasible:
            return False
        del plans[n_plans:], floors[n_floors:]   # no floor: recompute may still fit
        deferred.append((k, flat, cut))
        return True

    shapes = _spmd_meshes(mesh)
    recomputing = False   # a 1-D mesh's recompute solves wait for the pipeline search (plan_flat)
    for k, spmd_mesh in enumerate(shapes):   # a 2-D mesh's memory-row solves wait (DEFER)
        before = len(plans)
        if spmd_mesh.ndim == 1 and pipelines and recompute in (None, "auto"):
            recomputing |= plan_flat(k, spmd_mesh)
        else:
            plan_spmd(k, spmd_mesh, DEFER if spmd_mesh.ndim > 1 else None)
        flat = next((p for p in plans[before:] if p.feasible), None)
        if spmd_mesh.ndim == 1 and pipelines and search == "fast" and _searches_pipelines(search, flat, least):
            # the 1-D plan says the search runs (the fast rule): its LP bounds are worked out from now on
            worker = BoundWorker(prof, lp_requests(prof, jobs, budget, recompute=recompute != "none"))
    if pipelines and deferred and not recomputing and not any(p.feasible for p in plans):
        # without an incumbent the pipeline search prices every candidate until one fits (Llama-3.1-405B,
        # 2,048 x 8,192 tokens, on 256 x 8 H100s: 63 groups of 30-70 CPU s): the most promising mesh first.
        # Not where a 1-D mesh waits for recompute: that costly solve is what the waiting saves, and a
        # 2-D mesh's row costs more (Llama-3-70B on 8 x 8: 60-100 s); the search's first group sets a cutoff
        first = min(deferred, key=lambda d: d[2].bound)
        deferred.remove(first)
        plan_spmd(first[0], first[1], None, first[2])
    flat = next((p for p in plans if p.feasible and p.mesh.ndim == 1), None)
    incumbent = min((p.predicted_step_time for p in plans if p.feasible), default=float("inf"))
    found: list[Candidate] = []
    searched: list[tuple] = []   # the jobs branch and bound prices: all of them, or the fast search's probe
    explored, walk = False, {}
    if pipelines:
        if flat is not None:
            log(1, f"fast rule: the 1-D SPMD plan {flat.predicted_step_time:.4g} s = "
                   f"{flat.predicted_step_time / least:.3g} x the least pipeline bound {least:.4g} s "
                   f"(FAST_RATIO {FAST_RATIO}; the best SPMD plan {incumbent / least:.3g} x)")
        explored = _searches_pipelines(search, flat, least)
        room = budget if budget is not None else mesh.hardware.mem_capacity
        probing = any(p.feasible and p.memory_per_device >= PROBE_MEMORY_SHARE * room for p in plans)
        # a model that fills devices: every pipeline where they are few (seconds), else the probe
        explored = explored or (probing and _candidates(jobs, v_shaped=False) <= SMALL_SEARCH)
        searched = jobs if explored else probe_jobs(jobs) if probing else []
        if searched:
            with timer("search"):
                found = branch_and_bound(prof, searched, budget, None, keep=1, incumbent=incumbent,
                                         fast=search == "fast", stats=walk, recompute=recompute != "none",
                                         worker=worker)
            log(1, f"layout search{'' if explored else ' (probe)'}: {_candidates(searched)} pipeline "
                   f"candidates, {len(found)} priced (incumbent {incumbent:.4g} s)")
    if worker is not None:
        worker.close()
    piped = min((c for c in found if c.feasible), key=lambda c: c.step_time, default=None)
    fastest = min(incumbent, piped.step_time if piped is not None else float("inf"))
    pruned, more = {}, []
    spmd_best = fastest   # the caller's mesh wins ties with the other shapes (not with a pipeline: fastest)
    for k, spmd_mesh, cut in sorted(deferred, key=lambda d: d[2].bound):   # the most promising first
        if cut.bound < fastest and (cut.bound < spmd_best or k == 0):
            # on from where it stopped: its CostProblem, recipes and budget-free optimum
            # no plan slower than the best found is kept: no recipe slower than it warm-starts the solve
            spmd_best = min(spmd_best, plan_spmd(k, spmd_mesh, None, cut, ceiling=fastest))
        else:
            pruned[f"spmd {spmd_mesh.shape}"] = {
                "feasible": False, "time": None, "memory": None, "bound": cut.bound,
                "reason": f"not solved under the memory row: its fastest plan without the row ({cut.bound:.4g} s) "
                          f"needs more memory and is no faster than the best found ({spmd_best:.4g} s)"}
    plans.sort(key=lambda p: p.mesh != mesh)   # the caller's mesh first: it wins ties, solved late or not
    best = min((p for p in plans if p.feasible), key=lambda p: p.predicted_step_time, default=None)
    if piped is not None and piped.step_time < (best.predicted_step_time if best is not None else float("inf")):
        with timer("stages"):
            best = pipelined_plan(prof, piped, model, budget, timer)
    if best is None:   # last resort: SPMD on the other (N / k) x k grids of the same devices (`regrid`)
        with timer("regrid"):
            more, failed = regrid.plan_regridded(captured, model, example_inputs, mesh, _batch(example_inputs),
                                                 skip=[tuple(m.shape) for m in shapes],
                                                 memory_budget=memory_budget,
                                                 optimizer=optimizer, time_limit=time_limit, baselines=False,
                                                 recompute=recompute)
        plans, floors = plans + more, floors + failed
        best = min((p for p in more if p.feasible), key=lambda p: p.predicted_step_time, default=None)
    if best is None:
        raise _infeasible(model, mesh, budget, optimizer, plans, floors, found, pipelines, policy)
    chosen = best   # the one SPMD plan kept is assembled (the other shapes stay rows of the table)
    best = best.plan() if isinstance(best, spmd.Solved) else best
    timer["total"] = sum(v for k, v in timer.items() if k != "total")
    # the recipes priced on the caller's mesh (k = 0), whichever shape won, solved or cut
    caller_recipes = [p.baselines for p in plans if p.mesh == mesh] + [c.state[1] for k, _, c in deferred if k == 0] \
        + ([refused] if refused else [])
    table = {**(caller_recipes[0] if caller_recipes else best.baselines), **pruned}
    for p in plans:   # the other shapes of the devices (regrid's last-resort grids stay out of the summary)
        if p is not chosen and p.feasible and all(p is not q for q in more):
            table[f"spmd {p.mesh.shape}"] = {"feasible": True, "time": p.predicted_step_time,
                                              "memory": p.memory_per_device, "reason": _stopped(p)}
    runner_up = piped if best.stages == () else min(
        (c for c in found if c.feasible and c is not piped), key=lambda c: c.step_time, default=None)
    if runner_up is not None:   # the best pipeline that lost (or the runner-up of the one that won)
        table[_label(runner_up)] = {"feasible": True, "time": runner_up.step_time,
                                    "memory": runner_up.memory_per_device, "reason": ""}
    stats = {"pipeline_candidates": _candidates(jobs), "priced": len(found),
             "pipelines_searched": bool(jobs) and explored, "probed": 0 if explored else _candidates(searched), **walk}
    return dataclasses.replace(best, baselines=table if baselines else best.baselines, timings=dict(timer),
                               solver={**best.solver, "search": stats})


def pipelined_plan(prof: Profiler, best: Candidate, model, budget, timer) -> Plan:
    """The pipelined Plan of a priced candidate, from the solution and split the search priced."""
    m, sub = best.num_microbatches, prof.sub_mesh(best.dp, best.tp)
    cap, inputs = prof.captured(m)
    # the profile and solution the search priced (with its layers recomputed if it priced so), on the full graph
    prob, layers, sol, rc = prof.full_solution(m, best.dp, best.tp, best.inner_budget, None, best.inner_weight,
                                               best.inner_step_weight, recompute=best.recompute)
    wanted = recipes.normalize("auto", sub)
    one_stage = spmd.assemble_plan(prob, cap, sub, "auto", wanted, None, sol, "", {}, timer, model, inputs)
    one_stage = assemble.with_recompute(one_stage, prob, sol.choice, rc)
    full = Mesh((best.pp, *sub.shape), ("pp", *sub.axis_names), prof.hardware, prof.dpn)
    v = chunks_per_device(best.schedule)
    return pipelined.widen(one_stage, full, layers, best.split, m, best.schedule, budget, cap, v)


def _searches_pipelines(search: str, flat, least: float) -> bool:
    """The fast rule (module docstring): every pipeline is searched where search="exact", where the SPMD plan of the
    devices as one axis (`flat`) does not fit (None) or fits only with recompute, or where its step exceeds
    FAST_RATIO times `least`, the least lower bound of a pipeline's step."""
    return search == "exact" or flat is None or bool(flat.recompute) or flat.predicted_step_time > FAST_RATIO * least


def _spmd_meshes(mesh: Mesh) -> list[Mesh]:
    """The caller's mesh, then its 1-D flattening and the grids (N / t) x t, t > 1 dividing a node (data x
    tensor parallel with tp inside a node: the pipeline search's pp = 1 sub-meshes), each once: the same
    devices and links, and the same set whatever the caller's shape of them."""
    n, dpn = mesh.size, mesh.devices_per_node
    out = [mesh]
    for shape in [(n,)] + [(n // t, t) for t in range(2, dpn + 1) if dpn % t == 0 and n % t == 0 and n // t > 1]:
        if all(tuple(m.shape) != shape for m in out):
            out.append(Mesh(shape, ("dp", "tp") if len(shape) == 2 else None, mesh.hardware, dpn))
    return out


def _batch(example_inputs) -> int | None:
    try:
        return batch_size(example_inputs)
    except InputError:
        return None


def _candidates(jobs: list[tuple], v_shaped: bool = True) -> int:
    """How many candidates `jobs` hold: one per (pp, dp, tp, m) and schedule; `v_shaped=False` leaves out zero
    bubble V's (SMALL_SEARCH's count: each adds splits of a group that interleaved zero bubble prices too)."""
    return sum(sum(v_shaped or s not in V_SHAPED for s in job[4]) for job in jobs)


def probe_jobs(jobs: list[tuple]) -> list[tuple]:
    """The pipelines search="fast" prices where its rule searches none (the SPMD plan is within FAST_RATIO
    of the least pipeline bound, so any pipeline win is narrow): those of one micro-batch count, the most
    up to PROBE_MICROBATCHES (one capture), on 1-D sub-meshes (each stage tensor or data parallel over one
    axis: its SPMD problem solved by the DP, no MIP), by the same branch and bound under the SPMD
    incumbent. A few seconds where the full search takes minutes: GPT-2 1.5B on 8 H100s in bf16 under
    20 GB plans pp8, m8, interleaved zero bubble at 65.2 ms where SPMD 4 x 2 took 74.8 (search="exact":
    63.0 ms, pp4 x tp2, m4, in 9.5 CPU s against 5.7); Llama-3-8B on 8 x 8 H100s (batch 64 x 4,096) pp8 x tp8, m8, interleaved zero bubble at 890 ms
    against SPMD's 953 (what search="exact" finds, in 53 CPU s). Only where an SPMD plan holds
    PROBE_MEMORY_SHARE of the budget (of the device's memory without one) or more: pipelines are how
    models that fill devices train; a toy model's default stays the SPMD plan the ratio rule picks (a
    2-layer GPT on 2 CPU processes would otherwise plan as a 2-stage zero-bubble pipeline, its price on
    such steps unmeasured: `benchmarks/RESULTS.md#costmodel_fidelity` measured 2-stage 1F1B on CPU only)."""
    counts = [m for pp, _, _, m, _ in jobs if pp > 1 and m <= PROBE_MICROBATCHES]
    if not counts:
        return []
    m = max(counts)
    return [job for job in jobs if job[0] > 1 and job[3] == m and min(job[1], job[2]) == 1]


def _splits_batch(example_inputs) -> bool:
    batch = _batch(example_inputs)
    return batch is not None and batch > 1


def _stopped(p: Plan) -> str:
    """A row's note when its solver stopped at the time limit: its time is that plan's, not the mesh's best."""
    if p.gap <= GAP_NOTE:
        return ""
    return (f"the solver stopped at its time limit: no plan of this mesh is faster than "
            f"{format_seconds(p.predicted_step_time * (1 - p.gap))}")


def _label(c: Candidate) -> str:
    if c.pp == 1:   # one stage: gradient accumulation
        return f"accumulate dp{c.dp} tp{c.tp} m{c.num_microbatches}"
    return f"pp{c.pp} dp{c.dp} tp{c.tp} m{c.num_microbatches} {c.schedule}" + (" recompute" if c.recompute else "")


def _infeasible(model, mesh, budget, optimizer, plans, floors, found, pipelines, policy=None) -> InfeasiblePlanError:
    """No candidate fits: a lower bound over the whole space, and the least memory a candidate needed."""
    spmd_floor = min([e.min_memory_per_device for e in floors if e.min_memory_per_device is not None]
                     + [p.memory_per_device for p in plans], default=0.0)
    bound = min(spmd_floor, state_floor(model, mesh.size, optimizer)) if pipelines else spmd_floor
    least = min([spmd_floor] + [c.memory_per_device for c in found if not c.feasible])
    where = "SPMD and pipelined " if pipelines else "SPMD "
    return InfeasiblePlanError(
        f"no plan fits the memory budget ({format_bytes(budget)} per device) on {mesh.size} devices ({where}"
        f"layouts): the smallest plan needs "
        f"{format_bytes(bound)} or more (a lower bound over every recipe, recompute setting and stage count; "
        f"the least a priced candidate needed is {format_bytes(least)}); raise memory_budget or use more "
        f"devices" + ("" if policy else ", or pass mixed_precision='bf16'"),
        min_memory_per_device=bound, budget=budget)
