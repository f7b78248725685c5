"""gflow: GradientFlow-style collectives for data-parallel training on MPI.

The public API; the implementation lives in the private modules.
"""

import os as _os

from ._config import config
from .collectives.api import allgather, allreduce, allreduce_async, broadcast, reduce_scatter
from .collectives.lazy import LazyAllreduce
from .collectives.sparse import SparseAllreduce
from .compression import LossScaler
from .data_parallel import DataParallel, broadcast_parameters
from .engine import Handle
from .errors import CompressionOverflowError, GflowError, MismatchError, NonFiniteError
from .failures import install as _install_excepthook
from .timeline import start_timeline, stop_timeline

_install_excepthook()
if _os.environ.get("GFLOW_TIMELINE"):
    start_timeline(_os.environ["GFLOW_TIMELINE"])

__version__ = "0.1.0"

__all__ = [
    "CompressionOverflowError",
    "DataParallel",
    "GflowError",
    "Handle",
    "LazyAllreduce",
    "LossScaler",
    "MismatchError",
    "NonFiniteError",
    "SparseAllreduce",
    "allgather",
    "allreduce",
    "allreduce_async",
    "broadcast",
    "broadcast_parameters",
    "config",
    "reduce_scatter",
    "start_timeline",
    "stop_timeline",
]
