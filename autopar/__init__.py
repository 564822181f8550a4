"""autopar: auto-parallelize PyTorch training with a graph compiler and an ILP planner."""
from autopar import checkpoint, errors
from autopar.diff import diff
from autopar.mesh import Mesh
from autopar.plan import Plan
from autopar.precision import MixedPrecision
from autopar.planner import plan
from autopar.runtime import ParallelModule, autoparallelize
from autopar.scaling import ScalingReport, scaling

__all__ = ["Mesh", "Plan", "plan", "autoparallelize", "ParallelModule", "checkpoint", "errors", "diff", "scaling", "ScalingReport",
           "MixedPrecision"]
__version__ = "0.1.0"
