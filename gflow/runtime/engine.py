"""The background communication thread: runs submitted collectives in order, so callers can compute
while messages move (GradientFlow's computation/communication overlap).

It knows nothing of the algorithms: collectives submit plain callables and get a Handle back. One
thread serves the whole process and runs its work in submission order, which is what keeps ranks
matched: every rank submits its collectives in the same order, as MPI requires of blocking ones.
The engine's collectives use their own duplicate communicator (CommContext.background), so they
never meet the blocking calls the caller's thread makes meanwhile. That needs MPI_THREAD_MULTIPLE,
which mpi4py asks for by default; the engine checks it on first use.
"""

import itertools
import queue
import threading

from mpi4py import MPI

from ..errors import GflowError, NonFiniteError
from . import stall, timeline

_running = threading.local()  # what the engine thread runs now (running)

# What a job is, for the verdict on a mismatch (collectives/recursive_doubling.end_where_a_step_met_strays):
# a call queued outside any step, one queued while a step was begun on its communicator, a training
# step's own work (a LazyAllreduce segment, its final exchange), or a step's rejection of a bad push
# (after which that step sends nothing more).
CALL, IN_A_STEP, STEP, STEP_REJECTION = 1, 2, 3, 4


def running() -> int:
    """What this thread runs now: one of CALL, IN_A_STEP, STEP, STEP_REJECTION (a blocking call's
    thread: CALL)."""
    return getattr(_running, "kind", CALL)


class Handle:
    """An operation in flight. Holds every buffer the operation uses, so none can be freed before
    it finishes, whatever the caller drops."""

    def __init__(self, description: str, keep: tuple, on_failure=None, ctx=None, kind=CALL):
        self.description = description
        self.kind = kind  # CALL, IN_A_STEP, STEP or STEP_REJECTION (running)
        self.context = ctx  # the background CommContext the operation runs on (or None)
        self._keep = keep
        self._on_failure = on_failure
        self._finished = threading.Event()
        self._result = None
        self._error = None
        self._unseen = None  # (its failure's number among those no wait() has raised: Engine.collected)
        self._collected = False  # (its failure reached the program: not one lost at exit)

    def done(self) -> bool:
        """True once the operation has finished (successfully or not); never blocks."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None):
        """Block until the operation finishes; return its result or raise its error.

        Raises:
            TimeoutError: timeout seconds passed first (the operation goes on).
        """
        if not self._finished.is_set():
            mark = stall.mark()  # a program's thread waiting for background work (stall._check_crossed)
            mark.blocked_on = self.context
            try:
                finished = self._finished.wait(timeout)
            finally:
                mark.blocked_on = None
            if not finished:
                raise TimeoutError(f"{self.description} did not finish within {timeout} s")
        self._keep = ()
        if self._error is not None:
            _engine.collected(self)
            if self._on_failure is not None:  # it acts only where the failure was collective
                self._on_failure(self.context)
            raise self._error
        return self._result

    def error_said_elsewhere(self) -> None:
        """The caller raised another error for what failed in this job (join()): it is not one lost
        at exit, though no wait() raises it."""
        _engine.collected(self)

    def _finish(self, result=None, error=None) -> None:
        self._result, self._error = result, error
        self._finished.set()


class Engine:
    """One daemon thread taking (callable, handle) pairs from a queue."""

    _STOP = object()

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._thread = None
        self._lock = threading.Lock()
        self._in_flight: dict = {}  # the handles of jobs queued or running, in submission order
        # Failures no wait() has raised, held or dropped by the program, by number: their lines
        # (None past _LINES_KEPT), which shutdown() returns
        self._unseen: dict = {}
        self._failures = itertools.count()

    def idle(self) -> bool:
        return not self._in_flight

    def submit(self, description: str, fn, keep: tuple = (), ctx=None, on_failure=None, kind=None) -> Handle:
        if kind is None:  # (a call of the program's: inside a step of its communicator, or not)
            parent = getattr(ctx, "parent", None)
            kind = IN_A_STEP if parent is not None and parent.in_a_step() else CALL
        handle = Handle(description, keep, on_failure, ctx, kind)
        with self._lock:
            if self._thread is None:
                if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
                    from .mpi import mpi_library, thread_level_name

                    raise GflowError(
                        f"gflow's background thread (async calls, LazyAllreduce) needs MPI initialised "
                        f"with MPI_THREAD_MULTIPLE; {mpi_library()} gave "
                        f"{thread_level_name(MPI.Query_thread())}: leave mpi4py.rc.thread_level at "
                        "'multiple' (its default), or use an MPI library built with thread support"
                    )
                self._thread = threading.Thread(target=self._run, name="gflow-engine", daemon=True)
                self._thread.start()
            self._in_flight[handle] = None
            self._queue.put((fn, handle, ctx))
        if timeline.active():
            timeline.counter("engine queue", self._queue.qsize())
        return handle

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is self._STOP:
                return
            self._run_one(*item)
            item = None  # (nothing of a job outlives it here: see _run_one)

    def _run_one(self, fn, handle: Handle, ctx) -> None:
        """Run one job and hand its result or error to its handle. Its own frame: an error raised
        again by Handle.wait carries the waiting caller's frames, whose locals hold the program's
        objects, and a reference to it left in this thread until the next job kept those alive
        (helper-70: an optimizer replaced after a failed step went on reducing its parameters)."""
        mark = stall.mark()
        mark.job, _running.kind = handle.description, handle.kind
        result = error = None
        try:
            with timeline.span(handle.description):
                result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            # (not for inf/NaN: every rank settles that alike after its collective completed, so
            # their queues stay alike, and ranks in join() stay on this channel with them)
            failed = isinstance(exc, GflowError) and not isinstance(exc, NonFiniteError)
            if ctx is not None and ctx.failed is None and failed:
                ctx.failed = f"{handle.description}: {exc}"
            error = exc
        # (before the caller wakes: a finished job is not a busy thread at exit)
        mark.job, _running.kind = None, CALL
        with self._lock:
            self._in_flight.pop(handle, None)
            if error is not None and not handle._collected:  # (kept until a wait() raises it)
                first = (str(error).splitlines() or [""])[0]  # (a MismatchError's summary line)
                line = f"{handle.description}: {type(error).__name__}: {first}"
                handle._unseen = next(self._failures)
                self._unseen[handle._unseen] = line if len(self._unseen) < _LINES_KEPT else None
        handle._finish(result=result, error=error)

    def collected(self, handle: Handle) -> None:
        """handle's failure reached the program (its wait() raised it, or the caller another error for
        it): not one lost at exit. A failure never collected is said at exit, whether the job ended
        before it (its peers had left already) or in it."""
        with self._lock:
            handle._collected = True
            self._unseen.pop(handle._unseen, None)

    def shutdown(self, timeout: float = 10.0) -> list[str]:
        """Let queued work finish, then stop the thread (bounded: it is a daemon either way). Returns
        what was lost: a line for each job that failed, before or now (a peer left first), and that
        no wait() raised, and for each job in flight that had not finished within `timeout`; no
        caller will wait for those any more."""
        with self._lock:
            thread, self._thread = self._thread, None
            left = [h for h in self._in_flight if h.description != "drain"]
        if thread is not None:
            self._queue.put(self._STOP)
            thread.join(timeout)
        # (before the failures: a job that fails in between is said twice rather than not at all)
        unfinished = [h.description for h in left if not h.done()]
        with self._lock:
            unseen, self._unseen = list(self._unseen.values()), {}  # (said once: here)
        lost = [line for line in unseen if line is not None]
        if len(lost) < len(unseen):
            lost.append(f"{len(unseen) - len(lost)} more failed jobs that no wait() collected")
        return lost + [f"{job}: not finished after {timeout:g} s, dropped" for job in unfinished]


_LINES_KEPT = 100  # lines kept of failures no wait() collected (at_exit shows 3, counts the rest)

_engine = Engine()  # stopped at exit by lifecycle.py, before MPI finalizes
stall.register_engine(_engine.idle)


def shutdown(timeout: float = 10.0) -> list[str]:
    """Stop the background thread once its queued work is done (a later submit starts it again);
    the jobs lost, as Engine.shutdown says."""
    return _engine.shutdown(timeout)


def idle() -> bool:
    """Nothing queued or running on the background thread: it starts nothing more unless the
    program submits it (stall._check_crossed)."""
    return _engine.idle()


def drain() -> None:
    """Wait until the work submitted before has ended (whether it succeeded or failed: its own
    handles report that); at once when nothing is queued or running."""
    if not _engine.idle():
        _engine.submit("drain", lambda: None).wait()


def submit(description: str, fn, keep: tuple = (), ctx=None, on_failure=None, kind=None) -> Handle:
    """Run fn() on the background thread after everything submitted before it; return its Handle.
    A GflowError from fn, but NonFiniteError, marks `ctx` (a background CommContext) failed: see
    CommContext.check_usable; on_failure(ctx) runs in the caller's thread when Handle.wait raises
    (CommContext.reset_background, which acts only on a context marked failed). `kind`: what fn is
    (running): STEP or STEP_REJECTION for a training step's work; by default IN_A_STEP or CALL."""
    return _engine.submit(description, fn, keep, ctx, on_failure, kind)
