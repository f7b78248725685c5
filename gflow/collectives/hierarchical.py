"""Hierarchical allreduce: reduce-scatter inside each node, a ring per shard across nodes, allgather
inside each node (Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE, NCCL's split of the work by node).

The shards and who owns them are described in collectives/topology.py. A flat ring over p ranks pays
2(p-1) message latencies and as many Python steps; here a rank pays 2(k-1) inside its node and
2(m-1) across m nodes, and only 1/k of the data crosses the node's link from each rank.

The node phase has two forms:
- shared memory (host arrays, when every node's ranks can map one MPI window): each rank copies its
  input into its slot of the node's window, then reduces its own block of shards reading every
  peer's slot once, in local-rank order, into its own slot; after the cross-node ring it writes its
  finished block into every peer's slot. Two node barriers per call. Far fewer passes over memory
  than a ring's copies and reductions, and no Python step per segment;
- a ring on the node's communicator (device arrays, or no shared memory): the same reduce-scatter and
  allgather as collectives/ring.py, with chunk bounds at the shard blocks. A device variant of the
  window phase (CUDA IPC handles in place of the window) would slot in beside the host one.

Every block is reduced by one rank, in one fixed order, then copied: all ranks get the same bits.
"""

import numpy as np
from mpi4py import MPI

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

    def barrier(self) -> None:
        """A node barrier that also orders the window's memory (MPI's unified model: sync, barrier,
        sync), waiting the way the context waits."""
        self._window.Sync()
        node = self.node
        if node.is_background:
            node.waitall([node.comm.Ibarrier()])
        else:
            node.comm.Barrier()
        self._window.Sync()

    def slots(self, count: int, dtype) -> list:
        """Every node rank's slot of the window, as count elements of dtype. Growing the window is
        collective over the node; all its ranks ask for the same size (the ranks agreed on it)."""
        nbytes = count * np.dtype(dtype).itemsize
        if nbytes > self._slot_bytes or self._window is None:
            self._free_window()
            size = max(4096, -(-nbytes // 4096) * 4096)
            self._window = MPI.Win.Allocate_shared(size, 1, comm=self.node.comm)
            self._window.Lock_all(MPI.MODE_NOCHECK)
            self._slots = [
                np.frombuffer(self._window.Shared_query(q)[0], np.uint8)[:size] for q in range(self.node.size)
            ]
            self._slot_bytes = size
        return [slot[:nbytes].view(dtype) for slot in self._slots]

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


def hierarchy(ctx: CommContext) -> Hierarchy:
    if ctx.hierarchy is None:
        ctx.hierarchy = Hierarchy(ctx)
    return ctx.hierarchy


def allreduce(ctx: CommContext, src, dst, ops, op: str, host_memory: bool) -> None:
    """Hierarchical allreduce of the flat `src` into the flat `dst` (may be src). op: sum, mean, max
    or min. host_memory: the buffers are host memory the node phase may place in a shared window
    (the ranks agreed on the kind of array, so they agree on this)."""
    h = hierarchy(ctx)
    reduce_op = "sum" if op == "mean" else op
    bounds = ring.chunk_bounds(dst.size, h.shards)
    lo, hi = bounds[h.first], bounds[h.last]
    in_window = host_memory and h.topology.shared_memory and h.node.size > 1
    if in_window:
        slots = h.slots(dst.size, dst.dtype)
        mine = slots[h.local]
        ops.copy(mine, src)
        h.barrier()
        _reduce_block(slots, mine[lo:hi], lo, hi, ops, reduce_op, h.node)
    else:
        node_bounds = [bounds[s] for s in h.starts] + [dst.size]
        ring.reduce_scatter(h.node, src, dst, ops, reduce_op, node_bounds)
        mine = dst
    for s in range(h.first, h.last):
        shard = mine[bounds[s] : bounds[s + 1]]
        ring.allreduce(h.cross[s], shard, shard, ops, reduce_op)
    if op == "mean":
        ops.divide(mine[lo:hi], ctx.size)
        ops.fence()
    if in_window:
        for q, slot in enumerate(slots):
            if q != h.local:
                ops.copy(slot[lo:hi], mine[lo:hi])
        h.barrier()
        ops.copy(dst, mine)
    else:
        ring.allgather(h.node, dst, ops, node_bounds)


def _reduce_block(slots, out, lo: int, hi: int, ops, op: str, node: CommContext) -> None:
    """out = slots[0][lo:hi] op slots[1][lo:hi] op ... in local-rank order (the lower ranks' operand
    first, as everywhere in gflow). out is this rank's own slot's block: it is read (as one of the
    operands) before the last step writes it, so the steps before go through a scratch buffer."""
    k = len(slots)
    if k == 1:
        return
    tmp = node.scratch("node_acc", hi - lo, out.dtype, ops) if k > 2 else None
    for q in range(1, k):
        low = slots[0][lo:hi] if q == 1 else tmp
        ops.reduce(out if q == k - 1 else tmp, low, slots[q][lo:hi], op)
