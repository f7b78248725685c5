"""fp16 communication, LossScaler, allreduce_async and LazyAllreduce, at world sizes 1 to 4."""

import copy
import gc
import pickle
import re
import time

import numpy as np
import pytest
from helpers import (
    WORLD,
    Interrupt,
    assert_close_to_reference,
    assert_same_on_all_ranks,
    interrupted_after,
    mpi_allreduce,
    on_all_ranks,
    random_array,
    rank_rng,
    without_warnings,
)
from mpi4py import MPI

import gflow
from gflow.runtime import engine
from gflow.runtime.context import context

SIZES = [1, 2, 3, 4]


def fp16_close(y, x, op):
    """Within float16 rounding of the float64 reference: each rank's value and the result are rounded
    to float16 once, and p - 1 additions round in float16."""
    everyone = np.stack(WORLD.allgather(x.astype(np.float64)))
    exact = everyone.mean(axis=0) if op == "mean" else everyone.sum(axis=0)
    scale = np.abs(everyone).sum(axis=0) / (WORLD.size if op == "mean" else 1)
    tol = (WORLD.size + 2) * 2.0**-11 * scale + 2.0**-24
    assert np.all(np.abs(y.astype(np.float64) - exact) <= tol), np.max(np.abs(y - exact) - tol)


@pytest.mark.parallel(SIZES)
def test_fp16_allreduce_is_within_float16_rounding_and_identical():
    for n, dtype, op in [
        (1, np.float32, "sum"),
        (1000, np.float32, "mean"),
        (100_003, np.float64, "sum"),
        (70_000, np.float32, "mean"),
    ]:
        x = random_array(rank_rng(n), n, dtype)

        def check(x=x, op=op):
            y = gflow.allreduce(x, op, compression="fp16")
            assert y.dtype == x.dtype and y.shape == x.shape
            fp16_close(y, x, op)
            assert_same_on_all_ranks(y)

        on_all_ranks(check, f"n={n} {dtype.__name__} {op}")


@pytest.mark.parallel([2, 3, 4])
def test_fp16_mean_divides_before_the_sum_and_overflow_fails_every_rank():
    # 40000 on every rank: the float16 sum would overflow (max 65504), the mean fits.
    x = np.full(1000, 40000.0, np.float32)
    on_all_ranks(lambda: np.testing.assert_array_equal(gflow.allreduce(x, "mean", compression="fp16"), x))

    def overflow():
        with pytest.raises(gflow.CompressionOverflowError, match="inf or NaN"):
            gflow.allreduce(x, "sum", compression="fp16")

    on_all_ranks(overflow, "sum overflows")
    # One rank's NaN or out-of-range value: every rank raises, none goes on with different values.
    for bad in (np.nan, 1e6):
        y = np.ones(100, np.float32)
        if WORLD.rank == WORLD.size - 1:
            y[3] = bad
        on_all_ranks(
            lambda y=y: pytest.raises(
                gflow.CompressionOverflowError, gflow.allreduce, y, "mean", compression="fp16"
            ),
            f"{bad}",
        )


def test_compression_argument_errors():
    with pytest.raises(ValueError, match="expected None, 'fp16' or 'bf16'"):
        gflow.allreduce(np.ones(3, np.float32), compression="int8")
    with pytest.raises(TypeError, match="needs a floating dtype"):
        gflow.allreduce(np.ones(3, np.int32), compression="fp16")


@pytest.mark.parallel(SIZES)
def test_loss_scaler_skips_on_every_rank_when_one_rank_overflows():
    scaler = gflow.LossScaler(init_scale=1024.0, growth_interval=3)

    def check():
        # Step 1: only the last rank overflows; every rank must skip and back off.
        assert scaler.update(WORLD.rank == WORLD.size - 1) is False
        assert scaler.scale == 512.0 and scaler.skipped_steps == 1
        # Three clean steps: applied everywhere, then the scale grows.
        assert [scaler.update(False) for _ in range(3)] == [True, True, True]
        assert scaler.scale == 1024.0
        assert WORLD.allgather(scaler.scale) == [1024.0] * WORLD.size

    on_all_ranks(check)
    grad = np.full(10, 2048.0, np.float32)
    assert scaler.unscale(grad) is False and np.all(grad == 2.0)
    grad[0] = np.inf
    assert scaler.unscale(grad) is True


def test_loss_scaler_rejects_bad_settings():
    for kwargs, match in [
        ({"init_scale": 0}, "init_scale"),
        ({"init_scale": 2.0**65}, r"init_scale must be in \(0, 2\*\*64\]"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.5}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
    ]:
        with pytest.raises(ValueError, match=match):
            gflow.LossScaler(**kwargs)


@pytest.mark.parallel([1, 2, 3])
def test_a_scaled_push_past_the_range_is_inf_without_a_warning():
    """push(scale=) multiplies on the way into the fusion buffer: a product past float32's range is inf
    in the result, as a sum past it is, with no NumPy warning; under warnings as errors the step
    finishes on every rank (the overflowing rank's push raised, and the step failed: helper-79)."""
    x = random_array(rank_rng(5), 10, np.float32)
    if WORLD.rank == 0:
        x[2] = 2e38

    def check():
        lazy, g = gflow.LazyAllreduce(threshold_bytes=4096), x.copy()
        without_warnings(lambda: (lazy.push(g, scale=4.0), lazy.flush()))
        assert g[2] == np.inf
        rest = np.delete(x, 2) * np.float32(4.0)
        assert_close_to_reference(np.delete(g, 2), rest, "mean")
        assert_same_on_all_ranks(g)

    on_all_ranks(check)


def test_loss_scaler_stops_growing_before_inf():
    """helper-51: the scale grew without bound to inf; unscale then multiplied by 0 (every gradient
    zero, no overflow reported) and the scaler's own state_dict no longer loaded."""
    for init, growth in ((2.0**16, 2.0), (2.0**63, 3.0), (1.0, 1e300)):
        scaler = gflow.LossScaler(init_scale=init, growth_factor=growth, growth_interval=1)
        for _ in range(200):
            assert scaler.update(False)
        assert scaler.scale == 2.0**64
        g = np.array([3.0, -6.0]) * scaler.scale
        assert not scaler.unscale(g)
        np.testing.assert_array_equal(g, [3.0, -6.0])
        gflow.LossScaler(growth_factor=growth, growth_interval=1).load_state_dict(scaler.state_dict())
    # helper-52: a scale saved past the cap (before there was one) loads, at the cap
    old = dict(gflow.LossScaler().state_dict(), scale=2.0**70)
    resumed = gflow.LossScaler()
    resumed.load_state_dict(old)
    assert resumed.scale == 2.0**64


@pytest.mark.parallel([2, 3, 4])
def test_async_allreduce_overlaps_with_the_callers_work():
    """Rank 0's allreduce cannot finish until rank 0 itself, after starting it, tells the others to
    join. If allreduce_async blocked, that message would never be sent and the test would deadlock
    (and fail on the watchdog): passing proves the caller ran while the collective was in flight."""
    x = random_array(rank_rng(9), 50_000, np.float32)
    comm = WORLD.Dup()
    if WORLD.rank == 0:
        handle = gflow.allreduce_async(x)
        busy = float(np.sum(np.sqrt(np.abs(x))))  # the caller's own work, while the transfer waits
        assert not handle.done()
        for peer in range(1, WORLD.size):
            comm.send("go", dest=peer, tag=7)
        result = handle.wait(timeout=30)
        assert busy > 0
    else:
        assert comm.recv(source=0, tag=7) == "go"
        result = gflow.allreduce_async(x).wait(timeout=30)
    assert handle.done() if WORLD.rank == 0 else True
    on_all_ranks(lambda: assert_close_to_reference(result, x, "sum"))
    comm.Free()


@pytest.mark.parallel([1, 2, 3])
def test_async_results_errors_and_buffers():
    x = random_array(rank_rng(4), 1000, np.float64)
    expected = gflow.allreduce(x, "max")

    def check():
        out = np.full(1000, np.nan)
        handles = [
            gflow.allreduce_async(x.copy(), "max", out=out),
            gflow.allreduce_async(x.copy(), "mean", compression="fp16"),
        ]
        assert handles[0].wait() is out  # the temporary input copies were kept alive by the handle
        np.testing.assert_array_equal(out, expected)
        fp16_close(handles[1].wait(), x, "mean")
        with pytest.raises(TypeError, match="unsupported dtype"):
            gflow.allreduce_async(np.ones(3, np.uint8)).wait()  # reported by the handle

    on_all_ranks(check)
    if WORLD.size > 1:
        # Ranks disagree: every rank's wait() raises; the next async call works again.
        n = 10 + (WORLD.rank == 0)
        on_all_ranks(
            lambda: pytest.raises(gflow.MismatchError, gflow.allreduce_async(np.ones(n)).wait), "mismatch"
        )
        on_all_ranks(
            lambda: np.testing.assert_array_equal(gflow.allreduce_async(np.ones(5)).wait(), WORLD.size)
        )


def push_all(lazy, tensors):
    for t in tensors:
        lazy.push(t)
    lazy.flush()


@pytest.mark.parallel(SIZES)
def test_lazy_allreduce_equals_per_tensor_allreduce():
    rng = rank_rng(12)
    sizes = [1, 7, 1000, 3, 40_000, 0, 250, 120_000, 5]
    for dtype, op in [(np.float32, "mean"), (np.int64, "sum"), (np.float64, "max")]:
        tensors = [random_array(rng, n, dtype) for n in sizes]
        expected = [gflow.allreduce(t, op) for t in tensors]
        # Thresholds below, equal to and above single tensors, and above the whole step.
        for threshold in (1, 4 * 250, 4 * 1000, 4 * 40_000, 10**5, 10**9):
            lazy = gflow.LazyAllreduce(threshold_bytes=threshold, op=op)
            for _step in range(2):  # the pool is reused on the second step
                work = [t.copy() for t in tensors]
                on_all_ranks(
                    lambda lazy=lazy, work=work: push_all(lazy, work), f"{dtype.__name__} {op} {threshold}"
                )
                for got, want in zip(work, expected, strict=True):
                    if np.dtype(dtype).kind == "i" or op == "max":
                        np.testing.assert_array_equal(got, want)
                    else:
                        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parallel([1, 2, 4])
def test_lazy_allreduce_fp16():
    tensors = [random_array(rank_rng(n), n, np.float32) for n in (10, 3000, 70_000)]
    lazy = gflow.LazyAllreduce(threshold_bytes=8000, op="mean", compression="fp16")
    work = [t.copy() for t in tensors]
    on_all_ranks(lambda: push_all(lazy, work))
    for got, x in zip(work, tensors, strict=True):
        on_all_ranks(lambda got=got, x=x: fp16_close(got, x, "mean"))


@pytest.mark.parallel([2, 3, 4])
def test_lazy_push_mismatch_fails_every_rank_and_loses_nothing():
    last = WORLD.rank == WORLD.size - 1
    cases = {
        "swapped order": [100, 200] if last else [200, 100],
        "different size": [100, 201] if last else [100, 200],
        "one tensor more": [100, 200, 300] if last else [100, 200],
        "one tensor fewer, across segments": [500] * 5 if last else [500] * 6,
    }
    lazy = gflow.LazyAllreduce(threshold_bytes=1500)
    for case, sizes in cases.items():
        tensors = [np.full(n, float(WORLD.rank + 1), np.float32) for n in sizes]

        def check(tensors=tensors):
            with pytest.raises(gflow.GflowError):
                push_all(lazy, tensors)
            for t in tensors:  # nothing lost: each still holds this rank's own values
                np.testing.assert_array_equal(t, WORLD.rank + 1)

        on_all_ranks(check, case)
        # The next step, pushed alike everywhere, works.
        same = [np.ones(n, np.float32) for n in (100, 2000)]
        on_all_ranks(lambda same=same: push_all(lazy, same), f"after {case}")
        for t in same:
            np.testing.assert_array_equal(t, 1.0)


@pytest.mark.parallel([2, 3])
def test_lazy_agree_vectors_that_differ_fail_every_rank_saying_so():
    """flush(agree=) with another length, or none, on one rank: MismatchError on every rank that names
    the agree= vector (not the op or the tensors alone); the next step, alike everywhere, works."""
    last = WORLD.rank == WORLD.size - 1
    lazy = gflow.LazyAllreduce()
    seed = WORLD.bcast(int(np.random.SeedSequence().entropy % 2**32))
    x = random_array(rank_rng(seed), 300, np.float32)
    for case, vector, said in (
        ("another length", np.arange(4 if last else 3), "length of the agree= vector"),
        ("none on one rank", None if last else np.arange(3), "carries an agree= vector"),
    ):
        lazy.push(x.copy())

        def check(vector=vector, said=said):
            with pytest.raises(gflow.MismatchError, match=said):
                lazy.flush(agree=vector)

        on_all_ranks(check, case)
    mine = rank_rng(seed + 1).integers(-50, 50, 5)
    y = x.copy()
    lazy.push(y)
    agreed = lazy.flush(agree=mine)
    np.testing.assert_array_equal(agreed, np.max(WORLD.allgather(mine), axis=0))
    assert_close_to_reference(y, x, "mean")  # (LazyAllreduce's default op)
    assert_same_on_all_ranks(y)


@pytest.mark.parallel([1, 2, 3])
def test_lazy_agree_vector_of_floats_fails_the_step_on_every_rank():
    """helper-51: flush(agree=) cut floats to integers (a max of 0.9 came back 0). A vector that is not
    of integers fails the step: TypeError on that rank, MismatchError on the others, nothing written;
    the next step works. A refuse= that raises after the exchange leaves the pushed arrays alone too."""
    last = WORLD.rank == WORLD.size - 1
    lazy = gflow.LazyAllreduce()
    x = random_array(rank_rng(WORLD.bcast(int(np.random.SeedSequence().entropy % 2**32))), 300, np.float32)
    y = x.copy()
    lazy.push(y)
    vector = np.array([0.3, 0.9]) if last else np.arange(2)
    expected = TypeError if last else gflow.MismatchError
    with pytest.raises(expected, match="agree must be a vector of integers|integers, got float64"):
        lazy.flush(agree=vector)
    np.testing.assert_array_equal(y, x)

    def refuse(agreed):
        raise RuntimeError(f"refused at {agreed.tolist()}")

    lazy.push(y)
    with pytest.raises(RuntimeError, match=re.escape(f"refused at [{WORLD.size}, 5]")):
        lazy.flush(agree=np.array([WORLD.size, 5]), refuse=refuse)
    np.testing.assert_array_equal(y, x)
    lazy.push(y)
    assert lazy.flush(agree=[]).tolist() == []  # (an empty list is float64 to NumPy: still fine)
    lazy.push(y)
    assert lazy.flush(agree=np.array([WORLD.rank, 1], np.int32)).tolist() == [WORLD.size - 1, 1]
    assert_close_to_reference(y, x, "mean")


def test_lazy_alone_needs_no_copy_and_keeps_the_step_rules():
    """One rank, dense, no compression: the gradients are already the result, so no fusion buffer is
    made; a step is still a step (state_dict refuses mid-step), a bad push still fails flush(), and a
    scale or fp16 still takes the full path."""
    assert WORLD.size == 1
    rng = np.random.default_rng(7)
    for op in ("sum", "mean", "max", "min"):
        lazy = gflow.LazyAllreduce(threshold_bytes=64, op=op)
        grads = [random_array(rng, n, np.float32) for n in (5, 300, 0, 41)]
        before = [g.copy() for g in grads]
        for g in grads:
            lazy.push(g)
        with pytest.raises(RuntimeError, match="in flight"):
            lazy.state_dict()
        lazy.flush()
        for g, b in zip(grads, before, strict=True):
            np.testing.assert_array_equal(g, b)
        assert lazy._buffers == [], "a fusion buffer was made for one rank"
        lazy.push(grads[0])
        lazy.push(np.ones(3, np.int32) if op == "mean" else "not an array")
        with pytest.raises(TypeError):
            lazy.flush()
        lazy.push(grads[1])
        lazy.flush()  # the next step works
        lazy.state_dict()
    scaled = gflow.LazyAllreduce(threshold_bytes=64)
    g = np.full(8, 3.0, np.float32)
    scaled.push(g, scale=0.5)
    scaled.flush()
    np.testing.assert_array_equal(g, 1.5)
    fp16 = gflow.LazyAllreduce(compression="fp16")
    g = np.full(4, 1 / 3, np.float32)
    fp16.push(g)
    fp16.flush()
    np.testing.assert_array_equal(g, np.float32(np.float16(1 / 3)))  # rounded through float16, as at p > 1


@pytest.mark.parallel([1, 2, 3])
def test_a_bad_scale_fails_the_step_on_every_rank_and_the_next_step_works():
    """push(g, scale=None) on one rank: flush() raises TypeError there and MismatchError on the others
    (it once left half a push behind: that rank's flush failed alone and the ranks fell out of step)."""
    last = WORLD.rank == WORLD.size - 1
    lazy = gflow.LazyAllreduce(threshold_bytes=1 << 20)
    grads = [np.full(10, WORLD.rank + 1.0, np.float32), np.full(5, 2.0, np.float32)]

    def check():
        lazy.push(grads[0])
        lazy.push(grads[1], scale=None if last else 1.0)
        with pytest.raises(
            TypeError if last else gflow.MismatchError, match="scale must be a number" if last else ""
        ):
            lazy.flush()
        np.testing.assert_array_equal(grads[0], WORLD.rank + 1.0)  # nothing lost
        work = [np.ones(10, np.float32), np.full(5, 3.0, np.float32)]
        for w in work:
            lazy.push(w, scale=np.float32(2.0))
        lazy.flush()
        np.testing.assert_array_equal(work[0], 2.0)
        np.testing.assert_array_equal(work[1], 6.0)

    on_all_ranks(check)


def test_lazy_argument_errors():
    with pytest.raises(ValueError, match="threshold_bytes must be >= 1"):
        gflow.LazyAllreduce(threshold_bytes=0)
    with pytest.raises(ValueError, match="op: expected"):
        gflow.LazyAllreduce(op="prod")
    lazy = gflow.LazyAllreduce(op="mean")
    lazy.push(np.ones(3, np.int32))  # reported by flush(), where every rank's step ends
    with pytest.raises(TypeError, match="needs a floating dtype"):
        lazy.flush()
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE


@pytest.mark.parallel([2, 3])
def test_gradient_buffers_of_other_shapes_on_one_rank_are_named():
    """helper-54: a parameter of another shape on one rank failed gradient_buffers() on every rank
    with "ranks disagree on the call's extra field: rank 0 passed one, rank 1 another". The message
    names the buffer and both shapes now."""
    last = WORLD.rank == WORLD.size - 1
    shapes = [(10, 11), (5, 11) if last else (11, 5), (5,)]
    lazy = gflow.LazyAllreduce()
    theirs, mine = r"an array of shape \(11, 5\) \(buffer 1\)", r"an array of shape \(5, 11\) \(buffer 1\)"
    headline = f"ranks disagree on the shape: rank \\d+ passed {theirs}, rank {WORLD.size - 1} passed {mine}"
    on_all_ranks(lambda: pytest.raises(gflow.MismatchError, lazy.gradient_buffers, shapes).match(headline))


@pytest.mark.parallel([1, 3])
@pytest.mark.parametrize("reduce_in_place", [False, True])
def test_lazy_gradient_buffers_live_in_the_pool(reduce_in_place):
    shapes = [(3, 5), (1000,), (7,), (40, 50), (2,)]
    lazy = gflow.LazyAllreduce(threshold_bytes=4 * 1500, op="sum")
    grads = lazy.gradient_buffers(shapes, reduce_in_place=reduce_in_place)
    assert [g.shape for g in grads] == shapes
    rng = rank_rng(17)
    for step in range(2):
        values = [random_array(rng, s, np.float32) for s in shapes]
        for g, v in zip(grads, values, strict=True):
            g[...] = v
        extra = random_array(rng, 10, np.float32)  # an ordinary array may be pushed among them
        extra_before = extra.copy()
        pushes = grads[:2] + [extra] + grads[2:] if step else grads

        def step_all(pushes=pushes):
            for t in pushes:
                lazy.push(t)
            lazy.flush()

        on_all_ranks(step_all, f"step {step}")
        for g, v in zip(grads, values, strict=True):
            on_all_ranks(lambda g=g, v=v: assert_close_to_reference(g, v, "sum"))
        if step:
            on_all_ranks(lambda e=extra, b=extra_before: assert_close_to_reference(e, b, "sum"))
    assert all(np.shares_memory(g, lazy._pool.flat) for g in grads)
    with pytest.raises(ValueError, match="2-byte with compression='fp16'"):
        gflow.LazyAllreduce(compression="fp16").gradient_buffers([(3,)])
    with pytest.raises(ValueError, match="dense segments"):
        gflow.LazyAllreduce(sparse={"density": 0.5}).gradient_buffers([(3,)], reduce_in_place=True)


@pytest.mark.parallel([1, 2, 3])
def test_a_kit_copied_mid_step_and_its_step_leave_no_step_behind():
    """A step holds its kit in its communicator's set of steps in flight (CommContext.in_a_step, asked
    by every async call), not a reference the kit keeps: copying or pickling a kit mid-step works as
    before (a first version kept the context, and deepcopy raised). The step ends as it began."""
    rng = rank_rng(331)
    lazy = gflow.LazyAllreduce(threshold_bytes=1 << 20, op="sum")  # (the world's: a kit on a
    x = random_array(rng, 257, np.float64)  # communicator of its own is not copied, for the comm)
    expected = mpi_allreduce(x)
    steps = context().kits
    assert lazy not in steps
    lazy.push(x)
    assert lazy in steps and context().in_a_step()
    twin = pickle.loads(pickle.dumps(copy.deepcopy(lazy)))
    assert twin not in steps
    lazy.flush()
    assert lazy not in steps
    np.testing.assert_allclose(x, expected, rtol=1e-12)


def test_a_failure_no_wait_collected_is_said_at_exit_once():
    """An async job that failed and whose error no wait() raised is lost to the program: exit says so
    (lifecycle.at_exit prints what engine.shutdown returns), whether the handle is still held or was
    dropped; one whose error a wait() raised is not said. Before, only a job still in flight at exit
    was said."""
    assert WORLD.size == 1
    engine.shutdown()  # (what earlier tests in this process left: not this test's)
    collected, dropped, kept = (gflow.allreduce_async(f"not an array {i}") for i in range(3))
    with pytest.raises(TypeError, match="not an array|got str"):
        collected.wait()
    while not (dropped.done() and kept.done()):
        time.sleep(0.01)
    del dropped
    gc.collect()
    lost = engine.shutdown()
    assert len(lost) == 2 and all(
        line.startswith("allreduce (rejected arguments): TypeError") for line in lost
    )
    assert engine.shutdown() == []  # (said once)
    with pytest.raises(TypeError):
        kept.wait()  # (still the program's to collect)


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("kit", ["LazyAllreduce", "DataParallel"])
def test_a_flush_interrupted_while_it_waits_is_finished_by_the_next(kit):
    """Ctrl-C on rank 0 while its step's flush() (synchronize()) waits for a late peer: the step's
    segments run on in the background, so the peers finish the step; the next flush() on rank 0
    finishes it too, with the same results, and a push before it is refused on rank 0 alone, sending
    nothing (pushing the step again met the peers' next step: helper-88's MismatchError, or, had the
    interrupt come between segments, the peers' next batch, silently). Then the ranks go on in step."""
    comm = WORLD.Dup()
    rng = rank_rng(91)
    shapes = {"w": (300, 200), "v": (50_000,), "b": (7,)}
    if kit == "LazyAllreduce":
        lazy = gflow.LazyAllreduce(threshold_bytes=1 << 18, op="sum", comm=comm)
        grads = {name: np.empty(shape, np.float32) for name, shape in shapes.items()}
        push, flush, op = lambda name: lazy.push(grads[name]), lazy.flush, "sum"
        interrupted = lambda: lazy.flush_interrupted  # noqa: E731
    else:
        dp = gflow.DataParallel(
            {name: np.zeros(shape, np.float32) for name, shape in shapes.items()}, comm=comm
        )
        grads = dp.gradient_buffers()
        push, flush, op = dp.push, dp.synchronize, "mean"
        interrupted = lambda: dp.synchronize_interrupted  # noqa: E731
    late = WORLD.rank == WORLD.size - 1
    for step in range(3):  # a step, the interrupted one, and one after it
        inputs = {name: random_array(rng, shape, np.float32) for name, shape in shapes.items()}
        if step == 1 and late:
            time.sleep(1.5)  # rank 0's flush waits for this rank's segments
        for name in reversed(shapes):  # (backward's order)
            grads[name][...] = inputs[name]
            push(name)
        if step != 1:
            on_all_ranks(flush, f"step {step}")
        else:

            def interrupt_then_push(inputs=inputs):  # (plain asserts: on_all_ranks catches Exception)
                try:
                    with interrupted_after(0.3):
                        flush()
                except Interrupt:
                    pass
                else:
                    raise AssertionError("flush() finished before the interrupt: the late rank was not late")
                assert interrupted()
                try:
                    push("b")
                except RuntimeError as refused:
                    assert "interrupted while it waited" in str(refused), refused
                else:
                    raise AssertionError("a push after the interrupted flush() was taken")
                for name in shapes:  # nothing written yet
                    np.testing.assert_array_equal(grads[name], inputs[name])

            # Rank 0 is interrupted, then flushes again; the others flush once, meanwhile.
            first, then = (interrupt_then_push, flush) if WORLD.rank == 0 else (flush, lambda: None)
            on_all_ranks(first, "rank 0 interrupted in flush(), a push refused; the others' flush()")
            on_all_ranks(then, "rank 0's flush() again")
        on_all_ranks(lambda: None if not interrupted() else 1 / 0, "still interrupted after flush()")
        for name in shapes:
            assert_close_to_reference(grads[name], inputs[name], op)
