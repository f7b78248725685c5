"""How device buffers reach MPI: directly (CUDA-aware MPI) or staged through pinned host memory.

Direct when GFLOW_CUDA_AWARE_MPI=1 (refused if the library says it is not CUDA-aware), =force (taken
as it is: some CUDA-aware builds say no), or when it is unset and the MPI library says it supports CUDA
(Open MPI's MPIX_Query_cuda_support, MPICH's MPIX_GPU_query_support). GFLOW_CUDA_AWARE_MPI=0 forces
staging. When staging was chosen without the variable being set, the first staged call warns once,
naming it. Either way the result is the same; staging costs a device-host copy each way.
"""

import ctypes
import os
import warnings

from .memory import SIMULATED

_ENV = "GFLOW_CUDA_AWARE_MPI"
_decided = None
_warned = False


def _mpi_library_handles() -> list:
    """ctypes handles that can see the MPI library's symbols. mpi4py may load libmpi privately
    (RTLD_LOCAL, as with the MPICH wheel), so the process-wide namespace alone does not find them:
    also open every libmpi already mapped into this process (Linux's /proc/self/maps)."""
    from mpi4py import MPI  # noqa: F401 - the library must be loaded before it can be found

    handles = []
    try:
        handles.append(ctypes.CDLL(None))
    except OSError:
        pass
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libmpi" in line and "/" in line})
    except OSError:
        paths = []
    for path in paths:
        try:
            handles.append(ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL))
        except OSError:
            pass
    return handles


def _library_cuda_support() -> bool | None:
    """Ask the loaded MPI library whether it is CUDA-aware; None when it has no way to tell."""
    for library in _mpi_library_handles():
        query = getattr(library, "MPIX_Query_cuda_support", None)  # Open MPI (and MPICH >= 4)
        if query is not None:
            query.restype = ctypes.c_int
            return bool(query())
        query = getattr(library, "MPIX_GPU_query_support", None)  # MPICH >= 4
        if query is not None:
            supported = ctypes.c_int(0)
            query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
            if query(0, ctypes.byref(supported)) == 0:  # 0 = MPIX_GPU_SUPPORT_CUDA
                return bool(supported.value)
    return None


def cuda_aware() -> bool:
    """True when device buffers may go to MPI as they are (decided once per process).

    Raises:
        ValueError: GFLOW_CUDA_AWARE_MPI is not 0 or 1, or it is 1 and the MPI library says it is
            not CUDA-aware (it would read device pointers as host memory and crash or corrupt).
    """
    global _decided
    if _decided is None:
        value = os.environ.get(_ENV, "")
        if value not in ("", "0", "1", "force"):
            raise ValueError(f"{_ENV} must be 0, 1 or force, got {value!r}")
        if value == "1" and not arrays_simulated() and _library_cuda_support() is False:
            from ..runtime.mpi import mpi_library

            raise ValueError(
                f"{_ENV}=1 asks gflow to hand device buffers to MPI, but {mpi_library()} says it is not "
                "CUDA-aware (MPIX_Query_cuda_support / MPIX_GPU_query_support): load a CUDA-aware MPI, "
                f"unset {_ENV} to stage device buffers through host memory, or set {_ENV}=force if the "
                "library is CUDA-aware but says otherwise (Open MPI 5 before CUDA starts, Open MPI over "
                "a CUDA-enabled UCX)"
            )
        _decided = value in ("1", "force") if value else bool(_library_cuda_support())
    return _decided


def arrays_simulated() -> bool:
    """Numba's CUDA simulator: its "device memory" is host memory, which any MPI can read."""
    return SIMULATED


def note_staging() -> None:
    """Warn once that device buffers are being staged, unless the user chose that explicitly."""
    global _warned
    if not _warned and os.environ.get(_ENV, "") == "" and not cuda_aware():  # (not the latency path's)
        _warned = True
        warnings.warn(
            f"gflow: the MPI library does not report CUDA support, so device buffers are staged through "
            f"pinned host memory. If your MPI is CUDA-aware, set {_ENV}=1 to pass device buffers directly; "
            f"set {_ENV}=0 to silence this warning.",
            RuntimeWarning,
            stacklevel=3,
        )


def describe() -> str:
    if cuda_aware():
        return "direct (CUDA-aware MPI)"
    return "staged through pinned host memory"
