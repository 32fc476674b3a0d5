"""meshforge.parallelisms: one file per technique, composed once by `parallelize`."""

from .materialize import materialize
from .mesh import MESH_DIMS, ParallelDims
from .parallelize import ParallelModel, parallelize

__all__ = ["MESH_DIMS", "ParallelDims", "ParallelModel", "materialize", "parallelize"]
