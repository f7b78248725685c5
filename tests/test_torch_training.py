"""Trainers' paths through gflow.torch that once went silently wrong or hung (issue 24): in-place
collectives and autograd, async calls matched by name, the float16 mean, torch AMP's GradScaler
without synchronize(), parameters unfrozen or added after wrapping, momentum schedules with CSC,
blocking collectives on some ranks only, and the errors that name their cause. Each at 2-3 ranks,
against a float64 reference or MPI's own collectives."""

import numpy as np
import pytest
import torch
from helpers import WORLD, assert_same_on_all_ranks, on_all_ranks

import gflow
import gflow.torch as hvd

torch.set_num_threads(1)
SIZES = [2, 3]


@pytest.fixture(autouse=True)
def _init():
    hvd.init()


# --- item 8: in-place collectives bump the version counter ------------------------------------------


def _in_place_ops():
    """Every way gflow writes into a tensor in place: name -> op(w)."""
    return {
        "hvd.allreduce_": lambda w: hvd.allreduce_(w),
        "hvd.allreduce_async_": lambda w: hvd.synchronize(hvd.allreduce_async_(w)),
        "hvd.grouped_allreduce_": lambda w: hvd.grouped_allreduce_([w]),
        "hvd.broadcast_": lambda w: hvd.broadcast_(w, 0),
        "hvd.broadcast_async_": lambda w: hvd.synchronize(hvd.broadcast_async_(w, 0)),
        "gflow.allreduce(out=w)": lambda w: gflow.allreduce(w, "mean", out=w),
        "gflow.allreduce(out=w, fp16)": lambda w: gflow.allreduce(w, "mean", out=w, compression="fp16"),
        "gflow.allreduce_async(out=w)": lambda w: gflow.allreduce_async(w, out=w).wait(),
        "gflow.broadcast(out=w)": lambda w: gflow.broadcast(w, 1, out=w),
        "LossScaler.unscale": lambda w: gflow.LossScaler(init_scale=4.0).unscale(w),
    }


@pytest.mark.parallel(SIZES)
def test_in_place_collectives_bump_the_version_counter():
    """A backward that saved a tensor which a collective then overwrote raises, as after any torch
    in-place op (it used the new values silently: x.grad 2.5 or 3.0 where the forward used 2.0)."""
    for name, op in _in_place_ops().items():

        def check(op=op):
            x = torch.ones(3, requires_grad=True)
            w = torch.full((3,), 2.0 + WORLD.rank)  # differs per rank: every op changes it somewhere
            loss = (x * w).sum()  # saves w for x's gradient
            before = w._version
            op(w)
            assert w._version > before
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss.backward()

        on_all_ranks(check, name)


@pytest.mark.parallel(SIZES)
def test_the_optimizers_reduced_gradients_bump_the_version_counter():
    """DistributedOptimizer writes the reduced gradients into p.grad through a NumPy view: a graph
    that saved p.grad (a gradient penalty built before step) must not silently see the new values."""
    model = torch.nn.Linear(4, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), threshold_bytes=1)
    torch.manual_seed(WORLD.rank)
    model(torch.randn(3, 4)).sum().backward()

    def check():
        versions = [p.grad._version for p in model.parameters()]
        opt.synchronize()
        assert all(p.grad._version > v for p, v in zip(model.parameters(), versions, strict=True))

    on_all_ranks(check)
    with opt.skip_synchronize():
        opt.step()


# --- item 3: names are agreed on -------------------------------------------------------------------


@pytest.mark.parallel(SIZES)
def test_async_calls_under_names_in_another_order_fail_on_every_rank():
    """Two same-shape tensors started in the other order on the last rank, under their names: they
    came back mixed (a = 55.5 and b = 55.5 where 6 and 105 were right); now MismatchError on every
    rank. In the same order they reduce right, and unnamed calls still match by order."""
    a = torch.full((4,), 1.0 + WORLD.rank)
    b = torch.full((4,), 100.0 + WORLD.rank)
    p = WORLD.size
    want_a, want_b = sum(1.0 + r for r in range(p)), sum(100.0 + r for r in range(p))

    def same_order():
        ha = hvd.allreduce_async(a, name="a", op=hvd.Sum)
        hb = hvd.allreduce_async(b, name="b", op=hvd.Sum)
        assert torch.equal(hvd.synchronize(ha), torch.full((4,), want_a))
        assert torch.equal(hvd.synchronize(hb), torch.full((4,), want_b))

    on_all_ranks(same_order)
    swapped = WORLD.rank == p - 1

    def other_order():
        order = [("b", b), ("a", a)] if swapped else [("a", a), ("b", b)]
        handles = [hvd.allreduce_async(t, name=n, op=hvd.Sum) for n, t in order]
        errors = []
        for h in handles:
            try:
                hvd.synchronize(h)
            except hvd.HorovodInternalError as exc:
                errors.append(exc)
        assert errors and isinstance(errors[0], gflow.MismatchError), errors
        assert "name='a'" in str(errors[0]) or "name='b'" in str(errors[0]), str(errors[0])

    on_all_ranks(other_order)
    on_all_ranks(same_order)  # the channel recovered

    def blocking_and_broadcast_names():
        names = ("x", "y") if not swapped else ("y", "x")
        with pytest.raises(gflow.MismatchError):
            hvd.allreduce(a, name=names[0])
        with pytest.raises(gflow.MismatchError):
            hvd.broadcast(a, 0, name=names[1])
        with pytest.raises(gflow.MismatchError):
            hvd.allgather(a, name=names[0])
        assert torch.equal(hvd.allgather(a, name="z")[:4], torch.full((4,), 1.0))

    on_all_ranks(blocking_and_broadcast_names)


class TwoTwins(torch.nn.Module):
    """Two layers of the same shapes: only their names tell their gradients apart."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.second = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


@pytest.mark.parallel(SIZES)
def test_named_parameters_in_another_order_fail_on_every_rank():
    """named_parameters passed in another order on one rank: the push-order checksum covered shapes
    only, so first's gradient was averaged with second's; the names now join it."""
    torch.manual_seed(0)
    model = TwoTwins()
    named = list(model.named_parameters())
    if WORLD.rank == WORLD.size - 1:
        named = named[2:] + named[:2]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named)
    torch.manual_seed(WORLD.rank)

    def check():
        model(torch.randn(3, 4)).sum().backward()
        with pytest.raises(gflow.MismatchError):
            opt.step()

    on_all_ranks(check)


@pytest.mark.parallel(SIZES)
def test_data_parallel_parameters_in_another_order_fail_on_every_rank():
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(5).astype(np.float32) for k in ("a", "b", "c")}
    if WORLD.rank == WORLD.size - 1:
        params = {k: params[k] for k in ("b", "a", "c")}
    dp = gflow.DataParallel(params, threshold_bytes=8)

    def check():
        for key in reversed(list(params)):
            dp.push(key, np.full(5, float(WORLD.rank), np.float32))
        with pytest.raises(gflow.MismatchError):
            dp.synchronize()

    on_all_ranks(check)


# --- items 1, 2, 13: AMP, gradients changed between backward and step, clear errors ----------------


PER_RANK = 4


class Net(torch.nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.body = torch.nn.Linear(6, width)
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def data(steps, features=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    n = WORLD.size * PER_RANK
    return [
        (torch.randn(n, features, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(steps)
    ]


def local_loss(model, x, y, factor=1.0):
    r = WORLD.rank
    xs, ys = x[r * PER_RANK : (r + 1) * PER_RANK], y[r * PER_RANK : (r + 1) * PER_RANK]
    return torch.nn.functional.cross_entropy(model(xs), ys) * factor


def reference_step(ref, ref_opt, x, y, clip=None):
    """The same step in one process, float64, on every rank's samples (the ranks' losses averaged)."""
    ref_opt.zero_grad()
    torch.nn.functional.cross_entropy(ref(x.double()), y).backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    ref_opt.step()


def assert_identical(model):
    for name, p in model.named_parameters():
        try:
            assert_same_on_all_ranks(p.detach().numpy())
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None


def assert_close(model, ref, atol=1e-5):
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach().double(), q.detach(), atol=atol, rtol=1e-4, msg=name)


def amp_step(opt, scaler, loss, pattern, model, clip=None):
    """One step of torch AMP in one of the patterns trainers write."""
    scaler.scale(loss).backward()
    if pattern == "horovod":  # Horovod's documented recipe
        opt.synchronize()
        scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        with opt.skip_synchronize():
            scaler.step(opt)
    else:  # PyTorch's own lines, no synchronize(): "plain", or with unscale_ and clipping
        if pattern == "unscale":
            scaler.unscale_(opt)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
    scaler.update()


@pytest.mark.parallel(SIZES)
def test_torch_amp_without_synchronize_applies_the_unscaled_average():
    """scaler.scale(loss).backward(); scaler.step(opt); scaler.update() with no synchronize():
    the segments sent during backward reached step() still scaled (460.8 where 0.45 was right, or
    65,536x too far). GradScaler now unscales the reduced gradients: every pattern equals the float64
    reference, bitwise alike on every rank, with a 1-byte threshold (every gradient sent during
    backward), the default one, and a model over the default 25 MiB."""
    cases = [
        ("plain", 1, 8),
        ("unscale", 1, 8),
        ("horovod", 1, 8),
        ("plain", None, 8),
        ("unscale", None, 2600),
    ]
    for pattern, threshold, width in cases:

        def check(pattern=pattern, threshold=threshold, width=width):
            torch.manual_seed(0)
            model = Net(width)
            ref = Net(width).double()
            ref.load_state_dict(model.state_dict())
            kw = {} if threshold is None else {"threshold_bytes": threshold}
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                named_parameters=model.named_parameters(), **kw,
            )  # fmt: skip
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1)
            clip = 0.05 if pattern != "plain" else None
            for x, y in data(3, seed=width):
                opt.zero_grad()
                amp_step(opt, scaler, local_loss(model, x, y), pattern, model, clip)
                reference_step(ref, ref_opt, x, y, clip)
                assert_identical(model)
                assert_close(model, ref)
            assert scaler.get_scale() == 2.0**19  # three good steps, growing each

        on_all_ranks(check, f"{pattern} threshold={threshold} width={width}")


@pytest.mark.parallel(SIZES)
def test_one_ranks_local_overflow_skips_the_step_on_every_rank():
    """One rank's local gradient holds inf: its GradScaler skipped step() alone, so it never
    synchronized (a misleading zero_grad AssertionError, or a hang). The overflow is now found in the
    reduced gradient: every rank skips that step, every rank's scale backs off alike, and training
    goes on equal to the reference that skipped it too."""
    bad_rank = WORLD.size - 1
    for pattern in ("plain", "unscale", "horovod"):

        def check(pattern=pattern):
            torch.manual_seed(0)
            model = Net()
            ref = Net().double()
            ref.load_state_dict(model.state_dict())
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                threshold_bytes=1,
            )  # fmt: skip
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=100)
            for step, (x, y) in enumerate(data(4)):
                before = [p.detach().clone() for p in model.parameters()]
                opt.zero_grad()
                overflow = step == 1
                factor = 1e38 if overflow and WORLD.rank == bad_rank else 1.0
                amp_step(opt, scaler, local_loss(model, x, y, factor), pattern, model)
                if overflow:
                    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
                else:
                    reference_step(ref, ref_opt, x, y)
                assert WORLD.allgather(scaler.get_scale()) == [scaler.get_scale()] * WORLD.size
                assert scaler.get_scale() == (2.0**9 if step >= 1 else 2.0**10)
                assert_identical(model)
                assert_close(model, ref)

        on_all_ranks(check, pattern)


@pytest.mark.parallel(SIZES)
def test_a_gradient_changed_between_backward_and_step_fails_on_every_rank():
    """A change to p.grad after backward sent it and before step() was kept or dropped by timing
    (clip_grad_norm_ without synchronize(), model.zero_grad(), p.grad = ...). Defined now: the step
    fails on every rank with a RuntimeError that names the parameter and the cause, nothing is
    applied, and the next step is right."""
    changes = {
        "clip_grad_norm_ on every rank": (
            None,
            lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3),
        ),
        "model.zero_grad() on rank 0": (0, lambda m: m.zero_grad()),
        "p.grad replaced on the last rank": (
            -1,
            lambda m: setattr(m.head.bias, "grad", m.head.bias.grad * 2),
        ),
        "in place on the last rank": (-1, lambda m: m.body.weight.grad.mul_(3)),
        # (no version bump: the reduction went into the old memory, p.grad kept this rank's own)
        "p.grad.data replaced on the last rank": (
            -1,
            lambda m: setattr(m.body.weight.grad, "data", m.body.weight.grad.data.clamp(-1e-3, 1e-3)),
        ),
    }
    for label, (who, change) in changes.items():

        def check(who=who, change=change):
            torch.manual_seed(0)
            model = Net()
            ref = Net().double()
            ref.load_state_dict(model.state_dict())
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                threshold_bytes=1,
            )  # fmt: skip
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
            (x, y), (x2, y2) = data(2)
            local_loss(model, x, y).backward()
            if who is None or WORLD.rank == who % WORLD.size:
                change(model)
            before = [p.detach().clone() for p in model.parameters()]
            with pytest.raises(RuntimeError, match="changed after backward sent it") as info:
                opt.step()
            if who is not None and WORLD.rank == who % WORLD.size:
                assert "here," in str(info.value)
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
            opt.zero_grad()
            local_loss(model, x2, y2).backward()
            opt.step()
            reference_step(ref, ref_opt, x2, y2)
            assert_identical(model)
            assert_close(model, ref)

        on_all_ranks(check, label)


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("op", ["Average", "Sum"])
def test_a_retry_on_gradients_a_refused_step_reduced_fails_on_every_rank(op):
    """A step refused after its gradients were reduced where they are leaves them holding the ranks'
    sum: step() again without a new backward would reduce them twice (silently, with op=Sum). It
    fails on every rank, nothing is applied, and zero_grad() with a new backward is right."""

    def check():
        torch.manual_seed(0)
        model = Net()
        ref = Net().double()
        ref.load_state_dict(model.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=getattr(hvd, op))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1 * (WORLD.size if op == "Sum" else 1))
        (x, y), (x2, y2) = data(2)
        local_loss(model, x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # after backward sent them: refused
        with pytest.raises(RuntimeError, match="changed after backward sent it"):
            opt.step()
        before = [p.detach().clone() for p in model.parameters()]
        for _ in range(2):  # the retry as it is, twice
            with pytest.raises(RuntimeError, match="still those of a step that was not applied"):
                opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        opt.zero_grad(set_to_none=False)  # (in place: the same tensors, zeroed)
        local_loss(model, x2, y2).backward()
        opt.step()
        reference_step(ref, ref_opt, x2, y2)
        assert_identical(model)
        assert_close(model, ref)

    on_all_ranks(check)


@pytest.mark.parallel(SIZES)
def test_errors_name_their_cause():
    """model.zero_grad() between backward and step names the cause (it was an AttributeError about
    NoneType.copy_); load_state_dict and state_dict mid-step name the method called (it said
    'DataParallel.state_dict')."""
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), threshold_bytes=1)
    state = opt.state_dict()
    ((x, y),) = data(1)

    def check():
        local_loss(model, x, y).backward()
        with pytest.raises(RuntimeError, match=r"DistributedOptimizer.load_state_dict: a step is in flight"):
            opt.load_state_dict(state)
        with pytest.raises(RuntimeError, match=r"DistributedOptimizer.state_dict: a step is in flight"):
            opt.state_dict()
        model.zero_grad()
        with pytest.raises(RuntimeError, match=r"was cleared \(p.grad is None: model.zero_grad\(\)\?\)"):
            opt.step()
        opt.load_state_dict(state)  # between steps again

    on_all_ranks(check)


# --- item 5: parameters unfrozen or added after wrapping --------------------------------------------


@pytest.mark.parallel(SIZES)
def test_parameters_unfrozen_or_added_after_wrapping_are_reduced():
    """A parameter frozen when the optimizer was wrapped and unfrozen later (requires_grad_(True)),
    or appended to a param group, got no hook: each rank applied its own gradient and the replicas
    drifted apart. The parameters to reduce are now taken at each step's start."""
    for how in ("unfreeze", "append", "add_param_group", "freeze again"):

        def check(how=how):
            torch.manual_seed(0)
            model = Net()
            extra = torch.nn.Parameter(torch.randn(3))  # a bias added to the output from step 2 on
            ref = Net().double()
            ref.load_state_dict(model.state_dict())
            ref_extra = torch.nn.Parameter(extra.detach().double().clone())
            frozen = how in ("unfreeze", "freeze again")
            if frozen:
                model.body.weight.requires_grad_(False)
            ref.body.weight.requires_grad_(not frozen)
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                named_parameters=model.named_parameters(), threshold_bytes=64,
            )  # fmt: skip
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
            use_extra = False
            for step, (x, y) in enumerate(data(5)):
                if step == 2:
                    if how == "unfreeze" or how == "freeze again":
                        model.body.weight.requires_grad_(True)
                        ref.body.weight.requires_grad_(True)
                    elif how == "append":
                        opt.param_groups[0]["params"].append(extra)
                        ref_opt.param_groups[0]["params"].append(ref_extra)
                        use_extra = True
                    else:
                        opt.add_param_group({"params": [extra]})
                        ref_opt.add_param_group({"params": [ref_extra]})
                        use_extra = True
                if step == 4 and how == "freeze again":
                    model.body.weight.requires_grad_(False)
                    ref.body.weight.requires_grad_(False)
                opt.zero_grad()
                r = WORLD.rank
                xs, ys = x[r * PER_RANK : (r + 1) * PER_RANK], y[r * PER_RANK : (r + 1) * PER_RANK]
                out = model(xs) + (extra if use_extra else 0)
                torch.nn.functional.cross_entropy(out, ys).backward()
                opt.step()
                ref_opt.zero_grad()
                ref_out = ref(x.double()) + (ref_extra if use_extra else 0)
                torch.nn.functional.cross_entropy(ref_out, y).backward()
                ref_opt.step()
                assert_identical(model)
                assert_same_on_all_ranks(extra.detach().numpy())
                assert_close(model, ref)
                torch.testing.assert_close(extra.detach().double(), ref_extra.detach(), atol=1e-5, rtol=1e-4)
            if how in ("append", "add_param_group"):  # names by place for a parameter named nowhere
                assert any(k.startswith("param_groups.") for k in opt._gflow_keys)

        on_all_ranks(check, how)


# --- item 6: CSC's momentum and momentum schedules ----------------------------------------------------


@pytest.mark.parallel(SIZES)
def test_momentum_is_applied_once_whatever_the_schedule_or_state_dict():
    """CSC takes SGD's momentum over and sets the groups' to 0; OneCycleLR/CyclicLR (cycle_momentum)
    or a plain optimizer state dict put it back, and momentum was applied twice (3 steps of gradient 1
    moved 0.561 instead of 0.300). The groups' momentum now becomes CSC's at each step. At density 1
    CSC sends everything and masks the velocity it sent, so the update is plain SGD's: the reference
    is SGD without momentum, on the same learning-rate schedule."""
    schedules = {
        "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=10),
        "CyclicLR": lambda o: torch.optim.lr_scheduler.CyclicLR(o, 0.05, 0.2, step_size_up=2),
        "plain state dict": None,
    }
    for label, schedule in schedules.items():

        def check(label=label, schedule=schedule):
            torch.manual_seed(0)
            model = Net()
            ref = Net().double()
            ref.load_state_dict(model.state_dict())
            sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            plain_state = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).state_dict()
            opt = hvd.DistributedOptimizer(
                sgd, named_parameters=model.named_parameters(), sparse=dict(density=1.0, chunk_elems=4)
            )
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
            sched = ref_sched = None
            if schedule is not None:
                sched = schedule(opt)
                # the same learning rates without momentum (cycle_momentum needs a momentum to cycle)
                ref_sched = type(sched)(ref_opt, **_same_lr_schedule(label))
            seen = []
            for step, (x, y) in enumerate(data(5)):
                if label == "plain state dict" and step == 2:
                    opt.load_state_dict(plain_state)  # a state dict of the plain SGD: momentum 0.9
                    assert opt._dp._lazy.sparse["momentum"] == 0.9
                opt.zero_grad()
                local_loss(model, x, y).backward()
                opt.step()
                seen.append(opt._dp._lazy.sparse["momentum"])
                assert all(g["momentum"] == 0.0 for g in opt.param_groups) or sched is not None
                reference_step(ref, ref_opt, x, y)
                if sched is not None:
                    sched.step()
                    ref_sched.step()
                assert_identical(model)
                assert_close(model, ref)
            if sched is not None:  # CSC's momentum followed the schedule
                assert len(set(seen)) > 1, seen

        on_all_ranks(check, label)


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize(
    "how", ["scheduler state on rank 0 only", "ReduceLROnPlateau on each rank's metric", "NumPy rates"]
)
def test_ranks_stepping_at_different_learning_rates_fail_on_every_rank(how):
    """The usual resume with the scheduler's state loaded on rank 0 alone, or ReduceLROnPlateau fed
    each rank's own metric: the ranks stepped at different learning rates, and the replicas parted,
    silently (helper-94). The ranks compare their optimizer settings in each step's agreement:
    MismatchError on every rank, nothing applied; with the rates alike again, the steps go on."""
    torch.manual_seed(0)
    model = Net()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), named_parameters=model.named_parameters()
    )
    if how.startswith("scheduler"):
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch))
        if WORLD.rank == 0:
            sched.load_state_dict(dict(sched.state_dict(), last_epoch=3))
            sched.step()  # (as a resumed loop's first scheduler step would)
    elif how == "NumPy rates":  # (a schedule read out of a float32 array: helper-96)
        opt.param_groups[0]["lr"] = np.float32(0.1 if WORLD.rank == 0 else 0.2)
    else:
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
        for metric in (1.0, 2.0 + WORLD.rank):  # each rank's own validation loss: rank 0 alone improved
            sched.step(metric if WORLD.rank else 1.0 - metric)
    ((x, y),) = data(1)

    def check():
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        local_loss(model, x, y).backward()
        with pytest.raises(
            gflow.MismatchError, match=r"optimizer settings differ \(this rank's: group 0: lr="
        ):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        for group in opt.param_groups:
            group["lr"] = 0.05
        opt.zero_grad()
        local_loss(model, x, y).backward()
        opt.step()
        assert_identical(model)

    on_all_ranks(check, how)


def _same_lr_schedule(label: str) -> dict:
    if label == "OneCycleLR":
        return dict(max_lr=0.2, total_steps=10, cycle_momentum=False)
    return dict(base_lr=0.05, max_lr=0.2, step_size_up=2, cycle_momentum=False)


@pytest.mark.parallel(SIZES)
def test_grad_scalers_at_different_scales_fail_on_every_rank():
    """A GradScaler state restored on rank 0 only (item 7's case, with torch's own scaler): each rank
    scaled its loss by another factor, so the reduced gradient mixed units. The ranks agree on the
    scale when GradScaler reads the gradients (both patterns): MismatchError on every rank."""
    for pattern in ("plain", "horovod"):

        def check(pattern=pattern):
            torch.manual_seed(0)
            model = Net()
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
            )
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
            if WORLD.rank == 0:
                scaler.load_state_dict(dict(scaler.state_dict(), scale=2.0**14))
            ((x, y),) = data(1)
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            with pytest.raises(gflow.MismatchError, match="GradScaler scales differ"):
                amp_step(opt, scaler, local_loss(model, x, y), pattern, model)
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))

        on_all_ranks(check, pattern)


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("named", [True, False])
def test_a_checkpoint_taken_after_unfreezing_resumes_where_the_layer_is_frozen_at_start(named):
    """A restart builds the model as at the start (a layer frozen), wraps, loads a checkpoint taken
    after the layer was unfrozen: the kit took the saved parameters (it refused the load: the number
    of parameters differs; without named_parameters too, by Horovod's names "allreduce.noname.<i>"),
    and the run goes on equal to the run never stopped."""

    def wrap(model):
        names = {"named_parameters": model.named_parameters()} if named else {}
        return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), **names)

    def run(stop_at=None):
        torch.manual_seed(0)
        model = Net()
        model.body.weight.requires_grad_(False)
        opt = wrap(model)
        for step, (x, y) in enumerate(data(5)):
            if step == 1:
                model.body.weight.requires_grad_(True)
            if step == stop_at:
                saved = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict())
                torch.manual_seed(1)
                model = Net()
                model.body.weight.requires_grad_(False)  # as at the start
                opt = wrap(model)
                model.load_state_dict(saved[0])
                opt.load_state_dict(saved[1])
                model.body.weight.requires_grad_(True)  # as the schedule has it by now
            opt.zero_grad()
            local_loss(model, x, y).backward()
            opt.step()
        return model

    def check():
        whole, resumed = run(), run(stop_at=3)
        for (name, a), b in zip(whole.named_parameters(), resumed.parameters(), strict=True):
            assert torch.equal(a, b), name

    on_all_ranks(check)


# --- findings of the review of the fixes above -----------------------------------------------------


@pytest.mark.parallel(SIZES)
def test_gradients_set_by_hand_after_a_step_grad_scaler_skipped_are_reduced():
    """Gradients from torch.autograd.grad assigned to p.grad (no hook fires) with PyTorch's AMP lines:
    after a step GradScaler skipped, the next one was taken for reduced already, and each rank applied
    its own gradient. Every step is reduced now: the weights stay alike and equal the reference."""
    torch.manual_seed(0)
    model = Net()
    ref = Net().double()
    ref.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=100)

    def check():
        for step, (x, y) in enumerate(data(4)):
            overflow = step == 1
            factor = 1e38 if overflow and WORLD.rank == WORLD.size - 1 else 1.0
            loss = scaler.scale(local_loss(model, x, y, factor))
            for p, g in zip(
                model.parameters(), torch.autograd.grad(loss, list(model.parameters())), strict=True
            ):
                p.grad = g
            scaler.step(opt)
            scaler.update()
            if not overflow:
                reference_step(ref, ref_opt, x, y)
            assert_identical(model)
            assert_close(model, ref)

    on_all_ranks(check)


@pytest.mark.parallel(SIZES)
def test_parameters_that_join_during_a_step_fail_it_on_every_rank():
    """A layer unfrozen between the passes of backward_passes_per_step, or a parameter with a
    gradient added to the groups between backward and step, was applied with each rank's local
    gradient. Such a step now fails on every rank; the next step reduces the new parameter."""
    for how in ("between passes", "add_param_group"):

        def check(how=how):
            torch.manual_seed(0)
            model = Net()
            extra = torch.nn.Parameter(torch.randn(3))
            if how == "between passes":
                model.body.weight.requires_grad_(False)
            params = list(model.parameters())
            opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), backward_passes_per_step=2)
            (x, y), (x2, y2) = data(2)
            before = [p.detach().clone() for p in params]
            if how == "between passes":
                local_loss(model, x, y, 0.5).backward()
                model.body.weight.requires_grad_(True)
                local_loss(model, x2, y2, 0.5).backward()
            else:
                for _ in range(2):
                    (local_loss(model, x, y, 0.5) + (extra * WORLD.rank).sum()).backward()
                opt.add_param_group({"params": [extra]})
            with pytest.raises(RuntimeError, match="the parameters to reduce changed during a step"):
                opt.step()
            assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
            opt.zero_grad()
            extra.grad = None
            for _ in range(2):
                (local_loss(model, x, y, 0.5) + (extra * WORLD.rank).sum()).backward()
            opt.step()
            assert_identical(model)
            assert_same_on_all_ranks(extra.detach().numpy())

        on_all_ranks(check, how)


@pytest.mark.parallel(SIZES)
def test_a_refused_sparse_step_leaves_the_residuals_as_they_were():
    """The checks that refuse a step after the reduction (a gradient changed between backward and
    step, GradScalers at different scales; DataParallel's loss scales) ran after CSC had committed its
    new residuals, so a refused step still changed the next ones. Now they run before the commit: a run
    that failed a step and went on ends bitwise equal to one that never made it."""

    def run(fail_at, how):
        torch.manual_seed(0)
        model = Net()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
            sparse=dict(density=0.25, chunk_elems=8),
        )  # fmt: skip
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=100)
        for step, (x, y) in enumerate(data(4)):
            opt.zero_grad()
            if step == fail_at and how == "skip":
                continue
            if step == fail_at:
                if how == "scale" and WORLD.rank == 0:
                    scaler.update(2.0**9)
                scaler.scale(local_loss(model, x, y)).backward()
                if how == "changed" and WORLD.rank == 0:
                    model.head.weight.grad.mul_(2)
                with pytest.raises((RuntimeError, gflow.MismatchError)):
                    scaler.step(opt)
                if how == "scale":
                    scaler.update(2.0**8)  # (the step raised before GradScaler recorded an inf check)
                continue
            scaler.scale(local_loss(model, x, y)).backward()
            scaler.step(opt)
            scaler.update()
        return model

    for how in ("changed", "scale"):

        def check(how=how):
            failed, skipped = run(1, how), run(1, "skip")
            for (name, a), b in zip(failed.named_parameters(), skipped.parameters(), strict=True):
                assert torch.equal(a, b), name

        on_all_ranks(check, how)


@pytest.mark.parallel(SIZES)
def test_barrier_between_backward_and_step_with_other_parameters_used_works():
    """hvd.barrier() on every rank between backward and step, where rank 0 used a parameter the others
    did not: the barrier had moved onto the background channel behind the segments, which those ranks
    send at other times (MismatchError); it runs on the caller's channel again."""
    torch.manual_seed(0)
    model = Net()
    extra = torch.nn.Parameter(torch.randn(3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([*model.parameters(), extra], lr=0.1), threshold_bytes=1)

    def check():
        for x, y in data(3):
            opt.zero_grad()
            loss = local_loss(model, x, y) + (extra.sum() if WORLD.rank == 0 else 0)
            loss.backward()
            hvd.barrier()
            opt.step()
            assert_identical(model)
            assert_same_on_all_ranks(extra.detach().numpy())

    on_all_ranks(check)


@pytest.mark.parallel(SIZES)
def test_mixed_amp_recipes_and_predivide_factors_are_named():
    """Horovod's AMP recipe on one rank and PyTorch's lines on the others said the scales differ
    ("from -0 to 256"); a gradient_predivide_factor given on one rank only went unnoticed (each rank
    scaled by its own). Both are MismatchErrors on every rank that say what differs."""
    torch.manual_seed(0)
    model = Net()
    ((x, y),) = data(1)

    def mixed():
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        with pytest.raises(gflow.MismatchError, match="same AMP recipe"):
            amp_step(opt, scaler, local_loss(model, x, y), "horovod" if WORLD.rank == 0 else "plain", model)

    def predivide():
        factor = 2.0 if WORLD.rank == 0 else 1.0
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), gradient_predivide_factor=factor
        )
        opt.zero_grad()
        local_loss(model, x, y).backward()
        with pytest.raises(gflow.MismatchError, match="gradient_predivide_factor differ"):
            opt.step()

    on_all_ranks(mixed, "mixed recipes")
    on_all_ranks(predivide, "predivide")
