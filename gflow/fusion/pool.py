"""The gradient pool: one flat array that LazyAllreduce.gradient_buffers() carves gradients out of
(DDP's gradient_as_bucket_view), so backward writes them where the segments read them: no copy in.

The arrays sit side by side in push order, so any run of them that a segment fuses is one piece of
the pool, whatever the threshold (it changes while threshold "auto" tunes). Where the hierarchical
allreduce's node phase would run, the pool lives in the node's MPI shared-memory window, and the
node phase reads each rank's gradients where backward wrote them (collectives/hierarchical.py).
"""

import itertools
import math
import os
import struct
import warnings
import zlib

import numpy as np

from ..collectives import hierarchical
from ..collectives.operations import annotated, rejected_in_background
from ..collectives.recursive_doubling import agreed, allreduce_with_agreement, wants_agreement
from ..runtime import engine
from ..runtime.config import config
from ..runtime.context import context
from ..runtime.signature import Words, check_dtype, check_op, signature

_SHAPES = [struct.Struct(f"<{n}q") for n in range(8)]


def shape_bytes(shape) -> bytes:
    """A shape as bytes, for the checksums ranks agree on."""
    n = len(shape)
    return (_SHAPES[n] if n < len(_SHAPES) else struct.Struct(f"<{n}q")).pack(*shape)


def _check_shape(shape) -> tuple:
    """A gradient_buffers() shape as a tuple of non-negative ints, or TypeError/ValueError."""
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"gradient_buffers: a shape must be a tuple of ints, got {shape!r}") from None
    if not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0 for n in dims):
        raise ValueError(f"gradient_buffers: a shape must be a tuple of non-negative ints, got {shape!r}")
    return tuple(int(n) for n in dims)


def check_shapes(shapes, dtype: np.dtype) -> list:
    """gradient_buffers()' shapes as tuples, if this machine can hold them; else TypeError/ValueError."""
    shapes = [_check_shape(shape) for shape in shapes]
    total = sum(math.prod(shape) for shape in shapes) * dtype.itemsize
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if total > machine:
        raise ValueError(
            f"gradient_buffers: the shapes hold {total} bytes of {dtype.name}, more than this "
            f"machine's memory ({machine} bytes)"
        )
    return shapes


def pool_memory(parent, shapes, dtype: np.dtype, memory: str = "host"):
    """Zeroed bytes of `memory` ("host" or "device") for a pool of `shapes` (64-byte aligned size):
    in the node's peer memory when that helps (agreed by every rank of `parent`, the caller's
    CommContext, on its background channel, in order with the segments), else private memory.
    parent None: one rank alone."""
    count = sum(math.prod(shape) for shape in shapes)
    nbytes = -(-count * dtype.itemsize // 64) * 64
    if parent is None:
        return _private(nbytes, memory)
    ctx = parent.for_async("gradient_buffers")
    layout = b"".join(shape_bytes(shape) for shape in shapes) + struct.pack("<q", len(shapes))
    sig = signature("gradient_buffers", "mpi", count, dtype, None, extra=zlib.crc32(layout), memory=memory)

    def allocate():
        ctx.check_usable()
        if wants_agreement(ctx):  # (a MismatchError names the shapes: helper-54 got "the extra field")
            agree = lambda: allreduce_with_agreement(ctx, sig, config.small_message_bytes)  # noqa: E731
            annotated(agree, Words(_shapes_in_words, shapes))
            agreed(ctx)
        return hierarchical.shared_pool(ctx, nbytes, memory)

    handle = engine.submit("gradient_buffers", allocate, ctx=ctx, on_failure=parent.reset_background)
    pool, why_not = handle.wait()
    if why_not:
        warnings.warn(
            f"gflow: LazyAllreduce.gradient_buffers: the gradient pool stays in private memory (the "
            f"hierarchical allreduce's node phase then copies it in): {why_not}",
            RuntimeWarning,
            stacklevel=3,
        )
    return _private(nbytes, memory) if pool is None else pool


def _shapes_in_words(shapes) -> str:
    """What a rank asked gradient_buffers() for, in fields the mismatch message compares one by one."""
    return ", ".join(f"an array of shape {tuple(shape)} (buffer {i})" for i, shape in enumerate(shapes))


def _private(nbytes: int, memory: str):
    if memory == "host":
        return np.zeros(nbytes, np.uint8)
    from ..cuda import ops

    return ops.zeros(nbytes, np.uint8)


class GradientPool:
    """The arrays gradient_buffers() handed out, and where each sits in the pool."""

    def __init__(self):
        self.flat = None  # the pool, in the gradients' dtype
        self.arrays: list = []  # the arrays handed out
        self.offsets: list = []  # where each starts in the pool (elements), and where the last ends
        self.index: dict = {}  # id(array handed out) -> its position
        self.reduce_in_place = False  # gradient_buffers(reduce_in_place=True): no copy back

    def carve(self, memory, shapes, dtype: np.dtype, reduce_in_place: bool) -> list:
        """Make `memory` the pool and hand out one array per shape (a new list of them)."""
        sizes = [math.prod(shape) for shape in shapes]
        count = sum(sizes)
        self.reduce_in_place = bool(reduce_in_place)
        self.flat = memory.view(dtype)[:count]
        self.offsets = [0, *itertools.accumulate(sizes)]
        self.arrays = [
            _shaped(self.flat, start, size, shape)
            for start, size, shape in zip(self.offsets, sizes, shapes, strict=False)
        ]
        self.index = {id(a): i for i, a in enumerate(self.arrays)}
        return list(self.arrays)

    def run(self, pushed):
        """The piece of the pool holding `pushed` when they are consecutive arrays handed out, in
        order (then they already sit side by side, whatever the threshold); else None."""
        start = self.index.get(id(pushed[0]))
        if start is None:
            return None
        end = start + len(pushed)
        if end > len(self.arrays) or any(
            a is not b for a, b in zip(pushed, self.arrays[start:end], strict=True)
        ):
            return None
        return self.flat[self.offsets[start] : self.offsets[end]]


def _shaped(flat, start: int, size: int, shape):
    """flat[start : start + size] as `shape`. (An empty device array is a new one: Numba can neither
    slice nor reshape into one.)"""
    if size == 0 and not isinstance(flat, np.ndarray):
        from numba import cuda

        return cuda.device_array(shape, flat.dtype)
    return flat[start : start + size].reshape(shape)


class PooledGradients:
    """LazyAllreduce.gradient_buffers() (a mixin of LazyAllreduce, lazy.py; self._pool is its
    GradientPool)."""

    def gradient_buffers(
        self, shapes, dtype=np.float32, *, reduce_in_place: bool = False, private=False, memory: str = "host"
    ) -> list:
        """Arrays for gradients, carved out of the fusion pool (DDP's gradient_as_bucket_view): host
        arrays, or with memory="device" Numba device arrays (wrap them with cupy.asarray or
        torch.as_tensor: no copy), not of bfloat16 (Numba has no such type).

        Give the shapes in the order the gradients will be pushed. Writing each gradient into its
        array and pushing that array costs no copy into the pool; flush() copies the results back
        into it once the whole step has succeeded. With reduce_in_place=True (dense segments only)
        the pool is reduced in place instead, saving that copy (one pass over the gradients; 30% of
        a ResNet-50 step at p = 4 here, bench/RESULTS.md), at a price: after a failed step the
        arrays may hold reduced values, so recompute the gradients before retrying. Not with dense
        compression (the pool would hold the 2-byte type, so pushing casts anyway); sparse segments
        keep full precision, so they may.

        Collective: every rank calls it, with the same shapes, dtype and memory (a rank whose
        arguments fail its checks raises its error, the others MismatchError). Where the hierarchical
        allreduce's node phase would run (nodes of several ranks with shared memory; on one node,
        three ranks or more, or two for device pools), the pool is allocated in the node's peer
        memory (an MPI shared-memory window; device memory exported through CUDA IPC), so that the
        node phase reads each rank's gradients where backward wrote them (collectives/hierarchical.py).
        It reads the communicator's topology (GFLOW_RANKS_PER_NODE) if no allreduce has yet. Each
        call allocates a new pool, kept until the process ends; past
        hierarchical.MAX_SHARED_POOLS of them, or without room in /dev/shm, the pool is in private
        memory (with a warning) and the node phase copies it in.

        Called while this rank has a step in flight, it abandons that step (as a failed one: the
        pushed arrays keep their values) and raises RuntimeError; the other ranks' call raises
        MismatchError. After a flush() interrupted in its wait (Ctrl-C), it first finishes that step,
        which the other ranks finished.

        private=True: the pool is in this rank's private memory, and the call is not collective (for
        a caller that may rebuild its pool on one rank alone; the node phase copies it in).
        """
        if self.flush_interrupted:
            self.flush()
        if self._in_step():
            self.fail_step(RuntimeError("gradient_buffers: a step was in flight (pushed, not flushed)"))
            self.flush()  # raises, once the step's segments are done: this rank starts clean
        try:
            if self.compression and not self.sparse:
                raise ValueError(
                    f"gradient_buffers: the pool would be 2-byte with compression={self.compression!r}; push "
                    "ordinary arrays"
                )
            if reduce_in_place and self.sparse:
                raise ValueError(
                    "gradient_buffers: reduce_in_place applies to dense segments, not sparse ones"
                )
            dtype = check_dtype(np.dtype(dtype))
            check_op(self.op, dtype)
            if memory not in ("host", "device"):
                raise ValueError(f"gradient_buffers: memory must be 'host' or 'device', got {memory!r}")
            if memory == "device" and dtype.kind == "V":
                raise ValueError(
                    "gradient_buffers: no bfloat16 device pool (Numba arrays cannot hold bfloat16); push "
                    "bfloat16 CUDA tensors, or take a float32 pool"
                )
            shapes = check_shapes(shapes, dtype)
        except Exception as exc:
            if not (self._alone() or private):  # the peers are about to allocate with this rank
                rejected_in_background(context(self._comm), "gradient_buffers", exc).wait()  # raises exc
            raise
        parent = None if self._alone() or private else context(self._comm)
        return self._pool.carve(pool_memory(parent, shapes, dtype, memory), shapes, dtype, reduce_in_place)
