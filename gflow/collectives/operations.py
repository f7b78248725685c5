"""The public allreduce (blocking, async, Adasum): argument checks, algorithm choice, and the call into
the algorithms; the other public collectives are in collectives/exchange.py.

Each public function checks its arguments, which gives it the kind of array it holds (gflow/arrays/kinds.py),
then works on flat views of the kind's memory: the kind's transport hands them to MPI (directly, or
staged through pinned host memory for device arrays without a CUDA-aware MPI) and gives the ops for
the memory MPI sees; the *_flat functions of collectives/dispatch.py do the rest. Results are made by
the kind, so they are of the caller's kind (a tensor for a tensor, CuPy for CuPy).
"""

import sys

import numpy as np

from ..arrays.codecs import decode, encode, overflow_message, wire_dtype
from ..arrays.kinds import check_array, kind_of
from ..errors import CompressionOverflowError, MismatchError
from ..runtime import engine, timeline
from ..runtime.config import config
from ..runtime.context import CommContext, context
from ..runtime.signature import PASSED_BYTES, Words, rejected_signature, signature
from . import latency, recursive_doubling
from .adasum import adasum, check_adasum
from .checks import check_allreduce, shape_fingerprint
from .dispatch import (
    agree,
    allreduce_flat,
)
from .recursive_doubling import allreduce_with_agreement

_USER_CALL = ("allreduce", 0)  # a user's call: the ranks agree on x's shape (allreduce_on)


def reject(ctx: CommContext, collective: str, error: BaseException | None = None) -> None:
    """This rank's arguments failed its local checks: tell the peers (when validating), so they raise
    MismatchError instead of waiting for this rank forever, with this rank's error (`error`, or the one
    being handled) in its first line. The caller then raises the local error. Every exception the
    local checks raise takes this path, not only TypeError and ValueError."""
    if recursive_doubling.wants_agreement(ctx) and ctx.failed is None and ctx.ended is None:
        error = error or sys.exc_info()[1]
        try:
            with recursive_doubling.passing(None if error is None else Words(_first_line, error)):
                allreduce_with_agreement(ctx, rejected_signature(collective), config.small_message_bytes)
        except MismatchError as exc:
            if ctx.is_background:  # as the peers' engines mark theirs (see CommContext.check_usable)
                ctx.failed = f"{collective} (rejected arguments): {exc}"


def _first_line(error: BaseException) -> str:
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - the rank raises its own error all the same
        text = ""
    return f"{type(error).__name__}: {(text or '-').splitlines()[0]}"


def allreduce(x, op="sum", *, comm=None, out=None, algorithm="auto", compression=None):
    """Reduce x elementwise over all ranks; every rank gets the same result.

    Args:
        x: a NumPy array, or a device array (CuPy, Numba, anything with __cuda_array_interface__;
            C-contiguous), or a torch tensor, any shape (reduced as flat), of float16/32/64,
            bfloat16 (ml_dtypes.bfloat16 in NumPy, torch.bfloat16) or int32/64. Not modified unless
            `out` is x.
        op: "sum", "mean" (floating dtypes only), "max", "min", or MPI.SUM/MAX/MIN; or "adasum"
            (floating dtypes, a power-of-two number of ranks; see collectives/adasum.py).
        comm: an mpi4py intracommunicator; gflow talks on its own cached duplicate. Default COMM_WORLD.
        out: where to write the result (same kind, dtype and size as x, C-contiguous); may be x.
        algorithm: "auto" (recursive doubling up to config.small_message_bytes, 16x that on two
            ranks, where it is one exchange as the ring's is; above, the
            hierarchical allreduce where the topology makes it pay (see gflow.config), else the
            ring), "ring", "hierarchical" (node phase, cross-node ring per shard, node phase; see
            collectives/hierarchical.py), or "recursive_doubling" (only up to
            config.small_message_bytes).
        compression: None, "fp16" to send float16 on the wire, or "bf16" to send bfloat16
            (floating dtypes; the result comes back in x's dtype). See gflow/arrays/codecs.py.

    Returns:
        An array of x's shape and dtype holding the reduction, bitwise identical on every rank.

    Raises:
        TypeError, ValueError: bad arguments on this rank, before any data moves.
        MismatchError: ranks passed different shapes, lengths, dtypes, ops or algorithms; raised on
            every rank.
        CompressionOverflowError: with compression, the 2-byte reduction overflowed or met NaN/inf
            (on every rank; the result holds the non-finite values).
    """
    ctx = context(comm)
    if op.__class__ is str and op == ADASUM:
        return adasum_on(ctx, x, out=out, algorithm=algorithm, compression=compression)
    if x.__class__ is np.ndarray and op.__class__ is str and compression is None:
        result = latency.allreduce(ctx, x, op, out, algorithm)  # (None: not one for the fast lane)
        if result is not None:
            return result
    return allreduce_on(ctx, x, op, out=out, algorithm=algorithm, compression=compression)


def rejected_in_background(parent: CommContext, collective: str, error: Exception, kind=None):
    """The Handle of a background collective whose arguments failed this rank's checks: its rejection
    runs on the engine in this rank's order, where it meets the peers' collective of the same
    position (theirs then fail with MismatchError), and wait() raises `error`. Reporting it through
    the handle rather than at once keeps every rank's program on the same path: each waits on the
    handle of that call and resets the background channel there, whatever it had queued behind it.
    `kind`: engine.STEP_REJECTION for a training step's (engine.running); else the engine's own."""
    ctx = parent.for_async(collective)

    def run():
        reject(ctx, collective, error)
        raise error

    return engine.submit(
        f"{collective} (rejected arguments)", run, ctx=ctx, on_failure=parent.reset_background, kind=kind
    )


def allreduce_async(x, op="sum", *, comm=None, out=None, algorithm="auto", compression=None):
    """Start an allreduce on gflow's background thread and return at once.

    Arguments as for allreduce; they are checked now, in the caller's thread. Every rank must start
    its async collectives in the same order. Do not modify x (or read out) until the handle is done.
    A communicator's first call makes gflow's communicators there, an async one too: it returns
    once every rank has made its first call on it (docs/cluster.md).
    gflow.config is read when the operation runs, on the background thread: change a setting only
    while no async collective is in flight (else ranks may read it on either side of the change, and
    the call raises MismatchError on every rank).
    Bad arguments are reported by the handle: on this rank wait() raises the TypeError/ValueError,
    on its peers MismatchError (see rejected_in_background for why not at once).

    Returns:
        A Handle: done() tells whether it has finished, wait() returns the result (out, or a new
        array) or raises what the operation raised (MismatchError, CompressionOverflowError, ...).
        After a GflowError other than NonFiniteError (an inf/NaN, settled alike everywhere), async
        collectives already queued fail too (on every rank alike); wait on the failed handle on
        every rank before starting new ones.
    """
    return allreduce_async_on(context(comm), x, op, out=out, algorithm=algorithm, compression=compression)


def allreduce_async_on(parent: CommContext, x, op, *, out=None, algorithm="auto", compression=None,
                       tag=_USER_CALL, about=None):  # fmt: skip
    """allreduce_async on a given context; `tag` and `about` as for allreduce_on (gflow.torch's: what
    the ranks agree on in place of x's shape, and how this rank's call reads in a MismatchError)."""
    try:
        if op.__class__ is str and op == ADASUM:
            (kind, dtype), name = check_array(x), ADASUM
        else:
            kind, dtype, name = check_allreduce(
                x, op, out, algorithm, compression, ranks=parent.size, need_out=False
            )[:3]
    except Exception as exc:
        return rejected_in_background(parent, "allreduce", exc)
    # (the call in words only where a stall line needs them: not formatted on every call)
    ctx = parent.for_async(
        "allreduce", lambda: f"allreduce of {kind.size(x)} {dtype.name} ({kind.memory} array), op={name}"
    )
    run = lambda: allreduce_on(  # noqa: E731
        ctx, x, op, out=out, algorithm=algorithm, compression=compression, tag=tag, about=about
    )
    run = kind.in_background(run, x, *([] if out is None else [out]))
    return engine.submit("allreduce", run, keep=(x, out), ctx=ctx, on_failure=parent.reset_background)


def background_on(parent: CommContext, collective: str, call, *arrays):
    """Run call(ctx) on gflow's background thread, on parent's background context, after the async
    collectives this rank started before (every rank starts them in the same order); `arrays` are
    kept alive, and read after the work that produced them (device arrays). Returns the Handle. The
    arguments must have been checked: a rank that refuses its own calls rejected_in_background."""
    ctx = parent.for_async(collective)
    run = kind_of(arrays[0]).in_background(lambda: call(ctx), *arrays)
    return engine.submit(collective, run, keep=arrays, ctx=ctx, on_failure=parent.reset_background)


def annotated(call, about):
    """call(), its MismatchError naming what this rank passed (when `about` says)."""
    if about is None:
        return call()
    try:
        with recursive_doubling.passing(about):  # (shared with the peers after a mismatch)
            return call()
    except MismatchError as exc:
        words = str(about)
        words = words if len(words) <= PASSED_BYTES else words[: PASSED_BYTES - 3] + "..."
        raise MismatchError(f"{exc}.\nThis rank passed {words}") from exc


def allreduce_on(
    ctx: CommContext,
    x,
    op,
    *,
    out=None,
    algorithm="auto",
    compression=None,
    tag=_USER_CALL,
    about=None,
    holds=None,
):
    """allreduce on a given context (the caller's, or the engine's for allreduce_async). `tag` is the
    (collective, extra) pair the ranks agree on: LazyAllreduce puts its push-order fingerprint there,
    gflow.torch a fingerprint of the tensors' shapes, op and factors; a user's call (the default) a
    fingerprint of x's shape. `about`, when given, names this rank's call in a MismatchError.
    `holds`: see check_allreduce (gflow's own buffers only)."""
    ctx.check_usable()
    if op.__class__ is str and op == ADASUM:
        fingerprint = None if tag is _USER_CALL else tag[1]
        kw = dict(out=out, algorithm=algorithm, compression=compression, fingerprint=fingerprint, about=about)
        return adasum_on(ctx, x, **kw)
    try:
        kind, dtype, name, chosen, codec, result = check_allreduce(
            x, op, out, algorithm, compression, ranks=ctx.size, holds=holds
        )
    except Exception:
        reject(ctx, "allreduce")
        raise
    if tag is _USER_CALL:
        shape = tuple(kind.shape(x))
        tag = ("allreduce", shape_fingerprint(shape, dtype, codec))
        about = about or f"an array of shape {shape}" + (
            f" of {dtype.name}, compression={codec!r}" if codec else ""
        )
    run = lambda: _allreduce_checked(  # noqa: E731
        ctx, x, kind=kind, dtype=dtype, name=name, chosen=chosen, codec=codec, result=result,
        algorithm=algorithm, tag=tag,
    )  # fmt: skip
    if not timeline.active():  # (the span's arguments cost more than the span)
        return run() if about is None else annotated(run, about)
    count = int(np.prod(kind.shape(x), dtype=np.int64))
    with timeline.span(
        "allreduce", bytes=count * dtype.itemsize, dtype=dtype.name, op=name, algorithm=algorithm,
        compression=codec or None,
    ):  # fmt: skip
        return run() if about is None else annotated(run, about)


def _allreduce_checked(ctx: CommContext, x, *, kind, dtype, name, chosen, codec, result, algorithm, tag):
    if codec:
        return _allreduce_compressed(
            ctx, x, kind=kind, result=result, name=name, algorithm=algorithm, tag=tag, codec=codec
        )
    transport = kind.transport()
    if chosen == "recursive_doubling":
        transport = transport.latency_path
    dst_view = kind.write_view(result, "out")
    src_view = kind.read(x, "x", spare=dst_view)
    sig = signature(tag[0], chosen, src_view.size, dtype, name, extra=tag[1], memory=kind.memory)
    if transport.name == "staged" and chosen != "recursive_doubling":  # (see allreduce_flat)
        allreduce_flat(
            ctx, src_view, dst_view, ops=kind.ops, sig=sig, chosen=chosen, name=name, staging=transport
        )
        return kind.done(result)
    src = transport.send(ctx, src_view)
    dst = transport.buffer_for(ctx, "stage_out", dst_view)
    allreduce_flat(ctx, src, dst, ops=transport.ops, sig=sig, chosen=chosen, name=name)
    transport.store(dst_view, dst)
    return kind.done(result)


def _allreduce_compressed(ctx: CommContext, x, *, kind, result, name: str, algorithm: str, tag, codec: str):
    """Encode to the 2-byte wire type (dividing first for a mean), allreduce that buffer in place,
    decode. The wire buffer is of x's memory, so its own allreduce takes x's transport."""
    ops = kind.ops
    src, dst = kind.read(x), kind.write_view(result, "out")
    wire = ctx.scratch(f"{codec}_wire", src.size, wire_dtype(codec), ops)
    encode(ops, wire, src, name, ctx.size)
    wire_op = "sum" if name == "mean" else name
    allreduce_on(ctx, wire, wire_op, out=wire, algorithm=algorithm, tag=tag, holds=wire_dtype(codec))
    overflow = decode(ops, dst, wire)
    kind.done(result)
    if overflow:
        raise CompressionOverflowError(overflow_message("allreduce", codec))
    return result


ADASUM = "adasum"


def adasum_on(ctx: CommContext, x, *, out=None, algorithm="auto", compression=None, sizes=None,
              fingerprint=None, about=None):  # fmt: skip
    """allreduce(op="adasum") on a given context: the ranks agree on the size, dtype and `fingerprint`
    (by default a checksum of x's shape); `sizes` splits the flat array into tensors combined each on
    its own (default: one). The arithmetic runs on the host in float64 (collectives/adasum.py)."""
    try:
        kind, dtype = check_array(x)
        check_adasum(ctx.size, dtype)
        if compression is not None or algorithm != "auto":
            raise ValueError(
                f"op='adasum' takes neither compression nor an algorithm, got compression={compression!r}, "
                f"algorithm={algorithm!r}"
            )
        count = kind.size(x)
        sizes = [count] if sizes is None else [int(n) for n in sizes]
        if sum(sizes) != count or min(sizes, default=0) < 0:
            raise ValueError(
                f"adasum: sizes must be counts summing to the array's {count} elements, got {sizes}"
            )
        result = kind.prepare_out(x, out, dtype, count)
    except Exception:
        reject(ctx, "allreduce")
        raise
    if fingerprint is None:
        shape = tuple(kind.shape(x))
        fingerprint, about = shape_fingerprint(shape), f"an array of shape {shape}"
    sig = signature("allreduce", "adasum", count, dtype, None, extra=fingerprint, memory=kind.memory)
    transport = kind.transport().latency_path  # (the host: device arrays are staged)
    work = np.array(transport.send(ctx, kind.read(x)), dtype=np.float64)
    annotated(lambda: agree(ctx, sig), about)
    with timeline.span("adasum", bytes=count * dtype.itemsize) if timeline.active() else timeline.OFF:
        adasum(ctx, work, sizes)
    dst_view = kind.write_view(result, "out")
    buffer = transport.buffer_for(ctx, "stage_out", dst_view)
    with np.errstate(over="ignore"):  # (a result past the dtype's range is inf, as a sum's: fp_errors.py)
        buffer[...] = work.astype(buffer.dtype)
    transport.store(dst_view, buffer)
    return kind.done(result)
