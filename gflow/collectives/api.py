"""The public collectives: argument checks, algorithm choice, and the call into the algorithms."""

import numpy as np
from mpi4py import MPI

from .._array import check_array, flat_view, prepare_out
from .._config import config
from .._context import CommContext, context
from .._validate import check_op, check_root, rejected_signature, signature
from ..errors import MismatchError
from . import ring
from .recursive_doubling import allreduce_with_agreement

ALGORITHMS = ("auto", "ring", "recursive_doubling")


def _reject(ctx: CommContext, collective: str) -> None:
    """This rank's arguments failed its local checks: tell the peers (when validating), so they raise
    MismatchError instead of waiting for this rank forever. The caller then raises the local error."""
    if config.validate and ctx.size > 1:
        try:
            allreduce_with_agreement(ctx, rejected_signature(collective), config.small_message_bytes)
        except MismatchError:
            pass


def _agree(ctx: CommContext, sig: tuple) -> None:
    """Header-only agreement before a bandwidth algorithm (skipped when validation is off)."""
    if config.validate and ctx.size > 1:
        allreduce_with_agreement(ctx, sig, config.small_message_bytes)


def _flat_source(x, flat_buf, ops):
    """x as a flat array MPI can send from: x itself when contiguous, else copied into flat_buf
    (which the ring may then reduce in place)."""
    if x.flags.c_contiguous:
        return x.reshape(-1)
    ops.copy(flat_buf.reshape(x.shape), x)
    return flat_buf


def _choose(algorithm: str, nbytes: int) -> str:
    if algorithm == "auto":
        return "recursive_doubling" if nbytes <= config.small_message_bytes else "ring"
    if algorithm == "ring":
        return algorithm
    if algorithm == "recursive_doubling":
        if nbytes > config.small_message_bytes:
            raise ValueError(
                f"algorithm='recursive_doubling' takes at most config.small_message_bytes = "
                f"{config.small_message_bytes} bytes, got {nbytes}"
            )
        return algorithm
    raise ValueError(f"algorithm: expected one of {ALGORITHMS}, got {algorithm!r}")


def allreduce(x, op="sum", *, comm=None, out=None, algorithm="auto"):
    """Reduce x elementwise over all ranks; every rank gets the same result.

    Args:
        x: a NumPy array (any shape, reduced as flat) of float16/32/64 or int32/64. Not modified
            unless `out` is x.
        op: "sum", "mean" (floating dtypes only), "max", "min", or MPI.SUM/MAX/MIN.
        comm: an mpi4py intracommunicator; gflow talks on its own cached duplicate. Default COMM_WORLD.
        out: where to write the result (same dtype and size as x, C-contiguous); may be x itself.
        algorithm: "auto" (recursive doubling up to config.small_message_bytes, ring above),
            "ring", or "recursive_doubling" (only up to config.small_message_bytes).

    Returns:
        An array of x's shape and dtype holding the reduction, bitwise identical on every rank.

    Raises:
        TypeError, ValueError: bad arguments on this rank, before any data moves.
        MismatchError: ranks passed different lengths, dtypes, ops or algorithms; raised on every rank.
    """
    ctx = context(comm)
    try:
        ops, dtype = check_array(x)
        name = check_op(op, dtype)
        chosen = _choose(algorithm, x.size * dtype.itemsize)
        result = prepare_out(x, out, ops, dtype, x.size)
    except (TypeError, ValueError):
        _reject(ctx, "allreduce")
        raise
    sig = signature("allreduce", chosen, x.size, dtype, name)
    flat_out = result.reshape(-1)

    if ctx.size == 1:
        if result is not x:
            ops.copy(result, x)
    elif chosen == "recursive_doubling":
        reduce_op = "sum" if name == "mean" else name
        allreduce_with_agreement(ctx, sig, config.small_message_bytes, x.reshape(-1), flat_out, reduce_op)
        if name == "mean":
            ops.divide(flat_out, ctx.size)
    else:
        _agree(ctx, sig)
        ring.allreduce(ctx, _flat_source(x, flat_out, ops), flat_out, ops, name)
    return result


def reduce_scatter(x, op="sum", *, comm=None):
    """Reduce x over all ranks and return only this rank's shard of the flat result.

    The shard layout is np.array_split's: rank r gets np.array_split(result.ravel(), size)[r], so the
    first (x.size % size) ranks hold one element more.

    Args:
        x: a NumPy array (any shape, reduced as flat); not modified.
        op: as for allreduce.
        comm: as for allreduce.

    Returns:
        A new 1-D array: this rank's shard of the reduction.

    Raises:
        TypeError, ValueError, MismatchError: as for allreduce.
    """
    ctx = context(comm)
    try:
        ops, dtype = check_array(x)
        name = check_op(op, dtype)
    except (TypeError, ValueError):
        _reject(ctx, "reduce_scatter")
        raise
    _agree(ctx, signature("reduce_scatter", "ring", x.size, dtype, name))
    bounds = ring.chunk_bounds(x.size, ctx.size)
    work = ops.empty(x.size, dtype)
    ring.reduce_scatter(ctx, _flat_source(x, work, ops), work, ops, "sum" if name == "mean" else name, bounds)
    shard = ops.empty(bounds[ctx.rank + 1] - bounds[ctx.rank], dtype)
    ops.copy(shard, work[bounds[ctx.rank] : bounds[ctx.rank + 1]])
    if name == "mean":
        ops.divide(shard, ctx.size)
    return shard


def allgather(x, *, comm=None):
    """Concatenate every rank's x along the first axis, in rank order (Horovod's allgather).

    Ranks may pass different first-axis lengths (as reduce_scatter's shards have); the other axes and
    the dtype must agree. A 0-d array counts as one element.

    Args:
        x: a NumPy array; not modified.
        comm: as for allreduce.

    Returns:
        A new array of shape (sum of the ranks' first-axis lengths, *x.shape[1:]).

    Raises:
        TypeError, ValueError, MismatchError: as for allreduce.
    """
    ctx = context(comm)
    try:
        ops, dtype = check_array(x)
    except (TypeError, ValueError):
        _reject(ctx, "allgather")
        raise
    rows = x.reshape(-1) if x.ndim == 0 else x
    row_elems = int(np.prod(rows.shape[1:], dtype=np.int64))
    _agree(ctx, signature("allgather", "ring", 0, dtype, None, extra=row_elems))
    lengths = ctx.comm.allgather(rows.shape[0]) if ctx.size > 1 else [rows.shape[0]]
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length * row_elems)
    result = ops.empty(bounds[-1], dtype)
    ops.copy(result[bounds[ctx.rank] : bounds[ctx.rank + 1]], rows.reshape(-1))
    ring.allgather(ctx, result, bounds)
    return result.reshape((sum(lengths),) + rows.shape[1:])


def broadcast(x, root=0, *, comm=None):
    """Return a copy of root's x on every rank.

    Args:
        x: a NumPy array; every rank passes one of the same size and dtype (non-root contents are
            ignored). Not modified.
        root: the rank whose data is sent.
        comm: as for allreduce.

    Returns:
        A new array of x's shape holding root's values.

    Raises:
        TypeError, ValueError, MismatchError: as for allreduce.
    """
    ctx = context(comm)
    try:
        ops, dtype = check_array(x)
        root_rank = check_root(root, ctx.size)
    except (TypeError, ValueError):
        _reject(ctx, "broadcast")
        raise
    _agree(ctx, signature("broadcast", "mpi", x.size, dtype, None, extra=root_rank))
    result = ops.empty(x.size, dtype).reshape(x.shape)
    if ctx.rank == root_rank:
        ops.copy(result, x)
    if ctx.size > 1:
        ctx.comm.Bcast([flat_view(result, "result"), MPI.BYTE], root_rank)
    return result
