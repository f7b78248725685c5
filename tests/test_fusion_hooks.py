"""Segment hooks (gflow/fusion/strategies.py): a user's reduction of each fused segment, through
LazyAllreduce.register_hook and DataParallel.register_hook, checked against MPI's own Allreduce; a
hook that fails, returns the wrong thing or meets inf on one rank, a bad push, or a rank without the
hook, fails the step on every rank within seconds and loses nothing; under loss scaling the hook sees
unscaled gradients and a skipped step leaves its state as it was; the examples' top-k hook trains the
digits MLP within a point of dense."""

import os
import sys

import numpy as np
import pytest
from helpers import WORLD, mpi_allreduce, on_all_ranks, random_array, rank_rng

import gflow

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)
import topk_hook  # noqa: E402


class Recorder:
    """A hook's state: what each call saw, and what gflow told it."""

    def __init__(self):
        self.seen, self.told = [], []

    def commit(self):
        self.told.append("commit")

    def discard(self):
        self.told.append("discard")


def allreduce_hook(state: Recorder, segment):
    """gflow's own allreduce, as the built-in dense strategy does it."""
    state.seen.append((segment.index, segment.op, list(segment.shapes), segment.buffer.size))
    return segment.allreduce(segment.buffer, segment.op)


def allgather_hook(state: Recorder, segment):
    """The sum from an allgather of every rank's segment (another collective, summed here)."""
    state.seen.append(segment.index)
    rows = segment.allgather(segment.buffer.reshape(1, -1))
    return rows.sum(axis=0) / (segment.size if segment.op == "mean" else 1)


def push_all(target, tensors):
    for t in tensors:
        target.push(t)
    target.flush()


@pytest.mark.parallel([1, 2, 3, 4])
def test_a_hook_reduces_each_segment_as_mpi_does():
    rng = rank_rng(41)
    shapes = [(3, 5), (1000,), (7,), (40, 30), (0,), (250,)]
    for hook, op in [(allreduce_hook, "mean"), (allgather_hook, "sum")]:
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
        assert state.told == ["commit"] * 6, state.told  # once per segment, per successful step
        if hook is allreduce_hook:
            # Segments as the threshold cuts them (4000 bytes: 500 float64), the same every step.
            first = state.seen[: len(state.seen) // 2]
            assert first == state.seen[len(state.seen) // 2 :]
            assert [s[2] for s in first] == [[(3, 5), (1000,)], [(7,), (40, 30)], [(0,), (250,)]], first
            assert [s[0] for s in first] == [0, 1, 2] and {s[1] for s in first} == {op}
        else:
            assert state.seen == [0, 1, 2, 0, 1, 2], state.seen


@pytest.mark.parallel([1, 3])
def test_the_first_segment_of_each_step_fires_at_first_segment_bytes():
    """DDP's first bucket: the step's first segment is cut at first_segment_bytes, the rest at the
    threshold, every step alike; the results are MPI's."""
    rng = rank_rng(42)
    shapes = [(10,), (200,), (30,), (300,), (400,), (5,)]  # float64: 80, 1600, 240, 2400, 3200, 40 bytes
    lazy = gflow.LazyAllreduce(threshold_bytes=4000, op="sum", comm=WORLD, first_segment_bytes=1000)
    state = Recorder()
    lazy.register_hook(state, allreduce_hook)
    for step in range(2):
        tensors = [random_array(rng, shape, np.float64) for shape in shapes]
        expected = [mpi_allreduce(t) for t in tensors]
        on_all_ranks(lambda: push_all(lazy, tensors), f"step {step}")  # noqa: B023 - called at once
        for got, want in zip(tensors, expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    cut = [s[2] for s in state.seen]
    assert cut == [[(10,), (200,)], [(30,), (300,), (400,)], [(5,)]] * 2, cut
    with pytest.raises(ValueError, match="first_segment_bytes"):
        gflow.LazyAllreduce(first_segment_bytes=0)


def hook_failing(how: str):
    """A hook that goes wrong on the last rank in segment 1, in the way `how` says."""

    def hook(state, segment):
        bad = segment.rank == segment.size - 1 and segment.index == 1
        if bad and how == "raise":
            raise RuntimeError("the hook broke")
        if bad and how == "wrong size":
            return np.zeros(segment.buffer.size + 1, segment.buffer.dtype)
        if bad and how == "wrong dtype":
            return segment.buffer.astype(np.float32)
        if how == "raise midway":  # after its first collective, before its second
            first = segment.allgather(segment.buffer.reshape(1, -1))
            if bad:
                raise RuntimeError("the hook broke midway")
            segment.allgather(first[:1])
        result = allgather_hook(state, segment)
        if bad and how == "inf":
            result[0] = np.inf
        if bad and how == "own inf check":  # (its collectives made: it raises itself, on one rank;
            raise gflow.NonFiniteError("the hook's own check")  # the peers waited: helper-46)
        return result

    return hook


CASES = {
    "raise": RuntimeError,
    "wrong size": TypeError,
    "wrong dtype": TypeError,
    "raise midway": RuntimeError,
    "inf": gflow.NonFiniteError,
    "own inf check": gflow.NonFiniteError,
}


@pytest.mark.parallel([2, 3])
@pytest.mark.timeout(120)
def test_a_hook_going_wrong_on_one_rank_fails_the_step_everywhere_and_loses_nothing():
    bad = WORLD.rank == WORLD.size - 1
    for how, error in CASES.items():
        lazy = gflow.LazyAllreduce(threshold_bytes=400, op="sum", comm=WORLD)
        state = Recorder()
        lazy.register_hook(state, hook_failing(how))
        tensors = [np.full(n, float(WORLD.rank + 1)) for n in (60, 60, 60)]
        everywhere = gflow.NonFiniteError if "inf" in how else gflow.MismatchError

        def check(lazy=lazy, tensors=tensors, error=error, everywhere=everywhere):
            with pytest.raises(error if bad else everywhere):
                push_all(lazy, tensors)
            for t in tensors:  # nothing written: each still holds this rank's own values
                np.testing.assert_array_equal(t, WORLD.rank + 1)

        on_all_ranks(check, how)
        assert "commit" not in state.told and "discard" in state.told, (how, state.told)
        # A retry of the same step with a hook that works: every rank gets the sum.
        lazy.register_hook(state, allgather_hook)
        on_all_ranks(lambda lazy=lazy, tensors=tensors: push_all(lazy, tensors), f"retry after {how}")
        for t in tensors:
            np.testing.assert_array_equal(t, WORLD.size * (WORLD.size + 1) / 2)


@pytest.mark.parallel([2, 3])
@pytest.mark.timeout(120)
def test_a_bad_push_or_a_rank_without_the_hook_fails_the_step_on_every_rank():
    tensors = [np.full(n, float(WORLD.rank + 1)) for n in (60, 60, 60)]
    # One rank pushes a read-only gradient: its own ValueError there, MismatchError elsewhere.
    lazy = gflow.LazyAllreduce(threshold_bytes=400, op="sum", comm=WORLD)
    lazy.register_hook(Recorder(), allgather_hook)
    pushed = [t.copy() for t in tensors]
    if WORLD.rank == 0:
        pushed[1].flags.writeable = False

    def bad_push():
        with pytest.raises(ValueError if WORLD.rank == 0 else gflow.MismatchError):
            push_all(lazy, pushed)

    on_all_ranks(bad_push, "read-only push")
    # Only rank 0 runs the hook (the top-k one), the others gflow's own reduction.
    lazy = gflow.LazyAllreduce(threshold_bytes=400, op="sum", comm=WORLD)
    if WORLD.rank == 0:
        lazy.register_hook(topk_hook.TopK(0.1), topk_hook.topk_hook)

    def partial():
        with pytest.raises(gflow.MismatchError):
            push_all(lazy, [t.copy() for t in tensors])

    on_all_ranks(partial, "hook on rank 0 only")


@pytest.mark.parallel([2, 3])
@pytest.mark.timeout(120)
def test_under_loss_scaling_the_hook_sees_unscaled_gradients_and_a_skipped_step_keeps_its_state():
    params = {"w": np.zeros(64, np.float32), "b": np.zeros(8, np.float32)}
    scaler = gflow.LossScaler(init_scale=1024.0, growth_interval=1000)
    dp = gflow.DataParallel(params, loss_scaler=scaler, threshold_bytes=1)
    state = topk_hook.TopK(0.25)
    seen = []

    def hook(state, segment):
        seen.append(float(np.max(np.abs(segment.buffer))))
        return topk_hook.topk_hook(state, segment)

    dp.register_hook(state, hook)
    grads = dp.gradient_buffers()
    rng = rank_rng(7)
    applied = {k: np.zeros(v.shape) for k, v in params.items()}  # the averaged updates applied
    true_sum = {k: np.zeros(v.shape) for k, v in params.items()}  # this rank's applied true gradients
    for step in range(6):
        true = {k: rng.uniform(0.5, 1.0, v.shape).astype(np.float32) for k, v in params.items()}
        overflow_here = step == 3 and WORLD.rank == 0
        for k in ("b", "w"):  # backward, last layer first: the loss-scaled gradients
            grads[k][...] = true[k] * np.float32(dp.loss_scale)
            if overflow_here:
                grads[k][0] = np.inf
            dp.push(k)
        before = {i: r.copy() for i, r in state.residuals.items()}
        seen.clear()
        applied_now = []
        on_all_ranks(lambda out=applied_now: out.append(dp.synchronize()), f"step {step}")
        apply = applied_now[0]
        if step == 3:
            assert apply is False  # skipped on every rank
            assert state.residuals.keys() == before.keys()
            for i, r in state.residuals.items():  # the skipped step changed no residual
                np.testing.assert_array_equal(r, before[i])
        else:
            assert apply is True
            assert max(seen) <= 1.0 + 1e-6, seen  # unscaled on their way in
            for k in params:
                applied[k] += grads[k]
                true_sum[k] += true[k]
    # Nothing lost: what every rank sent (p times the averaged updates) plus what each still owes is
    # the sum over the ranks of the true gradients of the applied steps, within float32 rounding.
    # (One segment per gradient at threshold_bytes=1, in push order: b is segment 0, w segment 1.)
    owed = {"b": state.residuals[0], "w": state.residuals[1]}
    for k in params:
        sent_and_owed = WORLD.size * applied[k] + mpi_allreduce(owed[k].astype(np.float64))
        np.testing.assert_allclose(sent_and_owed, mpi_allreduce(true_sum[k]), rtol=1e-5, atol=1e-5)


def test_register_hook_refuses_what_it_cannot_honour():
    with pytest.raises(TypeError, match="callable"):
        gflow.LazyAllreduce().register_hook(None, "not a function")
    for kwargs in ({"compression": "fp16"}, {"sparse": {"density": 0.1}}):
        with pytest.raises(ValueError, match="without compression= and sparse="):
            gflow.LazyAllreduce(**kwargs).register_hook(None, allreduce_hook)
    with pytest.raises(ValueError, match="threshold in bytes"):
        gflow.LazyAllreduce("auto").register_hook(None, allreduce_hook)
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
