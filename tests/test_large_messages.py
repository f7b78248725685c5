"""Messages over ring.MAX_MESSAGE_BYTES go in pieces, at world sizes 1 to 4.

The real limit (2**30 bytes) is too big to test here, so it is monkeypatched to a few dozen bytes, once
to a value that is not a multiple of the itemsize. Results are checked against MPI's own collectives;
a wrapper around gflow's communicator records every message of the ring allgather and of broadcast,
so the tests also see that no message is over the limit and that every byte went.
"""

import numpy as np
import pytest
from helpers import (
    MPI_OP,
    WORLD,
    assert_close_to_reference,
    mpi_bcast,
    on_all_ranks,
    random_array,
    rank_rng,
    reference_mpi,
)
from numba import cuda

import gflow
from gflow.collectives import ring
from gflow.cuda import memory
from gflow.runtime.context import TAG_RING_AG, CommContext

SIZES = [1, 2, 3, 4]
LIMITS = [64, 102]  # 102: not a multiple of 4 or 8 bytes
DTYPES = [np.float32, np.float64, np.int32]
POISON = -7


class _Recording:
    """gflow's communicator, recording (call, tag, bytes) for each point-to-point message and Bcast."""

    def __init__(self, comm, log):
        self._comm, self._log = comm, log

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def Isend(self, spec, dest, tag):  # noqa: N802 - mpi4py's names
        self._log.append(("send", tag, spec[0].nbytes))
        return self._comm.Isend(spec, dest, tag)

    def Irecv(self, spec, source, tag):  # noqa: N802
        self._log.append(("recv", tag, spec[0].nbytes))
        return self._comm.Irecv(spec, source, tag)

    def Ibcast(self, spec, root):  # noqa: N802
        self._log.append(("bcast", None, spec[0].nbytes))
        return self._comm.Ibcast(spec, root)


@pytest.fixture
def messages(monkeypatch):
    """The list every message on gflow's communicators is recorded in (clear it before a call).
    mpi4py's calls are what is recorded, so the ring runs its Python loop (config.native off); the
    compiled loops send the same messages (tests/test_native.py compares them with these)."""
    monkeypatch.setattr(gflow.config, "native", False)
    log = []
    real = CommContext.__dict__["comm"]
    monkeypatch.setattr(CommContext, "comm", property(lambda self: _Recording(real.fget(self), log)))
    return log


def ring_allgather_messages(log):
    sent = [nbytes for call, tag, nbytes in log if call == "send" and tag == TAG_RING_AG]
    received = [nbytes for call, tag, nbytes in log if call == "recv" and tag == TAG_RING_AG]
    return sent, received


def check_ring_allgather_pieces(log, chunk_bytes, limit):
    """Every allgather message is within the limit; this rank sent every chunk but its right
    neighbour's and received every chunk but its own, in full."""
    sent, received = ring_allgather_messages(log)
    p, r = WORLD.size, WORLD.rank
    assert max(sent + received, default=0) <= limit, f"a message over {limit} bytes: {max(sent + received)}"
    if p > 1:
        assert sum(sent) == sum(chunk_bytes) - chunk_bytes[(r + 1) % p]
        assert sum(received) == sum(chunk_bytes) - chunk_bytes[r]
    else:
        assert not log


@pytest.mark.parallel(SIZES)
def test_ring_allreduce_in_pieces_matches_mpi(monkeypatch, messages):
    for limit in LIMITS:
        monkeypatch.setattr(ring, "MAX_MESSAGE_BYTES", limit)
        for n in (1, 7, 1001, 10_007):
            for dtype in DTYPES:
                for op in ("sum", "max"):
                    x = random_array(rank_rng(n), n, dtype)

                    def check(x=x, op=op, limit=limit):
                        out = np.full(x.shape, POISON, dtype=x.dtype)
                        messages.clear()
                        y = gflow.allreduce(x, op, out=out, algorithm="ring")
                        assert y is out
                        assert_close_to_reference(y, x, op)
                        chunks = [c.nbytes for c in np.array_split(x, WORLD.size)]
                        check_ring_allgather_pieces(messages, chunks, limit)

                    on_all_ranks(check, f"limit={limit} n={n} {dtype.__name__} {op}")


def rows_of(rank: int, pattern) -> int:
    return pattern[rank % len(pattern)]


@pytest.mark.parallel(SIZES)
def test_allgather_in_pieces_matches_mpi(monkeypatch, messages):
    for limit in LIMITS:
        monkeypatch.setattr(ring, "MAX_MESSAGE_BYTES", limit)
        for pattern in ([0, 250, 3, 1001], [1001, 0, 17, 0], [5, 6, 0, 7]):
            for tail in ((), (3,)):
                for dtype in DTYPES:
                    mine = random_array(rank_rng(len(tail)), (rows_of(WORLD.rank, pattern),) + tail, dtype)

                    def check(mine=mine, limit=limit):
                        before = mine.copy()
                        messages.clear()
                        y = gflow.allgather(mine)
                        np.testing.assert_array_equal(mine, before)
                        everyone = WORLD.allgather(mine)
                        expected = np.concatenate(everyone, axis=0)
                        assert y.shape == expected.shape and y.dtype == expected.dtype
                        np.testing.assert_array_equal(y, expected)
                        check_ring_allgather_pieces(messages, [a.nbytes for a in everyone], limit)

                    on_all_ranks(check, f"limit={limit} rows={pattern} tail={tail} {dtype.__name__}")


@pytest.mark.parallel(SIZES)
def test_reduce_scatter_with_a_tiny_limit_matches_mpi(monkeypatch):
    for limit in LIMITS:
        monkeypatch.setattr(ring, "MAX_MESSAGE_BYTES", limit)
        for n in (1, 7, 1001, 10_007):
            for dtype in DTYPES:
                for op in ("sum", "max"):
                    x = random_array(rank_rng(n), n, dtype)

                    def check(x=x, op=op):
                        shard = gflow.reduce_scatter(x, op)
                        full = reference_mpi(x, op)  # (op is never "mean" here)
                        expected = np.array_split(full, WORLD.size)[WORLD.rank]
                        assert shard.dtype == x.dtype and shard.shape == expected.shape
                        if x.dtype.kind == "f" and op == "sum":
                            # Both sums round p - 1 times, each within eps * the sum of magnitudes.
                            magnitude = np.empty(x.size)
                            WORLD.Allreduce(np.abs(x.astype(np.float64)), magnitude, MPI_OP["sum"])
                            eps = float(np.finfo(x.dtype).eps)
                            tol = 4 * WORLD.size * eps * np.array_split(magnitude, WORLD.size)[WORLD.rank]
                            err = np.abs(shard.astype(np.float64) - expected)
                            assert np.all(err <= tol), f"off by {err.max()} (tolerance {tol.max()})"
                        else:
                            np.testing.assert_array_equal(shard, expected)

                    on_all_ranks(check, f"limit={limit} n={n} {dtype.__name__} {op}")


def check_bcast_pieces(log, nbytes, itemsize, limit):
    bcasts = [b for call, _, b in log if call == "bcast"]
    if WORLD.size == 1:
        assert not bcasts
        return
    assert sum(bcasts) == nbytes
    assert max(bcasts, default=0) <= limit
    per_piece = (limit // itemsize) * itemsize
    assert len(bcasts) == -(-nbytes // per_piece), (len(bcasts), nbytes, per_piece)


@pytest.mark.parallel(SIZES)
def test_broadcast_in_pieces_matches_mpi(monkeypatch, messages):
    for limit in LIMITS:
        monkeypatch.setattr(ring, "MAX_MESSAGE_BYTES", limit)
        for shape in ((1,), (7,), (1001,), (2003,), (50, 3)):
            for dtype in DTYPES:
                for root in sorted({0, WORLD.size - 1}):
                    x = random_array(rank_rng(root), shape, dtype)
                    arg = x if WORLD.rank == root else np.full(shape, POISON, dtype=dtype)

                    def check(x=x, arg=arg, root=root, limit=limit):
                        expected = x.copy()
                        mpi_bcast(expected, root)
                        messages.clear()
                        y = gflow.broadcast(arg, root=root)
                        assert y.shape == expected.shape and y.dtype == expected.dtype
                        np.testing.assert_array_equal(y, expected)
                        check_bcast_pieces(messages, x.nbytes, x.itemsize, limit)

                    on_all_ranks(check, f"limit={limit} shape={shape} {dtype.__name__} root={root}")


@pytest.mark.parallel(SIZES)
def test_under_the_limit_each_step_is_one_message(messages):
    """The real limit: one message each way per allgather step and one Ibcast, as before pieces
    existed."""
    x = random_array(rank_rng(3), (1000, 3), np.float64)

    def check():
        messages.clear()
        np.testing.assert_array_equal(gflow.allgather(x), np.concatenate(WORLD.allgather(x)))
        calls = [call for call, tag, _ in messages if tag == TAG_RING_AG]
        assert calls == ["recv", "send"] * (WORLD.size - 1)
        messages.clear()
        gflow.broadcast(x, root=0)
        assert [call for call, _, _ in messages] == (["bcast"] if WORLD.size > 1 else [])

    on_all_ranks(check)


def to_host(a) -> np.ndarray:
    return memory.device_view(a).copy_to_host()


@pytest.mark.parallel(SIZES)
def test_device_allgather_and_broadcast_in_pieces(monkeypatch, messages, transport_mode):
    """Device arrays (Numba's simulator unless GFLOW_TEST_GPU=1), kept small for the simulator."""
    for limit in LIMITS:
        monkeypatch.setattr(ring, "MAX_MESSAGE_BYTES", limit)
        for dtype in DTYPES:
            mine = random_array(rank_rng(1), (rows_of(WORLD.rank, [0, 60, 7, 45]), 2), dtype)
            x = random_array(rank_rng(2), 200, dtype)

            def check(mine=mine, x=x, limit=limit):
                messages.clear()
                y = to_host(gflow.allgather(cuda.to_device(mine)))
                everyone = WORLD.allgather(mine)
                np.testing.assert_array_equal(y, np.concatenate(everyone))
                check_ring_allgather_pieces(messages, [a.nbytes for a in everyone], limit)

                root = WORLD.size - 1
                expected = x.copy()
                mpi_bcast(expected, root)
                arg = x if WORLD.rank == root else np.full(x.shape, POISON, dtype=x.dtype)
                messages.clear()
                np.testing.assert_array_equal(
                    to_host(gflow.broadcast(cuda.to_device(arg), root=root)), expected
                )
                check_bcast_pieces(messages, x.nbytes, x.itemsize, limit)

            on_all_ranks(check, f"{transport_mode} limit={limit} {dtype.__name__}")
