"""Trainers' paths through gflow.torch that once went silently wrong or hung (issue 24): in-place
collectives and autograd, async calls matched by name, the float16 mean, torch AMP's GradScaler
without synchronize(), parameters unfrozen or added after wrapping, momentum schedules with CSC,
blocking collectives on some ranks only, and the errors that name their cause. Each at 2-3 ranks,
against a float64 reference or MPI's own collectives."""

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
