"""meshforge.parallelisms: one file per technique, composed once by `parallelize`."""

from .materialize import materialize
from .mesh import Meshes, build_meshes
from .parallelize import ParallelModel, parallelize

__all__ = ["Meshes", "ParallelModel", "build_meshes", "materialize", "parallelize"]
