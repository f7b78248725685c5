"""Per-communicator state: gflow's private duplicate, the fixed schedules, reusable scratch buffers.

One CommContext per user communicator, made on first use and cached on that communicator as an MPI
attribute, so it is freed with it and a reused handle never finds a stale one. Traffic on the
private duplicate can never match the user's own messages.

This file is long: a context's duplicates, its background channel and what a failure leaves usable
(crossed waits, interrupts) are one state machine, read together.
"""

import threading
import time
import weakref

import numpy as np
from mpi4py import MPI

from ..errors import GflowError
from . import stall
from .waiting import (
    caller_wait_until,
    caller_waitall,
    polite_wait_until,
    polite_waitall,
    wait_for_duplicates,
    watched,
)

# Tags inside the private communicator; one per phase, so a protocol bug shows up as a mismatch.
TAG_AGREE = 11
TAG_RING_RS = 12
TAG_RING_AG = 13
TAG_ALLTOALL = 14
TAG_ADASUM = 15

# A context's duplicate whose Idup is not posted yet: a user communicator's first background context,
# made in its parent's sequence (CommContext.make_duplicates)
_NOT_POSTED = "not posted"
# ... and one whose Idup MPI failed (out of communicators, say): nothing to wait for or free
_REFUSED = "refused by MPI"


def rd_schedule(rank: int, size: int):
    """Recursive-doubling roles for `rank`, with the usual fold for sizes that are not powers of two.

    Returns (fold, rounds): fold is None, ("send", peer) for an even rank below 2*rem that hands its
    data to rank+1 and waits for the result, or ("recv", peer) for the odd rank that takes it;
    rounds lists (peer, peer_is_lower) for the exchanges among the remaining power-of-two group.
    """
    p2 = 1
    while p2 * 2 <= size:
        p2 *= 2
    rem = size - p2
    if rank < 2 * rem:
        if rank % 2 == 0:
            return ("send", rank + 1), []
        fold, newrank = ("recv", rank - 1), rank // 2
    else:
        fold, newrank = None, rank - rem
    rounds = []
    mask = 1
    while mask < p2:
        peer_new = newrank ^ mask
        peer = peer_new * 2 + 1 if peer_new < rem else peer_new + rem
        rounds.append((peer, peer_new < newrank))
        mask <<= 1
    return fold, rounds


class CommContext:
    """gflow's view of one user communicator."""

    def __init__(self, comm: MPI.Intracomm, background: bool = False, own: bool = False, by_parent=False):
        """own: comm is gflow's already (a node or cross-node communicator of the hierarchical
        allreduce): talk on it as it is, and free it with the context. by_parent: a background
        context whose duplicates its parent makes with its own (make_duplicates)."""
        self.user_handle = comm.handle
        # Idup, not Dup: making a context must not block, or an async call whose peers have not
        # started theirs yet could never return. The duplicate is waited for on first use (.comm).
        self._user_comm = comm
        if own:
            self._comm, self._pending = comm, None
        elif by_parent:
            self._comm, self._pending = None, _NOT_POSTED
        else:
            self._comm, self._pending = comm.Idup()
        self.by_parent = by_parent
        # A user communicator's context makes its first background context's duplicates with its own
        self._eager_background = not (own or background)
        self._making_lock = threading.Lock()  # (held while the duplicates are made: either thread may)
        self._background_lock = threading.Lock()  # (never held while waiting)
        self._monitor_pending = None  # (the monitor's Idup, between its post and its completion)
        # Whether make_duplicates has finished (set last: a thread that sees it may use the duplicates
        # at once, without the lock; _pending alone is cleared before the monitor's Idup is posted)
        self._made = own
        self.making_interrupted = False  # (an exception of the program's in the wait for the duplicates)
        self.making_error = None  # (what failed making them in for_async)
        # The stall inspector's questions travel on a duplicate of their own (none for gflow's own
        # node and cross-node communicators: their collectives are counted on the caller's context),
        # made from the first once it exists: Open MPI 4.1 can hang with two Idups of one communicator
        # outstanding (ompi#2025; seen here as one rank never finishing its Idup).
        self.monitor_comm, self._wants_monitor = None, not own
        self.entered = 0  # collectives begun on this context (stall.py)
        self.stall_report = (-1, 0)  # (collective, whether this rank reports its stall: stall.py)
        self.departed = {}  # rank -> collectives it completed here before its process exited
        self.abandoned = None  # the collective this rank left unfinished (stall.abandoned)
        self.interrupted = {}  # rank -> the collective it left unfinished here, as it told (stall.py)
        # Ranks that left ({rank: when this rank heard}), shared by a user communicator's context and
        # its background contexts: a fresh background context (after a failed one), or one whose peers
        # said goodbye only on the other context, must know them before its peers can say so.
        self.gone = {}
        self.heard_departures = 0  # (stall.hear_elsewhere: the news it looked at)
        # Crossed waits (stall._check_crossed), shared the same way: peers that said they wait in a
        # blocking collective here that this rank has not entered ({rank: (its place on its background
        # context, which one, its collective here, whether over a fresh one after a failure)}), the
        # error of one this rank found itself; and how many cut
        # this rank's steps short here, with the last one's error (stall.cut_steps, LazyAllreduce)
        self.crossed, self.crossed_here = {}, None
        self.crossed_cause = None  # (why, as the peer that told this rank of them found: stall._answer)
        self.steps_cut, self.cut_why = 0, None
        # Why no rank makes another collective on this communicator, where a step met another kind of
        # call on the background channel (collectives/recursive_doubling.end_where_a_step_met_strays):
        # like crossed waits, which of the ranks' steps pair next is unknown. Checked where a call starts.
        self.ended = None
        # The LazyAllreduce kits whose step here has begun and not ended (in_a_step): weakly, a kit
        # lives as the program's
        self.kits = weakref.WeakSet()
        # Background contexts made for this one so far; a background context's own number among them
        # (crossed waits name the one they are about: a peer's fresh one is not the one it was told of)
        self.backgrounds_made = self.generation = 0
        self.parent = None  # for a background context: the context it duplicates (see .comm)
        self.last_sig = None
        self.agreed_unvalidated = False  # (collectives/recursive_doubling.wants_agreement)
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.rd_fold, self.rd_rounds = rd_schedule(self.rank, self.size)
        self._scratch = {}
        self.rd_plans = {}  # recursive_doubling._Plan by call signature
        self.small_calls = {}  # collectives/latency.py's fast lane, by (dtype, shape, op, ...)
        self.native_phases = None  # collectives/native.py's arrays for the compiled ring loops
        self._background = None
        # The background context the first failure's replaces, its duplicates made with the first's
        # (make_duplicates): no rank then waits for the others' next async call to make one (helper-84)
        self._spare = self._new_background(by_parent=True) if self._eager_background else None
        self._retired = None  # the last background context dropped after a failure (reset_background)
        self.topology = None  # collectives/topology.py, found on first use
        self.hierarchy = None  # collectives/hierarchical.py's communicators and window
        self.is_background = background
        self.failed = None  # set on a background context by its first failed collective
        self.retired = False  # dropped after a failure, its monitor duplicate kept (reset_background)
        # How this context waits for its messages: the caller's thread polls, yielding between polls
        # (lowest latency); the engine thread polls and sleeps in between, so the caller's computation
        # keeps the core. Both notice a peer that has left (stall.check_waiting).
        self.waitall = watched(polite_waitall if background else caller_waitall)
        self.wait_until = watched(polite_wait_until if background else caller_wait_until)
        # The ranks' slots in shared memory (collectives/shared_slots.py): None until the set-up in
        # the first exchange, then SharedSlots or False (MPI's messages)
        self.slots = None

    def check_usable(self) -> None:
        """Refuse to communicate on a background context after one of its collectives failed.

        Ranks then may have different numbers of operations queued (one pushed a tensor more, say):
        each rank fails the rest of its queue here, without talking, instead of waiting for peers
        who will never make those calls. Every rank saw the same failure, at the same position.
        A caller's context fails only where it left a collective unfinished (crossed waits: stall.py):
        its messages are still posted, so no later collective on it could be trusted. So does a
        context whose collective was interrupted (Ctrl-C, a signal handler's exception) in a wait or
        an exchange through shared memory (stall.abandoned): its message may be with the others
        already (an MPI message sent eagerly, a slot of collectives/shared_slots.py), which take it
        for their own call, and this rank's next call would meet their next, silently."""
        if self.ended is not None:
            raise GflowError(self.ended)
        if self.failed is not None:
            channel = "background " if self.is_background else ""
            raise GflowError(f"an earlier {channel}collective on this communicator failed: {self.failed}")
        if self.abandoned is not None and self.size > 1:
            raise GflowError(
                f"collective #{self.abandoned} on this communicator was interrupted after its message "
                "may have reached the other ranks (they take it for their own call): no later "
                "collective on it can meet theirs. Use another communicator"
            )

    def channel_generation(self) -> int:
        """The generation of the background context this rank's next async call goes to (the
        current one, or the fresh one made after a failure). A step whose channel was replaced
        after it began sends nothing more (LazyAllreduce._check_cut, channel_replaced)."""
        return self.backgrounds_made + (self._background is None)

    def channel_replaced(self, generation: int) -> str | None:
        """Why the background channel of `generation` was replaced since (its failure), or None."""
        if self.channel_generation() == generation:
            return None
        return f"its background channel failed ({self._retired.failed if self._retired else 'unknown'})"

    def in_a_step(self) -> bool:
        """Whether a LazyAllreduce on this communicator has begun a step that has not ended: an async
        call queued now is one inside that step (engine.IN_A_STEP). Its mismatch with a peer's step
        ends the communicator; with a peer's rejection of a bad push in that step, it fails the step
        on every rank alike (recursive_doubling._steps_met_strays)."""
        return bool(self.kits)  # (asked by every async call: a kit leaves it as its step ends)

    def sendrecv(self, sendbuf, dest: int, sendtag: int, recvbuf, source: int, recvtag: int) -> None:
        """Sendrecv, waiting the way this context waits (see waitall)."""
        comm = self.comm
        self.waitall([comm.Irecv(recvbuf, source, recvtag), comm.Isend(sendbuf, dest, sendtag)])

    @property
    def comm(self) -> MPI.Intracomm:
        """gflow's private duplicate (completing its creation the first time)."""
        if not self._made:
            if self.making_error is not None:  # (for_async's, raised by the work queued after it)
                error, self.making_error = self.making_error, None
                raise error
            maker = self.parent if self.by_parent else self
            with maker._making_lock:
                if not self._made:  # (waited for as this context's: its collective waits)
                    maker.make_duplicates(lambda request: self._wait_for(request) or True)
        return self._comm

    def make_duplicates(self, wait) -> bool:
        """Finish this context's duplicates (gflow's and the stall inspector's), in one sequence that is
        the same on every rank whichever thread gets there first. A user communicator's context makes
        its first background context's with them, and the spare's that replaces it after a failure,
        at its first collective of either kind: Open MPI
        4.1 makes no other communicator on a rank while a duplicate is pending that its peers have
        not started, as a rank's background one was where join() was its first call on the
        communicator and the others' first calls were blocking (the slots' and the node phase's
        communicators were then never made). wait(request) -> whether it completed (finish_duplicates gives
        up at a deadline); returns whether all did."""
        if not _finished(self, wait):
            return False
        background = self._first_background(wait)
        if background is False:
            return False
        if self._wants_monitor and self.monitor_comm is None:
            if self._monitor_pending is None:
                self._monitor_pending = self._comm.Idup()
            monitor, pending = self._monitor_pending
            if not wait(pending):
                return False
            self._monitor_pending = None
            self.monitor_comm = monitor  # (only once made: the inspector asks on it when set)
            stall.watch(self)
        if background is not None:  # (the spare first: a background context made implies its spare)
            for child in (self._spare, background):
                if child is not None and not child._made and not child.make_duplicates(wait):
                    return False
        self._made = True
        return True

    def _first_background(self, wait):
        """The first background context, its duplicate and the spare's made (before this context's
        monitor duplicate, on every rank); None where there is none to make (the spare replaces the
        first after a failure; after a second failure a fresh one is made at the next async call).
        Duplicated from gflow's own duplicate, not the user's communicator: this may run on the engine
        thread (join() serving it), whose order among the program's own calls on that communicator (a
        Split right after an async call) would differ between ranks."""
        if not self._eager_background or self._user_comm is None:
            return None
        if self._background is None and self.backgrounds_made > 0:
            return None
        background = self.background()
        if not background.by_parent:
            return None
        for child in (background, self._spare):
            if child is None:  # (the spare was promoted: a failure before this sequence ended)
                continue
            if child._pending is _NOT_POSTED:
                child._comm, child._pending = self._comm.Idup()
            # (each waited for before the next Idup of the same communicator: Open MPI 4.1 can hang
            # with two outstanding, ompi#2025)
            if not _finished(child, wait):
                return False
        return background

    def _wait_for(self, request) -> None:
        """Wait for one of this context's duplicates. Making them is a collective, in the first
        collective on the context, where a late rank is as likely as anywhere (a trainer's first
        async step): the wait is watched as every other, and marked as one for duplicates, since
        the peers cannot be asked on them yet (stall._channel)."""
        stall.start()
        mark = stall.mark()
        mark.making = self
        try:
            if self.parent is None:
                self.waitall([request])
            else:
                watched(lambda requests: wait_for_duplicates(requests, self))([request])
        except (GflowError, MPI.Exception):  # (MPI's own: out of communicators, say; not an interrupt)
            raise
        except BaseException:  # (Ctrl-C, a signal handler's exception: finish_duplicates, at exit)
            self.making_interrupted = True
            raise
        finally:
            mark.making = None

    def for_async(self, collective: str, about=None) -> "CommContext":
        """The background context an async collective is queued on. The caller's thread first finishes
        its duplicates, and this context's (so a communicator's first async call returns once every
        rank has made its first call on it, and the first after a failure once every rank has made
        its next async call). A duplicate left pending on the engine thread met the program's own
        communicators made right after the call: under Open MPI 4.1 its Split or Dup of the
        communicator, out of order (ompi#2025); under MPICH the duplicate mpi4py makes at a
        communicator's first lowercase collective (a hang, once: pmodels/mpich#2020, #3794). What
        fails here is raised by the queued work. `collective` names the call in a stall warning
        meanwhile, and `about()` says what it reduces ("allreduce of 1024 float32 (host array), op=sum")."""
        if self.failed is not None or self.ended is not None:
            return self._refusing()
        background = self.background()
        if (self._made and background._made) or background.failed is not None:
            return background  # (a failed one refuses its work: check_usable)
        mark = stall.mark()
        # (the wait is in none of this thread's collectives: an interrupt is not one left unfinished
        # on the communicator of its last; a peer checking for crossed waits sees whose work it waits for)
        last, mark.ctx, mark.blocked_on, mark.job, mark.about = mark.ctx, None, background, collective, about
        try:
            background.comm  # noqa: B018 (the property makes them, the parent's first)
        except Exception as error:  # noqa: BLE001 - raised by the first work queued on it (.comm)
            background.making_error = error
        finally:
            mark.ctx, mark.blocked_on, mark.job, mark.about = last, None, None, None
        return background

    def _refusing(self) -> "CommContext":
        """After crossed waits (stall.py), or a step that met another kind of call (`ended`), no rank
        makes another collective on this communicator: the ranks cannot tell which of their steps pair
        (the one the others failed in was this rank's current step, its next, or one its program
        skips: helper-77). Async work goes to a context that refuses it without communicating
        (check_usable), as blocking calls here are refused."""
        background = self._background or self._retired
        if background is None:  # (none made yet: one that posts no duplicate)
            background = self._retired = CommContext(self._user_comm, background=True, by_parent=True)
        background.failed = self.ended or (
            f"crossed waits ended this communicator's collectives on every rank ({self.failed}): make "
            "that call on every rank; end the job, or go on with a new communicator"
        )
        return background

    def background(self) -> "CommContext":
        """A second context, on its own duplicate, for the engine thread's collectives: they run
        while the caller's thread may run blocking ones on this context, and must not meet them.
        Its duplicates are made with this context's, in the first collective of either kind
        (make_duplicates), and so are the spare's that the first failure's next async call takes,
        talking to no one (in the order the ranks' calls come: an async call before a blocking one
        on some ranks, after it on others). After a second failure a fresh one's duplicates are
        made at the next async call, which returns once every rank has made its own."""
        background = self._background
        if background is not None:  # (every async call asks: no lock once made)
            return background
        with self._background_lock:
            if self._background is None:
                first = self._eager_background and self.backgrounds_made == 0
                # (a spare whose Idup was never posted: the first collective's sequence broke off)
                if not first and self._spare is not None and self._spare._pending is not _NOT_POSTED:
                    self._background, self._spare = self._spare, None
                else:
                    self._background = self._new_background(by_parent=first)
                self.backgrounds_made += 1
                self._background.generation = self.backgrounds_made
            return self._background

    def _new_background(self, by_parent: bool) -> "CommContext":
        """A background context of this one, sharing what it hears of departures and crossed waits."""
        child = CommContext(self._user_comm, background=True, by_parent=by_parent)
        child.parent, child.gone, child.crossed = self, self.gone, self.crossed
        return child

    def scratch(self, name: str, count: int, dtype, ops):
        """A reusable buffer of count elements of dtype, one per (name, memory): `ops` (or
        gflow.cuda.arrays.pinned) allocates it, and says what dtype holds `dtype` there (bfloat16 is
        uint16 bits on the device). The storage grows, never shrinks."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        key = (name, ops.memory)
        buf = self._scratch.get(key)
        if buf is None or buf.size < nbytes:
            buf = ops.empty(max(nbytes, 64), np.uint8)
            self._scratch[key] = buf
        return buf[:nbytes].view(ops.storage(dtype))

    def reset_background(self, failed: "CommContext") -> None:
        """Drop the background context `failed` if it is still the current one and did fail, so the
        next async call makes a fresh one. Called from the caller's thread where a failure on it is
        observed (Handle.wait, LazyAllreduce.flush): every rank observes it at the same call, so the
        fresh duplicate is made collectively. Only the context the failed work ran on is dropped:
        a newer one may be failing too, but whether it is marked yet depends on timing."""
        if self._background is failed and failed.failed is not None:
            # Freed but for its monitor duplicate, which stays watched: where it was a rank's only
            # channel of this communicator (its only calls were async, and failed), the rank says
            # goodbye there at exit, and a peer waiting for it elsewhere (the fresh background context's
            # duplicates, join()) learns that it left. One kept per communicator: the last.
            failed.free(keep_monitor=True)
            failed.retired = True
            if self._retired is not None:
                self._retired.free_monitor()
            self._retired, self._background = failed, None

    def free(self, keep_monitor: bool = False):
        if self._user_comm is None:  # already freed
            return
        # Marked first: completing a pending Idup can complete the user's own deferred Comm_free, whose
        # attribute callback (_delete_context) calls this again, inside MPI; it must then do nothing.
        self._user_comm = None
        self._wants_monitor = False  # (completing a pending duplicate below must not start another)
        for child in (self._background, self._spare):
            if child is not None:
                child.free()
        if self._retired is not None:
            self._retired.free_monitor()
            self._retired = None
        if not MPI.Is_finalized():
            if self.hierarchy is not None:
                self.hierarchy.free()
                self.hierarchy = None
            for plan in self.rd_plans.values():
                plan.free()
            if self.slots:
                self.slots.close()
            self.slots = None
            self.rd_plans.clear()
            self.small_calls.clear()
            if self._pending is _NOT_POSTED or self._pending is _REFUSED:  # (nothing to free)
                self._pending = None
            elif self._pending is None or (
                self.failed is None and _done_by(self._pending, time.monotonic() + FREE_PENDING_S)
            ):
                self._pending = None
                self._comm.Free()
            # (else its first collective failed while its duplicate was still being made, or a peer
            # never started making it (a rank that left, while this one served join() a fresh
            # background context: helper-49): waiting would hang or raise anew; the request is left to
            # MPI_Finalize)
            if not keep_monitor:
                self.free_monitor()

    def free_monitor(self) -> None:
        """Stop answering on the stall inspector's duplicate, and free it."""
        stall.unwatch(self)
        if self.monitor_comm is not None and not MPI.Is_finalized():
            with stall._lock:  # not while the monitor is asking or answering on it
                self.monitor_comm.Free()
                self.monitor_comm = None


def free_all() -> None:
    """At exit (lifecycle.py), before mpi4py finalizes MPI and after the background thread stopped:
    free gflow's duplicates, so MPI finds none left over."""
    global _world
    if stall.busy_elsewhere():  # a thread of the program's is inside a collective: freeing its
        return  # communicators under it would crash it; MPI_Finalize takes them as they are
    for ctx in list(_by_handle.values()):
        ctx.free()
    _by_handle.clear()
    _world = None


FINISH_DUPLICATES_S = 10.0  # at exit: how long a rank waits to finish duplicates an interrupt left
FREE_PENDING_S = 1.0  # ... and for a duplicate still being made when its context is freed


def finish_duplicates(seconds: float = FINISH_DUPLICATES_S) -> None:
    """At exit (lifecycle.py), before the goodbye: finish the duplicates of contexts whose first
    collective was interrupted while they were being made (Ctrl-C in the wait for a late rank), within
    `seconds` in all (only those: a context whose first collective failed otherwise may have peers
    that never make them). The peers wait in that first collective; they can be told this rank left only
    on the monitor duplicate, which is made after the first (helper-31: without it they waited
    forever, warning that which rank was gone "cannot be told yet"). A duplicate not finished in time
    is left to MPI_Finalize, as before."""
    if MPI.Is_finalized() or stall.busy_elsewhere():
        return
    deadline = time.monotonic() + seconds
    contexts = list(_by_handle.values())
    contexts += [c._background for c in contexts if c._background is not None]
    for ctx in contexts:
        maker = ctx.parent if ctx.by_parent else ctx
        if not ctx.making_interrupted or ctx._user_comm is None or maker._made:
            continue
        try:
            maker.make_duplicates(lambda request: _done_by(request, deadline))
        except MPI.Exception:  # (MPI refused one: left to MPI_Finalize, the exit goes on)
            continue


def _finished(ctx, wait) -> bool:
    """Wait for ctx's own duplicate, where it is pending: whether it is made. An MPI error in the wait
    (MPI could make no more communicators) is raised, here and at every later use of ctx."""
    if ctx._pending is _REFUSED:
        raise GflowError("MPI refused to make gflow's duplicate of this communicator (see the first error)")
    if ctx._pending is None:
        return True
    try:
        if not wait(ctx._pending):
            return False
    except MPI.Exception:
        ctx._pending = _REFUSED  # (its request is gone: the handle it would have made is no communicator)
        raise
    ctx._pending = None
    return True


def _done_by(request, deadline: float) -> bool:
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _delete_context(comm, keyval, ctx):
    _by_handle.pop(ctx.user_handle, None)
    ctx.free()


_keyval = None
_world = None
# The attribute is the source of truth; this is a faster index of it (Get_attr costs ~1 us),
# emptied for a communicator when MPI deletes the attribute, i.e. when the communicator is freed.
_by_handle: dict = {}


def ended(comm) -> bool:
    """Whether gflow refuses every later collective on `comm` on this rank (crossed waits, or a step
    that met another kind of call, ended them), without making its context where there is none."""
    if _keyval is None:  # (no context made yet, on any communicator)
        return False
    ctx = _by_handle.get(comm.handle) or comm.Get_attr(_keyval)
    return ctx is not None and (ctx.ended is not None or ctx.failed is not None)


def context(comm=None) -> CommContext:
    """The CommContext of `comm` (MPI.COMM_WORLD when None)."""
    global _keyval, _world
    if comm is None:
        if _world is None:
            _world = context(MPI.COMM_WORLD)
        return _world
    if comm.__class__ is MPI.Intracomm:
        ctx = _by_handle.get(comm.handle)
        if ctx is not None:
            return ctx
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm: expected an mpi4py MPI.Intracomm, got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError(
            "comm: got MPI.COMM_NULL (a freed communicator: in gflow.torch, that of a process set "
            "removed by hvd.remove_process_set, which an optimizer or a call still uses?)"
        )
    if _keyval is None:
        _keyval = MPI.Comm.Create_keyval(delete_fn=_delete_context)
    ctx = comm.Get_attr(_keyval)
    if ctx is None:
        stall.refuse_if_gone(comm)  # (before the duplicate is posted)
        ctx = CommContext(comm)
        comm.Set_attr(_keyval, ctx)
    _by_handle[ctx.user_handle] = ctx
    return ctx
