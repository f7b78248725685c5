"""The compiled ring phases of native.py (imported by it once the MPI entry points are registered).

Every integer a phase needs travels in one int64 array, `ints` (native.py's Phases: segment, widest
chunk, p, rank, op, half, comm, MPI_BYTE, tag, MPI_Request size, polls per visit (sleeping:
microseconds slept per visit), sleep in us, the allgather's tag and whether to divide by p between
the phases; then the state; then the chunk bounds), and the requests and statuses in one byte array,
`space`: a few arrays type faster than a dozen scalars, and the same way on every call. Each phase
is a resumable state machine: the state holds (step, segment, in flight, phase) so that a visit that
has polled POLLS_PER_VISIT times without progress can return _PENDING and the next visit goes on
from there. `allreduce` runs the two phases in one call (one visit from Python instead of two:
ring.allreduce's fixed cost). Handles and pointers travel as 64-bit integers (see native.py)."""

import numpy as np
from numba import njit, types
from numba.extending import overload

from ..arrays.half_kernels import _combine, _from_bf16, _from_half, _to_bf16, _to_half
from ..runtime.config import BACKGROUND_POLL_BACKOFF

_i32, _i64, _u32 = types.int32, types.int64, types.uint32
# int MPI_Irecv(void *buf, int count, MPI_Datatype, int source, int tag, MPI_Comm, MPI_Request *)
mpi_irecv = types.ExternalFunction("MPI_Irecv", _i32(_i64, _i32, _i64, _i32, _i32, _i64, _i64))
mpi_isend = types.ExternalFunction("MPI_Isend", _i32(_i64, _i32, _i64, _i32, _i32, _i64, _i64))
# int MPI_Testall(int count, MPI_Request requests[], int *flag, MPI_Status statuses[])
mpi_testall = types.ExternalFunction("MPI_Testall", _i32(_i32, _i64, _i64, _i64))
sched_yield = types.ExternalFunction("sched_yield", _i32())
usleep = types.ExternalFunction("usleep", _i32(_u32))

_DONE, _PENDING = 0, 1


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
    """Poll the two requests: 0 done, _PENDING not yet, < 0 an MPI error. Yielding (sleep_us 0):
    up to budget polls. Sleeping: until budget microseconds were slept, the pause doubling from
    sleep_us to BACKOFF times it, so a wait that lasts (a slow link) wakes its core seldom while
    backward computes, and a short one (shared memory) is polled as often as before."""
    if sleep_us <= 0:
        for _ in range(budget):
            rc = mpi_testall(2, space.ctypes.data, flag.ctypes.data, space.ctypes.data + 16)
            if rc != 0:
                return -rc
            if flag[0] != 0:
                return 0
            sched_yield()
        return _PENDING
    pause, slept, longest = sleep_us, 0, longest_pause(sleep_us, budget)
    while True:
        rc = mpi_testall(2, space.ctypes.data, flag.ctypes.data, space.ctypes.data + 16)
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
