"""Peer memory: memory that every rank of a node reads and writes directly, where the hierarchical
allreduce's node phase works (collectives/hierarchical.py).

The node phase is written once, against NodeSlots; what maps the memory (a "mapping") has two
implementations, so that the algorithm and its tests run on any machine and only the mapping is
GPU-only:
- host buffers: an MPI shared-memory window of the node (runtime/shared_memory.py's HostWindow);
- device buffers: device memory the node's ranks export to each other with CUDA IPC handles
  (cuda/ipc.py; under Numba's simulator, whose device memory is host memory, a host window seen as
  device arrays: the device node phase, its kernels and its ordering run there without a GPU).

A mapping has `memory` ("host"/"device": which ops work on it), `where` (for messages), `room()`
(free bytes for it), `allocate(node_comm, nbytes, local)` (every node rank's nbytes as byte arrays of
its memory, this rank's zeroed; collective over the node, and on failure it raises
PeerMemoryUnavailable on every node rank), `before_barrier()` (this rank's writes done),
`after_barrier()` (the peers' writes visible here) and `free()` (collective).
"""

import os
import warnings

import numpy as np
from mpi4py import MPI

from ..runtime import stall
from ..runtime.context import CommContext
from ..runtime.shared_memory import HostWindow, PeerMemoryUnavailable, pages
from ..runtime.waiting import watched

_CODE = {"host": 1, "device": 2}  # what a node rank can map, as the node's ranks compare it


def node_mapping(node: CommContext, memory: str, shared_memory: bool):
    """A mapping of buffers of `memory` ("host" or "device") that every rank of the node can use,
    or None (then the node phase takes the node's ring; for device buffers gflow says once why).
    Collective over the node: its ranks compare what they can map, and all take it or none."""
    mapping, why = None, "no shared memory between this node's ranks"
    if memory == "host":
        mapping = HostWindow() if shared_memory else None
    else:
        from ..cuda import ipc

        mapping, why = ipc.mapping(shared_memory)
    code = _CODE[memory] if mapping is not None else 0
    codes = np.empty(2, np.int64)
    node.comm.Allreduce(np.array([code, -code], np.int64), codes, op=MPI.MIN)
    if codes[0] == -codes[1] != 0:
        return mapping
    if memory == "device":
        if mapping is not None:
            why = "another rank of this node cannot map its peers' device memory (or stages it on the host)"
        warn_once("device", f"the node phase of device arrays runs a ring inside the node: {why}")
    return None


class NodeSlots:
    """Two slots per node rank in one allocation of peer memory, used by alternate calls: a rank
    copies its result out of its peers' slots after the call's last barrier, and the next call
    overwrites only the other slots, so no third barrier is needed."""

    def __init__(self, node: CommContext, local: int, mapping):
        self.node, self.local, self.mapping = node, local, mapping
        self.memory = mapping.memory
        self._slot_bytes = 0
        self._slots = None
        self._parity = 0
        self._failed_bytes = None  # the smallest allocation that failed: not tried again at that size

    def slots(self, count: int, dtype):
        """Every node rank's slot for this call, as count elements of dtype; None when the node cannot
        hold them (then the node phase takes the ring).

        Growing the allocation is collective over the node: all its ranks ask for the same size (the
        ranks agreed on it), in the same call, and agree whether there is room for it."""
        nbytes = count * np.dtype(dtype).itemsize
        if nbytes > self._slot_bytes or self._slots is None:
            self._release()
            size = pages(nbytes)
            room = self.node.comm.allreduce(self.mapping.room(), op=MPI.MIN)
            if 2 * size * self.node.size > room // 2:  # leave half the room to everyone else
                warn_once(
                    "room",
                    f"the hierarchical allreduce's node phase needs {2 * size * self.node.size >> 20} MiB "
                    f"of {self.mapping.where} and it has {room >> 20} MiB free (gflow takes at most half "
                    "of it); using a ring inside the node instead (give it more room, or lower "
                    "gflow.config.shared_memory_max_bytes)",
                )
                return None
            if self._failed_bytes is not None and 2 * size >= self._failed_bytes:
                return None  # (alike on the node's ranks: the failure was raised on all of them)
            try:
                memory = self.mapping.allocate(self.node.comm, 2 * size, self.local)
            except PeerMemoryUnavailable as failure:
                self._failed_bytes = 2 * size
                warn_once("allocate", f"the node phase runs a ring inside the node: {failure}")
                return None
            self._slots = [[m[:size], m[size : 2 * size]] for m in memory]
            self._slot_bytes = size
        self._parity ^= 1
        return [pair[self._parity][:nbytes].view(dtype) for pair in self._slots]

    def room(self) -> int:
        """The free bytes of this rank's peer memory, its own slots counted as free (slots() lets
        them go before it asks for larger ones)."""
        return self.mapping.room() + 2 * self._slot_bytes

    def barrier(self, value: int = 0, pool=None) -> bool:
        """A node barrier that also orders the peer memory (every write before it, on any node rank,
        is seen after it on all), and tells whether every node rank passed the same `value`. It waits
        politely, yielding the core between polls: a node phase is memory-bound work spread over
        every rank of the node, and a rank spinning in a barrier would slow the ones still working
        whenever ranks outnumber cores. `pool`: a SharedPool whose memory is ordered too."""
        self.mapping.before_barrier()
        if pool is not None:
            pool.mapping.before_barrier()
        values = np.array([value, -value], np.int64)
        extremes = np.empty(2, np.int64)
        request = self.node.comm.Iallreduce(values, extremes, op=MPI.MIN)
        (self.node.waitall if self.node.is_background else _yielding_wait)([request])
        self.mapping.after_barrier()
        if pool is not None:
            pool.mapping.after_barrier()
        return extremes[0] == -extremes[1]

    def _release(self) -> None:
        if self._slots is not None:
            self._slots = None
            self._slot_bytes = 0
            self.mapping.free()

    def free(self) -> None:
        self._release()


_warned: set = set()


def warn_once(topic: str, message: str) -> None:
    """A RuntimeWarning, once per process for each topic."""
    if topic not in _warned:
        _warned.add(topic)
        warnings.warn(f"gflow: {message}", RuntimeWarning, stacklevel=3)


def _yield_until_done(requests) -> None:
    departures = stall.departures
    while not MPI.Request.Testall(requests):
        if departures:
            stall.check_waiting()
        os.sched_yield()


_yielding_wait = watched(_yield_until_done)  # the caller's thread in a node barrier (see barrier)
