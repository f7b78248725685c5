"""Hierarchical allreduce: reduce-scatter inside each node, a ring per shard across nodes, allgather
inside each node (Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE, NCCL's split of the work by node).

The shards and who owns them are described in collectives/topology.py. A flat ring over p ranks pays
2(p-1) message latencies and as many Python steps; here a rank pays 2(k-1) inside its node and
2(m-1) across m nodes, and only 1/k of the data crosses the node's link from each rank.

The node phase has two forms:
- in peer memory (collectives/peer_memory.py: an MPI shared window for host buffers, CUDA IPC for
  device buffers handed to MPI as they are): each rank copies its input into its slot (all but its
  own block), then reduces its own block of shards reading every peer's slot once, in local-rank
  order (ops.reduce_many: one kernel over all k slots on a device), into its own slot; after the
  cross-node ring and a node barrier, each rank copies every block straight out of the slot of the
  rank that finished it (ops.gather: one kernel on a device). Two node barriers
  per call (the slots alternate between calls). When the input already lives in a gradient pool
  allocated in shared memory (shared_pool, LazyAllreduce.gradient_buffers), the ranks reduce
  straight from their peers' pools and the copy in is saved. Per rank that is about 5 passes over
  the message where a ring makes about 8 (its copies through MPI's shared-memory cells, and its
  reductions), and no Python step per segment;
- a ring on the node's communicator (no peer memory, or no room for it): the same reduce-scatter
  and allgather as collectives/ring.py, with chunk bounds at the shard blocks.

Every block is reduced by one rank, in one fixed order, then copied: all ranks get the same bits.
"""

from mpi4py import MPI

from ..runtime import shared_memory, timeline
from ..runtime.config import config
from ..runtime.context import CommContext
from . import peer_memory, ring
from .topology import Topology, discover, shard_block


def topology(ctx: CommContext) -> Topology:
    """ctx's topology, found on first use (collective: call it where every rank is at the same call)."""
    if ctx.topology is None:
        ctx.topology = discover(ctx.comm)
    return ctx.topology


class Hierarchy:
    """The communicators and the peer memory of one context's hierarchical allreduce (made
    collectively, once, on the first call that needs them)."""

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
        # (agreed memory, buffers' memory) -> (NodeSlots, or None: the node's ring; whether every rank
        # of the node stages its device buffers through the host)
        self._peers = {}

    def peers(self, agreed: str, memory: str, staged: bool) -> tuple:
        """(the node's slots in peer memory for buffers of `memory`, or None when the node phase takes
        the node's ring; whether every rank of the node stages), on a call whose ranks agreed on arrays
        of `agreed` memory, this rank staging or not. Made on first use, collectively over the node
        (the key is alike on its ranks: the agreed memory is, and each rank's transport for it is
        fixed; the buffers' memory is the arrays' own for every transport but a host one), with its
        ranks agreeing on the mapping and on whether they all stage."""
        key = (agreed, memory)
        if key not in self._peers:
            mapping, all_staged = None, staged
            if self.node.size > 1:
                mapping = peer_memory.node_mapping(self.node, memory, self.topology.shared_memory)
                all_staged = self.node.comm.allreduce(int(staged), op=MPI.MIN) == 1
            slots = peer_memory.NodeSlots(self.node, self.local, mapping) if mapping else None
            self._peers[key] = (slots, all_staged)
        return self._peers[key]

    def pool_views(self, src, memory: str):
        """(tag, views, pool): when src (of `memory`, "host" or "device") lies in a shared pool this
        node phase can read, each node rank's memory at the same place, and a tag naming the pool and
        the place, for the node ranks to check that they all pass theirs; (0, None, None) when not."""
        for pool in _pools:
            if pool.mapping.memory != memory:
                continue
            start = pool.place(src)
            if start is not None and MPI.Group.Compare(pool.group, self.node_group) == MPI.IDENT:
                return pool.tag(start), pool.views(src, start), pool
        return 0, None, None

    def free(self) -> None:
        if MPI.Is_finalized():
            return
        for slots, _ in self._peers.values():
            if slots is not None:
                slots.free()
        self._peers = {}
        self.node_group.Free()
        self.node.free()
        for cross in self.cross.values():
            cross.free()
        self.cross = {}


class SharedPool:
    """One rank's gradient pool in its node's peer memory (an MPI shared window for host pools, CUDA
    IPC for device ones: the mapping, collectives/peer_memory.py), and its peers' pools. Kept until
    the process ends (freeing is collective over the node, and arrays handed out may still point
    into it)."""

    def __init__(self, mapping, memory, local: int, group, ident: int):
        self.mapping, self.memory, self.local, self.group, self.ident = mapping, memory, local, group, ident
        self._own = mapping.address(memory[local])

    def place(self, src):
        """src's byte offset in this rank's pool; None if src is not (wholly, contiguously) in it."""
        at = self.mapping.address(src)
        if at is None:
            return None
        start = at[0] - self._own[0]
        return start if 0 <= start and start + at[1] <= self._own[1] else None

    def views(self, src, start: int):
        """Each node rank's pool memory at byte offset `start`, shaped as src (flat)."""
        nbytes = src.size * src.dtype.itemsize  # (a Numba device array has no .nbytes to trust)
        return [m[start : start + nbytes].view(src.dtype) for m in self.memory]

    def tag(self, start: int) -> int:
        """This pool and the offset, as one number the node ranks compare."""
        return (self.ident << 40) | (start + 1)


_pools: list = []
_next_pool = 1  # a pool's number is agreed by its node ranks: the largest of their next numbers
# MPICH holds about 2,000 windows per process; pools are kept until exit, so their number is bounded.
MAX_SHARED_POOLS = 64


def shared_pool(ctx: CommContext, nbytes: int, memory: str = "host"):
    """(pool, None): nbytes of zeroed memory of `memory` ("host" or "device") for this rank's
    gradient pool in its node's peer memory (a shared window; CUDA IPC), so that the node phase reads
    every rank's gradients where they were written (no copy in); or (None, why) when that cannot help
    (auto would not take the node phase: no shared memory, one rank per node, or, for host pools,
    two ranks on one node), the node cannot map it or lacks room for it, or this process already
    holds MAX_SHARED_POOLS pools of that memory. Collective over ctx; every rank of a node gets a pool
    or none."""
    global _next_pool
    h = hierarchy(ctx)
    topo = h.topology
    largest = max(len(n) for n in topo.nodes)
    alone = 1 if memory == "device" else 2  # (auto's node phase: settle_auto)
    useful = topo.shared_memory and (largest > 1 if len(topo.nodes) > 1 else ctx.size > alone)
    mapping, why = None, None
    if useful:
        if memory == "host":
            mapping = shared_memory.HostWindow()
        else:
            from ..cuda import ipc

            mapping, why = ipc.mapping(topo.shared_memory)
    size = shared_memory.pages(nbytes)
    room = h.node.comm.allreduce(mapping.room() if mapping else 0, op=MPI.MIN)
    held = sum(pool.mapping.memory == memory for pool in _pools)  # (each memory has its own bound)
    fits = mapping is not None and size * h.node.size <= room // 2 and held < MAX_SHARED_POOLS
    if not ctx.comm.allreduce(bool(fits), op=MPI.LAND):
        if not useful:
            return None, None
        if held >= MAX_SHARED_POOLS:
            return None, f"this process already holds {MAX_SHARED_POOLS} {memory} pools (kept until exit)"
        if not ctx.comm.allreduce(mapping is not None, op=MPI.LAND):
            return None, why or "another rank cannot map its node's peer memory"
        where = mapping.where
        return None, (
            f"a shared pool needs {size * h.node.size >> 20} MiB on this node, and {where} has "
            f"{room >> 20} MiB free (gflow takes at most half of it); give {where} more room"
        )
    ident = h.node.comm.allreduce(_next_pool, op=MPI.MAX)
    _next_pool = ident + 1
    try:
        memory_of = mapping.allocate(h.node.comm, size, h.local)
    except shared_memory.PeerMemoryUnavailable as failure:  # (raised on every rank of the node)
        return None, str(failure)
    _pools.append(SharedPool(mapping, memory_of, h.local, h.node.comm.Get_group(), ident))
    return memory_of[h.local][:nbytes], None


def hierarchy(ctx: CommContext) -> Hierarchy:
    if ctx.hierarchy is None:
        ctx.hierarchy = Hierarchy(ctx)
    return ctx.hierarchy


# Device arrays go in pieces this many times config.shared_memory_max_bytes (256 MiB by default): a
# piece's fixed cost (kernel launches, device syncs and two node barriers from Python, about 1.5 ms on
# an H200) must stay small against its bytes, which a GPU moves at terabytes per second. Measured: 16 MiB
# pieces held the node phase to 7% of the device's copy bandwidth (bench/RESULTS.md, issue 26).
DEVICE_PIECE_SCALE = 16


def allreduce(ctx: CommContext, src, dst, ops, op: str, agreed: str, staging=None) -> None:
    """Hierarchical allreduce of the flat `src` into the flat `dst` (may be src). op: sum, mean, max
    or min. agreed: the memory ("host" or "device") of the arrays the ranks agreed on (the buffers
    are in ops.memory). staging: device buffers that MPI cannot read (see dispatch.allreduce_flat):
    the node phase stays on the device when the node maps its peers' device memory, and only the
    shards that cross nodes go through the host; otherwise each piece is staged whole.

    A message above config.shared_memory_max_bytes goes in pieces of at most that size (device arrays:
    DEVICE_PIECE_SCALE times it), each a whole hierarchical allreduce, so that the peer memory stays
    bounded (the ranks agree on the setting: it is part of the call's signature)."""
    if dst.size == 0:  # (on every rank: they agreed on the size. Numba cannot slice an empty device array)
        hierarchy(ctx)  # (the topology is found as for any size)
        return
    piece = max(4096, config.shared_memory_max_bytes)
    if agreed == "device" and dst.size * dst.dtype.itemsize > piece:
        piece = _device_piece(ctx, piece, dst.size * dst.dtype.itemsize, ops, staging)
    step = piece // dst.dtype.itemsize  # (a Numba device array has no .itemsize)
    if dst.size <= step:
        _allreduce_piece(ctx, src, dst, ops, op, agreed, staging)
        return
    for lo in range(0, dst.size, step):
        _allreduce_piece(ctx, src[lo : lo + step], dst[lo : lo + step], ops, op, agreed, staging)


def _device_piece(ctx: CommContext, piece: int, nbytes: int, ops, staging) -> int:
    """The piece of a device message: up to DEVICE_PIECE_SCALE times the host's, halved while some
    node's peer memory lacks room for its slots (NodeSlots.slots' rule), so that a larger piece never
    costs a node phase that the host-sized one would have had. Alike on every rank of ctx."""
    h = hierarchy(ctx)
    peers, _ = h.peers("device", ops.memory, staging is not None)
    # (a node without device peer memory stages its pieces whole through the host: host-sized ones)
    room = ctx.comm.allreduce(peers.room() if peers is not None else 0, op=MPI.MIN)
    largest = max(len(n) for n in h.topology.nodes)
    size = min(piece * DEVICE_PIECE_SCALE, nbytes)
    while size > piece and 2 * shared_memory.pages(size) * largest > room // 2:
        size //= 2
    return max(size, piece)


def _allreduce_piece(ctx: CommContext, src, dst, ops, op: str, agreed: str, staging, with_peers=True) -> None:
    """One piece. with_peers False: the node phase takes the node's ring (see the staged case below)."""
    h = hierarchy(ctx)
    reduce_op = "sum" if op == "mean" else op
    bounds = ring.chunk_bounds(dst.size, h.shards)
    node_bounds = [bounds[s] for s in h.starts] + [dst.size]  # each local rank's block
    lo, hi = node_bounds[h.local], node_bounds[h.local + 1]
    peers, all_staged = h.peers(agreed, ops.memory, staging is not None) if with_peers else (None, False)
    slots = None if peers is None else peers.slots(dst.size, dst.dtype)  # None: no room for them
    if slots is None and staging is not None:  # (alike on the node's ranks: they agreed on peers)
        # MPI cannot read this rank's device buffers: the piece goes through the host, whole. Its node
        # phase then takes the host window if every rank of the node stages; the node's ring (as the
        # ranks handing MPI device memory take it) if any does not.
        host_dst = staging.buffer_for(ctx, "stage_out", dst)
        host_src = staging.send(ctx, src)
        _allreduce_piece(ctx, host_src, host_dst, staging.ops, op, agreed, None, with_peers=all_staged)
        staging.store(dst, host_dst)
        return
    with timeline.span("node phase", bytes=dst.nbytes, ranks=h.node.size) as phase:
        if slots is not None:
            mine = slots[h.local]
            tag, pools, pool = h.pool_views(src, ops.memory)
            own = src if _reads_in_place(src, ops) else None  # see _copy_in
            if pools is None:
                _copy_in(ops, mine, src, lo, hi, own is None)
            if not peers.barrier(tag, pool):  # some node rank's src is elsewhere: all copy in after all
                if pools is not None:
                    _copy_in(ops, mine, src, lo, hi, own is None)
                pools = pool = None
                peers.barrier()
            if pools is not None:  # every node rank's src is at the same place of its shared pool
                parts = [memory[lo:hi] for memory in pools]
            else:
                parts = [s[lo:hi] for s in slots]
                if own is not None:
                    parts[h.local] = own[lo:hi]
            ops.reduce_many(mine[lo:hi], parts, reduce_op)
            phase.note(peers=peers.mapping.where, pool=pools is not None)
        else:
            ring.reduce_scatter(h.node, src, dst, ops, reduce_op, node_bounds)
            mine = dst
    for s in range(h.first, h.last) if len(h.topology.nodes) > 1 else ():  # (one node: nothing to do)
        shard = mine[bounds[s] : bounds[s + 1]]
        with timeline.span("cross-node ring", bytes=shard.nbytes, shard=s):
            ops.fence()  # (device kernels that reduced the shard have finished before MPI reads it)
            _cross_ring(ctx, h.cross[s], shard, ops, reduce_op, agreed, staging)
    if op == "mean":
        ops.divide(mine[lo:hi], ctx.size)
        ops.fence()
    with timeline.span("node allgather", bytes=dst.nbytes):
        if slots is not None:
            peers.barrier(pool=pool)
            ops.gather(dst, slots, node_bounds)  # every block from the rank that finished it
        else:
            ring.allgather(h.node, dst, ops, node_bounds)


# The cross-node rings of device arrays go in segments of this size, so that a staged shard's copies to
# and from the host overlap its ring (Staged.through_host). Every rank of a cross-node group cuts alike
# (each segment is one ring), whether its node stages, maps its peers' memory or hands MPI device memory.
STAGING_SEGMENT_BYTES = 4 * 2**20


def _cross_ring(ctx: CommContext, cross: CommContext, shard, ops, op: str, agreed: str, staging) -> None:
    """The allreduce of one shard across nodes: one ring for host arrays; for device arrays a ring
    per segment, pipelined through pinned host memory where the shard is staged."""
    if agreed == "host":
        ring.allreduce(cross, shard, shard, ops, op)
        return
    segment = max(1, STAGING_SEGMENT_BYTES // shard.dtype.itemsize)
    if staging is not None:
        reduce = lambda host: ring.allreduce(cross, host, host, staging.ops, op)  # noqa: E731
        staging.through_host(ctx, shard, reduce, segment)
        return
    for lo in range(0, shard.size, segment):
        piece = shard[lo : lo + segment]
        ring.allreduce(cross, piece, piece, ops, op)


def _reads_in_place(src, ops) -> bool:
    """Whether this rank's own block may be reduced straight from src: not when src is a read-only
    host array (the fused host reduction takes operands of one type)."""
    return ops.memory == "device" or src.flags.writeable


def _copy_in(ops, mine, src, lo: int, hi: int, own_block_too: bool) -> None:
    """src into this rank's slot for the peers to read: every block but this rank's own, which it
    reads from src itself (unless own_block_too: see _reads_in_place)."""
    ops.copy(mine[:lo], src[:lo])
    ops.copy(mine[hi:], src[hi:])
    if own_block_too:
        ops.copy(mine[lo:hi], src[lo:hi])
