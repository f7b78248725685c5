"""Every algorithm choice, and what every kind of array shares once its arguments are checked.

choose() decides what can be decided before the ranks talk (the latency path or a bandwidth
algorithm); settle_auto() decides "auto" after the agreement, from the topology, alike on every rank.
Then the agreement before a bandwidth algorithm, and each collective on flat contiguous buffers given
the ops for their memory. (The settings that "auto" depends on are folded into the
signature by runtime/signature.py, so ranks configured differently fail the agreement.)"""

import numpy as np
from mpi4py import MPI

from ..runtime import stall, timeline
from ..runtime.config import config, latency_path_limit
from ..runtime.context import TAG_ALLTOALL, CommContext
from ..runtime.signature import CODE_MEMORY, signature
from . import hierarchical, ring
from .recursive_doubling import agreed, allreduce_with_agreement, reduce_in_slots, wants_agreement

USER_ALGORITHMS = ("auto", "ring", "recursive_doubling", "hierarchical")  # what algorithm= takes


def latency_path_bytes(ranks: int) -> int:
    """The largest message "auto" sends by recursive doubling on a communicator of `ranks`."""
    return latency_path_limit(ranks, config.small_message_bytes)


def agree(ctx: CommContext, sig: tuple) -> None:
    """Header-only agreement before a bandwidth algorithm (with validation off, only until the ranks
    have agreed that none validates: recursive_doubling.wants_agreement)."""
    if wants_agreement(ctx):
        with timeline.span("agreement"):
            allreduce_with_agreement(ctx, sig, config.small_message_bytes)
        agreed(ctx)


def _predivided(ctx: CommContext, src, ops, name: str):
    """(src, op) to reduce: for a "mean" of 2-byte floats (float16, bfloat16), a copy of src already
    divided by the world size, summed. Summing first would overflow where the mean fits (two ranks of
    40000 in float16: inf, where 40000 is right); the 2-byte wire codecs divide first for the same
    reason (gflow/arrays/codecs.py). The copy is scratch, so a failed call changes no array of the
    caller's."""
    if name != "mean" or src.dtype.itemsize != 2 or ctx.size == 1:
        return src, name
    divided = ctx.scratch("mean_predivided", src.size, src.dtype, ops)
    ops.copy(divided, src)
    ops.divide(divided, ctx.size)
    ops.fence()
    return divided, "sum"


def allreduce_flat(
    ctx: CommContext, src, dst, *, ops, sig: tuple, chosen: str, name: str, staging=None
) -> None:
    """Allreduce the flat contiguous src into dst (may be src), after the checks have passed.

    staging: for device buffers MPI cannot read, the transport that stages them through the host
    (cuda/arrays.py's Staged). src and dst are then device views and ops the device ops: the ring
    stages the whole message, the hierarchical allreduce only what crosses nodes. (The latency path
    stages before it is called: its agreement rides with the payload.)"""
    src, name = _predivided(ctx, src, ops, name)
    if ctx.size == 1:
        if dst is not src:
            ops.copy(dst, src)
    elif chosen == "recursive_doubling":
        with timeline.span("recursive doubling", bytes=dst.nbytes) if timeline.active() else timeline.OFF:
            allreduce_with_agreement(
                ctx, sig, latency_path_bytes(ctx.size), src, dst, "sum" if name == "mean" else name
            )
        if name == "mean":
            ops.divide(dst, ctx.size)
    else:
        if _may_reduce_in_slots(ctx, ops, chosen, staging, dst.nbytes):
            with timeline.span("shared slots", bytes=dst.nbytes) if timeline.active() else timeline.OFF:
                done = reduce_in_slots(ctx, sig, src, dst, "sum" if name == "mean" else name)
            if done:
                if name == "mean":
                    ops.divide(dst, ctx.size)
                return
        else:
            agree(ctx, sig)
        # Ctrl-C or a signal handler's exit in the node phase's reduce or a copy leaves the call
        # unfinished (helper-59: the next call went on, and met the others' unfinished one: a hang).
        # Not the errors every rank raises alike before any message moves (a bad topology: helper-60).
        try:
            _bandwidth_allreduce(ctx, src, dst, ops, sig, chosen, name, staging)
        except (KeyboardInterrupt, SystemExit):
            stall.abandoned(stall.mark())
            raise


def _bandwidth_allreduce(
    ctx: CommContext, src, dst, ops, sig: tuple, chosen: str, name: str, staging
) -> None:
    """allreduce_flat's ring or hierarchical allreduce, once the ranks agreed on the call."""
    agreed = CODE_MEMORY[int(sig[6])]  # the arrays' memory, unlike the transport each rank picked
    if chosen == "auto":
        chosen = settle_auto(ctx, dst.nbytes, agreed)
    if chosen == "hierarchical":  # (the timeline shows which by the phases inside)
        hierarchical.allreduce(ctx, src, dst, ops, name, agreed, staging)
    elif staging is not None:
        host_src = staging.send(ctx, src)
        host_dst = staging.buffer_for(ctx, "stage_out", dst)
        ring.allreduce(ctx, host_src, host_dst, staging.ops, name)
        staging.store(dst, host_dst)
    else:
        ring.allreduce(ctx, src, dst, ops, name)


def _may_reduce_in_slots(ctx: CommContext, ops, chosen: str, staging, nbytes: int) -> bool:
    """Whether an "auto" allreduce of nbytes past the latency path may go through the slots of a
    context whose ranks share one host (recursive_doubling.reduce_in_slots decides, once they are
    set up): host buffers, three ranks or more, below where "auto" takes the node phase in a shared
    window. Measured against the ring there: bench/RESULTS.md, "Reduce-scatter and allgather in the
    slots"."""
    return (
        chosen == "auto"
        and staging is None
        and ops.memory == "host"
        and ctx.size > 2
        and nbytes < config.shared_memory_min_bytes
    )


def choose(algorithm: str, nbytes: int, ranks: int) -> str:
    """The algorithm for a message of nbytes on a communicator of `ranks`, as far as it can be told
    before the ranks talk: "auto" above latency_path_bytes stays "auto" (ring or hierarchical,
    settled from the topology after the agreement). Alike on every rank, whatever its transport (the
    latency path of device memory goes through the host: see Transport.latency_path)."""
    if algorithm == "auto":
        chosen = "recursive_doubling" if nbytes <= latency_path_bytes(ranks) else "auto"
    elif algorithm in ("ring", "hierarchical"):
        chosen = algorithm
    elif algorithm == "recursive_doubling":
        check_recursive_doubling_size(nbytes, config.small_message_bytes)
        chosen = algorithm
    else:
        raise ValueError(f"algorithm: expected one of {USER_ALGORITHMS}, got {algorithm!r}")
    return chosen


def check_recursive_doubling_size(nbytes: int, small_message_bytes: int) -> None:
    """An explicit algorithm="recursive_doubling" takes messages up to small_message_bytes (also what
    the cost model refuses)."""
    if nbytes > small_message_bytes:
        raise ValueError(
            f"algorithm='recursive_doubling' takes at most config.small_message_bytes = "
            f"{small_message_bytes} bytes, got {nbytes}"
        )


def settle_auto(ctx: CommContext, nbytes: int, memory: str) -> str:
    """What algorithm="auto" runs for a bandwidth-sized message, once the ranks have agreed on the
    call: the topology (found now on first use, collectively), the agreed size and the arrays' memory
    decide, so every rank settles alike. Hierarchical where it pays: across nodes from
    config.hierarchical_min_bytes; on one node, its peer-memory node phase from
    config.shared_memory_min_bytes: for host arrays from three ranks (two ranks alone make one
    exchange each way in the ring, as fast or faster; bench/RESULTS.md, "Scale"), for device arrays
    from two (CUDA IPC keeps the bytes on the GPUs, where the ring stages them through the host)."""
    topo = hierarchical.topology(ctx)
    if len(topo.nodes) > 1:
        if topo.shards > 1 and nbytes >= config.hierarchical_min_bytes:
            return "hierarchical"
    elif topo.shared_memory and ctx.size > (1 if memory == "device" else 2):
        if nbytes >= config.shared_memory_min_bytes:
            return "hierarchical"
    return "ring"


def reduce_scatter_flat(
    ctx: CommContext, src, *, ops, dtype, name: str, memory: str, rows=None, fingerprint: int = 0
):
    """This rank's shard of the reduction of the flat contiguous src, as a new flat array: chunk
    `rank` of np.array_split's layout over the elements, or, with rows=nrows, over the rows. The
    ranks agree on `fingerprint` (the caller's checksum of the shape)."""
    agree(ctx, signature("reduce_scatter", "ring", src.size, dtype, name, extra=fingerprint, memory=memory))
    src, name = _predivided(ctx, src, ops, name)
    if rows is None:
        bounds = ring.chunk_bounds(src.size, ctx.size)
    else:
        row_elems = src.size // rows if rows else 0
        bounds = [b * row_elems for b in ring.chunk_bounds(rows, ctx.size)]
    work = ops.empty(src.size, dtype)
    ring.reduce_scatter(ctx, src, work, ops, "sum" if name == "mean" else name, bounds)
    shard = ops.empty(bounds[ctx.rank + 1] - bounds[ctx.rank], dtype)
    ops.copy(shard, work[bounds[ctx.rank] : bounds[ctx.rank + 1]])
    if name == "mean":
        ops.divide(shard, ctx.size)
    return shard


def alltoall_flat(
    ctx: CommContext, rows, splits, *, row_elems: int, ops, dtype, memory: str, fingerprint: int = 0
):
    """Send rows splits[0] of the flat `rows` to rank 0, the next splits[1] to rank 1, ...; return the
    flat concatenation of what every rank sent this one, in rank order, and how many rows came from
    each. The ranks agree on row_elems and `fingerprint` (the caller's checksum of a row's shape);
    the counts travel first, then each pair's rows in messages of at most ring.MAX_MESSAGE_BYTES."""
    agree(ctx, signature("alltoall", "mpi", row_elems, dtype, None, extra=fingerprint, memory=memory))
    sent = np.asarray(splits, np.int64)
    received = np.empty_like(sent)
    if ctx.size > 1:
        ctx.waitall([ctx.comm.Ialltoall(sent, received)])
    else:
        received[:] = sent
    send_at = np.concatenate(([0], np.cumsum(sent))) * row_elems
    recv_at = np.concatenate(([0], np.cumsum(received))) * row_elems
    result = ops.empty(int(recv_at[-1]), dtype)
    r, step, buffer, comm = ctx.rank, ring.piece_elems(dtype), ops.buffer, ctx.comm
    ops.copy(result[recv_at[r] : recv_at[r + 1]], rows[send_at[r] : send_at[r + 1]])
    ops.fence()
    requests = []
    for peer in range(ctx.size):  # (every pair's messages on one tag arrive in order: piece j in piece j)
        if peer == r:
            continue
        recv, send = result[recv_at[peer] : recv_at[peer + 1]], rows[send_at[peer] : send_at[peer + 1]]
        requests += [
            comm.Irecv([buffer(recv[lo : lo + step]), MPI.BYTE], peer, TAG_ALLTOALL)
            for lo in range(0, recv.size, step)
        ]
        requests += [
            comm.Isend([buffer(send[lo : lo + step]), MPI.BYTE], peer, TAG_ALLTOALL)
            for lo in range(0, send.size, step)
        ]
    if requests:
        ctx.waitall(requests)
    return result, received


def allgather_flat(
    ctx: CommContext, rows, *, nrows: int, row_elems: int, ops, dtype, memory: str, fingerprint: int = 0
):
    """Concatenate the ranks' flat `rows` (nrows rows of row_elems elements each, nrows may differ
    between ranks); returns the flat result and the total number of rows. The ranks agree on
    row_elems and on `fingerprint` (the caller's checksum of the row's shape)."""
    agree(ctx, signature("allgather", "ring", row_elems, dtype, None, extra=fingerprint, memory=memory))
    lengths = ctx.comm.allgather(nrows) if ctx.size > 1 else [nrows]
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length * row_elems)
    result = ops.empty(bounds[-1], dtype)
    ops.copy(result[bounds[ctx.rank] : bounds[ctx.rank + 1]], rows)
    ops.fence()
    ring.allgather(ctx, result, ops, bounds)
    return result, sum(lengths)


def broadcast_flat(
    ctx: CommContext, buf, *, ops, dtype, root: int, memory: str, fingerprint: int = 0
) -> None:
    """Overwrite the flat buf with root's, on every rank: one Bcast per piece of at most
    ring.MAX_MESSAGE_BYTES (the ranks agreed on buf's size, so they cut the same pieces). The ranks
    also agree on the root and on `fingerprint` (the caller's checksum of the shape, < 2**31): both
    travel in the signature's extra field, the root in its low 32 bits (see runtime/signature.describe)."""
    extra = root | (fingerprint << 32)
    agree(ctx, signature("broadcast", "mpi", buf.size, dtype, None, extra=extra, memory=memory))
    if ctx.size > 1:
        ops.fence()
        step = ring.piece_elems(dtype)
        for lo in range(0, buf.size, step):
            ctx.waitall([ctx.comm.Ibcast([ops.buffer(buf[lo : lo + step]), MPI.BYTE], root)])
