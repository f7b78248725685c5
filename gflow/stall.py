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
"""

import sys
import threading
import time
import warnings

import numpy as np
from mpi4py import MPI

from ._config import config

POLL_S = 0.05
ANSWER_S = 2.0
TAG_QUESTION, TAG_ANSWER = 1, 2

_local = threading.local()
_marks: list = []  # every thread's _Mark
_watched: list = []  # contexts whose questions the monitor answers
_lock = threading.RLock()  # held while the monitor talks on a context's duplicate, and to free it
_monitor = None
_questions = 0
_warned_off = False


class _Mark:
    """What one thread is doing: the context of its last collective and since when it waits."""

    __slots__ = ("thread", "ctx", "since", "warned_at", "warned_since", "job")

    def __init__(self):
        self.thread = threading.current_thread().name
        self.ctx = None
        self.since = None
        self.warned_at = None
        self.warned_since = None  # the wait warned_at belongs to
        self.job = None


def mark() -> _Mark:
    """This thread's mark (made on first use)."""
    m = getattr(_local, "mark", None)
    if m is None:
        m = _local.mark = _Mark()
        with _lock:
            _marks.append(m)
    return m


def entered(ctx, sig) -> None:
    """ctx's next collective begins on this thread (its agreement): count it."""
    ctx.entered += 1
    ctx.last_sig = sig
    try:
        _local.mark.ctx = ctx
    except AttributeError:
        mark().ctx = ctx


def watch(ctx) -> None:
    """Answer the peers' questions about ctx (its monitor duplicate is made by the caller)."""
    global _monitor, _warned_off
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:  # the monitor would call MPI beside the caller
        if not _warned_off and (config.stall_warning_s > 0 or config.stall_abort_s > 0):
            _warned_off = True
            warnings.warn(
                "gflow: the stall inspector is off: it needs MPI initialised with MPI_THREAD_MULTIPLE "
                "(mpi4py's default)",
                RuntimeWarning,
                stacklevel=2,
            )
        return
    with _lock:
        _watched.append(ctx)
        if _monitor is None:
            _monitor = threading.Thread(target=_run, name="gflow-monitor", daemon=True)
            _monitor.start()


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
    while comm.Iprobe(MPI.ANY_SOURCE, TAG_QUESTION, status):
        question = np.empty(1, np.int64)
        comm.Recv(question, status.Get_source(), TAG_QUESTION)
        waiting = [t for t in (m.since for m in list(_marks) if m.ctx is ctx) if t is not None]
        seconds = time.monotonic() - min(waiting) if waiting else -1.0
        comm.Send(
            np.array([question[0], ctx.entered, int(seconds * 1000)], np.int64),
            status.Get_source(),
            TAG_ANSWER,
        )


def _inspect(m: _Mark) -> None:
    since, ctx = m.since, m.ctx
    warn, abort = config.stall_warning_s, config.stall_abort_s
    if since is None or ctx is None or ctx.monitor_comm is None:
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
        print(f"{text}; ending the job (GFLOW_STALL_ABORT_S={abort:g})", file=sys.stderr, flush=True)
        from . import timeline

        timeline.stop_timeline()  # the trace of a stalled job is the one most worth keeping
        MPI.COMM_WORLD.Abort(1)
    print(text, file=sys.stderr, flush=True)


def report(ctx, m: _Mark, waited: float) -> str:
    """The stall message: this rank, the collective, and where every other rank of ctx is."""
    with _lock:
        return _report(ctx, m, waited)


def _report(ctx, m: _Mark, waited: float) -> str:
    global _questions
    job = f" ({m.job})" if m.job else ""
    if not config.validate:
        return (
            f"gflow rank {ctx.rank}: waited {waited:.0f} s on thread {m.thread}{job} in a collective (with "
            "GFLOW_VALIDATE=0 gflow counts no collectives, so it cannot tell which ranks are late)"
        )
    _questions += 1
    comm, me, mine = ctx.monitor_comm, ctx.rank, ctx.entered
    peers = [r for r in range(ctx.size) if r != me] if comm is not None else []
    answers = {}
    question = np.array([_questions], np.int64)
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
    silent = sorted(r for r in peers if r not in answers)
    what = _brief(ctx.last_sig) if ctx.last_sig is not None else "a collective"
    world = _world_ranks(ctx)
    me_named = f"gflow rank {ctx.rank}{world(None)}"
    parts = [f"{me_named}: waited {waited:.0f} s on thread {m.thread}{job} in collective #{mine}"]
    parts.append(f"on a communicator of {ctx.size} ranks: {what}")
    if late:
        counts = ", ".join(f"rank {r} at #{answers[r][0]}" for r in late)
        verb = "has" if len(late) == 1 else "have"
        parts.append(f"{_ranks(late)}{world(late)} {verb} not entered it yet ({counts})")
    if waiting:
        parts.append(f"{_ranks(waiting)}{world(waiting)} {'is' if len(waiting) == 1 else 'are'} in it too")
    if silent:
        parts.append(
            f"{_ranks(silent)}{world(silent)} did not answer within {ANSWER_S:g} s (gone, stuck holding "
            "the GIL, or not yet on this communicator)"
        )
    if not (late or silent):
        parts.append("every rank has entered it: a peer is slow inside it, or the network is")
    return "; ".join(parts)


def _world_ranks(ctx):
    """A function giving ' (world ranks ...)' for ranks of ctx's communicator, or '' where those are
    the world's own; with None, the same for this rank."""
    group, world = ctx.comm.Get_group(), MPI.COMM_WORLD.Get_group()
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


def _ranks(ranks: list[int]) -> str:
    """'rank 3' or 'ranks 1, 3' (the first 16, then how many more)."""
    shown = ", ".join(map(str, ranks[:16])) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"
