"""allreduce against MPI's own Allreduce and float64 NumPy, at world sizes 1 to 4."""

import time

import numpy as np
import pytest
from helpers import (
    WORLD,
    assert_close_to_reference,
    assert_same_on_all_ranks,
    mpi_allreduce,
    on_all_ranks,
    random_array,
    rank_rng,
    reference_mpi,
    without_warnings,
)
from hypothesis import given
from hypothesis import strategies as st
from mpi4py import MPI

import gflow
from gflow.runtime.context import context

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
def test_inf_and_overflow_reduce_as_mpi_does_without_warnings():
    """inf + -inf is NaN and a sum past the dtype's maximum is inf, as in MPI's own Allreduce, with no
    NumPy RuntimeWarning from gflow's arithmetic. Where the program turns warnings into errors, the
    reduction still finishes: raised inside it, one would stop a collective half way on one rank."""
    p = WORLD.size
    fits = gflow.config.small_message_bytes  # (recursive doubling takes no more)
    algorithms = ("auto", "ring", "recursive_doubling", "hierarchical")
    dtypes = (np.float16, np.float32, np.float64)
    cases = [
        (n, dtype, algorithm)
        for n in (5, 5000, 70_000)
        for dtype in dtypes
        for algorithm in algorithms
        if algorithm != "recursive_doubling" or n * np.dtype(dtype).itemsize <= fits
    ]

    def check(x, op, algorithm, errors):
        y = without_warnings(lambda: gflow.allreduce(x, op, algorithm=algorithm), as_errors=errors)
        np.testing.assert_array_equal(y[1:3], [np.nan if p > 1 else np.inf, np.inf])
        if op == "sum":  # (a float16 mean is summed in float32: its maximum times p fits there)
            assert y[3] == (np.inf if p > 1 else np.finfo(x.dtype).max)
        assert_close_to_reference(y[4:], x[4:], op)
        assert_same_on_all_ranks(y)

    for n, dtype, algorithm in cases:
        x = random_array(rank_rng(n + p), n, dtype)
        x[1:4] = np.inf if WORLD.rank == 0 else -np.inf, np.inf, np.finfo(dtype).max
        for op, errors in (("sum", False), ("mean", True)):
            label = f"{n} {np.dtype(dtype).name} {algorithm} {op}"
            on_all_ranks(lambda x=x, op=op, a=algorithm, e=errors: check(x, op, a, e), label)


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


@pytest.mark.parallel([2, 3])
def test_validation_off_on_some_ranks_only_is_a_mismatch_on_every_rank():
    """helper-51: with GFLOW_VALIDATE=0 on one rank only, that rank skipped the agreement before a
    ring and its peers waited in it for ever. Without validation the ranks still agree once per
    communicator, on a signature that carries the setting."""
    x = random_array(rank_rng(12), 600_000, np.float32)  # (past the latency path at p = 2 too)
    rows = np.ascontiguousarray(x[: 1000 * WORLD.size].reshape(WORLD.size, 1000))
    saved = gflow.config.validate
    comm = WORLD.Dup()
    calls = {
        "ring": lambda: gflow.allreduce(x, comm=comm, algorithm="ring"),
        "auto": lambda: gflow.allreduce(x, comm=comm),
        "hierarchical": lambda: gflow.allreduce(x, comm=comm, algorithm="hierarchical"),
        "broadcast": lambda: gflow.broadcast(x, comm=comm),
        "allgather": lambda: gflow.allgather(x, comm=comm),
        "reduce_scatter": lambda: gflow.reduce_scatter(x, comm=comm),
        "alltoall": lambda: gflow.alltoall(rows, comm=comm),
    }
    try:
        gflow.config.validate = WORLD.rank != 0
        for call in calls.values():
            with pytest.raises(gflow.MismatchError, match="validate=(True|False), .*validate=(True|False)"):
                call()
        # the latency path's calls always carry their agreement: correct whatever the setting
        np.testing.assert_array_equal(gflow.allreduce(x[:10], comm=comm), reference_mpi(x[:10], "sum"))
        gflow.config.validate = False  # on every rank: agreed once, then no agreement
        for _ in range(2):
            for name, call in calls.items():
                expected = {"ring": reference_mpi(x, "sum"), "auto": reference_mpi(x, "sum")}.get(name)
                got = call()
                if expected is not None:
                    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
        assert context(comm).agreed_unvalidated
    finally:
        gflow.config.validate = saved
        comm.Free()


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
        from gflow.runtime.context import context

        assert context(sub) is context(sub)
        assert context(sub).comm != sub

    on_all_ranks(check)
    sub.Free()


@pytest.mark.parallel([2, 3, 4])
def test_a_two_byte_mean_that_fits_the_type_never_overflows():
    """A "mean" of float16 or bfloat16 divides before it sums (issue 24, item 4): two ranks of 40000
    in float16 gave inf, where 40000 is right. Every algorithm, reduce_scatter and LazyAllreduce; the
    result is within the dtype's rounding of float64 NumPy's mean, on every rank alike."""
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = rank_rng(24)
    cases = {
        np.dtype(np.float16): rng.uniform(30_000, 65_000, 4097),  # sums overflow float16 (65504)
        bf16: rng.uniform(1.8e38, 3.3e38, 4097),  # sums overflow bfloat16 (3.39e38)
    }
    for dtype, values in cases.items():
        values[::2] *= -1 if WORLD.rank % 2 else 1  # signs differ by rank: the mean is not the max
        x = values.astype(dtype)
        exact = reference_float64_mean(x)
        eps = 2.0**-10 if dtype == np.float16 else 2.0**-7
        # each rank's x/p rounds once, and p - 1 partial sums round: within (p + 1) eps of max |x|
        tol = (WORLD.size + 1) * eps * float(np.max(np.abs(values)))

        def check(x=x, exact=exact, tol=tol, dtype=dtype):
            results = {
                algorithm: gflow.allreduce(x, "mean", algorithm=algorithm)
                for algorithm in ("auto", "ring", "hierarchical")
            }
            results["recursive_doubling"] = gflow.allreduce(x[:1000], "mean", algorithm="recursive_doubling")
            results["reduce_scatter"] = gflow.reduce_scatter(x, "mean")
            lazy = gflow.LazyAllreduce(threshold_bytes=1000, op="mean")
            pushed = [x[:1000].copy(), x[1000:].copy()]
            for g in pushed:
                lazy.push(g)
            lazy.flush()
            results["lazy"] = np.concatenate(pushed)
            bounds = np.array_split(np.arange(x.size), WORLD.size)[WORLD.rank]
            for name, y in results.items():
                want = exact[:1000] if name == "recursive_doubling" else exact
                if name == "reduce_scatter":
                    want = exact[bounds]
                assert y.dtype == dtype, name
                got = y.astype(np.float64)
                assert np.all(np.isfinite(got)), f"{dtype} {name}: {np.sum(~np.isfinite(got))} not finite"
                assert np.max(np.abs(got - want)) <= tol, (dtype, name, np.max(np.abs(got - want)), tol)
                if name != "reduce_scatter":  # (each rank holds its own shard)
                    assert_same_on_all_ranks(y.view(np.uint16))

        on_all_ranks(check, str(dtype))


@pytest.mark.parallel([2, 3, 4])
@pytest.mark.parametrize("first", ["blocking", "async", "both"])
def test_join_as_a_ranks_first_call_on_a_communicator(first):
    """Rank 0's first call on a fresh communicator is join(); the others' first is a blocking call, an
    async one, or both, then calls on every path that makes a communicator of gflow's on first use (the
    slots, the node phase). Under Open MPI 4.1 this hung whatever the others' first call: the joined
    rank's background duplicate stayed pending until the others' first async call, and Open MPI makes
    no other communicator on a rank meanwhile. Every rank now makes its duplicates and its background
    context's together, in its first collective of either kind."""

    comm = WORLD.Dup()
    others = comm.Split(int(comm.rank > 0), comm.rank)

    def reduced(x, algorithm="auto", run_async=False):
        expected = mpi_allreduce(x, comm=others)
        if run_async:
            got = gflow.allreduce_async(x, comm=comm, algorithm=algorithm).wait(timeout=30)
        else:
            got = gflow.allreduce(x, comm=comm, algorithm=algorithm)
        np.testing.assert_allclose(got, expected, rtol=1e-12, err_msg=f"{x.size} {algorithm} {run_async}")

    def check():
        if comm.rank == 0:
            last = gflow.join(comm)
        else:
            x = random_array(rank_rng(900), 700, np.float64)
            if first in ("blocking", "both"):
                reduced(x)
            if first in ("async", "both"):
                reduced(x, run_async=True)
            for n, algorithm in ((300_001, "auto"), (9000, "hierarchical"), (5001, "ring")):
                reduced(random_array(rank_rng(n), n, np.float64), algorithm)
                reduced(random_array(rank_rng(n + 1), n, np.float64), algorithm, run_async=True)
            last = gflow.join(comm)
        assert comm.allgather(last) == [last] * comm.size and last > 0  # (whichever joined last)

    on_all_ranks(check)
    others.Free()
    comm.Free()


@pytest.mark.parallel([2, 3, 4])
def test_a_joined_rank_serves_the_sub_communicators_it_is_given():
    """join(comm, subsets=...) (gflow.torch's process sets): rank 0, out of data at once, takes part
    with zeros in the allreduces of the two sub-communicators it is in (all of comm's ranks but the
    last, and the even ones; at p = 2, [0] and [0, 1]), blocking and async, on the latency path and
    the ring, while the others call on comm as well. gflow's duplicates of the sub-communicators
    are made first, as gflow.torch makes a process set's (Open MPI hangs otherwise). Against MPI's
    Allreduce over the ranks with data."""

    comm = WORLD.Dup()
    p, r = comm.size, comm.rank
    member_lists = [list(range(max(p - 1, 1))), list(range(0, p, 2)) if p > 2 else [0, 1]]
    subsets, with_data = [], []
    for ranks in member_lists:  # (each sub-communicator, and its ranks but rank 0: the reference's)
        subsets.append(comm.Split(0 if r in ranks else MPI.UNDEFINED, r))
        with_data.append(comm.Split(0 if r in ranks and r > 0 else MPI.UNDEFINED, r))
    mine = [sub for sub in subsets if sub != MPI.COMM_NULL]
    rest = comm.Split(0 if r > 0 else MPI.UNDEFINED, r)  # (comm's ranks with data)
    for sub in mine:
        context(sub).comm  # noqa: B018 (the property makes them)

    def check():
        if r > 0:
            for step in range(2):
                x = random_array(rank_rng(910 + step), 9, np.float64)
                np.testing.assert_allclose(
                    gflow.allreduce(x, comm=comm), mpi_allreduce(x, comm=rest), rtol=1e-12
                )
                for sub, data in zip(subsets, with_data, strict=True):
                    if sub == MPI.COMM_NULL:
                        continue
                    large = random_array(rank_rng(920 + step), 100_003, np.float32)
                    handle = gflow.allreduce_async(large, "mean", comm=sub)
                    got = gflow.allreduce(x, "max", comm=sub)
                    np.testing.assert_array_equal(got, mpi_allreduce(x, MPI.MAX, comm=data))
                    mean = mpi_allreduce(large.astype(np.float64), comm=data) / sub.size  # (the sub's size)
                    np.testing.assert_allclose(handle.wait(timeout=30), mean, rtol=1e-5, atol=1e-5)
        last = gflow.join(comm, subsets=mine)
        assert comm.allgather(last) == [last] * p
        for sub in mine:  # everyone joined: the sub-communicators work as before
            assert gflow.allreduce(np.ones(2), comm=sub).tolist() == [float(sub.size)] * 2

    on_all_ranks(check)
    for sub in subsets + with_data + [rest]:
        if sub != MPI.COMM_NULL:
            sub.Free()
    comm.Free()


@pytest.mark.parallel([2, 3])
def test_one_thread_waits_for_the_duplicates_another_is_making(monkeypatch):
    """Rank 0's first call on a fresh communicator is join(): its caller's thread serves the caller's
    channel and the engine thread the background one, and either may make gflow's duplicates (async
    calls make them on the caller's thread). The others' first call is a blocking allreduce. On rank 0
    the thread making them is held right after posting the background context's duplicate (a
    preemption there): the other thread must wait for the rest, not start its own collectives on
    gflow's duplicate before the stall inspector's is posted (the ranks then made them in different
    orders, and both calls hung; helper-66, then with an async call instead of join())."""
    from gflow.runtime.context import CommContext

    if WORLD.rank == 0:
        first_background = CommContext._first_background

        def held(self, *args):
            made = first_background(self, *args)
            time.sleep(0.5)
            return made

        monkeypatch.setattr(CommContext, "_first_background", held)
    comm = WORLD.Dup()

    def check():
        y = random_array(rank_rng(951), 5, np.float64)
        expected = mpi_allreduce(y if WORLD.rank else np.zeros_like(y))  # (rank 0 serves zeros)
        if WORLD.rank == 0:
            assert gflow.join(comm) in range(1, WORLD.size)
        else:
            np.testing.assert_allclose(gflow.allreduce(y, comm=comm), expected, rtol=1e-12)
            assert gflow.join(comm) in range(1, WORLD.size)

    on_all_ranks(check)
    comm.Free()


@pytest.mark.parallel([2, 3, 4])
def test_the_programs_own_calls_on_a_communicator_right_after_its_first_async_call():
    """A communicator's first call is async: the program's own communicators made right after it
    must not meet a duplicate of gflow's still pending on the engine thread. Under Open MPI 4.1 the
    pending duplicate met the program's Split out of order (ompi#2025), and both hung; under MPICH one
    hung once beside mpi4py's duplicate for a fresh communicator's first lowercase collective. The
    caller's thread makes them (CommContext.for_async): every one is made when the call returns.
    20 fresh communicators, each split and duplicated at once."""

    def check():
        for i in range(20):
            comm = WORLD.Dup()
            x = random_array(rank_rng(960 + i), 33, np.float64)
            expected = mpi_allreduce(x)
            handle = gflow.allreduce_async(x, comm=comm)
            made = context(comm)
            assert made.monitor_comm is not None and made.background().monitor_comm is not None
            halves = comm.Split(comm.rank % 2, comm.rank)
            twin = comm.Dup()
            assert halves.allreduce(1) == len(range(comm.rank % 2, comm.size, 2))
            assert twin.allreduce(comm.rank) == sum(range(comm.size))
            np.testing.assert_allclose(handle.wait(timeout=20), expected, rtol=1e-12)
            np.testing.assert_allclose(gflow.allreduce(x, comm=twin), expected, rtol=1e-12)
            for c in (twin, halves, comm):
                c.Free()

    on_all_ranks(check)


@pytest.mark.parallel([2, 3])
def test_the_programs_split_right_after_the_first_async_call_after_a_failed_one():
    """After a failed async call every rank makes a fresh background channel at its next async call:
    a duplicate of the program's communicator, which under Open MPI 4.1 met the program's Split
    right after that call out of order and hung: the caller's thread makes it (CommContext.for_async),
    and it is made when the call returns. 5 communicators, each with
    a mismatched async call (rank 0 passes 3 elements, the others 4), then an async call and a Split."""

    def check():
        for i in range(5):
            comm = WORLD.Dup()
            gflow.allreduce(random_array(rank_rng(980 + i), 3, np.float64), comm=comm)
            wrong = random_array(rank_rng(985 + i), 3 if comm.rank == 0 else 4, np.float64)
            with pytest.raises(gflow.MismatchError):
                gflow.allreduce_async(wrong, comm=comm).wait(timeout=20)
            x = random_array(rank_rng(990 + i), 33, np.float64)
            expected = mpi_allreduce(x)
            handle = gflow.allreduce_async(x, comm=comm)
            assert context(comm).background().monitor_comm is not None  # (made on this thread)
            halves = comm.Split(comm.rank % 2, comm.rank)
            assert halves.allreduce(1) == len(range(comm.rank % 2, comm.size, 2))
            np.testing.assert_allclose(handle.wait(timeout=20), expected, rtol=1e-12)
            halves.Free()
            comm.Free()

    on_all_ranks(check)


@pytest.mark.parallel([2, 3, 4])
def test_gradient_buffers_raise_while_a_rank_is_joined_and_the_others_go_on():
    """gradient_buffers() carves a pool that the node's ranks allocate together, which a rank in join()
    cannot: the callers raise NotServedInJoinError (Horovod's rule for what is not an allreduce), and
    an allreduce after it is still served. The joined rank served the pool's agreement as an allreduce
    of zeros, and the callers hung in the pool's allocation (helper-76)."""

    comm = WORLD.Dup()
    others = comm.Split(int(comm.rank > 0), comm.rank)
    gflow.allreduce(np.ones(3), comm=comm)  # (gflow's communicators made: under Open MPI, join() as
    # rank 0's first call beside the others' gradient_buffers() hangs making them; not fixed)

    def check():
        if comm.rank > 0:
            not_in_join = r"^gradient_buffers\(\) is not supported while"
            lazy = gflow.LazyAllreduce(comm=comm)
            with pytest.raises(gflow.NotServedInJoinError, match=not_in_join):
                lazy.gradient_buffers([(1000,), (10,)])
            params = {"w": np.zeros((30, 20)), "b": np.zeros(20)}
            dp = gflow.DataParallel(params, comm=comm)
            with pytest.raises(gflow.NotServedInJoinError, match=not_in_join):
                dp.gradient_buffers()
            x = random_array(rank_rng(77), 5000, np.float64)
            expected = mpi_allreduce(x, comm=others)
            np.testing.assert_allclose(gflow.allreduce(x, comm=comm), expected, rtol=1e-12)
        last = gflow.join(comm)
        assert comm.allgather(last) == [last] * comm.size and last > 0  # (whichever joined last)

    on_all_ranks(check)
    others.Free()
    comm.Free()


def reference_float64_mean(x: np.ndarray) -> np.ndarray:
    return np.mean(np.stack(WORLD.allgather(x.astype(np.float64))), axis=0)


@pytest.mark.parallel([2, 3, 4])
def test_a_joined_rank_changes_no_min_or_max_on_any_path():
    """While rank 0 is in join() (Horovod's uneven data), the others' min and max are over their own
    values: the joined rank contributes values that change nothing (it contributed zeros, and a min of
    values above 0 came out 0); a sum still counts it as zeros. Every path a joined rank serves: the
    latency path's payload inline and apart, the slots' reduce-scatter (p >= 3), the ring, and the
    node phase; float64 and int32, values of both signs."""

    comm = WORLD.Dup()
    others = comm.Split(int(comm.rank > 0), comm.rank)  # (the reference: MPI over the ranks with data)
    # (join() is rank 0's first call on comm: the communicators gflow makes in the others' first calls,
    # its duplicates, the slots' and the node phase's, are made with it serving)
    calls = [(7, "auto"), (5000, "auto"), (40_000, "auto"), (3001, "ring"), (300_001, "auto")]
    calls += [(9000, "hierarchical")]

    def check():
        if comm.rank == 0:
            last = gflow.join(comm)
            assert comm.allgather(last) == [last] * comm.size and last > 0  # (whichever joined last)
            return
        for i, (n, algorithm) in enumerate(calls):
            for dtype in (np.float64, np.int32):
                x = random_array(rank_rng(800 + i), n, dtype)
                x[0] = -0.0 if dtype == np.float64 else x[0]  # (a sum of -0.0s is -0.0, as MPI's)
                for op, mpi_op in (("min", MPI.MIN), ("max", MPI.MAX), ("sum", MPI.SUM)):
                    expected = np.empty_like(x)
                    others.Allreduce(x, expected, mpi_op)
                    got = gflow.allreduce(x, op, comm=comm, algorithm=algorithm)
                    if op == "sum" and dtype == np.float64:
                        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12, err_msg=f"{n} {op}")
                        assert np.signbit(got[0]) == np.signbit(expected[0]), (n, algorithm)
                    else:
                        np.testing.assert_array_equal(got, expected, err_msg=f"{n} {dtype} {op} {algorithm}")
        last = gflow.join(comm)
        assert comm.allgather(last) == [last] * comm.size and last > 0

    on_all_ranks(check)
