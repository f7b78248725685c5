"""Ring steps without Python in the loop: Numba loops that call the MPI library's own C entry points
(MPI_Irecv, MPI_Isend, MPI_Testall, MPI_Startall of the library mpi4py loaded) and reduce what arrives.
Recursive doubling's steps (the latency path, the agreement before a ring) run the same way: see
RecursiveDoubling at the end.

A ring step in Python costs 4 to 9 us of interpreter per exchange here (mpi4py's buffer handling,
the watched wait, slicing, the ufunc call; bench/ring_steps.py); at 512 ranks a 4 MiB allreduce makes
1,022 of them. Here a
whole phase (the reduce-scatter's p - 1 steps and their segments, or the allgather's) runs in one
compiled call with the GIL released. It does what ring.py does, message for message (the same
tags, sizes, order and pipelining), so a rank on this path and a rank on ring.py's Python loop
(a timeline on one of them, say) still pair up, and the reductions are the same float32/float64/
integer operations (float16 and bfloat16 through gflow/arrays/half_kernels.py's conversions), so the
bits are the same.

Waits stay watched: the loop polls MPI_Testall, yielding the core between polls as the caller's
Python wait does (or sleeping, on the background thread, for longer the longer a wait lasts), and
every POLLS_PER_VISIT polls (sleeping: SLEEPING_VISIT_S of sleep) it returns to Python, which looks
for departed ranks (the stall inspector's goodbyes), lets signal handlers run (Ctrl-C) and calls
back in where it left off. The stall inspector's mark says this thread waits on its peers for the
whole phase.

Binding: the MPI functions are resolved by name through llvmlite (add_symbol, with the addresses
ctypes finds in the library mpi4py loaded), so the compiled code is cached on disk and works for
MPICH and Open MPI alike: handles travel as 64-bit integers, which the x86-64 and AArch64 calling
conventions pass in registers whichever width the library declares (MPICH: int; Open MPI:
pointers), and requests are addressed with the library's own MPI_Request size. Where anything of
this is missing (another platform, a library without the symbols, GFLOW_NATIVE=0), ring.py's Python
loop runs instead.
"""

import ctypes
import platform
import sys
import time

import numpy as np
from mpi4py import MPI

from ..errors import GflowError
from ..runtime import stall
from ..runtime.config import config
from ..runtime.context import TAG_RING_AG, TAG_RING_RS, CommContext
from ..runtime.signature import is_bfloat16

# What a compiled loop returns (a negative number: -(the MPI error code)); ASK_PYTHON: recursive
# doubling met a header that is not this rank's
DONE, _PENDING, ASK_PYTHON = 0, 1, 2
POLLS_PER_VISIT = 2000  # polls between visits to Python, yielding (a few ms: departures, Ctrl-C)
SLEEPING_VISIT_S = 0.005  # ... and, sleeping between polls (the engine thread), at most this long


def _half(dtype) -> int:
    """Which 2-byte float a dtype is (1: float16, 2: bfloat16, reduced as their bits), else 0."""
    return 1 if dtype == np.float16 else 2 if is_bfloat16(dtype) else 0


_OPS = {"sum": 0, "max": 1, "min": 2}
_ENTRY_POINTS = ("MPI_Irecv", "MPI_Isend", "MPI_Testall", "MPI_Startall")

_compiled = None  # the compiled phases once bound, or False where they cannot be


def _bind():
    """Register the MPI and libc entry points with the JIT and compile (or load) the phases; False
    where this platform or library does not allow it."""
    if platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        return False
    try:
        import llvmlite.binding as llvm

        library = ctypes.CDLL(MPI.__file__)  # dlsym through it finds the MPI library it links
        libc = ctypes.CDLL(None)
        for name in _ENTRY_POINTS:
            llvm.add_symbol(name, ctypes.cast(getattr(library, name), ctypes.c_void_p).value)
        for name in ("sched_yield", "usleep", "memcpy"):
            llvm.add_symbol(name, ctypes.cast(getattr(libc, name), ctypes.c_void_p).value)
        from . import native_loops

        return native_loops
    except (ImportError, OSError, AttributeError):
        return False


def _loops():
    """The compiled phases (native_loops), bound on first use; False where they cannot be."""
    global _compiled
    if _compiled is None:
        _compiled = _bind()
    return _compiled


def usable(ops) -> bool:
    """Whether a phase over buffers of `ops` can run compiled: host memory, the native loops on."""
    if not config.native or ops.memory != "host":
        return False
    return _loops() is not False


# The element types the loops run on (2-byte floats travel as their bits: _plain)
LOOP_DTYPES = (np.uint16, np.float32, np.float64, np.int32, np.int64)


def loop_signatures() -> list:
    """(loop, argument types) for every compiled loop and element type the collectives run, read-only
    sources included: what `gflow compile` compiles ahead (tests/test_native.py checks that the
    collectives compile nothing else). Empty where the loops cannot be bound."""
    loops = _loops()
    if loops is False:
        return []
    from numba import typeof

    ints, space = np.zeros(1, np.int64), np.zeros(1, np.uint8)
    steps, slots = np.zeros((1, 1), np.int64), np.zeros((1, 1, 1), np.uint8)
    plan = [(loops.recursive_doubling, (space,) * 5 + (ints, steps, space))]  # (a header alone)
    for dtype in LOOP_DTYPES:
        a = np.zeros(1, dtype)
        read_only = a.copy()
        read_only.setflags(write=False)
        plan += [
            (loops.allgather, (a, ints, space)),
            (loops.recursive_doubling, (a, a, a, space, space, ints, steps, space)),
        ]
        for src in (a, read_only):
            plan += [
                (loops.reduce_scatter, (src, a, a, ints, space)),
                (loops.allreduce, (src, a, a, a, ints, space)),
                (loops.slots_step, (src, a, slots, ints)),
                (loops.slots_scatter_step, (src, a, slots, ints, ints)),
            ]
    return [(loop, tuple(typeof(x) for x in args)) for loop, args in plan]


def _plain(a, half: int):
    """What the compiled loop takes for a buffer: itself, or its uint16 bits for a 2-byte float."""
    return a.view(np.uint16) if half else a


def _int64(handle: int) -> int:
    """A handle as mpi4py gives it (unsigned: MPICH's negative ints come sign-extended) as an int64."""
    return handle - (1 << 64) if handle >= 1 << 63 else handle


class Phases:
    """A context's arrays for the compiled loops, made once and reused by every phase on it (one
    thread uses a context at a time): `ints` holds the native_loops.PARAMS integers, then the
    resumable state (STATE words), then the chunk bounds (p + 1); `space` the two requests and their
    statuses; `divisors` the world size in each dtype a mean divides (host_ops.divide's operand)."""

    def __init__(self, ctx: CommContext):
        self.is_background = ctx.is_background  # (_budget: the engine thread sleeps between polls)
        self.params, self.state = _compiled.PARAMS, _compiled.STATE
        self.ints = np.zeros(self.params + self.state + ctx.size + 1, np.int64)
        handles = (_int64(ctx.comm.handle), _int64(MPI.BYTE.handle), 0, MPI._sizeof(MPI.Request))
        self.ints[: self.params] = [0, 0, ctx.size, ctx.rank, 0, 0, *handles, 0, 0, 0, 0]
        self.space = np.zeros(2 * 8 + 2 * 64, np.uint8)  # (room for any library's MPI_Request and MPI_Status)
        self.size, self.divisors = ctx.size, {}

    def start(self, tag: int, bounds, seg=0, widest=0, op=0, half=0, tag_allgather=0, mean=0):
        ints = self.ints
        ints[0], ints[1], ints[4], ints[5], ints[8], ints[12], ints[13] = (
            seg, widest, op, half, tag, tag_allgather, mean
        )  # fmt: skip
        ints[10], ints[11] = _budget(self)
        ints[self.params : self.params + self.state] = 0
        ints[self.params + self.state :] = bounds
        return ints

    def divisor(self, dtype):
        """The world size as a one-element array of dtype (made once per dtype)."""
        d = self.divisors.get(dtype)
        if d is None:
            d = self.divisors[dtype] = np.full(1, self.size, dtype)
        return d


def _budget(ctx) -> tuple:
    """A visit's (budget, sleep_us): the engine thread sleeps between polls, budget microseconds
    slept per visit (native_loops._wait_on backs off); the caller's thread yields, budget polls."""
    if ctx.is_background:
        return int(SLEEPING_VISIT_S * 1e6), max(1, config.background_poll_us)
    return POLLS_PER_VISIT, 0


def _phases(ctx: CommContext) -> Phases:
    phases = ctx.native_phases
    if phases is None:
        phases = ctx.native_phases = Phases(ctx)
    return phases


_ready: set = set()  # (loop, argument types) compiled or loaded from Numba's cache in this process


def _compiled_for(loop, args) -> None:
    """Compile (or load) loop for these arguments now, before the phase's wait is marked: a first
    compile takes seconds, which the stall inspector must not take for a slow peer."""
    key = (loop, args[0].dtype, args[0].flags.writeable)  # (the first: the caller's, maybe read-only)
    if key not in _ready:
        from numba import typeof

        loop.compile(tuple(typeof(a) for a in args))
        _ready.add(key)


def _visit(loop, args) -> int:
    """Call loop(*args) (one compiled visit) until it returns anything but _PENDING, and return that,
    doing between visits what the watched wait does between polls; the stall inspector sees this
    thread waiting the whole time."""
    mark = stall.mark()
    mark.since = time.monotonic()
    try:
        while True:
            status = loop(*args)
            if status != _PENDING:
                return status
            if stall.departures:
                stall.check_waiting()
    except GflowError:
        raise
    except BaseException:  # Ctrl-C, SystemExit from a signal handler: the phase is left unfinished
        stall.abandoned(mark)
        raise
    finally:
        mark.since = None


def _drive(ctx: CommContext, loop, args) -> None:
    """Run a ring phase's loop to its end; an MPI error names this rank's two neighbours."""
    try:
        _compiled_for(loop, args)
    except BaseException:  # (Ctrl-C in a compile: this rank's part of the collective is left undone)
        stall.abandoned(stall.mark())
        raise
    status = _visit(loop, args)
    if status < 0:
        left, right = (ctx.rank - 1) % ctx.size, (ctx.rank + 1) % ctx.size
        raise GflowError(
            f"MPI failed in a ring step on rank {ctx.rank}, exchanging with ranks {left} and {right} "
            f"(a peer that failed?): MPI error class {MPI.Get_error_class(-status)}, "
            f"{MPI.Get_error_string(-status)}"
        )


def reduce_scatter(ctx: CommContext, src, buf, landing, bounds, seg: int, widest: int, op: str) -> None:
    """ring.reduce_scatter's steps, compiled (see there for the schedule)."""
    half = _half(buf.dtype)
    phases = _phases(ctx)
    ints = phases.start(TAG_RING_RS, bounds, seg, widest, _OPS[op], half)
    args = (_plain(src, half), _plain(buf, half), _plain(landing, half), ints, phases.space)
    _drive(ctx, _compiled.reduce_scatter, args)


def allreduce(ctx: CommContext, src, buf, landing, bounds, seg: int, widest: int, op: str) -> None:
    """ring.allreduce's two phases in one compiled call: its reduce-scatter, then (op "mean", float32
    or float64 only: the caller checks) this rank's chunk divided by p, then its allgather."""
    half = _half(buf.dtype)
    phases = _phases(ctx)
    mean = op == "mean"
    reduce_op = _OPS["sum" if mean else op]
    ints = phases.start(TAG_RING_RS, bounds, seg, widest, reduce_op, half, TAG_RING_AG, int(mean))
    plain = _plain(buf, half)
    args = (_plain(src, half), plain, _plain(landing, half), phases.divisor(plain.dtype), ints, phases.space)
    _drive(ctx, _compiled.allreduce, args)


def allgather(ctx: CommContext, buf, bounds) -> None:
    """ring.allgather's steps, compiled, for chunks of at most ring.MAX_MESSAGE_BYTES."""
    phases = _phases(ctx)
    ints = phases.start(TAG_RING_AG, bounds)
    _drive(ctx, _compiled.allgather, (_plain(buf, _half(buf.dtype)), ints, phases.space))


class RecursiveDoubling:
    """A recursive-doubling plan's steps for the compiled loop (native_loops.recursive_doubling):
    its persistent requests' handles, one row per step, and the header's offsets, made once per plan.
    In Python a step costs about 3 us here (Startall, the watched wait, the header's comparison, the
    ufunc), log2(p) of them per call; compiled, the loop starts, waits and folds each step while every
    header that arrives is this rank's own, and hands the rest (a mismatch, ranks in join(), a payload
    sent apart, a receive that did not fit) back to recursive_doubling.py, which goes on from there.
    `steps`: (peer is lower, action, requests) per step, requests as recursive_doubling._Step holds
    them (the receive first); `layout`: (bytes compared, rank_a, rank_b, follows, header bytes)."""

    def __init__(self, steps, layout, last_into_dst: bool):
        loops = _compiled
        size = MPI._sizeof(MPI.Request)
        self.steps = np.zeros((len(steps), 4), np.int64)
        self.space = np.zeros(len(steps) * 2 * size + 2 * 64, np.uint8)  # (room for any MPI_Status)
        for i, (lower, action, requests, receives) in enumerate(steps):
            code = {"combine": loops.RD_COMBINE, "take": loops.RD_TAKE}.get(action, -1)
            self.steps[i] = (int(lower), code, len(requests), int(receives))
            for k, request in enumerate(requests):
                at = (2 * i + k) * size
                self.space[at : at + size] = np.frombuffer(
                    (request.handle & ((1 << 8 * size) - 1)).to_bytes(size, sys.byteorder), np.uint8
                )
        self.ints = np.zeros(loops.RD_PARAMS + 2, np.int64)
        words = (loops.RD_SAME, loops.RD_RANK_A, loops.RD_RANK_B, loops.RD_FOLLOWS, loops.RD_HEADER)
        self.ints[list(words)] = layout
        self.ints[loops.RD_STEPS], self.ints[loops.RD_REQUEST_SIZE] = len(steps), size
        self.ints[loops.RD_STATUSES], self.ints[loops.RD_LAST_INTO_DST] = len(steps) * 2 * size, last_into_dst


_NO_PAYLOAD = np.zeros(0, np.uint8)


def recursive_doubling(ctx: CommContext, rd: RecursiveDoubling, acc, incoming, dst, send, recv, op) -> tuple:
    """Run a plan's steps compiled while every peer's header is this rank's own (see
    native_loops.recursive_doubling). Returns (step, status): status DONE (step: the number of
    steps), ASK_PYTHON (that step's messages arrived; the caller folds them and goes on) or
    -(an MPI error code) of that step."""
    loops = _compiled
    ints = rd.ints
    half = _half(acc.dtype) if acc is not None else 0
    ints[loops.RD_OP], ints[loops.RD_HALF] = _OPS[op] if op is not None else 0, half
    ints[loops.RD_BUDGET], ints[loops.RD_SLEEP] = _budget(ctx)
    ints[loops.RD_PARAMS :] = 0
    if acc is None:
        args = (_NO_PAYLOAD, _NO_PAYLOAD, _NO_PAYLOAD, send, recv, ints, rd.steps, rd.space)
    else:
        payload = (_plain(acc, half), _plain(incoming, half), _plain(dst, half))
        args = (*payload, send, recv, ints, rd.steps, rd.space)
    _compiled_for(loops.recursive_doubling, args)
    status = _visit(loops.recursive_doubling, args)
    return int(ints[loops.RD_PARAMS]), status


class SlotsStep:
    """A plan's one exchange through shared_slots.py's slots for the compiled loop
    (native_loops.slots_step): its integers and header in one array, made once per plan. In Python the
    exchange's own work (posting the header and payload, comparing the headers, folding the payloads)
    costs about 5 us at p = 2 here; compiled, the call into it (Numba's dispatch of four arrays) is
    most of what remains. `header`: this rank's (bytes, 8-byte words); `layout`: (rank_a's byte
    offset, the slots' message offset); `bounds`: the shares of a payload reduced a share per rank
    (recursive_doubling.scatter_gather; native_loops.slots_scatter_step), None where every rank
    folds it whole."""

    def __init__(self, ctx: CommContext, header: bytes, layout, op: str, dtype, bounds=None):
        loops = _compiled
        self.half = _half(np.dtype(dtype))
        self.ints = np.zeros(loops.SLOT_PARAMS + len(header) // 8, np.int64)
        self.ints[loops.SLOT_PARAMS :] = np.frombuffer(header, np.int64)
        self.ints[: loops.SLOT_PARAMS] = (
            ctx.rank, 0, 1, layout[0], _OPS[op], self.half, *_budget(ctx), layout[1], 0
        )  # fmt: skip
        self.bounds = None if bounds is None else np.array(bounds, np.int64)
        self.ready = set()  # (whether src is writeable) compiled for


def slots_step(ctx: CommContext, step: SlotsStep, slots, src, dst) -> int:
    """Exchange and fold through the slots, compiled (see native_loops.slots_step, and
    slots_scatter_step for a step with bounds): DONE, or ASK_PYTHON where every rank's message is
    there and not all of them this rank's header and length (the caller reads them from the slots).
    Waits the loop's budget did not finish are the context's watched wait."""
    loops, ints = _compiled, step.ints
    if step.half:
        src, dst = src.view(np.uint16), dst.view(np.uint16)
    if step.bounds is None:
        return one_exchange(ctx, step, slots, src, dst)
    loop, args = loops.slots_scatter_step, (src, dst, slots.memory, ints, step.bounds)
    writeable = src.flags.writeable
    if writeable not in step.ready:  # (as in one_exchange)
        _compiled_for(loop, args)
        step.ready.add(writeable)
    slots.sequence += 1
    ints[loops.SLOT_SEQUENCE] = slots.sequence
    ints[loops.SLOT_STAGE] = 0
    try:
        status = loop(*args)
        while status == _PENDING:
            slots.sequence = int(ints[loops.SLOT_SEQUENCE])  # (the second exchange's, once posted)
            ctx.wait_until(slots.arrived)
            ints[loops.SLOT_POST] = 0
            status = loop(*args)
    finally:
        ints[loops.SLOT_POST] = 1
        slots.sequence = int(ints[loops.SLOT_SEQUENCE])
    return status


def one_exchange(ctx: CommContext, step: SlotsStep, slots, src, dst) -> int:
    """slots_step for a step of one exchange (no bounds; 2-byte floats viewed as their bits by the
    caller): the latency path's, kept lean (at p = 2 a few hundred nanoseconds of Python are what
    gflow adds to Open MPI's Allreduce of 1 KB)."""
    loops, ints = _compiled, step.ints
    if src.flags.writeable not in step.ready:  # (before this exchange counts: a compile takes
        _compiled_for(loops.slots_step, (src, dst, slots.memory, ints))  # seconds, and Ctrl-C in it
        step.ready.add(src.flags.writeable)  # must leave the exchange not begun)
    slots.sequence = sequence = slots.sequence + 1
    ints[loops.SLOT_SEQUENCE] = sequence
    status = loops.slots_step(src, dst, slots.memory, ints)
    if status == _PENDING:
        try:
            ctx.wait_until(slots.arrived)
            ints[loops.SLOT_POST] = 0
            status = loops.slots_step(src, dst, slots.memory, ints)
        finally:  # (Ctrl-C is raised as a compiled visit returns, with SLOT_POST 0 only in here: the
            ints[loops.SLOT_POST] = 1  # next exchange posts again)
    return status
