"""allreduce against MPI's own Allreduce and float64 NumPy, at world sizes 1 to 4."""

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
from hypothesis import given
from hypothesis import strategies as st
from mpi4py import MPI

import gflow

SIZES = [1, 2, 3, 4]
DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
OPS = ["sum", "mean", "max", "min"]

# Lengths around the interesting edges: empty, fewer than ranks, primes, and both sides of the
# small-message crossover (in float32 elements; other dtypes cross it elsewhere).
CROSSOVER = gflow.config.small_message_bytes // 4
lengths = st.one_of(
    st.integers(0, 9),
    st.integers(10, 3000),
    st.sampled_from([997, CROSSOVER - 1, CROSSOVER, CROSSOVER + 1, 100_003]),
)


def check_allreduce(x, op, algorithm):
    before = x.copy()
    y = gflow.allreduce(x, op, algorithm=algorithm)
    assert y is not x
    assert y.shape == x.shape and y.dtype == x.dtype
    np.testing.assert_array_equal(x, before)  # input untouched
    assert_close_to_reference(y, x, op)
    assert_same_on_all_ranks(y)


@pytest.mark.parallel(SIZES)
@given(
    n=lengths,
    dtype=st.sampled_from(DTYPES),
    op=st.sampled_from(OPS),
    algorithm=st.sampled_from(["auto", "ring", "recursive_doubling"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_allreduce_matches_mpi(n, dtype, op, algorithm, seed):
    if op == "mean" and np.dtype(dtype).kind != "f":
        return  # a documented TypeError, tested below
    if algorithm == "recursive_doubling" and n * np.dtype(dtype).itemsize > gflow.config.small_message_bytes:
        algorithm = "auto"
    x = random_array(rank_rng(seed), n, dtype)
    on_all_ranks(lambda: check_allreduce(x, op, algorithm))


@pytest.mark.parallel(SIZES)
def test_allreduce_any_shape_is_reduced_flat():
    for shape in [(), (3, 5), (2, 3, 4), (70_000, 2)]:
        x = random_array(rank_rng(7), shape, np.float32)
        on_all_ranks(lambda: check_allreduce(x, "sum", "auto"), f"shape {shape}")  # noqa: B023


@pytest.mark.parallel(SIZES)
def test_out_and_in_place():
    for n in [5, 200_000]:
        x = random_array(rank_rng(n), n, np.float64)
        expected = gflow.allreduce(x)
        on_all_ranks(lambda: check_out_and_in_place(x, expected), f"n={n}")  # noqa: B023


def check_out_and_in_place(x, expected):
    out = np.full(x.size, np.nan)  # poisoned
    assert gflow.allreduce(x, out=out) is out
    np.testing.assert_array_equal(out, expected)
    z = x.copy()
    assert gflow.allreduce(z, out=z) is z
    np.testing.assert_array_equal(z, expected)


@pytest.mark.parallel(SIZES)
def test_non_contiguous_input_works():
    for n in [7, 100_001]:
        x = random_array(rank_rng(n), (n, 2), np.float32)[:, 1]
        assert not x.flags.c_contiguous
        on_all_ranks(lambda: check_allreduce(x, "max", "auto"), f"n={n}")  # noqa: B023


@pytest.mark.parallel(SIZES)
def test_mpi_ops_are_accepted():
    x = random_array(rank_rng(3), 1000, np.int64)

    def check():
        for mpi_op, name in ((MPI.SUM, "sum"), (MPI.MAX, "max"), (MPI.MIN, "min")):
            np.testing.assert_array_equal(gflow.allreduce(x, mpi_op), gflow.allreduce(x, name))

    on_all_ranks(check)


@pytest.mark.parallel(SIZES)
def test_validation_switch_does_not_change_results():
    x = random_array(rank_rng(11), 100_000, np.float32)
    saved = gflow.config.validate
    try:
        for validate in (True, False):
            gflow.config.validate = validate
            for n in (100, x.size):
                on_all_ranks(lambda: check_allreduce(x[:n], "sum", "auto"), f"validate={validate} n={n}")  # noqa: B023
    finally:
        gflow.config.validate = saved


@pytest.mark.parallel([2, 3, 4])
def test_gflow_traffic_never_matches_user_messages():
    """A receive the user posted for any source and tag must not catch gflow's messages."""
    rank, size = WORLD.rank, WORLD.size
    token = np.full(1, -1, dtype=np.int64)
    request = WORLD.Irecv(token, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
    x = random_array(rank_rng(5), 300_000, np.float32)

    def check():
        check_allreduce(x, "sum", "auto")
        check_allreduce(x[:10], "sum", "auto")
        assert not request.Test(), "gflow's traffic matched a user receive"

    on_all_ranks(check)
    WORLD.Send(np.full(1, rank, dtype=np.int64), dest=(rank + 1) % size, tag=99)
    request.Wait()
    assert token[0] == (rank - 1) % size


@pytest.mark.parallel([1, 2, 3, 4])
def test_user_communicators_get_their_own_duplicate():
    color = WORLD.rank % 2
    sub = WORLD.Split(color, WORLD.rank)
    x = random_array(rank_rng(13), 50, np.int64)

    def check():
        y = gflow.allreduce(x, comm=sub)
        expected = np.empty_like(x)
        sub.Allreduce(x, expected)
        np.testing.assert_array_equal(y, expected)
        from gflow._context import context

        assert context(sub) is context(sub)
        assert context(sub).comm != sub

    on_all_ranks(check)
    sub.Free()
