"""gflow.torch.SyncBatchNorm against torch's BatchNorm run in one process on the concatenation of every
rank's batch (gathered with mpi4py's allgather): outputs, input gradients, the sum over the ranks of the
weight/bias gradients, running statistics and num_batches_tracked, at world sizes 1 to 4, with random
data and a different batch size on each rank (empty ones included); eval mode; errors; resnet18.
"""

import numpy as np
import pytest
import torch
from helpers import WORLD, assert_same_on_all_ranks, on_all_ranks

import gflow
import gflow.torch as hvd
from gflow.torch.sync_batch_norm import SyncBatchNorm, _SyncBatchNormFunction

torch.set_num_threads(1)
SIZES = [1, 2, 3, 4]
TORCH_BN = {
    2: torch.nn.BatchNorm1d,
    3: torch.nn.BatchNorm1d,
    4: torch.nn.BatchNorm2d,
    5: torch.nn.BatchNorm3d,
}
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-10), torch.float32: dict(rtol=2e-4, atol=2e-4)}


@pytest.fixture(autouse=True)
def _init():
    hvd.init()


def concat(t: torch.Tensor) -> torch.Tensor:
    """Every rank's tensor concatenated along dimension 0, in rank order (mpi4py's allgather)."""
    return torch.cat(WORLD.allgather(t.detach().clone()))


def rank_slice(t: torch.Tensor, n: int) -> torch.Tensor:
    """This rank's rows of a concatenation whose rank r contributed n_r rows."""
    counts = WORLD.allgather(n)
    start = sum(counts[: WORLD.rank])
    return t[start : start + n]


def summed(t: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks (mpi4py's allreduce)."""
    return WORLD.allreduce(t.detach().clone())


def batch_sizes(seed: int, allow_empty: bool) -> list[int]:
    """A batch size per rank (the same list on every rank), 0..4 or 1..4; total at least 2."""
    rng = np.random.default_rng([seed, WORLD.size])
    while True:
        sizes = [int(s) for s in rng.integers(0 if allow_empty else 1, 5, size=WORLD.size)]
        if sum(sizes) >= 2:
            return sizes


def make_pair(channels, dim, dtype, seed, **kwargs):
    """A SyncBatchNorm and torch's BatchNorm with the same (random) parameters and buffers."""
    sync = SyncBatchNorm(channels, dtype=dtype, **kwargs)
    ref = TORCH_BN[dim](channels, dtype=dtype, **kwargs)
    gen = torch.Generator().manual_seed(seed)  # the same on every rank
    with torch.no_grad():
        if sync.affine:
            sync.weight.copy_(torch.rand(channels, generator=gen, dtype=dtype) + 0.5)
            sync.bias.copy_(torch.randn(channels, generator=gen, dtype=dtype))
        if sync.track_running_stats:
            sync.running_mean.copy_(torch.randn(channels, generator=gen, dtype=dtype))
            sync.running_var.copy_(torch.rand(channels, generator=gen, dtype=dtype) + 0.5)
    ref.load_state_dict(sync.state_dict())
    return sync, ref


def step_and_compare(sync, ref, shape_tail, n, dtype, gen, label):
    """One forward/backward of both on random data (n rows on this rank; the reference on all rows)."""
    x = (torch.randn(n, *shape_tail, generator=gen, dtype=torch.float64) * 3 + 1).to(dtype)
    g = torch.randn(n, *shape_tail, generator=gen, dtype=torch.float64).to(dtype)
    x.requires_grad_(True)
    for p in (*sync.parameters(), *ref.parameters()):
        p.grad = None

    y = sync(x)
    (y * g).sum().backward()

    big_x = concat(x).requires_grad_(True)
    big_y = ref(big_x)
    (big_y * concat(g)).sum().backward()

    expected_y, expected_dx = rank_slice(big_y.detach(), n), rank_slice(big_x.grad, n)
    grads = [(summed(p.grad), q.grad) for p, q in zip(sync.parameters(), ref.parameters(), strict=True)]
    running = [(b, q) for b, q in zip(sync.buffers(), ref.buffers(), strict=True)]

    def check():
        tol = TOL[dtype]
        assert y.dtype == dtype and y.shape == x.shape
        torch.testing.assert_close(y.detach(), expected_y, **tol, msg=lambda m: f"output: {m}")
        torch.testing.assert_close(x.grad, expected_dx, **tol, msg=lambda m: f"input grad: {m}")
        for got, want in grads:
            torch.testing.assert_close(got, want, **tol, msg=lambda m: f"weight/bias grad: {m}")
        for got, want in running:
            torch.testing.assert_close(got, want, **tol, msg=lambda m: f"buffer: {m}")
        for b in sync.buffers():
            assert_same_on_all_ranks(b.numpy())

    on_all_ranks(check, label)


CONFIGS = [
    dict(),
    dict(momentum=None),
    dict(momentum=0.3, eps=1e-3),
    dict(affine=False),
    dict(track_running_stats=False),
]


@pytest.mark.parallel(SIZES)
def test_matches_batchnorm_on_concatenated_batch():
    """Training steps then eval, for 2- to 5-dimensional inputs, both float dtypes and every
    constructor option; batch sizes differ per rank and some ranks' batches are empty. Then eval
    with running statistics run by rank 0 alone (it does not communicate)."""
    shapes = {2: (5,), 3: (3, 4), 4: (3, 3, 2), 5: (2, 2, 3, 2)}  # channels first, then spatial
    case = 0
    for dtype in (torch.float64, torch.float32):
        for dim, tail in shapes.items():
            for kwargs in CONFIGS:
                case += 1
                label = f"{dtype} dim={dim} {kwargs}"
                sync, ref = make_pair(tail[0], dim, dtype, seed=case, **kwargs)
                gen = torch.Generator().manual_seed(1000 * case + WORLD.rank)  # differs per rank
                for step in range(3):
                    sizes = batch_sizes(10 * case + step, allow_empty=step == 1)
                    step_and_compare(sync, ref, tail, sizes[WORLD.rank], dtype, gen, f"{label} step {step}")
                sync.eval()
                ref.eval()
                step_and_compare(sync, ref, tail, sizes[WORLD.rank], dtype, gen, f"{label} eval")
    eval_with_running_stats_does_not_communicate()


def eval_with_running_stats_does_not_communicate():
    """Eval mode with running statistics is local: rank 0 alone runs it, the others do not wait."""
    sync, ref = make_pair(4, 4, torch.float64, seed=7)
    sync.eval()
    ref.eval()
    x = torch.randn(2 + WORLD.rank, 4, 3, 3, dtype=torch.float64)
    if WORLD.rank == 0:
        for _ in range(3):
            torch.testing.assert_close(sync(x), ref(x), rtol=1e-12, atol=1e-12)
    WORLD.Barrier()
    assert int(sync.num_batches_tracked) == 0


def test_one_rank_function_matches_batchnorm_and_gradcheck():
    """The synchronized path itself (the module takes F.batch_norm on one rank), on a one-rank
    communicator: torch's BatchNorm's output and running statistics, and torch's gradcheck."""
    comm = WORLD.Split(WORLD.rank, 0)  # a one-rank communicator
    try:
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(3, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True)
        w = torch.rand(2, generator=gen, dtype=torch.float64).add_(0.5).requires_grad_(True)
        b = torch.randn(2, generator=gen, dtype=torch.float64, requires_grad=True)
        rm, rv = torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
        ref_rm, ref_rv = rm.clone(), rv.clone()
        y = _SyncBatchNormFunction.apply(x, w, b, rm, rv, 1e-5, 0.1, comm)
        expected = torch.nn.functional.batch_norm(x, ref_rm, ref_rv, w, b, True, 0.1, 1e-5)
        torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(rm, ref_rm, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(rv, ref_rv, rtol=1e-12, atol=1e-12)
        fn = lambda x, w, b: _SyncBatchNormFunction.apply(x, w, b, None, None, 1e-5, 0.1, comm)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (x, w, b))
    finally:
        comm.Free()


@pytest.mark.parallel([1, 3])
def test_edge_cases_on_every_rank():
    every_batch_empty()
    one_value_per_channel_raises_everywhere()
    if WORLD.size > 1:
        bad_input_on_one_rank_fails_every_rank()


def every_batch_empty():
    """Every rank's batch is empty: an empty output and gradients, running statistics unchanged
    (torch's BatchNorm does the same with an empty batch)."""
    sync = SyncBatchNorm(3)
    x = torch.randn(0, 3, 2, 2, requires_grad=True)
    y = sync(x)
    y.sum().backward()
    assert y.shape == x.shape and x.grad.shape == x.shape
    assert torch.equal(sync.weight.grad, torch.zeros(3)) and torch.equal(sync.bias.grad, torch.zeros(3))
    assert torch.equal(sync.running_mean, torch.zeros(3)) and torch.equal(sync.running_var, torch.ones(3))


def one_value_per_channel_raises_everywhere():
    """A global count of 1 per channel in training is torch's ValueError, on every rank (ranks other
    than 0 pass empty batches, so only the global count says it)."""
    sync = SyncBatchNorm(3)
    x = torch.randn(1 if WORLD.rank == 0 else 0, 3)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        sync(x)
    assert torch.equal(sync.running_mean, torch.zeros(3))
    y = sync(torch.randn(2, 3))  # the next forward works
    assert y.shape == (2, 3)


def bad_input_on_one_rank_fails_every_rank():
    """Rank 0's input has the wrong channel count: it raises ValueError, its peers MismatchError
    (also a HorovodInternalError) instead of waiting; the next forward works everywhere."""
    sync = SyncBatchNorm(3)
    if WORLD.rank == 0:
        with pytest.raises(ValueError, match="expected 3 channels"):
            sync(torch.randn(4, 5))
    else:
        with pytest.raises(gflow.MismatchError) as info:
            sync(torch.randn(4, 3))
        assert isinstance(info.value, hvd.HorovodInternalError)
    y = sync(torch.randn(4, 3))
    assert y.shape == (4, 3)


def test_arguments():
    """Constructor and input checks that need no peers."""
    sync = SyncBatchNorm(3, process_set=hvd.global_process_set)
    assert isinstance(sync, torch.nn.modules.batchnorm._BatchNorm)
    assert set(sync.state_dict()) == set(torch.nn.BatchNorm2d(3).state_dict())
    with pytest.raises(TypeError, match="ProcessSet"):
        SyncBatchNorm(3, process_set=[0])
    sync.eval()
    with pytest.raises(ValueError, match="at least 2D"):
        sync(torch.randn(3))
    with pytest.raises(ValueError, match="expected 3 channels"):
        sync(torch.randn(2, 4))


def test_requires_init_when_it_communicates():
    sync = SyncBatchNorm(2)
    hvd.shutdown()
    try:
        with pytest.raises(ValueError, match="not been initialized"):
            sync(torch.randn(4, 2))
        sync.eval()
        assert sync(torch.randn(4, 2)).shape == (4, 2)  # eval with running statistics needs no peers
    finally:
        hvd.init()


@pytest.mark.parallel([2])
def test_resnet18_forward_backward():
    """torchvision's resnet18 with norm_layer=SyncBatchNorm, 2 images of 32x32 per rank: the output
    slice and the input gradient of the same network with BatchNorm2d on all 4 images, the summed
    parameter gradients, and running statistics identical on every rank."""
    import torchvision  # here: the other tests' ranks need not import it

    torch.manual_seed(0)  # the same weights on every rank
    model = torchvision.models.resnet18(num_classes=10, norm_layer=SyncBatchNorm)
    ref = torchvision.models.resnet18(num_classes=10)
    ref.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(100 + WORLD.rank)
    x = torch.randn(2, 3, 32, 32, generator=gen, requires_grad=True)
    target = torch.randint(0, 10, (2,), generator=gen)

    out = model(x)
    loss = torch.nn.functional.cross_entropy(out, target, reduction="sum")
    loss.backward()

    big_x = concat(x).requires_grad_(True)
    big_out = ref(big_x)
    torch.nn.functional.cross_entropy(big_out, concat(target), reduction="sum").backward()
    grads = [(summed(p.grad), q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True)]
    expected_out, expected_dx = rank_slice(big_out.detach(), 2), rank_slice(big_x.grad, 2)

    def check():
        assert torch.isfinite(loss)
        torch.testing.assert_close(out.detach(), expected_out, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(x.grad, expected_dx, rtol=1e-3, atol=1e-4)
        for got, want in grads:
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        for (name, b), (_, r) in zip(model.named_buffers(), ref.named_buffers(), strict=True):
            torch.testing.assert_close(b, r, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
            assert_same_on_all_ranks(b.numpy())
        model.eval()
        ref.eval()
        torch.testing.assert_close(model(x).detach(), ref(x).detach(), rtol=1e-4, atol=1e-4)

    on_all_ranks(check)
