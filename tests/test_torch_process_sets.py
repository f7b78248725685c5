"""gflow.torch's process sets (Horovod's): every collective on a set against MPI's own over the same ranks,
root_rank in hvd.rank()'s numbering, DistributedOptimizer and SyncBatchNorm on a set, and the errors
(ranks outside a set, sets that differ between ranks, a set registered twice), at world sizes 1 to 4."""

import time

import numpy as np
import pytest
import torch
from helpers import WORLD, on_all_ranks, rank_rng

import gflow
import gflow.torch as hvd

torch.set_num_threads(1)
SIZES = [1, 2, 3, 4]


def init_afresh():
    """init() with no process set registered (init() again alone keeps them)."""
    hvd.shutdown()
    hvd.init()


@pytest.fixture(autouse=True)
def _init():
    init_afresh()  # (each test starts without any set)


def sets_by_parity():
    """Two registered sets (even ranks, odd ranks) and this rank's; on one rank, the global set (a set of
    rank 0 alone would duplicate it, which is refused)."""
    if WORLD.size == 1:
        return None, None, hvd.global_process_set
    even = hvd.add_process_set([r for r in range(WORLD.size) if r % 2 == 0])
    odd = hvd.add_process_set([r for r in range(WORLD.size) if r % 2 == 1]) if WORLD.size > 1 else None
    return even, odd, (even if WORLD.rank % 2 == 0 else odd)


def members_rows(x: torch.Tensor, ranks) -> np.ndarray:
    """Every rank's x in float64 (MPI's own allgather), the rows of `ranks` only."""
    everyone = np.stack(WORLD.allgather(x.detach().numpy().astype(np.float64)))
    return everyone[ranks]


@pytest.mark.parallel(SIZES)
def test_collectives_on_a_process_set_against_mpi_over_its_ranks():
    rng = rank_rng(5)
    x = torch.from_numpy(rng.standard_normal((4, 3)))
    xi = torch.from_numpy(rng.integers(-9, 9, (5,), dtype=np.int64)).to(torch.int16)

    def check():
        even, odd, mine = sets_by_parity()
        try:
            assert mine.included() and mine.size() == len(mine.ranks)
            assert mine.rank() == mine.ranks.index(WORLD.rank)
            assert hvd.global_process_set.size() == WORLD.size
            rows = members_rows(x, mine.ranks)
            np.testing.assert_allclose(hvd.allreduce(x, op=hvd.Sum, process_set=mine).numpy(), rows.sum(0))
            np.testing.assert_allclose(hvd.allreduce(x, process_set=mine).numpy(), rows.mean(0))
            got = hvd.synchronize(hvd.allreduce_async(x, op=hvd.Max, process_set=mine))
            np.testing.assert_array_equal(got.numpy(), rows.max(0))
            ints = members_rows(xi, mine.ranks).sum(0)
            np.testing.assert_array_equal(hvd.allreduce(xi, op=hvd.Sum, process_set=mine).numpy(), ints)
            grouped = hvd.grouped_allreduce([x, x[0]], op=hvd.Sum, process_set=mine)
            np.testing.assert_allclose(grouped[1].numpy(), rows.sum(0)[0])
            gathered = hvd.allgather(x, process_set=mine)
            np.testing.assert_array_equal(gathered.numpy(), rows.reshape(-1, 3))
            root = mine.ranks[-1]  # a rank of hvd.rank()'s numbering, as Horovod takes it
            np.testing.assert_array_equal(hvd.broadcast(x, root, process_set=mine).numpy(), rows[-1])
            y = x.clone()
            hvd.synchronize(hvd.broadcast_async_(y, root, process_set=mine))
            np.testing.assert_array_equal(y.numpy(), rows[-1])
            assert hvd.broadcast_object(("from", WORLD.rank), root, process_set=mine) == ("from", root)
            assert hvd.allgather_object(WORLD.rank, process_set=mine) == mine.ranks
            shards = hvd.reducescatter(x, op=hvd.Sum, process_set=mine)
            expected = np.array_split(rows.sum(0), len(mine.ranks))[mine.rank()]
            np.testing.assert_allclose(shards.numpy(), expected)
            got, received = hvd.alltoall(
                torch.arange(2.0 * len(mine.ranks)), [2] * len(mine.ranks), process_set=mine
            )
            assert received.tolist() == [2] * len(mine.ranks)
            hvd.barrier(process_set=mine)
            # the global set still works alongside
            total = hvd.allreduce(torch.ones(1), op=hvd.Sum)
            assert total.item() == WORLD.size
        finally:
            if odd is not None:
                assert hvd.remove_process_set(even) and hvd.remove_process_set(odd)
        assert not hvd.remove_process_set(hvd.global_process_set)
        if even is not None:
            assert not hvd.remove_process_set(even), "a set is removed once"
            assert even.process_set_id is None and even.size() is None

    on_all_ranks(check)


@pytest.mark.parallel([2, 3])
def test_a_rank_outside_a_set_gets_value_error_and_the_sets_ranks_go_on():
    def check():
        first = hvd.add_process_set([0])
        try:
            t = torch.full((3,), float(WORLD.rank + 1))
            if WORLD.rank == 0:
                assert torch.equal(hvd.allreduce(t, op=hvd.Sum, process_set=first), t)
            else:
                with pytest.raises(ValueError, match="not part of"):
                    hvd.allreduce(t, process_set=first)
                with pytest.raises(ValueError, match="not part of"):
                    hvd.synchronize(hvd.allgather_async(t, process_set=first))
                with pytest.raises(ValueError, match="not part of"):
                    first.rank()
            assert first.included() == (WORLD.rank == 0)
            assert hvd.allreduce(t, op=hvd.Sum).tolist() == [WORLD.size * (WORLD.size + 1) / 2] * 3
        finally:
            hvd.remove_process_set(first)

    on_all_ranks(check)


@pytest.mark.parallel([2, 3])
def test_sets_that_differ_between_ranks_fail_on_every_rank_and_duplicates_are_refused():
    def check():
        mine = [0] if WORLD.rank == 0 else [0, 1]
        with pytest.raises(ValueError, match="same list of ranks"):
            hvd.add_process_set(mine)
        with pytest.raises(ValueError, match="not a rank"):
            hvd.add_process_set([0, WORLD.size])
        with pytest.raises(ValueError, match=r"passed \[0, >= 2\*\*62\], and >= 2\*\*62 is not a rank"):
            hvd.add_process_set([0, 10**30])  # (past int64: the message says so, not a clamped number)
        with pytest.raises(ValueError, match="registered already"):
            hvd.add_process_set(list(range(WORLD.size)))  # the global set's ranks
        pair = hvd.add_process_set([1, 0]) if WORLD.size > 2 else None
        if pair is not None:
            assert pair.ranks == [0, 1]  # sorted, as Horovod's
            with pytest.raises(ValueError, match="registered already"):
                hvd.add_process_set([0, 1])
            if WORLD.rank in pair.ranks:  # (helper-71: it named "broadcast_", what it is made of)
                with pytest.raises(ValueError, match=r"^broadcast_object: root_rank 2 is not a rank of"):
                    hvd.broadcast_object("x", root_rank=2, process_set=pair)
            hvd.remove_process_set(pair)
            with pytest.raises(ValueError, match="not registered"):
                hvd.allreduce(torch.ones(1), process_set=pair)  # (every rank: removed everywhere)
            if WORLD.rank in pair.ranks:  # its ranks alone: they raise at once, as Horovod's (they
                # were rejected on the global set: helper-43)
                with pytest.raises(ValueError, match=r"not registered \(hvd.remove_process_set removed it\)"):
                    hvd.allreduce(torch.ones(1), process_set=pair)
            assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == WORLD.size
        with pytest.raises(ValueError, match="list of ranks"):
            hvd.ProcessSet("01")

    on_all_ranks(check)


@pytest.mark.parallel([3, 4])
def test_init_registers_process_sets_of_ranks_and_of_communicators():
    def check():
        first_two = hvd.ProcessSet([0, 1])
        split = WORLD.Split(color=WORLD.rank % 2, key=WORLD.rank)
        by_comm = hvd.ProcessSet(split)
        hvd.init(process_sets=[first_two, by_comm])
        try:
            assert by_comm.ranks == [r for r in range(WORLD.size) if r % 2 == WORLD.rank % 2]
            got = hvd.allreduce(torch.tensor([float(WORLD.rank)]), op=hvd.Sum, process_set=by_comm)
            assert got.item() == sum(by_comm.ranks)
            if WORLD.rank < 2:
                assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=first_two).item() == 2
        finally:
            init_afresh()  # (forgets the sets)
            split.Free()
        assert first_two.process_set_id is None

    on_all_ranks(check)


@pytest.mark.parallel([3, 4])
def test_sets_of_split_communicators_are_known_to_every_rank():
    """Horovod's split-communicator example: each rank passes the set of its own communicator; every
    rank then knows every set, with one id everywhere, so registering the same ranks again raises
    ValueError on every rank (helper-71: the ranks outside it waited in Comm.Create for ever)."""

    def check():
        split = WORLD.Split(color=WORLD.rank % 2, key=WORLD.rank)
        mine = hvd.ProcessSet(split)
        hvd.init(process_sets=[mine])
        try:
            evens = [r for r in range(WORLD.size) if r % 2 == 0]
            odds = [r for r in range(WORLD.size) if r % 2 == 1]
            assert mine.ranks == (evens if WORLD.rank % 2 == 0 else odds)
            assert mine.process_set_id == (1 if WORLD.rank % 2 == 0 else 2)  # (rank 0's set first)
            x = torch.from_numpy(rank_rng(3).standard_normal(5))
            got = hvd.allreduce(x, op=hvd.Sum, process_set=mine)
            np.testing.assert_allclose(got.numpy(), members_rows(x, mine.ranks).sum(0), rtol=1e-12)
            with pytest.raises(ValueError, match=r"registered already"):
                hvd.add_process_set(evens)
            with pytest.raises(ValueError, match=r"registered already"):
                hvd.add_process_set(odds)
            both = hvd.add_process_set([0, 1])  # (a new set still registers, with the next id)
            assert both.process_set_id == 3
            hvd.remove_process_set(both)
        finally:
            init_afresh()
            split.Free()

    on_all_ranks(check)


@pytest.mark.parallel([3, 4])
def test_sets_of_communicators_not_passed_by_every_member_fail_on_every_rank():
    def check():
        split = WORLD.Split(color=int(WORLD.rank in (0, WORLD.size - 1)), key=WORLD.rank)
        given = [hvd.ProcessSet(split)] if WORLD.rank != WORLD.size - 1 else []
        try:
            with pytest.raises(ValueError, match=r"passed by"):
                hvd.init(process_sets=given)
            hvd.allreduce(torch.ones(1))  # (every rank went on in step)
        finally:
            init_afresh()
            split.Free()

    on_all_ranks(check)


@pytest.mark.parallel([3, 4])
def test_init_again_keeps_the_sets_and_init_on_another_communicator_says_it_dropped_them():
    """A second init() (wrappers such as Lightning's make one) leaves registered sets usable, as in
    Horovod; one on another communicator drops them, and a call with one says so (helper-71: it said
    "removed", and DistributedOptimizer blamed hvd.remove_process_set)."""

    def check():
        first_two = hvd.add_process_set([0, 1])
        hvd.init()
        if WORLD.rank < 2:
            got = hvd.allreduce(torch.tensor([float(WORLD.rank + 1)]), op=hvd.Sum, process_set=first_two)
            assert got.item() == 3.0
        hvd.init(comm=list(range(WORLD.size)))  # (the same ranks, as a list)
        assert first_two.process_set_id is not None
        reversed_world = WORLD.Split(0, key=-WORLD.rank)  # (the same ranks, numbered otherwise)
        try:
            hvd.init(comm=reversed_world)
            assert first_two.process_set_id is None
            if WORLD.rank < 2:
                with pytest.raises(
                    ValueError, match=r"a later hvd.init\(\) on another communicator dropped it"
                ):
                    hvd.allreduce(torch.ones(1), process_set=first_two)
        finally:
            init_afresh()
            reversed_world.Free()

    on_all_ranks(check)


@pytest.mark.parallel([3, 4])
def test_distributed_optimizer_and_sync_batch_norm_on_a_process_set():
    """Each parity set trains its own replica: after steps, the set's ranks hold bitwise equal weights,
    equal to a float64 replay of SGD on the set's average gradient."""
    rng = rank_rng(9)
    inputs = torch.from_numpy(rng.standard_normal((6, 4)))
    targets = torch.from_numpy(rng.standard_normal((6, 1)))

    def check():
        even, odd, mine = sets_by_parity()
        try:
            torch.manual_seed(1)
            model = torch.nn.Linear(4, 1).double()
            start = [p.detach().clone() for p in model.parameters()]
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), process_set=mine
            )
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            loss.backward()
            opt.step()
            # float64 replay: the set's members' gradients, averaged
            replay = torch.nn.Linear(4, 1).double()
            with torch.no_grad():
                for p, s in zip(replay.parameters(), start, strict=True):
                    p.copy_(s)
            torch.nn.functional.mse_loss(replay(inputs), targets).backward()
            for p, q in zip(model.parameters(), replay.parameters(), strict=True):
                grads = members_rows(q.grad, mine.ranks)
                np.testing.assert_allclose(
                    p.detach().numpy(), q.detach().numpy() - 0.1 * grads.mean(0), rtol=1e-12
                )
                weights = members_rows(p, mine.ranks)
                assert (weights == weights[0]).all(), "replicas of a set differ"
            bn = hvd.SyncBatchNorm(4, process_set=mine).double()
            out = bn(inputs)
            stacked = torch.from_numpy(members_rows(inputs, mine.ranks).reshape(-1, 4))
            mean, var = stacked.mean(0), stacked.var(0, unbiased=False)
            np.testing.assert_allclose(
                out.detach().numpy(), ((inputs - mean) / torch.sqrt(var + bn.eps)).numpy(), atol=1e-10
            )
        finally:
            if odd is not None:
                hvd.remove_process_set(even)
                hvd.remove_process_set(odd)
        # Its set removed, the optimizer says so at the next backward (MPI's "Null communicator" was
        # all a rank read: helper-43)
        opt.zero_grad()
        with pytest.raises(ValueError, match="its process set was removed"):
            torch.nn.functional.mse_loss(model(inputs), targets).backward()

    on_all_ranks(check)


def test_process_set_queries_before_registration():
    ps = hvd.ProcessSet([2, 0])
    assert ps.ranks == [0, 2] and ps.process_set_id is None
    assert ps.size() is None and ps.rank() is None
    with pytest.raises(TypeError, match="ProcessSet"):
        hvd.allreduce(torch.ones(1), process_set="all")


@pytest.mark.parallel([3, 4])  # (at 2 ranks, [0, 1] is the global set)
def test_removing_a_set_waits_for_its_async_collective_and_numpy_ranks_are_ranks():
    """remove_process_set with an allreduce of the set still in flight (a peer late) waits for it, where
    freeing the set's communicator under it aborted MPICH; NumPy ints are ranks, in any order."""

    def check():
        pair = hvd.add_process_set(np.array([1, 0]) if WORLD.rank == 0 else [np.int64(0), 1])
        assert pair.ranks == [0, 1]
        if WORLD.rank < 2:
            hvd.allreduce(torch.ones(1), process_set=pair)  # (the set's context exists before)
            t = torch.full((1 << 20,), float(WORLD.rank + 1))
            if WORLD.rank == 1:
                time.sleep(0.3)
            handle = hvd.allreduce_async(t, op=hvd.Sum, process_set=pair)
        assert hvd.remove_process_set(pair)
        if WORLD.rank < 2:
            assert torch.equal(hvd.synchronize(handle), torch.full((1 << 20,), 3.0))
        again = hvd.add_process_set([0, 1])
        if WORLD.rank < 2:
            assert hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=again).tolist() == [2.0, 2.0]
        hvd.remove_process_set(again)
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [float(WORLD.size)] * 2

    on_all_ranks(check)


@pytest.mark.parallel([2, 3])
def test_a_set_one_rank_alone_refuses_fails_on_every_rank():
    """One rank's list is not ranks (a float, a bool, a string): every rank raises, none waits."""

    def check():
        for bad in ([0, 1.5], [True, 1], "01"):
            mine = bad if WORLD.rank == WORLD.size - 1 else [0, 1]
            with pytest.raises(ValueError, match="same list of ranks"):
                hvd.add_process_set(mine)
        with pytest.raises(ValueError, match="list of ranks"):
            hvd.ProcessSet([0, 1.0])
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == WORLD.size

    on_all_ranks(check)


@pytest.mark.parallel([3])
def test_a_step_after_its_set_was_removed_says_so():
    """Backward before hvd.remove_process_set, step() after: MPI's "Invalid communicator" was all the
    set's ranks read (helper-45)."""
    pair = hvd.add_process_set([0, 1])
    model = torch.nn.Linear(4, 1).double()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), process_set=pair
    )
    if WORLD.rank in pair.ranks:
        model(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    hvd.remove_process_set(pair)
    if WORLD.rank in pair.ranks:
        with pytest.raises(ValueError, match="its process set was removed"):
            opt.step()
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == WORLD.size


@pytest.mark.parallel([2, 3])
def test_an_optimizer_outside_its_set_steps_on_its_own_gradients():
    """Horovod's rule: DistributedOptimizer(process_set=even) on an odd rank reduces nothing and steps on
    the rank's own gradients (the synchronize/skip_synchronize/no_sync calls of a trainer still work)."""

    def check():
        even, odd, mine = sets_by_parity()
        try:
            torch.manual_seed(WORLD.rank)
            model = torch.nn.Linear(3, 1).double()
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), process_set=even
            )
            start = model.weight.detach().clone()
            model(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
            local = model.weight.grad.clone()
            averaged = members_rows(local, even.ranks).mean(0)  # (every rank: an allgather of MPI's)
            opt.step()
            if WORLD.rank % 2 == 1:
                torch.testing.assert_close(model.weight.detach(), start - 0.1 * local, rtol=0, atol=0)
                opt.synchronize()
                with opt.skip_synchronize(), opt.no_sync():
                    pass
            else:
                np.testing.assert_allclose(model.weight.detach().numpy(), (start.numpy() - 0.1 * averaged))
        finally:
            hvd.remove_process_set(even)
            hvd.remove_process_set(odd)

    on_all_ranks(check)


@pytest.mark.parallel([3])
def test_a_set_removed_on_some_ranks_only_fails_every_rank():
    """helper-53: remove_process_set agreed on nothing, so a rank that removed a set alone went on
    while its peers waited. The ranks now compare the set they remove: different sets are a
    ValueError on every rank, and a rank removing one while the others call a collective is a
    MismatchError on every rank; the global set works after both. (A peer inside the set's own
    collective meanwhile still waits: that wait is on another communicator.)"""

    def check():
        first, second = hvd.add_process_set([0, 2]), hvd.add_process_set([0, 1])
        with pytest.raises(ValueError, match=r"every rank must remove the same set; got rank 0 process set"):
            hvd.remove_process_set(first if WORLD.rank == 0 else second)
        with pytest.raises(gflow.MismatchError):
            if WORLD.rank == 0:
                hvd.remove_process_set(first)
            else:
                hvd.allreduce(torch.ones(1), op=hvd.Sum)
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == WORLD.size
        assert hvd.remove_process_set(first) and hvd.remove_process_set(second)
        assert not hvd.remove_process_set(first)

    on_all_ranks(check)
