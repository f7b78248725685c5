"""Bad input gets a clear error before any data moves; ranks that disagree all raise, none hangs."""

import re

import numpy as np
import pytest
from helpers import WORLD, assert_close_to_reference, on_all_ranks, random_array, rank_rng
from mpi4py import MPI

import gflow

MULTI = [2, 3, 4]


def raises_on_this_rank(exc_type, match, fn):
    with pytest.raises(exc_type, match=match):
        fn()


# Each case: a call with a bad argument, the exception it must raise and what the message must say.
BAD_INPUT = [
    (lambda: gflow.allreduce([1.0, 2.0]), TypeError, "expected a NumPy array"),
    (lambda: gflow.allreduce(np.ones(3, np.complex64)), TypeError, "unsupported dtype complex64"),
    (lambda: gflow.allreduce(np.ones(3, np.uint8)), TypeError, "unsupported dtype uint8"),
    (lambda: gflow.allreduce(np.ones(3), op="prod"), ValueError, "op: expected one of"),
    (lambda: gflow.allreduce(np.ones(3), op=MPI.PROD), ValueError, "unsupported MPI.Op"),
    (lambda: gflow.allreduce(np.ones(3, np.int32), op="mean"), TypeError, "needs a floating dtype"),
    (lambda: gflow.allreduce(np.ones(3), out=np.ones(4)), ValueError, "expected 3 elements, got 4"),
    (lambda: gflow.allreduce(np.ones(3), out=np.ones(3, np.float32)), TypeError, "expected dtype float64"),
    (lambda: gflow.allreduce(np.ones(3), out=np.ones(6)[::2]), ValueError, "C-contiguous"),
    (lambda: gflow.allreduce(np.ones(3), algorithm="tree"), ValueError, "algorithm: expected one of"),
    (lambda: gflow.allreduce(np.ones(10**6), algorithm="recursive_doubling"), ValueError, "at most"),
    (lambda: gflow.allreduce(np.ones(3), comm="world"), TypeError, "comm: expected an mpi4py"),
    (lambda: gflow.reduce_scatter(np.ones(3, bool)), TypeError, "unsupported dtype bool"),
    (lambda: gflow.allgather("abc"), TypeError, "expected a NumPy array"),
    (lambda: gflow.broadcast(np.ones(3), root=WORLD.size), ValueError, "root must be in"),
    (lambda: gflow.broadcast(np.ones(3), root=1.0), TypeError, "root must be an int"),
]


@pytest.mark.parallel([1, 2, 3])
def test_bad_input_raises_on_every_rank():
    # One spawn for all cases (each mpiexec start costs seconds here); each case checked on its own.
    for call, exc_type, match in BAD_INPUT:
        on_all_ranks(lambda: raises_on_this_rank(exc_type, match, call), match)  # noqa: B023 - called at once
        # Nothing was left in flight: the next call works.
        on_all_ranks(lambda: np.testing.assert_array_equal(gflow.allreduce(np.ones(5)), WORLD.size))


# Each case: what rank 0 calls, what every other rank calls, and what the message must name.
MISMATCHES = {
    "length": (
        lambda: gflow.allreduce(np.ones(1024, np.float32)),
        lambda: gflow.allreduce(np.ones(1000, np.float32)),
        "1024 float32 elements",
    ),
    "dtype": (
        lambda: gflow.allreduce(np.ones(10, np.float32)),
        lambda: gflow.allreduce(np.ones(10, np.float64)),
        "float64",
    ),
    "op": (
        lambda: gflow.allreduce(np.ones(10), "sum"),
        lambda: gflow.allreduce(np.ones(10), "max"),
        "op=max",
    ),
    "small vs bandwidth-sized": (  # auto above the latency path settles ring/hierarchical later
        lambda: gflow.allreduce(np.ones(10)),
        lambda: gflow.allreduce(np.ones(10**6)),
        "algorithm=auto",
    ),
    "forced algorithm": (
        lambda: gflow.allreduce(np.ones(10), algorithm="ring"),
        lambda: gflow.allreduce(np.ones(10)),
        "algorithm=recursive_doubling",
    ),
    "ring lengths": (
        lambda: gflow.allreduce(np.ones(10**6)),
        lambda: gflow.allreduce(np.ones(10**6 + 1)),
        "1000001 float64",
    ),
    "collective": (
        lambda: gflow.allreduce(np.ones(10)),
        lambda: gflow.broadcast(np.ones(10)),
        "called broadcast",
    ),
    "root": (
        lambda: gflow.broadcast(np.ones(10), root=0),
        lambda: gflow.broadcast(np.ones(10), root=1),
        "root=1",
    ),
    "reduce_scatter length": (
        lambda: gflow.reduce_scatter(np.ones(50)),
        lambda: gflow.reduce_scatter(np.ones(51)),
        "51 float64",
    ),
    "allgather rows": (
        lambda: gflow.allgather(np.ones((2, 3))),
        lambda: gflow.allgather(np.ones((2, 4))),
        "rows of 4 float64",
    ),
}


def check_mismatch_raises(case):
    first, others, named = MISMATCHES[case]
    call = first if WORLD.rank == 0 else others
    with pytest.raises(gflow.MismatchError, match="ranks disagree") as info:
        call()
    message = str(info.value)
    assert "rank 0" in message and named in message, f"{case}: {message}"
    assert isinstance(info.value, gflow.GflowError)


@pytest.mark.parallel(MULTI)
def test_ranks_that_disagree_all_raise():
    x = random_array(rank_rng(1), 300_000, np.float32)
    for case in MISMATCHES:
        on_all_ranks(lambda: check_mismatch_raises(case), case)  # noqa: B023 - called at once
        # The failed call left nothing in flight: the next one is correct.
        on_all_ranks(lambda: assert_close_to_reference(gflow.allreduce(x), x, "sum"))


_PUSHES_DIFFER = (
    "the tensors pushed so far (their order or sizes: a parameter frozen or set_absent() on some ranks "
    "only?), the fusion threshold, or its tuning"
)
FIRST_LINES = {
    "count": (lambda: gflow.allreduce(np.ones(10)), lambda: gflow.allreduce(np.ones(11)),
              "the number of elements: rank {a} passed 10, rank {last} passed 11"),
    "dtype": (lambda: gflow.allreduce(np.ones(4)), lambda: gflow.allreduce(np.ones(4, np.float32)),
              "the dtype: rank {a} passed float64, rank {last} passed float32"),
    "op": (lambda: gflow.allreduce(np.ones(4)), lambda: gflow.allreduce(np.ones(4), op="max"),
           "the op: rank {a} op=sum, rank {last} op=max"),
    "collective": (lambda: gflow.allreduce(np.ones(4)), lambda: gflow.allgather(np.ones(4)),
                   "the collective: rank {a} called allreduce, rank {last} called allgather"),
    "root": (lambda: gflow.broadcast(np.ones(4)), lambda: gflow.broadcast(np.ones(4), root=1),
             "the root: rank {a} root=0, rank {last} root=1"),
    "shape": (lambda: gflow.allreduce(np.ones((2, 2))), lambda: gflow.allreduce(np.ones(4)),
              "the shape: rank {a} passed an array of shape (2, 2), rank {last} passed an array of "
              "shape (4,)"),
    "large shape": (lambda: gflow.allreduce(np.ones((2, 5000))), lambda: gflow.allreduce(np.ones(10**4)),
                    "the shape: rank {a} passed an array of shape (2, 5000), rank {last} passed an array of "
                    "shape (10000,)"),
    "compression": (lambda: gflow.allreduce(np.ones(4, np.float32)),
                    lambda: gflow.allreduce(np.ones(4, np.float32), compression="fp16"),
                    "the dtype on the wire (the array's own, or the one compression= sends): rank {a} passed "
                    "float32 (an array of shape (4,)), rank {last} passed float16 (an array of shape (4,) of "
                    "float32, compression='fp16')"),
    "fused segments": (lambda: _lazy_step([7, 2000, 13]), lambda: _lazy_step([7, 2000]),
                       "how many fused segments the step has (the ranks pushed different tensors, or one "
                       "flushed a step the others did not: compare the push-order checksums below): rank {a} "
                       "sent a segment of 13 float32 elements, rank {last} ended its step after 1 segment"),
    "int64 segments": (lambda: _lazy_step([10], np.int64, "max"), lambda: _lazy_step([12], np.int64, "max"),
                       "the number of elements in a fused segment (a different model, a parameter frozen or "
                       "set_absent() on some ranks only, another fusion threshold, or a step one rank left "
                       "half-pushed, an exception between its pushes, and went on with the next): rank {a} "
                       "passed 10, "
                       "rank {last} passed 12"),
    "CSC settings": (lambda: gflow.SparseAllreduce(density=0.1, chunk_elems=16)(np.ones(1000, np.float32)),
                     lambda: gflow.SparseAllreduce(density=0.1, chunk_elems=17)(np.ones(1000, np.float32)),
                     "the gradient or the CSC settings: rank {a} passed chunk_elems=16, rank {last} passed "
                     "chunk_elems=17"),
    "CSC shapes": (lambda: gflow.SparseAllreduce(density=0.1)(np.ones((50, 20), np.float32)),
                   lambda: gflow.SparseAllreduce(density=0.1)(np.ones(1000, np.float32)),  # (helper-74)
                   "the gradient or the CSC settings: rank {a} passed a gradient of 1000 float32 "
                   "elements (shape (50, 20)), rank {last} passed a gradient of 1000 float32 elements "
                   "(shape (1000,))"),
    "pushed names": (lambda: _lazy_step([4, 4], names=["a", "b"]),
                     lambda: _lazy_step([4, 4], names=["b", "a"]),
                     f"{_PUSHES_DIFFER}: rank {{a}} pushed a (4,) float32 as its push 1, "
                     "rank {last} pushed b (4,) float32"),
    "pushed shapes": (lambda: _lazy_step([7, (3, 4), 2000]), lambda: _lazy_step([7, (4, 3), 2000]),
                      f"{_PUSHES_DIFFER}: rank {{a}} pushed (3, 4) float32 as its push 2, "
                      "rank {last} pushed (4, 3) float32"),
    "rows": (lambda: gflow.reduce_scatter(np.ones((10, 2)), rows=True),
             lambda: gflow.reduce_scatter(np.ones((10, 2))),
             "rows=: rank {a} passed rows=True, rank {last} passed rows=False"),
    "flat shapes": (lambda: gflow.reduce_scatter(np.ones((5, 3))),
                    lambda: gflow.reduce_scatter(np.ones((3, 5))),
                    "the shape: rank {a} passed an array of shape (5, 3), rank {last} passed an array of "
                    "shape (3, 5)"),
    "settings": (lambda: gflow.allreduce(np.ones(64), algorithm="ring"), lambda: _segments_of(4096),
                 "gflow.config's settings for the algorithm: rank {a} has ring_segment_bytes=1048576, "
                 "rank {last} has ring_segment_bytes=4096"),
}  # fmt: skip


def _segments_of(nbytes):
    """A ring allreduce with gflow.config.ring_segment_bytes set to nbytes on this rank alone."""
    before, gflow.config.ring_segment_bytes = gflow.config.ring_segment_bytes, nbytes
    try:
        gflow.allreduce(np.ones(64), algorithm="ring")
    finally:
        gflow.config.ring_segment_bytes = before


def _lazy_step(sizes, dtype=np.float32, op="mean", names=None):
    """One LazyAllreduce step over tensors of these sizes or shapes (7 and 2000 float32s fill a
    segment), under these names."""
    lazy = gflow.LazyAllreduce(threshold_bytes=4096, op=op)
    for n, name in zip(sizes, names or [None] * len(sizes), strict=True):
        lazy.push(np.ones(n, dtype), name=name)
    lazy.flush()


@pytest.mark.parallel(MULTI)
def test_the_first_line_says_what_the_ranks_disagree_on():
    """One line first (what differs, with both ranks' values), the details after it."""
    last = WORLD.size - 1
    for case, (mine, theirs, expected) in FIRST_LINES.items():
        with pytest.raises(gflow.MismatchError) as info:
            (theirs if WORLD.rank == last else mine)()
        first, *details = str(info.value).split("\n")
        pattern = re.escape("ranks disagree on " + expected).replace(re.escape("{a}"), r"\d+")
        pattern = pattern.replace(re.escape("{last}"), str(last))
        assert re.match(pattern + "$", first), f"{case}: {info.value}"
        assert any(f"rank {last} called" in line for line in details), f"{case}: {info.value}"


@pytest.mark.parallel([3, 4])
def test_on_a_sub_communicator_the_first_line_gives_world_ranks_too():
    sub = WORLD.Split(0 if WORLD.rank >= 1 else MPI.UNDEFINED, WORLD.rank)
    if sub != MPI.COMM_NULL:
        with pytest.raises(gflow.MismatchError) as info:
            gflow.allreduce(np.ones(5 if sub.rank == 0 else 6), comm=sub)
        first = str(info.value).split("\n")[0]
        found = re.search(
            r"rank 0 \(world rank 1\) passed 5, rank (\d+) \(world rank (\d+)\) passed 6", first
        )
        assert found and int(found[2]) == int(found[1]) + 1, first
        with pytest.raises(gflow.MismatchError) as info:  # a root is shown with its world rank too
            gflow.broadcast(np.ones(3), root=0 if sub.rank == 0 else 1, comm=sub)
        assert "root=0 (world rank 1)" in str(info.value).split("\n")[0], str(info.value)
        assert "root=1 (world rank 2)" in str(info.value).split("\n")[0], str(info.value)
        sub.Free()


@pytest.mark.parallel(MULTI)
def test_messages_agree_on_every_rank():
    n = 10 + (WORLD.rank == WORLD.size - 1)
    with pytest.raises(gflow.MismatchError) as info:
        gflow.allreduce(np.ones(n))
    # What the ranks agree on reads alike everywhere; each rank then adds what it passed itself.
    shared, _, own = str(info.value).partition(".\nThis rank passed ")
    assert own == f"an array of shape ({n},)", str(info.value)
    messages = WORLD.allgather(shared)
    assert len(set(messages)) == 1, messages


@pytest.mark.parallel(MULTI)
@pytest.mark.parametrize("n", [10, 10**6])
def test_bad_input_on_one_rank_fails_every_rank(n):
    bad = WORLD.rank == WORLD.size - 1
    x = np.ones(n, np.complex64 if bad else np.float32)

    def check():
        if bad:
            raises_on_this_rank(TypeError, "unsupported dtype complex64", lambda: gflow.allreduce(x))
        else:
            raises_on_this_rank(
                gflow.MismatchError,
                f"rank {WORLD.size - 1} called allreduce with arguments it rejected",
                lambda: gflow.allreduce(x),
            )

    on_all_ranks(check)


def _lazy_push(x):
    lazy = gflow.LazyAllreduce(threshold_bytes=1 << 20)
    lazy.push(x)
    lazy.flush()


@pytest.mark.parallel(MULTI)
@pytest.mark.parametrize(
    "call",
    [gflow.allreduce, lambda x: gflow.allreduce_async(x).wait(), _lazy_push],
    ids=["blocking", "async", "lazy push"],
)
def test_the_peers_first_line_shows_the_rejecting_ranks_error(call):
    """The peers of a rank whose own checks failed read that rank's error in their first line."""
    last = WORLD.size - 1
    x = np.ones(8, np.complex64 if WORLD.rank == last else np.float32)

    def check():
        if WORLD.rank == last:
            raises_on_this_rank(TypeError, "unsupported dtype complex64", lambda: call(x))
            return
        with pytest.raises(gflow.MismatchError) as info:
            call(x)
        first = str(info.value).split("\n")[0]
        expected = f"rank {last} rejected its own arguments (TypeError: "
        assert "ranks disagree on the arguments" in first and expected in first, str(info.value)
        assert "unsupported dtype complex64" in first, str(info.value)

    on_all_ranks(check)
    on_all_ranks(lambda: assert_close_to_reference(gflow.allreduce(np.ones(8)), np.ones(8), "sum"))


@pytest.mark.parallel(MULTI)
def test_the_peers_of_a_data_parallel_push_that_failed_read_its_error():
    """DataParallel's own push checks: the peers read them too (they read "got _Rejected", the
    placeholder DataParallel pushed in place of the gradient, helper-44)."""
    last = WORLD.size - 1
    dp = gflow.DataParallel({"w": np.ones(8, np.float32)})
    grad = np.ones(8, np.float64 if WORLD.rank == last else np.float32)
    dp.push("w", grad)

    def check():
        if WORLD.rank == last:
            raises_on_this_rank(TypeError, "expected the parameter's shape", dp.synchronize)
            return
        with pytest.raises(gflow.MismatchError) as info:
            dp.synchronize()
        first = str(info.value).split("\n")[0]
        assert f"rank {last} rejected its own arguments (TypeError: DataParallel.push('w')" in first, first
        assert "got (8,) float64" in first and "_Rejected" not in str(info.value), str(info.value)

    on_all_ranks(check)
    dp.push("w", np.ones(8, np.float32))
    on_all_ranks(lambda: dp.synchronize())
    np.testing.assert_array_equal(dp.gradients()["w"], 1.0)


def test_an_mpi_without_thread_multiple_is_named_before_any_data_moves():
    """mpi4py started below MPI_THREAD_MULTIPLE (as an MPI built without thread support does): the
    background engine refuses at once, naming the library and the level; blocking calls still work."""
    import subprocess
    import sys

    script = (
        "import mpi4py\n"
        "mpi4py.rc.thread_level = 'serialized'\n"
        "import warnings, numpy as np, gflow\n"
        "warnings.simplefilter('ignore')\n"
        "print('blocking', gflow.allreduce(np.ones(4))[0])\n"
        "try:\n"
        "    gflow.allreduce_async(np.ones(4))\n"
        "except gflow.GflowError as exc:\n"
        "    print('refused:', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    from gflow.runtime.mpi import mpi_library

    assert "blocking 1.0" in done.stdout, done.stdout
    assert "refused:" in done.stdout and "MPI_THREAD_MULTIPLE" in done.stdout, done.stdout
    assert "MPI_THREAD_SERIALIZED" in done.stdout and mpi_library() in done.stdout, done.stdout
