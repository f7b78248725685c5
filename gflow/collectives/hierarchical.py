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
  call (the slots alternate between calls, see Hierarchy.slots). When the input already lives in a
  gradient pool allocated in shared memory (shared_pool, LazyAllreduce.gradient_buffers), the ranks
  reduce straight from their peers' pools and the copy in is saved. Per rank that is about 5 passes
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

from ..runtime import stall, timeline
from ..runtime.config import config
from ..runtime.context import CommContext, watched
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
        self.node_group = self.node.comm.Get_group()  # which shared pools this node phase can read
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

    def barrier(self, value: int = 0, pool=None) -> bool:
        """A node barrier that also orders the window's memory (MPI's unified model: sync, barrier,
        sync), and tells whether every node rank passed the same `value`. It waits politely,
        yielding the core between polls: a node phase is memory-bound work spread over every rank
        of the node, and a rank spinning in a barrier would slow the ones still working whenever
        ranks outnumber cores. `pool`: a SharedPool whose memory is ordered too."""
        windows = [self._window] if pool is None else [self._window, pool.window]
        for window in windows:
            window.Sync()
        values = np.array([value, -value], np.int64)
        extremes = np.empty(2, np.int64)
        request = self.node.comm.Iallreduce(values, extremes, op=MPI.MIN)
        (self.node.waitall if self.node.is_background else _yielding_wait)([request])
        for window in windows:
            window.Sync()
        return extremes[0] == -extremes[1]

    def pool_views(self, src):
        """(tag, views, pool): when src lies in a shared pool this node phase can read, each node
        rank's memory at the same place, and a tag naming the pool and the place, for the node ranks
        to check that they all pass theirs; (0, None, None) when it does not."""
        for pool in _pools:
            start = pool.place(src)
            if start is not None and MPI.Group.Compare(pool.group, self.node_group) == MPI.IDENT:
                return pool.tag(start), pool.views(src, start), pool
        return 0, None, None

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
            size = _pages(nbytes)
            room = self.node.comm.allreduce(_shared_memory_room(), op=MPI.MIN)
            if 2 * size * self.node.size > room // 2:  # leave half the room to everyone else
                _warn_no_room(2 * size * self.node.size, room)
                return None
            self._window, memory = _allocate_shared(self.node.comm, 2 * size, self.local)
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
        self.node_group.Free()
        self.node.free()
        for cross in self.cross.values():
            cross.free()
        self.cross = {}


class SharedPool:
    """One rank's gradient pool in an MPI shared-memory window of its node, and its peers' pools.
    Kept until the process ends (freeing a window is collective over the node, and arrays handed
    out may still point into it)."""

    def __init__(self, window, memory, local: int, group, ident: int):
        self.window, self.memory, self.local, self.group, self.ident = window, memory, local, group, ident

    def place(self, src):
        """src's byte offset in this rank's pool; None if src is not (wholly, contiguously) in it."""
        own = self.memory[self.local]
        start = src.__array_interface__["data"][0] - own.__array_interface__["data"][0]
        if not src.flags.c_contiguous or start < 0 or start + src.nbytes > own.nbytes:
            return None
        return start

    def views(self, src, start: int):
        """Each node rank's pool memory at byte offset `start`, shaped as src."""
        return [m[start : start + src.nbytes].view(src.dtype) for m in self.memory]

    def tag(self, start: int) -> int:
        """This pool and the offset, as one number the node ranks compare."""
        return (self.ident << 40) | (start + 1)


_pools: list = []
_next_pool = 1  # a pool's number is agreed by its node ranks: the largest of their next numbers
# MPICH holds about 2,000 windows per process; pools are kept until exit, so their number is bounded.
MAX_SHARED_POOLS = 64


def shared_pool(ctx: CommContext, nbytes: int):
    """(memory, None): nbytes of zeroed host memory for this rank's gradient pool in a shared window
    of its node, so that the node phase reads every rank's gradients where they were written (no
    copy in); or (None, why) when that cannot help (auto would not take the node phase: no shared
    memory, one rank per node, two ranks on one node), the node lacks room for it, or this process
    already holds MAX_SHARED_POOLS pools. Collective over ctx; every rank gets a window or none."""
    global _next_pool
    h = hierarchy(ctx)
    topo = h.topology
    largest = max(len(n) for n in topo.nodes)
    useful = topo.shared_memory and (largest > 1 if len(topo.nodes) > 1 else ctx.size > 2)
    size = _pages(nbytes)
    room = h.node.comm.allreduce(_shared_memory_room(), op=MPI.MIN) if useful else 0
    fits = useful and size * h.node.size <= room // 2 and len(_pools) < MAX_SHARED_POOLS
    if not ctx.comm.allreduce(bool(fits), op=MPI.LAND):
        if not useful:
            return None, None
        if len(_pools) >= MAX_SHARED_POOLS:
            return None, f"this process already holds {MAX_SHARED_POOLS} shared pools (kept until exit)"
        return None, (
            f"{size * h.node.size >> 20} MiB on this node, and {_SHM} has {room >> 20} MiB free (gflow "
            f"takes at most half of it); give {_SHM} more room"
        )
    ident = h.node.comm.allreduce(_next_pool, op=MPI.MAX)
    _next_pool = ident + 1
    window, memory = _allocate_shared(h.node.comm, size, h.local)
    _pools.append(SharedPool(window, memory, h.local, h.node.comm.Get_group(), ident))
    return memory[h.local][:nbytes], None


def _pages(nbytes: int) -> int:
    """nbytes rounded up to whole 4 KiB pages (at least one)."""
    return max(4096, -(-nbytes // 4096) * 4096)


def _allocate_shared(node_comm, nbytes: int, local: int):
    """(window, every node rank's memory as bytes) of a shared window of nbytes per rank, with this
    rank's part zeroed, so it takes its room in /dev/shm at once: a later window must not count it
    as free (MPICH maps windows without reserving their pages; a write past the room is a SIGBUS)."""
    window = MPI.Win.Allocate_shared(nbytes, 1, comm=node_comm)
    window.Lock_all(MPI.MODE_NOCHECK)
    memory = [np.frombuffer(window.Shared_query(q)[0], np.uint8) for q in range(node_comm.size)]
    memory[local][:] = 0
    return window, memory


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
            f"window and {_SHM} has {room >> 20} MiB free (gflow takes at most half of it); using a ring "
            f"inside the node instead (give {_SHM} more room, or lower "
            "gflow.config.shared_memory_max_bytes)",
            RuntimeWarning,
            stacklevel=2,
        )


def _yield_until_done(requests) -> None:
    departures = stall.departures
    while not MPI.Request.Testall(requests):
        if departures:
            stall.check_waiting()
        os.sched_yield()


_yielding_wait = watched(_yield_until_done)  # the caller's thread in a node barrier (see barrier)


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
    with timeline.span("node phase", bytes=dst.nbytes, ranks=h.node.size) as phase:
        if slots is not None:
            mine = slots[h.local]
            tag, pools, pool = h.pool_views(src)
            if pools is None:
                _copy_in(ops, mine, src, lo, hi)
            if not h.barrier(tag, pool):  # some node rank's src is elsewhere: all copy in after all
                if pools is not None:
                    _copy_in(ops, mine, src, lo, hi)
                pools = pool = None
                h.barrier()
            if pools is not None:  # every node rank's src is at the same place of its shared pool
                parts = [memory[lo:hi] for memory in pools]
            else:
                own = src[lo:hi] if src.flags.writeable else None  # see _copy_in
                parts = [own if q == h.local and own is not None else s[lo:hi] for q, s in enumerate(slots)]
            ops.reduce_many(mine[lo:hi], parts, reduce_op)
            phase.note(pool=pools is not None)
        else:
            ring.reduce_scatter(h.node, src, dst, ops, reduce_op, node_bounds)
            mine = dst
    for s in range(h.first, h.last) if len(h.topology.nodes) > 1 else ():  # (one node: nothing to do)
        shard = mine[bounds[s] : bounds[s + 1]]
        with timeline.span("cross-node ring", bytes=shard.nbytes, shard=s):
            ring.allreduce(h.cross[s], shard, shard, ops, reduce_op)
    if op == "mean":
        ops.divide(mine[lo:hi], ctx.size)
        ops.fence()
    with timeline.span("node allgather", bytes=dst.nbytes):
        if slots is not None:
            h.barrier(pool=pool)
            for q, slot in enumerate(slots):  # every block from the rank that finished it
                ops.copy(dst[node_bounds[q] : node_bounds[q + 1]], slot[node_bounds[q] : node_bounds[q + 1]])
        else:
            ring.allgather(h.node, dst, ops, node_bounds)


def _copy_in(ops, mine, src, lo: int, hi: int) -> None:
    """src into this rank's slot for the peers to read: every block but this rank's own, which it
    reads from src itself (unless src is read-only: the fused reduction takes operands of one type)."""
    ops.copy(mine[:lo], src[:lo])
    ops.copy(mine[hi:], src[hi:])
    if not src.flags.writeable:
        ops.copy(mine[lo:hi], src[lo:hi])
