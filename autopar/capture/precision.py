"""Mixed precision: the policy `plan(..., mixed_precision=...)` and `autoparallelize` accept.

Semantics are those of `torch.autocast(device_type, dtype=param_dtype)` around the unmodified
model's forward: parameters stay fp32 master weights (sharded as planned, stepped by the optimizer in
fp32), each op computes in the dtype autocast gives it, and parameter gradients arrive in fp32.
The casts are not inserted by a pass: capture traces the forward under autocast
(`autocast_forward`), so the joint graph holds autocast's own `_to_copy` nodes and backward
differentiates them (a bf16 weight-gradient is cast back to fp32 by the cast's backward).

`reduce_dtype` is the dtype gradient reductions (all-reduce / reduce-scatter of parameter gradients)
move: fp32 (default, as DDP/FSDP with fp32 gradients) or bf16 (half the bytes; the gradient is cast
down before the collective and back to fp32 after it).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.errors import InputError
from autopar.graph import PHASE

# fp16 is left out on purpose: without a gradient scaler its gradients underflow (autocast fp16 needs
# torch.amp.GradScaler, which this runtime does not drive).
ACCEPTED = ('"bf16"', "torch.bfloat16",
            "MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32 or torch.bfloat16)", "None")
_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
_COMPUTE = (torch.bfloat16,)
_REDUCE = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class MixedPrecision:
    """Compute in `param_dtype` where autocast would; reduce gradients in `reduce_dtype`."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.param_dtype not in _COMPUTE:
            raise InputError(f"MixedPrecision.param_dtype={self.param_dtype!r} is not supported; "
                             "accepted: torch.bfloat16")
        if self.reduce_dtype not in _REDUCE:
            raise InputError(f"MixedPrecision.reduce_dtype={self.reduce_dtype!r} is not supported; "
                             "accepted: torch.float32, torch.bfloat16")

    def to_json(self) -> dict:
        return {"param_dtype": _dtype_name(self.param_dtype), "reduce_dtype": _dtype_name(self.reduce_dtype)}

    @classmethod
    def from_json(cls, data: dict | None) -> "MixedPrecision | None":
        if data is None:
            return None
        return cls(getattr(torch, data["param_dtype"]), getattr(torch, data["reduce_dtype"]))

    def __str__(self) -> str:
        return f"{_dtype_name(self.param_dtype)} compute, fp32 master weights, " \
               f"{_dtype_name(self.reduce_dtype)} gradient reduction"


def as_policy(value) -> MixedPrecision | None:
    """`mixed_precision=` as given (None, "bf16", a MixedPrecision) -> a policy or None (fp32)."""
    if value is None or isinstance(value, MixedPrecision):
        return value
    if isinstance(value, str) and value.lower() in _NAMES:
        return MixedPrecision(param_dtype=_NAMES[value.lower()])
    if isinstance(value, torch.dtype) and value in _COMPUTE:
        return MixedPrecision(param_dtype=value)
    raise InputError(f"mixed_precision={value!r} is not supported; accepted: {', '.join(ACCEPTED)}")


def autocast_forward(policy: MixedPrecision | None, device_type: str = "cpu"):
    """The context the captured forward runs in: autocast for the device of the traced tensors (fake
    CPU tensors for a CPU or meta model, fake CUDA ones for a CUDA model), so that device's autocast
    op lists decide which ops compute in the low dtype. Autocast of one device type leaves another
    device's ops alone: a CPU context around CUDA tensors would trace an fp32 step."""
    if policy is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=policy.param_dtype)


def reduce_itemsize(policy: MixedPrecision | None, dtype: torch.dtype) -> int:
    """Bytes per element a gradient of `dtype` moves in its reduction under `policy` (lowering casts
    only to a narrower dtype, never up)."""
    if policy is None or not dtype.is_floating_point:
        return dtype.itemsize
    return min(dtype.itemsize, policy.reduce_dtype.itemsize)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Ops a parameter gradient passes through after its last real kernel: casts (autocast's bf16 -> fp32
# on the way back to the fp32 parameter), views, and the sum of a tied weight's gradients.
_GRAD_TAIL_OPS = {"_to_copy", "view", "_unsafe_view", "reshape", "permute", "t", "transpose", "clone",
                  "alias", "detach", "squeeze", "unsqueeze", "add"}


def gradient_tails(grad_nodes: list[fx.Node]) -> set[fx.Node]:
    """The nodes between each parameter gradient's last real kernel and the graph output.

    Under mixed precision a weight gradient is computed in bf16 and cast up to fp32 on its way out.
    A Partial gradient may legally be reduced anywhere along that tail (casts and views pass Partial
    through), and below the cast it would move bf16 whatever `reduce_dtype` says. The cost model
    therefore refuses reductions on the edges into these nodes, so every gradient reduction is the
    gradient edge's, priced and lowered in `reduce_dtype`. A node whose value also feeds something
    other than the gradient (another tail node or the output) is not part of a tail."""
    tails: set[fx.Node] = set()
    stack = [g for g in grad_nodes if isinstance(g, fx.Node)]
    while stack:
        node = stack.pop()
        if node in tails or not _is_tail_op(node):
            continue
        if any(u.op != "output" and u not in tails for u in node.users):
            continue
        tails.add(node)
        stack.extend(node.all_input_nodes)
    return tails


def _is_tail_op(node: fx.Node) -> bool:
    name = getattr(node.target, "__name__", "")  # "add.Tensor", "_to_copy.default"
    if node.op != "call_function" or node.meta.get(PHASE) != "backward" or name == "add.Scalar":
        return False
    return name.split(".")[0] in _GRAD_TAIL_OPS


def resolve_with_plan(value, plan) -> MixedPrecision | None:
    """The policy a run uses: `value` as given, or, when None and a saved plan is reused, the plan's
    (a bf16 plan only fits a bf16 graph); a value that contradicts the plan is refused."""
    policy = as_policy(value)
    if plan is None:
        return policy
    planned = MixedPrecision.from_json(plan.mixed_precision)
    if value is None:
        return planned
    if policy != planned:
        raise InputError(f"mixed_precision={value!r} contradicts the plan, made with "
                         f"{planned or 'fp32 (no mixed precision)'}; pass the plan's policy or re-plan")
    return policy
