"""Ring reduce-scatter, ring allgather, and the ring allreduce made of the two.

The flat buffer of N elements is cut into p chunks as np.array_split cuts it (the first N % p chunks
one element longer); chunk c's bounds are bounds[c]:bounds[c+1]. Each rank talks only to its
neighbours: it sends to right = r+1 and receives from left = r-1 (mod p).

Reduce-scatter, steps i = 0 .. p-2: rank r sends chunk (r-i-1) mod p and receives chunk (r-i-2) mod p,
which it reduces into its own copy (received partial first, then its own). After p-1 steps rank r holds
chunk r fully reduced. Each chunk is reduced in one fixed order along the ring, by one rank at a time,
so the result does not depend on who looks at it.

Allgather, steps i = 0 .. p-2: rank r sends chunk (r-i) mod p and receives chunk (r-i-1) mod p straight
into place. After p-1 steps every rank holds every chunk: copies of the reduced ones, bitwise equal.

Message sizes: no message exceeds MAX_MESSAGE_BYTES. Reduce-scatter moves segments of
config.ring_segment_bytes; an allgather step whose chunks fit in MAX_MESSAGE_BYTES is one message each way,
and longer chunks go in pieces of at most that size, all posted at once (nonblocking) and waited for
together; messages between one pair on one tag do not overtake each other, so piece j lands in piece j.

Traffic: each phase sends (p-1)/p * N elements per rank, so the allreduce sends 2(p-1)/p * N, the
lower bound for any allreduce (baidu-allreduce, Patarasuk & Yuan 2009); the price is 2(p-1) message
latencies, which is why small messages take recursive doubling instead.
"""

import numpy as np
from mpi4py import MPI

from ..runtime import timeline
from ..runtime.config import config
from ..runtime.context import TAG_RING_AG, TAG_RING_RS, CommContext
from . import native

# MPI-3 libraries (Open MPI 4, say) count in C ints: a single message of 2**31 bytes or more may fail.
MAX_MESSAGE_BYTES = 2**30
_DIVIDED_IN_LOOP = (np.dtype(np.float32), np.dtype(np.float64))  # (means native.allreduce divides)


def chunk_bounds(n: int, p: int) -> list[int]:
    """Offsets of the p chunks of n elements (np.array_split's layout): chunk c is [b[c], b[c+1])."""
    base, extra = divmod(n, p)
    bounds = [0]
    for c in range(p):
        bounds.append(bounds[-1] + base + (1 if c < extra else 0))
    return bounds


def segment_elems(widest: int, itemsize: int) -> int:
    """Elements per reduce-scatter segment: config.ring_segment_bytes' worth, within one message and
    within the widest chunk."""
    return max(1, min(widest, config.ring_segment_bytes // itemsize, MAX_MESSAGE_BYTES // itemsize))


def piece_elems(dtype) -> int:
    """Elements of dtype per message: as many whole elements as fit in MAX_MESSAGE_BYTES."""
    return max(1, MAX_MESSAGE_BYTES // np.dtype(dtype).itemsize)


def reduce_scatter(ctx: CommContext, src, buf, ops, op: str, bounds: list[int]) -> None:
    """Ring reduce-scatter of the flat `src` into `buf`: afterwards chunk `rank` of buf is fully reduced.

    src is only read, and may be buf itself. No copy of src into buf is needed first: the one chunk a
    rank sends untouched (step 0) goes straight from src, and every chunk it receives is combined
    with src's chunk into buf; chunks of buf other than its own are scratch afterwards.
    """
    p, r = ctx.size, ctx.rank
    if p == 1:
        if buf is not src:
            ops.copy(buf, src)
        return
    widest = max([bounds[c + 1] - bounds[c] for c in range(p)])
    if widest == 0:  # nothing to reduce (an empty array): no exchange on any rank
        return
    seg = segment_elems(widest, buf.dtype.itemsize)
    scratch = ctx.scratch("ring_tmp", 2 * seg, buf.dtype, ops)
    if native.usable(ops) and not timeline.active():  # (a timeline shows each wait: the Python loop)
        native.reduce_scatter(ctx, src, buf, scratch, bounds, seg, widest, op)
        return
    landing = (scratch[:seg], scratch[seg:])  # segment j lands in landing[j % 2]
    right, left = (r + 1) % p, (r - 1) % p
    comm, buffer, waitall = ctx.comm, ops.buffer, ctx.waitall

    def start(send_base, dst_base, lo, j):
        incoming = landing[j % 2][: dst_base[lo : lo + seg].size]
        requests = [
            comm.Irecv([buffer(incoming), MPI.BYTE], left, TAG_RING_RS),
            comm.Isend([buffer(send_base[lo : lo + seg]), MPI.BYTE], right, TAG_RING_RS),
        ]
        return requests, incoming

    for i in range(p - 1):
        s = (r - i - 1) % p
        c = (r - i - 2) % p
        send_base = (src if i == 0 else buf)[bounds[s] : bounds[s + 1]]
        dst_base = buf[bounds[c] : bounds[c + 1]]
        own_base = src[bounds[c] : bounds[c + 1]]
        # Segments pipeline the step: segment j+1 is on its way while segment j is reduced, so the link
        # is not idle during the reduction, and what was just received is still in cache. Every rank
        # makes the same number of exchanges per step (set by the widest chunk), so sends and receives
        # pair up even where neighbouring chunks differ in length.
        starts = range(0, widest, seg)
        pending = start(send_base, dst_base, 0, 0)
        for j, lo in enumerate(starts):
            requests, incoming = pending
            waitall(requests)
            if lo + seg < widest:
                pending = start(send_base, dst_base, lo + seg, j + 1)
            ops.reduce(dst_base[lo : lo + seg], incoming, own_base[lo : lo + seg], op)
            ops.fence()  # the next step sends what was just reduced


def allgather(ctx: CommContext, buf, ops, bounds: list[int]) -> None:
    """Ring allgather in place: chunk `rank` of `buf` is this rank's; afterwards buf holds all chunks."""
    p, r = ctx.size, ctx.rank
    right, left = (r + 1) % p, (r - 1) % p
    sendrecv, buffer, step = ctx.sendrecv, ops.buffer, piece_elems(buf.dtype)
    if p > 1 and native.usable(ops) and not timeline.active():
        if max(bounds[c + 1] - bounds[c] for c in range(p)) <= step:
            native.allgather(ctx, buf, bounds)
            return
    for i in range(p - 1):
        s = (r - i) % p
        c = (r - i - 1) % p
        send, recv = buf[bounds[s] : bounds[s + 1]], buf[bounds[c] : bounds[c + 1]]
        if send.size <= step and recv.size <= step:
            sendrecv(
                [buffer(send), MPI.BYTE], right, TAG_RING_AG, [buffer(recv), MPI.BYTE], left, TAG_RING_AG
            )
            continue
        # Either branch sends a chunk as ceil(size / step) messages, and an empty one as one empty
        # message, so the neighbours' messages pair up whichever branch each of them takes.
        comm = ctx.comm
        requests = [
            comm.Irecv([buffer(recv[lo : lo + step]), MPI.BYTE], left, TAG_RING_AG)
            for lo in range(0, max(recv.size, 1), step)
        ]
        requests += [
            comm.Isend([buffer(send[lo : lo + step]), MPI.BYTE], right, TAG_RING_AG)
            for lo in range(0, max(send.size, 1), step)
        ]
        ctx.waitall(requests)


def allreduce(ctx: CommContext, src, buf, ops, op: str) -> None:
    """Ring allreduce of the flat `src` into the flat `buf` (may be src). op: sum, mean, max or min."""
    bounds = chunk_bounds(buf.size, ctx.size)
    if ctx.size > 1 and native.usable(ops) and not timeline.active():
        # Both phases in one compiled call, where each phase alone would run compiled too: the same
        # messages, and the fixed cost of one visit from Python instead of two.
        itemsize = buf.dtype.itemsize
        widest = bounds[1]  # (chunk 0 is the longest: chunk_bounds)
        if 0 < widest <= MAX_MESSAGE_BYTES // itemsize and (op != "mean" or buf.dtype in _DIVIDED_IN_LOOP):
            seg = segment_elems(widest, itemsize)
            landing = ctx.scratch("ring_tmp", 2 * seg, buf.dtype, ops)
            native.allreduce(ctx, src, buf, landing, bounds, seg, widest, op)
            return
    with timeline.span("reduce-scatter", bytes=buf.nbytes, ranks=ctx.size):
        reduce_scatter(ctx, src, buf, ops, "sum" if op == "mean" else op, bounds)
    if op == "mean":
        ops.divide(buf[bounds[ctx.rank] : bounds[ctx.rank + 1]], ctx.size)
        ops.fence()
    with timeline.span("allgather", bytes=buf.nbytes, ranks=ctx.size):
        allgather(ctx, buf, ops, bounds)
