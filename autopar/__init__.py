"""autopar: auto-parallelize PyTorch training with a graph compiler and an ILP planner."""
from autopar import errors
from autopar.mesh import Mesh
from autopar.plan import Plan
from autopar.planner import plan

__all__ = ["Mesh", "Plan", "plan", "errors"]
__version__ = "0.1.0"
