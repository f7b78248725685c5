"""The hierarchical allreduce and the topology, at world sizes 1 to 4, on nodes posed by
GFLOW_RANKS_PER_NODE (gflow.config.ranks_per_node, read when a communicator first needs its
topology): one node of all ranks (the shared-memory node phase alone), nodes of 1, 2 and 3 ranks (the
last node smaller where 3 does not divide p), against MPI's own Allreduce and float64 NumPy."""

import contextlib
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from helpers import (
    WORLD,
    assert_close_to_reference,
    assert_same_on_all_ranks,
    on_all_ranks,
    random_array,
    rank_rng,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import gflow
from gflow.collectives.dispatch import latency_path_bytes
from gflow.collectives.topology import parse_setting
from gflow.runtime.context import context

SIZES = [1, 2, 3, 4]
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
OPS = ["sum", "mean", "max", "min"]
SETTINGS = ["", "1", "2", "3"]


@contextlib.contextmanager
def posed_nodes(setting: str):
    """A fresh communicator whose topology is found under GFLOW_RANKS_PER_NODE=setting."""
    comm = WORLD.Dup()
    saved = gflow.config.ranks_per_node
    gflow.config.ranks_per_node = setting
    try:
        yield comm
    finally:
        gflow.config.ranks_per_node = saved
        comm.Free()


def expected_nodes(setting: str, p: int):
    k = parse_setting(setting) or p  # unset: this machine is one node
    return tuple(tuple(range(lo, min(lo + k, p))) for lo in range(0, p, k))


@pytest.mark.parallel(SIZES)
@given(
    n=st.one_of(st.integers(0, 12), st.integers(13, 5000), st.sampled_from([100_003, 300_001])),
    dtype=st.sampled_from(DTYPES),
    op=st.sampled_from(OPS),
    setting=st.sampled_from(SETTINGS),
    algorithm=st.sampled_from(["hierarchical", "auto"]),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=10)
def test_hierarchical_matches_mpi(n, dtype, op, setting, algorithm, seed):
    if op == "mean" and np.dtype(dtype).kind != "f":
        return
    x = random_array(rank_rng(seed), n, dtype)
    before = x.copy()
    with posed_nodes(setting) as comm:

        def check():
            y = gflow.allreduce(x, op, algorithm=algorithm, comm=comm)
            np.testing.assert_array_equal(x, before)  # the input is not modified
            assert y.shape == x.shape and y.dtype == x.dtype
            assert_close_to_reference(y, x, op)
            assert_same_on_all_ranks(y)
            out = np.full_like(x, 7)  # in place and into out= as well
            gflow.allreduce(x, op, algorithm=algorithm, comm=comm, out=out)
            np.testing.assert_array_equal(out, y)
            inplace = x.copy()
            gflow.allreduce(inplace, op, algorithm=algorithm, comm=comm, out=inplace)
            np.testing.assert_array_equal(inplace, y)
            if WORLD.size > 1 and algorithm == "hierarchical":  # one rank never needs its topology
                assert context(comm).topology.nodes == expected_nodes(setting, WORLD.size)

        on_all_ranks(check, f"n={n} {np.dtype(dtype)} {op} nodes={setting or 'MPI'}")


@pytest.mark.parallel([2, 3])
def test_read_only_and_strided_inputs():
    """The node phase reads its own block straight from the input: a read-only one (Numba types it
    apart from the window's memory) and a strided one (read through a copy) must work too."""
    for dtype in (np.float32, np.int64):
        x = random_array(rank_rng(6), 300_001, dtype)
        x.flags.writeable = False
        strided = random_array(rank_rng(7), (300_001, 2), dtype)[:, 1]
        for arr in (x, strided):
            on_all_ranks(lambda arr=arr: assert_close_to_reference(gflow.allreduce(arr), arr, "sum"))


@pytest.mark.parallel([2, 3, 4])
def test_pieces_ints_and_a_node_without_room(monkeypatch):
    """Messages above shared_memory_max_bytes go in pieces; an int setting works like the string
    (and agrees with it); a node whose /dev/shm lacks room takes a ring inside the node, warning."""
    from gflow.collectives import peer_memory
    from gflow.runtime import shared_memory

    x = random_array(rank_rng(8), 100_003, np.float64)
    monkeypatch.setattr(gflow.config, "shared_memory_max_bytes", 8192)
    for setting in ["", 2 if WORLD.rank % 2 else "2", "3"]:
        with posed_nodes(setting) as comm:
            on_all_ranks(lambda c=comm: assert_close_to_reference(gflow.allreduce(x, comm=c), x, "sum"))
            assert_same_on_all_ranks(gflow.allreduce(x, "max", algorithm="hierarchical", comm=comm))
    monkeypatch.setattr(shared_memory, "room", lambda: 1000)
    monkeypatch.setattr(peer_memory, "_warned", set())
    with posed_nodes("") as comm:
        with pytest.warns(RuntimeWarning, match="using a ring inside the node"):
            y = gflow.allreduce(x, algorithm="hierarchical", comm=comm)
        on_all_ranks(lambda: assert_close_to_reference(y, x, "sum"))
        assert context(comm).hierarchy.peers("host", "host", False)[0]._slots is None


def record_sizes(monkeypatch, module, name: str) -> list:
    """module.name wrapped to record the size of its third argument (a piece's dst, a copy's src) on
    each call: the list it appends to."""
    sizes, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: (sizes.append(a[2].size), real(*a, **kw))[1])
    return sizes


@pytest.mark.parallel([2, 3])
def test_device_arrays_go_in_larger_pieces_and_empty_ones_in_none(monkeypatch):
    """Device arrays go in pieces DEVICE_PIECE_SCALE times shared_memory_max_bytes (a piece's fixed
    cost is large against a GPU's bandwidth), host arrays in pieces of it; an empty array makes no
    piece (Numba cannot slice an empty device array: found on an H200) and still finds the topology."""
    from numba import cuda

    from gflow.collectives import hierarchical

    pieces = record_sizes(monkeypatch, hierarchical, "_allreduce_piece")
    monkeypatch.setattr(gflow.config, "shared_memory_max_bytes", 4096)
    n = 2 * hierarchical.DEVICE_PIECE_SCALE * 1024 + 5  # float32: two device pieces and a short one
    x = random_array(rank_rng(21), n, np.float32)
    with posed_nodes("") as comm:
        y = gflow.allreduce(cuda.to_device(x), algorithm="hierarchical", comm=comm).copy_to_host()
        assert pieces == [hierarchical.DEVICE_PIECE_SCALE * 1024] * 2 + [5], pieces
        on_all_ranks(lambda: assert_close_to_reference(y, x, "sum"))
        pieces.clear()
        gflow.allreduce(x, algorithm="hierarchical", comm=comm)
        assert len(pieces) == -(-n // 1024) and max(pieces) == 1024
        pieces.clear()
    with posed_nodes("") as comm:
        empty = gflow.allreduce(cuda.to_device(x[:0]), algorithm="hierarchical", comm=comm)
        assert empty.size == 0 and pieces == [] and context(comm).topology is not None


@pytest.mark.parallel([2, 3])
def test_device_pieces_shrink_to_the_room_of_the_peer_memory(monkeypatch):
    """Where peer memory lacks room for the largest device piece, the pieces halve until the slots
    fit (the node phase stays in peer memory, no ring, no warning), alike on every rank."""
    import warnings

    from numba import cuda

    from gflow.collectives import hierarchical
    from gflow.cuda import ipc

    pieces = record_sizes(monkeypatch, hierarchical, "_allreduce_piece")
    monkeypatch.setattr(gflow.config, "shared_memory_max_bytes", 4096)  # (device pieces up to 64 KiB)
    monkeypatch.setattr(ipc.SimulatedIpc, "room", lambda self: 4 * WORLD.size * 16384)  # for 16 KiB slots
    x = random_array(rank_rng(23), 16 * 1024 + 5, np.float32)  # 64 KiB and 20 bytes
    with posed_nodes("") as comm, warnings.catch_warnings():
        warnings.simplefilter("error")  # (no "using a ring inside the node")
        y = gflow.allreduce(cuda.to_device(x), algorithm="hierarchical", comm=comm).copy_to_host()
    assert pieces == [4096] * 4 + [5], pieces
    on_all_ranks(lambda: assert_close_to_reference(y, x, "sum"))


@pytest.mark.parallel(SIZES)
def test_shared_windows_start_where_copies_out_of_them_run_at_full_speed():
    """Every rank's part of a shared window (the node phase's slots, the gradient pools) starts
    PAGE_OFFSET bytes into a page, on every rank's mapping, whole and zeroed, and the parts do not
    overlap: memcpy from a page-aligned window into a NumPy array (16 bytes into its page) ran 5-9x
    slower (bench/RESULTS.md, "Copies out of shared memory")."""
    from gflow.runtime import shared_memory

    for nbytes in [1, 4096, 100_003]:
        window, memory = shared_memory.allocate(WORLD, nbytes, WORLD.rank)
        try:
            assert [m.ctypes.data % 4096 for m in memory] == [shared_memory.PAGE_OFFSET] * WORLD.size
            assert [m.nbytes for m in memory] == [nbytes] * WORLD.size
            assert not memory[WORLD.rank].any()
            memory[WORLD.rank][:] = WORLD.rank + 1
            WORLD.Barrier()
            window.Sync()
            assert (
                [int(m.min()) for m in memory]
                == [int(m.max()) for m in memory]
                == list(range(1, WORLD.size + 1))
            )
            WORLD.Barrier()
        finally:
            shared_memory.free(window)


@pytest.mark.parallel([2, 3])
def test_piece_size_disagreement_fails_every_rank(monkeypatch):
    x = random_array(rank_rng(9), 100_000, np.float32)
    if WORLD.rank == 0:
        monkeypatch.setattr(gflow.config, "shared_memory_max_bytes", 8192)
    with pytest.raises(gflow.MismatchError, match="settings checksum"):
        gflow.allreduce(x, algorithm="hierarchical")
    monkeypatch.undo()
    on_all_ranks(lambda: assert_close_to_reference(gflow.allreduce(x, algorithm="hierarchical"), x, "sum"))


@pytest.mark.parallel([2, 3, 4])
def test_auto_settles_by_topology_and_size():
    """auto: the shared-memory node phase on one node of 3 ranks or more from shared_memory_min_bytes;
    across nodes the hierarchical allreduce from hierarchical_min_bytes; the ring below, on one node
    of 2 ranks, or where every node holds one rank. Watched through the hierarchy it builds (made only
    when that algorithm runs)."""
    above = max(gflow.config.shared_memory_min_bytes, latency_path_bytes(WORLD.size))  # (p = 2: 2 MiB)
    big = random_array(rank_rng(1), above // 4 + 1, np.float32)
    p = WORLD.size
    for setting, hierarchical in [("", p > 2), ("2", p > 2), ("1", False)]:
        with posed_nodes(setting) as comm:
            gflow.allreduce(big[:1000], comm=comm)  # the latency path: no topology needed
            assert context(comm).topology is None
            gflow.allreduce(big, comm=comm)
            ctx = context(comm)
            assert ctx.topology is not None
            assert (ctx.hierarchy is not None) == hierarchical, setting


@pytest.mark.parallel(SIZES)
def test_fp16_async_lazy_and_sparse_ride_on_the_hierarchy():
    """fp16 compression, allreduce_async, LazyAllreduce's segments and CSC's packed chunks, with
    nodes of 2 (p = 3: nodes of 2 + 1), against their float64 references."""
    p = WORLD.size
    rng = rank_rng(5)
    with posed_nodes("2") as comm:

        def check():
            x = random_array(rng, 200_001, np.float32)
            y = gflow.allreduce(x, compression="fp16", algorithm="hierarchical", comm=comm)
            exact = np.sum(WORLD.allgather(x.astype(np.float64)), axis=0)
            np.testing.assert_allclose(y, exact, rtol=4e-3, atol=4e-3 * 4 * p)
            assert_same_on_all_ranks(y)

            h = gflow.allreduce_async(x, "max", algorithm="hierarchical", comm=comm)
            np.testing.assert_array_equal(h.wait(), np.max(WORLD.allgather(x), axis=0))

            grads = [random_array(rng, n, np.float32) for n in (70_000, 3, 150_000, 999)]
            expected = [np.mean(WORLD.allgather(g.astype(np.float64)), axis=0) for g in grads]
            lazy = gflow.LazyAllreduce(threshold_bytes=2**18, op="mean", comm=comm)
            for g in grads:
                lazy.push(g)
            lazy.flush()
            for g, e in zip(grads, expected, strict=True):
                np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)
                assert_same_on_all_ranks(g)
            assert context(comm).background().hierarchy is not None or p == 1

            grad = random_array(rng, 400_000, np.float32)
            dense = np.sum(WORLD.allgather(grad.astype(np.float64)), axis=0)
            csc = gflow.SparseAllreduce(density=0.25, chunk_elems=1000, op="sum", comm=comm)
            update = csc(grad)
            assert_same_on_all_ranks(update)
            sent = update != 0
            np.testing.assert_allclose(update[sent], dense[sent], rtol=1e-5, atol=1e-4)
            # Nothing lost: what was sent plus every rank's residual is the whole sum.
            residuals = np.sum(WORLD.allgather(csc.residual.astype(np.float64)), axis=0)
            np.testing.assert_allclose(update + residuals, dense, rtol=1e-5, atol=1e-4)

        on_all_ranks(check)


def peers_used(comm):
    """Which peer memory the node phase of comm's last hierarchical call could use, per key."""
    h = context(comm).hierarchy
    return {key: slots and type(slots.mapping).__name__ for key, (slots, _) in h._peers.items()}


def assert_peers(comm, key, expected):
    used = peers_used(comm) if context(comm).hierarchy else {}
    assert used.get(key) == expected, used


def to_device(x):
    """x on the device: a Numba array; bfloat16 on a GPU as a CUDA tensor (Numba has no bfloat16:
    under the simulator its arrays can hold one, on a GPU only torch's can)."""
    from numba import cuda

    from gflow.cuda import memory

    if x.dtype == BF16 and not memory.SIMULATED:
        import torch

        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16).cuda()
    return cuda.to_device(x)


def to_host(y) -> np.ndarray:
    if hasattr(y, "copy_to_host"):
        return y.copy_to_host()
    import torch

    return y.view(torch.int16).cpu().numpy().view(BF16)


@pytest.mark.parallel(SIZES)
def test_device_arrays_take_the_peer_memory_node_phase(transport_mode):
    """Device arrays (Numba's simulator here), handed to MPI directly or staged, on one node and on
    nodes of 2: the node phase works in the node's device memory (CUDA IPC on a GPU; its simulator
    twin, a host window seen as device arrays, here), with the device kernels, and only the cross-node
    shards are staged. The result has the bits of the host arrays' hierarchical allreduce (the same
    reductions in the same order)."""

    from gflow.cuda import memory

    for setting in ["", "2"]:  # (nodes of one rank each: the pipelined test below)
        with posed_nodes(setting) as comm:
            for n, dtype, op in [(37, np.float32, "sum"), (300, np.float64, "mean"), (65, np.int32, "max"),
                                 (64, np.float16, "min"), (33, BF16, "sum"),
                                 (0, np.float32, "sum")]:  # fmt: skip
                x = random_array(rank_rng(n), n, np.float32 if dtype == BF16 else dtype).astype(dtype)
                y = to_host(gflow.allreduce(to_device(x), op, algorithm="hierarchical", comm=comm))
                out = to_device(np.full_like(x, 7))
                gflow.allreduce(to_device(x), op, algorithm="hierarchical", comm=comm, out=out)
                host = gflow.allreduce(x, op, algorithm="hierarchical", comm=comm)

                def check(x=x, y=y, out=out, host=host, op=op):
                    if x.dtype != BF16:  # (bfloat16's bound is test_bfloat16.py's; here, the host's bits)
                        assert_close_to_reference(y, x, op)
                    np.testing.assert_array_equal(y.view(np.uint8), host.view(np.uint8))
                    np.testing.assert_array_equal(to_host(out), y)

                on_all_ranks(check, f"n={n} {np.dtype(dtype)} {op} setting={setting!r}")
                assert_same_on_all_ranks(y)
            h = context(comm).hierarchy  # (none at one rank: nothing to reduce)
            alone = h is None or h.node.size == 1
            expected = None if alone else "SimulatedIpc" if memory.SIMULATED else "CudaIpc"
            on_all_ranks(lambda c=comm, e=expected: assert_peers(c, ("device", "device"), e))


@pytest.mark.parallel([2, 3, 4])
def test_staged_cross_node_rings_go_in_pipelined_segments(monkeypatch):
    """Staged device arrays across two or more posed nodes, with the cross-node ring cut into segments
    of 16 bytes (several per shard, the last one short): right, and the same bits on every rank."""
    from numba import cuda

    from gflow.collectives import hierarchical
    from gflow.cuda import transport

    monkeypatch.setattr(transport, "_decided", False)
    monkeypatch.setattr(transport, "_warned", True)
    monkeypatch.setattr(hierarchical, "STAGING_SEGMENT_BYTES", 16)
    for setting in ["1", "2"]:
        with posed_nodes(setting) as comm:
            for n, dtype, op in [(301, np.float32, "sum"), (97, np.float64, "mean"), (50, np.int32, "min")]:
                x = random_array(rank_rng(n), n, dtype)
                y = gflow.allreduce(cuda.to_device(x), op, algorithm="hierarchical", comm=comm).copy_to_host()
                on_all_ranks(lambda x=x, y=y, op=op: assert_close_to_reference(y, x, op))
                assert_same_on_all_ranks(y)  # (each segment's ring has its own order: not the host's bits)


@pytest.mark.parallel([2, 3, 4])
@pytest.mark.parametrize("why", ["no ipc", "no room", "ipc"])
def test_ranks_of_one_node_that_stage_and_ranks_that_do_not_agree(monkeypatch, why):
    """Rank 0 hands device buffers to MPI directly, the others stage them, on one node and on posed
    nodes of 2: with peer memory, without it (IPC off everywhere), and without room for it on one
    rank. Each piece's node phase must be the same on every rank of the node (the staged ranks must
    not take the host window while the direct one takes the ring): right results, nothing hangs."""
    from numba import cuda

    from gflow.collectives import peer_memory
    from gflow.cuda import transport
    from gflow.runtime import shared_memory

    monkeypatch.setattr(transport, "_decided", WORLD.rank == 0)
    monkeypatch.setattr(transport, "_warned", True)
    monkeypatch.setattr(peer_memory, "_warned", {"device", "room"})
    monkeypatch.setattr(gflow.config, "shared_memory_max_bytes", 4096)  # (two pieces)
    if why == "no ipc":
        monkeypatch.setenv("GFLOW_CUDA_IPC", "0")
    if why == "no room" and WORLD.rank == WORLD.size - 1:
        monkeypatch.setattr(shared_memory, "room", lambda: 1000)
    x = random_array(rank_rng(17), 1500, np.float32)
    for setting in ["", "2"]:
        with posed_nodes(setting) as comm:
            y = gflow.allreduce(cuda.to_device(x), algorithm="hierarchical", comm=comm).copy_to_host()
            on_all_ranks(lambda y=y: assert_close_to_reference(y, x, "sum"))
            assert_same_on_all_ranks(y)


@pytest.mark.parallel([2, 3])
def test_peer_memory_that_cannot_be_allocated_is_not_tried_again(monkeypatch):
    """An allocation that fails on the node's ranks (a peer's GPU not peer-accessible) is not retried
    for every piece of every call: once per size, then the ring."""
    from numba import cuda

    from gflow.collectives import peer_memory
    from gflow.cuda import ipc, transport
    from gflow.runtime.shared_memory import PeerMemoryUnavailable

    attempts = []

    def failing(self, node_comm, nbytes, local):
        attempts.append(nbytes)
        node_comm.Barrier()  # (collective, as CudaIpc.allocate is, and failing alike on every rank)
        raise PeerMemoryUnavailable("node rank 1's GPU is not peer-accessible from here")

    monkeypatch.setattr(transport, "_decided", True)
    monkeypatch.setattr(ipc.SimulatedIpc, "allocate", failing)
    monkeypatch.setattr(peer_memory, "_warned", set())
    monkeypatch.setattr(gflow.config, "shared_memory_max_bytes", 4096)
    x = random_array(rank_rng(19), 1500, np.float32)
    with posed_nodes("") as comm:
        with pytest.warns(RuntimeWarning, match="not peer-accessible"):
            for _ in range(3):
                y = gflow.allreduce(cuda.to_device(x), algorithm="hierarchical", comm=comm).copy_to_host()
        on_all_ranks(lambda: assert_close_to_reference(y, x, "sum"))
    assert len(attempts) == 1, attempts


@pytest.mark.parallel([2, 3, 4])
def test_device_node_phase_without_ipc_takes_the_ring_and_says_why(monkeypatch, transport_mode):
    """GFLOW_CUDA_IPC=0 (a container that forbids IPC) on every rank, then on one rank only: every rank
    of the node says once why, and takes the ring inside the node (direct), or stages the message
    whole and reduces it in the host window (staged); the result is still right."""
    from numba import cuda

    from gflow.collectives import peer_memory

    x = random_array(rank_rng(5), 301, np.float32)
    everyone, last = range(WORLD.size), [WORLD.size - 1]
    for who, why in [(everyone, "GFLOW_CUDA_IPC=0"), (last, "another rank|GFLOW_CUDA_IPC=0")]:
        monkeypatch.setattr(peer_memory, "_warned", set())
        if WORLD.rank in who:
            monkeypatch.setenv("GFLOW_CUDA_IPC", "0")
        else:
            monkeypatch.delenv("GFLOW_CUDA_IPC", raising=False)
        with posed_nodes("") as comm:
            with pytest.warns(RuntimeWarning, match=f"ring inside the node: ({why})"):
                y = gflow.allreduce(cuda.to_device(x), algorithm="hierarchical", comm=comm).copy_to_host()
            on_all_ranks(lambda y=y: assert_close_to_reference(y, x, "sum"))
            assert_same_on_all_ranks(y)
            on_all_ranks(lambda c=comm: assert_peers(c, ("device", "device"), None))
            staged_in_window = "HostWindow" if transport_mode == "staged" else None
            on_all_ranks(lambda c=comm, e=staged_in_window: assert_peers(c, ("device", "host"), e))


@pytest.mark.parallel([2, 3, 4])
def test_ranks_that_disagree_about_the_topology_fail_together():
    for mine, theirs in [("2", ""), ("1", "2")]:
        setting = theirs if WORLD.rank == WORLD.size - 1 else mine
        with posed_nodes(setting) as comm:
            x = random_array(rank_rng(2), 100_000, np.float32)
            with pytest.raises(gflow.MismatchError) as info:
                gflow.allreduce(x, algorithm="hierarchical", comm=comm)
            message = str(info.value)
            assert f"GFLOW_RANKS_PER_NODE={mine!r}" in message or "GFLOW_RANKS_PER_NODE unset" in message
            assert "disagree about the topology" in message and f"rank {WORLD.size - 1}" in message


@pytest.mark.parallel([2, 3])  # one rank never reads it (nothing to split); `gflow info` shows it
def test_a_malformed_setting_fails_every_rank_and_names_it():
    for bad in ["0", "-2", "two"]:
        with posed_nodes(bad) as comm:
            with pytest.raises(ValueError, match=f"GFLOW_RANKS_PER_NODE must be a positive integer.*{bad!r}"):
                gflow.allreduce(np.ones(100_000, np.float32), algorithm="hierarchical", comm=comm)
            gflow.allreduce(np.ones(10, np.float32), comm=comm)  # the latency path does not need it


@pytest.mark.parallel([2, 3])
def test_algorithm_and_threshold_disagreements_fail_every_rank():
    x = random_array(rank_rng(4), latency_path_bytes(WORLD.size) // 4 + 100_000, np.float32)  # auto: not RD
    last = WORLD.rank == WORLD.size - 1
    with pytest.raises(gflow.MismatchError, match="algorithm=hierarchical"):
        gflow.allreduce(x, algorithm="ring" if last else "hierarchical")
    saved = gflow.config.hierarchical_min_bytes
    gflow.config.hierarchical_min_bytes = saved + (1 if last else 0)
    try:
        with pytest.raises(gflow.MismatchError, match="settings checksum"):
            gflow.allreduce(x)
    finally:
        gflow.config.hierarchical_min_bytes = saved
    np.testing.assert_allclose(gflow.allreduce(x), np.sum(WORLD.allgather(x), axis=0), rtol=1e-5, atol=1e-4)


def test_gflow_info_prints_the_topology():
    env = dict(os.environ, GFLOW_RANKS_PER_NODE="1")
    out = subprocess.run(
        [sys.executable, "-m", "gflow", "info"], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert "topology: 1 node(s) of 1 ranks each (from GFLOW_RANKS_PER_NODE=1)" in out


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("reduce_in_place", [False, True])
def test_lazy_gradient_pool_lives_in_shared_memory(monkeypatch, reduce_in_place):
    """gradient_buffers() carves the pool out of each node's shared window, and a segment pushed from
    it is reduced straight from every rank's pool: no copy into the node phase's window."""
    from gflow.collectives import hierarchical

    monkeypatch.setattr(gflow.config, "shared_memory_min_bytes", 256 * 1024)  # (the segments take it)
    copies = record_sizes(monkeypatch, hierarchical, "_copy_in")
    shapes = [(300, 300), (7,), (200, 500), (1000,)]  # two segments above shared_memory_min_bytes
    rng = rank_rng(11)
    for setting in ["", "2", "3"]:
        with posed_nodes(setting) as comm:
            lazy = gflow.LazyAllreduce(threshold_bytes=300_000, op="sum", comm=comm)
            grads = lazy.gradient_buffers(shapes, reduce_in_place=reduce_in_place)
            nodes = expected_nodes(setting, WORLD.size)
            # Where auto would take the node phase: nodes of 2+ ranks, or one node of 3+.
            shared = max(len(n) for n in nodes) > 1 if len(nodes) > 1 else WORLD.size > 2
            in_pool = [any(p.place(g) is not None for p in hierarchical._pools) for g in grads]
            assert in_pool == [shared] * len(grads), (setting, in_pool)
            assert all(not g.any() for g in grads)  # zeroed
            for step in range(2):
                values = [random_array(rng, s, np.float32) for s in shapes]
                for g, v in zip(grads, values, strict=True):
                    g[...] = v
                copies.clear()

                def run(lazy=lazy, grads=grads):
                    for g in grads:
                        lazy.push(g)
                    lazy.flush()

                on_all_ranks(run, f"nodes={setting or 'MPI'} step {step}")
                for g, v in zip(grads, values, strict=True):
                    on_all_ranks(lambda g=g, v=v: assert_close_to_reference(g, v, "sum"))
                    assert_same_on_all_ranks(g)
                assert copies == [], copies  # every node phase read the pools where they are


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("reduce_in_place", [False, True])
def test_a_device_gradient_pool_lives_in_the_nodes_peer_memory(monkeypatch, reduce_in_place):
    """gradient_buffers(memory="device") carves device arrays out of each node's peer memory (CUDA
    IPC; its simulator twin, a host window seen as device arrays, here) from two ranks of a node, and
    a segment pushed from it is reduced straight from every rank's pool: no copy into the slots."""
    from gflow.collectives import hierarchical

    # Small, for the simulator: every segment takes the node phase (no latency path, a low threshold).
    monkeypatch.setattr(gflow.config, "small_message_bytes", 0)
    monkeypatch.setattr(gflow.config, "shared_memory_min_bytes", 1024)
    copies = record_sizes(monkeypatch, hierarchical, "_copy_in")
    shapes = [(40, 30), (7,), (0, 5), (20, 50), (300,)]  # three segments, an empty gradient
    rng = rank_rng(17)
    for setting in ["", "2"]:
        with posed_nodes(setting) as comm:
            lazy = gflow.LazyAllreduce(threshold_bytes=4000, op="sum", comm=comm)
            grads = lazy.gradient_buffers(shapes, reduce_in_place=reduce_in_place, memory="device")
            assert all(not isinstance(g, np.ndarray) and hasattr(g, "copy_to_host") for g in grads)
            shared = max(len(n) for n in expected_nodes(setting, WORLD.size)) > 1
            in_pool = [any(p.place(g) is not None for p in hierarchical._pools) for g in grads if g.size]
            assert in_pool == [shared] * len(in_pool), (setting, in_pool)
            assert all(not g.copy_to_host().any() for g in grads)  # zeroed
            for step in range(2):
                values = [random_array(rng, s, np.float32) for s in shapes]
                for g, v in zip(grads, values, strict=True):
                    g.copy_to_device(v)
                copies.clear()

                def run(lazy=lazy, grads=grads):
                    for g in grads:
                        lazy.push(g)
                    lazy.flush()

                on_all_ranks(run, f"nodes={setting or 'MPI'} step {step}")
                for g, v in zip(grads, values, strict=True):
                    on_all_ranks(lambda g=g, v=v: assert_close_to_reference(g.copy_to_host(), v, "sum"))
                    assert_same_on_all_ranks(g.copy_to_host())
                assert copies == [], copies  # every node phase read the pools where they are


@pytest.mark.parallel([2, 3])
def test_a_device_pool_without_ipc_is_private_and_says_why(monkeypatch):
    """Where CUDA IPC is off, a device pool is this rank's private device memory, with a warning
    naming the reason; the node phase copies it in, and the results are right. A bfloat16 device
    pool, or another memory, is refused on the rank that asks and fails the others."""
    from gflow.collectives import hierarchical

    monkeypatch.setattr(gflow.config, "small_message_bytes", 0)  # (the node phase, small, for the simulator)
    monkeypatch.setattr(gflow.config, "shared_memory_min_bytes", 1024)
    lazy = gflow.LazyAllreduce(threshold_bytes=2**20, op="sum")
    monkeypatch.setenv("GFLOW_CUDA_IPC", "0")
    with pytest.warns(RuntimeWarning, match="private memory.*GFLOW_CUDA_IPC=0"):
        (grad,) = lazy.gradient_buffers([(3000,)], memory="device")
    assert not any(p.place(grad) is not None for p in hierarchical._pools)
    monkeypatch.delenv("GFLOW_CUDA_IPC")
    values = random_array(rank_rng(18), grad.shape, np.float32)
    grad.copy_to_device(values)
    lazy.push(grad)
    lazy.flush()
    on_all_ranks(lambda: assert_close_to_reference(grad.copy_to_host(), values, "sum"))
    last = WORLD.rank == WORLD.size - 1
    for bad in [dict(dtype=BF16, memory="device"), dict(memory="disk")]:
        if last:
            with pytest.raises(ValueError, match="bfloat16|memory"):
                lazy.gradient_buffers([(10,)], **bad)
        else:
            with pytest.raises(gflow.MismatchError):
                lazy.gradient_buffers([(10,)], memory="device")


@pytest.mark.parallel([2, 3, 4])
def test_a_rank_whose_input_is_not_in_its_pool_gets_the_copy_path():
    """Ranks of a node that pass pool memory and ranks that pass an ordinary array (or another place
    of the pool) find out in the node phase's first barrier and all copy in: right results either way."""
    lazy = gflow.LazyAllreduce(threshold_bytes=2**20, op="sum")
    (grad, other) = lazy.gradient_buffers([(300_000,), (300_000,)])
    rng = rank_rng(12)
    for outsider in range(WORLD.size):
        grad[...] = random_array(rng, grad.shape, np.float32)
        other[...] = grad
        mine = grad if WORLD.rank != outsider else (grad.copy() if outsider % 2 else other)
        y = gflow.allreduce(mine, algorithm="hierarchical")
        on_all_ranks(lambda y=y: assert_close_to_reference(y, grad, "sum"))
        assert_same_on_all_ranks(y)
        gflow.allreduce(mine, out=mine, algorithm="hierarchical")  # in place, into the pool
        on_all_ranks(lambda mine=mine, y=y: np.testing.assert_array_equal(mine, y))


@pytest.mark.parallel([2, 3, 4])
def test_gradient_buffers_during_a_step_abandons_it_on_that_rank():
    """A rank that calls gradient_buffers() with a step in flight abandons its step (RuntimeError,
    its pushed array keeps its values); the others' call fails with MismatchError. Their call met that
    rank's step, so the communicator takes no more collectives (which steps would pair next is
    unknown): the next step fails on every rank, and one on a new communicator works."""
    comm = WORLD.Dup()
    lazy = gflow.LazyAllreduce(threshold_bytes=2**16, op="sum", comm=comm)
    grads = lazy.gradient_buffers([(100_000,), (10,)])
    values = [random_array(rank_rng(14), g.shape, np.float32) for g in grads]
    for g, v in zip(grads, values, strict=True):
        g[...] = v
    if WORLD.rank == 0:
        lazy.push(grads[0])  # above the threshold: its segment is fired
        with pytest.raises(RuntimeError, match="a step was in flight"):
            lazy.gradient_buffers([(5,)])
        np.testing.assert_array_equal(grads[0], values[0])
    else:
        with pytest.raises(gflow.MismatchError):
            lazy.gradient_buffers([(5,)])
    with pytest.raises(gflow.GflowError, match="a step met another kind of call"):
        for g in grads:
            lazy.push(g)
        lazy.flush()
    for g, v in zip(grads, values, strict=True):
        np.testing.assert_array_equal(g, v)
    lazy = gflow.LazyAllreduce(threshold_bytes=2**16, op="sum", comm=WORLD.Dup())
    for g in grads:
        lazy.push(g)
    lazy.flush()
    for g, v in zip(grads, values, strict=True):
        on_all_ranks(lambda g=g, v=v: assert_close_to_reference(g, v, "sum"))


@pytest.mark.parallel([3])
def test_gradient_buffers_is_collective_and_checks_every_rank(monkeypatch):
    """A rank whose arguments fail its checks raises its error and the others MismatchError; ranks
    asking for different pools fail together; a node without room for the pool warns and keeps it in
    private memory; after all that, the next call works."""
    from gflow.collectives import hierarchical
    from gflow.runtime import shared_memory

    last = WORLD.rank == WORLD.size - 1
    lazy = gflow.LazyAllreduce(op="sum")
    if last:
        with pytest.raises((TypeError, ValueError)):
            lazy.gradient_buffers([(10,)], dtype=np.complex64)
    else:
        with pytest.raises(gflow.MismatchError, match="rejected"):
            lazy.gradient_buffers([(10,)])
    with pytest.raises(gflow.MismatchError, match="gradient_buffers"):
        lazy.gradient_buffers([(10,), (5 if last else 6,)])
    with pytest.raises(ValueError, match="more than this machine's memory"):
        lazy.gradient_buffers([(2**32, 2**32)])  # (its element count wraps to 0 in int64)
    monkeypatch.setattr(shared_memory, "room", lambda: 1000)
    # (not the cap on pools instead: the tests before it in a batch may hold 64 already)
    monkeypatch.setattr(hierarchical, "MAX_SHARED_POOLS", len(hierarchical._pools) + 8)
    with pytest.warns(RuntimeWarning, match="private memory.*has 0 MiB free"):
        (grad,) = lazy.gradient_buffers([(100_000,)])
    assert not any(p.place(grad) is not None for p in hierarchical._pools)
    monkeypatch.undo()
    host_pools = sum(p.mapping.memory == "host" for p in hierarchical._pools)  # (device: their own)
    monkeypatch.setattr(hierarchical, "MAX_SHARED_POOLS", host_pools)
    with pytest.warns(RuntimeWarning, match="already holds"):
        (grad,) = lazy.gradient_buffers([(100_000,)])
    assert not any(p.place(grad) is not None for p in hierarchical._pools)
    monkeypatch.setattr(hierarchical, "MAX_SHARED_POOLS", host_pools + 8)  # (room for one more)
    (grad,) = lazy.gradient_buffers([(100_000,)])
    assert any(p.place(grad) is not None for p in hierarchical._pools)
    values = random_array(rank_rng(13), grad.shape, np.float32)
    grad[...] = values
    lazy.push(grad)
    lazy.flush()
    on_all_ranks(lambda: assert_close_to_reference(grad, values, "sum"))
