"""The ring's compiled loops (gflow/collectives/native.py): the same bits and the same messages as
ring.py's Python loop, against MPI's own Allreduce, on every dtype and op, with chunks shorter than
a segment, of many segments, and empty; ranks on different loops pair up; a visit that runs out of
polls resumes where it stopped; the engine thread's loop sleeps between polls and gets it right."""

import time

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
from gflow.arrays import host_ops
from gflow.collectives import native

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


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_same_bits_as_the_python_loop_and_mpis_answer(monkeypatch, dtype):
    for n in (0, 1, WORLD.size + 1, 1000, 40_001):
        for segment_bytes in (64, 4096, 2**20):  # many segments per chunk, a few, one
            for op in ("sum", "max", "min"):
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
    monkeypatch.setattr(native, "_drive", lambda ctx, step: drive(ctx, lambda: visits.append(1) or step()))
    x = random_array(rank_rng(9), 50_000, np.float32)
    if WORLD.rank == WORLD.size - 1:
        time.sleep(0.2)
    y = gflow.allreduce(x, algorithm="ring")
    on_all_ranks(lambda: assert_close_to_reference(y, x, "sum"))
    assert_same_on_all_ranks(y)
    phases = 2  # reduce-scatter and allgather
    assert len(visits) > phases or WORLD.rank == WORLD.size - 1, len(visits)


@pytest.mark.parallel(MULTI)
def test_the_engine_threads_loop(monkeypatch):
    monkeypatch.setattr(gflow.config, "ring_segment_bytes", 8192)
    x = random_array(rank_rng(4), 100_003, np.float32)
    handles = [gflow.allreduce_async(x, algorithm="ring") for _ in range(3)]
    for handle in handles:
        y = handle.wait()
        on_all_ranks(lambda: assert_close_to_reference(y, x, "sum"))  # noqa: B023
        assert_same_on_all_ranks(y)
