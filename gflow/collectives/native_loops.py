"""The compiled ring phases of native.py (imported by it once the MPI entry points are registered).

Every integer a phase needs travels in one int64 array, `ints` (native.py's Phases: segment, widest
chunk, p, rank, op, half, comm, MPI_BYTE, tag, MPI_Request size, polls per visit (sleeping:
microseconds slept per visit), sleep in us, the allgather's tag and whether to divide by p between
the phases; then the state; then the chunk bounds), and the requests and statuses in one byte array,
`space`: a few arrays type faster than a dozen scalars, and the same way on every call. Each phase
is a resumable state machine: the state holds (step, segment, in flight, phase) so that a visit that
has polled POLLS_PER_VISIT times without progress can return _PENDING and the next visit goes on
from there. `allreduce` runs the two phases in one call (one visit from Python instead of two:
ring.allreduce's fixed cost). Handles and pointers travel as 64-bit integers (see native.py).

The file is long because every compiled loop lives here (the ring's phases, recursive doubling's
steps, the exchanges through the shared slots): they share the external functions declared at the
top, which resolve only once native.py has registered the library's entry points, so one module
imported at that moment holds them all."""

import numpy as np
from numba import njit, types
from numba.extending import intrinsic, overload

from ..arrays.half_kernels import _combine, _from_bf16, _from_half, _to_bf16, _to_half
from ..runtime.config import BACKGROUND_POLL_BACKOFF

_i32, _i64, _u32 = types.int32, types.int64, types.uint32
# int MPI_Irecv(void *buf, int count, MPI_Datatype, int source, int tag, MPI_Comm, MPI_Request *)
mpi_irecv = types.ExternalFunction("MPI_Irecv", _i32(_i64, _i32, _i64, _i32, _i32, _i64, _i64))
mpi_isend = types.ExternalFunction("MPI_Isend", _i32(_i64, _i32, _i64, _i32, _i32, _i64, _i64))
# int MPI_Testall(int count, MPI_Request requests[], int *flag, MPI_Status statuses[])
mpi_testall = types.ExternalFunction("MPI_Testall", _i32(_i32, _i64, _i64, _i64))
# int MPI_Startall(int count, MPI_Request requests[])
mpi_startall = types.ExternalFunction("MPI_Startall", _i32(_i32, _i64))
sched_yield = types.ExternalFunction("sched_yield", _i32())
usleep = types.ExternalFunction("usleep", _i32(_u32))
# void *memcpy(void *, const void *, size_t): a slice assignment checks for overlap and copies bytes
# one by one (2 MB took twice MPI's whole allreduce)
memcpy = types.ExternalFunction("memcpy", _i64(_i64, _i64, _i64))

_DONE, _PENDING, _ASK_PYTHON = 0, 1, 2


def reduce_into(out, low, high, op, half):
    """out = low op high, elementwise (see the overload)."""


@overload(reduce_into)
def _reduce_into(out, low, high, op, half):
    """uint16 buffers hold float16 (half == 1) or bfloat16 (half == 2) bits: combined in float32 and
    rounded once, as half_kernels.py does; every other dtype combines as it is (gflow reduces no
    uint16 of its own)."""
    if out.dtype == types.uint16:

        def reduce_halves(out, low, high, op, half):
            if half == 1:
                for k in range(out.size):
                    out[k] = _to_half(_combine(_from_half(low[k]), _from_half(high[k]), op))
            else:
                for k in range(out.size):
                    out[k] = _to_bf16(_combine(_from_bf16(low[k]), _from_bf16(high[k]), op))

        return reduce_halves

    def reduce_plain(out, low, high, op, half):
        for k in range(out.size):
            out[k] = _combine(low[k], high[k], op)

    return reduce_plain


def divide_by(x, d):
    """x /= d elementwise (see the overload)."""


@overload(divide_by)
def _divide_by(x, d):
    """Floating x: each element divided by d of its own dtype, in that dtype (NumPy's np.divide of
    float32 by float32 is float32, correctly rounded, as here). Other dtypes never take a mean here
    (ring.allreduce sends only float32 and float64), so nothing is compiled for them."""
    if isinstance(x.dtype, types.Float):

        def divide(x, d):
            for k in range(x.size):
                x[k] = x[k] / d

        return divide

    def nothing(x, d):
        pass

    return nothing


BACKOFF = BACKGROUND_POLL_BACKOFF  # a sleeping wait's pause doubles up to this many times sleep_us


@njit(inline="always")
def longest_pause(sleep_us, budget):
    """The longest pause of a sleeping wait: BACKOFF times the first, but not past the visit's budget
    (so a visit lasts at most budget plus one pause), unless the first pause alone is longer."""
    return min(sleep_us * BACKOFF, max(sleep_us, budget))


@njit(inline="always")
def _wait(space, flag, budget, sleep_us):
    """Poll the two requests at the start of space (their statuses after them)."""
    return _wait_on(2, space.ctypes.data, space.ctypes.data + 16, flag, budget, sleep_us)


@njit(inline="always")
def _wait_on(count, requests, statuses, flag, budget, sleep_us):
    """Poll `count` requests (at address `requests`): 0 done, _PENDING not yet, < 0 an MPI error.
    Yielding (sleep_us 0): up to budget polls. Sleeping: until budget microseconds were slept, the
    pause doubling from sleep_us to BACKOFF times it, so a wait that lasts (a slow link) wakes its
    core seldom while backward computes, and a short one (shared memory) is polled as often as before."""
    if sleep_us <= 0:
        for _ in range(budget):
            rc = mpi_testall(count, requests, flag.ctypes.data, statuses)
            if rc != 0:
                return -rc
            if flag[0] != 0:
                return 0
            sched_yield()
        return _PENDING
    pause, slept, longest = sleep_us, 0, longest_pause(sleep_us, budget)
    while True:
        rc = mpi_testall(count, requests, flag.ctypes.data, statuses)
        if rc != 0:
            return -rc
        if flag[0] != 0:
            return 0
        if slept >= budget:
            return _PENDING
        usleep(pause)
        slept += pause
        pause = min(pause * 2, longest)


@njit(inline="always")
def _exchange(recv, send, left, right, tag, comm, byte, space, size):
    """Post one receive of `recv` from left and one send of `send` to right (ring.py's Irecv, Isend
    order); the requests go to the start of `space`, `size` bytes each."""
    rc = mpi_irecv(recv.ctypes.data, recv.size * recv.itemsize, byte, left, tag, comm, space.ctypes.data)
    if rc != 0:
        return -rc
    rc = mpi_isend(
        send.ctypes.data, send.size * send.itemsize, byte, right, tag, comm, space.ctypes.data + size
    )
    return -rc


PARAMS, STATE = 14, 4  # (native.py reads these)


@njit(inline="always")
def _reduce_scatter_steps(src, buf, landing, ints, space, tag):
    """ring.reduce_scatter's loop: step i sends chunk (r-i-1) mod p and reduces chunk (r-i-2) mod p,
    in segments of seg elements, segment j+1 on the wire while segment j is reduced."""
    seg, widest, p, r, op, half = ints[0], ints[1], ints[2], ints[3], ints[4], ints[5]
    comm, byte, size, budget, sleep_us = ints[6], ints[7], ints[9], ints[10], ints[11]
    state, bounds = ints[PARAMS : PARAMS + STATE], ints[PARAMS + STATE :]
    right, left = (r + 1) % p, (r - 1) % p
    flag = np.zeros(1, np.int32)
    i, j, in_flight = state[0], state[1], state[2]
    while i < p - 1:
        s = (r - i - 1) % p
        c = (r - i - 2) % p
        send_base = src[bounds[s] : bounds[s + 1]] if i == 0 else buf[bounds[s] : bounds[s + 1]]
        dst_base = buf[bounds[c] : bounds[c + 1]]
        own_base = src[bounds[c] : bounds[c + 1]]
        lo = j * seg
        incoming = landing[(j % 2) * seg : (j % 2) * seg + dst_base[lo : lo + seg].size]
        if in_flight == 0:
            rc = _exchange(incoming, send_base[lo : lo + seg], left, right, tag, comm, byte, space, size)
            if rc != 0:
                return rc
            in_flight = 1
        rc = _wait(space, flag, budget, sleep_us)
        if rc != 0:
            state[0], state[1], state[2] = i, j, in_flight
            return rc
        in_flight = 0
        nxt = lo + seg
        if nxt < widest:  # the next segment goes on the wire before this one is reduced
            ahead = landing[((j + 1) % 2) * seg : ((j + 1) % 2) * seg + dst_base[nxt : nxt + seg].size]
            rc = _exchange(ahead, send_base[nxt : nxt + seg], left, right, tag, comm, byte, space, size)
            if rc != 0:
                return rc
            in_flight = 1
        reduce_into(dst_base[lo : lo + seg], incoming, own_base[lo : lo + seg], op, half)
        if nxt < widest:
            j += 1
        else:
            i, j = i + 1, 0
    state[0], state[1], state[2] = i, j, 0
    return _DONE


@njit(inline="always")
def _allgather_steps(buf, ints, space, tag):
    """ring.allgather's loop: step i sends chunk (r-i) mod p and receives chunk (r-i-1) mod p in place."""
    p, r = ints[2], ints[3]
    comm, byte, size, budget, sleep_us = ints[6], ints[7], ints[9], ints[10], ints[11]
    state, bounds = ints[PARAMS : PARAMS + STATE], ints[PARAMS + STATE :]
    right, left = (r + 1) % p, (r - 1) % p
    flag = np.zeros(1, np.int32)
    i, in_flight = state[0], state[2]
    while i < p - 1:
        s = (r - i) % p
        c = (r - i - 1) % p
        if in_flight == 0:
            send, recv = buf[bounds[s] : bounds[s + 1]], buf[bounds[c] : bounds[c + 1]]
            rc = _exchange(recv, send, left, right, tag, comm, byte, space, size)
            if rc != 0:
                return rc
            in_flight = 1
        rc = _wait(space, flag, budget, sleep_us)
        if rc != 0:
            state[0], state[2] = i, in_flight
            return rc
        in_flight = 0
        i += 1
    state[0], state[2] = i, 0
    return _DONE


@njit(nogil=True, cache=True)
def reduce_scatter(src, buf, landing, ints, space):
    """ring.reduce_scatter's steps (tag ints[8])."""
    return _reduce_scatter_steps(src, buf, landing, ints, space, ints[8])


@njit(nogil=True, cache=True)
def allgather(buf, ints, space):
    """ring.allgather's steps (tag ints[8])."""
    return _allgather_steps(buf, ints, space, ints[8])


@njit(nogil=True, cache=True)
def allreduce(src, buf, landing, divisor, ints, space):
    """ring.allreduce: the reduce-scatter (tag ints[8]); this rank's chunk divided by divisor[0] where
    ints[13] says so (op "mean": the same division in the same dtype as host_ops.divide); the
    allgather (tag ints[12]). state[3] says which phase a resumed visit is in."""
    state = ints[PARAMS : PARAMS + STATE]
    if state[3] == 0:
        rc = _reduce_scatter_steps(src, buf, landing, ints, space, ints[8])
        if rc != _DONE:
            return rc
        if ints[13] != 0:
            r, bounds = ints[3], ints[PARAMS + STATE :]
            divide_by(buf[bounds[r] : bounds[r + 1]], divisor[0])
        state[0], state[1], state[2], state[3] = 0, 0, 0, 1
    return _allgather_steps(buf, ints, space, ints[12])


# Recursive doubling's steps (recursive_doubling.py's schedule), for plans whose payload travels in
# the header's message. `ints`: the RD_PARAMS below, then the state (step, in flight); `steps`: one row
# per step (peer is lower, action, requests, receives); `space`: each step's two persistent requests
# (started by MPI_Startall), then room for two statuses.
RD_STEPS, RD_OP, RD_HALF, RD_BUDGET, RD_SLEEP, RD_REQUEST_SIZE = 0, 1, 2, 3, 4, 5
RD_SAME, RD_RANK_A, RD_RANK_B, RD_FOLLOWS, RD_HEADER, RD_LAST_INTO_DST, RD_STATUSES = 6, 7, 8, 9, 10, 11, 12
RD_PARAMS = 13
RD_COMBINE, RD_TAKE = 0, 1  # (any other action: the step only sends)


@njit(inline="always")
def _header_agrees(send, recv, ints):
    """The peer's header is this rank's (state and signature), with no rank in join() behind it and
    no payload sent apart: the only case handled here; anything else is recursive_doubling.py's."""
    for k in range(ints[RD_SAME]):
        if recv[k] != send[k]:
            return False
    for k in range(8):
        if recv[ints[RD_RANK_B] + k] != 0 or recv[ints[RD_FOLLOWS] + k] != 0:
            return False
    return True


@njit(nogil=True, cache=True)
def recursive_doubling(acc, incoming, dst, send, recv, ints, steps, space):
    """The steps of one recursive-doubling exchange from state[0] on, while every header received is
    this rank's own: start a step's persistent requests, wait, fold the peer's payload into acc (or
    dst, at the last step where the plan says so), lower rank's operand first. Returns _DONE, _PENDING
    (out of polls: call again), _ASK_PYTHON (step state[0]'s messages have arrived and its header is
    not this rank's: Python folds it and goes on) or -(an MPI error code) of step state[0]."""
    state = ints[RD_PARAMS:]
    op, half, size = ints[RD_OP], ints[RD_HALF], ints[RD_REQUEST_SIZE]
    budget, sleep_us = ints[RD_BUDGET], ints[RD_SLEEP]
    last = ints[RD_STEPS] - 1
    flag = np.zeros(1, np.int32)
    statuses = space.ctypes.data + ints[RD_STATUSES]
    i, in_flight = state[0], state[1]
    while i <= last:
        requests, count = space.ctypes.data + i * 2 * size, steps[i, 2]
        if in_flight == 0:
            rc = mpi_startall(count, requests)
            if rc != 0:
                state[0], state[1] = i, 0
                return -rc
            in_flight = 1
        rc = _wait_on(count, requests, statuses, flag, budget, sleep_us)
        if rc != 0:
            state[0], state[1] = i, in_flight if rc == _PENDING else 0
            return rc
        in_flight = 0
        if steps[i, 3] != 0:
            if not _header_agrees(send, recv, ints):
                state[0], state[1] = i, 0
                return _ASK_PYTHON
            lower, action = steps[i, 0] != 0, steps[i, 1]
            if action == RD_COMBINE:
                if lower:  # the lowest rank among those agreeing
                    for k in range(8):
                        send[ints[RD_RANK_A] + k] = recv[ints[RD_RANK_A] + k]
                out = dst if (i == last and ints[RD_LAST_INTO_DST] != 0) else acc
                if lower:
                    reduce_into(out, incoming, acc, op, half)
                else:
                    reduce_into(out, acc, incoming, op, half)
            elif action == RD_TAKE:  # the partner's verdict and result, as they are
                for k in range(ints[RD_HEADER]):
                    send[k] = recv[k]
        i += 1
    state[0], state[1] = i, 0
    return _DONE


# The ranks of one host exchange through shared memory (shared_slots.py's slots; recursive_doubling's
# _paired_step and _node_step). `slots`: the mapping as (ranks, 2 slots, stride) bytes, each slot
# [sequence number, length, ... | message from SLOT_DATA_AT]; `ints`: the SLOT_* words, then this
# rank's header as int64 words (its rank_a word at SLOT_RANK_A is not compared: each rank's holds
# its own rank). SLOT_SEQUENCE is the exchange a visit is in, SLOT_STAGE how far a resumed visit of
# slots_scatter_step has come.
SLOT_RANK, SLOT_SEQUENCE, SLOT_POST, SLOT_RANK_A, SLOT_OP, SLOT_HALF = 0, 1, 2, 3, 4, 5
SLOT_BUDGET, SLOT_SLEEP, SLOT_DATA_AT, SLOT_STAGE = 6, 7, 8, 9
SLOT_PARAMS = 10


@intrinsic
def _store_release(typingctx, words, value):
    """words[0] = value, after every store before it (the compiler keeps them first; x86-64 keeps
    stores in order in hardware: shared_slots.py's condition)."""

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        builder.store_atomic(args[1], array.data, "release", 8)
        return context.get_dummy_value()

    return types.void(words, types.int64), codegen


@intrinsic
def _load_acquire(typingctx, words):
    """words[0], read from memory every time (another process writes it) and before any load after it."""

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.load_atomic(array.data, "acquire", 8)

    return types.int64(words), codegen


@njit(inline="always")
def _wait_for(words, sequence, budget, sleep_us):
    """Poll words[0] for sequence as _wait_on polls requests: 0 there, _PENDING not yet."""
    if sleep_us <= 0:
        for _ in range(budget):
            if _load_acquire(words) == sequence:
                return 0
            sched_yield()
        return _PENDING
    pause, slept, longest = sleep_us, 0, longest_pause(sleep_us, budget)
    while _load_acquire(words) != sequence:
        if slept >= budget:
            return _PENDING
        usleep(pause)
        slept += pause
        pause = min(pause * 2, longest)
    return 0


@njit(inline="always")
def _all_posted(slots, sequence, ints):
    """Whether every other rank has posted its message of exchange `sequence`, polled as _wait_for
    polls, within the visit's budget."""
    rank, k, budget, sleep_us = ints[SLOT_RANK], sequence & 1, ints[SLOT_BUDGET], ints[SLOT_SLEEP]
    for r in range(slots.shape[0]):
        if r != rank and _wait_for(slots[r, k, :16].view(np.int64), sequence, budget, sleep_us) != 0:
            return False
    return True


@njit(inline="always")
def _slots_arrive(src, slots, ints):
    """Post this rank's [header | src] in its slot of exchange ints[SLOT_SEQUENCE] (unless
    ints[SLOT_POST] is 0: posted by an earlier visit) and wait for every other rank's: _DONE when
    all are there with this rank's header and length, _PENDING (not all there within the budget),
    _ASK_PYTHON (all there, not all of them this rank's header and length)."""
    rank, sequence, at = ints[SLOT_RANK], ints[SLOT_SEQUENCE], ints[SLOT_DATA_AT]
    header = ints[SLOT_PARAMS:].view(np.uint8)
    k, ranks = sequence & 1, slots.shape[0]
    mine = slots[rank, k]
    h = header.size
    n = h + src.size * src.itemsize
    if ints[SLOT_POST] != 0:
        memcpy(mine.ctypes.data + at, header.ctypes.data, h)
        memcpy(mine.ctypes.data + at + h, src.ctypes.data, n - h)
        words = mine[:16].view(np.int64)
        words[1] = n
        _store_release(words, sequence)
    if not _all_posted(slots, sequence, ints):
        return _PENDING
    rank_a = ints[SLOT_RANK_A]
    for r in range(ranks):
        if r == rank:
            continue
        theirs = slots[r, k]
        if theirs[:16].view(np.int64)[1] != n:
            return _ASK_PYTHON
        for b in range(h):
            if theirs[at + b] != header[b] and not rank_a <= b < rank_a + 8:
                return _ASK_PYTHON
    return _DONE


@njit(nogil=True, cache=True)
def slots_step(src, dst, slots, ints):
    """_slots_arrive, then, where every message is this rank's header and length, fold all payloads
    into dst in rank order from where they lie (so every rank computes the same bits; dst may be
    src). Returns _DONE, _PENDING (wait, then call again without posting) or _ASK_PYTHON (every
    message there, not all of them this rank's: recursive_doubling.py's)."""
    status = _slots_arrive(src, slots, ints)
    if status != _DONE:
        return status
    k, ranks, rank = ints[SLOT_SEQUENCE] & 1, slots.shape[0], ints[SLOT_RANK]
    at = ints[SLOT_DATA_AT] + (ints.size - SLOT_PARAMS) * 8
    n = at + src.size * src.itemsize
    op, half = ints[SLOT_OP], ints[SLOT_HALF]
    # The first fold reads this rank's own operand from src (the same bits as its slot, and faster
    # to read); the later ones from its slot, since dst may be src by then.
    first = src if rank == 0 else slots[0, k, at:n].view(dst.dtype)
    second = src if rank == 1 else slots[1, k, at:n].view(dst.dtype)
    reduce_into(dst, first, second, op, half)
    for r in range(2, ranks):
        reduce_into(dst, dst, slots[r, k, at:n].view(dst.dtype), op, half)
    return _DONE


@njit(nogil=True, cache=True)
def slots_scatter_step(src, dst, slots, ints, bounds):
    """recursive_doubling.scatter_gather after _slots_arrive, compiled: fold this rank's share
    (bounds[rank]:bounds[rank + 1]) of every rank's payload in rank order, its own from src, into
    its slot of the next exchange and post it; once every rank has, copy every share into dst (which
    may be src: it is written only then). Resumable (SLOT_STAGE 0: the first exchange, 1: the
    second); returns as slots_step does, _ASK_PYTHON only in the first exchange."""
    rank, at, ranks, itemsize = ints[SLOT_RANK], ints[SLOT_DATA_AT], slots.shape[0], dst.itemsize
    if ints[SLOT_STAGE] == 0:
        status = _slots_arrive(src, slots, ints)
        if status != _DONE:
            return status
        sequence = ints[SLOT_SEQUENCE]
        k, lo, hi = sequence & 1, bounds[rank], bounds[rank + 1]
        start = at + (ints.size - SLOT_PARAMS) * 8 + lo * itemsize  # (past the header)
        end = start + (hi - lo) * itemsize
        mine = slots[rank, 1 - k]
        share = mine[at : at + (hi - lo) * itemsize].view(dst.dtype)
        op, half = ints[SLOT_OP], ints[SLOT_HALF]
        first = src[lo:hi] if rank == 0 else slots[0, k, start:end].view(dst.dtype)
        second = src[lo:hi] if rank == 1 else slots[1, k, start:end].view(dst.dtype)
        reduce_into(share, first, second, op, half)
        for r in range(2, ranks):
            operand = src[lo:hi] if r == rank else slots[r, k, start:end].view(dst.dtype)
            reduce_into(share, share, operand, op, half)
        words = mine[:16].view(np.int64)
        words[1] = (hi - lo) * itemsize
        _store_release(words, sequence + 1)
        ints[SLOT_SEQUENCE], ints[SLOT_STAGE] = sequence + 1, 1
    sequence = ints[SLOT_SEQUENCE]
    if not _all_posted(slots, sequence, ints):
        return _PENDING
    k = sequence & 1
    for q in range(ranks):
        size = (bounds[q + 1] - bounds[q]) * itemsize
        memcpy(dst.ctypes.data + bounds[q] * itemsize, slots[q, k].ctypes.data + at, size)
    return _DONE
