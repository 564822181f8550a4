"""autopar: auto-parallelize PyTorch training with a graph compiler and an ILP planner.

The public surface is this module's `__all__`; the front door is `autopar/api.py`.
"""
from autopar import errors
from autopar.api import autoparallelize, plan, scaling
from autopar.capture.precision import MixedPrecision
from autopar.inspection.diff import diff
from autopar.mesh import Mesh
from autopar.pipeline.runtime import PipelinedModule
from autopar.plan import Plan
from autopar.planning.scaling import ScalingReport
from autopar.runtime import checkpoint
from autopar.runtime.module import ParallelModule

__all__ = ["Mesh", "Plan", "plan", "autoparallelize", "ParallelModule", "PipelinedModule", "checkpoint", "errors",
           "diff", "scaling", "ScalingReport", "MixedPrecision"]
__version__ = "0.1.0"
