"""The stall inspector: a rank that has waited on its peers in a gflow collective for longer than
config.stall_warning_s (GFLOW_STALL_WARNING_S, default 60) says so on stderr, naming the collective and
the ranks that have not entered it yet, and again every stall_warning_s; past config.stall_abort_s
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
(a collective itself), and the wait for them is marked like any other (Mark.making), so it is warned
of and aborted alike. Its late ranks are named where a channel already exists: for the engine's
background context (an async call, LazyAllreduce, a trainer's first step) the peers are asked on the
caller's context's duplicate about their background context (a rank that has not made it, or has
entered fewer collectives there, is late). Where none exists (the very first collective on a
communicator, blocking or async) the message says that some rank has not entered it and that which
one cannot be told yet.

The same monitor learns which ranks have left (gflow/failures.py): a rank whose interpreter exits
says goodbye on every watched duplicate, with the number of collectives it completed there. A peer
that is in, or later enters, a collective past that number can never finish it, and raises
GflowError naming the rank that left (check_waiting), instead of waiting forever. A rank that is
merely slow says nothing of the kind: that is a stall, reported as above.
"""

import sys
import threading
import time
import warnings

import numpy as np
from mpi4py import MPI

from ._config import config
from .errors import GflowError

POLL_S = 0.05
ANSWER_S = 2.0
TAG_QUESTION, TAG_ANSWER, TAG_GOODBYE = 1, 2, 3
ABOUT_ITSELF, ABOUT_BACKGROUND = 0, 1  # what a question asks about: the context it travels on, or its
# background context (whose own duplicates are still being made)

_local = threading.local()
_marks: list = []  # every thread's _Mark
_watched: list = []  # contexts whose questions the monitor answers
_lock = threading.RLock()  # held while the monitor talks on a context's duplicate, and to free it
_monitor = None
_questions = 0
_warned_off = False
# Non-empty once any peer on any watched context has said goodbye: the waits' one cheap test.
departures: list = []


class _Mark:
    """What one thread is doing: the context of its last collective, since when it waits, and the
    context whose duplicates it waits for (`making`: that is a wait in the context's first collective)."""

    __slots__ = ("thread", "ctx", "since", "warned_at", "warned_since", "job", "making")

    def __init__(self):
        self.thread = threading.current_thread().name
        self.ctx = None
        self.since = None
        self.warned_at = None
        self.warned_since = None  # the wait warned_at belongs to
        self.job = None
        self.making = None


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
            from ._context import mpi_library, thread_level_name

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


def _run() -> None:
    while not MPI.Is_finalized():
        time.sleep(POLL_S)
        try:
            with _lock:
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
    while comm.Iprobe(MPI.ANY_SOURCE, TAG_GOODBYE, status):
        completed = np.empty(1, np.int64)
        comm.Recv(completed, status.Get_source(), TAG_GOODBYE)
        ctx.departed[status.Get_source()] = int(completed[0])
        ctx.gone.add(status.Get_source())
        departures.append((ctx, status.Get_source()))
    while comm.Iprobe(MPI.ANY_SOURCE, TAG_QUESTION, status):
        question = np.empty(2, np.int64)
        comm.Recv(question, status.Get_source(), TAG_QUESTION)
        about = ctx if question[1] == ABOUT_ITSELF else ctx._background
        entered, seconds = _where(about)
        comm.Send(
            np.array([question[0], entered, int(seconds * 1000)], np.int64), status.Get_source(), TAG_ANSWER
        )


def _where(ctx) -> tuple:
    """(collectives this rank has entered on ctx, how long a thread of it has waited in one, or -1);
    (0, -1) for a context this rank has not made (a background context before its first async call)."""
    if ctx is None:
        return 0, -1.0
    marks = [m for m in list(_marks) if m.ctx is ctx or m.making is ctx]
    waiting = [t for t in (m.since for m in marks) if t is not None]
    return ctx.entered, time.monotonic() - min(waiting) if waiting else -1.0


def check_waiting() -> None:
    """A thread waiting on its peers, once some rank has left: raise GflowError if a rank that left
    can never take part in the collective this thread waits in (its number on the context)."""
    ctx = _local.mark.ctx
    if ctx is not None and ctx.departed:
        _raise_departed(ctx, ctx.entered, ctx.last_sig)


def _raise_departed(ctx, number: int, sig) -> None:
    gone = sorted(r for r, completed in ctx.departed.items() if completed < number)
    if not gone:  # it finished this collective before it left: its messages are on their way
        return
    world = _world_ranks(ctx)
    verb, whose = ("has", "its process") if len(gone) == 1 else ("have", "their processes")
    after = _completed_before_leaving(ctx, gone)
    what = _brief(sig) if sig is not None else "a collective"
    raise GflowError(
        f"{ranks_text(gone)}{world(gone)} {verb} left the job ({whose} exited: {after}), so collective "
        f"#{number} on this communicator of {ctx.size} ranks ({what}) can never finish on gflow rank "
        f"{ctx.rank}{world(None)}"
    )


def _completed_before_leaving(ctx, ranks) -> str:
    """'rank 1 after #5, rank 3 after #5': the last collective each rank that left completed on ctx."""
    return ", ".join(f"rank {r} after #{ctx.departed[r]}" for r in ranks)


def abandoned(m: _Mark) -> None:
    """This thread's wait was interrupted by an exception of the program's (a signal handler's
    SystemExit, KeyboardInterrupt): it leaves its collective unfinished, so goodbye must not count
    it as completed."""
    if m.ctx is not None:
        m.ctx.abandoned = m.ctx.entered


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
        for ctx in _watched:
            if ctx.monitor_comm is None or ctx.size == 1:
                continue
            completed = ctx.entered - any(b is ctx for b in busy)
            if ctx.abandoned is not None:
                completed = min(completed, ctx.abandoned - 1)
            completed = np.array([completed], np.int64)
            payloads.append(completed)
            peers = (r for r in range(ctx.size) if r != ctx.rank)
            sends += [ctx.monitor_comm.Isend(completed, r, TAG_GOODBYE) for r in peers]
    deadline = time.monotonic() + 1.0
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
        m.warned_since, m.warned_at = since, None
    waited = time.monotonic() - since
    due_abort = abort > 0 and waited >= abort
    due_warning = warn > 0 and waited >= warn and (m.warned_at is None or waited - m.warned_at >= warn)
    if not (due_abort or due_warning):
        return
    m.warned_at = waited
    text = report(ctx, m, waited)
    if due_abort:
        from .failures import end_job

        end_job(f"{text}; ending the job (GFLOW_STALL_ABORT_S={abort:g})")
    print(text, file=sys.stderr, flush=True)


def report(ctx, m: _Mark, waited: float) -> str:
    """The stall message: this rank, the collective, and where every other rank of ctx is."""
    with _lock:
        return _report(ctx, m, waited)


def _channel(ctx):
    """(the context whose monitor duplicate to ask the peers on, what to ask about), or (None, None).
    A context whose duplicates are still being made (its first collective) has none of its own; a
    background context's peers can then be asked on its parent's, about theirs."""
    if ctx.monitor_comm is not None:
        return ctx, ABOUT_ITSELF
    if ctx.parent is not None and ctx.parent.monitor_comm is not None:
        return ctx.parent, ABOUT_BACKGROUND
    return None, None


def _report(ctx, m: _Mark, waited: float) -> str:
    global _questions
    job = f" ({m.job})" if m.job else ""
    if not config.validate:
        return (
            f"gflow rank {ctx.rank}: waited {waited:.0f} s on thread {m.thread}{job} in a collective (with "
            "GFLOW_VALIDATE=0 gflow counts no collectives, so it cannot tell which ranks are late)"
        )
    asked, about = _channel(ctx)
    what = _brief(ctx.last_sig) if ctx.last_sig is not None else "a collective"
    world = _world_ranks(ctx)
    me_named = f"gflow rank {ctx.rank}{world(None)}"
    parts = [f"{me_named}: waited {waited:.0f} s on thread {m.thread}{job} in collective #{ctx.entered}"]
    parts.append(f"on a communicator of {ctx.size} ranks: {what}")
    if asked is None:  # the duplicates the peers would be asked on are made in this very collective
        parts.append(
            "some rank has not entered gflow's first collective on this communicator yet; which one "
            "cannot be told yet (the channel gflow asks its peers on is made in that collective)"
        )
        return "; ".join(parts)
    _questions += 1
    comm, me, mine = asked.monitor_comm, ctx.rank, ctx.entered
    peers = [r for r in range(ctx.size) if r != me]
    answers = {}
    question = np.array([_questions, about], np.int64)
    sends = [comm.Isend(question, r, TAG_QUESTION) for r in peers]
    buffers = {r: np.empty(3, np.int64) for r in peers}
    receives = {r: comm.Irecv(buffers[r], r, TAG_ANSWER) for r in peers}
    deadline = time.monotonic() + ANSWER_S
    while receives and time.monotonic() < deadline:
        for r, request in list(receives.items()):
            if request.Test():
                if buffers[r][0] == _questions:
                    del receives[r]
                    answers[r] = (int(buffers[r][1]), buffers[r][2] / 1000)
                else:  # a late answer to an earlier question: wait on for this one's
                    receives[r] = comm.Irecv(buffers[r], r, TAG_ANSWER)
        for other in _watched:  # peers may be asking us at the same time
            _answer(other)
        time.sleep(0.005)
    for request in receives.values():  # peers that did not answer: take the question back
        request.Cancel()
        request.Wait()
    MPI.Request.Waitall(sends)  # (tiny messages: sent eagerly, done at once)
    late = sorted(r for r, (count, _) in answers.items() if count < mine)
    waiting = sorted(r for r, (count, seconds) in answers.items() if count >= mine and seconds >= 0)
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
    return "; ".join(parts)


def _world_ranks(ctx):
    """A function giving ' (world ranks ...)' for ranks of ctx's communicator, or '' where those are
    the world's own; with None, the same for this rank."""
    # (the user's communicator while gflow's duplicate is being made: ctx.comm would wait for it)
    comm = ctx._comm if ctx._pending is None else ctx._user_comm
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    same = MPI.Group.Compare(group, world) == MPI.IDENT

    def show(ranks):
        if same:
            return ""
        ranks = [ctx.rank] if ranks is None else ranks
        mapped = MPI.Group.Translate_ranks(group, ranks, world)
        return f" (world rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, mapped[:16]))})"

    return show


def _brief(sig) -> str:
    """'allreduce of 1048576 float32 (host array), op=sum': what the waiting rank called."""
    from ._validate import CODE_COLLECTIVE, CODE_DTYPE, CODE_KIND, CODE_OP, SIG_REJECTED

    collective = CODE_COLLECTIVE.get(int(sig[0]), "a collective")
    if int(sig[7]) == SIG_REJECTED:
        return f"{collective} (its arguments were rejected here)"
    dtype = CODE_DTYPE.get(int(sig[3]))
    kind = CODE_KIND.get(int(sig[6]), "?")
    text = f"{collective} of {int(sig[2])} {dtype.name if dtype else '?'} ({kind} array)"
    return text + (f", op={CODE_OP.get(int(sig[4]), '?')}" if int(sig[4]) else "")


def ranks_text(ranks: list[int]) -> str:
    """'rank 3' or 'ranks 1, 3' (the first 16, then how many more)."""
    shown = ", ".join(map(str, ranks[:16])) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"
