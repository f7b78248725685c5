"""Device arrays: recognising them, viewing them through Numba, making results of the same kind.

gflow accepts CuPy arrays, Numba device arrays, PyTorch CUDA tensors and anything else exposing
__cuda_array_interface__. Inside, every one is a zero-copy Numba view; results are made as the caller's
kind (CuPy for CuPy; a Numba device array otherwise).

Streams: before MPI or a kernel of gflow's reads a caller's device buffer, gflow synchronizes the stream
named in its __cuda_array_interface__ ("stream", version 3), or the whole device when none is named.
gflow's own kernels run on the default stream and have finished when a gflow call returns.

Under NUMBA_ENABLE_CUDASIM=1 (tests without a GPU) "device memory" is host memory: simulator arrays
wrap NumPy arrays, and a bare __cuda_array_interface__ object's pointer is read as a host address.
"""

import os
import sys

import numpy as np
from numba import cuda

from .. import host as host_ops
from .._array import is_device
from .._validate import BFLOAT16, holds

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
    contiguous = strides is None or tuple(strides) == _c_strides(shape, dtype.itemsize) or 0 in shape
    return shape, dtype, contiguous


def flat_view(x, name: str = "x"):
    """A flat zero-copy Numba view of a C-contiguous device array; a clear error otherwise."""
    shape, _, contiguous = describe(x, name)
    if not contiguous:
        raise ValueError(
            f"{name}: device arrays must be C-contiguous; got one with shape {shape} and other strides"
        )
    view = device_view(x)
    if view.dtype == BFLOAT16:  # (only the simulator's arrays can be bfloat16)
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
    sync_producer(out)  # work queued on out's own stream may still read or write it
    return out


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
    (torch tensors: gflow/_torch_arrays.py)."""
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


class pinned:  # noqa: N801 - used like the ops modules: pinned.kind, pinned.empty(...)
    """Allocator of page-locked host memory for staging (plain memory under the simulator)."""

    kind = "pinned"

    @staticmethod
    def storage(dtype):
        return np.dtype(dtype)

    @staticmethod
    def empty(n: int, dtype):
        return cuda.pinned_array(n, dtype=dtype)


class Staged:
    """The transport of device memory through pinned host buffers (MPI not CUDA-aware): a buffer
    standing for a device view is a pinned scratch buffer of the context, reused across calls, and the
    reductions run on the host."""

    kind = "staged"
    ring_only = False

    def __init__(self):
        from .. import host

        self.ops = host

    def buffer_for(self, ctx, name: str, view):
        # uint16 device memory is bfloat16's bits: on the host, where it is reduced, it is bfloat16
        return ctx.scratch(name, view.size, holds(view.dtype), pinned)

    def load(self, buffer, view) -> None:
        to_host(buffer, view)

    def store(self, view, buffer) -> None:
        from_host(view, buffer)

    def send(self, ctx, view):
        from . import transport

        transport.note_staging()
        buffer = self.buffer_for(ctx, "stage_in", view)
        self.load(buffer, view)
        return buffer

    def result(self, kind, x, flat, shape, dtype):
        result = kind.new(x, shape, dtype)
        from_host(kind.write_view(result, "result"), flat)
        return result


class DeviceArrays:
    """Arrays exposing __cuda_array_interface__ (and the simulator's): C-contiguous only; results of
    the caller's kind; every read waits for the stream that produced the array (sync_producer)."""

    name = "device"
    _direct = None

    @property
    def ops(self):
        from . import ops

        return ops

    def check(self, x, name: str):
        from .._validate import check_dtype

        shape, dtype, contiguous = describe(x, name)
        check_dtype(dtype)
        if not contiguous:
            raise ValueError(
                f"{name}: device arrays must be C-contiguous; got one of shape {shape} with other strides"
            )
        return dtype

    def shape(self, x) -> tuple:
        return describe(x)[0]

    def size(self, x) -> int:
        return int(np.prod(describe(x)[0], dtype=np.int64))

    def read(self, x, name: str = "x", spare=None):
        return input_view(x, name)

    def write_view(self, x, name: str = "x"):
        return flat_view(x, name)

    def inout_view(self, x, name: str = "x"):
        return input_view(x, name)

    def write_back(self, x, flat) -> None:
        """read() was a view of x (device arrays are contiguous): nothing to write back."""

    def writable(self, x) -> bool:
        return writable(x)

    def new(self, x, shape, dtype):
        return new_like(x, shape, dtype)

    def adopt(self, x, flat, shape, dtype):
        result = self.new(x, shape, dtype)
        self.ops.copy(self.write_view(result, "result"), flat)
        return result

    def shaped(self, flat, shape):
        return flat

    def prepare_out(self, x, out, dtype, count: int, name: str = "out"):
        return prepare_out(x, out, dtype, count, name)

    def transport(self):
        """Direct to a CUDA-aware MPI (every size then takes the ring: the latency path inspects
        its header on the host), else staged; decided once per process by gflow/cuda/transport.py."""
        from . import transport

        if not transport.cuda_aware():
            return _STAGED
        if self._direct is None:
            from .._array import Direct

            self._direct = Direct(self.ops, ring_only=True)
        return self._direct

    def in_background(self, fn, *arrays):
        return on_callers_device(fn, *arrays)

    def done(self, result):
        self.ops.fence()  # the caller may use result on any stream once we return
        return result

    def written(self, x) -> None:
        """(see HostArrays.written: nothing to tell)"""


DEVICE = DeviceArrays()
_STAGED = Staged()
