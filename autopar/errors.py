"""autopar's exception types. User mistakes raise these; `assert` is kept for internal invariants."""
from __future__ import annotations


class AutoparError(Exception):
    """Base class of every error autopar raises for a user's input."""


class TraceError(AutoparError):
    """The model could not be captured as a graph (data-dependent control flow, unsupported Python)."""


class InputError(AutoparError, TypeError):
    """An argument (example inputs, mesh, strategy, budget) has the wrong type, value or shape."""


class NoLossError(AutoparError):
    """The model returned no scalar loss and no `loss_fn` was given."""


class MeshError(AutoparError, ValueError):
    """A mesh that cannot be built or does not match the running world."""


class DeviceError(AutoparError, RuntimeError):
    """A device was requested that this machine or torch build does not have (e.g. CUDA on a CPU build)."""


class HardwareError(AutoparError, ValueError):
    """An unknown hardware preset or a corrupt/incomplete hardware profile."""


class InfeasiblePlanError(AutoparError):
    """No plan fits the memory budget. `min_memory_per_device` is the smallest any plan needs (bytes)."""

    def __init__(self, message: str, *, min_memory_per_device: float | None = None, budget: float | None = None):
        super().__init__(message)
        self.min_memory_per_device = min_memory_per_device
        self.budget = budget
        self.baselines: dict = {}   # the recipes priced before the plan was refused (Plan.baselines' form)


class PlanMismatchError(AutoparError):
    """A saved plan was made for another model, mesh or input shape."""


class CheckpointError(AutoparError, ValueError):
    """A checkpoint that does not fit the model (keys, shapes), or that cannot be read or written."""


class SolverError(AutoparError):
    """The solver failed to return any plan (should not happen: a fallback plan always exists)."""


class UnsupportedOpWarning(UserWarning):
    """An operator has no sharding rule; it is kept replicated."""


class SolverTimeLimitWarning(UserWarning):
    """The solver stopped at its time limit; the plan is the best found and `Plan.gap` says how far from optimal."""
