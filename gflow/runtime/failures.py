"""When a rank fails: an exception that nothing catches ends the whole job at once, naming the rank.

Why: MPI leaves the other ranks waiting, forever, for a rank whose Python program died of an
exception (its process may even live on, stuck in MPI_Finalize). On a large job that burns hours of
the cluster, and nothing says which rank failed. gflow chains an excepthook onto sys.excepthook:
Python prints the traceback as usual, then one line naming the rank, the exception's type and
message, and MPI_Abort ends every rank of the job with a non-zero status (what `python -m mpi4py`
does for the programs it runs). Only exceptions that reach the top of the main thread get there, so
one that the program catches (a MismatchError it handles) is never fatal. config.abort_on_exception
(GFLOW_ABORT_ON_EXCEPTION=0) turns it off; it is read when the exception arrives.

A rank that leaves without an exception (sys.exit, the end of the script) is told to its peers by
the stall inspector's monitor (stall.goodbye, stall.check_waiting): they raise GflowError naming it,
which, if they do not catch it, ends the job here too.

MPICH removes its node's shared-memory file (/dev/shm/mpich_shm_*) in MPI_Finalize, which an aborted
job never reaches: every failed job left 1-3 MB of a node's memory behind, for good (4 GB on one
developer's machine after a few runs of the test suite). end_job removes the ones this process maps
first; the other ranks of the node map the same file and keep it while they live.
"""

import os
import sys
import time

from mpi4py import MPI

from .config import config

_previous = None
# MPI_Abort kills every rank at once; the launcher may not yet have forwarded what this rank just
# wrote (MPICH's mpiexec lost the traceback and the line naming the rank in about 1 run of 3).
FORWARD_S = 0.3


def _excepthook(error_type, value, traceback) -> None:
    _previous(error_type, value, traceback)  # the traceback, as Python (or the hook before ours) prints it
    if not config.abort_on_exception or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:  # no peer to leave waiting: exit as Python does
        return
    message = str(value).splitlines()[0] if str(value) else ""
    end_job(
        f"gflow rank {world.Get_rank()}: uncaught {error_type.__name__}{': ' + message if message else ''}; "
        "ending the job with MPI_Abort (GFLOW_ABORT_ON_EXCEPTION=0 turns this off)"
    )


def end_job(line: str) -> None:
    """Print line on stderr and end every rank of the job with MPI_Abort (status 1)."""
    print(line, file=sys.stderr, flush=True)
    from . import timeline

    timeline.stop_timeline()  # the trace of a failed job is one worth keeping
    remove_mpich_segments()
    time.sleep(FORWARD_S)
    MPI.COMM_WORLD.Abort(1)


def remove_mpich_segments() -> list[str]:
    """Unlink the MPICH shared-memory files this process maps; return their paths.

    Only for a job about to end: a process of the node that had not yet opened the file could no
    longer open it (by then, MPI_Init has opened it on every rank of the node).
    """
    removed = []
    for path in sorted(mpich_segments()):
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:  # another rank of the node removed it first
            pass
    return removed


def mpich_segments(maps: str = "/proc/self/maps") -> set[str]:
    """The MPICH shared-memory files a process maps (this one's, or another's /proc/PID/maps); none
    where that cannot be read (not Linux, a process that ended or is another user's)."""
    try:
        with open(maps) as lines:
            fields = [line.split() for line in lines]
    except OSError:
        return set()
    # (a file already removed shows as "/dev/shm/mpich_shm_... (deleted)": not matched)
    return {f[-1] for f in fields if f and f[-1].startswith("/dev/shm/mpich_shm_")}


def install() -> None:
    """Chain gflow's excepthook onto sys.excepthook (once, at import)."""
    global _previous
    if _previous is None:
        _previous, sys.excepthook = sys.excepthook, _excepthook
