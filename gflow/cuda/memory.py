"""Device memory: recognising device arrays, viewing them through Numba, making results of the same
kind, copying between device and host. (The device kind built on these is arrays.py.)

gflow accepts CuPy arrays, Numba device arrays, PyTorch CUDA tensors and anything else exposing
__cuda_array_interface__. Inside, every one is a zero-copy Numba view; results are made as the caller's
kind (CuPy for CuPy; a Numba device array otherwise).

Streams: before MPI or a kernel of gflow's reads a caller's device buffer, gflow synchronizes the stream
named in its __cuda_array_interface__ ("stream", version 3), or the whole device when none is named.
gflow's own kernels run on the default stream and have finished when a gflow call returns.

Under NUMBA_ENABLE_CUDASIM=1 (tests without a GPU) "device memory" is host memory: simulator arrays
wrap NumPy arrays, and a bare __cuda_array_interface__ object's pointer is read as a host address.
"""

import math
import os
import sys

import numpy as np
from numba import cuda

from ..arrays import host_ops
from ..arrays.numpy_arrays import is_device
from ..runtime.signature import holds, is_bfloat16

SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


class _HostPointer:
    """Exposes a pointer from __cuda_array_interface__ as a NumPy array (simulator only)."""

    def __init__(self, cai: dict):
        self.__array_interface__ = {
            "shape": tuple(cai["shape"]),
            "typestr": cai["typestr"],
            "data": cai["data"],
            "strides": cai.get("strides"),
            "version": 3,
        }


def _c_strides(shape, itemsize: int) -> tuple:
    strides, step = [], itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))


def describe(x, name: str = "x"):
    """(shape, dtype, C-contiguous) of a device array, read from its __cuda_array_interface__."""
    if SIMULATED and type(x).__name__ == "FakeCUDAArray":
        return tuple(x.shape), np.dtype(x.dtype), bool(x._ary.flags.c_contiguous)
    cai = x.__cuda_array_interface__
    shape, dtype = tuple(cai["shape"]), np.dtype(cai["typestr"])
    strides = cai.get("strides")
    contiguous = strides is None or 0 in shape or _is_c_order(shape, tuple(strides), dtype.itemsize)
    return shape, dtype, contiguous


def _is_c_order(shape, strides, itemsize: int) -> bool:
    """C order as NumPy judges it: an axis of extent 1 is never stepped, so its stride does not count
    (torch and some exporters give such axes an arbitrary stride rather than strides=None)."""
    # (not a stride of 0: Numba takes any such array for a broadcast one, and cannot view it flat)
    return all(
        (e == 1 and s != 0) or s == c
        for e, s, c in zip(shape, strides, _c_strides(shape, itemsize), strict=True)
    )


def flat_view(x, name: str = "x"):
    """A flat zero-copy Numba view of a C-contiguous device array; a clear error otherwise."""
    shape, _, contiguous = describe(x, name)
    if not contiguous:
        raise ValueError(
            f"{name}: device arrays must be C-contiguous; got one with shape {shape} and other strides"
        )
    view = device_view(x)
    if is_bfloat16(view.dtype):  # (only the simulator's arrays can be bfloat16)
        view = view.view(np.uint16)  # the kernels take bfloat16 as its bits (gflow/cuda/ops.py)
    if len(shape) == 1:
        return view
    if 0 in shape and not SIMULATED:  # Numba cannot reshape an empty 2-D array ("requires copying")
        return cuda.device_array(0, view.dtype)
    return view.reshape(-1)


def input_view(x, name: str = "x"):
    """flat_view of a caller's array that gflow is about to read, after waiting for the stream that
    produced it: every read of a caller's device buffer starts here."""
    view = flat_view(x, name)
    sync_producer(x)
    return view


def prepare_out(x, out, dtype, count: int, name: str = "out"):
    """The device array a result goes into: a new one of x's kind, or `out` after checking it."""
    if out is None:
        return new_like(x, describe(x)[0], dtype)
    if not is_device(out):
        raise TypeError(f"{name} must be a device array like x, got {type(out).__name__}")
    shape, out_dtype, contiguous = describe(out, name)
    if holds(out_dtype) != dtype:  # (a bfloat16 result may be gflow's own uint16 bits)
        raise TypeError(f"{name}: expected dtype {dtype}, got {out_dtype}")
    if int(np.prod(shape, dtype=np.int64)) != count:
        raise ValueError(f"{name}: expected {count} elements, got {int(np.prod(shape, dtype=np.int64))}")
    if not contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if not writable(out):
        raise ValueError(f"{name} is read-only; the result is written into it: pass a writable array")
    if out is not x:  # (helper-55: out=base[1:] over x=base[:-1] gave wrong sums on the direct path)
        mine, theirs = address(out), address(x)
        apart = not (mine and theirs) or mine[0] >= theirs[0] + theirs[1] or theirs[0] >= mine[0] + mine[1]
        if mine != theirs and not apart:
            raise ValueError(
                f"{name} overlaps x in part: pass out=x (or an array over exactly x's memory) to "
                "write the result over x, or a separate array"
            )
    sync_producer(out)  # work queued on out's own stream may still read or write it
    return out


def address(x):
    """(device address, bytes) of x if it is a C-contiguous device array, else None."""
    if SIMULATED and type(x).__name__ == "FakeCUDAArray":
        return (x._ary.__array_interface__["data"][0], x._ary.nbytes) if x._ary.flags.c_contiguous else None
    if getattr(x, "__cuda_array_interface__", None) is None:
        return None
    shape, dtype, contiguous = describe(x)
    return (x.__cuda_array_interface__["data"][0], math.prod(shape) * dtype.itemsize) if contiguous else None


def writable(x) -> bool:
    """Whether x may be written (__cuda_array_interface__'s read-only flag; the simulator's array)."""
    if SIMULATED and type(x).__name__ == "FakeCUDAArray":
        return bool(x._ary.flags.writeable)
    return not x.__cuda_array_interface__["data"][1]


def device_view(x):
    """A zero-copy Numba device array over x."""
    if SIMULATED:
        if type(x).__name__ == "FakeCUDAArray":
            return x
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(np.asarray(_HostPointer(x.__cuda_array_interface__)))
    if cuda.is_cuda_array(x) and not isinstance(x, cuda.cudadrv.devicearray.DeviceNDArray):
        cai = x.__cuda_array_interface__
        if 0 in tuple(cai["shape"]):  # no memory to view (the pointer may be null): an empty array
            return cuda.device_array(tuple(cai["shape"]), np.dtype(cai["typestr"]))
        return cuda.as_cuda_array(x, sync=False)
    return x


def sync_producer(x) -> None:
    """Wait for the work that produced x (see the module docstring for the rule)."""
    if SIMULATED:
        return
    cai = getattr(x, "__cuda_array_interface__", None)
    stream = cai.get("stream") if cai else None
    if stream:
        cuda.external_stream(stream).synchronize()
    else:
        cuda.synchronize()


def on_callers_device(fn, *inputs):
    """fn, wrapped to run on gflow's background thread as if in the caller's: on the caller's current
    device (CUDA's current device is per thread), after the work that produced `inputs` on the
    caller's streams (an event recorded now; CuPy and torch report the current stream of the thread
    that asks, so the engine thread cannot find it itself)."""
    if SIMULATED:
        return fn
    device_id = cuda.get_current_device().id
    events = []
    for x in inputs:
        stream = x.__cuda_array_interface__.get("stream")
        if stream:
            event = cuda.event(timing=False)
            event.record(cuda.external_stream(stream))
            events.append(event)
        else:
            cuda.synchronize()

    def run():
        cuda.select_device(device_id)
        cupy = sys.modules.get("cupy")
        if cupy is not None:
            cupy.cuda.Device(device_id).use()
        for event in events:
            event.synchronize()
        return fn()

    return run


def new_like(x, shape, dtype):
    """A new device array of x's kind: CuPy for CuPy, a Numba device array for anything else
    (torch tensors: gflow/arrays/torch_tensors.py)."""
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy.empty(shape, dtype=dtype)
    return cuda.device_array(shape, dtype=dtype)


def mpi_buffer(view):
    """What to hand MPI for a device view: the view itself, whose __cuda_array_interface__ a
    CUDA-aware MPI reads (in the simulator, the host array underneath)."""
    return view._ary if SIMULATED else view


def to_host(host, view) -> None:
    """Copy a contiguous device view into a host array of the same size."""
    host = host_ops.buffer(host)  # bfloat16 as the uint16 bits its device twin holds
    if view.size:
        if SIMULATED:
            np.copyto(host, view._ary.reshape(-1))
        else:
            view.copy_to_host(host)


def from_host(view, host) -> None:
    """Copy a host array into a contiguous device view of the same size."""
    host = host_ops.buffer(host)  # bfloat16 as the uint16 bits its device twin holds
    if view.size:
        if SIMULATED:
            np.copyto(view._ary.reshape(-1), host)
        else:
            view.copy_to_device(host)


def to_host_async(host, view, stream) -> None:
    """to_host, queued on `stream` (host must be pinned for the copy to overlap other work)."""
    host = host_ops.buffer(host)
    if view.size:
        if SIMULATED:
            np.copyto(host, view._ary.reshape(-1))
        else:
            view.copy_to_host(host, stream=stream)


def from_host_async(view, host, stream) -> None:
    """from_host, queued on `stream`."""
    host = host_ops.buffer(host)
    if view.size:
        if SIMULATED:
            np.copyto(view._ary.reshape(-1), host)
        else:
            view.copy_to_device(host, stream=stream)


_copy_streams: dict = {}


def copy_streams():
    """(inbound, outbound): this process's two copy streams on the current device, made once."""
    device = 0 if SIMULATED else cuda.get_current_device().id
    if device not in _copy_streams:
        _copy_streams[device] = (cuda.stream(), cuda.stream())
    return _copy_streams[device]


class pinned:  # noqa: N801 - used like the ops modules: pinned.memory, pinned.empty(...)
    """Allocator of page-locked host memory for staging (plain memory under the simulator)."""

    memory = "pinned"

    @staticmethod
    def storage(dtype):
        return np.dtype(dtype)

    @staticmethod
    def empty(n: int, dtype):
        return cuda.pinned_array(n, dtype=dtype)
