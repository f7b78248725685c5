"""The public collectives besides allreduce: reduce_scatter, alltoall, allgather and broadcast.

Each checks its arguments as allreduce does (collectives/operations.py), tells the peers when they
fail (reject), then hands flat views of the kind's memory to its *_flat function in
collectives/dispatch.py; the result is made by the kind, so it is of the caller's kind.
"""

import numpy as np

from ..arrays.kinds import check_array
from ..runtime.context import CommContext, context
from ..runtime.signature import Words, check_op, check_root
from .checks import shape_fingerprint
from .dispatch import allgather_flat, alltoall_flat, broadcast_flat, reduce_scatter_flat
from .operations import annotated, reject


def reduce_scatter(x, op="sum", *, comm=None, rows=False):
    """Reduce x over all ranks and return only this rank's shard of the result.

    The shard layout is np.array_split's: rank r gets np.array_split(result.ravel(), size)[r], so the
    first (x.size % size) ranks hold one element more. With rows=True, x's first axis is split
    instead (Horovod's reducescatter): rank r gets np.array_split(result, size)[r], of shape
    (its rows, *x.shape[1:]), and the ranks must pass the same shape.

    Args:
        x: a NumPy or device array (any shape; at least one axis with rows=True); not modified.
        op: as for allreduce.
        comm: as for allreduce.
        rows: split the first axis (True) or the flat elements (False, the default).

    Returns:
        A new array: this rank's shard of the reduction (1-D, or x's trailing axes with rows=True).

    Raises:
        TypeError, ValueError, MismatchError: as for allreduce.
    """
    return reduce_scatter_on(context(comm), x, op, rows=rows)


def reduce_scatter_on(ctx: CommContext, x, op, *, rows=False, fingerprint=None, about=None):
    """reduce_scatter on a given context. With rows=True the ranks agree on `fingerprint`: by default
    a checksum of x's shape (gflow.torch's: of the tensor's shape, dtype, op and factors); `about`
    names this rank's call in a MismatchError."""
    try:
        kind, dtype = check_array(x)
        name = check_op(op, dtype)
        shape = tuple(kind.shape(x))
        if rows and not shape:
            raise ValueError("reduce_scatter(rows=True): x must have at least one axis, got a 0-d array")
    except Exception:
        reject(ctx, "reduce_scatter")
        raise
    if fingerprint is None:  # ((2, 3) against (3, 2) fails, as in allreduce; rows= apart from either)
        fingerprint = shape_fingerprint(shape if rows else (*shape, -1))
    if about is None:  # (words made only for a MismatchError)
        about = Words("an array of shape {}, rows={}".format, shape, bool(rows))
    transport = kind.transport()
    src = transport.send(ctx, kind.read(x))
    shard = annotated(
        lambda: reduce_scatter_flat(
            ctx, src, ops=transport.ops, dtype=dtype, name=name, memory=kind.memory,
            rows=shape[0] if rows else None, fingerprint=fingerprint,
        ),
        about,
    )  # fmt: skip
    if not rows:
        return kind.done(transport.result(kind, x, shard, (shard.size,), dtype))
    nrows = ring_rows(shape[0], ctx.size, ctx.rank)
    return kind.done(transport.result(kind, x, shard, (nrows, *shape[1:]), dtype))


def ring_rows(nrows: int, size: int, rank: int) -> int:
    """How many of nrows rows np.array_split gives `rank` of `size`."""
    return nrows // size + (1 if rank < nrows % size else 0)


def alltoall(x, splits=None, *, comm=None):
    """Send a slice of x's first axis to every rank and receive one from every rank (MPI_Alltoallv).

    Rank r sends its rows [sum(splits[:d]), sum(splits[:d+1])) to rank d, and receives from every rank
    the rows that rank addressed to it, concatenated in rank order (Horovod's alltoall). The other
    axes and the dtype must agree; the splits may differ between ranks.

    Args:
        x: a NumPy or device array with at least one axis; not modified.
        splits: None (x.shape[0] must then divide evenly by the number of ranks), or one
            non-negative row count per rank, summing to x.shape[0].
        comm: as for allreduce.

    Returns:
        (received, received_splits): a new array of x's kind, of shape (rows received, *x.shape[1:]),
        and a NumPy int64 array of the rows received from each rank.

    Raises:
        TypeError, ValueError, MismatchError: as for allreduce.
    """
    return alltoall_on(context(comm), x, splits)


def alltoall_on(ctx: CommContext, x, splits, *, fingerprint=None, about=None):
    """alltoall on a given context (`fingerprint` and `about` as for allgather_on)."""
    try:
        kind, dtype = check_array(x)
        shape = tuple(kind.shape(x))
        counts = check_splits(splits, shape, ctx.size)
    except Exception:
        reject(ctx, "alltoall")
        raise
    if fingerprint is None:
        fingerprint, about = shape_fingerprint(shape[1:]), f"an array of shape {shape}"
    row_elems = int(np.prod(shape[1:], dtype=np.int64))
    transport = kind.transport()
    rows = transport.send(ctx, kind.read(x))
    flat, received = annotated(
        lambda: alltoall_flat(
            ctx,
            rows,
            counts,
            row_elems=row_elems,
            ops=transport.ops,
            dtype=dtype,
            memory=kind.memory,
            fingerprint=fingerprint,
        ),  # fmt: skip
        about,
    )
    result = transport.result(kind, x, flat, (int(received.sum()), *shape[1:]), dtype)
    return kind.done(result), received


def check_splits(splits, shape: tuple, size: int) -> np.ndarray:
    """alltoall's splits as one int64 row count per rank, or TypeError/ValueError saying what is wrong."""
    if not shape:
        raise ValueError("alltoall: x must have at least one axis, got a 0-d array")
    if splits is None:
        if shape[0] % size:
            raise ValueError(
                f"alltoall: without splits, x's first axis ({shape[0]}) must divide evenly by the "
                f"number of ranks ({size}); pass splits= to send unequal slices"
            )
        return np.full(size, shape[0] // size, np.int64)
    try:
        counts = np.asarray(splits)
    except Exception as exc:
        raise TypeError(f"alltoall: splits must be a sequence of ints, got {type(splits).__name__}") from exc
    if counts.ndim != 1 or (counts.size and counts.dtype.kind not in "iu"):
        raise TypeError(f"alltoall: splits must be a 1-D sequence of ints, got {splits!r}")
    if counts.size != size:
        raise ValueError(f"alltoall: splits must give one row count per rank ({size}), got {counts.size}")
    if (counts < 0).any():
        raise ValueError(f"alltoall: splits must not be negative, got {counts.tolist()}")
    if int(counts.sum()) != shape[0]:
        raise ValueError(
            f"alltoall: splits must sum to x's first axis ({shape[0]}), got {counts.tolist()} "
            f"(sum {int(counts.sum())})"
        )
    return counts.astype(np.int64)


def allgather(x, *, comm=None):
    """Concatenate every rank's x along the first axis, in rank order (Horovod's allgather).

    Ranks may pass different first-axis lengths (as reduce_scatter's shards have); the other axes and
    the dtype must agree. A 0-d array counts as one element.

    Args:
        x: a NumPy or device array; not modified.
        comm: as for allreduce.

    Returns:
        A new array of x's kind, of shape (sum of the ranks' first-axis lengths, *x.shape[1:]).

    Raises:
        TypeError, ValueError, MismatchError: as for allreduce.
    """
    return allgather_on(context(comm), x)


def allgather_on(ctx: CommContext, x, *, fingerprint=None, about=None):
    """allgather on a given context. The ranks agree on the row's length and on `fingerprint`: by
    default a checksum of x's axes after the first (gflow.torch's: of the tensor's own trailing axes
    and dtype, for dtypes it moves as int32 words); `about` names this rank's call in a MismatchError."""
    try:
        kind, dtype = check_array(x)
    except Exception:
        reject(ctx, "allgather")
        raise
    shape = tuple(kind.shape(x)) or (1,)
    if fingerprint is None:
        fingerprint, about = shape_fingerprint(shape[1:]), f"an array of shape {tuple(kind.shape(x))}"
    row_elems = int(np.prod(shape[1:], dtype=np.int64))
    transport = kind.transport()
    rows = transport.send(ctx, kind.read(x))
    flat, nrows = annotated(
        lambda: allgather_flat(
            ctx,
            rows,
            nrows=shape[0],
            row_elems=row_elems,
            ops=transport.ops,
            dtype=dtype,
            memory=kind.memory,
            fingerprint=fingerprint,
        ),  # fmt: skip
        about,
    )
    return kind.done(transport.result(kind, x, flat, (nrows,) + shape[1:], dtype))


def broadcast(x, root=0, *, comm=None, out=None):
    """Return root's x on every rank.

    Args:
        x: a NumPy, device array or tensor; every rank passes one of the same shape and dtype
            (non-root contents are ignored; another shape of the same size is a MismatchError, as
            Horovod's shape check). Not modified unless `out` is x.
        root: the rank whose data is sent.
        comm: as for allreduce.
        out: where to write the result (same kind, dtype and size as x, C-contiguous); may be x,
            which broadcasts in place (how a trainer makes every rank start from root's weights).

    Returns:
        `out`, or a new array of x's shape and kind, holding root's values.

    Raises:
        TypeError, ValueError, MismatchError: as for allreduce.
    """
    return broadcast_on(context(comm), x, root=root, out=out)


def broadcast_on(ctx: CommContext, x, *, root, out=None, fingerprint=None, about=None):
    """broadcast on a given context. The ranks agree on the size, dtype, root and `fingerprint`: by
    default a checksum of x's shape (gflow.torch's: of the tensor's own shape and dtype, for dtypes it
    moves as int32 words); `about` names this rank's call in a MismatchError."""
    try:
        kind, dtype = check_array(x)
        root_rank = check_root(root, ctx.size)
        result = kind.prepare_out(x, out, dtype, kind.size(x))
    except Exception:
        reject(ctx, "broadcast")
        raise
    if fingerprint is None:
        shape = tuple(kind.shape(x))
        fingerprint, about = shape_fingerprint(shape), f"an array of shape {shape}"
    transport = kind.transport()
    dst_view = kind.write_view(result, "out")
    buffer = transport.buffer_for(ctx, "stage_out", dst_view)
    if ctx.rank == root_rank:
        transport.load(buffer, kind.read(x, "x", spare=dst_view))
    annotated(
        lambda: broadcast_flat(
            ctx,
            buffer,
            ops=transport.ops,
            dtype=dtype,
            root=root_rank,
            memory=kind.memory,
            fingerprint=fingerprint,
        ),
        about,
    )
    transport.store(dst_view, buffer)
    return kind.done(result)
