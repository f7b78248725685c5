"""Recursive doubling with an agreement header: the latency path, and the check that ranks agree.

Every exchange sends a header and the payload. The header carries the sender's call
signature (gflow/runtime/signature.py) or, once a disagreement has been seen, the record of two ranks found to
disagree. Merging two headers is a reduction like the payload's, so after the rounds every rank holds
the same verdict: all agree, or "rank a called X, rank b called Y"; then every rank raises, or none
does. Nobody hangs on a mismatch: all ranks run the same schedule whatever they were called with, and
every receive has room for the largest message any peer may send, whatever its settings (header +
MAX_SMALL_MESSAGE_BYTES), so no message is ever truncated.

Small payloads travel in the header's message, [header | payload], copied in. From
SEPARATE_PAYLOAD_BYTES they travel as a second message sent straight from the caller's array: the
copy cost more than the extra message (bench/RESULTS.md, "The cost of a call"). The header says how
many payload bytes follow it, and the receiver takes a second message only when its peer's header
says so: ranks that disagree on the size (and so on how they send) still pair message for message.

Used three ways:
- with the data as payload, for messages up to small_message_bytes (16x that at two ranks:
  dispatch.latency_path_bytes): the check rides along for free;
- header only, before the ring, for larger messages: log2(p) tiny messages;
- from three ranks on one host, with the data as payload up to a slot's room, for "auto"'s larger
  messages too (reduce_in_slots): the slots then reduce it a share per rank (scatter_gather).

Schedule (p2 = largest power of two <= p, rem = p - p2): ranks below 2*rem pair up, the even one sends
its buffer to the odd one and drops out; the p2 survivors exchange with rank ^ 2^k in round k; at the
end the odd ranks hand the result back to their even partner. Latency: log2(p2) rounds, + 2 steps
when p is not a power of two. Each rank sends N bytes per round: right only while N is small.
The lower-ranked operand always goes first, so every rank computes bitwise the same result.
"""

import re
import sys
import threading
from contextlib import contextmanager

import numpy as np
from mpi4py import MPI

from ..arrays import host_ops as host
from ..errors import GflowError, MismatchError, NotServedInJoinError
from ..runtime import engine, stall, timeline
from ..runtime.config import MAX_SMALL_MESSAGE_BYTES, config
from ..runtime.context import TAG_AGREE, CommContext
from ..runtime.signature import (
    CODE_ALGORITHM,
    CODE_COLLECTIVE,
    COLLECTIVE_CODE,
    PASSED_BYTES,
    SIG_LEN,
    SIG_REJECTED,
    collective_in_words,
    describe,
    difference,
    first_push_apart,
    settings_differ,
    settings_words,
)
from . import native, ring, shared_slots

_MAGIC = 0x67666C6F77  # "gflow"
_OK, _MISMATCH, JOINED = 0, 1, 2
# Header words: magic, state, sig_a[SIG_LEN], sig_b[SIG_LEN], rank_a, rank_b, follows. In the OK state
# sig_a is the signature every rank seen so far agrees on and rank_a the lowest of them; sig_b is zero,
# and rank_b counts the ranks among them that are in hvd.join() (collectives/join.py): a JOINED header
# comes from such a rank before it knows the call, with no payload, and counts as zeros.
# follows: the bytes of payload the sender sends as a message of their own after this one (0: none).
_SIG_A = slice(2, 2 + SIG_LEN)
_SIG_B = slice(2 + SIG_LEN, 2 + 2 * SIG_LEN)
_RANK_A, _RANK_B, _FOLLOWS = 2 + 2 * SIG_LEN, 3 + 2 * SIG_LEN, 4 + 2 * SIG_LEN
HEADER_WORDS = 5 + 2 * SIG_LEN
HEADER_BYTES = HEADER_WORDS * 8
_SAME = slice(0, _RANK_A * 8)  # equal bytes here: same state and same signature or record
_RANK_A_BYTES = slice(_RANK_A * 8, _RANK_B * 8)
_RANK_B_BYTES = slice(_RANK_B * 8, _RANK_B * 8 + 8)
_OK_BYTES = np.array([_OK], dtype=np.int64).tobytes()
_MAGIC_BYTES = np.array([_MAGIC], dtype=np.int64).tobytes()
_NONE_BYTES = bytes(8)
_STATE_BYTES = slice(8, 16)
_FOLLOWS_BYTES = slice(_FOLLOWS * 8, _FOLLOWS * 8 + 8)
_TAIL = slice(_RANK_B * 8, HEADER_BYTES)  # rank_b and follows: zero in a header of the OK state without
_TAIL_NONE = bytes(16)  # ranks in join() and without a payload sent apart
# Payloads from this size go as a message of their own, straight from the caller's array (measured
# on MPICH and Open MPI: bench/RESULTS.md, "The cost of a call").
SEPARATE_PAYLOAD_BYTES = 16 * 1024
# Two ranks exchanging in shared memory (shared_slots.py) copy payloads below this into the header's
# message instead (no MPI message at all); their slots hold the largest such message. (Where the
# ranks' plans differ on it, each header still says whether a payload follows it.)
PAIR_INLINE_BYTES = 2 * 1024 * 1024
# From three ranks every rank reads every rank's payload from the slots: k payloads of n bytes, where
# recursive doubling reads log2(k) of them. Measured against MPICH's Allreduce (bench/node_exchange.py,
# bench/RESULTS.md "Every rank of one host through one window"): 1.3-1.6x at p = 4 and 64 KB, 0.6-0.8x
# from 256 KB. So payloads up to this many bytes over the ranks (128 KiB at p = 4: the latency path's
# default limit) are folded whole by every rank (node_fold_bytes); larger ones are reduced in the
# slots as the node phase reduces (scatter_gather: each rank folds its 1/k of every payload and posts
# it, then copies out every rank's share), up to the slot's room; beyond it, by the ring after the
# slots' agreement.
NODE_READ_BYTES = 512 * 1024
# A slot holds payloads up to this size from three ranks on: up to where "auto" takes the node phase
# in a shared window (config.shared_memory_min_bytes' default), within SLOTS_MEMORY_BYTES for all of a
# context's slots (two per rank), so from nine ranks on a slot holds less.
NODE_SLOT_BYTES = 2 * 1024 * 1024
SLOTS_MEMORY_BYTES = 32 * 1024 * 1024


def slot_room(ranks: int) -> int:
    """The message a slot holds on a context of `ranks` (alike on every rank: no setting changes it)."""
    if ranks == 2:
        return HEADER_BYTES + PAIR_INLINE_BYTES
    return HEADER_BYTES + min(NODE_SLOT_BYTES, SLOTS_MEMORY_BYTES // (2 * ranks)) // 64 * 64


def slot_room_reserved(ranks: int) -> tuple:
    """(slot_room, the bytes of it reserved when the slots are made: all that the latency path
    writes, the header and a payload folded whole; shared_slots.connect)."""
    room = slot_room(ranks)
    return room, (room if ranks == 2 else HEADER_BYTES + node_fold_bytes(ranks))


def node_fold_bytes(ranks: int) -> int:
    """The largest payload every rank of a context of `ranks` (three or more) on one host folds whole
    from the slots; larger ones are reduced a share per rank (scatter_gather)."""
    return NODE_READ_BYTES // ranks // 64 * 64


class _Step:
    """One exchange of the schedule: its persistent requests for the header's message (a receive
    first, where the step receives), the peer, what to do with what arrived, and the persistent
    requests of a separate payload: one that receives it, one that sends it from the accumulator."""

    __slots__ = (
        "requests",
        "peer",
        "peer_is_lower",
        "action",
        "receives",
        "sends",
        "payload_in",
        "payload_out",
    )

    def __init__(self, requests, peer, peer_is_lower, action, receives, sends, payload_in, payload_out):
        self.requests, self.peer, self.peer_is_lower, self.action = requests, peer, peer_is_lower, action
        self.receives, self.sends = receives, sends
        self.payload_in, self.payload_out = payload_in, payload_out

    def free(self) -> None:
        for request in (*self.requests, self.payload_in, self.payload_out):
            if request is not None:
                request.Free()


class _Plan:
    """Everything one shape of call needs, built once and reused: the header, views of the message
    buffers, and MPI persistent requests for each step of the schedule."""

    def __init__(self, ctx: CommContext, sig: tuple, capacity: int, dtype, count: int):
        send = ctx.scratch("rd_send", HEADER_BYTES + capacity, np.uint8, host)
        # Sized for any peer's capacity, not this rank's: a peer with a larger small_message_bytes
        # must be told it disagrees, and a truncated receive is not safe on every MPI.
        recv = ctx.scratch("rd_recv", HEADER_BYTES + MAX_SMALL_MESSAGE_BYTES, np.uint8, host)
        nbytes = count * np.dtype(dtype).itemsize if dtype is not None else 0
        inline = ctx.slots.room - HEADER_BYTES if ctx.slots else SEPARATE_PAYLOAD_BYTES - 1
        self.separate = nbytes > inline  # (through the slots from three ranks: reduced by the ring)
        # (from three ranks on one host, a payload past node_fold_bytes: reduced a share per rank)
        self.scattered = bool(ctx.slots) and ctx.size > 2 and node_fold_bytes(ctx.size) < nbytes <= inline
        header = np.zeros(HEADER_WORDS, dtype=np.int64)
        header[0], header[1], header[_SIG_A], header[_RANK_A] = _MAGIC, _OK, sig, ctx.rank
        header[_FOLLOWS] = nbytes if self.separate else 0
        self.header = header.tobytes()
        self.header_same = self.header[_SAME]
        self.send_mv, self.recv_mv = memoryview(send), memoryview(recv)
        self.send_same, self.recv_same = self.send_mv[_SAME], self.recv_mv[_SAME]
        self.acc = self.incoming = self.acc_bytes = None
        if dtype is not None:
            self.acc = send[HEADER_BYTES : HEADER_BYTES + nbytes].view(dtype)
            self.incoming = recv[HEADER_BYTES : HEADER_BYTES + nbytes].view(dtype)
            self.acc_bytes = self.send_mv[HEADER_BYTES : HEADER_BYTES + nbytes]
        self.message = send[: HEADER_BYTES + (0 if self.separate else nbytes)]
        message = [self.message, MPI.BYTE]
        whole_recv = [recv, MPI.BYTE]
        payload = [send[HEADER_BYTES : HEADER_BYTES + nbytes], MPI.BYTE]
        payload_room = [recv[HEADER_BYTES:], MPI.BYTE]  # where a combined message's payload lands too
        self.comm = comm = ctx.comm
        fold = ctx.rd_fold

        def step(peer, peer_is_lower, action, receives=True, sends=True):
            requests = [comm.Recv_init(whole_recv, peer, TAG_AGREE)] if receives else []
            if sends:
                requests.append(comm.Send_init(message, peer, TAG_AGREE))
            payload_in = comm.Recv_init(payload_room, peer, TAG_AGREE) if receives else None
            payload_out = comm.Send_init(payload, peer, TAG_AGREE) if sends and self.separate else None
            return _Step(requests, peer, peer_is_lower, action, receives, sends, payload_in, payload_out)

        self.steps = []
        if fold is not None and fold[0] == "send":
            self.steps.append(step(fold[1], False, "take"))
        else:
            if fold is not None:
                self.steps.append(step(fold[1], True, "combine", sends=False))
            self.steps += [step(peer, lower, "combine") for peer, lower in ctx.rd_rounds]
            if fold is not None:
                self.steps.append(step(fold[1], False, "none", receives=False))
        # The last combine can write straight to the caller's array unless a partner still needs it.
        self.last_into_dst = fold is None and len(self.steps) > 0
        # One exchange, the payload in the header's message (p = 2 below SEPARATE_PAYLOAD_BYTES):
        # _exchange runs it inline (_lone_step).
        self.lone = len(self.steps) == 1 and self.steps[0].action == "combine" and not self.separate
        self.send, self.recv = send, recv
        self.uses = 0
        self.compiled = None  # the steps for native.py's loop, from the plan's second use (_compiled)
        self.slots_step = None  # ... and an exchange's through the slots (slots_compiled)

    def _compiled(self):
        """native.py's form of these steps, or None where they run in Python: one step (a call into
        the compiled loop, Numba's dispatch of its arrays, costs about what a step in Python does:
        measured slower at p = 2, faster from two steps: bench/RESULTS.md), a payload sent apart, no
        compiled loops here, or a plan used once so far (a short script need not load Numba)."""
        self.uses += 1
        if self.uses == 2 and len(self.steps) >= 2 and not self.separate and native.usable(host):
            steps = [(s.peer_is_lower, s.action, s.requests, s.receives) for s in self.steps]
            layout = (_RANK_A * 8, _RANK_A * 8, _RANK_B * 8, _FOLLOWS * 8, HEADER_BYTES)
            self.compiled = native.RecursiveDoubling(steps, layout, self.last_into_dst)
        return self.compiled

    def slots_compiled(self, ctx: CommContext, op):
        """native.py's form of the exchange through the slots (_paired_step, _node_step), from the
        plan's second use (as _compiled), or None where it runs in Python."""
        self.uses += 1
        if self.uses == 2 and native.usable(host):
            layout = (_RANK_A * 8, shared_slots.DATA_AT)
            bounds = ring.chunk_bounds(self.acc.size, ctx.size) if self.scattered else None
            self.slots_step = native.SlotsStep(ctx, self.header, layout, op, self.acc.dtype, bounds)
        return self.slots_step

    def free(self) -> None:
        for step in self.steps:
            step.free()
        self.steps = []


def plan_for(ctx: CommContext, sig: tuple, capacity: int, src) -> _Plan:
    """The plan of this call's shape, made on first use and kept on ctx."""
    dtype = None if src is None else src.dtype
    key = (sig, capacity, dtype)
    plan = ctx.rd_plans.get(key)
    if plan is None:
        if len(ctx.rd_plans) >= 256:  # bounded: a trainer uses a handful of shapes
            _forget_plans(ctx)
        plan = ctx.rd_plans[key] = _Plan(ctx, sig, capacity, dtype, 0 if src is None else src.size)
    return plan


def _forget_plans(ctx: CommContext) -> None:
    for plan in ctx.rd_plans.values():
        plan.free()
    ctx.rd_plans.clear()
    ctx.small_calls.clear()  # (they hold plans just freed)


# What the call this thread is in passed, in words (operations.annotated sets it): after a mismatch
# the ranks share theirs, so that a MismatchError shows the other rank's call, not a fingerprint.
calling = threading.local()


@contextmanager
def passing(about):
    """Within: this thread's call passed `about` (a str, or signature.Words), for calling."""
    before = getattr(calling, "about", None)
    calling.about = about
    try:
        yield
    finally:
        calling.about = before


def allreduce_with_agreement(ctx: CommContext, sig: tuple, capacity: int, src=None, dst=None, op=None):
    """Check that every rank passed the same `sig`; allreduce the flat host array `src` into `dst`.

    With src None only the signatures travel. op is "sum", "max" or "min". `capacity` is the largest
    payload in bytes this rank may send (config.small_message_bytes, at most MAX_SMALL_MESSAGE_BYTES).
    dst may be src. Raises MismatchError on every rank when any two ranks' signatures differ.
    """
    if src is not None and src.nbytes > capacity:
        raise ValueError(f"payload of {src.nbytes} bytes exceeds the agreement capacity of {capacity} bytes")
    _begin(ctx, sig)
    _exchange(ctx, plan_for(ctx, sig, capacity, src), src, dst, op)


def _begin(ctx: CommContext, sig: tuple) -> None:
    """What every agreement does before its plan and exchange."""
    # Every collective agrees first: none may start where an earlier one left its messages posted
    # (crossed waits), which a peer's next collective would otherwise take for its own.
    ctx.check_usable()
    stall.entered(ctx, sig)  # (before the plan: making it may wait for the context's duplicates)
    if ctx.slots is None:
        connect_slots(ctx)  # (before the plan: it sizes its messages by the slots)


def wants_agreement(ctx: CommContext) -> bool:
    """Whether a bandwidth-sized call on ctx agrees before it moves data: always with config.validate;
    without it, until the ranks have once agreed with validation off on every rank (the setting is in
    those calls' signatures: runtime/signature._SETTINGS). So GFLOW_VALIDATE=0 set on some ranks only
    from the start is a MismatchError on every rank in that first agreement, not a wait for ever. Not
    caught: a rank in join() during it (its header carries no signature), or the setting changed at
    run time on some ranks after it."""
    return ctx.size > 1 and (config.validate or not ctx.agreed_unvalidated)


def agreed(ctx: CommContext) -> None:
    """After an agreement on a signature that carries config.validate (see wants_agreement)."""
    ctx.agreed_unvalidated = not config.validate


def reduce_in_slots(ctx: CommContext, sig: tuple, src, dst, op) -> bool:
    """The start of a bandwidth-sized allreduce (algorithm "auto", host buffers, a context of three
    ranks or more) of the flat `src` into `dst`: where the ranks share one host and the payload fits
    a slot, the whole allreduce through the slots, its agreement riding with the payload (_node_step,
    scatter_gather): True. Otherwise the agreement alone (dispatch.agree's, where wants_agreement
    asks for it): False, and the ring or the node phase follows. Alike on every rank: the slots are
    set up (or refused) in a context's first exchange, before it, so a first call goes the way of
    every later one."""
    if not wants_agreement(ctx) and not (ctx.slots and src.nbytes <= ctx.slots.room - HEADER_BYTES):
        return False  # (no agreement asked for, and no exchange to make)
    _begin(ctx, sig)
    room = ctx.slots.room - HEADER_BYTES if ctx.slots else 0
    if src.nbytes <= room:
        _exchange(ctx, plan_for(ctx, sig, room, src), src, dst, op)
        agreed(ctx)
        return True
    _exchange(ctx, plan_for(ctx, sig, config.small_message_bytes, None), None, None, None)
    agreed(ctx)
    return False


def connect_slots(ctx: CommContext) -> None:
    """Set up ctx's slots in shared memory, or settle on MPI's messages (shared_slots.connect), in
    the context's first exchange, before it: every rank's first gflow collective on a context begins
    with one (or, in join(), with join's), whatever it was called with. Before it, not after: from
    three ranks the slots fold in rank order, MPI's recursive doubling in pairs, and the same inputs
    must give the same bits on a context's first call as on every later one (a twin, a run resumed
    from a checkpoint)."""
    try:
        slots = shared_slots.wanted(ctx) and shared_slots.connect(ctx, *slot_room_reserved(ctx.size))
    except GflowError:  # (on every rank alike, or a peer has left)
        raise
    except BaseException:  # (Ctrl-C, a signal handler's exception: the set-up is out of step with
        stall.abandoned(stall.mark())  # the others', so the context refuses its next call)
        raise
    ctx.slots = slots or False
    if ctx.slots:  # (plans made before would send payloads apart from SEPARATE_PAYLOAD_BYTES)
        _forget_plans(ctx)


def run(ctx: CommContext, plan: _Plan, sig: tuple, src, dst, op, about: str) -> None:
    """allreduce_with_agreement with its plan (made by plan_for for this sig, capacity and src's
    dtype and size): the latency path's fast lane (collectives/latency.py) keeps it from call to call.
    `about`: what this rank passed, in words (the fast lane sets no thread-local)."""
    stall.entered(ctx, sig)
    _exchange(ctx, plan, src, dst, op, about)


def run_compiled_slots(ctx: CommContext, plan: _Plan, sig: tuple, src, dst, op, about: str) -> None:
    """run, for a plan whose one exchange is compiled through shared memory (plan.slots_step, on a
    context whose slots are connected), with src and dst flat and contiguous, dst writable and
    aligned: the fast lane's way, without _exchange's generality (the layers between cost about
    1.5 us at p = 2 here, as much as Open MPI's whole Allreduce of 1 KB)."""
    stall.entered(ctx, sig)
    step = plan.slots_step
    try:
        if step.half or step.bounds is not None:
            status = native.slots_step(ctx, step, ctx.slots, src, dst)
        else:
            status = native.one_exchange(ctx, step, ctx.slots, src, dst)
        if status != native.DONE:
            _run_plan(ctx, plan, src, dst, op, about, exchanged=True)  # (not this rank's header)
    except GflowError:
        raise
    except BaseException:  # (as in _exchange)
        stall.abandoned(stall.mark())
        raise


def _exchange(ctx: CommContext, plan: _Plan, src, dst, op, about=None) -> None:
    """The agreement and payload exchange of one call with its plan (_run_plan). An exception of the
    program's (Ctrl-C, a signal handler's) anywhere in it, in a compile, a compiled visit, around a
    watched wait or while folding, may leave this rank's message with the others (in a slot, or an
    MPI message sent eagerly), which take it for their own call, and the call is counted already
    (stall.entered): it is marked abandoned, so the context refuses its next one (check_usable),
    which would meet the others' next, silently."""
    try:
        _run_plan(ctx, plan, src, dst, op, about)
    except GflowError:  # (on every rank alike, or a peer has left)
        raise
    except BaseException:
        stall.abandoned(stall.mark())
        raise


def _run_plan(ctx: CommContext, plan: _Plan, src, dst, op, about=None, exchanged=False) -> None:
    """_exchange's work. `exchanged`: a plan whose exchange through the slots is done already
    (run_compiled_slots), where not every header was this rank's own."""
    if ctx.slots and ctx.size > 2:
        _node_step(ctx, plan, src, dst, op, about, exchanged)
        return
    paired = plan.lone and ctx.slots  # (its one exchange through shared memory)
    if paired and _paired_step(ctx, plan, src, dst, op, exchanged):
        return  # (the peer's header was this rank's own: nothing below applies)
    send_mv, acc = plan.send_mv, plan.acc
    send_mv[:HEADER_BYTES] = plan.header
    own = acc  # what this rank contributes: src itself until the first combine, where it can be sent as is
    if acc is not None and not paired:  # (_paired_step copied src into acc where it did not finish)
        if plan.separate and src.flags.c_contiguous:
            own = src
        elif src.flags.c_contiguous:
            plan.acc_bytes[:] = memoryview(host.buffer(src)).cast("B")  # cheaper than np.copyto
        else:
            np.copyto(acc, src)
    last = len(plan.steps) - 1
    if paired:
        first, arrived = 0, True  # (what arrived is _complete's and _combine's)
    elif plan.lone:
        first, arrived = _lone_step(ctx, plan, dst, op)
    else:
        first, arrived = _compiled_steps(ctx, plan, dst, op)  # (compiled only where own is acc already)
    for i in range(first, last + 1):
        step = plan.steps[i]
        if not _complete(ctx, plan, step, own, arrived=i == first and arrived):
            own = acc
            continue
        if step.action == "combine":
            out = dst if (i == last and plan.last_into_dst) else acc
            _combine(plan, own, out, step.peer_is_lower, op)
            own = acc
        elif step.action == "take":  # the partner's verdict and result, as they are
            send_mv[:HEADER_BYTES] = plan.recv_mv[:HEADER_BYTES]
    _conclude(ctx, np.frombuffer(send_mv[:HEADER_BYTES], dtype=np.int64), about)
    if acc is not None and not plan.last_into_dst:
        took = plan.steps and plan.steps[0].action == "take"  # (one rank: no steps)
        np.copyto(dst, plan.incoming if took else acc)


def _conclude(ctx: CommContext, header, about) -> None:
    """Raise MismatchError (on every rank alike) where the verdict `header` (int64 words) records
    ranks that disagree; where ranks in join() took part (with zeros), check that they may."""
    if header[1] != _OK:
        header = np.array(header)
        if about is None:
            about = getattr(calling, "about", None)
        _, sig_a, _, sig_b = _record(header)
        if _two_calls(header) and settings_differ(sig_a, sig_b):
            about = settings_words(sig_a)  # (this rank's values of them: which one differs)
        passed, kinds = share_what_passed(ctx, header, about)
        text = _mismatch_message(header, stall.world_ranks(ctx), passed)
        end_where_a_step_met_strays(ctx, kinds, text)
        raise MismatchError(text)
    if header[_RANK_B] != 0:
        _check_joined(header)


def _steps_met_strays(kinds) -> bool:
    """Whether a mismatch's kinds (share_what_passed) pair a training step's own call with a call
    that is no step's (any: one inside a step was made there on one rank only, or reaches the peers
    in another order), or a step's rejection with a call made outside any step. A rejection met by a
    call made inside the step is that step failing on every rank alike: the rejecting rank sends it
    at the bad push, ahead of the others' later segments (test_soak)."""
    kinds = set(kinds)
    others = {engine.CALL, engine.IN_A_STEP} & kinds
    return bool(engine.STEP in kinds and others or engine.STEP_REJECTION in kinds and engine.CALL in kinds)


def end_where_a_step_met_strays(ctx: CommContext, kinds, text: str) -> str | None:
    """Why this communicator takes no more collectives, where a mismatch on its background channel
    (`text`, its first line quoted) paired a training step's call (a LazyAllreduce segment,
    DataParallel's or gflow.torch's optimizer's) with a call that is no step's (_steps_met_strays);
    else None. A rank made a call the others did not (a metric's allreduce_async on one rank,
    before, inside or after its own step): no rank makes another collective there, as after crossed
    waits. Whether that rank's next step pairs with the others' failed one or with their next one
    depends on where its program goes after the error (did the error skip its step() or
    synchronize()?), and a wrong guess averages batch k with batch k + 1 for the rest of training,
    silently (helper-77). Every rank holds the same verdict and kinds."""
    parent = ctx.parent
    if not ctx.is_background or parent is None or not _steps_met_strays(kinds):
        return None
    if parent.ended is None:
        parent.ended = (
            f"a step met another kind of call on this communicator ({text.partition(chr(10))[0]}), so "
            "no rank makes another collective on it: which of the ranks' steps would pair next is "
            "unknown. Make that call on every rank; end the job, or go on with a new communicator"
        )
        stall.departures.append((parent, None))  # (a blocking wait there ends: stall.check_waiting)
    stall.cut_steps(parent, parent.ended)
    return parent.ended


def _node_step(ctx: CommContext, plan: _Plan, src, dst, op, about, exchanged=False) -> None:
    """The whole exchange of a context of three ranks or more whose ranks share one host: every rank
    posts [header | payload] in its slot (shared_slots.py), waits for every other rank's, and folds
    all payloads in rank order from where they lie, compiled where it can be (native.slots_step), so
    every rank holds the same bits after one step instead of log2(p) rounds. Where not every header
    is this rank's own, every rank folds the same headers into the same verdict (node_verdict): a
    mismatch raises on every rank, ranks in join() count as zeros. A payload larger than a slot
    (slot_room: only with a raised small_message_bytes) travels by the ring after the headers
    agree. `exchanged`: posted and arrived already (run_compiled_slots)."""
    slots = ctx.slots
    if not exchanged:
        contiguous = src is not None and src.flags.c_contiguous
        compiled = None  # (a timeline shows each wait: Python's exchange, as the ring's loop)
        if contiguous and not plan.separate and not timeline.active():
            compiled = plan.slots_compiled(ctx, op)
        if compiled is not None and dst.flags.c_contiguous and dst.flags.writeable and dst.flags.aligned:
            if native.slots_step(ctx, compiled, slots, src, dst) == native.DONE:
                return
        elif src is None or plan.separate:
            slots.post(plan.header)
        elif contiguous:
            slots.post(plan.header, memoryview(host.buffer(src)).cast("B"))
        else:
            np.copyto(plan.acc, src)
            slots.post(plan.header, plan.acc_bytes)
    messages = slots.wait(ctx)
    n, same = len(plan.message), plan.header_same
    if all(len(m) == n and m[_SAME] == same and m[_TAIL] == _TAIL_NONE for m in messages):
        if plan.scattered:
            own = src if src.flags.c_contiguous else plan.acc
            scatter_gather(ctx, messages, own.dtype, own.size, own, dst, op)
        elif src is not None:
            _fold_in_rank_order(dst, messages, plan.acc, op, [False] * len(messages))
        return
    headers = [np.frombuffer(m, np.int64, HEADER_WORDS) for m in messages]
    verdict = node_verdict(headers)
    _conclude(ctx, verdict, about)
    if src is None:
        return
    if verdict[_FOLLOWS]:  # (every rank's payload is this size: the same signature)
        if not src.flags.c_contiguous:
            np.copyto(plan.acc, src)
            src = plan.acc
        ring.allreduce(ctx, src, dst, host, op)
        return
    zeros = [h[1] == JOINED for h in headers]
    if plan.scattered:
        own = src if src.flags.c_contiguous else plan.acc
        scatter_gather(ctx, messages, own.dtype, own.size, own, dst, op, zeros)
        return
    _fold_in_rank_order(dst, messages, plan.acc, op, zeros)


def scatter_gather(ctx: CommContext, messages, dtype, count: int, own, dst, op, zeros=None) -> None:
    """_node_step's second half for a payload past node_fold_bytes, once every rank's message of its
    exchange is in the slots (`messages`, in rank order): the node phase's reduce-scatter and
    allgather in the slots. This rank folds its share of every rank's payload (the chunks of
    ring.chunk_bounds: the ring's) in rank order, own's from own, into its slot of the next
    exchange, posts it, and once every rank has, copies every share into dst. Per rank that is one
    copy in, one read of the payload's size and one copy out, and two exchanges; where the ring
    makes 2(k - 1) steps over MPI, each message copied twice. The payloads are `count` elements of
    `dtype`; zeros[r]: rank r's payload counts as zeros (a rank in join(), which passes own and dst
    None)."""
    slots, rank = ctx.slots, ctx.rank
    bounds = ring.chunk_bounds(count, ctx.size)
    lo, hi = bounds[rank], bounds[rank + 1]
    operands = []
    for r, message in enumerate(messages):
        if zeros is not None and zeros[r]:
            operands.append(host.neutral(hi - lo, dtype, op))
        elif r == rank:
            operands.append(own[lo:hi])
        else:
            operands.append(np.frombuffer(message, dtype, hi - lo, HEADER_BYTES + lo * dtype.itemsize))
    share = np.frombuffer(slots.next_message(), dtype, hi - lo)
    host.reduce(share, operands[0], operands[1], op)
    for operand in operands[2:]:
        host.reduce(share, share, operand, op)
    slots.publish(share.nbytes)
    shares = slots.wait(ctx)
    if dst is not None:
        for q, message in enumerate(shares):
            dst[bounds[q] : bounds[q + 1]] = np.frombuffer(message, dtype, bounds[q + 1] - bounds[q])


def _fold_in_rank_order(dst, messages, like, op, zeros) -> None:
    """dst = the payloads of every rank's message (arrays like `like`) folded in rank order, where
    zeros[r] says rank r's counts as zeros (a rank in join())."""
    operands = [
        host.neutral(like.size, like.dtype, op)
        if zero
        else np.frombuffer(m, like.dtype, like.size, HEADER_BYTES)
        for m, zero in zip(messages, zeros, strict=True)
    ]
    host.reduce(dst, operands[0], operands[1], op)
    for operand in operands[2:]:
        host.reduce(dst, dst, operand, op)


def node_verdict(headers) -> np.ndarray:
    """Every rank's header of one exchange (int64 words, in rank order) folded into the verdict every
    rank then holds, as recursive doubling's rounds fold them two at a time: all agree (the lowest
    such rank as rank_a, the count of ranks in join() as rank_b), or the record of two that
    disagree (_merge). JOINED headers count as zeros; where every rank is in join(), a JOINED one."""
    verdict, joined = None, 0
    for theirs in headers:
        if theirs[0] == _MAGIC and theirs[1] == JOINED:
            joined += 1
        elif verdict is None:
            verdict = np.array(theirs)
        elif not (verdict[1] == _OK == theirs[1] and np.array_equal(verdict[_SIG_A], theirs[_SIG_A])):
            _merge(verdict, theirs, peer_is_lower=False)
    if verdict is None:
        verdict = np.array(headers[0])
    if verdict[1] != _MISMATCH:
        verdict[_RANK_B] = joined
    return verdict


def _compiled_steps(ctx: CommContext, plan: _Plan, dst, op) -> tuple:
    """Run the plan's steps in native.py's compiled loop while every header received is this rank's
    own. Returns (the first step left to Python, whether that step's header exchange has already
    completed); (0, False) where the loop does not serve this call."""
    compiled = plan._compiled()
    if compiled is None or timeline.active():  # (a timeline shows each wait: the Python loop)
        return 0, False
    if dst is not None and not (dst.flags.c_contiguous and dst.flags.writeable and dst.flags.aligned):
        return 0, False
    step, status = native.recursive_doubling(
        ctx, compiled, plan.acc, plan.incoming, dst, plan.send, plan.recv, op
    )
    if status == native.ASK_PYTHON:
        return step, True
    if status < 0:
        _failed(plan, plan.steps[step], MPI.Exception(-status))
        return step + 1, False
    return step, False


def _paired_step(ctx: CommContext, plan: _Plan, src, dst, op, exchanged=False) -> bool:
    """_lone_step through shared memory (shared_slots.py) without copies of its own: this rank's
    payload goes into its slot straight from src, and the peer's is folded from where it lies,
    compiled where it can be (native.slots_step). True when done: the peer's header was this rank's
    own and the result is in dst. False where what arrived is _complete's and _combine's (a mismatch,
    ranks in join(), a payload the peer sends apart): the peer's message is then copied into the
    plan's receive buffer and this rank's payload into the accumulator, where they read them."""
    pair = ctx.slots
    contiguous = src is not None and src.flags.c_contiguous
    compiled = plan.slots_compiled(ctx, op) if contiguous and not exchanged else None
    if exchanged:
        theirs = pair.wait(ctx)[1 - ctx.rank]  # (there already: not this rank's header)
    elif compiled is not None and dst.flags.c_contiguous and dst.flags.writeable and dst.flags.aligned:
        if native.slots_step(ctx, compiled, pair, src, dst) == native.DONE:
            return True
        theirs = pair.wait(ctx)[1 - ctx.rank]
    else:
        if src is None:
            pair.post(plan.header)
        elif contiguous:
            pair.post(plan.header, memoryview(host.buffer(src)).cast("B"))
        else:
            np.copyto(plan.acc, src)
            pair.post(plan.header, plan.acc_bytes)
        theirs = pair.wait(ctx)[1 - ctx.rank]
        alike = len(theirs) == len(plan.message) and theirs[_TAIL] == _TAIL_NONE
        if alike and theirs[_SAME] == plan.header_same:
            if src is not None:
                incoming = np.frombuffer(theirs, plan.acc.dtype, plan.acc.size, HEADER_BYTES)
                own = src if contiguous else plan.acc
                low, high = (incoming, own) if plan.steps[0].peer_is_lower else (own, incoming)
                host.reduce(dst, low, high, op)
            return True
    plan.recv_mv[: len(theirs)] = theirs
    if contiguous:
        plan.acc_bytes[:] = memoryview(host.buffer(src)).cast("B")
    return False


def _lone_step(ctx: CommContext, plan: _Plan, dst, op) -> tuple:
    """A plan's one exchange (p = 2, the payload in the header's message), inline: _complete and
    _combine's generality cost about as much as MPI's own allreduce of a few KB at p = 2
    (bench/RESULTS.md). Returns (1, False) when the step is done: the peer's header was this rank's
    own and the result is in dst, or an MPI error was recorded as a mismatch (_failed); (0, True)
    where the header that arrived is _combine's to fold (a mismatch, ranks in join())."""
    step = plan.steps[0]
    requests = step.requests
    try:
        MPI.Prequest.Startall(requests)
        if not MPI.Request.Testall(requests):
            ctx.waitall(requests)
    except MPI.Exception as exc:
        _failed(plan, step, exc, requests)
        return 1, False
    recv_mv = plan.recv_mv
    if plan.recv_same != plan.send_same or recv_mv[_RANK_B_BYTES] != _NONE_BYTES:
        return 0, True  # a mismatch, or ranks in join(): _combine's
    if plan.acc is not None:  # (None: the agreement before a ring, headers only)
        low, high = (plan.incoming, plan.acc) if step.peer_is_lower else (plan.acc, plan.incoming)
        host.reduce(dst, low, high, op)
    return 1, False


def _complete(ctx: CommContext, plan: _Plan, step: _Step, own, arrived=False) -> bool:
    """Run one step: the header's message (with the payload, unless it goes apart) each way, then a
    separate payload each way where the sender's header says one follows. False (and a recorded
    mismatch) when the peer's message did not fit: receives have room for any settings, so it came
    from another version of gflow. `arrived`: the header's messages have been exchanged already
    (by the compiled loop, which leaves a plan whose payload goes apart to Python)."""
    if ctx.slots and not arrived:
        return _complete_paired(ctx, plan, step, own)
    requests, waitall, recv_mv = step.requests, ctx.waitall, plan.recv_mv
    try:
        if arrived:
            requests = []
        else:
            MPI.Prequest.Startall(requests)  # (the header is posted before its payload: it arrives first)
        if plan.separate:
            if step.sends:
                requests = [*requests, _send_payload(plan, step, own)]
            if step.receives:  # the header first: the peer posts the receive of this rank's payload then
                waitall(requests[:1])
                requests = requests[1:]
                if _follows(recv_mv):
                    step.payload_in.Start()
                    requests = [step.payload_in, *requests]
            waitall(requests)
        else:
            waitall(requests)
            if step.receives and recv_mv[_FOLLOWS_BYTES] != _NONE_BYTES and _follows(recv_mv):
                requests = [step.payload_in]  # (a peer that sends its payload apart: it disagrees)
                step.payload_in.Start()
                waitall(requests)
    except MPI.Exception as exc:
        _failed(plan, step, exc, requests)
        return False
    return True


def _complete_paired(ctx: CommContext, plan: _Plan, step: _Step, own) -> bool:
    """_complete on a two-rank context whose header's messages travel in shared memory
    (shared_slots.py); payloads sent apart still go over MPI."""
    pair, requests = ctx.slots, []
    try:
        pair.post(plan.message)
        if plan.separate:
            requests.append(_send_payload(plan, step, own))
        pair.receive(ctx, plan.recv_mv)
        if plan.recv_mv[_FOLLOWS_BYTES] != _NONE_BYTES and _follows(plan.recv_mv):
            step.payload_in.Start()
            requests.insert(0, step.payload_in)
        if requests:
            ctx.waitall(requests)
    except MPI.Exception as exc:
        _failed(plan, step, exc, requests)
        return False
    return True


def _send_payload(plan: _Plan, step: _Step, own):
    """Start sending this rank's payload apart (from the accumulator by its persistent request, or
    straight from the caller's array before the first combine); the request."""
    if own is plan.acc:
        step.payload_out.Start()
        return step.payload_out
    return plan.comm.Isend([host.buffer(own), MPI.BYTE], step.peer, TAG_AGREE)


def _failed(plan: _Plan, step: _Step, exc: MPI.Exception, requests=None) -> None:
    """A step's MPI error: a receive that did not fit is recorded as a mismatch with the peer, once
    the step's other requests have finished; any other error raises."""
    # A truncated receive comes back as ERR_TRUNCATE, or, from a wait on several requests, as
    # ERR_IN_STATUS (the error is in the receive's status): on gflow's private communicator, the
    # only sender is a gflow rank, and its message can only be too long for another protocol.
    if exc.Get_error_class() not in (MPI.ERR_TRUNCATE, MPI.ERR_IN_STATUS):
        raise GflowError(f"MPI failed during the agreement exchange with rank {step.peer}: {exc}") from exc
    for request in step.requests if requests is None else requests:  # let the send half finish: the
        try:  # next call starts these again
            request.Wait()
        except MPI.Exception:
            pass
    mine = np.frombuffer(plan.send_mv[:HEADER_BYTES], dtype=np.int64).copy()
    if mine[1] == _OK:
        mine[1], mine[_SIG_B], mine[_RANK_B] = _MISMATCH, 0, step.peer
        plan.send_mv[:HEADER_BYTES] = mine.tobytes()


def _follows(recv_mv) -> int:
    """The bytes of payload a gflow peer's header says follow it in a message of their own; 0 for a
    header that says none, or that is not gflow's (its mismatch is recorded on combining)."""
    follows = int.from_bytes(recv_mv[_FOLLOWS_BYTES], sys.byteorder, signed=True)
    if 0 < follows <= MAX_SMALL_MESSAGE_BYTES and recv_mv[:8] == _MAGIC_BYTES:
        return follows
    return 0


def _combine(plan: _Plan, own, out, peer_is_lower: bool, op) -> None:
    """Fold the received header and payload into this rank's (own: its payload so far)."""
    send_mv, recv_mv = plan.send_mv, plan.recv_mv
    if plan.recv_same == plan.send_same:
        # The common case: the same state and signature on both sides.
        if peer_is_lower:
            send_mv[_RANK_A_BYTES] = recv_mv[_RANK_A_BYTES]
        if recv_mv[_RANK_B_BYTES] != _NONE_BYTES and send_mv[_STATE_BYTES] == _OK_BYTES:  # (joined ranks)
            _add_joined(send_mv, recv_mv)
        if own is not None:
            if peer_is_lower:
                host.reduce(out, plan.incoming, own, op)
            else:
                host.reduce(out, own, plan.incoming, op)
        return
    mine = np.frombuffer(send_mv[:HEADER_BYTES], dtype=np.int64).copy()
    theirs = np.frombuffer(recv_mv[:HEADER_BYTES], dtype=np.int64)
    if theirs[0] == _MAGIC and theirs[1] == JOINED and mine[1] == _OK:
        # A rank in join() that did not know the call yet: its payload counts as zeros (Horovod's; for
        # min and max the values that change nothing: host_ops.neutral_value)
        if own is not None:
            plan.incoming[...] = host.neutral_value(plan.incoming.dtype, op)
            host.reduce(out, plan.incoming, own, op) if peer_is_lower else host.reduce(
                out, own, plan.incoming, op
            )
        _add_joined(send_mv, recv_mv)
        return
    _merge(mine, theirs, peer_is_lower)
    send_mv[:HEADER_BYTES] = mine.tobytes()


def _add_joined(send_mv, recv_mv) -> None:
    """Add the peer's count of ranks in join() to this rank's header."""
    count = int.from_bytes(send_mv[_RANK_B_BYTES], sys.byteorder) + int.from_bytes(
        recv_mv[_RANK_B_BYTES], sys.byteorder
    )
    send_mv[_RANK_B_BYTES] = count.to_bytes(8, sys.byteorder)


# What ranks in join() serve: Horovod's rule (an allreduce, whatever the layer that made it).
SERVED_WHILE_JOINED = ("allreduce", "lazy")


def joined_refusal(header) -> str | None:
    """Why the callers refuse a call whose agreement (verdict `header`, _OK) ranks in join() took
    part in, or None: only an allreduce can (as in Horovod), and not Adasum's (its pairs combine
    vectors, which a joined rank has none of; it would wait for the joined rank for ever). The joined
    ranks ask it too: a refusal fails the callers' background channel, which they then leave."""
    collective = CODE_COLLECTIVE.get(int(header[_SIG_A][0]), "?")
    named = collective_in_words(header[_SIG_A][0])
    joined = f"while ranks are in join() ({int(header[_RANK_B])} of them)"
    if collective not in SERVED_WHILE_JOINED:
        return (
            f"{named} is not supported {joined}: as in Horovod, ranks that joined take part only in "
            "allreduces (with zeros)"
        )
    if CODE_ALGORITHM.get(int(header[_SIG_A][1]) & 0xFF) == "adasum":
        return f"Adasum is not supported {joined}: a joined rank has no vector to combine; use op=Average"
    return None


def _check_joined(header) -> None:
    """The call completed with ranks in join() taking part: raise NotServedInJoinError where it cannot."""
    refusal = joined_refusal(header)
    if refusal is not None:
        raise NotServedInJoinError(refusal)


def _record(header) -> tuple:
    """(rank_a, sig_a, rank_b, sig_b) of a header in the MISMATCH state."""
    return (int(header[_RANK_A]), tuple(header[_SIG_A]), int(header[_RANK_B]), tuple(header[_SIG_B]))


def _merge(mine, theirs, peer_is_lower: bool) -> None:
    """Fold header `theirs` into `mine` when they differ; the result is MISMATCH."""
    if theirs[0] != _MAGIC:
        # Not a gflow header at all: record it against an unknown sender.
        if mine[1] == _OK:
            mine[1], mine[_SIG_B], mine[_RANK_B] = _MISMATCH, 0, -1
        return
    low, high = (theirs, mine) if peer_is_lower else (mine, theirs)
    if low[1] == _OK and high[1] == _OK:
        record = (int(low[_RANK_A]), tuple(low[_SIG_A]), int(high[_RANK_A]), tuple(high[_SIG_A]))
    elif low[1] == _MISMATCH and high[1] == _MISMATCH:
        record = min(_record(low), _record(high), key=lambda r: (r[0], r[2]))
    else:
        record = _record(low if low[1] == _MISMATCH else high)
    mine[1] = _MISMATCH
    mine[_RANK_A], mine[_SIG_A], mine[_RANK_B], mine[_SIG_B] = record


def _two_calls(header) -> bool:
    """Whether a MISMATCH header records two gflow calls (else a message from another protocol)."""
    rank_a, sig_a, rank_b, sig_b = _record(header)
    return rank_b >= 0 and any(sig_b)


NO_CALL = 0  # a rank in join(): beside engine.STEP, IN_A_STEP and CALL in share_what_passed's kinds


def share_what_passed(ctx: CommContext, header, about: str | None, kind: int | None = None) -> tuple:
    """(every rank's words for the call it is in, "" where it has none; what each is in: NO_CALL or
    engine.running()'s kind), after a mismatch. Every rank holds the same verdict, so all of them take
    part (a rank in join() too, with `kind` NO_CALL: collectives/join.py); none does where a peer
    spoke another protocol, which may not."""
    if not _two_calls(header):
        return [], []
    if kind is None:
        kind = engine.running()
    mine = np.zeros(PASSED_BYTES + 1, np.uint8)
    text = ("" if about is None else str(about)).encode()[:PASSED_BYTES]  # (str: see signature.Words)
    mine[: len(text)] = np.frombuffer(text, np.uint8)
    mine[-1] = kind
    everyone = np.empty((ctx.size, PASSED_BYTES + 1), np.uint8)
    ctx.waitall([ctx.comm.Iallgather([mine, MPI.BYTE], [everyone, MPI.BYTE])])
    # (a character cut at the end: dropped)
    words = [bytes(row[:-1]).rstrip(b"\0").decode(errors="ignore") for row in everyone]
    return words, [int(row[-1]) for row in everyone]


def _fields(words: str) -> list:
    """A description's comma-separated fields; a comma inside brackets (a shape) or quotes (a name's
    repr) does not separate."""
    fields, depth, start, quote, escaped = [], 0, 0, None, False
    for i, c in enumerate(words):
        if quote is not None:  # (inside a repr: only its own closing quote ends it)
            escaped, quote = (not escaped and c == "\\"), (None if c == quote and not escaped else quote)
            continue
        if c in "'\"":
            quote = c
        depth += (c in "([{") - (c in ")]}")
        if depth == 0 and words.startswith(", ", i):
            fields.append(words[start:i])
            start = i + 2
    return [*fields, words[start:]]


def _given_on_one_side(fields_a, fields_b):
    """(the key=, A's fields, B's fields) where the two descriptions differ only by key=... fields
    that one of them has and the other lacks (name= given on one rank only), else None."""
    keys_a, keys_b = ({f.partition("=")[0] for f in fields if "=" in f} for fields in (fields_a, fields_b))
    only = sorted(keys_a ^ keys_b)
    if not only or len(only) > 1:
        return None
    key = only[0]
    rest = [[f for f in fields if f.partition("=")[0] != key] for fields in (fields_a, fields_b)]
    if rest[0] != rest[1]:
        return None
    said = [
        next((f for f in fields if f.partition("=")[0] == key), f"no {key}=")
        for fields in (fields_a, fields_b)
    ]
    return f"{key}= (given on one rank only)", *said


def _differing(words_a: str, words_b: str) -> tuple:
    """The fields in which two descriptions of one form differ (all of them, where the forms differ)."""
    a, b = _fields(words_a), _fields(words_b)
    if len(a) != len(b):
        return a, b
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x != y]
    return [x for x, _ in pairs], [y for _, y in pairs]


# Words that are a call of their own (gflow.torch's barrier(): a tiny allreduce under its own fingerprint)
_CALL_ALONE = re.compile(r"[a-z_]+\(\)")
_OF_SHAPE = re.compile(r"(?:an array|a tensor) of shape (\(.*?\))(.*)")
# The i-th tensor of a grouped call (gflow.torch's grouped_allgather: gather._agreed's words)
_MEMBER = re.compile(r"tensors=a list of \d+ \(\[(\d+)\] of it\)")
# gflow.torch's grouped calls: "[name='...', ]a list of N tensors [...]" (the name as repr() writes it)
_LIST = re.compile(r"""(?:name=(?:'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"), )?a list of (\d+) tensors? \[""")


def _list_lengths(words_a: str, words_b: str) -> tuple | None:
    """The lengths of two grouped calls' lists, from gflow.torch's words, where they differ; None where
    they do not, or either call passed no list."""
    found = [_LIST.match(words) for words in (words_a, words_b)]
    lengths = None if None in found else tuple(int(match[1]) for match in found)
    return lengths if lengths and lengths[0] != lengths[1] else None


def _field_names(fields_a, fields_b) -> str:
    """What pairs of differing fields are about: "name=" for name='a' against name='b', "the shape" or
    "the dtype" for arrays that differ in it (gflow.torch's int8 travels as int32), else "what it passed"."""
    names = []
    for a, b in zip(fields_a, fields_b, strict=True):
        key = a.partition("=")[0]
        shapes = [_OF_SHAPE.fullmatch(f) for f in (a, b)]
        if key.isidentifier() and b.startswith(key + "="):
            names.append(key + "=")
        elif all(shapes):
            (shape_a, rest_a), (shape_b, rest_b) = (m.groups() for m in shapes)
            names.append(
                "the shape"
                if rest_a == rest_b
                else "the dtype"
                if shape_a == shape_b
                else "the shape and dtype"
            )
        else:
            names.append("what it passed")
    return " and ".join(dict.fromkeys(names))


def _mismatch_message(header, world=lambda ranks: "", passed=()) -> str:
    """One line saying what the two ranks recorded disagree on (their world ranks too, on another
    communicator), then each one's call in full; `passed`: each rank's words for its call, where the
    ranks shared them (share_what_passed)."""
    rank_a, sig_a, rank_b, sig_b = _record(header)
    first = f"rank {rank_a} {describe(sig_a)}"
    if not _two_calls(header):
        who = "a peer" if rank_b < 0 else f"rank {rank_b}"
        second = f"{who} sent a message this protocol does not accept (other gflow settings or version?)"
        return f"ranks disagree: {first}; {second}"
    what, said_a, said_b = difference(sig_a, sig_b, world)
    words_a, words_b = (passed[rank_a], passed[rank_b]) if passed else ("", "")
    rejected = [int(sig[7]) == SIG_REJECTED for sig in (sig_a, sig_b)]
    if any(rejected):  # (the rejecting rank shared its error's first line)
        said_a, said_b = (
            f"rejected its own arguments ({words})" if refused and words else said
            for refused, words, said in zip(rejected, (words_a, words_b), (said_a, said_b), strict=True)
        )
    elif words_a and words_b and words_a != words_b:
        if any(_CALL_ALONE.fullmatch(words) for words in (words_a, words_b)):  # (a barrier() against a call)
            what = "the collective"
            said_a, said_b = (
                f"called {words if _CALL_ALONE.fullmatch(words) else collective_in_words(sig[0])}"
                for words, sig in ((words_a, sig_a), (words_b, sig_b))
            )
        elif what != "the collective" and (lengths := _list_lengths(words_a, words_b)):
            what = "the number of tensors in the list"  # (not the lists' element counts)
            said_a, said_b = (f"passed {n}" for n in lengths)
        elif int(sig_a[0]) == int(sig_b[0]) == COLLECTIVE_CODE["sparse"]:  # (CSC: sizes, a checksum)
            what = "the gradient or the CSC settings"
            said_a, said_b = (f"passed {', '.join(fields)}" for fields in _differing(words_a, words_b))
        elif settings_differ(sig_a, sig_b):
            said_a, said_b = (f"has {', '.join(fields)}" for fields in _differing(words_a, words_b))
        elif said_b == "another":  # (the signature holds a checksum: say which of the words differ)
            apart = first_push_apart(words_a, words_b)
            fields_a, fields_b = _differing(words_a, words_b)
            one_side = _given_on_one_side(fields_a, fields_b) if len(fields_a) != len(fields_b) else None
            if apart is not None:
                said_a, said_b = apart
            elif one_side is not None:
                what, said_a, said_b = one_side
                said_a, said_b = f"passed {said_a}", f"passed {said_b}"
            elif len(fields_a) == len(fields_b) and fields_a:
                what = _field_names(fields_a, fields_b)
                said_a, said_b = (f"passed {', '.join(fields)}" for fields in (fields_a, fields_b))
            else:
                said_a, said_b = f"passed {words_a}", f"passed {words_b}"
        elif what == "the dtype" and "compression=" in words_a + words_b:  # (the wire's dtype differs)
            what = "the dtype on the wire (the array's own, or the one compression= sends)"
            said_a, said_b = f"{said_a} ({words_a})", f"{said_b} ({words_b})"
    members = [_MEMBER.search(words) for words in (words_a, words_b)]
    if all(members) and members[0].group(1) == members[1].group(1) and not what.startswith("tensors="):
        what += f" of tensors[{members[0].group(1)}]"  # (which tensor of the list, in the first line)
    headline = (
        f"ranks disagree on {what}: rank {rank_a}{world([rank_a])} {said_a}, "
        f"rank {rank_b}{world([rank_b])} {said_b}"
    )
    details = [
        f"  rank {rank}{world([rank])} {describe(sig, other)}"
        + (f"; {'its error:' if refused else 'it passed'} {words}" if words else "")
        for rank, sig, other, words, refused in (
            (rank_a, sig_a, sig_b, words_a, rejected[0]),
            (rank_b, sig_b, sig_a, words_b, rejected[1]),
        )
    ]
    lazy = [int(sig[0]) == COLLECTIVE_CODE["lazy"] for sig in (sig_a, sig_b)]
    if lazy[0] != lazy[1] and not any(rejected):
        details[1] += ";\n" + _STEP_MET_ANOTHER_CALL
    return "\n".join([headline, details[0] + ";", details[1]])


# helper-92: every rank made the async call, between pushes, and the ranks pushed in other orders
# (DataParallel holds a push back until those before it in its order came): "rank 1 called
# allreduce" alone pointed at a call that every rank had made.
_STEP_MET_ANOTHER_CALL = (
    "  a gradient step met another call: one made on some ranks only, or at another point of the step "
    "(an async call between a step's pushes meets whatever segment those pushes fired, which differs "
    "between ranks that push in other orders): make it before the step's first push or after its "
    "synchronize()/flush()"
)
