"""SparseAllreduce (CSC): equal to dense at density 1, nothing lost, the same chunks everywhere."""

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
from numba import cuda

import gflow

SIZES = [1, 2, 3, 4]


@pytest.mark.parallel(SIZES)
def test_density_one_equals_the_dense_allreduce():
    for n, chunk, op in [(10_007, 100, "mean"), (999, 1000, "sum"), (5, 2, "mean")]:
        csc = gflow.SparseAllreduce(density=1.0, chunk_elems=chunk, op=op)
        for step in range(2):
            g = random_array(rank_rng(n + step), n, np.float32)

            def check(g=g, csc=csc, op=op):
                update = csc(g)
                assert update.shape == g.shape and update.dtype == g.dtype
                assert_close_to_reference(update, g, op)
                assert not csc.residual.any()  # everything was sent

            on_all_ranks(check, f"n={n} chunk={chunk}")


@pytest.mark.parallel(SIZES)
def test_nothing_is_lost_and_every_rank_sends_the_same_chunks():
    # momentum 0: applied updates + all ranks' residuals == all gradients pushed, after any step.
    n, chunk = 10_001, 64  # not a multiple of the chunk length
    for density, compression in [(0.05, None), (0.3, None), (0.1, "fp16")]:
        csc = gflow.SparseAllreduce(density=density, chunk_elems=chunk, op="sum", compression=compression)
        rng = rank_rng(int(density * 100))
        applied = np.zeros(n)
        pushed = np.zeros(n)
        for step in range(12):
            g = random_array(rng, n, np.float32)
            pushed += g
            update = csc(g)
            applied += update
            sent = np.flatnonzero(np.add.reduceat(np.abs(update), np.arange(0, n, chunk)))
            everyone = WORLD.allgather(update.tobytes())

            def check(
                everyone=everyone,
                sent=sent,
                csc=csc,
                step=step,
                pushed=pushed,
                applied=applied,
                compression=compression,
            ):
                assert all(b == everyone[0] for b in everyone), "updates differ between ranks"
                assert (
                    sent.size
                    <= csc.stats["chunks_sent"]
                    == np.ceil(csc.stats["density"] * csc.stats["chunks"])
                )
                all_pushed = np.sum(WORLD.allgather(pushed), axis=0)
                all_residual = np.sum(WORLD.allgather(csc.residual.astype(np.float64)), axis=0)
                tol = 1e-3 if compression is None else 0.05 * WORLD.size * (step + 1)
                np.testing.assert_allclose(applied + all_residual, all_pushed, atol=tol)

            on_all_ranks(check, f"density={density} {compression} step {step}")


@pytest.mark.parallel([1, 3])
def test_warmup_starts_dense_and_falls_to_the_target():
    csc = gflow.SparseAllreduce(density=0.01, chunk_elems=10, warmup_steps=4, momentum=0.9)
    densities = []
    for _ in range(6):
        csc(random_array(rank_rng(1), 10_000, np.float32))
        densities.append(csc.stats["density"])
        assert np.isfinite(csc.residual).all()
    np.testing.assert_allclose(densities, [1, 0.01**0.25, 0.01**0.5, 0.01**0.75, 0.01, 0.01])
    assert csc.stats["chunks_sent"] == 10  # 1% of 1000 chunks


def test_bad_arguments():
    for kwargs, error, match in [
        ({"density": 0}, ValueError, "density must be in"),
        ({"density": 1.5}, ValueError, "density must be in"),
        ({"chunk_elems": 0}, ValueError, "chunk_elems must be >= 1"),
        ({"momentum": 1.0}, ValueError, "momentum"),
        ({"warmup_steps": -1}, ValueError, "warmup_steps"),
        ({"op": "max"}, ValueError, "'mean' or 'sum'"),
        ({"compression": "int8"}, ValueError, "compression"),
    ]:
        with pytest.raises(error, match=match):
            gflow.SparseAllreduce(**kwargs)
    csc = gflow.SparseAllreduce()
    with pytest.raises(TypeError, match="floating"):
        csc(np.ones(10, np.int32))
    csc(np.ones(100, np.float32))
    with pytest.raises(ValueError, match="gradient changed: expected 100 float32"):
        csc(np.ones(101, np.float32))


@pytest.mark.parallel([2, 3])
def test_ranks_that_disagree_fail_together():
    last = WORLD.rank == WORLD.size - 1
    cases = {
        "size": (gflow.SparseAllreduce(chunk_elems=10), 1000 + 10 * last),
        "density": (gflow.SparseAllreduce(density=0.5 if last else 0.1, chunk_elems=10), 1000),
    }
    for case, (csc, n) in cases.items():
        g = np.ones(n, np.float32)
        on_all_ranks(lambda csc=csc, g=g: pytest.raises(gflow.MismatchError, csc, g), case)
    # A size change on one rank: that rank raises ValueError, the others MismatchError; none hangs.
    csc = gflow.SparseAllreduce(chunk_elems=10)
    csc(np.ones(100, np.float32))
    changed = np.ones(110 if last else 100, np.float32)
    on_all_ranks(lambda: pytest.raises(ValueError if last else gflow.MismatchError, csc, changed))


SWAP_CSC = {"density": 0.25, "chunk_elems": 10}


def sparse_step(lazy, *arrays) -> None:
    """One step of `lazy`: push each array, in this order, then flush."""
    for x in arrays:
        lazy.push(x)
    lazy.flush()


def swapped_step_refused(lazy, a, b, shapes: str) -> None:
    """On every rank: a step that pushes copies of b then a (a then b before) raises ValueError naming
    this step's `shapes` (a regular expression)."""

    def check():
        with pytest.raises(ValueError, match=rf"shapes {shapes} of float32, in this step"):
            sparse_step(lazy, b.copy(), a.copy())

    on_all_ranks(check)


@pytest.mark.parallel([1, 2, 3])
def test_a_sparse_step_that_pushes_its_tensors_the_other_way_round_is_refused():
    """Every rank pushes A (100 elements) then B (50), then B then A: the segment's size is the same,
    and A's residual went into B, silently (helper-92). Now ValueError on every rank, before anything
    is sent; the step in the first order then goes on, every residual kept."""
    rng = rank_rng(93)
    lazy = gflow.LazyAllreduce(sparse=SWAP_CSC, op="sum")
    a, b = rng.standard_normal(100).astype(np.float32), rng.standard_normal(50).astype(np.float32)
    sparse_step(lazy, a.copy(), b.copy())
    swapped_step_refused(lazy, a, b, r"\[\(50,\), \(100,\)\]")
    out = [a.copy(), b.copy()]
    sparse_step(lazy, *out)
    assert_same_on_all_ranks(np.concatenate(out))  # (each rank's own residual: none sent twice)
    # A restart from a checkpoint knows the layout too (helper-93: a fresh object took the swap).
    restarted = gflow.LazyAllreduce(sparse=SWAP_CSC, op="sum")
    restarted.load_state_dict(lazy.state_dict())
    swapped_step_refused(restarted, a, b, r"\[\(50,\), \(100,\)\]")
    sparse_step(restarted, a.copy(), b.copy())


@pytest.mark.parallel([1, 2])
def test_a_sparse_step_that_swaps_two_shapes_of_one_size_is_refused():
    """(6, 5) then (5, 6), then (5, 6) then (6, 5): the segment's flat views are alike, the tensors'
    shapes are not (helper-93: the check compared the flat views)."""
    rng = rank_rng(95)
    lazy = gflow.LazyAllreduce(sparse=SWAP_CSC, op="sum")
    a, b = rng.standard_normal((6, 5)).astype(np.float32), rng.standard_normal((5, 6)).astype(np.float32)
    sparse_step(lazy, a.copy(), b.copy())
    swapped_step_refused(lazy, a, b, r"\[\(5, 6\), \(6, 5\)\]")

    def in_float64_refused():  # (the message named the shapes alone, alike: helper-95)
        with pytest.raises(
            ValueError, match=r"\(5, 6\)\] of float64, in this step .*\(5, 6\)\] of float32, in earlier"
        ):
            sparse_step(lazy, a.astype(np.float64), b.astype(np.float64))

    on_all_ranks(in_float64_refused)
    sparse_step(lazy, a.copy(), b.copy())


@pytest.mark.parallel([1, 2, 4])
def test_lazy_allreduce_with_csc_segments():
    sizes = [300, 5, 2000, 17, 900]
    tensors = [random_array(rank_rng(n), n, np.float32) for n in sizes]
    dense = gflow.LazyAllreduce(threshold_bytes=4000, op="mean", sparse={"density": 1.0, "chunk_elems": 64})
    work = [t.copy() for t in tensors]

    def step(lazy=dense, work=work):
        for w in work:
            lazy.push(w)
        lazy.flush()

    on_all_ranks(step)
    for got, x in zip(work, tensors, strict=True):
        on_all_ranks(lambda got=got, x=x: assert_close_to_reference(got, x, "mean"))
    sparse = gflow.LazyAllreduce(
        threshold_bytes=4000, op="sum", compression="fp16", sparse={"density": 0.1, "chunk_elems": 16}
    )
    for _ in range(3):
        work = [t.copy() for t in tensors]
        on_all_ranks(lambda work=work: step(sparse, work))
        everyone = WORLD.allgather(b"".join(w.tobytes() for w in work))
        assert all(b == everyone[0] for b in everyone)
        assert sum(np.count_nonzero(w) for w in work) <= 0.1 * sum(sizes) + 16 * len(sparse._csc) + 16


@pytest.mark.parallel([1, 2])
def test_sparse_on_device_arrays_matches_host():
    g = random_array(rank_rng(3), 700, np.float32)
    on_host, on_device = (
        gflow.SparseAllreduce(density=0.2, chunk_elems=32),
        gflow.SparseAllreduce(density=0.2, chunk_elems=32),
    )

    def check():
        for _ in range(2):
            expected = on_host(g)
            got = on_device(cuda.to_device(g)).copy_to_host()
            np.testing.assert_array_equal(got, expected)

    on_all_ranks(check)
