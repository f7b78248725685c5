"""LazyAllreduce(threshold_bytes="auto"): tuning keeps every step correct, every rank settles on the
same threshold, failed steps and retune() keep the ranks in step, checkpoints carry the choice and,
mid-tuning, the whole position."""

import hashlib
import io
import math
import pickle
from functools import partial

import numpy as np
import pytest
from helpers import WORLD, assert_close_to_reference, on_all_ranks, random_array, rank_rng
from mpi4py import MPI

import gflow
from gflow.fusion import autotune

SIZES = [1, 2, 3, 4]
LAST = WORLD.size - 1
# About 2.4 MB of float32: the candidates from 256 KiB to 4 MiB (5 of them).
SHAPES = [(1000,), (300, 200), (50_000,), (7,), (400_000,), (1200, 100), (3, 5)]
STEP_BYTES = 4 * sum(int(np.prod(s)) for s in SHAPES)
CANDIDATES = [c for c in autotune.CANDIDATES if c < STEP_BYTES]
CANDIDATES += [next(c for c in autotune.CANDIDATES if c >= STEP_BYTES)]
(_, FIRST), (FINALISTS, SECOND) = autotune.ROUNDS
FIRST_ROUND = len(CANDIDATES) * (autotune.WARMUP_STEPS + FIRST)  # then the step that agrees
TUNING_STEPS = FIRST_ROUND + 1 + FINALISTS * (autotune.WARMUP_STEPS + SECOND) + 1
# About 2.7 MB of float32 on both sides of small_message_bytes (128 KiB) and of the shared-memory
# crossover (256 KiB): as the threshold changes, a tensor moves between segments that take recursive
# doubling, the ring or (p >= 3) the node phase, and at p = 4 its bits depend on which.
STRADDLING = [(1000,), (300, 200), (30_000,), (7,), (400_000,), (40_000,), (1200, 100), (25_000,), (3, 5)]


def expect(exc_type, fn, match=None):
    with pytest.raises(exc_type, match=match) as info:
        fn()
    return info.value


def checked_step(lazy, grads, rng, label=""):
    """Random gradients into `grads`, one push each, flush; every result against MPI float64."""
    inputs = [random_array(rng, g.shape, g.dtype) for g in grads]
    for g, x in zip(grads, inputs, strict=True):
        g[...] = x
    for g in grads:
        lazy.push(g)
    on_all_ranks(lazy.flush, label)
    for g, x in zip(grads, inputs, strict=True):
        on_all_ranks(lambda g=g, x=x: assert_close_to_reference(g, x, "sum"), label)


def older(state, **changes):
    """A LazyAllreduce state as gflow saved it before the tuner's position (tuned_threshold_bytes alone)."""
    return {key: value for key, value in dict(state, **changes).items() if key != "tuner"}


def tune(lazy, grads, rng, limit=100) -> int:
    """Checked steps until the threshold settles; how many it took."""
    steps = 0
    while lazy.tuning:
        assert steps < limit, f"still tuning after {limit} steps"
        checked_step(lazy, grads, rng, f"tuning step {steps}")
        steps += 1
    return steps


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("pool", [False, True])
def test_auto_settles_on_the_same_threshold_everywhere_and_every_step_is_right(pool, capsys):
    rng = rank_rng(80)
    lazy = gflow.LazyAllreduce("auto", op="sum")
    assert lazy.tuning and lazy.threshold_bytes == autotune.CANDIDATES[0]
    if pool:
        grads = lazy.gradient_buffers(SHAPES)
        runs = []  # every segment must find its gradients side by side in the pool, at every threshold
        original = lazy._pool.run
        lazy._pool.run = lambda pushed: runs.append(original(pushed)) or runs[-1]
    else:
        grads = [random_array(rng, s, np.float32) for s in SHAPES]
    thresholds = []
    steps = 0
    while lazy.tuning:
        thresholds.append(lazy.threshold_bytes)
        checked_step(lazy, grads, rng, f"tuning step {steps}")
        steps += 1
        assert steps <= 60
    settled = lazy.threshold_bytes
    agreed = WORLD.allgather((settled, lazy.tuning_results))
    assert all(a == agreed[0] for a in agreed), agreed
    if WORLD.size == 1:  # alone, nothing is fused: one step shows it, and it settles at once
        assert steps == 1 and settled == autotune.CANDIDATES[0] and lazy.tuning_results is None
    else:
        # every candidate up to the first holding the whole step, each for its warm-up and measured
        # steps, in order; the step that agrees; the same for the finalists; the step that agrees
        assert steps == TUNING_STEPS
        each = autotune.WARMUP_STEPS + FIRST
        assert thresholds[: FIRST_ROUND + 1] == [c for c in CANDIDATES for _ in range(each)] + [
            CANDIDATES[-1]
        ]
        second = thresholds[FIRST_ROUND + 1 :]
        finalists = sorted(set(second))
        each = autotune.WARMUP_STEPS + SECOND
        assert len(finalists) == FINALISTS and set(finalists) <= set(CANDIDATES)
        assert second == [c for c in finalists for _ in range(each)] + [finalists[-1]]
        results = lazy.tuning_results
        assert sorted(results) == CANDIDATES and all(t > 0 for t in results.values())
        assert settled == min(finalists, key=results.get)
    for k in range(3):  # settled: the threshold stays, the steps stay right
        checked_step(lazy, grads, rng, f"settled step {k}")
        assert lazy.threshold_bytes == settled and not lazy.tuning
    if pool and WORLD.size > 1:
        assert runs and all(r is not None for r in runs)
    logged = capsys.readouterr().err
    lines = [line for line in logged.splitlines() if "threshold_bytes='auto'" in line]
    assert len(lines) == (1 if WORLD.rank == 0 else 0), logged
    if WORLD.rank == 0:
        assert "settled on" in lines[0]


@pytest.mark.parallel([2, 3])
def test_a_failed_step_is_not_timed_and_the_ranks_stay_in_step():
    # A bad push on the last rank, once in a measured step and once in the step that agrees: every
    # rank's flush raises, the schedule does not move, and tuning goes on to the same end everywhere.
    rng = rank_rng(81)
    lazy = gflow.LazyAllreduce("auto", op="sum")
    grads = [random_array(rng, s, np.float32) for s in SHAPES]
    fail_at = {2, FIRST_ROUND, TUNING_STEPS - 1}  # (the others: the steps that agree)
    steps = failures = 0
    while lazy.tuning:
        if steps in fail_at:
            fail_at.discard(steps)
            before = (lazy.threshold_bytes, lazy._tuner.index, lazy._tuner.steps_here)
            kept = [g.copy() for g in grads]
            for i, g in enumerate(grads):
                lazy.push(g.astype(np.uint8) if (WORLD.rank == LAST and i == 3) else g)
            error = gflow.MismatchError if WORLD.rank != LAST else TypeError
            on_all_ranks(lambda error=error: expect(error, lazy.flush), f"failed step {steps}")
            for g, k in zip(grads, kept, strict=True):
                np.testing.assert_array_equal(g, k)
            assert (lazy.threshold_bytes, lazy._tuner.index, lazy._tuner.steps_here) == before
            failures += 1
            continue
        checked_step(lazy, grads, rng, f"step {steps}")
        steps += 1
        assert steps <= 60
    assert failures == 3
    assert steps == TUNING_STEPS
    agreed = WORLD.allgather(lazy.threshold_bytes)
    assert agreed == [agreed[0]] * WORLD.size


@pytest.mark.parallel([1, 2, 3])
def test_retune_tunes_again_and_one_rank_alone_fails_every_rank():
    rng = rank_rng(82)
    lazy = gflow.LazyAllreduce("auto", op="sum")
    grads = [random_array(rng, s, np.float32) for s in SHAPES]
    first = tune(lazy, grads, rng)
    lazy.push(grads[0])
    expect(RuntimeError, lazy.retune, "in flight")  # between steps only
    on_all_ranks(lazy.flush)
    lazy.retune()
    assert lazy.tuning and lazy.threshold_bytes == autotune.CANDIDATES[0] and lazy.tuning_results is None
    assert tune(lazy, grads, rng) == first == (TUNING_STEPS if WORLD.size > 1 else 1)
    if WORLD.size > 1:
        # The last rank alone retunes: its threshold (and so every segment) differs from the others',
        # and every rank's next step fails; all retuning together puts them back in step.
        if WORLD.rank == LAST:
            lazy.retune()
        inputs = [g.copy() for g in grads]
        for g in grads:
            lazy.push(g)
        on_all_ranks(lambda: expect(gflow.MismatchError, lazy.flush, "push-order checksum"), "mismatch")
        for g, x in zip(grads, inputs, strict=True):
            np.testing.assert_array_equal(g, x)
        lazy.retune()
        assert tune(lazy, grads, rng) == first
    fixed = gflow.LazyAllreduce(4096)
    expect(ValueError, fixed.retune, "fixed at 4096 bytes")


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("other", [autotune.CANDIDATES[0], 4 * 2**20])
def test_auto_on_one_rank_and_a_fixed_threshold_on_another_fail_at_once(other):
    # Even a fixed threshold equal to the first candidate: the ranks were told different things.
    rng = rank_rng(83)
    lazy = gflow.LazyAllreduce("auto" if WORLD.rank == 0 else other, op="sum")
    grads = [random_array(rng, s, np.float32) for s in SHAPES]
    for g in grads:
        lazy.push(g)
    on_all_ranks(lambda: expect(gflow.MismatchError, lazy.flush, "push-order checksum"), "mismatch")


@pytest.mark.parallel([1, 3])
def test_a_checkpoint_carries_the_settled_threshold():
    rng = rank_rng(84)
    lazy = gflow.LazyAllreduce("auto", op="sum")
    grads = [random_array(rng, s, np.float32) for s in SHAPES]
    checked_step(lazy, grads, rng)
    midway, position = lazy.state_dict(), lazy._tuner.position()
    assert midway["threshold_bytes"] == "auto"
    if WORLD.size > 1:
        assert midway["tuned_threshold_bytes"] is None and midway["tuner"]["settled"] is None
    tune(lazy, grads, rng)
    state = lazy.state_dict()
    assert state["tuned_threshold_bytes"] == lazy.threshold_bytes
    restarted = gflow.LazyAllreduce("auto", op="sum")
    restarted.load_state_dict(state)
    assert not restarted.tuning and restarted.threshold_bytes == lazy.threshold_bytes
    checked_step(restarted, grads, rng, "after loading")
    again = gflow.LazyAllreduce("auto", op="sum")
    again.load_state_dict(midway)
    assert again._tuner.position() == position  # saved while tuning: it goes on from there
    if WORLD.size > 1:  # (alone, one step settled it)
        assert again.tuning and again.threshold_bytes == autotune.CANDIDATES[0]
    expect(ValueError, lambda: gflow.LazyAllreduce(4096, op="sum").load_state_dict(state), "threshold_bytes")
    for bad in (0, -5, "8", 2.5, True):
        broken = dict(state, tuned_threshold_bytes=bad)
        expect(ValueError, lambda broken=broken: again.load_state_dict(broken), "tuned_threshold_bytes")
    assert again.tuning == (WORLD.size > 1)  # a refused state changed nothing


def test_bad_thresholds_are_named():
    expect(ValueError, lambda: gflow.LazyAllreduce("fast"), "threshold_bytes: expected an int or 'auto'")
    expect(TypeError, lambda: gflow.LazyAllreduce(2.5), "threshold_bytes: expected an int or 'auto'")
    expect(TypeError, lambda: gflow.LazyAllreduce(None), "threshold_bytes")
    expect(ValueError, lambda: gflow.LazyAllreduce(0), "threshold_bytes must be >= 1")
    expect(ValueError, lambda: gflow.LazyAllreduce("auto", sparse={"density": 0.5}), "dense fusion")
    expect(
        ValueError, lambda: gflow.DataParallel([np.zeros(3, np.float32)], threshold_bytes="Auto"), "'auto'"
    )


@pytest.mark.parallel([1, 2, 3])
def test_data_parallel_tunes_its_threshold():
    rng = rank_rng(85)
    params = {f"w{i}": np.zeros(s, np.float32) for i, s in enumerate(SHAPES)}
    dp = gflow.DataParallel(params, op="sum", threshold_bytes="auto")
    buffers = dp.gradient_buffers()
    steps = 0
    while dp._lazy.tuning:
        inputs = {k: random_array(rng, b.shape, b.dtype) for k, b in buffers.items()}
        for key in reversed(list(params)):
            buffers[key][...] = inputs[key]
            dp.push(key)
        on_all_ranks(dp.synchronize, f"step {steps}")
        for key, b in buffers.items():
            on_all_ranks(lambda b=b, x=inputs[key]: assert_close_to_reference(b, x, "sum"), f"step {steps}")
        steps += 1
        assert steps <= 60
    agreed = WORLD.allgather(dp._lazy.threshold_bytes)
    assert agreed == [agreed[0]] * WORLD.size


@pytest.mark.parallel([2, 3])
def test_ranks_elsewhere_in_the_schedule_on_the_same_threshold_fail_at_once():
    # Review: the last rank loads a state settled on the very threshold the others are trying, just
    # before the step that agrees; its flush returned while theirs waited for the agreement forever.
    # Now where each rank is in the schedule is part of every segment's checksum.
    rng = rank_rng(86)
    lazy = gflow.LazyAllreduce("auto", op="sum")
    grads = [random_array(rng, s, np.float32) for s in SHAPES]
    while not lazy._tuner.deciding:
        checked_step(lazy, grads, rng)
    if WORLD.rank == LAST:
        lazy.load_state_dict(older(lazy.state_dict(), tuned_threshold_bytes=lazy.threshold_bytes))
        assert not lazy.tuning
    for g in grads:
        lazy.push(g)
    on_all_ranks(lambda: expect(gflow.MismatchError, lazy.flush, "where it is in its tuning"), "mismatch")
    # Settled everywhere on the first candidate, then one rank retunes: the same threshold again.
    lazy.load_state_dict(older(lazy.state_dict(), tuned_threshold_bytes=autotune.CANDIDATES[0]))
    checked_step(lazy, grads, rng, "settled on the first candidate")
    if WORLD.rank == LAST:
        lazy.retune()
    for g in grads:
        lazy.push(g)
    on_all_ranks(lambda: expect(gflow.MismatchError, lazy.flush), "retuned on one rank")


@pytest.mark.parallel([1, 2])
def test_a_larger_step_after_settling_at_once_tunes_afresh():
    # Review: a first step of a few bytes (frozen layers) settled on 256 KiB for good.
    rng = rank_rng(87)
    lazy = gflow.LazyAllreduce("auto", op="sum")
    checked_step(lazy, [random_array(rng, (7,), np.float32)], rng, "a small first step")
    assert not lazy.tuning and lazy.threshold_bytes == autotune.CANDIDATES[0]
    grads = [random_array(rng, s, np.float32) for s in SHAPES]
    checked_step(lazy, grads, rng, "the first larger step")  # it counts as the first warm-up step
    if WORLD.size > 1:
        assert lazy.tuning
        assert 1 + tune(lazy, grads, rng) == TUNING_STEPS
    else:  # alone nothing is fused: every step is 0 bytes on the wire
        assert not lazy.tuning
    checked_step(lazy, grads, rng, "settled")
    big = gflow.LazyAllreduce(2**64, op="sum")  # review: a threshold past int64 broke every push
    checked_step(big, grads, rng, "a threshold of 2**64")


@pytest.mark.parallel([2])
def test_data_parallel_undoes_a_failed_load_tuning_progress_included():
    # Review: a load whose loss-scaler part was bad rolled back through state_dict(), which restarted
    # the tuning (and on this rank only, when the bad part is on one rank's checkpoint).
    rng = rank_rng(88)
    params = {f"w{i}": np.zeros(s, np.float32) for i, s in enumerate(SHAPES)}
    dp = gflow.DataParallel(params, op="sum", threshold_bytes="auto", loss_scaler=gflow.LossScaler())
    buffers = dp.gradient_buffers()
    for _ in range(4):
        for key in reversed(list(params)):
            buffers[key][...] = random_array(rng, buffers[key].shape, np.float32)
            dp.push(key)
        on_all_ranks(dp.synchronize)
    tuner, position = dp._lazy._tuner, dp._lazy._tuner.position()
    good = dp.state_dict()
    state = dict(good)
    lazy = state["lazy"]
    state["lazy"] = dict(lazy, tuned_threshold_bytes=2**20, tuner=dict(lazy["tuner"], settled=2**20))
    state["loss_scaler"] = dict(state["loss_scaler"], scale=-1.0)
    expect(ValueError, lambda: dp.load_state_dict(state), "scale")
    assert dp._lazy._tuner is tuner and tuner.position() == position and dp._lazy.tuning
    # A good checkpoint goes on from where the tuning was.
    params = {key: np.zeros(s, np.float32) for key, s in zip(params, SHAPES, strict=True)}
    resumed = gflow.DataParallel(params, op="sum", threshold_bytes="auto", loss_scaler=gflow.LossScaler())
    resumed.load_state_dict(pickle.loads(pickle.dumps(good)))
    assert resumed._lazy._tuner.position() == position and resumed._lazy.threshold_bytes == CANDIDATES[1]


def tuning_steps(shapes) -> tuple[int, int]:
    """For steps of float32 arrays of these shapes: the steps of the first round, and until settled."""
    step_bytes = 4 * sum(math.prod(s) for s in shapes)
    candidates = sum(1 for c in autotune.CANDIDATES if c < step_bytes) + 1
    first = candidates * (autotune.WARMUP_STEPS + FIRST)
    return first, first + 1 + FINALISTS * (autotune.WARMUP_STEPS + SECOND) + 1


@pytest.fixture
def fixed_times(monkeypatch):
    """Step times that depend only on where the tuner is and on the rank, not on the clock, so that a
    resumed run decides from the same numbers as the run never stopped; 1 MiB is the fastest."""
    step_done = autotune.ThresholdTuner.step_done

    def fixed(self, seconds, step_bytes):
        spread = abs(math.log2(self.threshold) - 20) / 10
        jitter = ((7 * self.steps + WORLD.rank) % 5) / 100
        return step_done(self, 1.0 + spread + jitter, step_bytes)

    monkeypatch.setattr(autotune.ThresholdTuner, "step_done", fixed)


@pytest.mark.parallel([2, 3, 4])
def test_a_run_checkpointed_mid_tuning_resumes_the_same_schedule_and_ends_bitwise_equal(fixed_times):
    # Issue 24, item 9: the checkpoint held only the settled threshold (None while tuning), so a run
    # restarted mid-tuning tuned from the start: other thresholds, other segments, at p = 4 other bits.
    first, settled_after = tuning_steps(STRADDLING)
    steps = settled_after + 2
    # in the first round; where the next step agrees; in the second round; the last agreement next
    stops = [4, first, first + 6, settled_after - 1]

    def step(lazy, k):
        """Step k's random gradients (per rank, the same in every run): the threshold it ran under
        and a digest of every result's bits."""
        rng = np.random.default_rng([89, k, WORLD.rank])
        grads = [random_array(rng, s, np.float32) for s in STRADDLING]
        threshold = lazy.threshold_bytes
        for g in grads:
            lazy.push(g)
        lazy.flush()
        return threshold, [hashlib.sha256(g.tobytes()).hexdigest() for g in grads]

    def check():
        whole = gflow.LazyAllreduce("auto", op="sum")
        saved, expected = {}, []
        for k in range(steps):
            if k in stops:
                saved[k] = pickle.dumps(whole.state_dict())  # as a file written at step k
            expected.append(step(whole, k))
        assert not whole.tuning and whole.threshold_bytes == 2**20
        for stop in stops:
            resumed = gflow.LazyAllreduce("auto", op="sum")  # a new process
            resumed.load_state_dict(pickle.loads(saved[stop]))
            assert resumed.tuning
            got = [step(resumed, k) for k in range(stop, steps)]  # compared after: ranks stay in step
            for k, (threshold, digests) in enumerate(got, start=stop):
                assert threshold == expected[k][0], f"resumed at {stop}: step {k} ran under another threshold"
                differ = [i for i, (a, b) in enumerate(zip(digests, expected[k][1], strict=True)) if a != b]
                assert not differ, f"resumed at {stop}: step {k}: the results of tensors {differ} differ"
            assert not resumed.tuning and resumed.threshold_bytes == whole.threshold_bytes
            assert resumed.tuning_results == whole.tuning_results
            assert resumed._tuner.steps == whole._tuner.steps

    on_all_ranks(check)


def _tuner_in_round(second: bool) -> autotune.ThresholdTuner:
    """A tuner moved along by hand (no communication) with steps of STEP_BYTES: in the first round at
    its second candidate, or in the second round."""
    tuner = autotune.ThresholdTuner()
    for k in range(FIRST_ROUND if second else 4):
        tuner.step_done(0.1 + k / 100, STEP_BYTES)
    if second:  # the first finalist's warm-up and measured steps, the second's warm-up
        tuner.agreed(tuner.medians() * 2, 2)
        for k in range(autotune.WARMUP_STEPS * 2 + SECOND):
            tuner.step_done(0.2 + k / 100, STEP_BYTES)
    return tuner


def test_a_malformed_tuner_state_is_refused_naming_the_field_and_changes_nothing():
    lazy = gflow.LazyAllreduce("auto", op="sum")
    good = dict(lazy.state_dict(), tuner=_tuner_in_round(False).state_dict())
    lazy.load_state_dict(good)
    tuner, position = lazy._tuner, lazy._tuner.position()
    assert lazy.tuning and lazy.threshold_bytes == CANDIDATES[1]
    saved = good["tuner"]
    samples = saved["samples"]
    bad = {
        "tuner: expected a dict": 5,
        "tuner: the state lacks 'samples'": {k: v for k, v in saved.items() if k != "samples"},
        "tuner.trying: expected an increasing": dict(saved, trying=[2**19, 2**18]),
        "tuner.trying: expected the smallest candidates": dict(saved, trying=CANDIDATES[1:]),
        "tuner.trying: expected a list": dict(saved, trying=2**18),
        "tuner.round: expected an int from 0 to 1": dict(saved, round=2),
        "tuner.index: expected an int from 0 to 4": dict(saved, index=5),
        "tuner.steps_here: expected an int": dict(saved, steps_here="1"),
        "tuner.pruned: expected True or False": dict(saved, pruned=1),
        "tuner.at_once: expected False while not settled": dict(saved, at_once=True),
        "tuner.settled: expected an int >= 1 or None": dict(saved, settled=0),
        "tuner.steps: expected an int >= 0": dict(saved, steps=-1),
        "tuner.samples: expected a dict": dict(saved, samples=[0.1]),
        "tuner.samples: expected candidates": dict(saved, samples=dict(samples, **{"4096": [0.1]})),
        r"tuner.samples\[262144\]: expected finite": dict(saved, samples={**samples, 2**18: [0.1, math.nan]}),
        r"tuner.samples\[262144\]: expected 2 step times": dict(saved, samples={**samples, 2**18: [0.1]}),
        "tuner.results: expected None in round 0": dict(saved, results={2**18: 0.1}),
        "tuned_threshold_bytes and tuner.settled differ": dict(saved, settled=2**20),
    }
    for match, broken in bad.items():
        expect(ValueError, lambda broken=broken: lazy.load_state_dict(dict(good, tuner=broken)), match)
    expect(ValueError, lambda: lazy.load_state_dict(dict(good, tuner=None)), "tuner: expected a dict")
    expect(ValueError, lambda: lazy.adopt_tuning(dict(saved, index=-1)), "tuner.index")
    assert lazy._tuner is tuner and tuner.position() == position and lazy.threshold_bytes == CANDIDATES[1]
    # A position in the second round; lists as tuples, arrays or NumPy scalars (what a round trip through
    # other formats may make of them) load alike.
    later = _tuner_in_round(True).state_dict()
    assert later["round"] == 1 and len(later["trying"]) == FINALISTS and later["results"]
    converted = dict(
        later,
        trying=tuple(np.int64(c) for c in later["trying"]),
        samples={np.int64(c): np.array(t) for c, t in later["samples"].items()},
        index=np.int64(later["index"]),
    )
    lazy.load_state_dict(pickle.loads(pickle.dumps(dict(good, tuner=converted))))
    assert lazy._tuner.state_dict() == later and lazy.tuning_results == later["results"]
    assert lazy.threshold_bytes == later["trying"][later["index"]]
    assert (later["index"], later["steps_here"]) == (1, autotune.WARMUP_STEPS)
    for i, count in ((0, FIRST + SECOND), (1, FIRST)):
        c = later["trying"][i]
        broken = dict(later, samples={**later["samples"], c: later["samples"][c][:-1]})
        load = lambda broken=broken: lazy.load_state_dict(dict(good, tuner=broken))  # noqa: E731
        expect(ValueError, load, rf"tuner.samples\[{c}\]: expected {count} step times")
    # Older checkpoints (no "tuner"): as before, tune from the start, or go on with the settled threshold.
    lazy.load_state_dict(older(good))
    assert lazy._tuner.position() == autotune.ThresholdTuner().position()
    lazy.load_state_dict(older(good, tuned_threshold_bytes=2**20))
    assert not lazy.tuning and lazy.threshold_bytes == 2**20
    fixed = gflow.LazyAllreduce(4096, op="sum")
    assert fixed.state_dict()["tuner"] is None
    expect(ValueError, lambda: fixed.load_state_dict(dict(fixed.state_dict(), tuner=saved)), "expected None")
    fixed.load_state_dict(older(fixed.state_dict()))


@pytest.mark.parallel([2, 3])
def test_ranks_adopt_root_tuning_position():
    # broadcast_optimizer_state's way: root's position, handed to every rank, and the steps go on in step.
    rng = rank_rng(90)
    lazy = gflow.LazyAllreduce("auto", op="sum")
    grads = [random_array(rng, s, np.float32) for s in SHAPES]
    for _ in range(5):
        checked_step(lazy, grads, rng)
    root = WORLD.bcast(lazy._tuner.state_dict() if WORLD.rank == 0 else None)
    fresh = gflow.LazyAllreduce("auto", op="sum")
    fresh.adopt_tuning(root)
    assert fresh._tuner.position() == lazy._tuner.position() and fresh.threshold_bytes == lazy.threshold_bytes
    assert 5 + tune(fresh, grads, rng) == TUNING_STEPS
    settled = fresh.threshold_bytes
    again = gflow.LazyAllreduce("auto", op="sum")
    again.adopt_tuning(WORLD.bcast(settled if WORLD.rank == 0 else None))  # a settled threshold, as before
    assert not again.tuning and again.threshold_bytes == settled
    checked_step(again, grads, rng)


def test_a_distributed_optimizer_checkpoint_mid_tuning_goes_through_torch_load():
    # gflow.torch holds the kit's state as tensors and Python values: torch.load(weights_only=True)
    # must take the tuner's position, and a new optimizer must go on from it.
    torch = pytest.importorskip("torch")
    import gflow.torch as hvd

    hvd.init()

    def make():
        model = torch.nn.Linear(8, 4)
        return hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
            threshold_bytes="auto",
        )  # fmt: skip

    opt = make()
    position = _tuner_in_round(True).state_dict()
    opt._dp._lazy.adopt_tuning(position)
    file = io.BytesIO()
    torch.save(opt.state_dict(), file)
    file.seek(0)
    fresh = make()
    fresh.load_state_dict(torch.load(file, weights_only=True))
    assert fresh._dp._lazy._tuner.state_dict() == position
    assert fresh._dp._lazy.threshold_bytes == position["trying"][position["index"]]


def _push_and_flush(lazy, grads) -> None:
    for g in grads:
        lazy.push(g)
    lazy.flush()


def _random_step(lazy, grads, rng) -> list:
    """Random values into `grads`, one step through `lazy`; returns the inputs."""
    inputs = [random_array(rng, g.shape, g.dtype) for g in grads]
    for g, x in zip(grads, inputs, strict=True):
        g[...] = x
    _push_and_flush(lazy, grads)
    return inputs


def _uneven_steps_then_join(step, joins, steps: int):
    """`steps` steps of `step()` on this rank, then `joins()`: the others' steps beyond this rank's
    are served with zeros."""
    for _ in range(steps):
        step()
    return joins()


@pytest.mark.parallel([2, 3, 4])
@pytest.mark.parametrize("kit", ["lazy", "data_parallel"])
def test_after_uneven_steps_and_join_every_rank_takes_the_tuning_of_the_rank_that_joined_last(kit):
    """Rank r runs r + 1 steps of an epoch, then join(): each rank's tuner stopped where it joined, and
    its position is in every segment's checksum, so every step after join() failed on every rank
    (helper-76). Now every rank takes the position of the rank that joined last at its next step, and
    the steps of the next epoch are right (MPI float64 reference) and in the same place everywhere."""
    rng, r, p = rank_rng(95), WORLD.rank, WORLD.size
    if kit == "lazy":
        lazy = gflow.LazyAllreduce("auto", op="sum")
        grads = [random_array(rng, s, np.float32) for s in SHAPES]
        step, joins = partial(_push_and_flush, lazy, grads), gflow.join
    else:
        params = {f"w{i}": np.zeros(s, np.float32) for i, s in enumerate(SHAPES)}
        dp = gflow.DataParallel(params, op="sum", threshold_bytes="auto")
        buffers = dp.gradient_buffers()
        lazy, grads = dp._lazy, list(buffers.values())

        def step():
            for key in reversed(list(params)):
                buffers[key][...] = random_array(rng, buffers[key].shape, np.float32)
                dp.push(key)
            dp.synchronize()

        joins = dp.join

    def check():
        last = _uneven_steps_then_join(step, joins, r + 1)
        assert last == p - 1
        for i in range(3):
            if kit == "lazy":
                checked_step(lazy, grads, rng, f"step {i} after join")
            else:
                inputs = {k: random_array(rng, b.shape, b.dtype) for k, b in buffers.items()}
                for key in reversed(list(params)):
                    buffers[key][...] = inputs[key]
                    dp.push(key)
                on_all_ranks(dp.synchronize, f"step {i} after join")
                for key, b in buffers.items():
                    on_all_ranks(lambda b=b, x=inputs[key]: assert_close_to_reference(b, x, "sum"), f"{i}")
            where = (lazy._tuner.position(), lazy.threshold_bytes)
            assert WORLD.allgather(where) == [where] * p

    on_all_ranks(check)


@pytest.mark.parallel([3, 4])
def test_a_kit_on_a_subset_takes_the_tuning_of_that_subsets_last_rank():
    """join(subsets=...): a kit on a sub-communicator takes the position of the member that joined
    last (rank p - 2 here, which ran the most of the subset's steps), not the last rank of all (p - 1,
    outside the subset)."""
    rng, r, p = rank_rng(96), WORLD.rank, WORLD.size
    comm = WORLD.Dup()
    sub = comm.Split(0 if r < p - 1 else MPI.UNDEFINED, r)
    subsets = [sub] if sub != MPI.COMM_NULL else []
    lazy = gflow.LazyAllreduce("auto", op="sum", comm=sub) if subsets else None
    grads = [random_array(rng, s, np.float32) for s in SHAPES]

    def check():
        if subsets:
            step, joins = partial(_push_and_flush, lazy, grads), partial(gflow.join, comm, subsets=subsets)
            last = _uneven_steps_then_join(step, joins, r + 1)
        else:
            for _ in range(p + 1):  # (the world's last to join: its allreduces are served by the rest)
                gflow.allreduce(np.ones(3), comm=comm)
            last = gflow.join(comm)
        assert last == p - 1
        if not subsets:
            return
        for _ in range(3):
            everyone = sub.allgather(_random_step(lazy, grads, rng))
            for k, g in enumerate(grads):
                expected = sum(e[k].astype(np.float64) for e in everyone)
                np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-5)
            where = (lazy._tuner.position(), lazy.threshold_bytes)
            assert sub.allgather(where) == [where] * sub.size

    on_all_ranks(check)
    if subsets:
        sub.Free()
    comm.Free()


@pytest.mark.parallel([2, 3])
def test_a_rank_with_no_data_in_the_next_epoch_leaves_the_others_to_follow_the_last_tuning():
    """The epoch after an uneven one: the last rank has no batch and joins at once, so the others'
    first step takes the tuning position it set through allreduces it serves with zeros in join()
    (a broadcast failed on them alone: helper-77). Every step of theirs sums the ranks with data."""
    rng, r, p = rank_rng(97), WORLD.rank, WORLD.size
    lazy = gflow.LazyAllreduce("auto", op="sum")
    grads = [random_array(rng, s, np.float32) for s in SHAPES]

    def check():
        assert _uneven_steps_then_join(partial(_push_and_flush, lazy, grads), gflow.join, r + 1) == p - 1
        inputs, outputs = [], []
        for _ in range(0 if r == p - 1 else 2):  # (the next epoch: the last rank has no data)
            inputs.append(_random_step(lazy, grads, rng))
            outputs.append([g.copy() for g in grads])
        gflow.join()
        everyone = WORLD.allgather(inputs)
        for i, got in enumerate(outputs):
            for k, g in enumerate(got):
                expected = sum(e[i][k].astype(np.float64) for e in everyone if len(e) > i)
                np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-5)
        where = (lazy._tuner.position(), lazy.threshold_bytes) if r < p - 1 else None
        assert len({w for w in WORLD.allgather(where) if w is not None}) == 1

    on_all_ranks(check)
