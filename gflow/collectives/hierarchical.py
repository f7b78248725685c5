"""Hierarchical allreduce: reduce-scatter inside each node, a ring per shard across nodes, allgather
inside each node (Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE, NCCL's split of the work by node).

The shards and who owns them are described in collectives/topology.py. A flat ring over p ranks pays
2(p-1) message latencies and as many Python steps; here a rank pays 2(k-1) inside its node and
2(m-1) across m nodes, and only 1/k of the data crosses the node's link from each rank.

The node phase has two forms:
- shared memory (host arrays, when every node's ranks can map one MPI window): each rank copies its
  input into its slot of the node's window (all but its own block), then reduces its own block of
  shards reading every peer's slot once, in local-rank order, in one fused pass
  (host.reduce_many), into its own slot; after the cross-node ring and a node barrier, each rank
  copies every block straight out of the slot of the rank that finished it. Two node barriers per
  call (the slots alternate between calls, see Hierarchy.slots). Per rank that is about 5 passes
  over the message where a ring makes about 8 (its copies through MPI's shared-memory cells, and its
  reductions), and no Python step per segment;
- a ring on the node's communicator (device arrays, or no shared memory): the same reduce-scatter and
  allgather as collectives/ring.py, with chunk bounds at the shard blocks. A device variant of the
  window phase (CUDA IPC handles in place of the window) would slot in beside the host one.

Every block is reduced by one rank, in one fixed order, then copied: all ranks get the same bits.
"""

import os
import warnings

import numpy as np
from mpi4py import MPI

from .._config import config
from .._context import CommContext
from . import ring
from .topology import Topology, discover, shard_block


def topology(ctx: CommContext) -> Topology:
    """ctx's topology, found on first use (collective: call it where every rank is at the same call)."""
    if ctx.topology is None:
        ctx.topology = discover(ctx.comm)
    return ctx.topology


class Hierarchy:
    """The communicators and the window of one context's hierarchical allreduce (made collectively,
    once, on the first call that needs them)."""

    def __init__(self, ctx: CommContext):
        topo = topology(ctx)
        node_index = topo.node_of[ctx.rank]
        members = topo.nodes[node_index]
        self.topology = topo
        self.shards = topo.shards
        self.local = members.index(ctx.rank)
        self.first, self.last = shard_block(self.local, len(members), self.shards)
        self.node = CommContext(ctx.comm.Split(node_index, ctx.rank), ctx.is_background, own=True)
        # Where each local rank's block starts: the chunk bounds of the node's ring.
        self.starts = [shard_block(j, len(members), self.shards)[0] for j in range(len(members))]
        self.cross = {}
        for s in range(self.shards):
            owns = self.first <= s < self.last
            comm = ctx.comm.Split(0 if owns else MPI.UNDEFINED, node_index)
            if owns:
                self.cross[s] = CommContext(comm, ctx.is_background, own=True)
        self._window = None
        self._slot_bytes = 0
        self._slots = None
        self._parity = 0

    def barrier(self) -> None:
        """A node barrier that also orders the window's memory (MPI's unified model: sync, barrier,
        sync). It waits politely, yielding the core between polls: a node phase is memory-bound work
        spread over every rank of the node, and a rank spinning in a barrier would slow the ones still
        working whenever ranks outnumber cores."""
        self._window.Sync()
        request = self.node.comm.Ibarrier()
        if self.node.is_background:
            self.node.waitall([request])
        else:
            while not request.Test():
                os.sched_yield()
        self._window.Sync()

    def slots(self, count: int, dtype):
        """Every node rank's slot of the window for this call, as count elements of dtype; None when
        the node cannot hold the window (then the node phase takes the ring).

        The window holds two slots per rank, used by alternate calls: a rank copies its result out
        of its peers' slots after the call's last barrier, and the next call overwrites only the
        other slots, so no third barrier is needed. Growing the window is collective over the node;
        all its ranks ask for the same size (the ranks agreed on it), in the same call, and agree
        whether the shared-memory file system has room for it: MPICH maps the window without
        checking, and a write beyond the room there is a SIGBUS, not an error."""
        nbytes = count * np.dtype(dtype).itemsize
        if nbytes > self._slot_bytes or self._window is None:
            self._free_window()
            size = max(4096, -(-nbytes // 4096) * 4096)
            room = self.node.comm.allreduce(_shared_memory_room(), op=MPI.MIN)
            if 2 * size * self.node.size > room // 2:  # leave half the room to everyone else
                _warn_no_room(2 * size * self.node.size, room)
                return None
            self._window = MPI.Win.Allocate_shared(2 * size, 1, comm=self.node.comm)
            self._window.Lock_all(MPI.MODE_NOCHECK)
            memory = [np.frombuffer(self._window.Shared_query(q)[0], np.uint8) for q in range(self.node.size)]
            self._slots = [[m[:size], m[size : 2 * size]] for m in memory]
            self._slot_bytes = size
        self._parity ^= 1
        return [pair[self._parity][:nbytes].view(dtype) for pair in self._slots]

    def _free_window(self) -> None:
        if self._window is not None:
            self._slots = None
            self._window.Unlock_all()
            self._window.Free()
            self._window = None
            self._slot_bytes = 0

    def free(self) -> None:
        if MPI.Is_finalized():
            return
        self._free_window()
        self.node.free()
        for cross in self.cross.values():
            cross.free()
        self.cross = {}


_SHM = "/dev/shm"  # where MPICH and Open MPI put shared-memory windows on Linux
_warned = False


def _shared_memory_room() -> int:
    """Free bytes where shared windows live (very large when it cannot be told)."""
    try:
        stat = os.statvfs(_SHM)
    except OSError:
        return 2**62
    return stat.f_bavail * stat.f_frsize


def _warn_no_room(needed: int, room: int) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"gflow: the hierarchical allreduce's node phase needs a {needed >> 20} MiB shared-memory "
            f"window and {_SHM} has {room >> 20} MiB free; using a ring inside the node instead (give "
            f"{_SHM} more room, or lower gflow.config.shared_memory_max_bytes)",
            RuntimeWarning,
            stacklevel=2,
        )


def hierarchy(ctx: CommContext) -> Hierarchy:
    if ctx.hierarchy is None:
        ctx.hierarchy = Hierarchy(ctx)
    return ctx.hierarchy


def allreduce(ctx: CommContext, src, dst, ops, op: str, host_memory: bool) -> None:
    """Hierarchical allreduce of the flat `src` into the flat `dst` (may be src). op: sum, mean, max
    or min. host_memory: the buffers are host memory the node phase may place in a shared window
    (the ranks agreed on the kind of array, so they agree on this).

    A message above config.shared_memory_max_bytes goes in pieces of at most that size, each a whole
    hierarchical allreduce, so that the window stays bounded (the ranks agree on the setting: it is
    part of the call's signature)."""
    step = max(4096, config.shared_memory_max_bytes) // dst.itemsize
    if dst.size <= step:
        _allreduce_piece(ctx, src, dst, ops, op, host_memory)
        return
    for lo in range(0, dst.size, step):
        _allreduce_piece(ctx, src[lo : lo + step], dst[lo : lo + step], ops, op, host_memory)


def _allreduce_piece(ctx: CommContext, src, dst, ops, op: str, host_memory: bool) -> None:
    h = hierarchy(ctx)
    reduce_op = "sum" if op == "mean" else op
    bounds = ring.chunk_bounds(dst.size, h.shards)
    node_bounds = [bounds[s] for s in h.starts] + [dst.size]  # each local rank's block
    lo, hi = node_bounds[h.local], node_bounds[h.local + 1]
    slots = None
    if host_memory and h.topology.shared_memory and h.node.size > 1:
        slots = h.slots(dst.size, dst.dtype)  # None when the node has no room for the window
    if slots is not None:
        mine = slots[h.local]
        # Peers read every block of this slot but this rank's own, which this rank reads from src
        # (unless src is read-only: the fused reduction takes operands of one type).
        own = src[lo:hi] if src.flags.writeable else None
        ops.copy(mine[:lo], src[:lo])
        ops.copy(mine[hi:], src[hi:])
        if own is None:
            ops.copy(mine[lo:hi], src[lo:hi])
        h.barrier()
        parts = [own if q == h.local and own is not None else slot[lo:hi] for q, slot in enumerate(slots)]
        ops.reduce_many(mine[lo:hi], parts, reduce_op)
    else:
        ring.reduce_scatter(h.node, src, dst, ops, reduce_op, node_bounds)
        mine = dst
    for s in range(h.first, h.last):
        shard = mine[bounds[s] : bounds[s + 1]]
        ring.allreduce(h.cross[s], shard, shard, ops, reduce_op)
    if op == "mean":
        ops.divide(mine[lo:hi], ctx.size)
        ops.fence()
    if slots is not None:
        h.barrier()
        for q, slot in enumerate(slots):  # every block from the rank that finished it
            ops.copy(dst[node_bounds[q] : node_bounds[q + 1]], slot[node_bounds[q] : node_bounds[q + 1]])
    else:
        ring.allgather(h.node, dst, ops, node_bounds)
