"""The latency path's fast lane (gflow/collectives/latency.py): once a shape, dtype and op has been
reduced, later calls skip the general checks. Each test warms the lane first, then checks that it
still gives MPI's answer, bitwise alike on every rank, and that every error the general path raises
is still raised, on every rank where the ranks disagree."""

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

import gflow
from gflow.collectives.recursive_doubling import SEPARATE_PAYLOAD_BYTES
from gflow.runtime.config import TWO_RANKS_FACTOR
from gflow.runtime.context import context

SIZES = [1, 2, 3, 4]
MULTI = [2, 3, 4]


def lane_entries() -> int:
    """How many calls the fast lane has learnt on COMM_WORLD (None entries: ones it does not serve)."""
    return sum(entry is not None for entry in context().small_calls.values())


DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64, ml_dtypes.bfloat16]
CASES = [  # every dtype with every op it takes ("mean" of integers is a TypeError: test_errors.py)
    (dtype, op)
    for dtype in DTYPES
    for op in ("sum", "mean", "max", "min")
    if op != "mean" or np.dtype(dtype).kind in "fV"
]


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize(("dtype", "op"), CASES)
def test_warm_calls_match_mpi_with_and_without_out(dtype, op):
    rng = rank_rng(7)
    for shape in [(1,), (5, 3), (257,), (gflow.config.small_message_bytes // np.dtype(dtype).itemsize,)]:
        for rep in range(4):  # the first call learns (the general path); the others take the lane
            x = random_array(rng, shape, np.float32).astype(dtype)
            before = x.copy()
            # out: none, of x's shape, or of another shape of x's size (allowed: a 2-D out of a 1-D x
            # once wrote past its end in the lane)
            out = [None, np.full(shape, 99, dtype), None, np.full((x.size, 1), 99, dtype)][rep]
            y = gflow.allreduce(x, op, out=out)
            assert y.shape == (shape if out is None else out.shape) and y.dtype == np.dtype(dtype)
            assert y is out if out is not None else y is not x
            y = y.reshape(shape)
            np.testing.assert_array_equal(x.view(np.uint8), before.view(np.uint8))  # x untouched
            if np.dtype(dtype) != ml_dtypes.bfloat16:  # (MPI has no bfloat16: test_bfloat16.py bounds it)
                on_all_ranks(lambda: assert_close_to_reference(y, x, op))  # noqa: B023 - called at once
            assert_same_on_all_ranks(y)
            general = np.empty(shape + (2,), dtype)[..., 0]  # x's values, not contiguous: the general path
            general[...] = x
            expected = gflow.allreduce(general, op)
            np.testing.assert_array_equal(y.view(np.uint8), expected.view(np.uint8))  # the same bits
            z = x.copy()
            assert gflow.allreduce(z, op, out=z) is z  # in place
            np.testing.assert_array_equal(z.view(np.uint8), y.view(np.uint8))
        # the lane learnt this call (and serves it, but for one rank and a mean of 2-byte floats);
        # asked of this key, not of the lane's size: the lane is emptied when its plans reach a bound
        key = (np.dtype(dtype), shape, op, "auto", gflow.config.small_message_bytes)
        entry = context().small_calls.get(key, "unseen")
        served = WORLD.size > 1 and not (op == "mean" and np.dtype(dtype).itemsize == 2)
        assert entry != "unseen" and (entry is not None) == served, (shape, entry)


@pytest.mark.parallel(MULTI)
@pytest.mark.parametrize("odd", ["last", "first"])  # (at p = 3 rank 0 hands its data to rank 1: the fold)
def test_warm_mismatches_raise_on_every_rank(odd):
    # The first call learns what this rank passes (before anything moves); the second is all lane.
    odd_rank = WORLD.size - 1 if odd == "last" else 0
    apart = SEPARATE_PAYLOAD_BYTES // 8  # float64 payloads from this length travel apart from the header
    two_ranks = TWO_RANKS_FACTOR * gflow.config.small_message_bytes // 8  # the latency path's end at p = 2
    cases = {
        "length": (np.ones(10), np.ones(11)),
        "length across the split": (np.ones(apart - 1), np.ones(apart)),
        "length, both apart": (np.ones(apart + 3), np.ones(apart)),
        "length across the two-rank bound": (np.ones(two_ranks), np.ones(two_ranks + 1)),  # (p = 2: RD, ring)
        "shape": (np.ones((2, 3)), np.ones((3, 2))),
        "dtype": (np.ones(4, np.float32), np.ones(4, np.int32)),
        "op": (np.ones(4), np.ones(4)),
    }
    for case, (mine, theirs) in cases.items():
        x = theirs if WORLD.rank == odd_rank else mine
        op = "max" if case == "op" and WORLD.rank == odd_rank else "sum"
        for _ in range(2):
            with pytest.raises(gflow.MismatchError, match="ranks disagree") as info:
                gflow.allreduce(x, op)
            message = str(info.value)
            assert f"rank {odd_rank}" in message, f"{case}: {message}"
            assert message.endswith(f"This rank passed an array of shape {x.shape}"), f"{case}: {message}"
        # nothing is left in flight: the next call is correct
        y = random_array(rank_rng(3), 9, np.float64)
        on_all_ranks(lambda: assert_close_to_reference(gflow.allreduce(y), y, "sum"))  # noqa: B023


@pytest.mark.parallel([2, 3])
def test_two_ranks_take_recursive_doubling_up_to_16x_small_message_bytes():
    # At p = 2 recursive doubling is one exchange, as the ring's is: "auto" takes it further there.
    limit = TWO_RANKS_FACTOR * gflow.config.small_message_bytes
    for n in (limit // 4, limit // 4 + 1):  # float32: at the bound, and one element over
        x = random_array(rank_rng(n), n, np.float32)
        for _ in range(2):  # (the first call learns; the lane serves only recursive doubling)
            y = gflow.allreduce(x)
            on_all_ranks(lambda: assert_close_to_reference(y, x, "sum"), f"n={n}")  # noqa: B023
            assert_same_on_all_ranks(y)
        key = (x.dtype, x.shape, "sum", "auto", gflow.config.small_message_bytes)
        took_recursive_doubling = context().small_calls.get(key) is not None
        assert took_recursive_doubling == (WORLD.size == 2 and n * 4 <= limit), n


@pytest.mark.parallel(MULTI)
def test_bad_arguments_after_warming_fail_every_rank():
    x = random_array(rank_rng(5), 6, np.float64)
    gflow.allreduce(x)
    gflow.allreduce(x)
    bad = WORLD.rank == 0
    frozen = x.copy()
    frozen.flags.writeable = False
    shared = np.concatenate([x, x])
    calls = [  # what rank 0 calls, what it must raise (None: a good call), what the message says
        ("read-only out=x", lambda: gflow.allreduce(frozen, out=frozen), ValueError, "read-only"),
        ("out of 7", lambda: gflow.allreduce(x, out=np.empty(7)), ValueError, "expected 6 elements"),
        ("out float32", lambda: gflow.allreduce(x, out=np.empty(6, np.float32)), TypeError, "float64"),
        ("out over x in part", lambda: gflow.allreduce(shared[:6], out=shared[3:9]), ValueError, "in part"),
        ("out a view", lambda: gflow.allreduce(x, out=np.empty(12)[3:9]), None, None),
    ]
    for label, call, error, match in calls:

        def check(call=call, error=error, match=match):
            if error is None:
                assert_close_to_reference(call() if bad else gflow.allreduce(x), x, "sum")
            elif bad:
                with pytest.raises(error, match=match):
                    call()
            else:
                with pytest.raises(
                    gflow.MismatchError, match="rank 0 called allreduce with arguments it rejected"
                ):
                    gflow.allreduce(x)

        on_all_ranks(check, label)


@pytest.mark.parallel(MULTI)
def test_what_the_lane_does_not_serve_still_gives_mpis_answer(tmp_path):
    rng = rank_rng(11)
    base = random_array(rng, (40, 2), np.float32)
    for _ in range(2):
        gflow.allreduce(base[:, 0].copy())  # warm (20,)-shaped float32 sums
    strided = base[:, 0]  # the same shape and dtype, not contiguous: the general path
    assert not strided.flags.c_contiguous
    on_all_ranks(lambda: assert_close_to_reference(gflow.allreduce(strided), strided, "sum"))
    gflow.start_timeline(str(tmp_path / "trace.json"))  # a timeline on: the general path, with its spans
    try:
        on_all_ranks(lambda: assert_close_to_reference(gflow.allreduce(base), base, "sum"))
    finally:
        gflow.stop_timeline()
    # settings that move the call off the latency path are honoured at once
    small = gflow.config.small_message_bytes
    try:
        gflow.config.small_message_bytes = 64
        y = gflow.allreduce(base)  # 320 bytes: the ring now
        on_all_ranks(lambda: assert_close_to_reference(y, base, "sum"))
        assert_same_on_all_ranks(y)
    finally:
        gflow.config.small_message_bytes = small


@pytest.mark.parallel([2])
@pytest.mark.parametrize("error", ["truncated", "other"])
def test_an_mpi_error_in_the_one_exchange_of_two_ranks(monkeypatch, error):
    # Two ranks exchange once, inline (recursive_doubling._lone_step). An MPI error there, before
    # anything moved (Startall replaced): a receive that did not fit is a message from another
    # protocol, a mismatch on every rank; any other error names the peer.
    from mpi4py import MPI

    from gflow.collectives import recursive_doubling

    code = MPI.ERR_TRUNCATE if error == "truncated" else MPI.ERR_OTHER
    x = random_array(rank_rng(6), 10, np.float64)
    comm = WORLD.Dup()  # (with MPI's messages: two ranks on one host exchange in shared memory)
    monkeypatch.setattr(gflow.config, "shared_slots", False)
    for _ in range(2):  # (the lane learns, then makes the plan)
        gflow.allreduce(x, comm=comm)
    assert context(comm).slots is False
    key = (x.dtype, x.shape, "sum", "auto", gflow.config.small_message_bytes)
    plan = context(comm).small_calls[key].plan
    assert plan is not None and plan.lone

    def failing(requests):
        raise MPI.Exception(code)

    mpi = type("MPI", (), {"Prequest": type("P", (), {"Startall": staticmethod(failing)})})
    for name in ("Request", "Exception", "ERR_TRUNCATE", "ERR_IN_STATUS"):
        setattr(mpi, name, getattr(MPI, name))
    monkeypatch.setattr(recursive_doubling, "MPI", mpi)
    if error == "truncated":
        with pytest.raises(gflow.MismatchError, match="a message this protocol does not accept"):
            gflow.allreduce(x, comm=comm)
    else:
        with pytest.raises(gflow.GflowError, match="agreement exchange with rank"):
            gflow.allreduce(x, comm=comm)
    monkeypatch.undo()
    if error == "truncated":  # nothing was left in flight
        on_all_ranks(lambda: assert_close_to_reference(gflow.allreduce(x, comm=comm), x, "sum"))
