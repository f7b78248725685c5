"""The collectives on device arrays, at world sizes 1 to 4, staged and direct (CUDA-aware) transport.

Without a GPU these run on Numba's CUDA simulator (conftest.py), where "device memory" is host memory,
so both transports can be exercised here: "direct" hands the simulated device buffers to MPI as a
CUDA-aware MPI would get them. Inputs are Numba device arrays and an object exposing nothing but
__cuda_array_interface__. Arrays stay small: the simulator runs kernels one Python thread per GPU thread.
"""

import warnings

import numpy as np
import pytest
from helpers import (
    WORLD,
    assert_close_to_reference,
    mpi_bcast,
    on_all_ranks,
    random_array,
    rank_rng,
    reference_mpi,
)
from numba import cuda

import gflow
from gflow.arrays.numpy_arrays import is_device
from gflow.cuda import memory, transport

SIZES = [1, 2, 3, 4]


class CAIOnly:
    """Nothing but __cuda_array_interface__ (version 3), as a foreign GPU library's array would be."""

    def __init__(self, device_array):
        self._keep = device_array
        host = device_array._ary if memory.SIMULATED else None
        pointer = host.ctypes.data if memory.SIMULATED else device_array.device_ctypes_pointer.value
        self.__cuda_array_interface__ = {
            "shape": tuple(device_array.shape),
            "typestr": np.dtype(device_array.dtype).str,
            "data": (pointer, False),
            "strides": None,
            "version": 3,
            "stream": None,
        }


def to_host(a) -> np.ndarray:
    return memory.device_view(a).copy_to_host()


def make(kind: str, host_array: np.ndarray):
    d = cuda.to_device(host_array)
    return CAIOnly(d) if kind == "cai" else d


@pytest.mark.parallel(SIZES)
def test_device_collectives_match_mpi(transport_mode):
    for kind in ("numba", "cai"):
        for n, dtype, op in [
            (0, np.float32, "sum"),
            (5, np.int32, "max"),
            (300, np.float32, "mean"),
            (301, np.float64, "sum"),
        ]:
            x = random_array(rank_rng(n), n, dtype)
            on_all_ranks(lambda: check_all_collectives(kind, x, op), f"{kind} n={n} {dtype.__name__} {op}")  # noqa: B023


def check_all_collectives(kind, x, op):
    d = make(kind, x)
    y = gflow.allreduce(d, op)
    assert is_device(y), type(y)
    assert_close_to_reference(to_host(y), x, op)
    np.testing.assert_array_equal(to_host(d), x)  # input untouched

    out = cuda.to_device(np.full(x.size, -7, dtype=x.dtype))
    assert gflow.allreduce(d, op, out=out) is out
    np.testing.assert_array_equal(out.copy_to_host(), to_host(y))

    shard = to_host(gflow.reduce_scatter(d, op))
    full = reference_mpi(x, op)
    np.testing.assert_allclose(shard, np.array_split(full, WORLD.size)[WORLD.rank], rtol=1e-5, atol=1e-5)

    mine = x[: max(x.size - WORLD.rank, 0)]
    gathered = to_host(gflow.allgather(make(kind, mine)))
    np.testing.assert_array_equal(gathered, np.concatenate(WORLD.allgather(mine)))

    root = WORLD.size - 1
    expected = x.copy()
    mpi_bcast(expected, root)
    np.testing.assert_array_equal(to_host(gflow.broadcast(d, root=root)), expected)


@pytest.mark.parallel([2, 3])
def test_host_and_device_arrays_in_one_call_fail_on_every_rank(transport_mode):
    x = np.ones(50, np.float32)
    arg = x if WORLD.rank == 0 else cuda.to_device(x)

    def check():
        with pytest.raises(gflow.MismatchError, match="host array.*device array|device array.*host array"):
            gflow.allreduce(arg)

    on_all_ranks(check)


@pytest.mark.parallel([1, 2])
def test_staging_warns_once_naming_the_variable(monkeypatch):
    monkeypatch.delenv("GFLOW_CUDA_AWARE_MPI", raising=False)
    monkeypatch.setattr(transport, "_decided", False)
    monkeypatch.setattr(transport, "_warned", False)
    d = cuda.to_device(np.ones(10, np.float32))
    with pytest.warns(RuntimeWarning, match="GFLOW_CUDA_AWARE_MPI=1"):
        gflow.allreduce(d)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        np.testing.assert_array_equal(to_host(gflow.allreduce(d)), WORLD.size)


@pytest.mark.parallel([1, 2])
def test_cuda_aware_forced_on_an_mpi_that_says_no_is_refused_before_any_data_moves(monkeypatch):
    from gflow.runtime.mpi import mpi_library

    monkeypatch.setenv("GFLOW_CUDA_AWARE_MPI", "1")
    monkeypatch.setattr(transport, "_decided", None)
    monkeypatch.setattr(transport, "arrays_simulated", lambda: False)  # a real GPU: MPI cannot read it
    monkeypatch.setattr(transport, "_library_cuda_support", lambda: False)
    d = cuda.to_device(np.ones(10, np.float32))

    def check():
        with pytest.raises(ValueError, match="GFLOW_CUDA_AWARE_MPI=1") as caught:
            gflow.allreduce(d)
        assert mpi_library() in str(caught.value) and "not CUDA-aware" in str(caught.value)

    on_all_ranks(check)
    monkeypatch.setenv("GFLOW_CUDA_AWARE_MPI", "force")  # the user knows better than the library
    monkeypatch.setattr(transport, "_decided", None)
    assert transport.cuda_aware()
    monkeypatch.setenv("GFLOW_CUDA_AWARE_MPI", "1")
    monkeypatch.setattr(transport, "_library_cuda_support", lambda: None)  # a library that cannot tell
    monkeypatch.setattr(transport, "_decided", None)
    assert transport.cuda_aware()  # ... is taken at the user's word


def test_bad_device_arguments():
    d = cuda.to_device(np.ones(10, np.float32))
    with pytest.raises(TypeError, match="out must be a device array"):
        gflow.allreduce(d, out=np.ones(10, np.float32))
    with pytest.raises(TypeError, match="expected dtype float32, got float64"):
        gflow.allreduce(d, out=cuda.to_device(np.ones(10)))
    with pytest.raises(ValueError, match="expected 10 elements, got 11"):
        gflow.allreduce(d, out=cuda.to_device(np.ones(11, np.float32)))
    with pytest.raises(TypeError, match="unsupported dtype uint8"):
        gflow.allreduce(cuda.to_device(np.ones(4, np.uint8)))
    with pytest.raises(TypeError, match="same kind of array as x"):
        gflow.allreduce(np.ones(10, np.float32), out=d)


def test_the_mpi_library_is_found_for_the_cuda_support_query():
    """mpi4py may load libmpi privately (the MPICH wheel does): the CUDA-support query must still reach
    it, or a CUDA-aware MPI would be taken for one that is not."""
    assert any(hasattr(handle, "MPI_Init") for handle in transport._mpi_library_handles())
