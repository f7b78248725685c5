"""hvd.join() with uneven data (Horovod's): ranks that ran out of data take part in the others' allreduces
with zeros (blocking, async, grouped, small and large, DistributedOptimizer's) until every rank has
joined; the result against float64 references built from every rank's inputs (MPI's own allgather);
other collectives raise on the ranks that call them while some rank is joined, and nothing hangs."""

import copy
import time
import warnings

import numpy as np
import pytest
import torch
from helpers import WORLD, on_all_ranks

import gflow
import gflow.torch as hvd

torch.set_num_threads(1)
SIZES = [2, 3]  # (the Horovod example runs at 4)


@pytest.fixture(autouse=True)
def _init():
    hvd.init()


@pytest.mark.parallel(SIZES)
def test_joined_ranks_contribute_zeros_to_every_kind_of_allreduce():
    p, r = WORLD.size, WORLD.rank
    steps = r + 1  # rank r has r + 1 batches: uneven
    rng = np.random.default_rng([61, r])
    small = [torch.from_numpy(rng.standard_normal(5)) for _ in range(steps)]
    large = [torch.from_numpy(rng.standard_normal(300_001)).float() for _ in range(steps)]
    ints = [torch.from_numpy(rng.integers(-50, 50, 7)).to(torch.int32) for _ in range(steps)]
    everyone = WORLD.allgather((small, large, ints))

    def summed(which, step, dtype=np.float64):
        return sum(
            (e[which][step].numpy().astype(dtype) for e in everyone if step < len(e[which])),
            np.zeros(everyone[-1][which][step].shape, dtype),
        )

    def check():
        for step in range(p):
            if step == steps:
                assert hvd.join() == p - 1  # the last rank has the most batches: it joins last
                break
            np.testing.assert_allclose(
                hvd.allreduce(small[step], op=hvd.Sum).numpy(), summed(0, step), rtol=1e-12
            )
            average = hvd.synchronize(hvd.allreduce_async(large[step], name="large"))
            np.testing.assert_allclose(average.numpy(), summed(1, step) / p, rtol=1e-5, atol=1e-5)  # / all p
            got = hvd.grouped_allreduce([ints[step], small[step]], op=hvd.Sum)
            np.testing.assert_array_equal(got[0].numpy(), summed(2, step, np.int64))
            # min and max over the ranks with data: a joined rank's values change nothing (Horovod's
            # zeros would put a 0 that no rank had into them)
            own = [e[0][step].numpy() for e in everyone if step < len(e[0])]
            np.testing.assert_array_equal(hvd.allreduce(small[step], op=hvd.Max).numpy(), np.max(own, axis=0))
            np.testing.assert_array_equal(hvd.allreduce(small[step], op=hvd.Min).numpy(), np.min(own, axis=0))
        else:
            assert hvd.join() == p - 1
        # everyone joined: the collectives work as before
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [float(p)] * 2

    on_all_ranks(check)


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("nbytes", [64, 2**16])
def test_joined_ranks_serve_device_allreduces_through_the_node_phase(monkeypatch, nbytes):
    """Device arrays (Numba's simulator here) whose "auto" allreduce takes the node phase in device
    peer memory, from two ranks: a joined rank takes part with device zeros through the same peer
    memory (it hung when it served with host zeros: the node's ranks made different peer memory),
    for one piece and several; the calls after join() work."""
    from numba import cuda

    monkeypatch.setattr(gflow.config, "small_message_bytes", 0)  # (the node phase, small, for the simulator)
    monkeypatch.setattr(gflow.config, "shared_memory_min_bytes", 64)
    monkeypatch.setattr(gflow.config, "shared_memory_max_bytes", 4096)  # (device pieces: 64 KiB)
    p, r = WORLD.size, WORLD.rank
    n = nbytes // 4 + 3
    x = np.random.default_rng([62, r]).standard_normal(n).astype(np.float32)
    everyone = WORLD.allgather(x.astype(np.float64))

    def check():
        for step in range(p):
            if step == r + 1:
                assert hvd.join() == p - 1
                break
            y = gflow.allreduce(cuda.to_device(x), "sum").copy_to_host()
            expected = sum(everyone[q] for q in range(p) if step < q + 1)
            np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
        else:
            assert hvd.join() == p - 1
        y = gflow.allreduce(cuda.to_device(x), "sum").copy_to_host()
        np.testing.assert_allclose(y, sum(everyone), rtol=1e-5, atol=1e-5)

    on_all_ranks(check)


@pytest.mark.parallel([2, 3, 4])
def test_joined_ranks_serve_the_process_sets_they_are_in():
    """A rank in join() takes part with zeros in the allreduces of each process set it is in too
    (the set's callers waited for it until the stall warning): blocking and async, on the latency
    path and the ring, means over the set's size, min/max over the set's ranks with data; sets of
    one rank, overlapping sets, ranks in no set but the global one, and async calls on a set still in
    flight when their rank joins (they run before it serves that set's background channel). Against
    float64 sums of every rank's inputs (MPI's own allgather)."""
    p, r = WORLD.size, WORLD.rank
    steps = [2, 1, 4, 3][:p]  # (distinct: the last to join is the one with most)
    rng = np.random.default_rng([64, r])
    small = [rng.standard_normal(7) for _ in range(steps[r])]
    large = [rng.standard_normal(70_001).astype(np.float32) for _ in range(steps[r])]
    everyone = WORLD.allgather((small, large))
    members = [[0, 1], list(range(1, p)), [0, 2]] if p > 2 else [list(range(1, p))]
    sets = [hvd.add_process_set(ranks) for ranks in members]

    def over(ranks, which, step):
        return [everyone[q][which][step].astype(np.float64) for q in ranks if step < steps[q]]

    def check():
        late = []  # (the last step's async calls: this rank joins with them in flight)
        for step in range(steps[r]):
            got = hvd.allreduce(torch.from_numpy(small[step]), op=hvd.Sum).numpy()
            np.testing.assert_allclose(got, sum(over(range(p), 0, step)), rtol=1e-12)
            for ps in sets:
                if r not in ps.ranks:
                    continue
                x = torch.from_numpy(small[step])
                handle = hvd.allreduce_async(torch.from_numpy(large[step]), name=f"large{ps.process_set_id}",
                                             process_set=ps)  # fmt: skip
                got = hvd.allreduce(x, op=hvd.Sum, process_set=ps).numpy()
                np.testing.assert_allclose(got, sum(over(ps.ranks, 0, step)), rtol=1e-12)
                got = hvd.allreduce(x, op=hvd.Max, process_set=ps).numpy()
                np.testing.assert_array_equal(got, np.max(over(ps.ranks, 0, step), axis=0))
                mean = sum(over(ps.ranks, 1, step)) / len(ps.ranks)  # (over the set's size)
                late.append((handle, mean))
                if step < steps[r] - 1:
                    handle, mean = late.pop()
                    np.testing.assert_allclose(hvd.synchronize(handle).numpy(), mean, rtol=1e-5, atol=1e-5)
        assert hvd.join() == int(np.argmax(steps))
        for handle, mean in late:
            np.testing.assert_allclose(hvd.synchronize(handle).numpy(), mean, rtol=1e-5, atol=1e-5)
        for ps in sets:  # everyone joined: the sets work as before
            if r in ps.ranks:
                got = hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=ps)
                assert got.tolist() == [float(len(ps.ranks))] * 2

    try:
        on_all_ranks(check)
    finally:
        for ps in sets:
            hvd.remove_process_set(ps)


@pytest.mark.parallel([2, 3])
def test_a_joined_rank_sleeps_while_the_others_compute():
    """A rank in join() waits for the others' next call without taking a core: its threads (the
    caller's channel, the background one, a set's) sleep between polls. The caller's channel polled
    without sleeping, about 0.8 of a core at p = 3 on 2 cores, taken from the ranks still training.
    Their allreduces after the computation still get the joined rank's zeros."""
    p, r = WORLD.size, WORLD.rank
    ps = hvd.add_process_set([0, p - 1]) if p > 2 else None
    rng = np.random.default_rng([65, r])
    x = rng.standard_normal(1000)
    everyone = WORLD.allgather(x)
    hvd.allreduce(torch.ones(1))  # (every channel's duplicates made: the wait below is only a wait)
    try:

        def check():
            if r == 0:
                wall, cpu = time.monotonic(), time.process_time()
                assert hvd.join() == p - 1
                wall, cpu = time.monotonic() - wall, time.process_time() - cpu
                assert wall > 1.0, f"join() returned after {wall:.2f} s, before the others' computation ended"
                assert cpu < 0.35 * wall, f"the joined rank used {cpu:.2f} s of CPU in {wall:.2f} s of join()"
                return
            end = time.monotonic() + 1.5
            while time.monotonic() < end:  # (the others compute: a joined rank must leave them the cores)
                sum(range(10_000))
            got = hvd.allreduce(torch.from_numpy(x), op=hvd.Sum).numpy()
            np.testing.assert_allclose(got, sum(everyone[1:]), rtol=1e-12)
            if ps is not None and r == p - 1:
                got = hvd.allreduce(torch.from_numpy(x), op=hvd.Sum, process_set=ps).numpy()
                np.testing.assert_allclose(got, everyone[p - 1], rtol=1e-12)
            hvd.join()

        on_all_ranks(check)
    finally:
        if ps is not None:
            hvd.remove_process_set(ps)


@pytest.mark.parallel([3, 4])
@pytest.mark.parametrize("on_a_set", [False, True])
def test_a_rank_joins_with_an_async_call_queued_that_fails(on_a_set):
    """Every rank queues an async allreduce that fails (the sizes differ) and rank 0 joins at once:
    it serves the fresh background channel the others make at their next async call, not the failed
    one (it did, and their next async call waited for ever: helper-72), globally and on a set."""
    p, r = WORLD.size, WORLD.rank
    ps = hvd.add_process_set([p - 2, p - 1]) if on_a_set else None
    ranks = ps.ranks if on_a_set else list(range(p))
    try:

        def check():
            failing = None
            if r not in ranks:
                hvd.join()
            else:
                failing = hvd.allreduce_async(torch.ones(100 + r), op=hvd.Sum, process_set=ps)
            if r == ranks[0]:
                hvd.join()
            elif failing is not None:
                with pytest.raises(gflow.MismatchError, match="number of elements"):
                    hvd.synchronize(failing)
                for _ in range(2):  # (a joined rank gives zeros: the sum of the others' ones)
                    got = hvd.synchronize(hvd.allreduce_async(torch.ones(5), op=hvd.Sum, process_set=ps))
                    assert got.tolist() == [len(ranks) - 1.0] * 5
                    got = hvd.allreduce(torch.ones(5), op=hvd.Sum, process_set=ps)
                    assert got.tolist() == [len(ranks) - 1.0] * 5
                hvd.join()
            if r == ranks[0]:
                with pytest.raises(gflow.MismatchError, match="number of elements"):
                    hvd.synchronize(failing)
            assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [float(p)] * 2

        on_all_ranks(check)
    finally:
        if on_a_set:
            hvd.remove_process_set(ps)


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("threshold", [None, "auto"])
def test_distributed_optimizer_with_uneven_batches_equals_a_float64_replay(threshold):
    """Each step averages the gradients of the ranks still training over all p ranks (zeros from those
    that joined, as Horovod's); the ranks end with bitwise equal weights. The next epoch, from the
    last rank's weights, trains on: with threshold_bytes="auto" too, whose tuning every rank takes
    from the rank that joined last (each rank's tuner had stopped where it joined, and every step
    after join() failed with MismatchError: helper-76)."""
    p, r = WORLD.size, WORLD.rank
    rng = np.random.default_rng([62, r])
    batches = [torch.from_numpy(rng.standard_normal((4, 3))) for _ in range(r + 1)]
    everyone = WORLD.allgather([b.numpy() for b in batches])
    epoch_two = [torch.from_numpy(rng.standard_normal((4, 3))) for _ in range(3)]
    everyone_two = WORLD.allgather([b.numpy() for b in epoch_two])

    def model():
        torch.manual_seed(0)
        layers = [torch.nn.Linear(3, 600), torch.nn.Tanh(), torch.nn.Linear(600, 600), torch.nn.Tanh()]
        # (2.9 MB of float64 weights: the kit's segment goes by the ring, not recursive doubling)
        return torch.nn.Sequential(*layers, torch.nn.Linear(600, 1)).double()

    def replay_step(replay, everyone, step):
        total = [torch.zeros_like(q) for q in replay.parameters()]
        for theirs in everyone:
            if step < len(theirs):
                replay.zero_grad()
                replay(torch.from_numpy(theirs[step])).sum().backward()
                total = [t + q.grad for t, q in zip(total, replay.parameters(), strict=True)]
        with torch.no_grad():
            for q, t in zip(replay.parameters(), total, strict=True):
                q -= 0.1 * t / p

    def check():
        net, replay = model(), model()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters(), threshold_bytes=threshold
        )
        for step in range(p):
            replay_step(replay, everyone, step)
            if step < len(batches):
                opt.zero_grad()
                net(batches[step]).sum().backward()
                opt.step()
            elif step == len(batches):
                last = hvd.join()
        if len(batches) == p:
            last = hvd.join()
        assert last == p - 1
        # every rank took each step's average (the joined ones too, through the kit's zeros), so the
        # ranks that trained longest hold the replay's weights
        if r == p - 1:
            for q, e in zip(net.parameters(), replay.parameters(), strict=True):
                np.testing.assert_allclose(q.detach().numpy(), e.detach().numpy(), rtol=1e-10, atol=1e-13)
        hvd.broadcast_parameters(net.state_dict(), root_rank=last)
        for step, x in enumerate(epoch_two):  # the next epoch: every rank has a batch
            replay_step(replay, everyone_two, step)
            opt.zero_grad()
            net(x).sum().backward()
            opt.step()
        for q, e in zip(net.parameters(), replay.parameters(), strict=True):
            np.testing.assert_allclose(q.detach().numpy(), e.detach().numpy(), rtol=1e-10, atol=1e-13)
            assert WORLD.allgather(q.detach().numpy().tobytes()) == [q.detach().numpy().tobytes()] * p
        if threshold == "auto":
            where = (opt._dp._lazy._tuner.position(), opt._dp._lazy.threshold_bytes)  # (the timings differ)
            assert WORLD.allgather(where) == [where] * p

    on_all_ranks(check)


@pytest.mark.parallel(SIZES)
def test_other_collectives_raise_while_a_rank_is_joined_and_the_job_goes_on():
    p, r = WORLD.size, WORLD.rank

    def check():
        if r == 0:
            assert hvd.join() == p - 1
        else:
            t = torch.ones(3)
            for call in (
                lambda: hvd.allgather(t),
                lambda: hvd.broadcast(t, root_rank=1),
                lambda: hvd.alltoall(torch.ones(p)),
                lambda: hvd.reducescatter(torch.ones(p)),
            ):
                with pytest.raises(gflow.NotServedInJoinError, match="join"):
                    call()
            # Calls made of other collectives are named as called (helper-71, helper-72: "allgather
            # is not supported", from allreduce(op=Product), allgather_object, add_process_set)
            for call, called in (
                (lambda: hvd.allreduce(t, op=hvd.Product), "allreduce(op=Product)"),
                (lambda: hvd.broadcast_object({"a": r}, root_rank=1), "broadcast_object"),
                (lambda: hvd.allgather_object(r), "allgather_object"),
                (lambda: hvd.add_process_set(list(range(1, p))), "add_process_set"),
            ):
                with pytest.raises(gflow.NotServedInJoinError) as info:
                    call()
                assert str(info.value).startswith(f"{called} is not supported while ranks are in join()")
                assert isinstance(info.value, hvd.HorovodInternalError)
            # Ranks that disagree while one is joined: they raise, saying what each passed, and the
            # joined rank serves on (ranks 1.. are at least two from p = 3).
            if p > 2:
                with pytest.raises(gflow.MismatchError) as info:
                    hvd.allreduce(torch.ones(2, 3) if r == 1 else torch.ones(3, 2), name="m")
                first = str(info.value).split("\n")[0]
                assert "on the shape: rank 1 passed a tensor of shape (2, 3)" in first, first
                assert "rank 2 passed a tensor of shape (3, 2)" in first, first  # (the lowest)
            # Async calls refused while a rank is joined fail the callers' background channel, and
            # they make a fresh one: so does the joined rank (it served the old one, and the next
            # async call hung: helper-43). Adasum, whose pairs combine vectors, is refused too (it
            # waited for the joined rank for ever).
            with pytest.raises(gflow.GflowError, match="allgather is not supported while ranks are in join"):
                hvd.synchronize(hvd.allgather_async(t))
            if p == 2:  # (Adasum needs a power of two)
                with pytest.raises(gflow.GflowError, match="Adasum is not supported while ranks are in join"):
                    hvd.synchronize(hvd.allreduce_async(t, op=hvd.Adasum))
            assert hvd.synchronize(hvd.allreduce_async(t, op=hvd.Sum)).tolist() == [float(p - 1)] * 3
            # Every rank but the joined one rejects its own arguments: each raises its own error, and
            # the joined rank serves on (it read the rejection's empty signature, KeyError, and
            # ended the job: helper-43)
            with pytest.raises(TypeError, match="prescale_factor"):
                hvd.allreduce(t, prescale_factor="x")
            assert hvd.allreduce(t, op=hvd.Sum).tolist() == [float(p - 1)] * 3  # rank 0 gives zeros
            if r == p - 1:
                import time

                time.sleep(0.3)  # (the last to join, by the clock too)
            assert hvd.join() == p - 1
        assert hvd.allgather(torch.tensor([float(r)])).tolist() == [float(k) for k in range(p)]

    on_all_ranks(check)


def test_join_alone_returns_this_rank():
    assert hvd.join() == WORLD.rank


@pytest.mark.parallel([2, 4])
@pytest.mark.timeout(240)
def test_the_horovod_features_example_runs_as_written(tmp_path_factory):
    """examples/horovod_features.py (join with uneven batches, a process set, alltoall, reducescatter,
    Adasum, the timeline), as a Horovod user would run it."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import horovod_features

    folder = WORLD.bcast(str(tmp_path_factory.mktemp("trace")) if WORLD.rank == 0 else None)
    trace = os.path.join(folder, "trace.json")
    found = horovod_features.main(["--timeline", trace])
    p, r = WORLD.size, WORLD.rank
    assert found["last"] == p - 1  # the rank with the most batches
    assert bool((found["received"] % p == r).all())
    rows = len(np.array_split(np.zeros(2 * p + 1), p)[r])
    assert found["shard"].shape == (rows, 3) and torch.allclose(
        found["shard"], torch.full((rows, 3), (p - 1) / 2)
    )
    assert found["adasum"] is not None and torch.isfinite(found["adasum"]).all()
    assert np.isfinite(found["final_loss"]) and found["final_loss"] < 1.0
    WORLD.Barrier()
    with open(os.path.join(folder, f"trace.{r}.json")) as f:
        assert json.load(f), "an empty timeline"


INTERRUPTED_JOIN = """
import os, signal, sys, threading
import numpy as np, torch
from mpi4py import MPI
import gflow, gflow.torch as hvd

torch.set_num_threads(1)
hvd.init()
rank, other = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.Dup()
gflow.allreduce(np.ones(4), comm=other)
hvd.synchronize(hvd.allreduce_async(torch.ones(3), name="warm"))
if rank == 0:
    def interrupt(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.8)
    try:
        hvd.join()
    except KeyboardInterrupt:
        pass
    calls = [lambda: hvd.allreduce(torch.ones(3)),
             lambda: hvd.synchronize(hvd.allreduce_async(torch.ones(3))), hvd.join]
    for call in calls:  # each in a thread: one that hangs is seen as such
        said = []
        def run(call=call):
            try:
                call()
            except Exception as exc:
                said.append(type(exc).__name__)
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(10)
        print(f"[0 then: {'hung' if thread.is_alive() else said}]", flush=True)
got = gflow.allreduce(np.ones(5000), comm=other), gflow.allreduce_async(np.ones(1000), comm=other).wait()
print(f"[{rank} other: {all(bool((g == other.size).all()) for g in got)}]", flush=True)
other.Barrier()
os._exit(0)
"""


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("slots", ["1", "0"])
def test_an_interrupted_join_refuses_its_communicator_and_frees_gflows_thread(size, slots):
    """Ctrl-C in hvd.join() on one rank while the others do other work: the communicator refuses
    its next blocking call, async call and join (the second join hung, and the async call queued
    for ever behind join's other channel, still serving on gflow's thread), and every rank's other
    communicator keeps working, async calls too (they queued behind it as well) (helper-30)."""
    import os
    import subprocess
    import sys

    done = subprocess.run(
        ["mpiexec", "-n", str(size), sys.executable, "-c", INTERRUPTED_JOIN],
        capture_output=True, text=True, timeout=90,
        env=dict(os.environ, OMP_NUM_THREADS="1", GFLOW_SHARED_SLOTS=slots, GFLOW_ABORT_ON_EXCEPTION="0"),
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.stdout.count("[0 then: ['GflowError']]") == 3, output
    assert all(f"[{r} other: True]" in done.stdout for r in range(size)), output


@pytest.mark.parallel(SIZES)
def test_a_partial_accumulation_at_join_is_dropped_with_a_warning_and_the_next_epoch_pairs():
    """backward_passes_per_step=2 and uneven data: an even rank r ends its epoch after 2r + 1 passes,
    one short of a step (an odd rank after 2r + 2). join() drops that partial step (nothing of it was
    sent) with a warning; it used to take the next epoch's first backward for its last pass, and the
    next failed on that rank alone ("more than backward_passes_per_step") while the others waited
    (helper-75). The next epoch, from
    the last rank's weights, equals a float64 replay on every rank."""
    p, r = WORLD.size, WORLD.rank
    rng = np.random.default_rng([63, r])
    first = [torch.from_numpy(rng.standard_normal((4, 3))) for _ in range(2 * r + 1 + r % 2)]
    second = [torch.from_numpy(rng.standard_normal((4, 3))) for _ in range(4)]
    everyone = WORLD.allgather([b.numpy() for b in second])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 20), torch.nn.Tanh(), torch.nn.Linear(20, 1)).double()

    def check():
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters(), backward_passes_per_step=2
        )
        for i, x in enumerate(first):
            net(x).sum().backward()
            if i % 2 == 1:
                opt.step()
                opt.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            last = hvd.join()
        dropped = [w for w in caught if "joined with 1 of backward_passes_per_step=2" in str(w.message)]
        assert len(dropped) == (r % 2 == 0), [str(w.message) for w in caught]
        assert WORLD.allgather(last) == [last] * p and last > 0  # (the last two run as many steps)
        hvd.broadcast_parameters(net.state_dict(), root_rank=last)
        replay = copy.deepcopy(net)
        opt.zero_grad()
        for i, x in enumerate(second):
            net(x).sum().backward()
            if i % 2 == 1:
                opt.step()
                opt.zero_grad()
                replay.zero_grad()
                for theirs in everyone:
                    for batch in theirs[i - 1 : i + 1]:
                        replay(torch.from_numpy(batch)).sum().backward()
                with torch.no_grad():
                    for q in replay.parameters():
                        q -= 0.1 * q.grad / p
        for q, e in zip(net.parameters(), replay.parameters(), strict=True):
            np.testing.assert_allclose(q.detach().numpy(), e.detach().numpy(), rtol=1e-10, atol=1e-13)
            assert WORLD.allgather(q.detach().numpy().tobytes()) == [q.detach().numpy().tobytes()] * p

    on_all_ranks(check)
