"""Adasum (gflow.allreduce(op="adasum"), hvd op=Adasum, DistributedOptimizer(op=Adasum)) against a float64
reference of the Adasum formula applied as a binary tree over the ranks, at 1, 2 and 4 ranks; its
restrictions (a power-of-two number of ranks, floating dtypes) refused on every rank."""

import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import WORLD, on_all_ranks, rank_rng, without_warnings

import gflow
import gflow.torch as hvd

torch.set_num_threads(1)
POWERS_OF_TWO = [1, 2, 4]
TINY = np.sqrt(np.finfo(np.float64).tiny)


def adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dot, aa, bb = a @ b, a @ a, b @ b
    ca = 1 - dot / (2 * aa) if aa >= TINY else 1.0
    cb = 1 - dot / (2 * bb) if bb >= TINY else 1.0
    return ca * a + cb * b


def reference(x: np.ndarray, sizes=None) -> np.ndarray:
    """Every rank's x (MPI's own allgather) combined pairwise, level by level, in float64; each tensor of
    `sizes` on its own."""
    everyone = [v.astype(np.float64).ravel() for v in WORLD.allgather(np.asarray(x))]
    sizes = [everyone[0].size] if sizes is None else sizes
    out, at = [], 0
    for n in sizes:
        level = [v[at : at + n] for v in everyone]
        while len(level) > 1:
            level = [adasum_pair(level[2 * i], level[2 * i + 1]) for i in range(len(level) // 2)]
        out.append(level[0])
        at += n
    return np.concatenate(out) if out else np.zeros(0)


@pytest.mark.parallel(POWERS_OF_TWO)
def test_adasum_against_the_formula_in_float64():
    rng = rank_rng(31)
    cases = [rng.standard_normal(n) for n in (1, 2, 3, 17, 1000)]
    cases.append(np.zeros(5))  # zero norms: the coefficients are 1, as Horovod's
    cases.append(rng.standard_normal((3, 4)).astype(np.float32))
    cases.append(rng.standard_normal(64).astype(np.float16))
    cases.append(rng.standard_normal(9).astype(ml_dtypes.bfloat16))

    def check():
        for x in cases:
            before = x.copy()
            y = gflow.allreduce(x, op="adasum")
            assert y.dtype == x.dtype and y.shape == x.shape
            assert np.array_equal(x, before, equal_nan=True)
            expected = reference(x)
            tol = {2: 1e-2, 4: 1e-6, 8: 1e-12}[np.dtype(x.dtype).itemsize]
            np.testing.assert_allclose(y.astype(np.float64).ravel(), expected, rtol=tol, atol=tol)
            blobs = WORLD.allgather(y.tobytes())
            assert all(b == blobs[0] for b in blobs), "ranks differ"
        h = gflow.allreduce_async(cases[3], op="adasum")
        np.testing.assert_allclose(h.wait(), reference(cases[3]), rtol=1e-12)
        out = cases[4].copy()
        assert gflow.allreduce(out, op="adasum", out=out) is out
        np.testing.assert_allclose(out, reference(cases[4]), rtol=1e-12)

    on_all_ranks(check)


@pytest.mark.parallel(POWERS_OF_TWO)
def test_adasum_of_infs_gives_the_formulas_nans_without_a_warning():
    """inf on one rank and -inf on another: the formula's NaNs, with no NumPy RuntimeWarning; under
    warnings as errors the combination still finishes on every rank (raised inside, it stopped the
    collective half way on one rank)."""
    x = rank_rng(41).standard_normal(100)
    x[3] = np.inf if WORLD.rank == 0 else -np.inf
    big = np.array([3e38, 3e38 if WORLD.rank % 2 == 0 else -3e38], np.float32)

    def check():
        y = without_warnings(lambda: gflow.allreduce(x, op="adasum"))
        with np.errstate(all="ignore"):
            expected = reference(x)
        assert WORLD.size == 1 or np.isnan(expected).any()
        np.testing.assert_allclose(y, expected, rtol=1e-12)  # (NaN where the formula has NaN)
        blobs = WORLD.allgather(y.tobytes())
        assert all(b == blobs[0] for b in blobs), "ranks differ"
        # Orthogonal float32 vectors near its maximum: a sum past its range, inf when cast back (helper-79)
        z = without_warnings(lambda: gflow.allreduce(big, op="adasum"))
        with np.errstate(all="ignore"):
            np.testing.assert_array_equal(z, reference(big).astype(np.float32))
        assert WORLD.size == 1 or np.isinf(z).any()

    on_all_ranks(check)


@pytest.mark.parallel([3])
def test_adasum_refuses_a_number_of_ranks_that_is_not_a_power_of_two_on_every_rank():
    def check():
        with pytest.raises(NotImplementedError, match="power-of-two"):
            gflow.allreduce(np.ones(4), op="adasum")
        hvd.init()
        with pytest.raises(NotImplementedError, match="power-of-two"):
            hvd.allreduce(torch.ones(4), op=hvd.Adasum)
        model = torch.nn.Linear(2, 1)
        with pytest.raises(NotImplementedError, match="power-of-two"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
        assert gflow.allreduce(np.ones(2), "sum").tolist() == [3.0, 3.0]  # and the ranks go on

    on_all_ranks(check)


@pytest.mark.parallel([2])
def test_adasum_refuses_integers_and_a_peer_with_another_shape_fails_too():
    def check():
        with pytest.raises(TypeError, match="floating"):
            gflow.allreduce(np.ones(4, np.int32), op="adasum")
        with pytest.raises(gflow.MismatchError):
            gflow.allreduce(np.ones(4 + WORLD.rank), op="adasum")
        if WORLD.rank == 0:
            with pytest.raises(ValueError, match="compression"):
                gflow.allreduce(np.ones(4), op="adasum", compression="fp16")
        else:
            with pytest.raises(gflow.MismatchError):
                gflow.allreduce(np.ones(4), op="adasum")
        hvd.init()
        with pytest.raises(TypeError, match="floating"):
            hvd.allreduce(torch.ones(4, dtype=torch.int32), op=hvd.Adasum)
        with pytest.raises(gflow.MismatchError, match="disagree on the op: rank 0 op=adasum, rank 1 op=sum"):
            hvd.allreduce(torch.ones(3), op=hvd.Adasum if WORLD.rank == 0 else hvd.Sum)  # (read op=?)

    on_all_ranks(check)


@pytest.mark.parallel(POWERS_OF_TWO)
def test_horovod_adasum_op_and_grouped_each_tensor_on_its_own():
    rng = rank_rng(32)
    a = torch.from_numpy(rng.standard_normal(10))
    b = torch.from_numpy(rng.standard_normal((3, 4)))

    def check():
        hvd.init()
        np.testing.assert_allclose(hvd.allreduce(a, op=hvd.Adasum).numpy(), reference(a.numpy()), rtol=1e-12)
        got = hvd.grouped_allreduce([a, b], op=hvd.Adasum)
        np.testing.assert_allclose(got[0].numpy(), reference(a.numpy()), rtol=1e-12)
        np.testing.assert_allclose(got[1].numpy().ravel(), reference(b.numpy()), rtol=1e-12)
        c = a.clone()
        hvd.synchronize(hvd.allreduce_async_(c, op=hvd.Adasum, postscale_factor=2.0))
        np.testing.assert_allclose(c.numpy(), 2.0 * reference(a.numpy()), rtol=1e-12)

    on_all_ranks(check)


@pytest.mark.parallel(POWERS_OF_TWO)
def test_adasum_optimizer_is_horovods_delta_optimizer():
    """Each rank's SGD update (its delta), combined by Adasum per parameter, added to the start."""
    rng = rank_rng(33)
    inputs, targets = (
        torch.from_numpy(rng.standard_normal((8, 4))),
        torch.from_numpy(rng.standard_normal((8, 2))),
    )

    def check():
        hvd.init()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2).double()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), model.named_parameters(), op=hvd.Adasum
        )
        assert isinstance(opt, torch.optim.SGD)
        for _ in range(2):
            start = [p.detach().clone() for p in model.parameters()]
            momenta = [opt.state[p].get("momentum_buffer") for p in model.parameters()]
            momenta = [None if m is None else m.clone() for m in momenta]
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            opt.step()
            for p, s, g, m in zip(model.parameters(), start, grads, momenta, strict=True):
                velocity = g if m is None else 0.5 * m + g  # (torch's SGD: the first step's buffer is g)
                expected = s.numpy().ravel() + reference((-0.1 * velocity).numpy())
                np.testing.assert_allclose(p.detach().numpy().ravel(), expected, rtol=1e-10, atol=1e-12)
            weights = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
            blobs = WORLD.allgather(weights.tobytes())
            assert all(b == blobs[0] for b in blobs), "replicas differ"
        with pytest.raises(AssertionError, match="Adasum"):
            with opt.skip_synchronize():
                pass

    on_all_ranks(check)


@pytest.mark.parallel(POWERS_OF_TWO)
def test_adasum_optimizer_with_grad_scaler_skips_a_step_on_every_rank_when_one_rank_overflows():
    """An inf in one rank's gradients skips the step on every rank and halves every rank's scale alike
    (without the agreement, that rank skipped and the others combined their deltas with its next
    step's); the steps around it are Adasum's."""
    rng = rank_rng(34)
    inputs, targets = (
        torch.from_numpy(rng.standard_normal((8, 4))).float(),
        torch.from_numpy(rng.standard_normal((8, 2))).float(),
    )

    def check():
        hvd.init()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), op=hvd.Adasum
        )
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        overflowing = hvd.size() - 1
        for step in range(3):
            start = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            if step == 1 and hvd.rank() == overflowing:
                loss = loss * float("inf")
            grads = None
            scaler.scale(loss).backward()
            if step != 1:
                grads = [p.grad.clone() / scaler.get_scale() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            for p, s, g in zip(model.parameters(), start, grads or [None] * 2, strict=True):
                expected = (
                    s.double()
                    if g is None
                    else s.double()
                    + torch.from_numpy(reference((-0.1 * g.double()).numpy()).reshape(s.shape))
                )
                np.testing.assert_allclose(
                    p.detach().double().numpy(), expected.numpy(), rtol=1e-5, atol=1e-6
                )
            weights = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
            blobs = WORLD.allgather(weights.tobytes() + np.float64(scaler.get_scale()).tobytes())
            assert all(b == blobs[0] for b in blobs), f"replicas or loss scales differ after step {step}"
        assert scaler.get_scale() == 512.0

    on_all_ranks(check)


@pytest.mark.parallel([1, 2])
def test_adasum_optimizer_no_sync_accumulates_and_refuses_a_step_inside():
    def check():
        hvd.init()
        model = torch.nn.Linear(3, 1)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), op=hvd.Adasum
        )
        x = torch.ones(2, 3)
        with opt.no_sync():
            model(x).sum().backward()
            once = model.weight.grad.clone()
            with pytest.raises(RuntimeError, match="no_sync"):
                opt.step()
        model(x).sum().backward()
        torch.testing.assert_close(model.weight.grad, 2 * once)
        opt.step()

    on_all_ranks(check)


@pytest.mark.parallel([2])
def test_adasum_optimizer_with_grad_scaler_and_a_rank_without_gradients_steps_everywhere():
    """A rank whose loss does not reach the model has no gradient for GradScaler to check: it still takes
    part in the step (its update is zero), where it used to fail alone and leave the other waiting."""

    def check():
        hvd.init()
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), op=hvd.Adasum
        )
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for step in range(2):
            opt.zero_grad()
            if step == 1 and WORLD.rank == 1:
                loss = torch.ones((), requires_grad=True) * 2.0
            else:
                loss = model(torch.ones(3, 4)).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            weights = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
            blobs = WORLD.allgather(weights.tobytes())
            assert all(b == blobs[0] for b in blobs), f"replicas differ after step {step}"

    on_all_ranks(check)
