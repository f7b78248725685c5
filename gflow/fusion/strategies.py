"""How a fused segment is reduced: LazyAllreduce's strategies, and the hook for a user's own.

Each segment of a step (the gradients fused until the threshold) goes through one strategy, in the
shape of PyTorch DDP's communication hooks (`hook(state, bucket) -> Future`): the strategy fills the
segment's buffer from the pushed arrays, starts its reduction and returns a completion handle, and
at flush() writes each result back. The built-in ones:

- Dense: gflow's allreduce of the segment as it is (ring, hierarchical or the latency path: "auto");
- Codec: fp16/bf16 on the wire: cast on the way in (divided first for a mean), back on the way out;
- Sparse: coarse-grained sparse communication (SparseAllreduce), one residual per segment.

A user's hook: `LazyAllreduce.register_hook(state, hook)` (or DataParallel's). For each segment,
`hook(state, segment)` runs on gflow's background thread, in segment order (so it overlaps backward,
as the built-in strategies do), and returns the reduced values: a flat array like segment.buffer,
which the hook owns (a copy of the gradients: reduce it in place if you like). It talks to the
other ranks through segment.allreduce and segment.allgather: gflow's collectives on the background
channel, whose agreement turns a rank that fails, leaves the step or runs another hook into an error
on every rank instead of a hang. `state` is whatever the hook keeps between steps; if it has
commit() and discard(), gflow calls commit() once the step succeeded on every rank (and DataParallel
applied it) and discard() when it failed or was skipped (each may come once per segment).
examples/topk_hook.py is one: top-k with error feedback.
"""

from dataclasses import dataclass, field

import numpy as np

from ..arrays.codecs import decode, encode, wire_dtype
from ..collectives.exchange import allgather_on
from ..collectives.operations import allreduce_on, reject
from ..errors import GflowError, NonFiniteError
from ..runtime import engine
from ..runtime.signature import holds, is_floating
from .sparse import SparseAllreduce


@dataclass
class Segment:
    """One fused segment of a step, as a strategy (or a user's hook) sees it.

    Attributes:
        index: which segment of the step (0, 1, ...): the same on every rank, step after step.
        buffer: the fused gradients, flat (a NumPy array; a Numba device array for device memory).
        op: the reduction ("sum", "mean", "max" or "min").
        shapes: the shapes of the arrays fused into it, in push order (buffer holds them side by side).
        rank, size: this rank and the number of ranks.
    """

    index: int
    buffer: object
    op: str
    shapes: list
    # for the strategies: the background channel, where the result goes, the push-order checksum the
    # ranks agree on, and the wire dtype
    context: object = field(default=None, repr=False)
    out: object = field(default=None, repr=False)
    checksum: int = field(default=0, repr=False)
    dtype: object = field(default=None, repr=False)
    about: object = field(default=None, repr=False)  # this rank's pushes so far, as signature.Words

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def size(self) -> int:
        return self.context.size

    def allreduce(self, x, op: str = "sum"):
        """gflow.allreduce of x over the segment's ranks, on the background channel (a new array)."""
        return allreduce_on(self.context, x, op)

    def allgather(self, x):
        """gflow.allgather of x over the segment's ranks, on the background channel (a new array)."""
        return allgather_on(self.context, x)


class Dense:
    """gflow's allreduce of each segment, in the gradients' own dtype."""

    uses_pool = True  # the gradient pool's pieces can be reduced where they are
    keeps_state = False  # nothing carried from step to step (see Sparse)

    def wire_dtype(self, dtype: np.dtype) -> np.dtype:
        """The dtype the segment's buffer holds (and the threshold counts in)."""
        return holds(dtype)

    def check_size(self, index: int, total: int, members: list) -> None:
        """Whether segment `index` may hold `total` elements this step, of `members` ((flat view,
        kind, the array pushed) each) (any: nothing is kept)."""

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
        run = lambda: allreduce_on(ctx, source, op, out=out, tag=tag, holds=dtype, about=segment.about)  # noqa: E731
        handle = engine.submit(f"gradient step segment {segment.index}", kind.in_background(run),
                               keep=(source, out), ctx=ctx, kind=engine.STEP)  # fmt: skip
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

    keeps_state = True  # residuals hold gradients across steps: DataParallel unscales them on the way in

    def __init__(self, op: str, compression, comm, settings: dict):
        self.op, self.compression, self.comm, self.settings = op, compression, comm, settings
        self.segments: dict = {}  # segment index -> its SparseAllreduce
        self.layouts: dict = {}  # segment index -> its arrays' (shape, dtype) when its residual began

    def check_size(self, index: int, total: int, members: list) -> None:
        """Each segment keeps its residual: every step must fuse the same arrays into it. The same
        number of elements is not enough: two tensors pushed the other way round took each other's
        residual, silently (helper-92)."""
        layout = tuple((tuple(pushed.shape), flat.dtype.name) for flat, _, pushed in members)
        csc = self.segments.get(index)
        if csc is None or csc.residual is None:
            self.layouts[index] = layout
            return
        if index not in self.layouts:  # (a residual loaded from a checkpoint, which keeps no layout)
            self.layouts[index] = layout
        if csc.residual.size != total or self.layouts[index] != layout:
            raise ValueError(
                f"LazyAllreduce(sparse=...): segment {index} holds {total} elements, {_in_words(layout)}, "
                f"in this step and {csc.residual.size}, {_in_words(self.layouts[index])}, in earlier "
                "ones; each sparse segment keeps its own residual, so every step must push the same "
                "tensors (shapes and dtypes) in the same order"
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
        handle = engine.submit(f"gradient step segment {segment.index}", kind.in_background(run),
                               keep=(source, out), ctx=ctx, kind=engine.STEP)  # fmt: skip
        return handle, csc

    def new_segment(self) -> SparseAllreduce:
        return SparseAllreduce(op=self.op, compression=self.compression, comm=self.comm, **self.settings)


class _HookState:
    """What flush() commits or discards for a hook: its state's commit()/discard(), if it has them."""

    def __init__(self, state):
        self.state = state

    def commit(self) -> None:
        getattr(self.state, "commit", _nothing)()

    def discard(self) -> None:
        getattr(self.state, "discard", _nothing)()


def _nothing() -> None:
    pass


class Hook(Dense):
    """A user's hook (see the module docstring), run on the background thread. A rank whose hook
    fails rejects the segment where the peers are (they raise MismatchError, it its own error); else
    one small allreduce on the background channel settles the segment alike on every rank: whether
    any rank's result holds inf/NaN (NonFiniteError everywhere: an overflow, under loss scaling). It
    carries the push-order checksum, as the built-in segments' agreement does."""

    uses_pool = False  # segment.buffer is the hook's to change: always a copy of the gradients
    keeps_state = True  # (DataParallel unscales on the way in, as for CSC)

    def __init__(self, state, hook):
        self.state, self.hook = state, hook

    def start(self, segment: Segment, kind):
        ctx, buffer, index = segment.context, segment.buffer, segment.index
        tag = ("lazy", segment.checksum)

        def run():
            ctx.check_usable()  # an earlier segment failed on every rank: this one must not start
            own = None  # the hook's own NonFiniteError (its check of its values, maybe on this rank only)
            try:
                result = checked(self.hook(self.state, segment), buffer)
                # cast_scaled by 1 changes nothing and says whether it met inf or NaN
                bad = is_floating(holds(result.dtype)) and kind.ops.cast_scaled(result, result, 1.0)
            except NonFiniteError as exc:  # settled with the peers below, so every rank raises one
                own, bad = exc, True
            except GflowError:
                raise  # a collective of the hook's failed on every rank alike
            except Exception:
                reject(ctx, "lazy")  # where the peers are (the settling allreduce, or a collective of
                raise  # their hook's), they fail with MismatchError; this rank raises its own error
            flag = np.array([1.0 if bad else 0.0])
            if allreduce_on(ctx, flag, "max", tag=tag, about="LazyAllreduce hook")[0]:
                raise own or NonFiniteError(
                    f"LazyAllreduce hook: segment {index} holds inf or NaN on some rank"
                )
            return result

        handle = engine.submit(f"gradient step hook segment {index}", kind.in_background(run),
                               keep=(buffer,), ctx=ctx, kind=engine.STEP)  # fmt: skip
        return handle, _HookState(self.state)


def checked(result, buffer):
    """A hook's result, flat, if it is an array like the segment's buffer; else TypeError."""
    size, dtype = getattr(result, "size", None), getattr(result, "dtype", None)
    if not isinstance(size, (int, np.integer)) or size != buffer.size or dtype != buffer.dtype:
        shown = f" of {size} {dtype}" if isinstance(size, (int, np.integer)) else ""
        raise TypeError(
            f"LazyAllreduce hook: expected the reduced segment as a flat array of {buffer.size} "
            f"{buffer.dtype} (like segment.buffer), got {type(result).__name__}{shown}"
        )
    return result.reshape(-1)


def _in_words(layout) -> str:
    """A segment's arrays as "shapes [(7, 9)] of float32" (a layout of (shape, dtype name) pairs)."""
    dtypes = sorted({name for _, name in layout})
    return f"shapes {[shape for shape, _ in layout]} of {'/'.join(dtypes)}"
