"""reduce_scatter, allgather and broadcast against MPI's own collectives, at world sizes 1 to 4."""

import numpy as np
import pytest
from helpers import (
    MPI_OP,
    WORLD,
    assert_same_on_all_ranks,
    mpi_bcast,
    on_all_ranks,
    random_array,
    rank_rng,
    reference_mpi,
)
from hypothesis import given
from hypothesis import strategies as st

import gflow

SIZES = [1, 2, 3, 4]
DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]


@pytest.mark.parallel(SIZES)
@given(
    n=st.one_of(st.integers(0, 9), st.integers(10, 5000), st.just(100_003)),
    dtype=st.sampled_from(DTYPES),
    op=st.sampled_from(["sum", "max", "min", "mean"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_reduce_scatter_is_this_ranks_shard_of_the_allreduce(n, dtype, op, seed):
    if op == "mean" and np.dtype(dtype).kind != "f":
        return
    x = random_array(rank_rng(seed), n, dtype)

    def check():
        before = x.copy()
        shard = gflow.reduce_scatter(x, op)
        np.testing.assert_array_equal(x, before)
        full = reference_mpi(x, op)
        expected = np.array_split(full, WORLD.size)[WORLD.rank]
        assert shard.dtype == x.dtype and shard.shape == expected.shape
        if np.dtype(dtype).kind == "f" and op in ("sum", "mean"):
            eps = float(np.finfo(dtype).eps)
            scale = np.array_split(np.abs(x.astype(np.float64)), WORLD.size)[WORLD.rank]
            # every rank joins the sum, also one whose shard is empty (n < p): a collective in a
            # conditional would leave the others waiting
            scale = WORLD.allreduce(float(scale.sum()), op=MPI_OP["sum"])
            np.testing.assert_allclose(
                shard.astype(np.float64),
                expected.astype(np.float64),
                rtol=0,
                atol=4 * WORLD.size * eps * scale + 1e-30,
            )
        else:
            np.testing.assert_array_equal(shard, expected)

    on_all_ranks(check)


@pytest.mark.parallel(SIZES)
@given(
    rows=st.integers(0, 300),
    tail=st.sampled_from([(), (3,), (2, 5)]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**32 - 1),
)
def test_allgather_concatenates_in_rank_order(rows, tail, dtype, seed):
    # Ranks pass different first-axis lengths, as reduce_scatter's shards have.
    mine = random_array(rank_rng(seed), (max(rows - WORLD.rank, 0),) + tail, dtype)

    def check():
        before = mine.copy()
        y = gflow.allgather(mine)
        np.testing.assert_array_equal(mine, before)
        expected = np.concatenate(WORLD.allgather(mine), axis=0)
        assert y.shape == expected.shape and y.dtype == expected.dtype
        np.testing.assert_array_equal(y, expected)

    on_all_ranks(check)


@pytest.mark.parallel(SIZES)
def test_allgather_of_reduce_scatter_is_allreduce():
    x = random_array(rank_rng(21), 100_003, np.int64)
    on_all_ranks(
        lambda: np.testing.assert_array_equal(gflow.allgather(gflow.reduce_scatter(x)), gflow.allreduce(x))
    )


@pytest.mark.parallel(SIZES)
def test_broadcast_from_every_root():
    for n, dtype in [(0, np.int32), (1, np.float16), (1000, np.int32), (300_001, np.float16)]:
        x = random_array(rank_rng(n), (n,), dtype)
        on_all_ranks(lambda: check_broadcast(x), f"n={n} {dtype}")  # noqa: B023 - called at once


def check_broadcast(x):
    for root in range(WORLD.size):
        before = x.copy()
        y = gflow.broadcast(x, root=root)
        np.testing.assert_array_equal(x, before)
        expected = x.copy()
        mpi_bcast(expected, root)
        np.testing.assert_array_equal(y, expected)
        assert_same_on_all_ranks(y)


@pytest.mark.parallel(SIZES)
@given(
    rows=st.integers(0, 12),
    tail=st.sampled_from([(), (3,), (2, 5)]),
    dtype=st.sampled_from(DTYPES),
    op=st.sampled_from(["sum", "max", "min", "mean"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_reduce_scatter_by_rows_is_this_ranks_rows_of_the_allreduce(rows, tail, dtype, op, seed):
    """rows=True (Horovod's reducescatter): the first axis is split, np.array_split's way."""
    if op == "mean" and np.dtype(dtype).kind != "f":
        return
    x = random_array(rank_rng(seed), (rows, *tail), dtype)

    def check():
        before = x.copy()
        mine = gflow.reduce_scatter(x, op, rows=True)
        np.testing.assert_array_equal(x, before)
        expected = np.array_split(reference_mpi(x, op), WORLD.size)[WORLD.rank]
        assert mine.dtype == x.dtype and mine.shape == expected.shape
        if np.dtype(dtype).kind == "f" and op in ("sum", "mean"):
            eps = float(np.finfo(dtype).eps)
            scale = WORLD.allreduce(float(np.abs(x.astype(np.float64)).sum()), op=MPI_OP["sum"])
            atol = 4 * WORLD.size * eps * scale + 1e-30
            np.testing.assert_allclose(
                mine.astype(np.float64), expected.astype(np.float64), rtol=0, atol=atol
            )
        else:
            np.testing.assert_array_equal(mine, expected)

    on_all_ranks(check)


@pytest.mark.parallel(SIZES)
@given(
    tail=st.sampled_from([(), (3,), (2, 5)]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**32 - 1),
)
def test_alltoall_against_mpis_alltoall(tail, dtype, seed):
    rng = rank_rng(seed)
    splits = rng.integers(0, 5, size=WORLD.size)
    x = random_array(rng, (int(splits.sum()), *tail), dtype)

    def check():
        before = x.copy()
        got, received = gflow.alltoall(x, splits.tolist())
        np.testing.assert_array_equal(x, before)
        starts = np.concatenate(([0], np.cumsum(splits)))
        pieces = WORLD.alltoall([x[starts[d] : starts[d + 1]] for d in range(WORLD.size)])
        expected = np.concatenate(pieces, axis=0)
        assert got.dtype == x.dtype and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(received, [len(p) for p in pieces])
        equal = np.ascontiguousarray(np.tile(x[:1], (WORLD.size * 2,) + (1,) * len(tail))) if len(x) else None
        if WORLD.allreduce(equal is None, op=MPI_OP["max"]):
            return
        got, received = gflow.alltoall(equal)  # no splits: equal parts
        assert received.tolist() == [2] * WORLD.size
        np.testing.assert_array_equal(
            got, np.concatenate(WORLD.alltoall([equal[2 * d : 2 * d + 2] for d in range(WORLD.size)]))
        )

    on_all_ranks(check)


@pytest.mark.parallel([2, 3])
def test_alltoall_refuses_bad_splits_on_the_rank_that_passed_them_and_its_peers_raise_mismatch():
    x = np.arange(6.0).reshape(6, 1)
    bad = {0: [7] + [0] * (WORLD.size - 1), 1: [1] * (WORLD.size + 1)}.get(WORLD.rank)
    good = [6] + [0] * (WORLD.size - 1)

    def check():
        if WORLD.rank in (0, 1):
            with pytest.raises(ValueError, match="splits"):
                gflow.alltoall(x, bad)
        else:
            with pytest.raises(gflow.MismatchError):
                gflow.alltoall(x, good)
        with pytest.raises(ValueError, match="divide evenly"):
            gflow.alltoall(np.zeros((WORLD.size + 1, 2)))
        # another trailing shape on one rank: MismatchError everywhere, naming the shape
        y = np.zeros((WORLD.size, 3 if WORLD.rank == 0 else 2))
        with pytest.raises(gflow.MismatchError, match="shape"):
            gflow.alltoall(y)
        # and the ranks go on in step
        got, _ = gflow.alltoall(np.full((WORLD.size, 1), float(WORLD.rank)))
        np.testing.assert_array_equal(got[:, 0], np.arange(WORLD.size))

    on_all_ranks(check)
