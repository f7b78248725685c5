"""gflow.torch.DistributedOptimizer at world sizes 1 to 4.

The reference is the same model trained in one process, in float64 torch, on all ranks' batches
(each rank's loss averaged, as data parallelism averages gradients), step after step; "identical"
means bitwise equal on every rank (MPI's own allgather of the bytes).
"""

import copy
import gc
import io
import re
import time
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import WORLD, Interrupt, assert_same_on_all_ranks, interrupted_after, on_all_ranks

import gflow
import gflow.torch as hvd
from gflow.runtime import stall

torch.set_num_threads(1)
# The layers above the collectives run at 1-3 ranks: the collectives under them are tested at 1-4
# (test_allreduce.py, test_hierarchical.py, ...), and 4 ranks each importing torch on the 2-core CI
# machine cost a third of the suite's time.
SIZES = [1, 2, 3]
PER_RANK = 4  # samples per rank per step


@pytest.fixture(autouse=True)
def _init():
    hvd.init()


class Net(torch.nn.Module):
    """A conv layer, no BatchNorm; `unused` is never used; `extra` is used on rank 0 only."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.randn(5))
        self.conv = torch.nn.Conv2d(1, 3, 3)
        self.fc = torch.nn.Linear(3 * 4 * 4, 4)
        self.extra = torch.nn.Parameter(torch.randn(4))

    def forward(self, x, use_extra=False):
        out = self.fc(torch.relu(self.conv(x)).flatten(1))
        return out + self.extra if use_extra else out


def make_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return Net().to(dtype)


def batches(steps, seed=1):
    """Every rank's batch of every step (the same on every rank): (x, y) of p * PER_RANK samples."""
    g = torch.Generator().manual_seed(seed)
    n = WORLD.size * PER_RANK
    return [
        (torch.randn(n, 1, 6, 6, generator=g), torch.randint(0, 4, (n,), generator=g)) for _ in range(steps)
    ]


def rank_loss(model, x, y, rank, parts=1, scale=1.0, scaler=None):
    """Rank `rank`'s loss on its share of (x, y), backward in `parts` micro-batches (times `scale`, or
    through scaler.scale); returns nothing."""
    xs = x[rank * PER_RANK : (rank + 1) * PER_RANK].to(next(model.parameters()).dtype)
    ys = y[rank * PER_RANK : (rank + 1) * PER_RANK]
    for xm, ym in zip(xs.chunk(parts), ys.chunk(parts), strict=True):
        loss = F.cross_entropy(model(xm, use_extra=rank == 0), ym) / parts
        (loss * scale if scaler is None else scaler.scale(loss)).backward()


def reference_step(model, opt, x, y, op="mean", clip=None):
    """One step of the single-process reference: the ranks' losses averaged (or summed), in float64."""
    opt.zero_grad()
    total = 0
    for r in range(WORLD.size):
        xs = x[r * PER_RANK : (r + 1) * PER_RANK].double()
        total = total + F.cross_entropy(model(xs, use_extra=r == 0), y[r * PER_RANK : (r + 1) * PER_RANK])
    (total / (WORLD.size if op == "mean" else 1)).backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()


def assert_identical(model):
    for name, p in model.named_parameters():
        try:
            assert_same_on_all_ranks(p.detach().numpy())
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None


def assert_close_to(model, ref, atol, rtol=1e-4):
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach().double(), q.detach(), atol=atol, rtol=rtol, msg=name)


def sgd_and_reference(**kw):
    """(model, its float64 copy, the model's SGD(lr=0.1) wrapped by DistributedOptimizer with `kw`,
    the copy's plain SGD(lr=0.1)): the single-process reference beside what the ranks train."""
    model = make_model()
    ref = copy.deepcopy(model).double()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), **kw
    )
    return model, ref, opt, torch.optim.SGD(ref.parameters(), lr=0.1)


class ToFloat64(hvd.Compressor):
    """A user compressor: float64 on the wire."""

    @staticmethod
    def compress(tensor):
        return tensor.to(torch.float64), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx)


@pytest.mark.parallel(SIZES)
def test_training_equals_one_process_on_the_concatenated_batch():
    """Dense, fp16 (float16 on the wire: within 2e-3 here), backward_passes_per_step=2, op=Sum,
    gradient_predivide_factor and a user compressor: parameters after every step equal the
    single-process float64 reference, and are bitwise identical on every rank; the unused parameter
    keeps grad None and its value (under weight decay too), the one used on rank 0 only is updated
    everywhere."""
    r = WORLD.rank
    modes = {
        "dense": dict(kw={}, atol=1e-5),
        "fp16": dict(kw=dict(compression=hvd.Compression.fp16), atol=2e-3),
        "bpps2": dict(kw=dict(backward_passes_per_step=2), atol=1e-5, parts=2),
        "sum": dict(kw=dict(op=hvd.Sum), atol=1e-5, op="sum"),
        "predivide": dict(kw=dict(gradient_predivide_factor=4.0), atol=1e-5),
        "compressor": dict(kw=dict(compression=ToFloat64, threshold_bytes=256), atol=1e-5),
    }
    data = batches(4)
    for mode, spec in modes.items():

        def check(spec=spec):
            model = make_model(seed=r)  # every rank different: broadcast_parameters must fix it
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            ref = copy.deepcopy(model).double()
            unused_before = model.unused.detach().clone()
            sgd = dict(lr=0.1, momentum=0.9, weight_decay=0.01)
            opt = torch.optim.SGD(model.parameters(), **sgd)
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **spec["kw"])
            ref_opt = torch.optim.SGD(ref.parameters(), **sgd)
            for x, y in data:
                opt.zero_grad()
                rank_loss(model, x, y, r, parts=spec.get("parts", 1))
                opt.step()
                reference_step(ref, ref_opt, x, y, op=spec.get("op", "mean"))
                assert_identical(model)
                assert_close_to(model, ref, atol=spec["atol"])
                assert model.unused.grad is None and torch.equal(model.unused.detach(), unused_before)
                assert model.extra.grad is not None

        on_all_ranks(check, mode)


@pytest.mark.parallel(SIZES)
def test_sparse_communication_loses_nothing_and_moves_sgd_momentum():
    r, p = WORLD.rank, WORLD.size
    data = batches(4)

    def nothing_lost():
        # momentum 0: the updates applied plus every rank's residual add up to the gradients pushed
        model = make_model()
        sparse = dict(density=0.3, chunk_elems=8)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05),
            named_parameters=model.named_parameters(),
            sparse=sparse,
            threshold_bytes=1 << 30,  # one segment: its residual is every gradient, last parameter first
        )
        names = [n for n, _ in model.named_parameters()]
        params = dict(model.named_parameters())
        pushed = {n: np.zeros(params[n].shape) for n in names}
        applied = {n: np.zeros(params[n].shape) for n in names}
        for x, y in data:
            opt.zero_grad()
            rank_loss(model, x, y, r)
            for n in names:
                local = params[n].grad
                local = np.zeros(params[n].shape) if local is None else local.double().numpy()
                pushed[n] += np.sum(WORLD.allgather(local), axis=0) / p
            opt.step()
            for n in names:
                if params[n].grad is not None:
                    applied[n] += params[n].grad.double().numpy()
            assert_identical(model)
        segment = opt.state_dict()["gflow"]["lazy"]["segments"][0]
        residual = np.asarray(segment["residual"], dtype=np.float64).reshape(-1)
        total_residual = np.sum(WORLD.allgather(residual), axis=0) / p
        offset = 0
        for n in reversed(names):
            size = params[n].numel()
            kept = total_residual[offset : offset + size].reshape(params[n].shape)
            offset += size
            np.testing.assert_allclose(applied[n] + kept, pushed[n], rtol=1e-5, atol=1e-6, err_msg=n)
        assert offset == residual.size

    on_all_ranks(nothing_lost, "nothing lost")

    def fp16_identical():
        model = make_model()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05),
            named_parameters=model.named_parameters(),
            compression=hvd.Compression.fp16,
            sparse=dict(density=0.25, chunk_elems=16),
            threshold_bytes=512,
        )
        for x, y in data:
            opt.zero_grad()
            rank_loss(model, x, y, r)
            opt.step()
            assert_identical(model)

    on_all_ranks(fp16_identical, "CSC + fp16 bitwise identical")

    def momentum_moves_into_csc():
        # SGD(momentum=m) with sparse=: the momentum is CSC's (Deep Gradient Compression's momentum
        # correction), SGD's is 0, so the update is accelerated once: the same as momentum=m given to
        # CSC beside a plain SGD. At density 1 every chunk is sent each step and momentum factor
        # masking clears the velocity with it: the update is then plain SGD's, not momentum SGD's.
        sparse = dict(density=0.3, chunk_elems=8)
        models = [make_model(), make_model(), make_model()]
        ref = copy.deepcopy(models[2]).double()
        opts = [
            hvd.DistributedOptimizer(
                torch.optim.SGD(models[0].parameters(), lr=0.1, momentum=0.9), sparse=sparse
            ),
            hvd.DistributedOptimizer(
                torch.optim.SGD(models[1].parameters(), lr=0.1), sparse=dict(sparse, momentum=0.9)
            ),
            hvd.DistributedOptimizer(
                torch.optim.SGD(models[2].parameters(), lr=0.1, momentum=0.9), sparse=dict(density=1.0)
            ),
        ]
        assert all(g["momentum"] == 0.0 for opt in opts for g in opt.param_groups)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for x, y in data:
            for model, opt in zip(models, opts, strict=True):
                opt.zero_grad()
                rank_loss(model, x, y, r)
                opt.step()
                assert_identical(model)
            for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
                assert torch.equal(a, b)
            reference_step(ref, ref_opt, x, y)
            assert_close_to(models[2], ref, atol=1e-5)

    on_all_ranks(momentum_moves_into_csc, "SGD momentum moved into CSC")


@pytest.mark.parallel(SIZES)
def test_checkpoint_and_resume_equals_an_uninterrupted_run():
    r = WORLD.rank
    data = batches(5)
    setups = {
        "adam": (lambda m: torch.optim.Adam(m.parameters(), lr=0.01), {}),
        "csc": (
            lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
            dict(sparse=dict(density=0.3, chunk_elems=8)),
        ),
    }
    for label, (make_opt, kw) in setups.items():

        def run(stop_at=None, make_opt=make_opt, kw=kw):
            model = make_model()
            opt = hvd.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters(), **kw)
            for step, (x, y) in enumerate(data):
                if step == stop_at:  # a restart: fresh objects, then the checkpoint loaded
                    file = io.BytesIO()  # torch.load's default (weights_only) must take gflow's state
                    torch.save((model.state_dict(), opt.state_dict()), file)
                    file.seek(0)
                    saved = torch.load(file, weights_only=True)
                    model = make_model(seed=123)
                    opt = hvd.DistributedOptimizer(
                        make_opt(model), named_parameters=model.named_parameters(), **kw
                    )
                    model.load_state_dict(saved[0])
                    opt.load_state_dict(saved[1])
                opt.zero_grad()
                rank_loss(model, x, y, r)
                opt.step()
            return model, opt

        def check(label=label):
            whole, opt = run()
            resumed, _ = run(stop_at=2)
            for (name, a), b in zip(whole.named_parameters(), resumed.parameters(), strict=True):
                assert torch.equal(a, b), name
            assert "gflow" in opt.state_dict()
            plain = torch.optim.Adam(whole.parameters()).state_dict()  # no "gflow" key: loads too
            if label == "adam":
                opt.load_state_dict(plain)

        on_all_ranks(check, label)


@pytest.mark.parallel(SIZES)
def test_gradient_clipping_and_grad_scaler_patterns():
    r = WORLD.rank
    data = batches(4)

    def clipping():
        model, ref, opt, ref_opt = sgd_and_reference()
        for x, y in data:
            opt.zero_grad()
            rank_loss(model, x, y, r)
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # active: the norms are larger
            with opt.skip_synchronize():
                opt.step()
            reference_step(ref, ref_opt, x, y, clip=0.05)
            assert_identical(model)
            assert_close_to(model, ref, atol=1e-5)
        opt.zero_grad()
        rank_loss(model, *data[0], r)
        opt.synchronize()
        with pytest.warns(UserWarning, match="skip_synchronize"):
            opt.step()

    on_all_ranks(clipping, "clipping")

    def step_after_synchronize_with_sum():
        """step() without skip_synchronize() after synchronize(): gradients changed in place are the
        reduced ones, applied once (Horovod reduces them again, which multiplies a sum by the number
        of ranks); a gradient set anew on some rank (p.grad = ...) is reduced again on every rank."""
        model, ref, opt, ref_opt = sgd_and_reference(op=hvd.Sum)
        for x, y in data[:2]:
            opt.zero_grad()
            rank_loss(model, x, y, r)
            opt.synchronize()
            reduced = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
            before = {name: p.detach().clone() for name, p in model.named_parameters()}
            if x is data[1][0]:  # changed in place on every rank (clipping would), values kept
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.clamp_(-1e6, 1e6)
            with pytest.warns(UserWarning, match="reduces them again only where a rank set"):
                opt.step()
            for name, p in model.named_parameters():
                if name in reduced:
                    assert torch.equal(p.grad, reduced[name]), name
                    assert torch.equal(p.detach(), before[name].add(reduced[name], alpha=-0.1)), name
            reference_step(ref, ref_opt, x, y, op="sum")
            assert_identical(model)
            assert_close_to(model, ref, atol=1e-5)
        # Set anew after synchronize(): rank r's own gradient (r + 1 times the reduced one); on rank 0
        # alone, or on every rank, or through .data. step() reduces them again, on every rank: the sum
        # of the new ones.
        for anew_on, by_data in (([0], False), (range(WORLD.size), False), ([0], True)):
            opt.zero_grad()
            rank_loss(model, *data[2], r)
            opt.synchronize()
            reduced = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
            factor = sum(q + 1 if q in anew_on else 1 for q in range(WORLD.size))
            if r in anew_on:
                for p in model.parameters():
                    if p.grad is not None and by_data:
                        p.grad.data = p.grad * (r + 1)  # (the same tensor over new memory)
                    elif p.grad is not None:
                        p.grad = p.grad * (r + 1)
            with pytest.warns(UserWarning):
                opt.step()
            for name, p in model.named_parameters():
                if name in reduced:
                    torch.testing.assert_close(p.grad, reduced[name] * factor, msg=name)
            assert_identical(model)
        # no_sync() after synchronize() refuses under op=Sum: a backward inside would add to the
        # reduced gradients, and step() would count them once per rank
        opt.zero_grad()
        rank_loss(model, *data[2], r)
        opt.synchronize()
        with pytest.raises(RuntimeError, match=r"no_sync\(\) after synchronize\(\).*op=Sum"):
            with opt.no_sync():
                pass
        with opt.skip_synchronize():
            opt.step()
        assert_identical(model)
        # ... but not once the gradients are gone (the module's zero_grad(): no reduced part left)
        rank_loss(model, *data[2], r)
        opt.synchronize()
        model.zero_grad()
        with opt.no_sync():
            rank_loss(model, *data[3], r)
        rank_loss(model, *data[2], r)
        opt.step()
        assert_identical(model)
        opt.zero_grad()  # and the next step is paired with the next step on every rank
        rank_loss(model, *data[0], r)
        opt.step()
        assert_identical(model)
        # Under op=Average it accumulates: step() reduces the sum again (the mean of both), on every rank
        averaging = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
        )
        del opt
        gc.collect()  # (its hooks must not fire again: see test_a_replaced_optimizer...)
        averaging.zero_grad()
        rank_loss(model, *data[2], r)
        averaging.synchronize()
        with averaging.no_sync():
            rank_loss(model, *data[3], r)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (gradients changed by a backward: no warning, reduced)
            averaging.step()
        assert_identical(model)

    on_all_ranks(step_after_synchronize_with_sum, "step after synchronize, op=Sum")

    def grad_scaler(op=hvd.Average, touch=False):
        """Horovod's recipe; `touch`: the program changes the reduced gradients in place between
        synchronize() and the scaler (here by 1.0), which must not reduce them again (op=Sum: x p)."""
        model, ref, opt, ref_opt = sgd_and_reference(op=op)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        for step, (x, y) in enumerate(data):
            opt.zero_grad()
            rank_loss(model, x, y, r, scaler=scaler)
            opt.synchronize()
            if touch:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(1.0)
            if step % 2 == 0:  # (else scaler.step unscales, inside skip_synchronize)
                scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
            reference_step(ref, ref_opt, x, y, op="sum" if op == hvd.Sum else "mean")
            assert_identical(model)
            assert_close_to(model, ref, atol=1e-5)

    on_all_ranks(grad_scaler, "GradScaler, dense")
    on_all_ranks(lambda: grad_scaler(hvd.Sum, touch=True), "GradScaler, op=Sum, gradients changed in place")

    def grad_scaler_fp16_overflow():
        # float16 on the wire overflows at a scale of 2**24: every rank sees inf, GradScaler skips
        # the step on every rank and lowers the scale, and training goes on.
        model = make_model()
        start = [p.detach().clone() for p in model.parameters()]
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            compression=hvd.Compression.fp16,
        )
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, backoff_factor=2.0**-6)
        scales = []
        for x, y in data:
            opt.zero_grad()
            rank_loss(model, x, y, r, scaler=scaler)
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
            scales.append(scaler.get_scale())
            scaler.update()
            assert_identical(model)
        assert scales[0] == 2.0**24 and scaler.get_scale() < 2.0**24, scales
        assert not all(torch.equal(a, b) for a, b in zip(start, model.parameters(), strict=True))
        # Without a scaler, step() refuses to apply the overflowed gradients (on every rank).
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        rank_loss(model, *data[0], r, scale=2.0**24)
        with pytest.raises(gflow.CompressionOverflowError) as info:
            opt.step()
        assert isinstance(info.value, hvd.HorovodInternalError)
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        opt.zero_grad()
        rank_loss(model, *data[1], r)
        opt.step()
        assert_identical(model)

    on_all_ranks(grad_scaler_fp16_overflow, "GradScaler, fp16 overflow")


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("who", ["every rank", "the last rank"])
def test_step_again_without_a_backward_applies_the_reduced_gradients_on_its_own(who):
    """helper-83: step() once more with no backward since (on one rank: its program's bug) pushed the
    gradients the last step reduced into the peers' next step; that rank's steps then paired with the
    others' next ones, mixing two steps' gradients silently (0.25 off the global batch's mean), and
    its last one never ended. It applies them again without communicating, as DDP's optimizer would,
    and warns; the steps after it reduce each step's own gradients."""
    model, ref, opt, ref_opt = sgd_and_reference()
    twice = who == "every rank" or WORLD.rank == WORLD.size - 1
    for step, (x, y) in enumerate(batches(3)):
        opt.zero_grad()
        rank_loss(model, x, y, WORLD.rank)
        local = [
            torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.double()
            for p in model.parameters()
        ]
        opt.synchronize()
        for p, mine in zip(model.parameters(), local, strict=True):  # each step's own gradients
            mean = np.mean(WORLD.allgather(mine.numpy()), axis=0)  # (None where no rank used it)
            if p.grad is not None:
                np.testing.assert_allclose(p.grad.double().numpy(), mean, rtol=1e-5, atol=1e-7)
        with opt.skip_synchronize():
            opt.step()
        reference_step(ref, ref_opt, x, y)
        if step == 1 and twice:
            with pytest.warns(UserWarning, match="again without a backward pass"):
                opt.step()
            ref_opt.step()
        if step == 1 or who == "every rank":
            assert_close_to(model, ref, atol=1e-5)
    if who == "every rank":
        assert_identical(model)


def a_step_on_a_new_communicator(model, ref, batch, r, momentum=0.0, init=None, **kw):
    """After a communicator ended: hvd.init() on a new one (or `init()`), where one SGD(lr=0.1,
    momentum) step, DistributedOptimizer with `kw`, gives identical replicas equal to the float64
    reference's."""
    hvd.init(comm=WORLD.Dup()) if init is None else init()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    opt = hvd.DistributedOptimizer(sgd, model.named_parameters(), **kw)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=momentum)
    opt.zero_grad()
    rank_loss(model, *batch, r)
    opt.step()
    reference_step(ref, ref_opt, *batch)
    assert_identical(model)
    assert_close_to(model, ref, atol=1e-5)


@pytest.mark.parallel(SIZES)
def test_a_stray_call_inside_a_step_fails_it_on_every_rank_and_ends_the_communicator():
    """One rank starts a collective inside its step that the others do not: every rank's step() raises a
    HorovodInternalError (gflow's error: the ranks disagree on the collective), and parameters and local
    gradients are unchanged. A step met another kind of call, so every later step on that communicator
    fails on every rank (which steps would pair next depends on the program: helper-77), and training
    goes on on a new communicator, equal to the reference."""
    r, p = WORLD.rank, WORLD.size
    data = batches(4)
    hvd.init(comm=WORLD.Dup())

    def check():
        model, ref, opt, ref_opt = sgd_and_reference(threshold_bytes=300)  # (segments during backward)
        for step, (x, y) in enumerate(data[:3]):
            opt.zero_grad()
            rank_loss(model, x, y, r)
            if step < 1 or p == 1:
                opt.step()
                reference_step(ref, ref_opt, x, y)
                assert_identical(model)
                assert_close_to(model, ref, atol=1e-5)
                continue
            params = [q.detach().clone() for q in model.parameters()]
            grads = [None if q.grad is None else q.grad.clone() for q in model.parameters()]
            stray = hvd.allreduce_async(torch.ones(7)) if r == p - 1 and step == 1 else None
            with pytest.raises(hvd.HorovodInternalError, match="disagree|another kind of call") as info:
                opt.step()
            assert isinstance(info.value, gflow.GflowError)
            if stray is not None:  # (a step is named as such, not by gflow's internal name)
                step_words = r"on the collective: rank \d+ called a gradient step \(fused allreduce\)"
                with pytest.raises(gflow.MismatchError, match=step_words):
                    hvd.synchronize(stray)
            for q, before, grad in zip(model.parameters(), params, grads, strict=True):
                assert torch.equal(q.detach(), before)
                assert (q.grad is None and grad is None) or torch.equal(q.grad, grad)
        a_step_on_a_new_communicator(model, ref, data[3], r, momentum=0.5, threshold_bytes=300)

    try:
        on_all_ranks(check)
    finally:
        hvd.init()


@pytest.mark.parallel([2, 3])
def test_a_synchronize_on_one_rank_only_is_named_in_the_error():
    """helper-83: rank 0 alone calls optimizer.synchronize() (to log a norm), then step() without
    skip_synchronize(). Its step's check whether a rank set a gradient anew met the others' next step,
    and the error named only gflow's internal allreduce. Every rank's error now says what rank 0's
    call was."""
    r = WORLD.rank
    data = batches(3)
    hvd.init(comm=WORLD.Dup())

    def check():
        model = make_model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
        errors = []
        for step, (x, y) in enumerate(data):
            opt.zero_grad()
            rank_loss(model, x, y, r)
            try:
                if step == 1 and r == 0:
                    opt.synchronize()
                    with warnings.catch_warnings():  # (Horovod's warning: step() after synchronize())
                        warnings.simplefilter("ignore")
                        opt.step()
                else:
                    opt.step()
            except hvd.HorovodInternalError as exc:
                errors.append(str(exc))
        assert errors, "no rank's step failed"
        named = "it passed step() after its own optimizer.synchronize() (did some rank set a gradient anew?)"
        assert named in errors[0], errors[0]

    try:
        on_all_ranks(check)
    finally:
        hvd.init()


CROSSED_CASES = [  # (where the last rank's metric is, how every rank zeroes, threshold_bytes)
    *[("between", zero, threshold) for zero in ("optimizer", "model") for threshold in (300, None)],
    ("after", "optimizer", 300),  # (segments sent during backward, or all at step())
    ("before", "model", None),
    ("between", "synchronize", 300),  # (Horovod's way to drop a step: synchronize(), zero_grad())
]


ASYNC_CASES = [("after", "optimizer", 300), ("after", "model", None), ("before", "optimizer", None),
               ("between", "synchronize", 300), ("between", "model", None)]  # fmt: skip


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize(
    ("call", "where", "zero", "threshold"),
    [("blocking", *case) for case in CROSSED_CASES] + [("async", *case) for case in ASYNC_CASES],
)
def test_after_crossed_waits_or_a_stray_async_call_no_rank_steps_again(
    call, where, zero, threshold, monkeypatch
):
    """The last rank reduces a metric alone (before backward, between backward and step(), or after
    step()) while the others are in their step: MismatchError on every rank within seconds (crossed
    waits, for a blocking call; for an async one, the ranks disagree on the collective). From then on
    every step on that communicator fails on every rank, sending nothing, and training goes on on a
    new one. Which of the ranks' steps pair after such an error depends on the program (did the rank's
    error skip its step, or come after it?): going on let steps pair a rank's batch k with the others'
    k + 1, silently (helper-73, helper-75, helper-77). The replicas stay identical, equal to a float64
    reference of the steps that succeeded."""
    monkeypatch.setattr(stall, "CROSSED_S", 0.25)  # (checked sooner: the same check, a quarter of the wait)
    r, last = WORLD.rank, WORLD.size - 1
    data = batches(5)
    hvd.init(comm=WORLD.Dup())

    def check():
        model, ref, opt, ref_opt = sgd_and_reference(threshold_bytes=threshold)
        failed = []
        said = "crossed waits" if call == "blocking" else "disagree on the collective|another kind of call"

        def reduce_metric():  # (on this rank only)
            if call == "blocking":
                hvd.allreduce(torch.ones(1), name="metric")
            else:
                hvd.synchronize(hvd.allreduce_async(torch.ones(1), name="metric"))

        for step, (x, y) in enumerate(data):
            metric = step == 1 and r == last
            try:
                if metric and where == "before":
                    reduce_metric()
                (model if zero == "model" else opt).zero_grad()
                rank_loss(model, x, y, r)
                if metric and where == "between":
                    reduce_metric()
                opt.step()
                reference_step(ref, ref_opt, x, y)
                if metric and where == "after":
                    reduce_metric()
            except gflow.GflowError as error:
                failed.append(step)
                assert re.search(said, str(error)), error
                if zero == "synchronize":  # (Horovod's way to drop a step: synchronize(), zero_grad())
                    with pytest.raises(gflow.GflowError, match=said):
                        opt.synchronize()
                    opt.zero_grad()
        assert failed == list(range(2 if where == "after" and r < last else 1, 5)), failed
        assert_identical(model)
        assert_close_to(model, ref, atol=1e-5)
        a_step_on_a_new_communicator(model, ref, data[0], r)

    try:
        on_all_ranks(check)
    finally:
        hvd.init()


@pytest.mark.parallel([2, 3])
def test_shutdown_and_init_go_on_after_crossed_waits(monkeypatch):
    """As in Horovod, where init() duplicates its communicator every time: hvd.shutdown() then
    hvd.init() on the communicator that crossed waits ended goes on, on a duplicate of it (it stayed
    ended before: helper-83), while gflow's own calls on that communicator are still refused."""
    monkeypatch.setattr(stall, "CROSSED_S", 0.25)
    r, last = WORLD.rank, WORLD.size - 1
    comm = WORLD.Dup()
    (x, y), after = batches(2)
    hvd.init(comm=comm)

    def check():
        model, ref, opt, _ = sgd_and_reference()
        opt.zero_grad()
        rank_loss(model, x, y, r)
        with pytest.raises(gflow.GflowError, match="crossed waits"):
            if r == last:  # a metric reduced on this rank only, between backward and step()
                hvd.allreduce(torch.ones(1), name="metric")
            opt.step()
        with pytest.raises(gflow.GflowError, match="crossed waits"):
            hvd.allreduce(torch.ones(1))
        assert_identical(model)  # (no step was taken anywhere)
        hvd.shutdown()

        def init_again():
            hvd.init(comm=comm)
            assert (hvd.rank(), hvd.size()) == (r, WORLD.size)

        a_step_on_a_new_communicator(model, ref, after, r, init=init_again)
        with pytest.raises(gflow.GflowError, match="crossed waits"):  # gflow's own calls: still ended
            gflow.allreduce(np.ones(1), comm=comm)

    try:
        on_all_ranks(check)
    finally:
        hvd.init()


@pytest.mark.isolated  # (it ends COMM_WORLD's collectives: no later test of a batch could use them)
@pytest.mark.parallel([2])
def test_shutdown_and_init_go_on_after_crossed_waits_on_the_world(monkeypatch):
    """hvd.init() with no argument (or a list of ranks) after crossed waits on COMM_WORLD: its check
    that every rank passed the same ranks ran on the ended world and raised (helper-93). A second
    init() with no shutdown() between stays on the duplicate (it went back to the ended world)."""
    monkeypatch.setattr(stall, "CROSSED_S", 0.25)
    r, last = WORLD.rank, WORLD.size - 1
    hvd.init()
    (x, y), after = batches(2)

    def check():
        model, ref, opt, _ = sgd_and_reference()
        opt.zero_grad()
        rank_loss(model, x, y, r)
        with pytest.raises(gflow.GflowError, match="crossed waits"):
            if r == last:
                hvd.allreduce(torch.ones(1), name="metric")
            opt.step()
        hvd.shutdown()
        a_step_on_a_new_communicator(model, ref, after, r, init=hvd.init)
        hvd.init()  # (again, as wrappers do)
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == WORLD.size
        hvd.init(comm=list(range(WORLD.size)))
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == WORLD.size

    on_all_ranks(check)


@pytest.mark.parallel([1, 2])
def test_bad_arguments_are_named():
    r = WORLD.rank

    def check():
        model = make_model()
        named = list(model.named_parameters())

        def sgd(**kw):
            return torch.optim.SGD(model.parameters(), lr=0.1, **kw)

        def wrap(opt=None, named=named, **kw):
            return hvd.DistributedOptimizer(sgd() if opt is None else opt, named, **kw)

        cases = [
            (TypeError, "torch.optim.Optimizer", lambda: hvd.DistributedOptimizer(model)),
            (ValueError, "unique", lambda: wrap(named=[("a", q) for _, q in named])),
            (ValueError, "not named", lambda: wrap(named=named[1:])),
            (ValueError, "tuples", lambda: wrap(named=list(model.parameters()))),
            (ValueError, "backward_passes_per_step", lambda: wrap(backward_passes_per_step=0)),
            (TypeError, "backward_passes_per_step", lambda: wrap(backward_passes_per_step=1.5)),
            (ValueError, "op", lambda: wrap(op=hvd.Max)),
            (ValueError, "predivide", lambda: wrap(op=hvd.Sum, gradient_predivide_factor=2.0)),
            (ValueError, "predivide", lambda: wrap(gradient_predivide_factor=0)),
            (TypeError, "compression", lambda: wrap(compression=object())),
            (TypeError, "sparse", lambda: wrap(sparse=True)),
            (ValueError, "density", lambda: wrap(sparse=dict(density=2.0))),
            (ValueError, "nesterov", lambda: wrap(sgd(momentum=0.9, nesterov=True), sparse={})),
            (ValueError, "once", lambda: wrap(sgd(momentum=0.9), sparse=dict(momentum=0.5))),
            (ValueError, "not registered", lambda: wrap(process_set=hvd.ProcessSet([0]))),
            (TypeError, "ProcessSet", lambda: wrap(process_set=[0])),
            (ValueError, "threshold_bytes", lambda: wrap(threshold_bytes=0)),
        ]
        for error, match, call in cases:
            with pytest.raises(error, match=match):
                call()
        plain = sgd(momentum=0.9)
        with pytest.raises(ValueError, match="once"):
            hvd.DistributedOptimizer(plain, named, sparse=dict(momentum=0.5))
        assert plain.param_groups[0]["momentum"] == 0.9  # a refused wrap leaves the optimizer as it was
        opt = hvd.DistributedOptimizer(sgd(), named)
        with pytest.raises(ValueError, match="already"):
            hvd.DistributedOptimizer(opt, named)
        assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
        x, y = batches(1)[0]
        rank_loss(model, x, y, r)
        with pytest.raises(AssertionError, match="zero_grad"):
            opt.zero_grad()
        with pytest.raises(AssertionError, match="backward_passes_per_step"):
            rank_loss(model, x, y, r)
        with pytest.raises(RuntimeError, match="changed after backward sent it"):
            opt.step()  # that backward accumulated into a gradient already sent: not applied
        opt.zero_grad()
        rank_loss(model, x, y, r)
        opt.step()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.zero_grad()

    on_all_ranks(check)


@pytest.mark.parallel(SIZES)
def test_threshold_auto_tunes_while_training_stays_exact():
    """threshold_bytes="auto": the steps that try thresholds train exactly as one process does, and
    every rank settles on the same threshold."""
    r, n = WORLD.rank, WORLD.size * PER_RANK

    def check():
        torch.manual_seed(0)
        # 1.4 MB of gradients: four candidates, 256 KiB to 2 MiB
        model = torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.Tanh(), torch.nn.Linear(600, 4))
        ref = copy.deepcopy(model).double()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
            threshold_bytes="auto",
        )  # fmt: skip
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        lazy = opt._dp._lazy
        g = torch.Generator().manual_seed(2)
        steps = 0
        while lazy.tuning or steps < 30:
            x, y = torch.randn(n, 600, generator=g), torch.randint(0, 4, (n,), generator=g)
            opt.zero_grad()
            F.cross_entropy(
                model(x[r * PER_RANK : (r + 1) * PER_RANK]), y[r * PER_RANK : (r + 1) * PER_RANK]
            ).backward()
            opt.step()
            ref_opt.zero_grad()
            F.cross_entropy(ref(x.double()), y).backward()  # the mean over all ranks' samples
            ref_opt.step()
            assert_identical(model)
            assert_close_to(model, ref, atol=1e-5)
            steps += 1
            if steps == 1 and WORLD.size == 1:
                assert not lazy.tuning  # alone, nothing is fused: it settles at once
        assert not lazy.tuning
        settled = WORLD.allgather(lazy.threshold_bytes)
        assert settled == [settled[0]] * WORLD.size
        assert opt.state_dict()["gflow"]["lazy"]["tuned_threshold_bytes"] == settled[0]
        # Horovod's restore: root loads the checkpoint, broadcast_optimizer_state gives the rest its
        # state, the settled threshold included (review: the others tuned afresh, and every step failed).
        checkpoint = opt.state_dict()
        model = copy.deepcopy(model)  # (the old optimizer's hooks stay on the old one)
        fresh = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
            threshold_bytes="auto",
        )  # fmt: skip
        if r == 0:
            fresh.load_state_dict(checkpoint)
        hvd.broadcast_optimizer_state(fresh, root_rank=0)
        assert not fresh._dp._lazy.tuning and fresh._dp._lazy.threshold_bytes == settled[0]
        fresh.zero_grad()
        F.cross_entropy(
            model(x[r * PER_RANK : (r + 1) * PER_RANK]), y[r * PER_RANK : (r + 1) * PER_RANK]
        ).backward()
        fresh.step()
        assert_identical(model)

    on_all_ranks(check)


@pytest.mark.parallel(SIZES)
def test_a_replaced_optimizer_still_alive_is_named_when_its_hooks_fail():
    """A new DistributedOptimizer over the same parameters while the old one lives on (its LR scheduler
    holds it): the old one's hooks still fire, and its error says so instead of only suggesting more
    backward_passes_per_step; once the old one is gone the new one trains on."""
    r = WORLD.rank
    data = batches(4)

    def replace():
        model = make_model()
        old = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
        )
        schedule = torch.optim.lr_scheduler.StepLR(old, step_size=1)
        old.zero_grad()
        rank_loss(model, *data[0], r)
        old.step()
        schedule.step()
        new = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
        )
        new.zero_grad()
        rank_loss(model, *data[1], r)  # the old one's hooks count this backward...
        new.step()
        new.zero_grad()
        with pytest.raises(AssertionError, match="another DistributedOptimizer, still alive"):
            rank_loss(model, *data[2], r)  # ... and refuse the next, before the new one's hook runs
        del schedule, old
        gc.collect()
        new.zero_grad()
        rank_loss(model, *data[3], r)
        new.step()
        assert_identical(model)

    on_all_ranks(replace, "replaced optimizer")


@pytest.mark.parallel(SIZES)
def test_no_sync_accumulates_locally_and_the_next_backward_reduces_the_sum():
    """DDP's pattern: micro-batches inside no_sync(), the last one outside; the step applies the ranks'
    average of each rank's summed gradient (float64 replay), and nothing communicates inside."""
    rng = np.random.default_rng([51, WORLD.rank])
    batches = [torch.from_numpy(rng.standard_normal((4, 3))) for _ in range(3)]

    def check():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2).double()
        start = [p.detach().clone() for p in model.parameters()]
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
        calls = []
        original = opt._dp.push
        opt._dp.push = lambda *a, **k: calls.append(a[0]) or original(*a, **k)
        with opt.no_sync():
            for x in batches[:2]:
                model(x).square().sum().backward()
            assert calls == [], "no_sync() pushed a gradient"
            with pytest.raises(RuntimeError, match="no_sync"):
                opt.step()
            with pytest.raises(RuntimeError, match="no_sync"):
                opt.synchronize()
        model(batches[2]).square().sum().backward()
        opt.step()
        replay = torch.nn.Linear(3, 2).double()
        with torch.no_grad():
            for p, s in zip(replay.parameters(), start, strict=True):
                p.copy_(s)
        for x in batches:
            replay(x).square().sum().backward()
        for p, q, s in zip(model.parameters(), replay.parameters(), start, strict=True):
            average = np.mean(WORLD.allgather(q.grad.numpy()), axis=0)
            np.testing.assert_allclose(p.detach().numpy(), s.numpy() - 0.1 * average, rtol=1e-12)
            assert_same_on_all_ranks(p.detach().numpy())
        opt.zero_grad()
        model(batches[0]).sum().backward()
        with pytest.raises(RuntimeError, match="first backward"):
            with opt.no_sync():
                pass
        opt.step()

    on_all_ranks(check)


class _Tagger(torch.nn.Module):
    """A sparse embedding and a dense head; `use_embedding=False` leaves the embedding without a gradient."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(12, 3, sparse=True)
        self.head = torch.nn.Linear(3, 2)

    def forward(self, idx, use_embedding=True):
        x = self.embedding(idx) if use_embedding else torch.ones(len(idx), 3, dtype=self.head.weight.dtype)
        return self.head(x).sum()


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("op", ["average", "sum"])
def test_sparse_gradients_are_gathered_as_horovods_and_sparse_adam_steps(op):
    """nn.Embedding(sparse=True): p.grad stays sparse and holds every rank's entries (divided by the size
    for Average), so SparseAdam works; its dense form is MPI's float64 sum of the ranks' gradients. The
    last rank (of several) leaves the embedding unused on the second step and still gets the others'."""
    rng = np.random.default_rng([44, WORLD.rank])

    def check():
        torch.manual_seed(0)
        model = _Tagger().double()
        hvd_op = hvd.Average if op == "average" else hvd.Sum
        sparse_opt = hvd.DistributedOptimizer(
            torch.optim.SparseAdam(list(model.embedding.parameters()), lr=0.01),
            named_parameters=list(model.embedding.named_parameters(prefix="embedding")),
            op=hvd_op,
        )
        for step in range(2):
            sparse_opt.zero_grad()
            idx = torch.from_numpy(rng.integers(0, 12, 5))
            unused = step == 1 and WORLD.rank == WORLD.size - 1 and WORLD.size > 1
            model(idx, use_embedding=not unused).backward()
            local = np.zeros((12, 3)) if unused else model.embedding.weight.grad.to_dense().numpy()
            expected = WORLD.allreduce(local) / (WORLD.size if op == "average" else 1)
            sparse_opt.synchronize()
            grad = model.embedding.weight.grad
            assert grad.layout == torch.sparse_coo
            np.testing.assert_allclose(grad.to_dense().numpy(), expected, rtol=1e-12, atol=1e-15)
            with sparse_opt.skip_synchronize():
                sparse_opt.step()
            assert_same_on_all_ranks(model.embedding.weight.detach().numpy())

    on_all_ranks(check)


def _kit_reduces(opt, name) -> bool:
    """Whether the optimizer's last step reduced a slot (zeros, for a sparse gradient) for `name` in
    its fused buffers (DataParallel.gradients() gives None for a parameter out of the fusion)."""
    return opt._dp.gradients()[name] is not None


@pytest.mark.parallel(SIZES)
def test_sparse_gradients_leave_the_fusion_after_the_first_step():
    """Once the ranks have seen the embedding's gradient sparse, the fused buffers no longer carry a
    zero slot for it, and every step still matches MPI's float64 average; a dense gradient for it
    later (on every rank) is reduced densely and takes it back into the fusion; mixed layouts fail on
    every rank; a SparseAdam over the embedding alone keeps working with nothing fused."""
    rng = np.random.default_rng([47, WORLD.rank])

    def check():
        torch.manual_seed(0)
        model = _Tagger().double()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
        torch.manual_seed(1)
        tagger = _Tagger().double()
        sparse_opt = hvd.DistributedOptimizer(
            torch.optim.SparseAdam(list(tagger.embedding.parameters()), lr=0.01),
            named_parameters=list(tagger.embedding.named_parameters(prefix="embedding")),
        )
        # (step, the embedding's layout on each rank): sparse, sparse, dense everywhere, sparse, sparse
        for step, dense_step in enumerate([False, False, True, False, False]):
            for net, optimizer in ((model, opt), (tagger, sparse_opt)):
                dense = dense_step and optimizer is opt  # (SparseAdam takes sparse gradients only)
                optimizer.zero_grad()
                net.embedding.sparse = not dense
                net(torch.from_numpy(rng.integers(0, 12, 5))).backward()
                params = [p for group in optimizer.param_groups for p in group["params"]]
                expected = [WORLD.allreduce(p.grad.to_dense().numpy()) / WORLD.size for p in params]
                optimizer.synchronize()
                for p, e in zip(params, expected, strict=True):
                    np.testing.assert_allclose(p.grad.to_dense().numpy(), e, rtol=1e-12, atol=1e-15)
                layout = torch.strided if dense else torch.sparse_coo
                assert net.embedding.weight.grad.layout == layout
                with optimizer.skip_synchronize():
                    optimizer.step()
                assert_same_on_all_ranks(net.embedding.weight.detach().numpy())
                # in the fusion at the first step (not yet known) and the step after a dense one; the
                # dense one itself is reduced on its own
                fused = step == 0 or (step == 3 and optimizer is opt)
                assert _kit_reduces(optimizer, "embedding.weight") == fused, step
        if WORLD.size > 1:
            opt.zero_grad()
            model.embedding.sparse = WORLD.rank != WORLD.size - 1
            model(torch.tensor([1, 2])).backward()
            with pytest.raises(RuntimeError, match="sparse on some ranks and dense on others"):
                opt.step()

    on_all_ranks(check)


@pytest.mark.parallel([2, 3])
def test_an_fp16_overflow_of_a_dense_gradient_out_of_the_fusion_is_refused_as_the_kits():
    """compression=fp16: a dense gradient past float16's range, for the embedding once its gradients
    left the fusion, overflows on every rank alike: step() raises CompressionOverflowError and leaves
    the parameters as they were; the next step trains."""

    def check():
        torch.manual_seed(0)
        model = _Tagger()
        fp16 = hvd.Compression.fp16
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), compression=fp16
        )
        for step in range(3):
            opt.zero_grad()
            model.embedding.sparse = step != 1
            idx = torch.tensor([1, 2, 3])
            huge = 1e6 * model.embedding(idx).sum() if step == 1 else 0.0  # (the head's stay small)
            (model(idx) + huge).backward()
            before = [p.detach().clone() for p in model.parameters()]
            if step == 1:  # as the kit's overflow: NaN on every rank (GradScaler skips), step() raises
                opt.synchronize()
                assert torch.isnan(model.embedding.weight.grad).all()
                assert not torch.isnan(model.head.weight.grad).any()
                with pytest.raises(gflow.CompressionOverflowError), opt.skip_synchronize():
                    opt.step()
                assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
            else:
                opt.step()
                assert not torch.equal(model.embedding.weight, before[0])
            assert_same_on_all_ranks(np.concatenate([p.detach().numpy().ravel() for p in model.parameters()]))

    on_all_ranks(check)


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("threshold", [None, "auto"])
def test_horovods_restore_recipe_after_the_sparse_gradients_left_the_fusion(threshold):
    """A checkpoint taken once the embedding's gradients left the fusion, loaded on rank 0 alone into
    a fresh optimizer, then broadcast_optimizer_state (Horovod's recipe, tuning included): the steps
    after it match MPI's float64 average, alike on every rank, as an uninterrupted optimizer's do."""
    rng = np.random.default_rng([50, WORLD.rank])
    kwargs = {} if threshold is None else {"threshold_bytes": threshold}

    def check():
        torch.manual_seed(0)
        model = _Tagger().double()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model.named_parameters(), **kwargs
        )
        for _ in range(3):
            opt.zero_grad()
            model(torch.from_numpy(rng.integers(0, 12, 5))).backward()
            opt.step()
        saved = io.BytesIO()
        torch.save(opt.state_dict(), saved)
        saved.seek(0)
        twin = _Tagger().double()
        fresh = hvd.DistributedOptimizer(
            torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9), twin.named_parameters(), **kwargs
        )
        if WORLD.rank == 0:
            twin.load_state_dict(model.state_dict())
            fresh.load_state_dict(torch.load(saved))
        hvd.broadcast_parameters(twin.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(fresh, root_rank=0)
        for _ in range(4):
            for net, optimizer in ((model, opt), (twin, fresh)):
                optimizer.zero_grad()
                net(torch.tensor([WORLD.rank % 12, 5, 7])).backward()
                params = list(net.parameters())
                expected = [WORLD.allreduce(p.grad.to_dense().numpy()) / WORLD.size for p in params]
                optimizer.synchronize()
                for p, e in zip(params, expected, strict=True):
                    np.testing.assert_allclose(p.grad.to_dense().numpy(), e, rtol=1e-12, atol=1e-15)
                with optimizer.skip_synchronize():
                    optimizer.step()
            for a, b in zip(model.parameters(), twin.parameters(), strict=True):
                np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-12, atol=1e-14)
            assert_same_on_all_ranks(np.concatenate([p.detach().numpy().ravel() for p in twin.parameters()]))

    on_all_ranks(check)


@pytest.mark.parallel([2, 3])
def test_a_gradient_sparse_on_one_rank_and_dense_on_another_fails_every_rank():
    def check():
        emb = torch.nn.Embedding(6, 2, sparse=WORLD.rank == 0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), emb.named_parameters())
        emb(torch.tensor([1, 2])).sum().backward()
        with pytest.raises(RuntimeError, match="sparse on some ranks and dense on others"):
            opt.step()

    on_all_ranks(check)


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_an_embedding_a_rank_left_unused_has_no_layout_of_its_own(set_to_none):
    """zero_grad(set_to_none=False) leaves an empty sparse gradient on an nn.Embedding(sparse=True)
    that a rank then does not use: it holds zeros, as None would, and must not make a step where the
    other ranks' gradient is dense fail as "sparse on some ranks". op=Sum, no named_parameters."""
    rng = np.random.default_rng([46, WORLD.rank])

    def check():
        torch.manual_seed(0)
        emb, head = torch.nn.Embedding(10, 3, sparse=True).double(), torch.nn.Linear(3, 1).double()
        params = [emb.weight, *head.parameters()]
        opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), op=hvd.Sum)  # (no momentum: torch
        last = WORLD.rank == WORLD.size - 1  # adds no sparse gradient to a dense buffer)
        for step, (sparse, skipped) in enumerate([(True, False), (False, True), (True, True), (True, False)]):
            opt.zero_grad(set_to_none=set_to_none)
            emb.sparse = sparse
            rows = torch.from_numpy(rng.integers(0, 10, 4))
            x = torch.from_numpy(rng.standard_normal((4, 3))) if skipped and last else emb(rows)
            head(x).pow(2).sum().backward()
            local = [
                np.zeros(p.shape) if p.grad is None else p.grad.to_dense().numpy().copy() for p in params
            ]
            expected = [WORLD.allreduce(g) for g in local]
            opt.synchronize()
            for i, (p, e) in enumerate(zip(params, expected, strict=True)):
                np.testing.assert_allclose(
                    p.grad.to_dense().numpy(), e, rtol=1e-12, atol=1e-14, err_msg=f"{step} {i}"
                )
            with opt.skip_synchronize():
                opt.step()
            assert_same_on_all_ranks(emb.weight.detach().numpy())

    on_all_ranks(check)


@pytest.mark.parallel([2, 3])
def test_a_mixed_layout_names_the_parameter_and_this_ranks_layout():
    def check():
        emb = torch.nn.Embedding(6, 2, sparse=WORLD.rank == 0)
        head = torch.nn.Linear(2, 1)
        opt = hvd.DistributedOptimizer(torch.optim.SGD([*head.parameters(), emb.weight], lr=0.1))
        head(emb(torch.tensor([1, 2]))).sum().backward()
        here = "sparse" if WORLD.rank == 0 else "dense"
        with pytest.raises(
            RuntimeError,
            match=rf"'allreduce.noname.2' is sparse .* \(this rank's of 'allreduce.noname.2': {here}\)",
        ):
            opt.step()

    on_all_ranks(check)


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("padded", [False, True])
def test_a_gradient_changed_through_data_while_reduced_in_its_pool_fails_the_step_on_every_rank(padded):
    """gradient_as_bucket_view: the last rank scales its gradients through p.grad.data after backward,
    once its pool's segments came back reduced (torch's version counter does not see a change through
    .data): its gradients differed from the others' and the replicas parted, silently (helper-94).
    The ranks compare a sample of the reduced gradients: RuntimeError on every rank, no weight moved,
    and after zero_grad() the next step works. `padded`: one small layer whose input's first column is
    always 0, so its gradient's element 0 is (the sample was element 0 alone: helper-96)."""
    rng = torch.Generator().manual_seed(WORLD.rank)

    def check():
        torch.manual_seed(0)
        if padded:
            model = torch.nn.Sequential(torch.nn.Linear(64, 1, bias=False))
        else:
            model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Tanh(), torch.nn.Linear(30, 5))
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            gradient_as_bucket_view=True,
            threshold_bytes=1,  # each gradient goes out as backward produces it
        )
        x = torch.randn(8, 64 if padded else 40, generator=rng)
        if padded:
            x[:, 0] = 0.0
        model(x).pow(2).sum().backward()
        if WORLD.rank == WORLD.size - 1:
            time.sleep(1.0)  # meanwhile its segments came back reduced, into p.grad
            for p in model.parameters():
                p.grad.data.mul_(0.5)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(RuntimeError, match=r"differ between the ranks .* p\.grad\.data"):
            opt.step()
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
        assert_same_on_all_ranks(np.concatenate([p.detach().numpy().ravel() for p in model.parameters()]))

    on_all_ranks(check)


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradient_as_bucket_view_reduces_in_the_pool_and_matches_mpi(set_to_none):
    """Each p.grad is a view of the fusion pool (the same memory every step with set_to_none=False) and
    holds MPI's float64 average of the ranks' gradients; the last rank of several leaves a layer unused on
    one step; freezing a layer rebuilds the pool and the views follow."""
    rng = np.random.default_rng([45, WORLD.rank])

    def check():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()
        extra = torch.nn.Linear(6, 3).double()
        params = list(model.named_parameters()) + [("extra." + n, p) for n, p in extra.named_parameters()]
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD([p for _, p in params], lr=0.05, momentum=0.9),
            named_parameters=params,
            gradient_as_bucket_view=True,
        )
        addresses = None
        for step in range(4):
            if step == 3:
                model[0].weight.requires_grad_(False)
            opt.zero_grad(set_to_none=set_to_none)
            x = torch.from_numpy(rng.standard_normal((4, 6)))
            loss = model(x).pow(2).sum()
            if not (step == 1 and WORLD.rank == WORLD.size - 1 and WORLD.size > 1):
                loss = loss + extra(x).sum()
            loss.backward()
            live = [(n, p) for n, p in params if p.requires_grad]
            local = [np.zeros(p.shape) if p.grad is None else p.grad.numpy().copy() for _, p in live]
            expected = [WORLD.allreduce(g) / WORLD.size for g in local]
            opt.synchronize()
            for (name, p), e in zip(live, expected, strict=True):
                np.testing.assert_allclose(p.grad.numpy(), e, rtol=1e-12, atol=1e-14, err_msg=name)
            if not set_to_none and step in (1, 2):
                now = [p.grad.data_ptr() for _, p in live]
                assert addresses is None or now == addresses, "the views moved"
                addresses = now
            with opt.skip_synchronize():
                opt.step()
            assert_same_on_all_ranks(np.concatenate([p.detach().numpy().ravel() for _, p in params]))

    on_all_ranks(check)


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("named", [False, True])
@pytest.mark.parametrize("views", [False, True])
def test_ranks_that_freeze_two_layers_of_one_shape_one_each_fail_on_every_rank(named, views):
    """Even ranks freeze one layer, odd ranks another of the same shape: without named_parameters the
    gradients were keyed by their place among those reduced, so one rank's layer was averaged with
    another's, silently, and the replicas parted (helper-91). Every rank now raises MismatchError
    naming both, by Horovod's "allreduce.noname.<i>" where unnamed, and no weight moves."""
    r = WORLD.rank

    def check():
        torch.manual_seed(0)
        layers = [torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6), torch.nn.Tanh()]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)).double()
        named_parameters = model.named_parameters() if named else None
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = hvd.DistributedOptimizer(sgd, named_parameters, gradient_as_bucket_view=views)
        x = torch.from_numpy(np.random.default_rng([47, r]).standard_normal((4, 5)))
        model[2 if r % 2 == 0 else 4].requires_grad_(False)
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        frozen = ["2.bias", "4.bias"] if named else ["allreduce.noname.3", "allreduce.noname.5"]
        with pytest.raises(gflow.MismatchError, match=f"pushed ({frozen[0]}|{frozen[1]}) .*pushed"):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))

    on_all_ranks(check)


@pytest.mark.parallel([2, 3])
def test_gradient_as_bucket_view_retried_after_a_refused_step_matches_mpi():
    """The pool is reduced in place (DDP's way): a step refused on every rank (a gradient changed after
    backward on one rank) is retried by recomputing the gradients, and then holds MPI's average."""
    rng = np.random.default_rng([46, WORLD.rank])

    def check():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model.named_parameters(),
            gradient_as_bucket_view=True,
        )
        x = torch.from_numpy(rng.standard_normal((3, 5)))
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        if WORLD.rank == WORLD.size - 1:
            model[0].weight.grad.mul_(2.0)  # after its hook pushed it: the step is refused everywhere
        with pytest.raises(RuntimeError, match="changed"):
            opt.step()
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        expected = [WORLD.allreduce(p.grad.numpy().copy()) / WORLD.size for p in model.parameters()]
        opt.synchronize()
        for p, e in zip(model.parameters(), expected, strict=True):
            np.testing.assert_allclose(p.grad.numpy(), e, rtol=1e-12, atol=1e-14)
        with opt.skip_synchronize():
            opt.step()
        assert_same_on_all_ranks(np.concatenate([p.detach().numpy().ravel() for p in model.parameters()]))

    on_all_ranks(check)


@pytest.mark.parallel([1])
def test_gradient_as_bucket_view_refuses_what_its_pool_cannot_hold():
    model = torch.nn.Linear(3, 2)
    for kwargs in ({"compression": hvd.Compression.fp16}, {"gradient_predivide_factor": 2.0}):
        with pytest.raises(ValueError, match="gradient_as_bucket_view"):
            hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), gradient_as_bucket_view=True, **kwargs
            )
    with pytest.raises(ValueError, match="float32 or float64"):
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.half().parameters(), lr=0.1), gradient_as_bucket_view=True
        )


@pytest.mark.parallel([2])
def test_sparse_gradients_without_named_parameters():
    def check():
        torch.manual_seed(0)
        emb = torch.nn.Embedding(8, 2, sparse=True)
        opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.01))
        opt.zero_grad()
        emb(torch.tensor([WORLD.rank, 5])).sum().backward()
        expected = WORLD.allreduce(emb.weight.grad.to_dense().numpy()) / WORLD.size
        opt.step()
        assert emb.weight.grad.layout == torch.sparse_coo
        np.testing.assert_allclose(emb.weight.grad.to_dense().numpy(), expected, rtol=1e-6)
        assert_same_on_all_ranks(emb.weight.detach().numpy())

    on_all_ranks(check)


@pytest.mark.parallel([1])
def test_parameter_names_are_horovods():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters()}]
    unnamed = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    assert list(unnamed._parameter_names.values()) == [f"allreduce.noname.{i}" for i in range(4)]
    named = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    assert list(named._parameter_names.values()) == ["0.weight", "0.bias", "1.weight", "1.bias"]


@pytest.mark.parallel([2, 3])
def test_sparse_as_dense_hands_a_sparse_gradient_to_ranks_that_had_none_and_replicas_stay_bitwise():
    """sparse_as_dense=True with the embedding unused on some ranks in a step: every rank gets the
    reduced gradient sparse (a dense one steps SGD with another rounding: replicas drift apart by an
    ulp), equal to MPI's float64 average, and the weights stay bitwise identical."""
    rng = np.random.default_rng([49, WORLD.rank])

    def check():
        torch.manual_seed(0)
        model = _Tagger().double()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), sparse_as_dense=True
        )
        for step in range(4):
            opt.zero_grad()
            use = (step + WORLD.rank) % 3 != 0
            model(torch.from_numpy(rng.integers(0, 12, 4)), use_embedding=use).backward()
            weight = model.embedding.weight
            local = weight.grad.to_dense().numpy() if weight.grad is not None else np.zeros((12, 3))
            expected = WORLD.allreduce(local) / WORLD.size
            opt.synchronize()
            assert weight.grad.layout == torch.sparse_coo, (step, use)
            np.testing.assert_allclose(weight.grad.to_dense().numpy(), expected, rtol=1e-12, atol=1e-15)
            with opt.skip_synchronize():
                opt.step()
            assert_same_on_all_ranks(np.concatenate([p.detach().numpy().ravel() for p in model.parameters()]))

    on_all_ranks(check)


@pytest.mark.parallel([2, 3])
def test_ranks_with_different_sparse_as_dense_fail_every_step_on_every_rank():
    """sparse_as_dense=True on the last rank only: every rank refuses each step (none applies it
    alone), whichever rank used the embedding."""

    def check():
        torch.manual_seed(0)
        model = _Tagger().double()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model.named_parameters(),
            sparse_as_dense=WORLD.rank == WORLD.size - 1,
        )
        before = [p.detach().clone() for p in model.parameters()]
        for _ in range(2):
            opt.zero_grad()
            model(torch.tensor([1, 2, WORLD.rank % 12])).backward()
            with pytest.raises(Exception, match="sparse_as_dense differ"):
                opt.step()
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))

    on_all_ranks(check)


@pytest.mark.parallel([1, 2])
def test_sparse_as_dense_reduces_dense_and_hands_back_a_sparse_gradient():
    """Horovod's sparse_as_dense=True: reduced as a dense tensor, made sparse again for the optimizer (so
    SparseAdam still steps); its dense form is MPI's average of the ranks' gradients."""

    def check():
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=True)
        opt = hvd.DistributedOptimizer(
            torch.optim.SparseAdam(list(emb.parameters()), lr=0.1), sparse_as_dense=True
        )
        for _ in range(2):
            opt.zero_grad()
            emb(torch.tensor([[1, 2, 4], [4, 3 + WORLD.rank, 9]])).sum().backward()
            expected = WORLD.allreduce(emb.weight.grad.to_dense().numpy()) / WORLD.size
            opt.synchronize()
            assert emb.weight.grad.layout == torch.sparse_coo
            np.testing.assert_allclose(emb.weight.grad.to_dense().numpy(), expected, rtol=1e-6)
            with opt.skip_synchronize():
                opt.step()
            assert_same_on_all_ranks(emb.weight.detach().numpy())

    on_all_ranks(check)


@pytest.mark.parallel([2, 3])
def test_gradient_as_bucket_view_takes_a_checkpoint_of_another_parameter_set_loaded_on_rank_0_only():
    """Horovod's resume recipe (load on rank 0, broadcast_optimizer_state) with a checkpoint saved while a
    layer was frozen: rank 0 rebuilds its pool alone (in private memory), where it used to make the
    pool's collective alone and fail every rank."""
    rng = np.random.default_rng([46, WORLD.rank])

    def run(model, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            x = torch.from_numpy(rng.standard_normal((4, 5)))
            model(x).pow(2).mean().backward()
            opt.step()

    def check():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 2)).double()

        def wrap(m):
            sgd = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
            return hvd.DistributedOptimizer(sgd, m.named_parameters(), gradient_as_bucket_view=True)

        opt = wrap(model)
        model[0].requires_grad_(False)
        run(model, opt, 2)
        saved = opt.state_dict()
        resumed = copy.deepcopy(model)
        resumed[0].requires_grad_(True)
        opt2 = wrap(resumed)
        if WORLD.rank == 0:
            opt2.load_state_dict(saved)
        hvd.broadcast_optimizer_state(opt2, root_rank=0)
        resumed[0].requires_grad_(False)
        run(resumed, opt2, 2)
        assert_same_on_all_ranks(np.concatenate([p.detach().numpy().ravel() for p in resumed.parameters()]))

    on_all_ranks(check)


@pytest.mark.parallel(SIZES)
def test_the_steps_agreement_rides_in_the_fused_steps_final_exchange(monkeypatch):
    """DDP carries its used-parameter mask in the step's last exchange; the optimizer carries its whole
    agreement (the mask, gradients changed after backward, the loss scale, layouts) in the fused
    step's final exchange, with no collective of its own. Where that exchange does not carry it (a
    vector over AGREE_IN_FINAL_BYTES: thousands of parameters) the agreement is a collective of its
    own, on every rank alike (here with that bound lowered); both give the reference's parameters,
    bitwise alike on every rank."""
    from gflow.fusion import lazy
    from gflow.torch import _distributed

    r = WORLD.rank
    calls = []
    real = _distributed.allreduce_async_on  # (the optimizer's own collectives: _over_ranks)

    def counted(parent, x, op, **kwargs):
        calls.append(op)
        return real(parent, x, op, **kwargs)

    monkeypatch.setattr(_distributed, "allreduce_async_on", counted)
    data = batches(3)
    for case in ("in the final exchange", "on its own"):
        if case == "on its own":  # (the model's agreement is 3 x 4 + 8 int64 words)
            monkeypatch.setattr(lazy, "AGREE_IN_FINAL_BYTES", 64)

        def check(case=case):
            model, ref, opt, ref_opt = sgd_and_reference()
            for x, y in data:
                calls.clear()
                opt.zero_grad()
                rank_loss(model, x, y, r)
                opt.step()
                reference_step(ref, ref_opt, x, y)
                assert calls == ([] if case == "in the final exchange" else ["max"]), calls
                assert_identical(model)
                assert_close_to(model, ref, atol=1e-5)
                assert model.extra.grad is not None and model.unused.grad is None  # (the mask)

        on_all_ranks(check, case)


@pytest.mark.parallel([2, 3])
def test_a_scheduler_made_before_wrapping_and_a_closure_optimizer_stay_exact():
    """helper-50: an LR scheduler made before DistributedOptimizer patches the inner optimizer's step
    on the instance, and the wrapper's copy of that attribute ran the inner step, unreduced (replicas
    apart from the first step). And LBFGS decided from each rank's own closure loss how often to call
    the closure: the ranks' reductions paired with other iterations', replicas diverged, no error."""
    r = WORLD.rank
    data = batches(3)

    def scheduled():
        model = make_model()
        ref = copy.deepcopy(model).double()
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(base, 1, 0.5)
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
        # and one made on the wrapper too (helper-52: it warned that it stepped before the optimizer)
        keep = torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=0)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, 0.5)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for x, y in data:
                opt.zero_grad()
                rank_loss(model, x, y, r)
                opt.step()
                sched.step()
                keep.step()
                reference_step(ref, ref_opt, x, y)
                ref_sched.step()
                assert_identical(model)
                assert_close_to(model, ref, atol=1e-5)
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.1 / 8
        assert not [w for w in seen if "lr_scheduler" in str(w.message)], [str(w.message) for w in seen]

    def closure_optimizer():
        model = make_model(dtype=torch.float64)
        ref = copy.deepcopy(model)
        lbfgs = dict(lr=0.5, max_iter=20, tolerance_change=1e-3)
        opt = hvd.DistributedOptimizer(
            torch.optim.LBFGS(model.parameters(), **lbfgs), named_parameters=model.named_parameters()
        )
        ref_opt = torch.optim.LBFGS(ref.parameters(), **lbfgs)
        for x, y in data:
            xs, ys = x[r * PER_RANK : (r + 1) * PER_RANK].double(), y[r * PER_RANK : (r + 1) * PER_RANK]

            def closure(xs=xs, ys=ys):
                opt.zero_grad()
                loss = F.cross_entropy(model(xs, use_extra=r == 0), ys)
                loss.backward()
                return loss

            def ref_closure(x=x, y=y):
                ref_opt.zero_grad()
                losses = [
                    F.cross_entropy(ref(x[q * PER_RANK : (q + 1) * PER_RANK].double(), use_extra=q == 0),
                                    y[q * PER_RANK : (q + 1) * PER_RANK])
                    for q in range(WORLD.size)
                ]  # fmt: skip
                loss = sum(losses) / WORLD.size
                loss.backward()
                return loss

            opt.step(closure)
            ref_opt.step(ref_closure)
            assert_identical(model)
            assert_close_to(model, ref, atol=1e-6)

    on_all_ranks(scheduled, "scheduler made before wrapping")
    on_all_ranks(closure_optimizer, "LBFGS")


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("differs", ["op", "threshold_bytes"])
def test_a_rank_that_replaces_its_optimizer_after_a_failed_step_trains_on(differs):
    """helper-70: after a step that failed (one rank's optimizer built otherwise), that rank built a
    right one and dropped the old, which lived on: the engine thread held the failed job's error
    (its traceback, the step's frames, the optimizer) until its next job, and the rest was a
    reference cycle; the old one's hooks went on reducing, and the next steps failed on every rank."""
    r = WORLD.rank
    data = batches(4)
    model = make_model()
    wrong = {"op": hvd.Sum, "threshold_bytes": 64}[differs] if r == WORLD.size - 1 else None

    def build(setting):
        kw = {} if setting is None else {differs: setting}
        return hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), **kw
        )

    opt = build(wrong)
    opt.zero_grad()
    rank_loss(model, *data[0], r)
    with pytest.raises(gflow.MismatchError):
        opt.step()
    ref = copy.deepcopy(model).double()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    if wrong is not None:
        opt = build(None)  # (no gc.collect(): the program only drops its reference)
    for x, y in data[1:]:
        opt.zero_grad()
        rank_loss(model, x, y, r)
        opt.step()
        reference_step(ref, ref_opt, x, y)
        assert_identical(model)
    assert_close_to(model, ref, atol=1e-5)


def test_a_load_state_dict_set_on_the_inner_optimizer_is_kept_by_wrapping():
    """A library's own load_state_dict on the optimizer instance (set before wrapping) still runs when
    the inner optimizer loads after wrapping, and the wrapper then holds what it loaded (helper-96)."""
    model = make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    calls = []
    torch_load = base.load_state_dict

    def own(state_dict):
        calls.append(len(state_dict["param_groups"]))
        torch_load(state_dict)

    base.load_state_dict = own
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    saved = copy.deepcopy(base.state_dict())
    saved["param_groups"][0]["lr"] = 0.25
    base.load_state_dict(saved)
    assert calls == [1]
    assert opt.param_groups[0]["lr"] == base.param_groups[0]["lr"] == 0.25
    assert opt.param_groups is base.param_groups and opt.state is base.state


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("load", ["broadcast_optimizer_state", "checkpoint", "checkpoint into the inner"])
def test_a_scheduler_made_before_wrapping_follows_a_loaded_state(load):
    """helper-70: torch's load_state_dict gives the wrapper new param groups, and a scheduler made on
    the inner optimizer before wrapping went on setting the old ones' rates: after Horovod's start-up
    (broadcast_optimizer_state loads on the ranks but the root) the ranks stepped at different rates,
    replicas apart, no error; after a checkpoint's load the rate stayed where it was saved. Loaded into
    the inner optimizer after wrapping (the program holds it too), the wrapper kept its empty state and
    the rate of before (helper-94)."""
    r = WORLD.rank
    data = batches(4)

    def build():
        model = make_model()
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(base, 1, 0.5)
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
        opt.inner = base  # (the test's own handle on it)
        return model, opt, sched

    def train(model, opt, sched, steps):
        for x, y in steps:
            opt.zero_grad()
            rank_loss(model, x, y, r)
            opt.step()
            sched.step()
            assert_identical(model)

    def check():
        model, opt, sched = build()
        ref = copy.deepcopy(model).double()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, 0.5)
        for x, y in data:
            reference_step(ref, ref_opt, x, y)
            ref_sched.step()
        if load == "broadcast_optimizer_state":
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            train(model, opt, sched, data)
        else:
            train(model, opt, sched, data[:2])
            saved = io.BytesIO()
            torch.save(
                {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, saved
            )
            saved.seek(0)
            state = torch.load(saved, weights_only=False)
            model, opt, sched = build()
            model.load_state_dict(state["model"])
            (opt.inner if load.endswith("inner") else opt).load_state_dict(
                {k: v for k, v in state["opt"].items() if k != "gflow"}
            )
            sched.load_state_dict(state["sched"])
            assert opt.state_dict()["state"], "the wrapper's state is the loaded one"
            train(model, opt, sched, data[2:])
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.1 / 16
        assert sched.optimizer.param_groups is opt.param_groups
        assert_close_to(model, ref, atol=1e-5)

    on_all_ranks(check, load)


@pytest.mark.parallel([2, 3])
def test_synchronize_twice_a_checkpoint_at_another_world_size_and_a_dtype_changed_after_wrapping():
    """helper-50: a second synchronize() before step() (a framework's hook and the user's code both)
    reduced the reduced gradients again: with op=Sum, the number of ranks times the gradient. A
    dense optimizer's checkpoint was refused at another world size, where Horovod's resumes. And a
    parameter whose dtype changed after wrapping (model.double()) failed every later step."""
    r = WORLD.rank
    data = batches(2)

    def twice():
        model, ref, opt, ref_opt = sgd_and_reference(op=hvd.Sum)
        for x, y in data:
            opt.zero_grad()
            rank_loss(model, x, y, r)
            opt.synchronize()
            opt.synchronize()
            with opt.skip_synchronize():
                opt.step()
            reference_step(ref, ref_opt, x, y, op="sum")
            assert_close_to(model, ref, atol=1e-5)
        assert_identical(model)

    def resized(sparse):
        model = make_model()
        kw = dict(sparse={"density": 0.5}) if sparse else {}
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            named_parameters=model.named_parameters(),
            **kw,
        )
        x, y = data[0]
        opt.zero_grad()
        rank_loss(model, x, y, r)
        opt.step()
        state = opt.state_dict()
        state["gflow"]["world_size"] = torch.tensor(WORLD.size + 1)  # (as saved by a larger job)
        fresh = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            named_parameters=model.named_parameters(),
            **kw,
        )
        if sparse:  # (CSC's residuals are per rank)
            with pytest.raises(ValueError, match="world size differs"):
                fresh.load_state_dict(state)
            return
        with warnings.catch_warnings():  # (a fixed threshold: gflow's state holds nothing per rank)
            warnings.simplefilter("error")
            fresh.load_state_dict(state)
        assert fresh._dp.step_count == opt._dp.step_count
        assert len(opt.state) >= 3
        for p, saved in opt.state.items():
            assert torch.equal(fresh.state[p]["momentum_buffer"], saved["momentum_buffer"])

    def retyped():  # (model.double() after wrapping: the same Parameter objects, another dtype)
        model, ref, opt, ref_opt = sgd_and_reference()
        for step, (x, y) in enumerate(batches(3)):
            if step == 1:
                model.double()
            opt.zero_grad()
            rank_loss(model, x, y, r)
            opt.step()
            reference_step(ref, ref_opt, x, y)
            assert_close_to(model, ref, atol=1e-5)
        assert_identical(model)

    on_all_ranks(twice, "synchronize twice, op=Sum")
    on_all_ranks(retyped, "a dtype changed after wrapping")
    on_all_ranks(lambda: resized(False), "dense at another world size")
    on_all_ranks(lambda: resized(True), "sparse at another world size")


class ChannelsLast(torch.nn.Module):
    """A conv net in channels_last (its weights' gradients are not contiguous) with a transposed
    parameter (a non-contiguous view)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.fc = torch.nn.Linear(4 * 4 * 4, 4)
        self.mix = torch.nn.Parameter(torch.randn(4, 4).t())

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1)) @ self.mix


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"gradient_predivide_factor": 2.0},
        {"backward_passes_per_step": 2, "gradient_predivide_factor": 2.0},
        {"gradient_as_bucket_view": True},
    ],
    ids=["plain", "predivide", "bpps2-predivide", "views"],
)
def test_a_channels_last_model_trains_as_one_process(kw):
    """broadcast_parameters into a channels_last model (through a contiguous copy: Horovod's raises),
    then steps on its non-contiguous gradients: equal to the float64 one-process reference, identical
    on every rank (with gradient_predivide_factor every step raised "grad must be C-contiguous")."""
    r, p = WORLD.rank, WORLD.size
    parts = kw.get("backward_passes_per_step", 1)

    def check():
        torch.manual_seed(r)  # every rank different: broadcast_parameters must fix it
        model = ChannelsLast().to(memory_format=torch.channels_last)
        assert not model.conv.weight.is_contiguous() and not model.mix.is_contiguous()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        assert not model.conv.weight.is_contiguous()  # (the layout kept)
        ref = copy.deepcopy(model).double()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            named_parameters=model.named_parameters(),
            **kw,
        )
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(5)
        for _ in range(3):
            x = torch.randn(p * PER_RANK, 3, 6, 6, generator=g).to(memory_format=torch.channels_last)
            y = torch.randint(0, 4, (p * PER_RANK,), generator=g)
            opt.zero_grad()
            mine = slice(r * PER_RANK, (r + 1) * PER_RANK)
            for xm, ym in zip(x[mine].chunk(parts), y[mine].chunk(parts), strict=True):
                (F.cross_entropy(model(xm), ym) / parts).backward()
            opt.step()
            ref_opt.zero_grad()
            (F.cross_entropy(ref(x.double()), y)).backward()
            ref_opt.step()
            assert_identical(model)
            assert_close_to(model, ref, atol=1e-5)

    on_all_ranks(check)


@pytest.mark.parallel([2, 3])
def test_broadcast_parameters_refuses_an_expanded_tensor_before_anything_moves():
    """Only layouts whose memory holds each element once (channels_last, a transpose) go through a
    contiguous copy; an expanded tensor on one rank is refused there, the others raise MismatchError,
    nothing moved (helper-64: it was broadcast, then the copy back failed on that rank alone), and the
    next broadcast works."""
    r = WORLD.rank

    def check():
        shared = torch.full((1,), float(r)).expand(4) if r == 1 else torch.full((4,), float(r))
        params = {"a": torch.full((3,), float(r)), "b": shared}
        with pytest.raises((ValueError, gflow.MismatchError)) as caught:
            hvd.broadcast_parameters(params, root_rank=0)
        assert isinstance(caught.value, ValueError if r == 1 else gflow.MismatchError), caught.value
        after = {"a": torch.full((3,), float(r))}
        hvd.broadcast_parameters(after, root_rank=0)
        assert after["a"].tolist() == [0.0] * 3

    on_all_ranks(check)


@pytest.mark.parallel([1, 2])
def test_a_layer_in_two_reentrant_checkpoints_is_named_as_the_cause():
    """A layer used in two segments of reentrant checkpointing has its gradient computed twice per
    backward: the error says so and what to use instead (it advised only a larger
    backward_passes_per_step, which works at exactly twice the passes); use_reentrant=False trains."""
    from torch.utils.checkpoint import checkpoint

    class Twice(torch.nn.Module):
        def __init__(self, reentrant):
            super().__init__()
            self.a, self.b, self.reentrant = torch.nn.Linear(6, 6), torch.nn.Linear(6, 1), reentrant

        def forward(self, x):
            h = checkpoint(lambda h: torch.tanh(self.a(h)), x, use_reentrant=self.reentrant)
            return checkpoint(lambda h: self.b(self.a(h)), h, use_reentrant=self.reentrant)

    def check():
        for reentrant in (True, False):
            model = Twice(reentrant)
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters()
            )
            x = torch.randn(4, 6, requires_grad=True)
            if reentrant:
                with pytest.raises(AssertionError, match="use_reentrant=False"):
                    model(x).sum().backward()
            else:
                model(x).sum().backward()
                opt.step()
            del opt
            gc.collect()

    on_all_ranks(check)


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("how", ["step", "model.zero_grad", "synchronize"])
def test_a_step_interrupted_while_it_waits_is_finished_by_the_next_step(how):
    """Ctrl-C on rank 0 in step() (or, Horovod's clipping recipe, in synchronize()) while the last rank
    is late: the reduction goes on in the background and the others apply the step, so on rank 0
    zero_grad() and a backward refuse (RuntimeError, sending nothing), as does step() inside
    skip_synchronize(); the same call again finishes the step, also after model.zero_grad() set the
    gradients to None (the pushed ones are put back). The replicas stay identical, at the float64
    reference of every step (a step pushed again met the others' next step: helper-88, helper-89)."""
    r, last = WORLD.rank, WORLD.size - 1
    data = batches(3)
    hvd.init(comm=WORLD.Dup())

    def expect_refused(call, label):
        try:
            call()
        except RuntimeError as error:
            assert "interrupted" in str(error) and "again" in str(error), error
        else:
            raise AssertionError(f"{label} was taken after the interrupted step")

    def check():
        model, ref, opt, ref_opt = sgd_and_reference()

        def step():
            if how == "synchronize":
                opt.synchronize()
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()

        for n, (x, y) in enumerate(data):
            opt.zero_grad()
            rank_loss(model, x, y, r)
            if n == 1 and r == last:
                time.sleep(1.5)  # rank 0's step waits for this rank's gradients
            if n == 1 and r == 0:
                try:
                    with interrupted_after(0.3):
                        opt.synchronize() if how == "synchronize" else opt.step()
                except Interrupt:
                    pass
                else:
                    raise AssertionError("step() finished before the interrupt: the last rank was not late")
                expect_refused(opt.zero_grad, "optimizer.zero_grad()")
                expect_refused(lambda x=x, y=y: rank_loss(model, x, y, r), "a backward")
                if how == "synchronize":
                    with opt.skip_synchronize():
                        expect_refused(opt.step, "step() inside skip_synchronize()")
                if how == "model.zero_grad":
                    model.zero_grad()  # (the gradients become None: the pushed ones are put back)
            step()
            reference_step(ref, ref_opt, x, y)
        assert_identical(model)
        assert_close_to(model, ref, atol=1e-5)

    try:
        on_all_ranks(check)
    finally:
        hvd.init()
