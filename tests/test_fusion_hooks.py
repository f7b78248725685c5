"""Segment hooks (gflow/fusion/strategies.py): a user's reduction of each fused segment, through
LazyAllreduce.register_hook and DataParallel.register_hook, checked against MPI's own Allreduce; a
hook that fails or returns the wrong thing on one rank fails the step on every rank and loses
nothing; the examples' top-k hook trains the digits MLP within a point of dense."""

import os
import sys

import numpy as np
import pytest
from helpers import WORLD, mpi_allreduce, on_all_ranks, random_array, rank_rng
from mpi4py import MPI

import gflow

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


class Recorder:
    """A hook's state: what each call saw."""

    def __init__(self):
        self.seen = []


def allreduce_hook(state: Recorder, segment):
    """gflow's own allreduce, started in the background: what the built-in dense strategy does."""
    state.seen.append((segment.index, segment.op, list(segment.shapes), segment.buffer.size))
    return gflow.allreduce_async(segment.buffer, segment.op, comm=segment.comm)


def returning_hook(state: Recorder, segment):
    """The reduced segment returned as an array (MPI's own Allreduce, on the caller's thread)."""
    state.seen.append(segment.index)
    out = np.empty_like(segment.buffer)
    segment.comm.Allreduce(segment.buffer, out, MPI.SUM)
    return out


def push_all(target, tensors):
    for t in tensors:
        target.push(t)
    target.flush()


@pytest.mark.parallel([1, 2, 3, 4])
def test_a_hook_reduces_each_segment_as_mpi_does():
    rng = rank_rng(41)
    shapes = [(3, 5), (1000,), (7,), (40, 30), (0,), (250,)]
    for hook, op in [(allreduce_hook, "mean"), (returning_hook, "sum")]:
        lazy = gflow.LazyAllreduce(threshold_bytes=4000, op=op, comm=WORLD)
        state = Recorder()
        lazy.register_hook(state, hook)
        for step in range(2):
            tensors = [random_array(rng, shape, np.float64) for shape in shapes]
            expected = [mpi_allreduce(t) / (WORLD.size if op == "mean" else 1) for t in tensors]
            work = [t.copy() for t in tensors]
            on_all_ranks(lambda lazy=lazy, work=work: push_all(lazy, work), f"{hook.__name__} step {step}")
            for got, want in zip(work, expected, strict=True):
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        if hook is allreduce_hook:
            # Segments as the threshold cuts them (4000 bytes: 500 float64), the same every step.
            first = state.seen[: len(state.seen) // 2]
            assert first == state.seen[len(state.seen) // 2 :]
            assert [s[2] for s in first] == [[(3, 5), (1000,)], [(7,), (40, 30)], [(0,), (250,)]], first
            assert [s[0] for s in first] == [0, 1, 2] and {s[1] for s in first} == {op}
        else:
            assert state.seen == [0, 1, 2, 0, 1, 2], state.seen


@pytest.mark.parallel([2, 3, 4])
def test_a_hook_failing_on_one_rank_fails_the_step_everywhere_and_loses_nothing():
    bad = WORLD.size - 1

    def raising(state, segment):
        if WORLD.rank == bad and segment.index == 1:
            raise RuntimeError("the hook broke")
        return allreduce_hook(state, segment)

    def wrong_size(state, segment):
        if WORLD.rank == bad:
            return np.zeros(segment.buffer.size + 1, segment.buffer.dtype)
        return allreduce_hook(state, segment)  # (in the background: the bad rank's rejection meets it)

    for hook, error in [(raising, RuntimeError), (wrong_size, TypeError)]:
        lazy = gflow.LazyAllreduce(threshold_bytes=400, op="sum", comm=WORLD)
        lazy.register_hook(Recorder(), hook)
        tensors = [np.full(n, float(WORLD.rank + 1)) for n in (60, 60, 60)]

        def check(lazy=lazy, tensors=tensors, error=error):
            with pytest.raises(error if WORLD.rank == bad else gflow.MismatchError):
                push_all(lazy, tensors)
            for t in tensors:  # nothing written: each still holds this rank's own values
                np.testing.assert_array_equal(t, WORLD.rank + 1)

        on_all_ranks(check, hook.__name__)
        # The next step, with gflow's own reduction back, works on every rank.
        lazy.register_hook(None, None)
        again = [np.full(n, float(WORLD.rank + 1)) for n in (60, 60)]
        on_all_ranks(lambda lazy=lazy, again=again: push_all(lazy, again), f"after {hook.__name__}")
        for t in again:
            np.testing.assert_array_equal(t, WORLD.size * (WORLD.size + 1) / 2)


@pytest.mark.parallel([2, 3])
def test_ranks_with_and_without_a_hook_fail_the_step_on_every_rank():
    lazy = gflow.LazyAllreduce(threshold_bytes=10**6, op="sum", comm=WORLD)
    if WORLD.rank == 0:
        lazy.register_hook(Recorder(), allreduce_hook)
    tensors = [np.full(50, float(WORLD.rank + 1))]

    def check():
        with pytest.raises(gflow.MismatchError):
            push_all(lazy, tensors)
        np.testing.assert_array_equal(tensors[0], WORLD.rank + 1)

    on_all_ranks(check)


def test_register_hook_refuses_what_it_cannot_honour():
    with pytest.raises(TypeError, match="callable"):
        gflow.LazyAllreduce().register_hook(None, "not a function")
    for kwargs in ({"compression": "fp16"}, {"sparse": {"density": 0.1}}):
        with pytest.raises(ValueError, match="without compression= and sparse="):
            gflow.LazyAllreduce(**kwargs).register_hook(None, allreduce_hook)
    lazy = gflow.LazyAllreduce(threshold_bytes=10**6)
    lazy.push(np.ones(10))
    with pytest.raises(RuntimeError, match="in flight"):
        lazy.register_hook(None, allreduce_hook)
    lazy.flush()
    params = {"w": np.ones(10, np.float32)}
    dp = gflow.DataParallel(params)
    dp.push("w", np.ones(10, np.float32))
    with pytest.raises(RuntimeError, match="in flight"):
        dp.register_hook(None, allreduce_hook)


@pytest.mark.parallel(4)
@pytest.mark.timeout(240)
def test_the_top_k_hook_trains_the_digits_mlp_within_a_point_of_dense():
    """examples/topk_hook.py through examples/train_mlp.py (DataParallel.register_hook): top-k at 1%
    with error feedback ends within one point of dense, and its hook really ran and sparsified."""
    sys.path.insert(0, EXAMPLES)
    import topk_hook
    import train_mlp

    calls, sent = [], []
    plain = topk_hook.topk_hook

    def counted(state, segment):
        calls.append(segment.index)
        result = plain(state, segment)
        sent.append(np.count_nonzero(result) / result.size)
        return result

    dense = train_mlp.main(["--epochs", "30", "--device", "cpu"])
    topk_hook.topk_hook = counted
    try:
        topk = train_mlp.main(["--epochs", "30", "--device", "cpu", "--topk", "0.01"])
    finally:
        topk_hook.topk_hook = plain
    assert dense > 0.95, f"dense itself did not learn: {dense}"
    assert topk >= dense - 0.01, f"top-k ended at {topk:.3f}, dense at {dense:.3f}"
    assert calls, "the hook never ran"
    assert max(sent) <= 4 * 0.01 + 1e-9, f"more than 4 ranks x 1% was sent: {max(sent):.4f}"
