"""The collectives on device arrays: straight to a CUDA-aware MPI, or staged through pinned host memory.

Either way the work is done by the functions of collectives/common.py: with the device ops (kernels)
on device memory when MPI is CUDA-aware, so the data never visits the host; with the host ops on
pinned host copies otherwise (one device-host copy each way, buffers reused across calls). The
choice is gflow/cuda/transport.py's. With a CUDA-aware MPI every size goes around the ring: the
latency path inspects its header on the host, which would cost the round trip this path avoids.
Callers have checked the arguments; the result is of the caller's kind of array (CuPy for CuPy).
"""

import numpy as np

from .. import host
from .._context import CommContext
from .._validate import signature
from ..cuda import arrays, transport
from ..cuda import ops as dev
from .common import allgather_flat, allreduce_flat, broadcast_flat, reduce_scatter_flat


def _staged(ctx: CommContext, name: str, view, dtype):
    """A pinned host copy of the flat device view (scratch reused across calls)."""
    buf = ctx.scratch(name, view.size, dtype, arrays.pinned)
    arrays.to_host(buf, view)
    return buf


def _finish(result):
    dev.fence()  # the caller may use result on any stream once we return
    return result


def allreduce(ctx: CommContext, x, result, dtype, name: str, chosen: str, tag=("allreduce", 0)):
    src, dst = arrays.input_view(x), arrays.flat_view(result, "out")
    if transport.cuda_aware():
        sig = signature(tag[0], "ring", src.size, dtype, name, extra=tag[1], kind="device")
        allreduce_flat(ctx, src, dst, dev, sig, "ring", name)
    else:
        transport.note_staging()
        staged_in = _staged(ctx, "stage_in", src, dtype)
        staged_out = ctx.scratch("stage_out", src.size, dtype, arrays.pinned)
        sig = signature(tag[0], chosen, src.size, dtype, name, extra=tag[1], kind="device")
        allreduce_flat(ctx, staged_in, staged_out, host, sig, chosen, name)
        arrays.from_host(dst, staged_out)
    return _finish(result)


def reduce_scatter(ctx: CommContext, x, dtype, name: str):
    src = arrays.input_view(x)
    if transport.cuda_aware():
        shard = reduce_scatter_flat(ctx, src, dev, dtype, name, kind="device")
        result = arrays.new_like(x, (shard.size,), dtype)
        dev.copy(arrays.device_view(result), shard)
    else:
        transport.note_staging()
        shard = reduce_scatter_flat(
            ctx, _staged(ctx, "stage_in", src, dtype), host, dtype, name, kind="device"
        )
        result = arrays.new_like(x, (shard.size,), dtype)
        arrays.from_host(arrays.device_view(result), shard)
    return _finish(result)


def allgather(ctx: CommContext, x, dtype):
    shape = arrays.describe(x)[0] or (1,)
    row_elems = int(np.prod(shape[1:], dtype=np.int64))
    rows = arrays.input_view(x)
    if transport.cuda_aware():
        flat, nrows = allgather_flat(ctx, rows, shape[0], row_elems, dev, dtype, kind="device")
        result = arrays.new_like(x, (nrows,) + shape[1:], dtype)
        dev.copy(arrays.flat_view(result, "result"), flat)
    else:
        transport.note_staging()
        staged = _staged(ctx, "stage_in", rows, dtype)
        flat, nrows = allgather_flat(ctx, staged, shape[0], row_elems, host, dtype, kind="device")
        result = arrays.new_like(x, (nrows,) + shape[1:], dtype)
        arrays.from_host(arrays.flat_view(result, "result"), flat)
    return _finish(result)


def broadcast(ctx: CommContext, x, dtype, root: int):
    shape = arrays.describe(x)[0]
    src = arrays.input_view(x)
    result = arrays.new_like(x, shape, dtype)
    dst = arrays.flat_view(result, "result")
    if transport.cuda_aware():
        if ctx.rank == root:
            dev.copy(dst, src)
        broadcast_flat(ctx, dst, dev, dtype, root, kind="device")
    else:
        transport.note_staging()
        staged = _staged(ctx, "stage_in", src, dtype)
        broadcast_flat(ctx, staged, host, dtype, root, kind="device")
        arrays.from_host(dst, staged)
    return _finish(result)
