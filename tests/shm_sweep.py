"""Remove the MPICH shared-memory files that test jobs killed from outside left in /dev/shm.

MPICH removes its node's file (/dev/shm/mpich_shm_*) in MPI_Finalize; a job that gflow aborts removes
it first (gflow/runtime/failures.py), but one that a test's timeout or signal kills cannot, and each
leaves 1-3 MB of the machine's memory behind for good. At the end of the run, the parent removes the
files that appeared during it, that no live process maps any longer, and that are older than a few
seconds (a job starting at that moment creates its file before it maps it).
"""

import os
import time

SHM = "/dev/shm"
PREFIX = "mpich_shm_"
SETTLED_S = 10.0

_before = None  # the files there when the run started: never touched


def _segments() -> set[str]:
    try:
        return {entry.path for entry in os.scandir(SHM) if entry.name.startswith(PREFIX)}
    except OSError:  # no /dev/shm (not Linux)
        return set()


def _mapped() -> set[str]:
    """The files any live process maps (a job still running, this run's or anyone's)."""
    from gflow.runtime.failures import mpich_segments

    return set().union(
        *(mpich_segments(f"/proc/{pid}/maps") for pid in filter(str.isdigit, os.listdir("/proc")))
    )


def pytest_sessionstart(session):
    global _before
    _before = _segments()


def pytest_sessionfinish(session, exitstatus):
    if _before is None or os.environ.get("_PYTEST_MPI_CHILD_PROCESS"):
        return
    removed = 0
    for path in sorted(_segments() - _before - _mapped()):
        try:
            if time.time() - os.stat(path).st_mtime > SETTLED_S:
                os.unlink(path)
                removed += 1
        except OSError:  # removed meanwhile
            pass
    if removed:
        print(f"\nremoved {removed} MPICH shared-memory files that killed test jobs left in {SHM}")
