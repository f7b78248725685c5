"""Ranks in join() (Horovod's uneven data): a rank that ran out of data takes part in the other ranks'
allreduces with zeros until every rank has joined (in a min or max, with values that change nothing:
host_ops.neutral_value; "zeros" below means those).

Every collective of gflow starts with the agreement of collectives/recursive_doubling.py (its header
carries the call's signature, and on the latency path the payload too). A joined rank cannot know
which call comes next, so it takes part in each agreement without knowing it: it runs the same
recursive-doubling schedule with a JOINED header and no payload (which the others count as zeros),
and learns the call from the first real header that reaches it; from then on it sends what it has
combined, as any rank. When the agreement ends with a call (every rank holds the same merged header),
a bandwidth allreduce goes on with its ring or hierarchical allreduce, this rank sending zeros; a
latency-path allreduce is already complete. Then it waits for the next agreement. An agreement in
which every rank is joined ends join(). Other collectives fail on the ranks that called them
(recursive_doubling._check_joined: Horovod's rule), and the joined ranks wait on.

A rank in join() serves one channel per call of serve(): join() runs it on the caller's channel and
on the background one at once (the others may use either), and on both channels of each
sub-communicator it is given (gflow.torch's process sets), each on a thread of its own.
"""

import threading
import time
import weakref
from contextlib import contextmanager
from functools import partial

import numpy as np
from mpi4py import MPI

from ..arrays import host_ops as host
from ..errors import GflowError
from ..runtime import engine, stall
from ..runtime.config import MAX_SMALL_MESSAGE_BYTES
from ..runtime.context import TAG_AGREE, CommContext, context
from ..runtime.signature import CODE_ALGORITHM, CODE_OP, SIG_REJECTED, code_dtype
from ..runtime.waiting import polite_wait_until, polite_waitall, watched
from . import hierarchical, ring
from .dispatch import settle_auto
from .operations import allreduce_on
from .recursive_doubling import (
    _FOLLOWS,
    _MAGIC,
    _OK,
    _RANK_A,
    _RANK_B,
    _SIG_A,
    HEADER_BYTES,
    HEADER_WORDS,
    JOINED,
    NO_CALL,
    SEPARATE_PAYLOAD_BYTES,
    _merge,
    connect_slots,
    end_where_a_step_met_strays,
    joined_refusal,
    node_fold_bytes,
    node_verdict,
    scatter_gather,
    share_what_passed,
)


def join(comm=None, subsets=()) -> int:
    """This rank has no more data: until every rank of comm has called join(), take part with zeros
    in the others' allreduces, on the caller's channel and gflow's background one at once (the others
    may use either: blocking calls, async ones, LazyAllreduce's segments); return the rank that
    called join() last, by each rank's wall clock at the call (exact on one node; ties: the lowest).
    A rank that joins first waits for the async work it started (it runs before).

    subsets: sub-communicators of comm's ranks that this rank is in (gflow.torch's process sets),
    whose allreduces it serves the same way meanwhile; every member of each passes it (an agreement
    there ends once all of them are in join()), or the others' calls there wait for ever. Under Open
    MPI, gflow's duplicates of each subset must be made on all its members before (made in the serving
    threads, or here while the others wait in a call on comm, it hangs): gflow.torch makes a set's
    when it registers it (process_sets._adopt)."""
    arrival = time.time()
    subsets = list(subsets)
    parent = context(comm)
    parent.check_usable()  # (before its background channel is made or used)
    others = [context(sub) for sub in subsets]
    for ctx in others:
        ctx.check_usable()
    background = parent.background()
    # (the background channels once the async work queued before has run: on the engine thread)
    handle = engine.submit(
        "join",
        partial(_serve_backgrounds, [parent] + others),
        ctx=background,
        on_failure=parent.reset_background,
    )
    try:
        _serve_together([parent] + others)
        handle.wait()
    except BaseException as interrupted:
        handle.error_said_elsewhere()  # (its failure, if any, follows from the one raised here)
        if not isinstance(interrupted, GflowError):  # (Ctrl-C: the other channels' serve would hold
            for ctx in [parent] + others:  # gflow's threads, and every async call, for ever)
                stall.give_up(ctx.background())
            for ctx in others:
                stall.give_up(ctx)
        raise
    times = np.full(parent.size, -np.inf)
    times[parent.rank] = arrival
    times = allreduce_on(parent, times, "max")
    last = int(np.argmax(times))
    everyone = MPI.COMM_WORLD if comm is None else comm
    _tell_listeners([(everyone, last)] + _last_of_each(parent, subsets, times))
    return last


# Objects told, when a join() on their communicator ends, which of its ranks joined last
_LISTENERS = weakref.WeakKeyDictionary()


def tell_after_join(listener, comm) -> None:
    """Have listener.joined(last) called when a join() on comm (a subset of one included) ends, with
    comm's rank that joined last (it ran every step): LazyAllreduce's threshold tuning follows it."""
    _LISTENERS[listener] = MPI.COMM_WORLD if comm is None else comm


def _tell_listeners(lasts: list) -> None:
    for listener, comm in list(_LISTENERS.items()):
        for joined, last in lasts:
            if comm == joined:
                listener.joined(last)


def _last_of_each(parent: CommContext, subsets: list, times) -> list:
    """(subset, its rank that joined last) for each subset, from every rank's arrival `times`."""
    if not subsets:
        return []
    everyone = parent.comm.Get_group()
    lasts = []
    for sub in subsets:
        group = sub.Get_group()
        members = group.Translate_ranks(list(range(group.Get_size())), everyone)
        group.Free()
        lasts.append((sub, int(np.argmax(times[members]))))
    everyone.Free()
    return lasts


def _serve_backgrounds(parents: list) -> None:
    """Serve the background channels of `parents` together, as they are once the async work queued
    before join() has run. Where that work failed, the channel is left for a fresh one, as the others
    leave it at their next async call (served as it was, it met none of their calls again: a hang,
    helper-72)."""
    channels = []
    for parent in parents:
        background = parent.background()
        if background.failed is not None:
            parent.reset_background(background)
            background = parent.background()
        channels.append(background)
    _serve_together(channels)


def _serve_together(channels: list) -> None:
    """serve() the first channel on this thread and each other one on a thread of its own, until
    all of them end (in join(): the others are a sub-communicator's)."""
    helpers = [_Serving(channel) for channel in channels[1:]]
    with _politely(channels[0]):
        serve(channels[0])
    for helper in helpers:
        helper.wait()


@contextmanager
def _politely(ctx: CommContext):
    """ctx's waits sleep between polls meanwhile, as the background channel's do. A joined rank waits
    most of the time (the others compute between their calls), and a thread polling without sleep
    took the cores of the ranks still training: at p = 3 on 2 cores, 0.8 of a core for the caller's
    channel (stop 58), and their work ran at half speed and less with a set's channel too (helper-72).
    The others' call after a long computation finds this rank asleep for at most the longest pause
    (1.3 ms by default); their allreduces' median latency next to a joined rank was no worse for it
    (bench/RESULTS.md, "A joined rank's waits")."""
    if ctx.is_background:
        yield
        return
    spinning = ctx.waitall, ctx.wait_until
    ctx.waitall, ctx.wait_until = watched(polite_waitall), watched(polite_wait_until)
    try:
        yield
    finally:
        ctx.waitall, ctx.wait_until = spinning


class _Serving:
    """serve(ctx) on a thread of its own (politely): a sub-communicator's channel, served beside
    comm's."""

    def __init__(self, ctx: CommContext):
        self.ctx, self.error = ctx, None
        self._thread = threading.Thread(target=self._run, name=f"gflow-join ({ctx.size} ranks)", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with _politely(self.ctx):
                serve(self.ctx)
        except BaseException as error:  # noqa: BLE001 - raised in join() on the caller's thread
            self.error = error

    def wait(self) -> None:
        self._thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def serve(ctx: CommContext) -> None:
    """Take part, with zeros, in every allreduce of ctx's other ranks until all of them are in
    join() too (their agreement then holds only JOINED headers). An exception of the program's
    (Ctrl-C, a signal handler's) in it may leave this rank's message with the others: ctx then
    refuses its next call (check_usable), and so does this one on a context refused already."""
    ctx.check_usable()
    try:
        _serve(ctx)
    except GflowError:
        raise
    except BaseException:  # (before its duplicates were made, in its first collective, which
        ctx.abandoned = ctx.entered if ctx._made else 1  # stall.abandoned counted back: helper-88)
        raise


def _serve(ctx: CommContext) -> None:
    while True:
        # Each exchange is counted as the others count their calls, before it: the stall inspector
        # then names a rank that left without joining (it can never post), and an interrupt is
        # charged to ctx, not to a context this thread entered before.
        stall.entered(ctx, None)
        header, complete = _exchange(ctx)
        if header[1] == JOINED:  # (every rank in join(): no call of theirs, none counted)
            ctx.entered -= 1
            return
        sig = header[_SIG_A]
        if header[1] != _OK:  # the callers raise, saying what each rank passed: this one, nothing
            _, kinds = share_what_passed(ctx, header, "nothing: it is in join(), out of data", NO_CALL)
            ended = end_where_a_step_met_strays(ctx, kinds, "while this rank was in join()")
            if ended is not None:  # (join() ends with it here: the others' join() is refused)
                raise GflowError(ended)
            ctx = _after_failure(ctx, "ranks disagree")
            continue
        refusal = joined_refusal(header)
        if refusal is not None:  # (a rejection too, of a collective a joined rank does not serve)
            ctx = _after_failure(ctx, refusal)
            continue
        if int(sig[7]) == SIG_REJECTED:
            continue  # each rank raises its own error (the others' were rejections as well)
        algorithm = CODE_ALGORITHM.get(int(sig[1]) & 0xFF)
        if complete or algorithm == "recursive_doubling":
            continue  # (complete: its payload travelled in the exchange)
        dtype, count = code_dtype(sig[3]), int(sig[2])
        # The op as the others run it: the owner of a chunk divides a mean (this rank owns some),
        # but 2-byte floats were divided first and are summed (dispatch._predivided).
        op = CODE_OP.get(int(sig[4]), "sum")
        if op == "mean" and dtype.itemsize == 2:
            op = "sum"
        memory = "device" if int(sig[6]) == 2 else "host"
        if algorithm == "auto":
            algorithm = settle_auto(ctx, count * dtype.itemsize, memory)
        if algorithm == "hierarchical":
            _hierarchical_zeros(ctx, count, dtype, op, memory)
        else:
            zeros = host.neutral(count, dtype, op)
            ring.allreduce(ctx, zeros, zeros, host, op)


def _after_failure(ctx: CommContext, why: str) -> CommContext:
    """The context to serve next after a call that fails on the callers with a GflowError: the same
    one, or for a background context a fresh one, as the callers make at their next async call (a
    failed background collective makes every rank leave its channel: CommContext.check_usable;
    serving the old one, this rank would never meet them again)."""
    if not ctx.is_background:
        return ctx
    ctx.failed = ctx.failed or f"a call served in join() failed on the other ranks: {why}"
    parent = ctx.parent
    parent.reset_background(ctx)
    return parent.background()


def _hierarchical_zeros(ctx: CommContext, count: int, dtype, op: str, memory: str) -> None:
    """This rank's zeros in the others' hierarchical allreduce: for device arrays, device zeros with
    the device ops and this rank's transport, as the callers run it, so that the node phase's peer
    memory (made collectively, per memory and transport) is the same on every rank of the node."""
    if memory == "host":
        zeros = host.neutral(count, dtype, op)
        hierarchical.allreduce(ctx, zeros, zeros, host, op, memory, None)
        return
    from ..cuda.arrays import DEVICE

    transport = DEVICE.transport()
    zeros = DEVICE.ops.neutral(count, dtype, op)
    if transport.name == "staged":
        hierarchical.allreduce(ctx, zeros, zeros, DEVICE.ops, op, memory, transport)
    else:
        hierarchical.allreduce(ctx, zeros, zeros, transport.ops, op, memory, None)


def _steps(ctx: CommContext) -> list:
    """(peer, peer_is_lower, action, receives, sends) for each step, as recursive_doubling._Plan's."""
    fold, rounds = ctx.rd_fold, ctx.rd_rounds
    if fold is not None and fold[0] == "send":
        return [(fold[1], False, "take", True, True)]
    steps = [(fold[1], True, "combine", True, False)] if fold is not None else []
    steps += [(peer, lower, "combine", True, True) for peer, lower in rounds]
    if fold is not None:
        steps.append((fold[1], False, "none", False, True))
    return steps


def _payload_spec(header):
    """(dtype, op) of the call a header names."""
    sig = header[_SIG_A]
    op = CODE_OP.get(int(sig[4]), "sum")
    return code_dtype(sig[3]), "sum" if op == "mean" else op


def _exchange(ctx: CommContext):
    """One agreement as a joined rank: (the merged header every rank ends with, whether the call is
    complete with it: a bandwidth allreduce reduced in the slots with its agreement)."""
    comm = ctx.comm
    mine = np.zeros(HEADER_WORDS, np.int64)
    mine[0], mine[1], mine[_RANK_A], mine[_RANK_B] = _MAGIC, JOINED, ctx.rank, 1
    acc = None  # the payload combined so far, once a peer's header said there is one
    if ctx.slots is None:  # (this rank's first exchange on ctx: the others' begins so too)
        connect_slots(ctx)
    if ctx.slots and ctx.size > 2:
        return _node_exchange(ctx, mine)
    room = np.empty(HEADER_BYTES + MAX_SMALL_MESSAGE_BYTES, np.uint8)
    pair = ctx.slots  # (two ranks on one host: the header's messages in shared memory, shared_slots.py)
    for peer, lower, action, receives, sends in _steps(ctx):
        separate = acc is not None and acc.nbytes >= SEPARATE_PAYLOAD_BYTES
        mine[_FOLLOWS] = acc.nbytes if separate else 0
        requests = []
        if receives and not pair:
            header_in = comm.Irecv([room, MPI.BYTE], peer, TAG_AGREE)
        if sends:
            message = mine.tobytes() + (b"" if acc is None or separate else acc.tobytes())
            if pair:
                pair.post(message)
            else:
                requests.append(comm.Isend([message, MPI.BYTE], peer, TAG_AGREE))
            if separate:
                requests.append(comm.Isend([acc, MPI.BYTE], peer, TAG_AGREE))
        theirs = payload = None
        if receives:
            if pair:
                count = pair.receive(ctx, memoryview(room))
            else:  # (watched waits, as every wait on a peer: Ctrl-C and a departed peer end them)
                status = MPI.Status()
                ctx.wait_until(partial(header_in.Test, status))
                count = status.Get_count(MPI.BYTE)
            theirs = np.frombuffer(room[:HEADER_BYTES].tobytes(), np.int64).copy()
            nbytes = int(theirs[_FOLLOWS]) if theirs[_FOLLOWS] > 0 else count - HEADER_BYTES
            if theirs[_FOLLOWS] > 0:
                ctx.waitall([comm.Irecv([room[HEADER_BYTES:], MPI.BYTE], peer, TAG_AGREE)])
            if nbytes > 0 and theirs[1] == _OK:
                dtype, _ = _payload_spec(theirs)
                payload = room[HEADER_BYTES : HEADER_BYTES + nbytes].view(dtype).copy()
        ctx.waitall(requests)
        if action == "take":  # (the fold's sender: its partner's verdict and result, as they are)
            mine = theirs
        elif action == "combine":
            mine, acc = _combine(mine, acc, theirs, payload, lower)
    return mine, False


def _node_exchange(ctx: CommContext, mine):
    """_exchange through the slots of a context of three ranks or more on one host
    (recursive_doubling._node_step): the verdict every rank folds from every rank's header. Where the
    others' payloads came with their headers, the call is complete with this exchange, or with the
    reduce-scatter and allgather in the slots that follow it (recursive_doubling.scatter_gather),
    where this rank folds its share with zeros of its own. Where a latency-path payload was too large
    for the slots, the others reduce it by the ring after the headers agree: this rank takes part
    with zeros."""
    slots = ctx.slots
    slots.post(mine.tobytes())
    messages = slots.wait(ctx)
    headers = [np.frombuffer(m, np.int64, HEADER_WORDS) for m in messages]
    verdict = node_verdict(headers)
    if verdict[1] != _OK or joined_refusal(verdict) is not None or int(verdict[_SIG_A][7]) == SIG_REJECTED:
        return verdict, False  # (refused, or every other rank rejected its own arguments: no payload)
    dtype, op = _payload_spec(verdict)
    count = int(verdict[_SIG_A][2])
    if verdict[_FOLLOWS]:
        zeros = host.neutral(count, dtype, op)
        ring.allreduce(ctx, zeros, zeros, host, op)
        return verdict, False
    if all(len(m) == HEADER_BYTES for m in messages):  # (headers alone: an agreement before a ring)
        return verdict, False
    if count * dtype.itemsize > node_fold_bytes(ctx.size):  # (within it, every rank folded every payload)
        joined = [h[1] == JOINED for h in headers]
        scatter_gather(ctx, messages, dtype, count, None, None, op, joined)
    return verdict, True


def _combine(mine, acc, theirs, payload, peer_is_lower: bool):
    """Fold a peer's header and payload into this joined rank's (JOINED headers count as zeros)."""
    if theirs[0] != _MAGIC or mine[1] not in (_OK, JOINED) or theirs[1] not in (_OK, JOINED):
        _merge(mine, theirs, peer_is_lower)  # (a mismatch, recorded as the others record it)
        return mine, acc
    joined = int(mine[_RANK_B]) + int(theirs[_RANK_B])
    if theirs[1] == JOINED:
        if acc is not None:  # zeros from the peer
            acc = _reduce(acc, _neutral_like(acc, mine), peer_is_lower, mine)
    elif mine[1] == JOINED:  # the first real header: adopt the call, this rank's share is zeros
        mine[1], mine[_SIG_A], mine[_RANK_A] = _OK, theirs[_SIG_A], theirs[_RANK_A]
        if payload is not None:
            acc = _reduce(_neutral_like(payload, mine), payload, peer_is_lower, mine)
    elif tuple(mine[_SIG_A]) == tuple(theirs[_SIG_A]):
        mine[_RANK_A] = min(mine[_RANK_A], theirs[_RANK_A])
        if acc is not None and payload is not None:
            acc = _reduce(acc, payload, peer_is_lower, mine)
    else:
        _merge(mine, theirs, peer_is_lower)
        return mine, acc
    mine[_RANK_B] = joined
    return mine, acc


def _neutral_like(a, header):
    """What this joined rank contributes to the call a header names, shaped like a (zeros for a sum)."""
    _, op = _payload_spec(header)
    return host.neutral(a.size, a.dtype, op)


def _reduce(own, incoming, peer_is_lower: bool, header):
    """own op incoming, the lower rank's operand first (as every rank combines)."""
    _, op = _payload_spec(header)
    out = np.empty_like(own)
    if peer_is_lower:
        host.reduce(out, incoming, own, op)
    else:
        host.reduce(out, own, incoming, op)
    return out
