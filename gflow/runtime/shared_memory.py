"""MPI shared-memory windows: host memory that every rank of a node maps, for the hierarchical
allreduce's node phase (collectives/peer_memory.py) and the gradient pools that live in it
(collectives/hierarchical.py's shared_pool).

MPICH maps a window without reserving its pages, and a write beyond the room of the file system
that backs it is a SIGBUS, not an error: so windows are zeroed when made (they take their room at
once), and callers check room() before asking for one.
"""

import os

import numpy as np
from mpi4py import MPI

SHM = "/dev/shm"  # where MPICH and Open MPI put shared-memory windows on Linux


class PeerMemoryUnavailable(RuntimeError):
    """A node's ranks cannot map each other's memory (raised alike on every rank of the node, by the
    mappings of collectives/peer_memory.py)."""


def pages(nbytes: int) -> int:
    """nbytes rounded up to whole 4 KiB pages (at least one)."""
    return max(4096, -(-nbytes // 4096) * 4096)


def room() -> int:
    """Free bytes where shared windows live (very large when it cannot be told)."""
    try:
        stat = os.statvfs(SHM)
    except OSError:
        return 2**62
    return stat.f_bavail * stat.f_frsize


# Where each rank's memory starts within a page. glibc's memcpy ran 5-9x slower (4 ranks, 1 MB, from
# memory other ranks had just written) when the destination sat 8 or 16 bytes past the source within a
# page, and a large NumPy array sits 16 bytes into its page while a window starts on one: every copy
# out of a page-aligned window into such an array paid it. Starting at 64 keeps both directions clear
# for arrays that start 0, 16 or 64 bytes into a page (bench/RESULTS.md, "Copies out of shared memory").
PAGE_OFFSET = 64


def allocate(node_comm, nbytes: int, local: int):
    """(window, every node rank's memory as bytes) of a shared window of nbytes per rank, each
    starting PAGE_OFFSET bytes into a page, with this rank's part zeroed (see the module docstring).
    Collective over node_comm."""
    window = MPI.Win.Allocate_shared(nbytes + 4096, 1, comm=node_comm)
    window.Lock_all(MPI.MODE_NOCHECK)
    memory = []
    for q in range(node_comm.size):
        whole = np.frombuffer(window.Shared_query(q)[0], np.uint8)
        skip = (PAGE_OFFSET - whole.ctypes.data) % 4096  # (alike on every rank: pages map whole)
        memory.append(whole[skip : skip + nbytes])
    memory[local][:] = 0
    return window, memory


def free(window) -> None:
    """Free a window made by allocate (collective over its node)."""
    window.Unlock_all()
    window.Free()


class HostWindow:
    """Peer memory on the host: one MPI shared window per allocation (see collectives/peer_memory.py
    for the interface). MPI's unified memory model orders a window's loads and stores with Sync on
    either side of a barrier."""

    memory = "host"
    where = SHM

    def __init__(self):
        self._window = None

    def room(self) -> int:
        return room()

    def allocate(self, node_comm, nbytes: int, local: int) -> list:
        self._window, memory = allocate(node_comm, nbytes, local)
        return memory

    def address(self, x):
        """(address, bytes) of x if it is a C-contiguous host array, else None."""
        if not isinstance(x, np.ndarray) or not x.flags.c_contiguous:
            return None
        return x.__array_interface__["data"][0], x.nbytes

    def before_barrier(self) -> None:
        self._window.Sync()

    def after_barrier(self) -> None:
        self._window.Sync()

    def free(self) -> None:
        if self._window is not None:
            free(self._window)
            self._window = None
