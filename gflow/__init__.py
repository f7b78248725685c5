"""gflow: GradientFlow-style collectives for data-parallel training on MPI.

The public API; the implementation lives in the private modules.
"""

from ._config import config
from .collectives.api import allgather, allreduce, broadcast, reduce_scatter
from .errors import GflowError, MismatchError

__version__ = "0.1.0"

__all__ = [
    "GflowError",
    "MismatchError",
    "allgather",
    "allreduce",
    "broadcast",
    "config",
    "reduce_scatter",
]
