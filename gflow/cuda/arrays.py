"""The device kind (see gflow/arrays/kinds.py): arrays exposing __cuda_array_interface__ (CuPy,
Numba, CUDA tensors through torch_tensors.py), and how their bytes reach MPI: directly (a CUDA-aware
MPI) or staged through pinned host memory.
"""

import numpy as np

from ..arrays import host_ops
from ..arrays.numpy_arrays import Direct
from ..runtime.signature import check_dtype, holds
from . import ops, transport
from .memory import (
    copy_streams,
    describe,
    flat_view,
    from_host,
    from_host_async,
    input_view,
    new_like,
    on_callers_device,
    pinned,
    prepare_out,
    to_host,
    to_host_async,
    writable,
)


class Staged:
    """The transport of device memory through pinned host buffers (MPI not CUDA-aware): a buffer
    standing for a device view is a pinned scratch buffer of the context, reused across calls, and the
    reductions run on the host."""

    name = "staged"

    def __init__(self):
        self.ops = host_ops
        self.latency_path = self

    def buffer_for(self, ctx, name: str, view):
        # uint16 device memory is bfloat16's bits: on the host, where it is reduced, it is bfloat16
        return ctx.scratch(name, view.size, holds(view.dtype), pinned)

    def load(self, buffer, view) -> None:
        to_host(buffer, view)

    def store(self, view, buffer) -> None:
        from_host(view, buffer)

    def send(self, ctx, view, name: str = "stage_in"):
        transport.note_staging()
        buffer = self.buffer_for(ctx, name, view)
        self.load(buffer, view)
        return buffer

    def result(self, kind, x, flat, shape, dtype):
        result = kind.new(x, shape, dtype)
        from_host(kind.write_view(result, "result"), flat)
        return result

    def through_host(self, ctx, view, work, segment: int, name: str = "stage_shard") -> None:
        """work(host) on each segment of at most `segment` elements of the device view, in order, each
        segment staged through pinned memory and written back, the copies overlapping the work: while
        work runs on segment i, segment i + 1 comes in and segment i - 1 goes out, each on its own
        stream (so a staged transfer costs about the slower of the copies and the work, not their
        sum). The view holds every result when this returns; if work raises, no copy is left running.
        The device work that produced the view must have finished (ops.fence)."""
        transport.note_staging()
        host = self.buffer_for(ctx, name, view)
        inbound, outbound = copy_streams()
        pieces = [(lo, min(lo + segment, view.size)) for lo in range(0, view.size, max(1, segment))]
        try:
            if pieces:
                to_host_async(host[: pieces[0][1]], view[: pieces[0][1]], inbound)
            for i, (lo, hi) in enumerate(pieces):
                inbound.synchronize()  # segment i is on the host
                if i + 1 < len(pieces):
                    nlo, nhi = pieces[i + 1]
                    to_host_async(host[nlo:nhi], view[nlo:nhi], inbound)
                work(host[lo:hi])
                from_host_async(view[lo:hi], host[lo:hi], outbound)
        finally:
            inbound.synchronize()
            outbound.synchronize()


class DeviceArrays:
    """Arrays exposing __cuda_array_interface__ (and the simulator's): C-contiguous only; results of
    the caller's kind; every read waits for the stream that produced the array (sync_producer)."""

    memory = "device"
    _direct = None

    @property
    def ops(self):
        return ops

    def check(self, x, name: str):
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
        """Direct to a CUDA-aware MPI (but for the latency path, which reads its header on the host
        and stages its small messages there), else staged; decided once per process by
        gflow/cuda/transport.py."""
        if not transport.cuda_aware():
            return _STAGED
        if self._direct is None:
            self._direct = Direct(self.ops, latency_path=_STAGED)
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
