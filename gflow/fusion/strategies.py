"""How a fused segment is reduced: LazyAllreduce's strategies, and the hook for a user's own.

Each segment of a step (the gradients fused until the threshold) goes through one strategy, in the
shape of PyTorch DDP's communication hooks (`hook(state, bucket) -> Future`): the strategy fills the
segment's buffer from the pushed arrays, starts its reduction and returns a completion handle, and
at flush() writes each result back. The built-in ones:

- Dense: gflow's allreduce of the segment as it is (ring, hierarchical or the latency path: "auto");
- Codec: fp16/bf16 on the wire: cast on the way in (divided first for a mean), back on the way out;
- Sparse: coarse-grained sparse communication (SparseAllreduce), one residual per segment.

A user's hook: `LazyAllreduce.register_hook(state, hook)` (or DataParallel's). For each segment,
`hook(state, segment)` runs on the caller's thread when the segment fills and returns either the
reduced values (a flat array like segment.buffer) or anything with a `wait()` that gives them, such
as the handle of `gflow.allreduce_async(segment.buffer, comm=segment.comm)`. The hook owns
segment.buffer (a copy of the gradients: reduce it in place if you like); `state` is whatever the
hook keeps between steps (error feedback, say). examples/topk_hook.py is one: top-k with error
feedback. Every rank must call the same collectives in its hook; the step's final exchange still
checks that every rank pushed the same tensors.
"""

from dataclasses import dataclass, field

import numpy as np

from ..arrays.codecs import decode, encode, wire_dtype
from ..collectives.operations import allreduce_on
from ..runtime import engine
from ..runtime.signature import holds
from .sparse import SparseAllreduce


@dataclass
class Segment:
    """One fused segment of a step, as a strategy (or a user's hook) sees it.

    Attributes:
        index: which segment of the step (0, 1, ...): the same on every rank, step after step.
        buffer: the fused gradients, flat (host or device array, as pushed).
        op: the reduction ("sum", "mean", "max" or "min").
        comm: the communicator (None: MPI.COMM_WORLD).
        shapes: the shapes of the arrays fused into it, in push order (buffer holds them side by side).
    """

    index: int
    buffer: object
    op: str
    comm: object
    shapes: list
    # for the built-in strategies: the background channel, where the result goes, the push-order
    # checksum the ranks agree on, and the wire dtype
    context: object = field(default=None, repr=False)
    out: object = field(default=None, repr=False)
    checksum: int = field(default=0, repr=False)
    dtype: object = field(default=None, repr=False)


class Dense:
    """gflow's allreduce of each segment, in the gradients' own dtype."""

    uses_pool = True  # the gradient pool's pieces can be reduced where they are

    def wire_dtype(self, dtype: np.dtype) -> np.dtype:
        """The dtype the segment's buffer holds (and the threshold counts in)."""
        return holds(dtype)

    def fill(self, ops, piece, flat, op: str, size: int, scale: float) -> None:
        """Put one pushed array (times scale) into its piece of the segment's buffer (size: the
        number of ranks)."""
        if scale != 1.0:
            ops.cast_scaled(piece, flat, scale)
        else:
            ops.copy(piece, flat)

    def start(self, segment: Segment, kind):
        """Start the segment's reduction on the background thread; (handle, what to commit)."""
        ctx, source, out, dtype = segment.context, segment.buffer, segment.out, segment.dtype
        tag = ("lazy", segment.checksum)
        op = self.wire_op(segment.op)
        run = lambda: allreduce_on(ctx, source, op, out, "auto", None, tag, holds=dtype)  # noqa: E731
        handle = engine.submit(f"lazy allreduce segment {segment.index}", kind.in_background(run),
                               keep=(source, out), ctx=ctx)  # fmt: skip
        return handle, None

    def wire_op(self, op: str) -> str:
        """The reduction on the wire for `op`."""
        return op

    def finish(self, ops, flat, piece) -> bool:
        """Write one array's result back; True if it overflowed the wire type."""
        ops.copy(flat, piece)
        return False


class Codec(Dense):
    """fp16/bf16 on the wire (arrays/codecs.py): a mean is divided before the cast and summed, so
    no sum overflows where the mean fits; an overflow makes flush() raise on every rank."""

    uses_pool = False  # the pool holds the gradients' dtype, the wire the 2-byte one

    def __init__(self, codec: str):
        self.codec = codec

    def wire_dtype(self, dtype: np.dtype) -> np.dtype:
        return wire_dtype(self.codec)

    def fill(self, ops, piece, flat, op: str, size: int, scale: float) -> None:
        encode(ops, piece, flat, op, size, scale)

    def wire_op(self, op: str) -> str:
        return "sum" if op == "mean" else op  # (encode divided a mean already)

    def finish(self, ops, flat, piece) -> bool:
        return decode(ops, flat, piece)


class Sparse(Dense):
    """Coarse-grained sparse communication of each segment, in full precision on the way in (the
    residual keeps it): one SparseAllreduce per segment index, its residual kept from step to step
    and committed only when the whole step succeeded."""

    def __init__(self, op: str, compression, comm, settings: dict):
        self.op, self.compression, self.comm, self.settings = op, compression, comm, settings
        self.segments: dict = {}  # segment index -> its SparseAllreduce

    def check_size(self, index: int, total: int) -> None:
        """Each segment keeps its residual: every step must fuse the same elements into it."""
        csc = self.segments.get(index)
        if csc is not None and csc.residual is not None and csc.residual.size != total:
            raise ValueError(
                f"LazyAllreduce(sparse=...): segment {index} holds {total} elements in this step "
                f"and {csc.residual.size} in earlier ones; each sparse segment keeps its own "
                "residual, so every step must push the same tensors in the same order"
            )

    def start(self, segment: Segment, kind):
        csc = self.segments.get(segment.index)
        if csc is None:
            csc = self.segments[segment.index] = self.new_segment()
        ctx, source, out, checksum = segment.context, segment.buffer, segment.out, segment.checksum
        # The update goes into `out`, reused step after step (a new array each step cost a fresh
        # allocation and its page faults); it is the source itself unless the source is the
        # gradient pool, which must keep its values until the whole step has succeeded.
        run = lambda: csc.step_on(ctx, source, extra=checksum, out=out)  # noqa: E731
        handle = engine.submit(f"lazy allreduce segment {segment.index}", kind.in_background(run),
                               keep=(source, out), ctx=ctx)  # fmt: skip
        return handle, csc

    def new_segment(self) -> SparseAllreduce:
        return SparseAllreduce(op=self.op, compression=self.compression, comm=self.comm, **self.settings)


class _Done:
    """The handle of a hook that returned its result."""

    context = None

    def __init__(self, result):
        self._result = result

    def wait(self):
        return self._result


class Hook(Dense):
    """A user's hook (see the module docstring): the segment's buffer is always a copy of the
    gradients, so the hook may reduce it in place and a failed step still leaves them as pushed."""

    uses_pool = False

    def __init__(self, state, hook):
        self.state, self.hook = state, hook

    def start(self, segment: Segment, kind):
        """Run the hook. A result it returns is checked now, so a wrong one fails the step on every
        rank before anything is written; one behind a handle is checked when it arrives."""
        done = self.hook(self.state, segment)
        if callable(getattr(done, "wait", None)):
            return _Checked(done, segment.buffer), None
        return _Done(checked(done, segment.buffer)), None


def checked(result, buffer):
    """A hook's result, flat, if it is an array like the segment's buffer; else TypeError."""
    size = getattr(result, "size", None)
    if size != buffer.size or getattr(result, "dtype", None) != buffer.dtype:
        got = type(result).__name__ + (f" of {size} {result.dtype}" if size is not None else "")
        raise TypeError(
            f"LazyAllreduce hook: expected the reduced segment as a flat array of {buffer.size} "
            f"{buffer.dtype} (like segment.buffer), got {got}"
        )
    return result.reshape(-1)


class _Checked:
    """A hook's handle, whose result is checked when it arrives."""

    def __init__(self, done, buffer):
        self._done, self._buffer = done, buffer
        self.context = getattr(done, "context", None)

    def wait(self):
        return checked(self._done.wait(), self._buffer)
