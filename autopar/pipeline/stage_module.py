"""One pipeline stage on one rank: `StageModule`, what torch.distributed.pipelining's PipelineStage runs.

Its forward is an autograd.Function (`_StageFn`) running the stage's forward program on a micro-batch (saving
what the backward program reads); its backward runs the backward program (boundary gradients in,
input-activation and parameter gradients out). A stage with ZeRO-1/2 parameters runs its `gather` program once
per step (`begin_step`), before the schedule: the gathered copies serve every micro-batch's forward and backward
and are freed after the schedule (`end_step`). Each of the three programs is a GraphModule, or its
`autopar.runtime.compile.CompiledProgram` under `compile=True`.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from autopar.passes.split_stages import StageProgram
from autopar.runtime.tensors import distinct, is_unit_seed


class _StageFn(torch.autograd.Function):
    """One stage on one micro-batch: the forward program now, the backward program in backward."""

    @staticmethod
    def forward(fctx, stage, num_params, *args):
        prog = stage.program
        env = stage.state_env(args[:num_params])
        env.update({("input", n): x for n, x in zip(prog.inputs, args[num_params:])})
        with torch.no_grad():
            outs = prog.forward(*[env[k] for k in prog.forward_args])
        stage.runs["forward"] += 1
        n_out = 1 if stage.is_last else len(prog.outputs)
        fctx.stage, fctx.locals, fctx.num_inputs = stage, args[:num_params], len(args) - num_params
        fctx.saved = outs[n_out:]
        results = [o.detach().clone() if any(o is a for a in args) else o for o in outs[:n_out]]
        fctx.like = results
        names = ["<loss>"] if stage.is_last else prog.outputs
        fctx.mark_non_differentiable(*[r for r, n in zip(results, names)
                                       if n != "<loss>" and not prog.differentiable[n]])
        return results[0] if stage.is_last else tuple(results)

    @staticmethod
    def backward(fctx, *grads):
        stage = fctx.stage
        prog = stage.program
        env = stage.state_env(fctx.locals)
        env.update({("saved", i): v for i, v in enumerate(fctx.saved)})
        if not stage.is_last:
            for name, g, like in zip(prog.outputs, grads, fctx.like):
                g = torch.zeros_like(like) if g is None else g
                env[("grad", name)] = stage.relayout(g, prog, name, to_grad=True)
        scale = grads[0] if stage.is_last and not is_unit_seed(grads[0]) else None
        if prog.backward_input is not None:   # zero bubble: B now, W when the schedule runs it (`run_weight`)
            outs = prog.backward_input(*[env[k] for k in prog.backward_input_args])
            stage.runs["backward_input"] += 1
            carried = outs[len(outs) - prog.num_carried:]
            stage.pending.append(([env[k] for k in prog.backward_weight_args] + list(carried), fctx.locals, scale))
            outs = [None] * len(prog.grad_params) + list(outs[:len(outs) - prog.num_carried])
        else:
            outs = prog.backward(*[env[k] for k in prog.backward_args])
            stage.runs["backward"] += 1
        outs = [o if o is None or scale is None else o * scale for o in outs]
        by_param = dict(zip(prog.grad_params, outs))
        by_input = dict(zip(prog.input_grads, outs[len(prog.grad_params):]))
        param_grads = [by_param.get(n) for n in stage.param_names]
        input_grads = [None if by_input.get(n) is None else stage.relayout(by_input[n], prog, n, to_grad=False)
                       for n in prog.inputs]
        fctx.saved = fctx.locals = None
        return (None, None, *distinct(param_grads), *input_grads)


class StageModule(nn.Module):
    """What PipelineStage runs: forward(*boundary inputs) -> boundary outputs (the last stage: the loss)."""

    def __init__(self, program: StageProgram, params: dict, buffers: dict, is_last: bool, mesh):
        super().__init__()
        self.program, self.is_last, self._is_last = program, is_last, is_last
        object.__setattr__(self, "mesh", mesh)
        self.param_names = [n for n in program.params if n in params]
        for i, n in enumerate(self.param_names):
            self.register_parameter(f"p{i}", params[n])
        self._buffers_by_name = buffers
        self._gathered: dict = {}
        self.runs: Counter = Counter()   # programs run in the current (or last) step: gather, forward, backward
        self.pending: list = []   # zero bubble: each B's arguments for its W, oldest first (`weight_runner`)

    def state_env(self, locals_) -> dict:
        env = {("param", n): t for n, t in zip(self.param_names, locals_)}
        env.update({("buffer", n): b.to_local() for n, b in self._buffers_by_name.items()})
        env.update(self._gathered)
        return env

    def begin_step(self) -> None:
        """Make this stage's ZeRO-1/2 gathered copies (`StageProgram.gather`) once for the step's micro-batches,
        from the parameters as the optimizer left them."""
        self.runs.clear()
        prog = self.program
        if prog.gather is None:
            return
        env = self.state_env([getattr(self, f"p{i}").to_local() for i in range(len(self.param_names))])
        with torch.no_grad():
            outs = prog.gather(*[env[k] for k in prog.gather_args])
        self._gathered = {("gathered", n): t for n, t in zip(prog.gathered, outs)}
        self.runs["gather"] += 1

    def end_step(self) -> None:
        """Free the gathered copies (the schedule has run every micro-batch's backward)."""
        self._gathered = {}

    def weight_runner(self):
        """PipelineStage's `dw_builder`: called right after a micro-batch's backward (B), it returns what
        computes that micro-batch's parameter gradients (W) when the schedule runs it. W's gradients reach
        p.grad as B's would have: through autograd, from the local tensors the forward read."""
        args, locals_, scale = self.pending.pop()

        def run_weight() -> None:
            with torch.no_grad():   # as autograd runs B (the schedule calls W in grad mode)
                outs = self.program.backward_weight(*args)
            self.runs["backward_weight"] += 1
            by_param = dict(zip(self.program.grad_params, outs))
            pairs = [(x, by_param[n] if scale is None else by_param[n] * scale)
                     for n, x in zip(self.param_names, locals_) if by_param.get(n) is not None]
            if pairs:
                torch.autograd.backward([x for x, _ in pairs], [g for _, g in pairs])
        return run_weight

    def relayout(self, g: torch.Tensor, prog: StageProgram, name: str, to_grad: bool) -> torch.Tensor:
        """A boundary gradient between the value's layout (what PipelineStage sends and checks) and the
        layout the backward program makes and reads (`StageProgram.grad_specs`), by DTensor redistribute."""
        if name not in prog.grad_specs:
            return g
        shape, _, value_spec = prog.values[name]
        src, dst = (value_spec, prog.grad_specs[name]) if to_grad else (prog.grad_specs[name], value_spec)
        dt = DTensor.from_local(g, self.mesh, list(src), run_check=False, shape=torch.Size(shape),
                                stride=torch.empty(shape, device="meta").stride())
        return dt.redistribute(self.mesh, list(dst)).to_local().contiguous()

    def forward(self, *inputs):
        locals_ = [getattr(self, f"p{i}").to_local() for i in range(len(self.param_names))]
        return _StageFn.apply(self, len(locals_), *locals_, *inputs)
