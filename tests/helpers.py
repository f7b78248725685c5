"""Helpers for tests that run on every rank at once: collective assertions and references."""

import contextlib
import signal
import traceback
import warnings

import numpy as np
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
# MPICH's TCP transport (a cluster's Ethernet) for one host's ranks, each on a node of its own: where a
# send to a process whose connection MPI saw close never returns (its progress engine reconnects)
MPICH_TCP = dict(MPIR_CVAR_NOLOCAL="1", MPIR_CVAR_CH4_NETMOD="ofi", FI_PROVIDER="tcp")


class Interrupt(BaseException):
    """Ctrl-C's kind of exception (a BaseException, as KeyboardInterrupt), which pytest does not take
    for the user stopping the whole session."""


@contextlib.contextmanager
def interrupted_after(seconds: float):
    """A signal handler raises Interrupt in the main thread after `seconds`, as Ctrl-C's would."""

    def interrupt(*_):
        raise Interrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def skip_unless_mpich() -> None:
    """Skip a test of MPICH_TCP under another MPI (Open MPI has no switch that splits one host's ranks)."""
    import pytest

    if "MPICH" not in MPI.Get_library_version():
        pytest.skip("MPIR_CVAR_NOLOCAL and MPIR_CVAR_CH4_NETMOD are MPICH's")


def on_all_ranks(fn, label: str = ""):
    """Run fn() on every rank; if it fails anywhere, fail everywhere with every rank's error.

    Keeps ranks in step: a failure on one rank never leaves the others waiting in the next collective,
    and hypothesis sees the same outcome on every rank (so every rank shrinks the same way).
    """
    try:
        fn()
        error = None
    except Exception as exc:  # noqa: BLE001 - reported below, with the traceback
        error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    errors = WORLD.allgather(error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        raise AssertionError(f"{label}: failed on ranks " + ", ".join(f"{r}:\n{e}" for r, e in failed))


def without_warnings(fn, as_errors: bool = True):
    """fn()'s result, asserting it warned of nothing; `as_errors`: with warnings turned into errors, as
    a program may turn them (one raised inside a collective would stop it half way on one rank)."""
    with warnings.catch_warnings(record=True) as raised:
        if as_errors:
            warnings.simplefilter("error")
        result = fn()
    assert not raised, [str(w.message) for w in raised]
    return result


def assert_same_on_all_ranks(y: np.ndarray) -> None:
    blobs = WORLD.allgather(y.tobytes())
    differing = [r for r, b in enumerate(blobs) if b != blobs[0]]
    assert not differing, f"results differ from rank 0's on ranks {differing}"


def random_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Random values of the dtype, never all zeros; integers small enough never to overflow a sum."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return np.asarray(rng.standard_normal(shape) * 4).astype(dtype)
    return np.asarray(rng.integers(-1000, 1000, size=shape, dtype=dtype))


def rank_rng(seed: int) -> np.random.Generator:
    """A generator that differs per rank and per example."""
    return np.random.default_rng([seed, WORLD.rank])


MPI_OP = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
NP_REDUCE = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}


def reference_float64(x: np.ndarray, op: str) -> np.ndarray:
    """The reduction in float64 NumPy over every rank's x (gathered with MPI's own allgather)."""
    everyone = np.stack(WORLD.allgather(x.astype(np.float64)))
    return NP_REDUCE[op](everyone, axis=0)


def _mpi_has(dtype) -> bool:
    try:
        MPI.Datatype.fromcode(np.dtype(dtype).char)
        return True
    except (ValueError, KeyError):  # Open MPI has no float16 type ("cannot map code 'e'")
        return False


def mpi_allreduce(x: np.ndarray, op=MPI.SUM, comm=None) -> np.ndarray:
    """MPI's own Allreduce (op an MPI.Op). Where the MPI library has no type for x's dtype (float16
    on Open MPI), in float32, rounded back: as exact as MPI's own, or more."""
    comm = WORLD if comm is None else comm
    x = np.ascontiguousarray(x)
    wide = x if _mpi_has(x.dtype) else x.astype(np.float32)
    out = np.empty_like(wide)
    comm.Allreduce(wide, out, op)
    return out.astype(x.dtype, copy=False)


def mpi_bcast(buf: np.ndarray, root: int, comm=None) -> None:
    """MPI's own Bcast of the contiguous buf, in place, as bytes (any dtype, any MPI library)."""
    assert buf.flags.c_contiguous, "mpi_bcast: buf must be C-contiguous (a reshape would copy it)"
    (WORLD if comm is None else comm).Bcast([buf.reshape(-1).view(np.uint8), MPI.BYTE], root=root)


def reference_mpi(x: np.ndarray, op: str) -> np.ndarray:
    """MPI's own Allreduce on the user's communicator."""
    ref = mpi_allreduce(x, MPI_OP[op])
    if op == "mean":
        ref = ref / ref.dtype.type(WORLD.size)
    return ref


def assert_close_to_reference(y: np.ndarray, x: np.ndarray, op: str) -> None:
    """Exact for integers and max/min; within the dtype's rounding for float sums and means."""
    exact64 = reference_float64(x, op)
    mpi = reference_mpi(x, op)
    if x.dtype.kind != "f" or op in ("max", "min"):
        np.testing.assert_array_equal(y, mpi)
        np.testing.assert_array_equal(y.astype(np.float64), exact64)
        return
    eps = float(np.finfo(x.dtype).eps)
    # p - 1 roundings of partial sums, each bounded by eps * sum of magnitudes.
    magnitude = reference_float64(np.abs(x.astype(np.float64)), "sum")
    if op == "mean":
        magnitude = magnitude / WORLD.size
    tol = 2 * WORLD.size * eps * magnitude + float(np.finfo(x.dtype).tiny)
    _assert_within(y, exact64, tol, "float64 NumPy")
    _assert_within(y, mpi.astype(np.float64), 2 * tol, "MPI's own Allreduce")  # both round


def _assert_within(y, ref, tol, name):
    err = np.abs(y.astype(np.float64) - ref)
    if err.size and not np.all(err <= tol):
        worst = np.unravel_index(int(np.argmax(err - tol)), err.shape)
        raise AssertionError(
            f"differs from {name} at index {worst}: got {y[worst]}, expected {ref[worst]} "
            f"(tolerance {tol[worst]})"
        )
