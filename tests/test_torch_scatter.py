"""gflow.torch's alltoall, reducescatter, grouped_allgather and grouped_reducescatter (Horovod's) against
MPI's own collectives and float64 references, their gradients against Horovod's definitions, and their
errors, at world sizes 1 to 4."""

import numpy as np
import pytest
import torch
from helpers import WORLD, on_all_ranks, rank_rng
from mpi4py import MPI

import gflow
import gflow.torch as hvd

torch.set_num_threads(1)
SIZES = [1, 2, 3]  # (4 ranks: the core collectives test it; the torch layer adds no 4-rank path)
ANY_DTYPES = (torch.float32, torch.float64, torch.float16, torch.int32, torch.uint8, torch.int16, torch.bool)
REDUCED = (torch.float32, torch.float64, torch.int32, torch.int64, torch.int16, torch.uint8)


@pytest.fixture(autouse=True)
def _init():
    hvd.init()


def random_tensor(rng, shape, dtype):
    if dtype.is_floating_point:
        return torch.from_numpy(rng.standard_normal(shape) * 3).to(dtype)
    if dtype == torch.bool:
        return torch.from_numpy(rng.integers(0, 2, shape).astype(bool))
    return torch.from_numpy(rng.integers(0, 40, shape)).to(dtype)


def mpi_sum(x: torch.Tensor) -> np.ndarray:
    """MPI's own Allreduce of x in float64 (integers: exact)."""
    out = np.empty(x.shape)
    WORLD.Allreduce(np.ascontiguousarray(x.numpy().astype(np.float64)), out, MPI.SUM)
    return out


@pytest.mark.parallel(SIZES)
def test_alltoall_against_mpis_alltoall_for_every_dtype():
    rng = rank_rng(3)
    cases = []
    for dtype in ANY_DTYPES:
        for tail in [(), (3,), (2, 2)]:
            splits = rng.integers(0, 4, WORLD.size)
            cases.append((random_tensor(rng, (int(splits.sum()), *tail), dtype), splits))

    def check():
        for x, splits in cases:
            before = x.clone()
            for given in (splits.tolist(), torch.tensor(splits, dtype=torch.int32)):
                out, received = hvd.alltoall(x, given)
                starts = np.concatenate(([0], np.cumsum(splits)))
                pieces = WORLD.alltoall([x[starts[d] : starts[d + 1]].numpy() for d in range(WORLD.size)])
                assert out.dtype == x.dtype and out.shape == (sum(len(p) for p in pieces), *x.shape[1:])
                np.testing.assert_array_equal(out.numpy(), np.concatenate(pieces))
                assert received.dtype == torch.int32 and received.tolist() == [len(p) for p in pieces]
            assert torch.equal(x, before), "the input was modified"
            equal = x[:1].repeat(WORLD.size, *([1] * (x.dim() - 1))) if len(x) else None
            if WORLD.allreduce(equal is None, op=MPI.LOR):
                continue
            out = hvd.alltoall(equal)  # no splits: the output alone, as Horovod returns it
            assert isinstance(out, torch.Tensor)
            np.testing.assert_array_equal(out.numpy(), np.stack(WORLD.alltoall(list(equal.numpy()))))
            out, received = hvd.synchronize(hvd.alltoall_async(equal, name="eq"))
            assert received.tolist() == [1] * WORLD.size

    on_all_ranks(check)


@pytest.mark.parallel(SIZES)
def test_reducescatter_against_mpis_allreduce_split_by_rows():
    rng = rank_rng(4)
    cases = [
        (random_tensor(rng, (rows, *tail), dtype), op, pre, post)
        for dtype in REDUCED
        for rows, tail in [(1, ()), (5, (3,)), (8, (2, 2)), (0, (2,))]
        for op, pre, post in [(hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Sum, 0.5, 3.0)]
    ]

    def check():
        for x, op, pre, post in cases:
            kw = dict(op=op, prescale_factor=pre, postscale_factor=post)
            got = hvd.reducescatter(x, **kw)
            if x.dtype.is_floating_point:
                full = post * mpi_sum(x * pre) / (WORLD.size if op == hvd.Average else 1)
            else:  # Horovod's integer scaling: truncated products, the average a truncated division
                summed = mpi_sum(torch.from_numpy(np.trunc(x.numpy().astype(np.float64) * pre)))
                summed = np.mod(summed, 2 ** (8 * x.element_size())) if x.dtype == torch.uint8 else summed
                full = np.trunc(summed * (post / WORLD.size if op == hvd.Average else post))
            expected = np.array_split(full, WORLD.size)[WORLD.rank]
            assert got.dtype == x.dtype and got.shape == expected.shape, (got.shape, expected.shape)
            if x.dtype.is_floating_point:
                np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-5)
            else:
                np.testing.assert_array_equal(
                    got.numpy().astype(np.float64), expected.astype(got.numpy().dtype)
                )
            again = hvd.synchronize(hvd.reducescatter_async(x, name="rs", **kw))
            assert torch.equal(again, got)

    on_all_ranks(check)


@pytest.mark.parallel(SIZES)
def test_grouped_forms_equal_one_call_per_tensor():
    rng = rank_rng(5)
    tensors = [random_tensor(rng, (6, 2), torch.float64), random_tensor(rng, (3,), torch.float32)]

    def check():
        grouped = hvd.grouped_reducescatter(tensors, op=hvd.Sum)
        one_by_one = [hvd.reducescatter(t, op=hvd.Sum) for t in tensors]
        assert all(torch.equal(a, b) for a, b in zip(grouped, one_by_one, strict=True))
        handle = hvd.grouped_reducescatter_async(tensors, op=hvd.Sum)
        assert all(torch.equal(a, b) for a, b in zip(hvd.synchronize(handle), one_by_one, strict=True))
        gathered = hvd.grouped_allgather(tensors)
        assert all(torch.equal(g, hvd.allgather(t)) for g, t in zip(gathered, tensors, strict=True))
        handle = hvd.grouped_allgather_async(tensors)
        assert all(torch.equal(a, b) for a, b in zip(hvd.synchronize(handle), gathered, strict=True))

    on_all_ranks(check)


@pytest.mark.parallel(SIZES)
def test_gradients_are_horovods():
    """reducescatter: the allgather of the incoming gradient (times the size for Sum); alltoall: the
    incoming gradient sent back along the received splits."""
    rng = rank_rng(6)
    x = torch.from_numpy(rng.standard_normal((2 * WORLD.size + 1, 3))).requires_grad_()
    splits = rng.integers(0, 3, WORLD.size)
    y = torch.from_numpy(rng.standard_normal((int(splits.sum()), 2))).requires_grad_()

    def check():
        for op, factor in ((hvd.Average, 1.0), (hvd.Sum, float(WORLD.size))):
            x.grad = None
            out = hvd.reducescatter(x, op=op, postscale_factor=2.0)
            upstream = torch.from_numpy(rank_rng(7).standard_normal(tuple(out.shape)))
            out.backward(upstream)
            everyone = np.concatenate(WORLD.allgather(upstream.numpy()))
            np.testing.assert_allclose(x.grad.numpy(), 2.0 * factor * everyone)
        out, received = hvd.alltoall(y, splits.tolist())
        upstream = torch.from_numpy(rank_rng(8).standard_normal(tuple(out.shape)))
        out.backward(upstream)
        back, _ = hvd.alltoall(upstream, received)
        np.testing.assert_array_equal(y.grad.numpy(), back.numpy())

    on_all_ranks(check)


@pytest.mark.parallel([2, 3])
def test_errors_on_the_rank_that_erred_and_mismatch_on_the_others():
    p = WORLD.size

    def check():
        cases = [
            ("float splits", lambda: hvd.alltoall(torch.ones(p), torch.ones(p)), ValueError, "integers"),
            ("splits sum", lambda: hvd.alltoall(torch.ones(p - 1), [1] * p), ValueError, "sum"),
            ("uneven", lambda: hvd.alltoall(torch.ones(p + 1)), ValueError, "divide evenly"),
            ("0-d", lambda: hvd.alltoall(torch.tensor(1.0)), ValueError, "dimension"),
            # (an op reducescatter lacks: NotImplementedError, a RuntimeError, as Horovod's error for Adasum)
            (
                "rs op",
                lambda: hvd.reducescatter(torch.ones(p), op=hvd.Max),
                NotImplementedError,
                "Average or",
            ),
            (
                "rs adasum",
                lambda: hvd.reducescatter(torch.ones(p), op=hvd.Adasum),
                RuntimeError,
                "Average or",
            ),
            (
                "rs bad op",
                lambda: hvd.reducescatter(torch.ones(p), op="max"),
                ValueError,
                "Average or hvd.Sum",
            ),
            ("rs dtype", lambda: hvd.reducescatter(torch.ones(p, dtype=torch.complex64)), TypeError, "dtype"),
            ("rs async", lambda: hvd.synchronize(hvd.reducescatter_async("x")), TypeError, "torch.Tensor"),
        ]
        for label, bad, error, match in cases:
            if WORLD.rank == 0:
                with pytest.raises(error, match=match):
                    bad()
            else:
                with pytest.raises(gflow.MismatchError):
                    if label == "rs async":  # (an async call's rejection meets the peers' async call)
                        hvd.synchronize(hvd.reducescatter_async(torch.ones(p)))
                    elif label.startswith("rs"):
                        hvd.reducescatter(torch.ones(p))
                    else:
                        hvd.alltoall(torch.ones(p))
        # ranks disagreeing on the dtype, or on a trailing axis: MismatchError (a RuntimeError) everywhere
        with pytest.raises(RuntimeError):
            hvd.alltoall(torch.ones(p, dtype=torch.int32 if WORLD.rank else torch.float32))
        with pytest.raises(RuntimeError):
            hvd.alltoall(torch.ones(p, 2 + WORLD.rank))
        with pytest.raises(gflow.MismatchError, match="shape"):
            hvd.reducescatter(torch.ones(p + WORLD.rank))
        assert hvd.reducescatter(torch.ones(p), op=hvd.Sum).tolist() == [float(p)]

    on_all_ranks(check)
