"""Trainers' paths through gflow.torch that once went silently wrong or hung (issue 24): in-place
collectives and autograd, async calls matched by name, the float16 mean, torch AMP's GradScaler
without synchronize(), parameters unfrozen or added after wrapping, momentum schedules with CSC,
blocking collectives on some ranks only, and the errors that name their cause. Each at 2-3 ranks,
against a float64 reference or MPI's own collectives."""

import numpy as np
import pytest
import torch
from helpers import WORLD, on_all_ranks

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
