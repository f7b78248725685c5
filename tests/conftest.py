"""Test harness: multi-rank tests run from plain `pytest` through mpi-pytest.

Without GFLOW_TEST_GPU=1, NUMBA_ENABLE_CUDASIM=1 is set here, so the device tests run on Numba's CUDA
simulator; with it, they run on the GPU and the CuPy tests fail instead of skipping when CuPy or the GPU
is missing. A test marked @pytest.mark.parallel([1, 2, 3, 4]) runs once per world size; for sizes above 1,
mpi-pytest spawns `mpiexec -n N pytest <that test>` and fails the test if any rank fails. Inside those
children a watchdog (faulthandler) dumps every thread's stack and kills the rank after
GFLOW_TEST_DEADLINE seconds (default 60), so a deadlock fails its test instead of hanging CI; the
parent's pytest-timeout is the backstop. The multi-rank tests of one world size share one `mpiexec`
(tests/batching.py).
"""

import ctypes
import faulthandler
import os
import sys

# One BLAS/OpenMP thread per process: up to 4 ranks share 2 cores here, and several BLAS threads each
# thrash them. Set before NumPy loads its BLAS; the ranks mpi-pytest spawns inherit it.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

# Without GFLOW_TEST_GPU=1 the CUDA kernels run on Numba's simulator (set before anything imports numba).
if os.environ.get("GFLOW_TEST_GPU") != "1":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

# Hand every launcher the tests start (batches, mpi-pytest's own `mpiexec`, the job-level tests) the
# environment without what MPI's start-up added: Open MPI's singleton (MPI started outside `mpiexec`, as
# in this parent; mpi-pytest's plugin has already imported mpi4py) puts OMPI_MCA_* and PMIX_* variables
# into the process's C environment, and an `mpiexec` that inherits them exits at once with status 1 and
# no output (Open MPI before 5.0.7). os.environ is the copy Python made at start-up and never sees
# them, so the names in the C environment that os.environ lacks are exactly what MPI added.
from mpi4py import MPI  # noqa: E402 - MPI is up from here on


def _c_environment_names() -> list[bytes]:
    environ = ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
    names, i = [], 0
    while environ[i] is not None:
        names.append(environ[i].split(b"=", 1)[0])
        i += 1
    return names


if "_PYTEST_MPI_CHILD_PROCESS" not in os.environ and "Open MPI" in MPI.Get_library_version():
    try:
        _added = set(_c_environment_names()) - set(os.environb)
    except (ValueError, OSError):  # a libc without a visible `environ`: leave the environment alone
        _added = set()
    for _name in _added:
        os.unsetenv(_name)

import pytest  # noqa: E402
from batching import (  # noqa: E402, F401  (hooks: pytest finds them by name in this module)
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_pyfunc_call,
    pytest_runtest_logreport,
    pytest_runtest_protocol,
    pytest_terminal_summary,
)
from hypothesis import HealthCheck, settings  # noqa: E402
from shm_sweep import pytest_sessionfinish, pytest_sessionstart  # noqa: E402, F401  (hooks)

# mpi-pytest calls plain `mpiexec`: make it the one installed beside this Python (the MPICH wheel's).
_bindir = os.path.dirname(sys.executable)
if os.path.exists(os.path.join(_bindir, "mpiexec")):
    os.environ["PATH"] = _bindir + os.pathsep + os.environ.get("PATH", "")

IN_MPI_CHILD = "_PYTEST_MPI_CHILD_PROCESS" in os.environ
DEADLINE_S = float(os.environ.get("GFLOW_TEST_DEADLINE", "60"))

# Every rank must draw the same examples, and timing-based health checks would make ranks diverge.
settings.register_profile(
    "mpi",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    suppress_health_check=list(HealthCheck),
    max_examples=int(os.environ.get("GFLOW_TEST_EXAMPLES", "30")),
)
settings.load_profile("mpi")


@pytest.fixture(autouse=True)
def _deadlock_watchdog(request):
    if IN_MPI_CHILD:
        marker = request.node.get_closest_marker("timeout")  # a longer test says so with its marker
        deadline = max(DEADLINE_S, float(marker.args[0]) - 10) if marker and marker.args else DEADLINE_S
        faulthandler.dump_traceback_later(deadline, exit=True, file=sys.__stderr__)  # past any capture
    yield
    if IN_MPI_CHILD:
        faulthandler.cancel_dump_traceback_later()


def _direct_transport_usable() -> bool:
    """The simulator's "device memory" is host memory, so MPI can take it as it is; a real GPU's only
    when the MPI library is CUDA-aware (or the user says so)."""
    from gflow.cuda import memory, transport

    forced = os.environ.get("GFLOW_CUDA_AWARE_MPI")
    said = transport._library_cuda_support()
    return memory.SIMULATED or forced == "force" or said is True or (forced == "1" and said is None)


@pytest.fixture(
    params=[
        "staged",
        pytest.param(
            "direct",
            marks=pytest.mark.skipif(
                not _direct_transport_usable(),
                reason="a real GPU and an MPI that is not CUDA-aware: device buffers cannot be handed to MPI",
            ),
        ),
    ]
)
def transport_mode(request):
    """Device buffers staged through host memory, or handed to MPI directly (CUDA-aware MPI)."""
    import warnings

    from gflow.cuda import transport

    saved = transport._decided
    transport._decided = request.param == "direct"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the staging notice; tested on its own
        yield request.param
    transport._decided = saved
