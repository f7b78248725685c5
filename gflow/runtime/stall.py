"""The stall inspector: a rank that has waited on its peers in a gflow collective for longer than
config.stall_warning_s (GFLOW_STALL_WARNING_S, default 60) says so on stderr, naming the collective and
the ranks that have not entered it yet, once per wait. One line per stall, not one per waiting rank
(at 512 ranks, 511 copies): a rank due to report says so in its answers to its peers' questions
("about to report this collective", then "reported it"), and stays silent where a peer in the same
collective has reported it, or a lower-ranked one is about to. The first rank past its threshold
reports, whatever the others' settings; ranks past theirs at the same moment leave it to the lowest.
(Where the peers cannot be asked, the first collective on a communicator or GFLOW_VALIDATE=0, every
waiting rank reports, once.) Past config.stall_abort_s
(GFLOW_STALL_ABORT_S, default 0: off) it ends the whole job with MPI_Abort and that message
(Horovod's stall check, with the late ranks found rather than guessed).

How the late ranks are found without waiting on the data path: every rank counts the collectives it
enters on each communicator (at their agreement, so with GFLOW_VALIDATE=0 nothing is counted) and
marks when a thread starts waiting on a peer. One monitor thread per process watches those marks and
answers its peers: when a wait passes the threshold it asks every rank of that communicator, on a
duplicate of its own, how many collectives it has entered; a rank whose count is below the waiting
rank's has not reached that collective. A rank asleep, computing or blocked elsewhere answers within a
poll (50 ms) as long as the Python interpreter runs; one that does not answer within 2 s is named as
not answering. Each rank applies its own settings (they change no result, so ranks may differ).

Every collective is inspected, a communicator's first included. That one makes gflow's duplicates
(a collective itself: both channels' at once, context.CommContext.make_duplicates), and the wait for
them is marked like any other (Mark.making), so it is warned of and aborted alike. No channel to ask
the peers on exists yet: the message says that some rank has not entered it and that which one
cannot be told yet. A fresh background context after a failure is made at the next async call: its
peers are asked on the caller's context's duplicate about their background context (a rank that has
not made it, or has entered fewer collectives there, is late).

The same monitor learns which ranks have left (gflow/runtime/failures.py): a rank whose interpreter exits
says goodbye on every watched duplicate, with the number of collectives it completed there. A peer
that is in, or later enters, a collective past that number can never finish it, and raises
GflowError naming the rank that left (check_waiting), instead of waiting forever. A rank that is
merely slow says nothing of the kind: that is a stall, reported as above.

(One file, and long: the monitor's protocol, questions, answers, crossed waits and departures,
holds only as a whole: the order of its messages is the invariant.)
"""

import sys
import threading
import time
import warnings

import numpy as np
from mpi4py import MPI

from ..errors import GflowError, MismatchError
from .config import config

POLL_S = 0.05
ANSWER_S = 2.0
TAG_QUESTION, TAG_ANSWER, TAG_GOODBYE, TAG_CROSSED, TAG_ABANDONED = 1, 2, 3, 4, 5
CROSSED_S = 1.0  # a blocking wait this long is checked for crossed waits (again after 2x, 4x, ...)
# What a question asks about: the context it travels on, its background context (whose own duplicates
# are still being made), or the context whose background context it is (not yet on its own duplicates)
ABOUT_ITSELF, ABOUT_BACKGROUND, ABOUT_PARENT = 0, 1, 2

_local = threading.local()
_marks: list = []  # every thread's _Mark
_watched: list = []  # contexts whose questions the monitor answers
_lock = threading.RLock()  # held while the monitor talks on a context's duplicate, and to free it
_monitor = None
_stopped = False  # this process is leaving: the monitor calls MPI no more (stop)
_questions = 0
_warned_off = False
# A rank's stall report of the collective it waits in, told in its answers (one line per stall).
_SILENT, _ABOUT_TO_REPORT, _REPORTED = 0, 1, 2
_UNDECIDED = object()  # (_report: a higher-ranked peer about to report has not chosen yet)
_DECIDE_TRIES, _DECIDE_PAUSE_S = 40, 0.05  # asking again, for at most 2 s, then reporting anyway
# Non-empty once any peer on any watched context has said goodbye: the waits' one cheap test.
departures: list = []


class _Mark:
    """What one thread is doing: the context of its last collective, since when it waits, and the
    context whose duplicates it waits for (`making`: that is a wait in the context's first collective)."""

    __slots__ = ("thread", "ctx", "since", "warned_at", "warned_since", "job", "about", "making",
                 "blocked_on", "crossed_at")  # fmt: skip

    def __init__(self):
        self.thread = threading.current_thread().name
        self.ctx = None
        self.since = None
        self.warned_at = None
        self.warned_since = None  # the wait warned_at belongs to
        self.job = None
        self.about = None  # () -> the call this thread makes the duplicates for, in words (not entered yet)
        self.making = None
        self.blocked_on = None  # the background context whose work this thread waits for (Handle.wait)
        self.crossed_at = None  # how long into the current wait it was last checked for crossed waits


def mark() -> _Mark:
    """This thread's mark (made on first use)."""
    m = getattr(_local, "mark", None)
    if m is None:
        m = _local.mark = _Mark()
        with _lock:
            _marks.append(m)
    return m


def entered(ctx, sig) -> None:
    """ctx's next collective begins on this thread (its agreement): count it. Raises GflowError,
    before any message moves, if a rank that left can never enter it."""
    if ctx.departed:
        _raise_departed(ctx, ctx.entered + 1, sig)
    if ctx.interrupted:
        raise _interrupted_error(ctx, ctx.entered + 1, sig)
    if ctx.heard_departures != len(departures):  # (news of a departure since: cheap to ask)
        _raise_left_unsaid(ctx, sig)
    ctx.entered += 1
    ctx.last_sig = sig
    try:
        _local.mark.ctx = ctx
    except AttributeError:
        mark().ctx = ctx


def watch(ctx) -> None:
    """Answer the peers' questions about ctx (its monitor duplicate is made by the caller)."""
    if start():
        with _lock:
            _watched.append(ctx)


def start() -> bool:
    """Start the monitor thread, once: before the first wait, which may be in the job's first
    collective. False (with a warning, once) where MPI's thread level does not allow it."""
    global _monitor, _warned_off
    if _monitor is not None:
        return True
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:  # the monitor would call MPI beside the caller
        if not _warned_off and (config.stall_warning_s > 0 or config.stall_abort_s > 0):
            _warned_off = True
            from .mpi import mpi_library, thread_level_name

            warnings.warn(
                "gflow: the stall inspector and the check for ranks that left are off: they need MPI "
                f"initialised with MPI_THREAD_MULTIPLE (mpi4py's default); {mpi_library()} gave "
                f"{thread_level_name(MPI.Query_thread())}",
                RuntimeWarning,
                stacklevel=3,
            )
        return False
    with _lock:
        if _monitor is None:
            _monitor = threading.Thread(target=_run, name="gflow-monitor", daemon=True)
            _monitor.start()
    return True


def unwatch(ctx) -> None:
    with _lock:
        if ctx in _watched:
            _watched.remove(ctx)


def stop() -> None:
    """This process is leaving (lifecycle.at_exit, after its goodbye): from now on the monitor thread
    calls MPI no more. A program's own MPI.Finalize() waits there for the other ranks' (seconds,
    where ranks end apart), and the monitor's next question met it: MPICH's "after finalizing" error,
    exit status 1 (helper-88)."""
    global _stopped
    with _lock:  # (once a talk in progress has ended: each begins by looking, under the lock)
        _stopped = True


def _run() -> None:
    while not MPI.Is_finalized():
        time.sleep(POLL_S)
        try:
            with _lock:
                if _stopped:
                    return
                for ctx in _watched:
                    _answer(ctx)
                marks = list(_marks)
            for m in marks:
                _inspect(m)
        except MPI.Exception:  # MPI shutting down: nothing more to watch
            return
        except Exception as exc:  # noqa: BLE001 - the inspector must never take the program down
            print(f"gflow: stall inspector: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def _answer(ctx) -> None:
    comm = ctx.monitor_comm
    if comm is None:
        return
    status = MPI.Status()
    while comm.Iprobe(MPI.ANY_SOURCE, TAG_CROSSED, status):  # (before goodbyes: a teller says it first)
        # the teller's place on its background context, which one, here, and whether the waits crossed
        # over a fresh background channel after a failure (its error's cause: each rank's says the same)
        told = np.empty(4, np.int64)
        comm.Recv(told, status.Get_source(), TAG_CROSSED)
        ctx.crossed[status.Get_source()] = (int(told[0]), int(told[1]), int(told[2]), bool(told[3]))
        departures.append((ctx, status.Get_source()))
        caller = ctx.parent or ctx  # the teller left a collective unfinished there: its messages stay
        if caller.failed is None:
            caller.failed = f"crossed waits with rank {status.Get_source()} (see its error)"
            caller.crossed_cause = _FRESH_CHANNEL_CAUSE if told[3] else _CROSSED_CAUSE
    while comm.Iprobe(MPI.ANY_SOURCE, TAG_ABANDONED, status):
        number = np.empty(1, np.int64)
        comm.Recv(number, status.Get_source(), TAG_ABANDONED)
        ctx.interrupted[status.Get_source()] = int(number[0])
        departures.append((ctx, status.Get_source()))
    _hear_goodbyes(ctx, comm, status)
    while comm.Iprobe(MPI.ANY_SOURCE, TAG_QUESTION, status):
        question = np.empty(2, np.int64)
        comm.Recv(question, status.Get_source(), TAG_QUESTION)
        _hear_goodbyes(ctx, comm, MPI.Status())  # (the asker may have left since: no answer then,
        if status.Get_source() in ctx.gone:  # _hear_every_goodbye)
            continue
        about = (ctx, ctx._background, ctx.parent)[int(question[1])]
        entered, seconds = _where(about)
        needs, background_seconds, blocked = _background_wait(ctx if ctx.is_background else ctx._background)
        number, report = (-1, _SILENT) if about is None else about.stall_report
        report = report if number == entered else _SILENT  # (about the collective it is in now)
        answer = [question[0], entered, int(seconds * 1000), needs, int(background_seconds * 1000), blocked]
        answer.append(report)
        comm.Send(np.array(answer, np.int64), status.Get_source(), TAG_ANSWER)


def _hear_goodbyes(ctx, comm, status) -> None:
    """Take in the goodbyes of ranks that have left ctx's communicator (goodbye)."""
    while comm.Iprobe(MPI.ANY_SOURCE, TAG_GOODBYE, status):
        completed = np.empty(1, np.int64)
        comm.Recv(completed, status.Get_source(), TAG_GOODBYE)
        if completed[0] != LEFT_UNCOUNTED:
            ctx.departed[status.Get_source()] = int(completed[0])
        ctx.gone.setdefault(status.Get_source(), time.monotonic())
        departures.append((ctx, status.Get_source()))


def _where(ctx) -> tuple:
    """(collectives this rank has entered on ctx, how long a thread of it has waited in one, or -1);
    (0, -1) for a context this rank has not made (a fresh background context after a failure)."""
    if ctx is None:
        return 0, -1.0
    marks = [(m, m.since) for m in list(_marks) if m.ctx is ctx or m.making is ctx]
    waiting = [(since, _collective_of(ctx, m)) for m, since in marks if since is not None]
    entered = max((number for _, number in waiting), default=ctx.entered)
    return entered, time.monotonic() - min(since for since, _ in waiting) if waiting else -1.0


def _collective_of(ctx, m: _Mark) -> int:
    """The number on ctx of the collective m's thread waits in: a thread making ctx's duplicates before
    it has entered one there (CommContext.for_async) is in the next."""
    return ctx.entered + (m.making is ctx and m.ctx is not ctx)


def _background_wait(background) -> tuple:
    """About a background context, for a peer checking for crossed waits: (the collective a thread of
    this rank waits in there, 0 while its duplicates are being made; how long, or -1 when no thread
    waits there; 1 when a thread of the program's waits for its work, Handle.wait)."""
    if background is None:
        return 0, -1.0, 0
    marks = list(_marks)
    blocked = int(any(m.blocked_on is background for m in marks))
    waiting = [m for m in marks if m.since is not None and (m.ctx is background or m.making is background)]
    if not waiting:
        return 0, -1.0, blocked
    needs = 0 if any(m.making is background for m in waiting) else background.entered
    return needs, time.monotonic() - min(m.since for m in waiting), blocked


def check_waiting() -> None:
    """A thread waiting on its peers, once some rank has left or crossed waits were found: raise
    GflowError if a rank that left can never take part in the collective this thread waits in (its
    number on the context), MismatchError if the waits crossed (see _check_crossed)."""
    mark = _local.mark
    ctx = mark.making or mark.ctx
    if ctx is None:
        return
    if ctx.crossed_here is not None or ctx.crossed:
        raise_crossed(ctx, ctx.entered)
    if ctx.ended is not None and not ctx.is_background:  # (a rank in join(): the others are refused)
        raise GflowError(ctx.ended)
    if ctx.failed is not None and not ctx.is_background:
        # A peer that found crossed waits told this rank (stall._answer), whose thread waits in a
        # blocking collective too (the one that peer left unfinished, or one after it): none can
        # finish. This rank's program leaves it as the finder's does: so does its background context.
        cut_steps(ctx, ctx.failed)
        if _engine_idle():
            _drop_background(ctx)
        raise MismatchError(
            f"{ctx.failed}: the blocking collective #{ctx.entered} gflow rank {ctx.rank} waits in cannot "
            f"finish. {ctx.crossed_cause or _CROSSED_CAUSE}"
        )
    if ctx.departed:
        _raise_departed(ctx, ctx.entered, ctx.last_sig)
    if ctx.interrupted:
        raise _interrupted_error(ctx, ctx.entered, ctx.last_sig)
    if mark.making is not None:
        hear_elsewhere(ctx)
    if len(ctx.gone) > len(ctx.departed):
        _raise_unheard(ctx, mark)
    if ctx.abandoned is not None:  # (by another thread of this rank: give_up)
        raise GflowError(
            f"collective #{ctx.abandoned} on this communicator was given up on gflow rank {ctx.rank}: "
            "the call it belongs to was interrupted on another thread"
        )


def raise_crossed(ctx, number: int) -> None:
    """Raise the MismatchError of crossed waits, where this thread's wait (collective #number on ctx)
    is one of them: found here (ctx.crossed_here), or told by a peer (ctx.crossed: the peer's place on
    its background context, which a wait here past it can never see reached)."""
    if ctx.crossed_here is not None:
        text, ctx.crossed_here = ctx.crossed_here, None
        ctx.failed = text  # its unfinished collective's messages are still posted
        # The peers were told to abandon their async collectives past this rank's place on the
        # background context (their duplicates, where it has none yet): each fails the one it waits in
        # (the program's step). This rank's background context is dropped now (made first where there
        # is none yet, so that its duplicate meets the one the peers abandoned). No rank makes another
        # collective on this communicator (CommContext._refusing: which steps pair is unknown).
        cut_steps(ctx, text)
        _drop_background(ctx)
        raise MismatchError(text)
    if not ctx.is_background:
        return
    for rank, (position, generation, theirs, fresh) in list(ctx.crossed.items()):
        if generation < ctx.generation:  # about a background context this rank has dropped since
            del ctx.crossed[rank]
        elif position < number:
            del ctx.crossed[rank]
            fresh = fresh or _after_a_failure(position >= 0, generation, _making(ctx))
            text = (
                f"crossed waits: rank {rank} waits in a blocking collective (#{theirs} on this communicator) "
                f"that gflow rank {ctx.rank} has not entered, and cannot start the async collective "
                f"#{number} this rank waits for before that call returns. "
                f"{_FRESH_CHANNEL_CAUSE if fresh else _CROSSED_CAUSE}"
            )
            cut_steps(ctx.parent, text)  # (the step this wait belongs to fails; one begun beside it too)
            raise MismatchError(text)


def cut_steps(ctx, why: str) -> None:
    """Crossed waits make this rank leave a blocking call on ctx, and the peers failed the async work
    they waited in, their program's step (or a step met another kind of call:
    recursive_doubling.end_where_a_step_met_strays): a step this rank had begun on ctx is cut short
    too (LazyAllreduce.cut_short). Sent on, on the fresh background context, it would pair with the
    peers' next step (helper-73)."""
    ctx.steps_cut, ctx.cut_why = ctx.steps_cut + 1, why


def _drop_background(ctx) -> None:
    """Drop ctx's background context (made first where there is none yet, so that its duplicate
    meets the one the peers abandoned): crossed waits (raise_crossed)."""
    background = ctx.background()
    background.failed = f"crossed waits on gflow rank {ctx.rank}'s communicator"
    ctx.reset_background(background)


_CROSSED_CAUSE = (
    "The ranks made different calls: a blocking collective on some ranks only while async work is in "
    "flight (a metric reduced on rank 0 only, while the optimizer's segments are on their way?), or "
    "async and blocking calls in different orders. Make each call on every rank, in the same order: "
    "a collective some ranks do not make never completes"
)
# Where the async side waits for a fresh background channel after a failure (helper-84): the calls
# may well be the same on every rank, and the order that fails is one that works at any other time.
_FRESH_CHANNEL_CAUSE = (
    "This follows a second failed async call or step on this communicator: the first failure's "
    "channel was made with the first, but after a second every rank makes a fresh background channel "
    "at its next async call, which returns only once every rank has made its own (docs/cluster.md), "
    "and here some rank's next async call comes after this blocking call (a step whose segments fire "
    "during the pushes on some ranks and only at synchronize() on others, with a metric between?). "
    "After a second failure, make the next async call before any blocking one on every rank"
)


def _making(ctx) -> bool:
    """Whether this thread waits while it makes ctx's duplicates."""
    mark = getattr(_local, "mark", None)
    return mark is not None and mark.making is ctx


def _after_a_failure(background_made: bool, generation: int, waits_to_make: bool) -> bool:
    """Whether crossed waits are over a fresh background channel after a failure: the waiting rank
    makes its duplicates (`waits_to_make`) and the other has dropped its failed one, making none yet."""
    return waits_to_make and not background_made and generation > 1


def _raise_departed(ctx, number: int, sig) -> None:
    gone = sorted(r for r, completed in ctx.departed.items() if completed < number)
    if not gone:  # it finished this collective before it left: its messages are on their way
        return
    raise _left_the_job(ctx, gone, number, sig, f": {_completed_before_leaving(ctx, gone)}")


UNHEARD_GRACE_S = 1.0  # how long past news heard only on the sibling context before naming the rank
# A goodbye on a context the leaving rank had dropped after a failure (CommContext.retired): a peer
# that has not dropped it yet may wait in a collective there that failed on the leaver (crossed waits,
# say), whose own error is on its way. So the peer only learns that the rank left (`gone`, named after
# UNHEARD_GRACE_S, as news from a sibling context is), not how far it came there.
LEFT_UNCOUNTED = -1


def hear_elsewhere(ctx) -> None:
    """Add to ctx.gone the ranks of ctx that said goodbye on another communicator this rank watches:
    while ctx's duplicates are being made (its first collective), a rank that left before its first
    call on ctx had no channel of ctx's to say so on, and the duplicates can never be made without
    it; as a collective begins, one that freed ctx's communicator before it left (entered). (Looked
    up again only when news came since.)"""
    count, user = len(departures), ctx._user_comm  # (once: another thread may free it meanwhile)
    if ctx.heard_departures == count or user is None:
        return
    try:
        gone = _gone_among(user, ctx.gone)
    except MPI.Exception:  # (freed meanwhile)
        return
    for rank in gone:
        ctx.gone.setdefault(rank, time.monotonic())
    ctx.heard_departures = count


def _gone_among(comm, skip=None) -> set:
    """The ranks of `comm` that said goodbye on a context this rank watches (but those whose news is
    the dict `skip`: a context's own, shared with its background contexts)."""
    group, gone = comm.Get_group(), set()
    try:
        for other in list(_watched):
            monitor = other.monitor_comm  # (once: another thread may free it meanwhile)
            if not other.gone or monitor is None or other.gone is skip:
                continue
            try:
                theirs = monitor.Get_group()
            except MPI.Exception:  # (freed meanwhile)
                continue
            try:
                mapped = MPI.Group.Translate_ranks(theirs, sorted(other.gone), group)
            finally:
                theirs.Free()
            gone.update(rank for rank in mapped if rank != MPI.UNDEFINED)
    finally:
        group.Free()
    return gone


def _raise_left_unsaid(ctx, sig) -> None:
    """Raise GflowError, before collective #entered + 1 on ctx sends anything, for ranks of ctx that
    left having said goodbye elsewhere only (they freed ctx's communicator first, say): that
    collective needs their part (its agreement does), so it can never finish. Over MPICH's TCP
    transport its first send to them never returned (helper-88: stall abort included)."""
    hear_elsewhere(ctx)
    unsaid = sorted(r for r in ctx.gone if r not in ctx.departed)
    if unsaid:
        raise _left_the_job(ctx, unsaid, ctx.entered + 1, sig, "")


def _raise_unheard(ctx, m: _Mark) -> None:
    """Raise GflowError for ranks that left having said goodbye only on ctx's sibling (a user
    communicator's context or its background one, which share `gone`): ctx had no channel of theirs to
    hear it on (a rank that left during the first collective, or one whose background context was
    dropped after a failure). How many collectives they completed on ctx is not known, so this waits until
    UNHEARD_GRACE_S after both the news and the wait began: one they finished would have ended by then."""
    now = time.monotonic()
    unheard = sorted(r for r, heard in ctx.gone.items() if r not in ctx.departed
                     and now - max(heard, m.since or now) > UNHEARD_GRACE_S)  # fmt: skip
    if unheard:
        raise _left_the_job(ctx, unheard, ctx.entered, ctx.last_sig, "")


def _left_the_job(ctx, ranks, number: int, sig, after: str) -> GflowError:
    """The error of a wait in collective #number on ctx that `ranks` (left the job) can never finish."""
    world = world_ranks(ctx)
    verb, whose = ("has", "its process") if len(ranks) == 1 else ("have", "their processes")
    what = _brief(sig) if sig is not None else "a collective"
    return GflowError(
        f"{ranks_text(ranks)}{world(ranks)} {verb} left the job ({whose} exited{after}), so collective "
        f"#{number} on this communicator of {ctx.size} ranks ({what}) can never finish on gflow rank "
        f"{ctx.rank}{world(None)}"
    )


def _completed_before_leaving(ctx, ranks) -> str:
    """'rank 1 after #5, rank 3 after #5': the last collective each rank that left completed on ctx."""
    return ", ".join(f"rank {r} after #{ctx.departed[r]}" for r in ranks)


def abandoned(m: _Mark) -> None:
    """This thread's wait was interrupted by an exception of the program's (a signal handler's
    SystemExit, KeyboardInterrupt): it leaves its collective unfinished, so goodbye must not count
    it as completed, and this rank refuses its later ones there (CommContext.check_usable). Its
    peers are told, so that they raise too instead of waiting in it until this process exits."""
    ctx = m.ctx
    if ctx is None:
        return
    if not ctx._made:  # interrupted while its duplicates were made: nothing of it can have been sent,
        ctx.entered -= 1  # so the next call takes its place (a retry pairs with the peers' call)
        m.ctx = None  # (counted back once, however many handlers the exception passes)
        return
    first = ctx.abandoned is None
    ctx.abandoned = ctx.entered
    if first and ctx.monitor_comm is not None and ctx.size > 1 and not MPI.Is_finalized():
        told = np.array([ctx.abandoned], np.int64)
        with _lock:
            peers = (r for r in range(ctx.size) if r != ctx.rank and r not in ctx.gone)  # (see goodbye)
            sends = [ctx.monitor_comm.Isend(told, r, TAG_ABANDONED) for r in peers]
        _sent_within(sends, 1.0)


def _interrupted_error(ctx, number: int, sig) -> GflowError:
    """The error of collective #number on ctx where a peer left one unfinished (Ctrl-C) and told."""
    world = world_ranks(ctx)
    ranks = sorted(ctx.interrupted)
    where = ", ".join(f"rank {r} in #{ctx.interrupted[r]}" for r in ranks)
    what = _brief(sig) if sig is not None else "a collective"
    was, refuses = ("was", "refuses") if len(ranks) == 1 else ("were", "refuse")
    return GflowError(
        f"{ranks_text(ranks)}{world(ranks)} {was} interrupted in a collective on this communicator "
        f"({where}: Ctrl-C, or a signal handler's exception) and {refuses} every later one there, so "
        f"collective #{number} on this communicator of {ctx.size} ranks ({what}) can never finish on "
        f"gflow rank {ctx.rank}{world(None)}. Use another communicator"
    )


def give_up(ctx) -> None:
    """This rank will not finish the collective that another of its threads waits in on ctx (join()'s
    background channel, once the caller's channel was interrupted): that wait ends with GflowError
    (check_waiting), which frees the thread for other work, and ctx refuses its next call."""
    if ctx.abandoned is None:
        ctx.abandoned = ctx.entered
    departures.append((ctx, None))  # (the waits' cheap test: now they look)


def busy_elsewhere() -> list:
    """The marks of the threads other than this one that are inside a wait or an engine job."""
    me = getattr(_local, "mark", None)
    return [m for m in list(_marks) if m is not me and (m.job is not None or m.since is not None)]


def goodbye() -> None:
    """This process is leaving: tell every peer of every watched context how many collectives it
    completed there. A collective still running on another thread (the engine, stopped at its
    time limit) is not completed. Bounded: a peer that has gone already is not waited for."""
    if MPI.Is_finalized():
        return
    busy = [m.ctx for m in busy_elsewhere()]
    sends, payloads = [], []
    with _lock:
        _hear_every_goodbye()
        for ctx in _watched:
            if ctx.monitor_comm is None or ctx.size == 1:
                continue
            completed = ctx.entered - any(b is ctx for b in busy)
            if ctx.abandoned is not None:
                completed = min(completed, ctx.abandoned - 1)
            if ctx.retired:  # (a peer may not have dropped it yet: its wait there is told apart)
                completed = LEFT_UNCOUNTED
            completed = np.array([completed], np.int64)
            payloads.append(completed)
            gone = _gone_among(ctx.monitor_comm)
            peers = (r for r in range(ctx.size) if r != ctx.rank and r not in gone)
            sends += [ctx.monitor_comm.Isend(completed, r, TAG_GOODBYE) for r in peers]
    _sent_within(sends, 1.0)


def _hear_every_goodbye() -> None:
    """Take in the goodbyes received on every watched context (the caller holds _lock). No message goes
    to a process that said one: under MPICH's TCP transport (ch4:ofi, FI_PROVIDER=tcp), a send to a
    process whose connection the progress engine saw close never returns (it reconnects to a port no
    one listens on), and a rank that ended later than its peers hung in its goodbye."""
    status = MPI.Status()
    for ctx in _watched:
        if ctx.monitor_comm is not None:
            _hear_goodbyes(ctx, ctx.monitor_comm, status)


def refuse_if_gone(comm) -> None:
    """Raise GflowError, before gflow's first duplicate of comm is posted, where a process of comm said
    goodbye on another communicator (hear_elsewhere's news, taken in first): the duplicate can never
    be made without it, and under MPICH's TCP transport posting it never returned (its first send goes
    to the process that exited, _hear_every_goodbye), stall abort included."""
    with _lock:
        _hear_every_goodbye()
        left = sorted(_gone_among(comm))
    if left:
        named = _world_ranks_of(comm, comm.Get_rank())
        verb, whose = ("has", "its process") if len(left) == 1 else ("have", "their processes")
        raise GflowError(
            f"{ranks_text(left)}{named(left)} {verb} left the job ({whose} exited before this "
            f"rank's first gflow call on this communicator of {comm.Get_size()} ranks), so no "
            f"collective on it can finish on gflow rank {comm.Get_rank()}{named(None)}"
        )


def _sent_within(sends: list, seconds: float) -> None:
    """Wait at most `seconds` for tiny sends to peers (sent eagerly; a peer gone is not waited for)."""
    deadline = time.monotonic() + seconds
    while sends and not MPI.Request.Testall(sends) and time.monotonic() < deadline:
        time.sleep(0.001)


def _inspect(m: _Mark) -> None:
    since, making = m.since, m.making  # (in this order: `making` is set first and cleared last)
    ctx = making or m.ctx
    warn, abort = config.stall_warning_s, config.stall_abort_s
    if since is None or ctx is None or (ctx.monitor_comm is None and making is None):
        m.warned_at = None
        return
    if m.warned_since is not since:  # a new wait: its warnings start afresh
        m.warned_since, m.warned_at, m.crossed_at = since, None, None
    waited = time.monotonic() - since
    number = _collective_of(ctx, m)  # (what peers are told: _answer compares it with _where)
    if (
        not ctx.is_background
        and config.validate
        and waited >= (CROSSED_S if m.crossed_at is None else 2 * m.crossed_at)
    ):
        m.crossed_at = waited
        with _lock:
            if _stopped:
                return
            _check_crossed(ctx, number)
    due_abort = abort > 0 and waited >= abort
    due_warning = warn > 0 and waited >= warn and (m.warned_at is None or waited - m.warned_at >= warn)
    if not (due_abort or due_warning):
        return
    m.warned_at = float("inf")  # once per wait (the abort, if set, still comes)
    ctx.stall_report = (number, _ABOUT_TO_REPORT)  # (peers that ask meanwhile leave it to this rank)
    with _lock:
        if _stopped:
            return
        text, reporter = _report(ctx, m, since)
    for _ in range(_DECIDE_TRIES):  # a higher-ranked peer about to report may yet leave it to this one
        if reporter is not _UNDECIDED or due_abort:
            break
        _answer_for(_DECIDE_PAUSE_S)
        with _lock:
            if _stopped:
                return
            text, reporter = _report(ctx, m, since)
    if due_abort:
        from .failures import end_job

        end_job(f"{text}; ending the job (GFLOW_STALL_ABORT_S={abort:g})")
        return  # (MPI_Abort may return before the launcher's kill arrives: said once, above)
    if reporter is None or reporter is _UNDECIDED:
        print(text, file=sys.stderr, flush=True)
        ctx.stall_report = (number, _REPORTED)
    else:
        ctx.stall_report = (number, _SILENT)


def _channel(ctx):
    """(the context whose monitor duplicate to ask the peers on, what to ask about), or (None, None).
    A context whose duplicates are still being made (its first collective) has none of its own; a
    background context's peers can then be asked on its parent's, about theirs."""
    if ctx.monitor_comm is not None:
        return ctx, ABOUT_ITSELF
    if ctx.parent is not None and ctx.parent.monitor_comm is not None:
        return ctx.parent, ABOUT_BACKGROUND
    return None, None


def _report(ctx, m: _Mark, since: float) -> tuple:
    """(the stall message: this rank, the collective and where every other rank of ctx is; who
    reports it: the peer in it too that does instead, None where this rank does, or _UNDECIDED while
    a higher-ranked peer about to report has not chosen). The wait it names (since `since`) is timed
    when the peers have answered, which may take seconds: the two then describe the same moment."""
    job = f" ({m.job})" if m.job else ""
    if not config.validate:
        return (
            f"gflow rank {ctx.rank}: waited {time.monotonic() - since:.0f} s on thread {m.thread}{job} in a "
            "collective (with GFLOW_VALIDATE=0 gflow counts no collectives, so it cannot tell which ranks "
            "are late)"
        ), None
    asked, about = _channel(ctx)
    number = _collective_of(ctx, m)
    if number == ctx.entered and ctx.last_sig is not None:
        what = _brief(ctx.last_sig)
    else:  # (not entered yet: the duplicates it waits for are made first, CommContext.for_async)
        about_call = m.about  # (read once: the caller's thread clears it when its duplicates are made)
        what = about_call() if about_call is not None else "a collective"
    world = world_ranks(ctx)
    me_named = f"gflow rank {ctx.rank}{world(None)}"
    me, mine = ctx.rank, number
    peers = [r for r in range(ctx.size) if r != me]
    answers = _ask(asked, about, peers) if asked is not None else {}
    waited = time.monotonic() - since
    parts = [f"{me_named}: waited {waited:.0f} s on thread {m.thread}{job} in collective #{number}"]
    parts.append(f"on a communicator of {ctx.size} ranks: {what}")
    if asked is None:  # the duplicates the peers would be asked on are made in this very collective
        parts.append(
            "some rank has not entered gflow's first collective on this communicator yet; which one "
            "cannot be told yet (the channel gflow asks its peers on is made in that collective)"
        )
        return "; ".join(parts), None
    late = sorted(r for r, (count, *_) in answers.items() if count < mine)
    waiting = sorted(r for r, (count, seconds, *_) in answers.items() if count >= mine and seconds >= 0)
    gone = sorted(r for r in peers if r in asked.departed and r not in answers)
    silent = sorted(r for r in peers if r not in answers and r not in asked.departed)
    if late:
        counts = ", ".join(f"rank {r} at #{answers[r][0]}" for r in late)
        verb = "has" if len(late) == 1 else "have"
        parts.append(f"{ranks_text(late)}{world(late)} {verb} not entered it yet ({counts})")
    if waiting:
        parts.append(
            f"{ranks_text(waiting)}{world(waiting)} {'is' if len(waiting) == 1 else 'are'} in it too"
        )
    if gone:
        after = _completed_before_leaving(asked, gone)
        parts.append(f"{ranks_text(gone)}{world(gone)} left the job ({after})")
    if silent:
        parts.append(
            f"{ranks_text(silent)}{world(silent)} did not answer within {ANSWER_S:g} s (gone, stuck holding "
            "the GIL, or not yet on this communicator)"
        )
    if not (late or silent or gone):
        parts.append("every rank has entered it: a peer is slow inside it, or the network is")
    # Who reports: a peer in this very collective that has; else the lowest-ranked of those about to;
    # a higher-ranked one about to may still defer to this rank: undecided until it has chosen.
    same = [r for r in waiting if answers[r][0] == mine]
    reporter = [r for r in same if answers[r][5] == _REPORTED]
    reporter += [r for r in same if r < me and answers[r][5] == _ABOUT_TO_REPORT]
    if not reporter and any(answers[r][5] == _ABOUT_TO_REPORT for r in same):
        return "; ".join(parts), _UNDECIDED
    return "; ".join(parts), (reporter[0] if reporter else None)


def _answer_for(seconds: float) -> None:
    """Answer the peers' questions for `seconds` (the monitor thread, between its own questions)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with _lock:
            if _stopped:
                return
            for other in _watched:
                _answer(other)
        time.sleep(0.005)


def _ask(asked, about, peers) -> dict:
    """Ask the peers, on asked's monitor duplicate, where they are (about asked itself, or its
    background context): {rank: (collectives entered, seconds a thread waits in one or -1,
    _background_wait's three, and its stall report of the collective it is in: _SILENT,
    _ABOUT_TO_REPORT or _REPORTED)} for those that answered within ANSWER_S."""
    global _questions
    _questions += 1
    comm, answers = asked.monitor_comm, {}
    peers = [r for r in peers if r not in asked.gone]  # (none to a process that left: _hear_every_goodbye)
    question = np.array([_questions, about], np.int64)
    sends = [comm.Isend(question, r, TAG_QUESTION) for r in peers]
    buffers = {r: np.empty(7, np.int64) for r in peers}
    receives = {r: comm.Irecv(buffers[r], r, TAG_ANSWER) for r in peers}
    deadline = time.monotonic() + ANSWER_S
    while receives and time.monotonic() < deadline:
        for r, request in list(receives.items()):
            if request.Test():
                if buffers[r][0] == _questions:
                    del receives[r]
                    b = buffers[r]
                    answers[r] = (int(b[1]), b[2] / 1000, int(b[3]), b[4] / 1000, bool(b[5]), int(b[6]))
                else:  # a late answer to an earlier question: wait on for this one's
                    receives[r] = comm.Irecv(buffers[r], r, TAG_ANSWER)
        for other in _watched:  # peers may be asking us at the same time
            _answer(other)
        time.sleep(0.005)
    for request in receives.values():  # peers that did not answer: take the question back
        request.Cancel()
        request.Wait()
    MPI.Request.Waitall(sends)  # (tiny messages: sent eagerly, done at once)
    return answers


# engine.idle, registered by engine.py: the engine sits above this module (it marks its waits here)
_engine_idle = None


def register_engine(idle) -> None:
    """engine.py hands over its idle() here, for the crossed-waits check."""
    global _engine_idle
    _engine_idle = idle


def _check_crossed(ctx, number: int) -> None:
    """Crossed waits (a deadlock across gflow's two channels): this rank's thread waits in a blocking
    collective on ctx, the caller's channel, that a peer has not entered, while that peer's program
    waits for its async work (Handle.wait: a LazyAllreduce flush, an optimizer's step) and its engine
    waits in a background collective this rank has not started. This rank's engine is idle, so only
    this rank's waiting thread could start it, and that thread waits for the peer: neither can go on.
    Found, this rank's wait raises MismatchError (check_waiting), and each such peer is told, so that
    its background wait raises too: an error on every rank instead of a hang. Checked after CROSSED_S
    of waiting, then at 2x, 4x, ... (each check asks every peer once). `number`: the collective
    this thread waits in. While it makes ctx's duplicates (ctx's first collective) the peers are
    asked on its background context's, where that has them."""
    background = ctx._background
    if ctx.monitor_comm is not None:
        asked, about = ctx, ABOUT_ITSELF
    elif background is not None and background.monitor_comm is not None:
        asked, about = background, ABOUT_PARENT
    else:
        return
    if not _engine_idle():
        return
    position = -1 if background is None else background.entered  # what this rank has entered there
    answers = _ask(asked, about, [r for r in range(ctx.size) if r != ctx.rank])
    crossed = sorted(
        r
        for r, (entered, _, needs, background_seconds, blocked, _) in answers.items()
        if entered < number and blocked and background_seconds >= 0 and needs > position
    )
    if not crossed or not _engine_idle():
        return
    # Every peer is told, not only those found crossed: one slower to start waiting is in the same
    # place a moment later, and none can finish what this rank now leaves unfinished.
    # (which background context: the current one, or the first one made from now where none is)
    generation = ctx.backgrounds_made + (background is None)
    making = all(answers[r][2] == 0 for r in crossed)  # (their `needs`: 0 while making duplicates)
    fresh = _after_a_failure(background is not None, generation, making)
    cause = _FRESH_CHANNEL_CAUSE if fresh else _CROSSED_CAUSE
    told = np.array([position, generation, number, fresh], np.int64)
    peers = [r for r in range(ctx.size) if r != ctx.rank and r not in ctx.gone]  # (_hear_every_goodbye)
    MPI.Request.Waitall([asked.monitor_comm.Isend(told, r, TAG_CROSSED) for r in peers])
    world = world_ranks(ctx)
    what = _brief(ctx.last_sig) if ctx.last_sig is not None else "a collective"
    verb = "waits" if len(crossed) == 1 else "wait"
    peers = f"{ranks_text(crossed)}{world(crossed)}"
    ctx.crossed_here = (
        f"crossed waits: gflow rank {ctx.rank}{world(None)} waits in a blocking collective "
        f"(#{number} on a communicator of {ctx.size} ranks: {what}) that {peers} "
        f"{'has' if len(crossed) == 1 else 'have'} not entered, and {ranks_text(crossed)} {verb} instead "
        "for async work of this rank's (gflow's background channel) that this rank cannot start before "
        f"this call returns. {cause}"
    )
    departures.append((ctx, None))


def world_ranks(ctx):
    """A function giving ' (world ranks ...)' for ranks of ctx's communicator, or '' where those are
    the world's own; with None, the same for this rank."""
    # (the user's communicator while gflow's duplicate is being made: ctx.comm would wait for it)
    return _world_ranks_of(ctx._comm if ctx._pending is None else ctx._user_comm, ctx.rank)


def _world_ranks_of(comm, rank: int):
    """world_ranks, for the ranks of comm (`rank`: this one's), which may have no context yet."""
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    same = MPI.Group.Compare(group, world) == MPI.IDENT

    def show(ranks):
        if same:
            return ""
        ranks = [rank] if ranks is None else ranks
        mapped = MPI.Group.Translate_ranks(group, ranks, world)
        return f" (world rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, mapped[:16]))})"

    return show


def _brief(sig) -> str:
    """'allreduce of 1048576 float32 (host array), op=sum': what the waiting rank called."""
    from .signature import CODE_DTYPE_NAME, CODE_MEMORY, CODE_OP, SIG_REJECTED, collective_in_words

    collective = collective_in_words(sig[0])
    if int(sig[7]) == SIG_REJECTED:
        return f"{collective} (its arguments were rejected here)"
    memory = CODE_MEMORY.get(int(sig[6]), "?")
    text = f"{collective} of {int(sig[2])} {CODE_DTYPE_NAME.get(int(sig[3]), '?')} ({memory} array)"
    return text + (f", op={CODE_OP.get(int(sig[4]), '?')}" if int(sig[4]) else "")


def ranks_text(ranks: list[int]) -> str:
    """'rank 3' or 'ranks 1, 3' (the first 16, then how many more)."""
    shown = ", ".join(map(str, ranks[:16])) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"
