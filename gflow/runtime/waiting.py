"""How a thread waits on its peers: the caller's thread polls and yields the core, gflow's engine
thread polls and sleeps, and every wait is marked for the stall inspector (runtime/stall.py) and shown
on the timeline. CommContext picks one per channel (runtime/context.py)."""

import os
import time
from functools import partial

from mpi4py import MPI

from ..errors import GflowError
from . import stall, timeline
from .config import BACKGROUND_POLL_BACKOFF, config


def caller_wait_until(arrived) -> None:
    """The caller's thread: poll arrived(), yielding the core between polls as MPICH's own Waitall
    does (a rank whose peer shares its core must let it run: without the yield, 4 ranks on 2 cores
    took 80x longer for a 4 KB allreduce). It comes back to Python between polls, so that a peer that
    has left the job is noticed (stall.check_waiting) and signal handlers (Ctrl-C) run."""
    departures, pause = stall.departures, os.sched_yield
    while not arrived():
        if departures:
            stall.check_waiting()
        pause()


def polite_wait_until(arrived) -> None:
    """Poll arrived(), sleeping between polls. MPI progresses only while polled, but a busy-polling
    background thread would take the core from the computation it is meant to overlap with; socket
    and shared-memory buffers hold far more than what moves in one sleep, so bandwidth is kept. The
    pause doubles while the wait lasts (up to BACKGROUND_POLL_BACKOFF times background_poll_us): on a
    slow link the thread wakes seldom, on shared memory as often as before (native_loops.py alike)."""
    departures = stall.departures
    pause = config.background_poll_us * 1e-6
    longest = pause * BACKGROUND_POLL_BACKOFF
    while not arrived():
        if departures:
            stall.check_waiting()
        time.sleep(pause)
        pause = min(pause * 2, longest)


def caller_waitall(requests) -> None:
    """caller_wait_until for MPI requests (a peer's message in shared memory is the other case:
    shared_slots.py)."""
    caller_wait_until(partial(MPI.Request.Testall, requests))


def polite_waitall(requests) -> None:
    """polite_wait_until for MPI requests."""
    polite_wait_until(partial(MPI.Request.Testall, requests))


def watched(wait):
    """wait (a function of a list of requests), marked for the stall inspector (this thread waits
    on a peer since now), and shown as a "wait" span when a timeline is on: every wait on a peer
    goes through one of these."""

    local, monotonic = stall._local, time.monotonic

    def waitall(requests):
        try:
            mark = local.mark
        except AttributeError:
            mark = stall.mark()
        mark.since = monotonic()
        try:
            if not timeline.active():
                return wait(requests)
            with timeline.span("wait"):
                return wait(requests)
        except GflowError:  # failed on every rank alike (or a peer left): nothing left unfinished here
            raise
        except BaseException:  # a signal handler's SystemExit, Ctrl-C, ...: this rank leaves the
            stall.abandoned(mark)  # collective unfinished, and must not tell its peers it finished it
            raise
        finally:
            mark.since = None

    return waitall


def wait_for_duplicates(requests, ctx) -> None:
    """Wait politely for a background context's duplicates (made with its parent's in the first
    collective on a communicator, context.CommContext.make_duplicates, or after a failure at the next
    async call), and raise GflowError if a rank of its parent has left and they are still not made a
    second later: the rank that left never started them. (Its count on the background context cannot
    tell: the rank that left may never have made that context.) A peer that found crossed waits with
    this one (stall._check_crossed) makes it raise MismatchError at once."""
    parent = ctx.parent
    pause, noticed = config.background_poll_us * 1e-6, None
    while not MPI.Request.Testall(requests):
        if stall.departures:
            stall.hear_elsewhere(parent)
        if parent.crossed:
            stall.raise_crossed(ctx, 1)
        if parent.gone:
            noticed = noticed or time.monotonic()
            if time.monotonic() - noticed > 1.0:
                gone = sorted(parent.gone)
                raise GflowError(
                    f"{stall.ranks_text(gone)} {'has' if len(gone) == 1 else 'have'} left the job "
                    f"({'its process' if len(gone) == 1 else 'their processes'} exited) without making "
                    f"gflow's background communicator with rank "
                    f"{parent.rank}: no async collective can start"
                )
        time.sleep(pause)
