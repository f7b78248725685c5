"""gflow: GradientFlow-style collectives for data-parallel training on MPI.

The public API. Where everything else lives: docs/architecture.md (one folder per layer, each
importing only from those below it).
"""

import os as _os

from .collectives.exchange import allgather, alltoall, broadcast, reduce_scatter
from .collectives.join import join
from .collectives.operations import allreduce, allreduce_async
from .errors import CompressionOverflowError, GflowError, MismatchError, NonFiniteError, NotServedInJoinError
from .fusion.lazy import LazyAllreduce
from .fusion.sparse import SparseAllreduce
from .runtime import lifecycle as _lifecycle  # noqa: F401 - registers the exit order
from .runtime.config import config
from .runtime.engine import Handle
from .runtime.failures import install as _install_excepthook
from .runtime.mpi import launcher_mismatch as _launcher_mismatch
from .runtime.timeline import start_timeline, stop_timeline
from .training.data_parallel import DataParallel, broadcast_parameters
from .training.loss_scaler import LossScaler

_install_excepthook()
_mismatch = _launcher_mismatch()
if _mismatch is not None:  # (before any collective: each rank would reduce with itself alone)
    import warnings as _warnings

    _warnings.warn(f"gflow: {_mismatch}", RuntimeWarning, stacklevel=2)
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
    "NotServedInJoinError",
    "SparseAllreduce",
    "allgather",
    "allreduce",
    "allreduce_async",
    "alltoall",
    "broadcast",
    "broadcast_parameters",
    "config",
    "join",
    "reduce_scatter",
    "start_timeline",
    "stop_timeline",
]
