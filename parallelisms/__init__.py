"""meshforge.parallelisms: one file per technique, composed once by `parallelize`."""

from .materialize import check_parameter_count, materialize, to_empty
from .mesh import Meshes, build_meshes
from .parallelize import ParallelModel, parallelize

__all__ = [
    "Meshes",
    "ParallelModel",
    "build_meshes",
    "check_parameter_count",
    "materialize",
    "parallelize",
    "to_empty",
]
