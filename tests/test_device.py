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


@pytest.mark.parallel([1, 2, 3])
def test_lazy_steps_that_switch_between_host_and_device_arrays():
    # helper-47: a segment's buffer was reused whatever memory the next step's pushes were in. After a
    # step of host arrays on one rank and device arrays on another (MismatchError, rightly), every
    # later step failed the same way; device pushes after host ones were sent as host arrays, and
    # host pushes after device ones raised TypeError.
    shapes = [(5, 3), (7,), (2, 2, 2), (11,)]
    lazy = gflow.LazyAllreduce(threshold_bytes=64, op="mean")
    seeds = iter(range(100))

    def step(where):
        rng = rank_rng(next(seeds))
        grads = [random_array(rng, int(np.prod(s)), np.float32).reshape(s) for s in shapes]
        pushed = [cuda.to_device(g) if where == "device" else g.copy() for g in grads]
        for g in pushed:
            lazy.push(g)
        lazy.flush()
        for g, d in zip(grads, pushed, strict=True):
            result = d.copy_to_host() if where == "device" else d
            assert_close_to_reference(result.ravel(), g.ravel(), "mean")

    if WORLD.size > 1:
        with pytest.raises(gflow.MismatchError, match="host array.*device array|device array.*host array"):
            step("device" if WORLD.rank == 0 else "host")
    for where in ("device", "host", "device", "device", "host"):
        on_all_ranks(lambda where=where: step(where), where)


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


@pytest.mark.parallel([1, 2, 3])
@pytest.mark.parametrize("kind", ["numba", "cai"])
def test_a_device_out_that_overlaps_x_in_part_is_refused(kind):
    """helper-55: out=base[1:] over x=base[:-1] was taken, and the direct ring and a world of one gave
    wrong elements (35 of 37), broadcast too; NumPy arrays were refused. Now refused alike, on the
    rank that passed it before any data moves (its peers: MismatchError), and the next call works."""
    n = 37
    base = cuda.to_device(np.concatenate([random_array(rank_rng(77), n, np.float32), [0]]).astype(np.float32))
    x, out = base[:-1], base[1:]
    if kind == "cai":
        x, out = CAIOnly(x), CAIOnly(out)
    mine = WORLD.rank == WORLD.size - 1
    for call in (lambda o: gflow.allreduce(x, out=o), lambda o: gflow.broadcast(x, root=0, out=o)):
        if mine or WORLD.size == 1:
            on_all_ranks(lambda call=call: pytest.raises(ValueError, call, out).match("overlaps x in part"))
        else:
            on_all_ranks(lambda call=call: pytest.raises(gflow.MismatchError, call, None))
    got = cuda.device_array(n, np.float32)
    gflow.allreduce(x, out=got)
    assert_close_to_reference(to_host(got), to_host(base)[:n], "sum")


def test_explicit_strides_on_axes_of_extent_one_are_still_c_order():
    """helper-47: a __cuda_array_interface__ with strides given for axes of extent 1 (any value: such an
    axis is never stepped) was refused as non-contiguous; NumPy and Numba call it C order."""
    x = random_array(rank_rng(7), 7, np.float32)
    for shape, strides in [((1, 7), (999, 4)), ((7, 1), (4, 3)), ((1, 7, 1), (28, 4, 1))]:
        a = CAIOnly(cuda.to_device(x))
        a.__cuda_array_interface__.update(shape=shape, strides=strides)
        assert memory.describe(a)[2], (shape, strides)
        assert_close_to_reference(to_host(gflow.allreduce(a)).reshape(-1), x, "sum")
    # Fortran order, and a stride of 0 (Numba takes it for a broadcast array): refused
    for shape, strides in [((2, 3), (4, 8)), ((1, 6), (0, 4))]:
        a = CAIOnly(cuda.to_device(x[:6]))
        a.__cuda_array_interface__.update(shape=shape, strides=strides)
        with pytest.raises(ValueError, match="must be C-contiguous"):
            gflow.allreduce(a)


def test_the_mpi_library_is_found_for_the_cuda_support_query():
    """mpi4py may load libmpi privately (the MPICH wheel does): the CUDA-support query must still reach
    it, or a CUDA-aware MPI would be taken for one that is not."""
    assert any(hasattr(handle, "MPI_Init") for handle in transport._mpi_library_handles())


def test_staging_through_the_host_pipelines_every_segment_count(monkeypatch):
    """Staged.through_host: the work sees every segment, in order, holding the device's values; the
    device holds every result afterwards; any segment size (1, uneven, the whole, more than the
    whole) and an empty view; bfloat16 as its bits. On a GPU the copies overlap the work (streams);
    under the simulator they are synchronous, and the order and the data are what is checked."""
    import ml_dtypes

    from gflow.cuda.arrays import Staged
    from gflow.runtime.context import context

    monkeypatch.setattr(transport, "_warned", True)
    ctx, staged = context(WORLD), Staged()
    rng = np.random.default_rng(11)
    for dtype in (np.float32, np.int64, np.dtype(ml_dtypes.bfloat16)):
        for n, segment in [(0, 4), (1, 1), (37, 1), (37, 5), (37, 36), (37, 37), (37, 100)]:
            x = rng.standard_normal(n).astype(dtype)
            view = memory.flat_view(cuda.to_device(x.view(np.uint16) if x.dtype.kind == "V" else x))
            seen = []

            def double(host, seen=seen):
                seen.append(host.copy())
                host[...] = (host.astype(np.float64) * 2).astype(host.dtype)

            staged.through_host(ctx, view, double, segment)
            pieces = [x[lo : lo + segment] for lo in range(0, n, segment)]
            assert len(seen) == len(pieces), (n, segment)
            for got, want in zip(seen, pieces, strict=True):
                np.testing.assert_array_equal(got, want)
            expected = (x.astype(np.float64) * 2).astype(dtype)
            np.testing.assert_array_equal(memory.device_view(view).copy_to_host().view(dtype), expected)


def test_a_failure_in_the_middle_of_the_staging_pipeline_leaves_no_copy_running(monkeypatch):
    """Work that raises on the third segment: the error reaches the caller; the segments before it are
    back on the device, the ones after it untouched; the next call works."""
    from gflow.cuda.arrays import Staged
    from gflow.runtime.context import context

    monkeypatch.setattr(transport, "_warned", True)
    ctx, staged = context(WORLD), Staged()
    x = np.arange(40, dtype=np.float32) + 1
    view = memory.flat_view(cuda.to_device(x))
    calls = []

    def negate_then_fail(host):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the ring failed")
        host *= -1

    with pytest.raises(RuntimeError, match="the ring failed"):
        staged.through_host(ctx, view, negate_then_fail, 10)
    after = view.copy_to_host()
    np.testing.assert_array_equal(after[:20], -x[:20])
    np.testing.assert_array_equal(after[20:], x[20:])
    staged.through_host(ctx, view, negate_then_fail, 10)  # (calls 4 to 7 do not fail)
    np.testing.assert_array_equal(view.copy_to_host(), np.concatenate([x[:20], -x[20:]]))
