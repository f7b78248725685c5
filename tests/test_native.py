"""The ring's compiled loops (gflow/collectives/native.py): the same bits and the same messages as
ring.py's Python loop, against MPI's own Allreduce, on every dtype and op, with chunks shorter than
a segment, of many segments, and empty; ranks on different loops pair up; a visit that runs out of
polls resumes where it stopped; the engine thread's loop sleeps between polls and gets it right."""

import time
from types import SimpleNamespace

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
from mpi4py import MPI

import gflow
from gflow.arrays import host_ops
from gflow.collectives import native
from gflow.collectives.recursive_doubling import SEPARATE_PAYLOAD_BYTES
from gflow.runtime import stall
from gflow.runtime.context import context, rd_schedule

SIZES = [1, 2, 3, 4]
MULTI = [2, 3, 4]
DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64, ml_dtypes.bfloat16]


def both_loops(monkeypatch, x, op, segment_bytes):
    """(compiled, Python) results of a ring allreduce of x."""
    monkeypatch.setattr(gflow.config, "ring_segment_bytes", segment_bytes)
    results = []
    for on in (True, False):
        monkeypatch.setattr(gflow.config, "native", on)
        out = np.full(x.shape, 7, x.dtype)  # poisoned: every element must be written
        results.append(gflow.allreduce(x, op, out=out, algorithm="ring"))
    return results


def test_the_compiled_loops_are_there():
    assert native.usable(host_ops), "the MPI entry points could not be bound: the ring runs in Python"


@pytest.mark.parallel([2, 3])
def test_collectives_compile_nothing_that_gflow_compile_leaves_out():
    """`gflow compile` compiles precompile.signatures() ahead of a job; a collective that needs
    another (a new argument, a layout) would compile it on every rank at a job's start again. Every
    path's loops and kernels (latency, the slots, the ring; read-only inputs, mean, fp16 and bf16
    compression, the engine thread), and whatever this process's earlier tests compiled."""
    from gflow.tools import precompile

    comm = WORLD.Dup()
    for dtype in DTYPES:
        for n in (3, 3_000, 300_000):
            x = random_array(rank_rng(n), n, np.float32).astype(dtype)
            for read_only in (False, True):
                x.setflags(write=not read_only)
                for op in ("sum", "mean") if np.dtype(dtype).kind != "i" else ("sum", "max"):
                    y = gflow.allreduce(x, op, comm=comm)
                    on_all_ranks(lambda: np.testing.assert_equal(y.shape, x.shape))  # noqa: B023
                gflow.allreduce_async(x, comm=comm).wait()
        if np.dtype(dtype).itemsize > 2 and np.dtype(dtype).kind == "f":
            for compression in ("fp16", "bf16"):
                x = random_array(rank_rng(1), 300_000, dtype)
                for read_only in (False, True):
                    x.setflags(write=not read_only)
                    gflow.allreduce(x, compression=compression, comm=comm)
    comm.Free()
    planned = precompile.signatures()
    unplanned = [
        (dispatcher.py_func.__name__, types)
        for dispatcher in {d for d, _ in planned}
        for types in dispatcher.signatures
        if (dispatcher, types) not in planned
    ]
    assert not unplanned, unplanned


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_same_bits_as_the_python_loop_and_mpis_answer(monkeypatch, dtype):
    for n in (0, 1, WORLD.size + 1, 40_001):
        for segment_bytes in (64, 2**20):  # many segments per chunk, one
            for op in ("sum", "max", "min", "mean") if np.dtype(dtype).kind != "i" else ("sum", "max", "min"):
                x = random_array(rank_rng(n), n, np.float32).astype(dtype)
                compiled, python = both_loops(monkeypatch, x, op, segment_bytes)
                label = f"n={n} segment={segment_bytes} {op}"
                assert compiled.tobytes() == python.tobytes(), label
                assert_same_on_all_ranks(compiled)
                if np.dtype(dtype) != ml_dtypes.bfloat16:  # (no MPI bfloat16: test_bfloat16.py)
                    on_all_ranks(lambda: assert_close_to_reference(compiled, x, op), label)  # noqa: B023


@pytest.mark.parallel(MULTI)
def test_ranks_on_different_loops_pair_up(monkeypatch):
    # One rank on the Python loop (a timeline on, say), the others compiled: the messages match.
    monkeypatch.setattr(gflow.config, "native", WORLD.rank != 0)
    monkeypatch.setattr(gflow.config, "ring_segment_bytes", 1000)
    for n in (5, 12_345, 300_000):
        x = random_array(rank_rng(n), n, np.float64)
        y = gflow.allreduce(x, algorithm="ring")
        on_all_ranks(lambda: assert_close_to_reference(y, x, "sum"), f"n={n}")  # noqa: B023
        assert_same_on_all_ranks(y)


@pytest.mark.parallel(MULTI)
def test_a_visit_out_of_polls_resumes_where_it_stopped(monkeypatch):
    # One poll per visit, and a late rank: every wait returns to Python many times mid-phase.
    monkeypatch.setattr(native, "POLLS_PER_VISIT", 1)
    monkeypatch.setattr(gflow.config, "ring_segment_bytes", 4096)
    visits = []
    drive = native._drive

    def counted(ctx, loop, args):
        def visit(*args):
            visits.append(loop)
            return loop(*args)

        visit.compile = loop.compile  # (the wrapper is compiled as the loop it wraps)
        return drive(ctx, visit, args)

    monkeypatch.setattr(native, "_drive", counted)
    x = random_array(rank_rng(9), 50_000, np.float32)
    if WORLD.rank == WORLD.size - 1:
        time.sleep(0.2)
    y = gflow.allreduce(x, algorithm="ring")
    on_all_ranks(lambda: assert_close_to_reference(y, x, "sum"))
    assert_same_on_all_ranks(y)
    assert set(visits) == {native._compiled.allreduce}  # both phases in one compiled call
    assert len(visits) > 1 or WORLD.rank == WORLD.size - 1, len(visits)


@pytest.mark.parallel(MULTI)
def test_the_engine_threads_loop(monkeypatch):
    monkeypatch.setattr(gflow.config, "ring_segment_bytes", 8192)
    x = random_array(rank_rng(4), 100_003, np.float32)
    handles = [gflow.allreduce_async(x, algorithm="ring") for _ in range(3)]
    for handle in handles:
        y = handle.wait()
        on_all_ranks(lambda: assert_close_to_reference(y, x, "sum"))  # noqa: B023
        assert_same_on_all_ranks(y)


@pytest.mark.parallel([2])
def test_a_first_compile_is_not_taken_for_a_slow_peer(monkeypatch, capsys):
    # A cold Numba cache compiles for seconds on every rank at once: that is no peer's fault, so the
    # stall inspector (warning after 0.3 s here) must not see it as a wait.
    monkeypatch.setattr(gflow.config, "stall_warning_s", 0.3)
    monkeypatch.setattr(native, "_ready", set())
    loop = native._compiled.allreduce  # (what a ring allreduce runs)
    real = loop.compile
    monkeypatch.setattr(loop, "compile", lambda sig: (time.sleep(1.0), real(sig))[1])
    x = random_array(rank_rng(2), 1000, np.float32)
    y = gflow.allreduce(x, algorithm="ring")
    on_all_ranks(lambda: assert_close_to_reference(y, x, "sum"))
    err = capsys.readouterr().err
    assert "waited" not in err, err


def test_a_sleeping_loop_visits_python_within_milliseconds(monkeypatch):
    # The engine thread sleeps from background_poll_us between polls, longer as a wait lasts: however
    # long that is, a visit (and so the check for departed ranks) comes within SLEEPING_VISIT_S plus
    # one pause, which is at most SLEEPING_VISIT_S unless background_poll_us alone is longer.
    assert native.usable(host_ops)  # (Phases reads the compiled loops' layout)
    from gflow.collectives import native_loops

    engine = SimpleNamespace(is_background=True, size=2, rank=0, comm=WORLD)
    visit_us = native.SLEEPING_VISIT_S * 1e6
    for pause_us in (1, 20, 1000, 20_000):
        monkeypatch.setattr(gflow.config, "background_poll_us", pause_us)
        ints = native.Phases(engine).start(0, [0, 1, 2])
        budget_us, sleep_us = ints[10], ints[11]
        assert sleep_us == pause_us and budget_us == visit_us
        longest = native_loops.longest_pause(sleep_us, budget_us)
        assert sleep_us <= longest <= max(visit_us, sleep_us), (pause_us, longest)
        assert longest == min(native_loops.BACKOFF * sleep_us, max(visit_us, sleep_us)), (pause_us, longest)
    caller = SimpleNamespace(is_background=False, size=2, rank=0, comm=WORLD)
    ints = native.Phases(caller).start(0, [0, 1, 2])
    assert ints[10] == native.POLLS_PER_VISIT and ints[11] == 0  # (yields: no sleep)


def test_an_mpi_error_in_a_compiled_step_is_named():
    class FailingLoop:  # what a compiled phase returns when MPI_Testall fails: -(the error code)
        def compile(self, signature):
            pass

        def __call__(self, *args):
            return -MPI.ERR_IN_STATUS

    with pytest.raises(
        gflow.GflowError, match=r"MPI failed in a ring step on rank \d+, exchanging with ranks"
    ):
        native._drive(context(), FailingLoop(), (np.zeros(1),))
    assert stall.mark().since is None  # the wait is over


# Recursive doubling's steps compiled (native_loops.recursive_doubling): the latency path and the
# agreement before a ring, from a plan's second use, on ranks whose plan has two steps or more.


def compiled_here() -> bool:
    """Whether this rank's recursive-doubling plans run compiled (two steps or more: p >= 3 but for
    the ranks that hand their data to a partner, or that only exchange once)."""
    fold, rounds = rd_schedule(WORLD.rank, WORLD.size)
    steps = 1 if fold is not None and fold[0] == "send" else len(rounds) + (2 if fold is not None else 0)
    return steps >= 2


def mpi_messages(monkeypatch):
    """A communicator whose exchanges are MPI's messages (as across hosts), not shared memory's slots
    (collectives/shared_slots.py: every rank of one host, which replace recursive doubling's steps)."""
    monkeypatch.setattr(gflow.config, "shared_slots", False)
    return WORLD.Dup()


def spy_on_compiled_steps(monkeypatch) -> list:
    """The (step, status) of every compiled recursive-doubling run in this process from now on."""
    runs, real = [], native.recursive_doubling

    def spied(*args):
        runs.append(real(*args))
        return runs[-1]

    monkeypatch.setattr(native, "recursive_doubling", spied)
    return runs


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_recursive_doubling_gives_the_python_loops_bits(monkeypatch, dtype):
    comm = mpi_messages(monkeypatch)
    runs = spy_on_compiled_steps(monkeypatch)
    for n in (1, 7, 1000):
        for op in ("sum", "max", "min", "mean") if np.dtype(dtype).kind != "i" else ("sum", "max", "min"):
            x = random_array(rank_rng(n), n, np.float32).astype(dtype)
            results = []
            for on in (True, False):
                monkeypatch.setattr(gflow.config, "native", on)
                for out in (None, "given"):  # the fast lane's own result, and the caller's array
                    for _ in range(3):  # (a plan runs compiled from its second use)
                        poisoned = None if out is None else np.full(x.shape, 7, x.dtype)
                        y = gflow.allreduce(x, op, out=poisoned, comm=comm)
                    results.append(y.tobytes())
            label = f"n={n} {op}"
            assert results[0] == results[1] == results[2] == results[3], label
            assert_same_on_all_ranks(y)
            if np.dtype(dtype) != ml_dtypes.bfloat16:  # (no MPI bfloat16: test_bfloat16.py)
                on_all_ranks(lambda: assert_close_to_reference(y, x, op), label)  # noqa: B023
    # every compiled run went through all its steps: no header differed
    assert bool(runs) == compiled_here(), runs
    assert all(status == 0 for _, status in runs), runs


@pytest.mark.parallel(MULTI)
def test_the_agreement_before_a_ring_runs_compiled(monkeypatch):
    comm = mpi_messages(monkeypatch)
    runs = spy_on_compiled_steps(monkeypatch)
    x = random_array(rank_rng(5), 300_001, np.float32)  # (above the latency path: agreement, then ring)
    for _ in range(3):
        y = gflow.allreduce(x, algorithm="ring", comm=comm)
    on_all_ranks(lambda: assert_close_to_reference(y, x, "sum"))
    assert_same_on_all_ranks(y)
    assert len(runs) == (2 if compiled_here() else 0) and all(status == 0 for _, status in runs), runs


@pytest.mark.parallel(MULTI)
def test_a_header_not_this_ranks_is_handed_to_python(monkeypatch):
    # Warm plans on every rank, then one rank passes another length: the compiled loop meets a header
    # that is not its own, hands the step to Python, and every rank raises.
    comm = mpi_messages(monkeypatch)
    runs = spy_on_compiled_steps(monkeypatch)
    for theirs in (11, SEPARATE_PAYLOAD_BYTES // 8 + 5):  # (the latter: a payload sent apart)
        mine = np.ones(10)
        for _ in range(2):
            gflow.allreduce(mine, comm=comm)
            gflow.allreduce(np.ones(theirs), comm=comm)
        x = np.ones(theirs) if WORLD.rank == 0 else mine
        for _ in range(2):
            with pytest.raises(gflow.MismatchError, match="ranks disagree"):
                gflow.allreduce(x, comm=comm)
        y = random_array(rank_rng(3), 9, np.float64)  # nothing left in flight
        on_all_ranks(lambda: assert_close_to_reference(gflow.allreduce(y, comm=comm), y, "sum"))  # noqa: B023
    asked = [step for step, status in runs if status == native.ASK_PYTHON]
    assert asked or WORLD.rank == 0 or not compiled_here(), runs  # (rank 0's long one: sent apart)


@pytest.mark.parallel([3, 4])
def test_compiled_recursive_doubling_resumes_after_a_visit(monkeypatch):
    # One poll per visit and a late rank: the waits return to Python many times between steps.
    comm = mpi_messages(monkeypatch)
    monkeypatch.setattr(native, "POLLS_PER_VISIT", 1)
    visits = []
    visit = native._visit

    def counted(loop, args):
        def once(*args):
            visits.append(loop)
            return loop(*args)

        return visit(once, args)

    x = random_array(rank_rng(8), 100, np.float32)
    gflow.allreduce(x, comm=comm)
    monkeypatch.setattr(native, "_visit", counted)
    for late in range(WORLD.size):
        if WORLD.rank == late:
            time.sleep(0.1)
        y = gflow.allreduce(x, comm=comm)
        on_all_ranks(lambda: assert_close_to_reference(y, x, "sum"))  # noqa: B023
        assert_same_on_all_ranks(y)
    assert len(visits) > WORLD.size or not compiled_here(), len(visits)


@pytest.mark.parallel([4])  # (every rank's plan has two steps: compiled)
@pytest.mark.parametrize("error", ["truncated", "other"])
def test_an_mpi_error_in_compiled_recursive_doubling(monkeypatch, error):
    # What the compiled loop returns when a step's MPI call fails, before anything moved (the loop is
    # replaced): a receive that did not fit is a message from another protocol, on every rank; any
    # other error names the peer.
    code = MPI.ERR_TRUNCATE if error == "truncated" else MPI.ERR_OTHER
    comm = mpi_messages(monkeypatch)
    x = random_array(rank_rng(6), 10, np.float64)
    gflow.allreduce(x, comm=comm)
    monkeypatch.setattr(native, "recursive_doubling", lambda *args: (0, -code))
    if error == "truncated":
        with pytest.raises(gflow.MismatchError, match="a message this protocol does not accept"):
            gflow.allreduce(x, comm=comm)
    else:
        with pytest.raises(gflow.GflowError, match=f"agreement exchange with rank {WORLD.rank ^ 1}"):
            gflow.allreduce(x, comm=comm)
    monkeypatch.undo()
    if error == "truncated":  # nothing was left in flight
        on_all_ranks(lambda: assert_close_to_reference(gflow.allreduce(x, comm=comm), x, "sum"))
