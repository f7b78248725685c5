"""torch tensors as a kind of array: every collective takes CPU tensors and gives tensors back, through
a zero-copy NumPy view, checked against MPI's own Allreduce/Allgather/Bcast. CUDA tensors take the
device path (__cuda_array_interface__); they need a GPU and are covered by bench/gpu_check.sh."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import WORLD, assert_close_to_reference, assert_same_on_all_ranks, random_array, rank_rng
from mpi4py import MPI

import gflow

torch.set_num_threads(1)
# The layers above the collectives run at 1-3 ranks: the collectives under them are tested at 1-4
# (test_allreduce.py, test_hierarchical.py, ...), and 4 ranks each importing torch on the 2-core CI
# machine cost a third of the suite's time.
SIZES = [1, 2, 3]
TORCH = {np.float16: torch.float16, np.float32: torch.float32, np.float64: torch.float64,
         np.int32: torch.int32, np.int64: torch.int64}  # fmt: skip


def _tensor(rng, shape, dtype):
    return torch.from_numpy(random_array(rng, shape, dtype))


@pytest.mark.parallel(SIZES)
def test_allreduce_on_cpu_tensors_returns_tensors():
    rng = rank_rng(1)
    for dtype in (np.float32, np.float64, np.int64, np.int32, np.float16):
        for op in ("sum", "max") + (("mean",) if np.dtype(dtype).kind == "f" else ()):
            _check_tensor_allreduce(rng, dtype, op)


def _check_tensor_allreduce(rng, dtype, op):
    x = _tensor(rng, (3, 37), dtype)
    before = x.clone()
    y = gflow.allreduce(x, op)
    assert isinstance(y, torch.Tensor) and y.dtype == TORCH[dtype] and y.shape == x.shape
    assert torch.equal(x, before), "the input was modified"
    if dtype is not np.float16:  # MPI's float16 reference is not portable; test_allreduce covers it
        assert_close_to_reference(y.numpy(), x.numpy(), op)
    assert_same_on_all_ranks(y.numpy())


@pytest.mark.parallel(SIZES)
def test_in_place_out_async_and_fp16_on_tensors():
    rng = rank_rng(2)
    x = _tensor(rng, (1000,), np.float32)
    ref = np.empty(1000, np.float32)
    WORLD.Allreduce(x.numpy(), ref, MPI.SUM)
    out = torch.full((1000,), float("nan"))
    assert gflow.allreduce(x, "sum", out=out) is out
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-4)
    handle = gflow.allreduce_async(x, "sum")
    y = handle.wait()
    assert isinstance(y, torch.Tensor)
    np.testing.assert_array_equal(y.numpy(), out.numpy())
    z = x.clone()
    gflow.allreduce(z, "mean", out=z, compression="fp16")
    np.testing.assert_allclose(z.numpy(), ref / WORLD.size, rtol=2e-3, atol=2e-2)
    assert_same_on_all_ranks(z.numpy())


@pytest.mark.parallel(SIZES)
def test_tensors_that_require_grad_and_non_contiguous_ones_are_read_as_they_are():
    rng = rank_rng(3)
    w = _tensor(rng, (8, 6), np.float64).requires_grad_()
    y = gflow.allreduce(w, "sum")
    assert not y.requires_grad
    ref = np.empty((8, 6))
    WORLD.Allreduce(w.detach().numpy(), ref, MPI.SUM)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-12)
    t = w.detach().t()  # a transposed view: not contiguous
    yt = gflow.allreduce(t, "sum")
    np.testing.assert_allclose(yt.numpy(), ref.T, rtol=1e-12)
    with pytest.raises(ValueError, match="C-contiguous"):
        gflow.allreduce(w.detach(), "sum", out=torch.empty(6, 8, dtype=torch.float64).t())


@pytest.mark.parallel(SIZES)
def test_reduce_scatter_allgather_broadcast_on_tensors():
    rng = rank_rng(4)
    x = _tensor(rng, (11, 3), np.float64)
    total = np.empty((11, 3))
    WORLD.Allreduce(x.numpy(), total, MPI.SUM)
    shard = gflow.reduce_scatter(x, "sum")
    assert isinstance(shard, torch.Tensor)
    mine = np.array_split(total.ravel(), WORLD.size)[WORLD.rank]
    np.testing.assert_allclose(shard.numpy(), mine, rtol=1e-12)
    rows = _tensor(rng, (WORLD.rank + 1, 3), np.int32)
    gathered = gflow.allgather(rows)
    assert isinstance(gathered, torch.Tensor) and gathered.dtype == torch.int32
    np.testing.assert_array_equal(gathered.numpy(), np.concatenate(WORLD.allgather(rows.numpy())))
    b = _tensor(rng, (5, 2), np.float32)
    root_values = WORLD.bcast(b.numpy() if WORLD.rank == WORLD.size - 1 else None, root=WORLD.size - 1)
    got = gflow.broadcast(b, root=WORLD.size - 1)
    assert isinstance(got, torch.Tensor)
    np.testing.assert_array_equal(got.numpy(), root_values)
    assert gflow.broadcast(b, root=WORLD.size - 1, out=b) is b  # in place
    np.testing.assert_array_equal(b.numpy(), root_values)


@pytest.mark.parallel(SIZES)
def test_lazy_sparse_and_loss_scaler_take_tensors():
    rng = rank_rng(5)
    grads = [_tensor(rng, shape, np.float32) for shape in [(64, 3), (17,), (5, 5)]]
    refs = []
    for g in grads:
        ref = np.empty(g.shape, np.float32)
        WORLD.Allreduce(g.numpy(), ref, MPI.SUM)
        refs.append(ref / WORLD.size)
    lazy = gflow.LazyAllreduce(threshold_bytes=256, op="mean")
    for g in grads:
        lazy.push(g)
    lazy.flush()
    for g, ref in zip(grads, refs, strict=True):
        np.testing.assert_allclose(g.numpy(), ref, rtol=1e-5, atol=1e-6)

    csc = gflow.SparseAllreduce(density=1.0, chunk_elems=16, op="sum")
    g = _tensor(rng, (10, 10), np.float64)
    update = csc(g)
    assert isinstance(update, torch.Tensor) and update.shape == g.shape
    ref = np.empty((10, 10))
    WORLD.Allreduce(g.numpy(), ref, MPI.SUM)
    np.testing.assert_allclose(update.numpy(), ref, rtol=1e-12)

    scaler = gflow.LossScaler(init_scale=4.0)
    h = torch.tensor([4.0, 8.0, float("inf")]) if WORLD.rank == 0 else torch.tensor([4.0, 8.0, 12.0])
    overflow = scaler.unscale(h)
    assert overflow == (WORLD.rank == 0)
    assert h[1].item() == 2.0
    assert scaler.update(overflow) is False  # rank 0's inf: every rank skips


@pytest.mark.parallel([1, 2])
def test_bad_tensors_get_clear_errors():
    with pytest.raises(TypeError, match="unsupported dtype torch.complex64"):  # bfloat16 is supported
        gflow.allreduce(torch.ones(4, dtype=torch.complex64))
    with pytest.raises(TypeError, match="same kind|tensor"):
        gflow.allreduce(torch.ones(4), out=np.empty(4, np.float32))
    with pytest.raises(TypeError, match="dtype"):
        gflow.allreduce(torch.ones(4), out=torch.empty(4, dtype=torch.float64))
    with pytest.raises(TypeError, match="strided"):
        gflow.allreduce(torch.ones(4).to_sparse())
    y = gflow.allreduce(torch.ones(4), "sum")  # the ranks are still in step
    assert y.tolist() == [float(WORLD.size)] * 4


def test_importing_gflow_does_not_import_torch():
    code = "import sys, gflow, numpy; gflow.allreduce(numpy.ones(3)); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
