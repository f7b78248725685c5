"""The error paths keep the README's promises: one test per defect found in review (issue 14), each
reproducing the reviewer's case. Every rank raises (none hangs), nothing pushed is lost or counted twice,
and the next correct call gives the right answer."""

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import WORLD, assert_close_to_reference, on_all_ranks, random_array, rank_rng
from mpi4py import MPI
from numba import cuda

import gflow
from gflow.collectives.dispatch import latency_path_bytes
from gflow.runtime.config import MAX_SMALL_MESSAGE_BYTES

LAST = WORLD.size - 1


def expect(exc_type, fn, match=None):
    with pytest.raises(exc_type, match=match) as info:
        fn()
    return info.value


@pytest.mark.parallel([2, 3])
def test_rejected_async_call_keeps_the_background_channel_in_step():
    # Defect 1: the last rank's async call is rejected locally (uint8); the others' wait() raises.
    # Then steps 2, 3, 4 must give step * size everywhere (they gave 5.0, then hung). The bad rank's
    # error comes from its handle, so every rank's program takes the same path.
    bad = WORLD.rank == LAST

    def failing_step():
        if bad:
            handle = gflow.allreduce_async(np.ones(16, np.uint8))
            expect(TypeError, handle.wait, "unsupported dtype")
        else:
            handle = gflow.allreduce_async(np.ones(16, np.float32))
            expect(gflow.MismatchError, handle.wait, f"rank {LAST} called allreduce with arguments it rej")

    on_all_ranks(failing_step, "rejected async call")
    for step in (2, 3, 4):
        got = gflow.allreduce_async(np.full(16, step, np.float32)).wait(timeout=20)
        on_all_ranks(lambda got=got, step=step: np.testing.assert_array_equal(got, step * WORLD.size))
    # Calls queued behind the rejected one fail alike on every rank (the reviewer's second case: they
    # returned 15 instead of 7, then hung); one rank, then every rank, rejecting.
    for bad_ranks in ({LAST}, set(range(WORLD.size))):
        for _ in range(2):
            first = gflow.allreduce_async(np.ones(4), op="prod" if WORLD.rank in bad_ranks else "sum")
            second = gflow.allreduce_async(np.full(4, 3.0))
            if WORLD.rank in bad_ranks:
                on_all_ranks(lambda first=first: expect(ValueError, first.wait, "op: expected"))
            else:
                on_all_ranks(lambda first=first: expect(gflow.MismatchError, first.wait))
            if len(bad_ranks) < WORLD.size:
                on_all_ranks(lambda second=second: expect(gflow.GflowError, second.wait, "earlier"))
            else:  # all rejected alike: nothing failed collectively, the next call works
                on_all_ranks(lambda s=second: np.testing.assert_array_equal(s.wait(), 3.0 * WORLD.size))
        got = gflow.allreduce_async(np.full(8, 7.0)).wait(timeout=20)
        on_all_ranks(lambda got=got: np.testing.assert_array_equal(got, 7.0 * WORLD.size))


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("threshold", [8, 1_000_000])  # (a segment per push, or one at flush())
def test_a_rejection_met_by_a_metric_inside_the_step_fails_that_step_alone(threshold):
    # helper-78: rank 0's push fails its checks in step 1, and every rank reduces a metric inside
    # that step and waits for it, tolerating its failure. Rank 0's rejection met the others' metric;
    # the wait replaced the channel mid-step, and the rest of their step 1, sent on the fresh one,
    # met rank 0's step 2: batch k against k + 1 for ever, silently (or every later step failed).
    # Now a step whose channel was replaced sends nothing more: step 1 fails on every rank and every
    # other step is the float64 sum of that step's gradients.
    comm = WORLD.Dup()
    lazy = gflow.LazyAllreduce(threshold_bytes=threshold, op="sum", comm=comm)
    rng = rank_rng(78)
    steps = [[random_array(rng, 3, np.float64) for _ in range(3)] for _ in range(4)]
    everyone = WORLD.allgather(steps)
    failed = []
    for step, grads in enumerate(steps):
        pushed = [g.copy() for g in grads]
        try:
            for i, g in enumerate(pushed):
                lazy.push(g.astype(np.int8) if (step == 1 and WORLD.rank == 0 and i == 0) else g)
                if step == 1 and i == 0:  # the metric, inside the step, on every rank
                    with pytest.raises(gflow.GflowError):
                        gflow.allreduce_async(np.ones(2), comm=comm).wait()
            lazy.flush()
        except (gflow.GflowError, TypeError):
            failed.append(step)
            continue
        for i, g in enumerate(pushed):
            want = sum(everyone[r][step][i] for r in range(WORLD.size))
            np.testing.assert_allclose(g, want, rtol=1e-12, err_msg=f"step {step}, push {i}")
    assert failed == [1], failed
    WORLD.Barrier()


@pytest.mark.parallel([2, 3])
def test_sparse_agreement_covers_the_gradient_size():
    # Defect 2: 2000 vs 2001 elements give the same number of 1024-element chunks, and at density 0.5
    # the short last chunk may not be selected: the ranks still disagree and must all raise.
    n = 2001 if WORLD.rank == LAST else 2000
    csc = gflow.SparseAllreduce(density=0.5, chunk_elems=1024, op="sum")
    grad = random_array(rank_rng(2), n, np.float32)
    grad[:1024] *= 100  # the first chunk is the one selected, not the short last one
    on_all_ranks(lambda: expect(gflow.MismatchError, lambda: csc(grad), f"a gradient of {n} float32"))
    assert csc.residual is None and csc.step_count == 0


@pytest.mark.parallel([2, 3])
def test_sparse_lazy_recovers_after_a_push_mismatch():
    # Defect 3: the last rank pushes one tensor more in step 1; steps 2 and 3 must then work (they
    # failed forever: a residual had been allocated at that rank's size).
    sizes = [300, 40, 500]
    settings = dict(threshold_bytes=1200, op="sum", sparse={"density": 0.5, "chunk_elems": 16})
    lazy, twin = gflow.LazyAllreduce(**settings), gflow.LazyAllreduce(**settings)
    rng = rank_rng(3)
    step1 = [random_array(rng, n, np.float32) for n in sizes + ([70] if WORLD.rank == LAST else [])]
    kept = [t.copy() for t in step1]

    def failing_step():
        for t in step1:
            lazy.push(t)
        expect(gflow.GflowError, lazy.flush)
        for t, k in zip(step1, kept, strict=True):
            np.testing.assert_array_equal(t, k)

    on_all_ranks(failing_step, "one tensor more")
    for step in (2, 3):
        grads = [random_array(rng, n, np.float32) for n in sizes]
        mine, theirs = [g.copy() for g in grads], [g.copy() for g in grads]
        on_all_ranks(
            lambda mine=mine, theirs=theirs: push_step(lazy, mine) or push_step(twin, theirs), f"{step}"
        )
        for a, b in zip(mine, theirs, strict=True):
            np.testing.assert_array_equal(a, b)


def push_step(lazy, tensors):
    for t in tensors:
        lazy.push(t)
    lazy.flush()


def residuals(lazy):
    return {i: (csc.residual.copy(), csc.step_count) for i, csc in sorted(lazy._csc.items())}


@pytest.mark.parallel([2, 3])
def test_failed_sparse_lazy_step_neither_loses_nor_doubles():
    # Defect 4: segment 0 succeeds, then the step fails (the last rank pushes a different size into
    # segment 1, which it refuses: its residual has the old size): every residual must be as before
    # the step, so a retry counts each gradient once.
    settings = dict(threshold_bytes=400, op="sum", sparse={"density": 0.25, "chunk_elems": 8})
    lazy, twin = gflow.LazyAllreduce(**settings), gflow.LazyAllreduce(**settings)
    rng = rank_rng(4)
    warm = [random_array(rng, n, np.float32) for n in (100, 100)]
    on_all_ranks(
        lambda: push_step(lazy, [w.copy() for w in warm]) or push_step(twin, [w.copy() for w in warm])
    )
    before = residuals(lazy)
    grads = [random_array(rng, n, np.float32) for n in (100, 100)]
    bad = [grads[0].copy(), np.ones(101 if WORLD.rank == LAST else 100, np.float32)]
    error = ValueError if WORLD.rank == LAST else gflow.MismatchError
    on_all_ranks(lambda: expect(error, lambda: push_step(lazy, bad)), "segment 1 mismatch")
    after = residuals(lazy)
    assert before.keys() == after.keys()
    for i in before:
        np.testing.assert_array_equal(after[i][0], before[i][0])
        assert after[i][1] == before[i][1]
    np.testing.assert_array_equal(bad[0], grads[0])  # the pushed array kept its local value
    # The retry: bitwise what the twin, which never saw the failed step, does.
    mine, theirs = [g.copy() for g in grads], [g.copy() for g in grads]
    on_all_ranks(lambda: push_step(lazy, mine) or push_step(twin, theirs), "retry")
    for a, b in zip(mine, theirs, strict=True):
        np.testing.assert_array_equal(a, b)
    for i, (r, count) in residuals(lazy).items():
        np.testing.assert_array_equal(r, twin._csc[i].residual)
        assert count == twin._csc[i].step_count


def sparse_step(obj, g):
    """One step of a SparseAllreduce, or of a LazyAllreduce(sparse=...) pushed g alone: the update."""
    if isinstance(obj, gflow.SparseAllreduce):
        return obj(g)
    work = g.copy()
    push_step(obj, [work])
    return work


def sparse_state(obj):
    csc = obj if isinstance(obj, gflow.SparseAllreduce) else obj._csc[0]
    return csc.residual.copy(), csc.step_count


@pytest.mark.parallel([2, 3])
def test_fp16_sparse_never_overflows_and_a_nan_fails_one_step_only():
    # Defect 5: 40000 on every rank, op="sum": the float16 sum would overflow. It used to raise, keep
    # the values in the residual and raise again on every later step.
    for op in ("sum", MPI.SUM):
        csc = gflow.SparseAllreduce(density=1.0, chunk_elems=64, op=op, compression="fp16")
        big = np.full(1000, 40000.0, np.float32)
        for _ in range(3):
            update = csc(big)
            on_all_ranks(lambda u=update: np.testing.assert_allclose(u, 40000.0 * WORLD.size, rtol=2**-10))
    # A NaN on one rank: every rank raises, nothing changes, and the next finite step works.
    settings = dict(op="sum", compression="fp16")
    sparse = {"density": 0.5, "chunk_elems": 16}
    nan_fails_one_step_only(lambda: gflow.SparseAllreduce(**sparse, **settings))
    nan_fails_one_step_only(lambda: gflow.LazyAllreduce(threshold_bytes=64, sparse=sparse, **settings))


def nan_fails_one_step_only(make):
    same = np.testing.assert_array_equal
    obj, twin = make(), make()
    rng = rank_rng(5)
    first = random_array(rng, 500, np.float32)
    on_all_ranks(lambda: same(sparse_step(obj, first), sparse_step(twin, first)))
    before = sparse_state(obj)
    poisoned = random_array(rng, 500, np.float32)
    if WORLD.rank == LAST:
        poisoned[7] = np.nan
    on_all_ranks(
        lambda: expect(gflow.CompressionOverflowError, lambda: sparse_step(obj, poisoned), "inf or NaN"),
        type(obj).__name__,
    )
    after = sparse_state(obj)
    np.testing.assert_array_equal(after[0], before[0])
    assert after[1] == before[1] == 1
    following = random_array(rng, 500, np.float32)
    on_all_ranks(
        lambda: np.testing.assert_array_equal(sparse_step(obj, following), sparse_step(twin, following))
    )


@pytest.mark.parallel([1, 2])
def test_fp16_sparse_keeps_its_rounding_in_the_residual():
    # "Also": what float16 could not carry stays in the residual. At p = 1 there is no float16 sum to
    # round, so applied + residual equals what was pushed to float32 precision (0.2 gave 0.19995).
    csc = gflow.SparseAllreduce(density=0.3, chunk_elems=10, op="mean", compression="fp16")
    rng = rank_rng(6)
    applied, pushed = np.zeros(1000), np.zeros(1000)
    for _ in range(5):
        g = random_array(rng, 1000, np.float32) + np.float32(0.2)
        pushed += g
        applied += csc(g)
    everyone = np.sum(WORLD.allgather(pushed), axis=0) / WORLD.size
    residuals_mean = np.sum(WORLD.allgather(csc.residual.astype(np.float64)), axis=0) / WORLD.size
    err = np.abs(applied + residuals_mean - everyone)
    # float32 arithmetic on values of ~20 over 5 steps; at p > 1 also the float16 sums' own rounding.
    tol = 1e-5 * 5 * 20 if WORLD.size == 1 else 5 * 2**-11 * np.abs(everyone).max()
    on_all_ranks(lambda: np.testing.assert_array_less(err, tol))


@pytest.mark.parallel([2, 3])
def test_pool_views_keep_their_values_after_a_mismatch():
    # Defect 6: gradients living in the pool (gradient_buffers) were reduced in place before the final
    # agreement failed: rank 0 read 3.0 where its local value was 1.0.
    lazy = gflow.LazyAllreduce(threshold_bytes=4 * 100, op="sum")
    grads = lazy.gradient_buffers([(100,), (100,)])
    for g in grads:
        g[...] = WORLD.rank + 1.0
    extra = [np.ones(5, np.float32)] if WORLD.rank == LAST else []
    on_all_ranks(lambda: expect(gflow.GflowError, lambda: push_step(lazy, grads + extra)), "one tensor more")
    for g in grads:
        np.testing.assert_array_equal(g, WORLD.rank + 1.0)
    on_all_ranks(lambda: push_step(lazy, grads), "next step")
    for g in grads:
        np.testing.assert_array_equal(g, sum(range(1, WORLD.size + 1)))


@pytest.mark.parallel([2, 3])
def test_one_rank_with_a_non_contiguous_device_array_fails_every_rank():
    # Defect 7: the contiguity check ran after the agreement, outside the reject path: peers hung.
    base = cuda.to_device(np.arange(64, dtype=np.float32).reshape(16, 4))
    x = base[:, 1] if WORLD.rank == LAST else cuda.to_device(np.ones(16, np.float32))
    for call in (gflow.allreduce, gflow.reduce_scatter, gflow.allgather, gflow.broadcast):
        if WORLD.rank == LAST:
            on_all_ranks(lambda call=call: expect(ValueError, lambda: call(x), "C-contiguous"), call.__name__)
        else:
            on_all_ranks(
                lambda call=call: expect(gflow.MismatchError, lambda: call(x), "rejected"), call.__name__
            )
    y = gflow.allreduce(cuda.to_device(np.full(16, 2.0, np.float32))).copy_to_host()
    on_all_ranks(lambda: np.testing.assert_array_equal(y, 2.0 * WORLD.size))


class Sub(np.ndarray):
    """A user's ndarray subclass, as trivial as they come."""


@pytest.mark.parallel([2, 3])
def test_ndarray_subclasses_work_and_unexpected_check_errors_reach_the_peers(tmp_path_factory):
    # Defect 8: any ndarray subclass failed with AttributeError on that rank, and its peers hung.
    x = random_array(rank_rng(8), (30, 7), np.float32)
    path = tmp_path_factory.mktemp(f"rank{WORLD.rank}") / "m.dat"
    mapped = np.memmap(path, dtype=np.float32, mode="w+", shape=x.shape)
    mapped[...] = x
    for kind, arr in (("memmap", mapped), ("subclass", x.view(Sub)), ("matrix", np.asmatrix(x))):

        def check(arr=arr):
            assert_close_to_reference(gflow.allreduce(arr), x, "sum")
            assert_close_to_reference(gflow.allreduce_async(arr, "mean").wait(), x, "mean")
            np.testing.assert_array_equal(gflow.reduce_scatter(arr), gflow.reduce_scatter(x))
            np.testing.assert_array_equal(gflow.allgather(arr), gflow.allgather(x))
            np.testing.assert_array_equal(gflow.broadcast(arr), gflow.broadcast(x))
            out = np.empty_like(arr)
            assert gflow.allreduce(arr, out=out) is out
            assert_close_to_reference(np.asarray(out), x, "sum")

        on_all_ranks(check, kind)

    class Exploding:
        """Asking for its __cuda_array_interface__ raises something other than TypeError/ValueError."""

        @property
        def __cuda_array_interface__(self):
            raise RuntimeError("driver says no")

    if WORLD.rank == LAST:
        on_all_ranks(lambda: expect(RuntimeError, lambda: gflow.allreduce(Exploding()), "driver says no"))
    else:
        on_all_ranks(lambda: expect(gflow.MismatchError, lambda: gflow.allreduce(np.ones(3)), "rejected"))
    on_all_ranks(lambda: np.testing.assert_array_equal(gflow.allreduce(np.ones(3)), WORLD.size))


@pytest.mark.parallel([2, 3])
def test_read_only_out_is_refused_before_any_data_moves():
    # Defect 9: a read-only out= passed the checks; that rank raised partway through the ring and its
    # peers hung.
    x = random_array(rank_rng(9), 100_000, np.float32)  # ring-sized
    out = np.zeros_like(x)
    if WORLD.rank == LAST:
        out.flags.writeable = False
        on_all_ranks(lambda: expect(ValueError, lambda: gflow.allreduce(x, out=out), "read-only"))
    else:
        on_all_ranks(lambda: expect(gflow.MismatchError, lambda: gflow.allreduce(x, out=out), "rejected"))
    readonly_x = x.copy()
    readonly_x.flags.writeable = False
    on_all_ranks(lambda: expect(ValueError, lambda: gflow.allreduce(readonly_x, out=readonly_x), "read-only"))
    lazy = gflow.LazyAllreduce()
    on_all_ranks(lambda: expect(ValueError, lambda: push_step(lazy, [readonly_x]), "read-only"))
    on_all_ranks(lambda: assert_close_to_reference(gflow.allreduce(x), x, "sum"))


def test_loss_scaler_unscales_non_contiguous_arrays_in_place():
    # Defect 10: it unscaled a copy and left the strided array as it was.
    scaler = gflow.LossScaler(init_scale=4.0)
    for dtype in (np.float32, np.float16):
        base = np.full((6, 4), 8.0, dtype)
        view = base[:, ::2]
        assert scaler.unscale(view) is False
        np.testing.assert_array_equal(base[:, ::2], 2.0)
        np.testing.assert_array_equal(base[:, 1::2], 8.0)  # the rest untouched
        view[0, 0] = np.inf
        assert scaler.unscale(view) is True
    frozen = np.ones(4, np.float32)
    frozen.flags.writeable = False
    expect(ValueError, lambda: scaler.unscale(frozen), "read-only")
    expect(TypeError, lambda: scaler.unscale(np.ones(4, np.int32)), "floating")


@pytest.mark.parallel([1, 2])
def test_sparse_paths_accept_mpi_ops():
    # "Also": the docs accept MPI ops; SparseAllreduce and LazyAllreduce(sparse=...) rejected MPI.SUM.
    g = random_array(rank_rng(10), 300, np.float32)
    dense = gflow.allreduce(g, "sum")
    csc = gflow.SparseAllreduce(density=1.0, chunk_elems=16, op=MPI.SUM)
    on_all_ranks(lambda: np.testing.assert_allclose(csc(g), dense, rtol=1e-6, atol=1e-5))
    lazy = gflow.LazyAllreduce(op=MPI.SUM, sparse={"density": 1.0, "chunk_elems": 16})
    work = g.copy()
    on_all_ranks(lambda: push_step(lazy, [work]))
    np.testing.assert_allclose(work, dense, rtol=1e-6, atol=1e-5)
    expect(ValueError, lambda: gflow.SparseAllreduce(op=MPI.MAX), "'mean' or 'sum'")


# What the review of the fixes above found, one reproducer each.


@pytest.mark.parallel([2, 3])
def test_a_strided_push_after_good_pushes_fails_every_rank():
    # The push fast path (dtype already checked) skipped the layout check's reject path: peers hung.
    lazy = gflow.LazyAllreduce(threshold_bytes=10**6, op="sum")
    good = np.ones(100, np.float32)
    strided = np.ones(200, np.float32)[::2] if WORLD.rank == LAST else np.ones(100, np.float32)
    error = ValueError if WORLD.rank == LAST else gflow.MismatchError
    on_all_ranks(lambda: expect(error, lambda: push_step(lazy, [good, strided])), "strided second push")
    np.testing.assert_array_equal(good, 1.0)
    again = [np.ones(100, np.float32), np.ones(100, np.float32)]
    on_all_ranks(lambda: push_step(lazy, again), "next step")
    np.testing.assert_array_equal(again[1], WORLD.size)


@pytest.mark.parallel([2, 3])
def test_sparse_refuses_float16_on_one_rank_without_hanging():
    # float16 passed the dtype check, then the host kernel raised NotImplementedError outside the
    # reject path: the peers hung in the norms exchange.
    g = np.ones(64, np.float16 if WORLD.rank == LAST else np.float32)
    csc = gflow.SparseAllreduce(density=0.5, chunk_elems=8)
    error = TypeError if WORLD.rank == LAST else gflow.MismatchError
    on_all_ranks(lambda: expect(error, lambda: csc(g)))
    on_all_ranks(lambda: np.testing.assert_array_equal(csc(np.ones(64, np.float32)).sum(), 64 * 0.5))


@pytest.mark.parallel([2, 3])
def test_sparse_sends_huge_and_tiny_finite_gradients():
    # float32 chunk norms overflowed on finite values (2e38, or 1e36 x 1024 in one chunk) and the step
    # was refused as NaN/inf forever; gradients of 1e-9 were never sent with fp16 (the scale only
    # went down).
    for g, compression, op in [
        (np.full(4, 2e38, np.float32), "fp16", "mean"),
        (np.full(1024, 1e36, np.float32), "fp16", "sum"),
        (np.full(64, 1e300), None, "sum"),
        (np.full(64, 1e-9, np.float32), "fp16", "sum"),
        # second review: norms at and beyond float32's reach: scaled hard, or sent uncompressed
        (np.full(1024, 1e29, np.float32), "fp16", "sum"),
        (np.full(4, 1e32), "fp16", "sum"),
        (np.full(16, 1e300), "fp16", "mean"),
        # helper-44: uncompressed, a float32 mean that fits, of values whose sum does not, came back inf
        (np.full(64, 2.5e38, np.float32), None, "mean"),
        # ... and float64 past float32's norms keeps sum-then-divide, exact (helper-45: a float32 scale
        # 1/3 made it 3e-8 off)
        (np.full(64, 1e300) * (WORLD.rank + 1), None, "mean"),
    ]:
        chunk = min(1024, g.size)
        csc = gflow.SparseAllreduce(density=1.0, chunk_elems=chunk, op=op, compression=compression)
        expected = WORLD.allreduce(g.astype(np.float64)) / (1 if op == "sum" else WORLD.size)
        rtol = 1e-15 if g.dtype == np.float64 and compression is None else 2**-10
        on_all_ranks(lambda csc=csc, g=g, e=expected, t=rtol: np.testing.assert_allclose(csc(g), e, rtol=t))
    # ... and such a sum was applied as inf (a LossScaler never heard of it): now refused on every rank,
    # nothing lost
    csc = gflow.SparseAllreduce(density=0.5, chunk_elems=8, op="sum")
    small = [rank_rng(5 + step).uniform(0.5, 1.5, 64).astype(np.float32) for step in range(2)]
    applied = csc(small[0]).astype(np.float64)
    before = csc.residual.copy()
    huge = np.full(64, 2.5e38, np.float32)
    on_all_ranks(lambda: expect(gflow.NonFiniteError, lambda: csc(huge), "passed the range of float32"))
    np.testing.assert_array_equal(csc.residual, before)  # the step left no trace
    applied += csc(small[1])
    unsent = WORLD.allreduce(csc.residual.astype(np.float64))
    pushed = WORLD.allreduce(small[0].astype(np.float64) + small[1])
    np.testing.assert_allclose(applied + unsent, pushed, rtol=1e-6)


@pytest.mark.parallel([2])
def test_gradient_buffers_with_sparse_fp16():
    # The pool holds full precision when segments are sparse, so it was refused for the wrong reason.
    lazy = gflow.LazyAllreduce(op="sum", compression="fp16", sparse={"density": 1.0, "chunk_elems": 16})
    (grad,) = lazy.gradient_buffers([(40,)])
    grad[...] = 2.0
    on_all_ranks(lambda: push_step(lazy, [grad]))
    np.testing.assert_allclose(grad, 2.0 * WORLD.size)


@pytest.mark.parallel([2])
def test_freeing_a_communicator_used_only_for_async_calls():
    # Completing gflow's pending duplicate at exit completed the user's deferred Comm_free, whose
    # attribute callback freed the same context again inside MPI: MPICH aborted the job at exit.
    for _ in range(3):
        comm = WORLD.Dup()
        got = gflow.allreduce_async(np.ones(4), comm=comm).wait(timeout=20)
        comm.Free()
        np.testing.assert_array_equal(got, WORLD.size)


@pytest.mark.parallel([2])
def test_waiting_on_an_old_failed_handle_leaves_a_newer_channel_alone():
    # Second review: waiting on an old failed handle reset whatever background channel was current, if
    # it was marked failed by then: a newer channel failing too was reset on some ranks only (timing),
    # and from then on async results paired with the wrong calls, then hung.
    x = np.ones(4, np.float32)
    bad = x.astype(np.int8) if WORLD.rank == 0 else x
    first, behind_first = gflow.allreduce_async(bad), gflow.allreduce_async(x)
    on_all_ranks(lambda: expect((TypeError, gflow.MismatchError), first.wait))
    second = gflow.allreduce_async(bad)  # on a fresh channel, failing too
    if WORLD.rank == 0:
        time.sleep(0.5)  # here the second failure is marked before the old handle is waited on
    on_all_ranks(lambda: expect(gflow.GflowError, behind_first.wait, "earlier"))
    behind_second = gflow.allreduce_async(x)  # queued behind the second failure: fails everywhere
    on_all_ranks(lambda: expect((TypeError, gflow.MismatchError), second.wait))
    on_all_ranks(lambda: expect(gflow.GflowError, behind_second.wait, "earlier"))
    on_all_ranks(lambda: np.testing.assert_array_equal(gflow.allreduce_async(x).wait(10), WORLD.size))


@pytest.mark.parallel([2, 3])
def test_allreduce_compares_shapes_not_only_element_counts():
    # Found with gflow.torch (issue 8): (2, 3) on one rank against (3, 2) elsewhere reduced silently,
    # where Horovod fails on a shape mismatch. Blocking, async, fp16 and the latency and ring paths.
    shape = (3, 2) if WORLD.rank == LAST else (2, 3)
    for n, call in [
        (1, lambda x: gflow.allreduce(x)),
        (1, lambda x: gflow.allreduce_async(x).wait()),
        (1, lambda x: gflow.allreduce(x, "mean", compression="fp16")),
        (40000, lambda x: gflow.allreduce(x, algorithm="ring")),
    ]:
        x = random_array(rank_rng(60), (shape[0] * n, shape[1]), np.float32)

        def mismatch(call=call, x=x):
            expect(gflow.MismatchError, lambda: call(x), f"shape \\({x.shape[0]}, {x.shape[1]}\\)")

        on_all_ranks(mismatch, "shape mismatch")
        y = gflow.allreduce(x.reshape(-1))  # flat on every rank: same shape, fine
        assert_close_to_reference(y, x.reshape(-1), "sum")


@pytest.mark.parallel([2, 3])
def test_broadcast_and_allgather_compare_shapes_not_only_sizes():
    # Review B, defects 1 and 2: broadcast agreed on the size only, so (2, 3) against (3, 2) came back
    # silently reshaped; allgather agreed on the row's length only, so (2, 3, 2) against (2, 2, 3)
    # concatenated mixed rows. Every rank raises, naming this rank's shape; the next call works.
    bad = WORLD.rank == LAST
    x = random_array(rank_rng(70), (3, 2) if bad else (2, 3), np.float32)
    g = random_array(rank_rng(71), (2, 2, 3) if bad else (2, 3, 2), np.float64)
    for call, arg in [
        (lambda a: gflow.broadcast(a, root=0), x),
        (lambda a: gflow.broadcast(a, root=LAST, out=a), x),  # in place
        (lambda a: gflow.allgather(a), g),
    ]:
        before = arg.copy()

        def mismatch(call=call, arg=arg):
            named = "This rank passed an array of shape \\(" + ", ".join(str(n) for n in arg.shape)
            expect(gflow.MismatchError, lambda: call(arg), named)

        on_all_ranks(mismatch, "shape mismatch")
        on_all_ranks(lambda arg=arg, before=before: np.testing.assert_array_equal(arg, before))
    # Same shapes everywhere: the next calls give MPI's answers.
    y = random_array(rank_rng(72), (2, 3), np.float32)
    expected = WORLD.bcast(y, root=LAST)
    on_all_ranks(lambda: np.testing.assert_array_equal(gflow.broadcast(y, root=LAST), expected))
    rows = random_array(rank_rng(73), (WORLD.rank + 1, 3, 2), np.float64)
    expected = np.concatenate(WORLD.allgather(rows))
    on_all_ranks(lambda: np.testing.assert_array_equal(gflow.allgather(rows), expected))


@pytest.mark.parallel([2, 3])
def test_lazy_push_order_checksum_covers_shapes():
    # Review B, defect 4: the push-order checksum covered sizes and dtypes only, so a (6, 4) gradient
    # on one rank met a (4, 6) one elsewhere (DistributedOptimizer with a transposed parameter) and
    # was reduced as if they matched. Every rank's flush() raises; nothing pushed changes; the next
    # step (same shapes everywhere) gives the sum.
    bad = WORLD.rank == LAST
    lazy = gflow.LazyAllreduce(threshold_bytes=64, op="sum")
    for sizes in ([(4, 6) if bad else (6, 4), (5,)], [(5,), (4, 6) if bad else (6, 4)]):
        grads = [random_array(rank_rng(74), shape, np.float32) for shape in sizes]
        before = [g.copy() for g in grads]
        for g in grads:
            lazy.push(g)
        on_all_ranks(lambda: expect(gflow.MismatchError, lazy.flush, "push-order checksum"), "mismatch")
        for g, b in zip(grads, before, strict=True):
            on_all_ranks(lambda g=g, b=b: np.testing.assert_array_equal(g, b), "unchanged")
    grads = [random_array(rank_rng(75), shape, np.float32) for shape in [(6, 4), (5,)]]
    inputs = [g.copy() for g in grads]
    for g in grads:
        lazy.push(g)
    on_all_ranks(lazy.flush, "the next step")
    for g, x in zip(grads, inputs, strict=True):
        assert_close_to_reference(g, x, "sum")


@pytest.mark.parallel([1, 2, 3])
def test_an_out_that_overlaps_x_in_part_is_refused():
    # Review of issue 9, found along the way: out=buf[1:] with x=buf[:n] gave wrong elements on the
    # ring (it reads x while writing out). Now a ValueError on that rank before any data moves, the
    # peers' MismatchError, and the next call works; out=x and views of exactly x stay in place.
    n = 300_000
    buf = random_array(rank_rng(76), n + 1, np.float64)
    x = buf[:n]
    mine = WORLD.rank == LAST
    error = ValueError if mine or WORLD.size == 1 else gflow.MismatchError
    call = (lambda: gflow.allreduce(x, out=buf[1:])) if mine else (lambda: gflow.allreduce(x))
    on_all_ranks(lambda: expect(error, call, "overlaps x in part" if error is ValueError else "disagree"))
    expected = gflow.allreduce(x)
    same = x.view()
    on_all_ranks(lambda: np.testing.assert_array_equal(gflow.allreduce(x, out=same), expected))


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("setting", [2**21, MAX_SMALL_MESSAGE_BYTES])
def test_ranks_with_another_small_message_bytes_fail_together(monkeypatch, setting):
    # Review of issue 9, found along the way: the last rank's larger small_message_bytes sent it down
    # the latency path with a longer message than its peers' receives; the truncation came back as
    # ERR_IN_STATUS, which the agreement took for an MPI failure (GflowError on one rank, MismatchError
    # on the other) and left a persistent request active, so the next call died in MPI_Startall. On
    # Open MPI (issue 12) the truncated receive overran its buffer and the job hung or crashed: now
    # every receive has room for the largest setting, and the headers say the ranks disagree.
    x = random_array(rank_rng(77), setting // 4, np.float32)  # the largest payload `setting` allows
    others = latency_path_bytes(WORLD.size)  # (at p = 2, 16x small_message_bytes: dispatch.py)
    if WORLD.rank == LAST:
        monkeypatch.setattr(gflow.config, "small_message_bytes", setting)
    if x.nbytes > others:  # the last rank alone takes the latency path: the message points at the setting
        said = r"disagree on the algorithm \(as passed, or as chosen by gflow.config's settings: small_"
        on_all_ranks(lambda: expect(gflow.MismatchError, lambda: gflow.allreduce(x), said))
    else:  # every rank takes it (receives have room for either): the right answer, alike
        on_all_ranks(lambda: assert_close_to_reference(gflow.allreduce(x), x, "sum"))
    monkeypatch.undo()
    on_all_ranks(lambda: assert_close_to_reference(gflow.allreduce(x), x, "sum"))


@pytest.mark.parametrize("value", [MAX_SMALL_MESSAGE_BYTES + 1, -1, 1.5, True, "4096", None, np.array([5])])
def test_small_message_bytes_larger_than_any_receive_is_refused_when_set(monkeypatch, value):
    # Refused on the rank that sets it, before any message: its peers' receives could not hold it.
    before = gflow.config.small_message_bytes
    with pytest.raises(
        ValueError, match=r"small_message_bytes .* from 0 to 4194304 .*got " + re.escape(repr(value))
    ):
        monkeypatch.setattr(gflow.config, "small_message_bytes", value)
    assert gflow.config.small_message_bytes == before


def test_small_message_bytes_from_the_environment_is_checked_too():
    done = subprocess.run(
        [sys.executable, "-c", "import gflow"],
        env=dict(os.environ, GFLOW_SMALL_MESSAGE_BYTES="8388608"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "GFLOW_SMALL_MESSAGE_BYTES" in done.stderr and "8388608" in done.stderr


@pytest.mark.parametrize(
    "value, said",
    [("-1", "GFLOW_BACKGROUND_POLL_US must be a whole number of microseconds >= 1, got '-1'"),
     ("0", "microseconds >= 1, got '0'"), ("abc", "microseconds >= 1, got 'abc'")],
)  # fmt: skip
def test_the_background_poll_from_the_environment_is_checked_at_import(value, said):
    # helper-48: -1 was accepted, and the first async call's wait died ("sleep length must be
    # non-negative"); 0 made the background thread spin; 'abc' was called a number of bytes.
    done = subprocess.run(
        [sys.executable, "-c", "import gflow"],
        env=dict(os.environ, GFLOW_BACKGROUND_POLL_US=value),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and said in done.stderr, done.stderr


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("algorithm", ["ring", "auto", "hierarchical"])
def test_ranks_with_another_ring_segment_fail_together(monkeypatch, algorithm):
    # Review of issue 12: ring_segment_bytes was not in what the ranks agree on, so a rank cutting
    # the ring's messages smaller truncated its peers' (Open MPI then crashed: SIGABRT, SIGSEGV).
    x = random_array(rank_rng(91), 1_000_000, np.float32)
    if WORLD.rank == LAST:
        monkeypatch.setattr(gflow.config, "ring_segment_bytes", 1024)
    on_all_ranks(
        lambda: expect(gflow.MismatchError, lambda: gflow.allreduce(x, algorithm=algorithm), "ring_segment")
    )
    monkeypatch.undo()
    on_all_ranks(lambda: assert_close_to_reference(gflow.allreduce(x, algorithm=algorithm), x, "sum"))


def test_a_ring_segment_of_no_bytes_is_refused_when_set(monkeypatch):
    with pytest.raises(ValueError, match=r"ring_segment_bytes \(GFLOW_RING_SEGMENT_BYTES\) .* >= 1, got 0"):
        monkeypatch.setattr(gflow.config, "ring_segment_bytes", 0)
