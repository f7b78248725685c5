"""The stall inspector (gflow/runtime/stall.py): a rank waiting on a late peer names it, in blocking calls and
in the background engine; GFLOW_STALL_ABORT_S ends the job with that message; bad settings are named."""

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import WORLD, mpi_allreduce, on_all_ranks, random_array, rank_rng

import gflow
from gflow.runtime import engine, stall

LAST = WORLD.size - 1

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parallel([2, 3, 4])
@pytest.mark.parametrize("mode", ["blocking", "engine"])
def test_a_late_rank_is_named_by_the_others(monkeypatch, capsys, mode):
    monkeypatch.setattr(gflow.config, "stall_warning_s", 1.0)
    x = np.ones(1 << 16, np.float32)
    WORLD.barrier()  # (ranks come from the batch's previous test apart: one over 1 s late made a line)
    gflow.allreduce(x)  # the communicators exist (a peer that has not made its own yet cannot answer)
    gflow.allreduce_async(x).wait()
    late = WORLD.size - 1
    for episode in range(2):  # each late arrival is reported, not only the first
        WORLD.barrier()
        if WORLD.rank == late:
            time.sleep(3.5)
        start = time.monotonic()
        y = gflow.allreduce(x) if mode == "blocking" else gflow.allreduce_async(x).wait()
        waited = time.monotonic() - start
        on_all_ranks(lambda y=y: np.testing.assert_array_equal(y, np.full_like(x, WORLD.size)))
        assert waited > 2.5 or WORLD.rank == late
        # One line per stall (not one per waiting rank per interval), though the wait is 3 intervals long
        line = only_stall_line(capsys.readouterr().err, episode)
        thread = "MainThread" if mode == "blocking" else "gflow-engine"
        assert f"on thread {thread}" in line and f"rank {late} has not entered it yet" in line, line
        assert "allreduce of 65536 float32 (host array), op=sum" in line, line
        if WORLD.size > 2:  # the others waiting with the reporter are named
            assert "in it too" in line, line


def only_stall_line(err: str, about=None) -> str:
    """The one stall line all ranks printed between them (each rank passes its own stderr), checked
    to come from a rank that waited: the late rank is the last."""
    lines = [line for text in WORLD.allgather(err) for line in text.splitlines() if ": waited" in line]
    assert len(lines) == 1, (about, lines)
    reporter = int(re.match(r"gflow rank (\d+):", lines[0]).group(1))
    assert reporter != WORLD.size - 1, lines
    return lines[0]


@pytest.mark.parallel([3, 4])
def test_a_stall_is_reported_whatever_the_lowest_ranks_settings(monkeypatch, capsys):
    # Rank 0 waits too, with warnings off: another waiting rank reports, once.
    monkeypatch.setattr(gflow.config, "stall_warning_s", 0.0 if WORLD.rank == 0 else 1.0)
    x = np.ones(1 << 10, np.float32)
    gflow.allreduce(x)  # the communicators exist
    late = WORLD.size - 1
    WORLD.barrier()
    if WORLD.rank == late:
        time.sleep(2.5)
    gflow.allreduce(x)
    line = only_stall_line(capsys.readouterr().err)
    assert not line.startswith("gflow rank 0:") and f"rank {late} has not entered it yet" in line, line


@pytest.mark.parallel([2, 3])
def test_the_wait_named_is_timed_when_the_peers_have_answered(monkeypatch):
    # The peers' answers may take seconds (a loaded machine: seen once in a batch of the torch files,
    # "waited 1 s ... every rank has entered it" while the late rank slept 3.5 s: the facts were those
    # of the answers, the time that of the first question). Rank 0 reports a wait begun 1 s ago, and its
    # question takes 2 s to go out: the line names a wait of 3 s or a little more (never the 1 s it began at).
    from gflow.runtime.context import context

    x = np.ones(1 << 10, np.float32)
    gflow.allreduce(x)  # the communicators exist
    WORLD.barrier()
    ask = stall._ask

    def slow_ask(*args):
        time.sleep(2.0)
        return ask(*args)

    def report_on_rank_0():
        if WORLD.rank == 0:
            monkeypatch.setattr(stall, "_ask", slow_ask)
            with stall._lock:  # (as the inspector holds it)
                text, _ = stall._report(context(), stall.mark(), time.monotonic() - 1.0)
            waited = int(re.search(r": waited (\d+) s", text).group(1))
            assert 3 <= waited <= 5 and "did not answer" not in text, text  # (1 s + 2 s + the answers)
        else:
            time.sleep(3.5)  # (the monitor thread answers meanwhile)

    on_all_ranks(report_on_rank_0)


@pytest.mark.parallel([2, 3])
def test_without_validation_the_message_says_what_it_cannot_tell(monkeypatch, capsys):
    monkeypatch.setattr(gflow.config, "stall_warning_s", 1.0)
    x = np.ones(1 << 16, np.float32)
    gflow.allreduce(x)
    monkeypatch.setattr(gflow.config, "validate", False)
    if WORLD.rank == 0:
        time.sleep(2.5)
    gflow.allreduce(x)
    err = capsys.readouterr().err
    if WORLD.rank:
        assert "GFLOW_VALIDATE=0" in err and "cannot tell which ranks are late" in err, err


@pytest.mark.parallel([2, 3, 4])
def test_a_rank_late_for_the_first_async_collective_is_named(monkeypatch, capsys):
    """The engine's first collective on a communicator makes its duplicates (a collective itself): the
    peers are asked on the caller's context's channel about their background context."""
    monkeypatch.setattr(gflow.config, "stall_warning_s", 1.0)
    comm = WORLD.Dup()  # new to gflow: no background context yet
    x = np.ones(1 << 10, np.float32)
    gflow.allreduce(x, comm=comm)  # the caller's context and its monitor's duplicate exist
    late = WORLD.size - 1
    WORLD.barrier()
    if WORLD.rank == late:
        time.sleep(3.5)
    start = time.monotonic()
    y = gflow.allreduce_async(x, comm=comm).wait()
    waited = time.monotonic() - start
    comm.Free()
    np.testing.assert_array_equal(y, np.full_like(x, WORLD.size))
    assert waited > 2.5 or WORLD.rank == late, waited
    line = only_stall_line(capsys.readouterr().err)  # one line from the waiting ranks, once
    assert "on thread gflow-engine" in line and "in collective #1; on a communicator of" in line, line
    assert f"rank {late} has not entered it yet (rank {late} at #0)" in line, line
    assert "allreduce of 1024 float32 (host array), op=sum" in line, line


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_a_rank_late_for_the_first_collective_is_warned_of(monkeypatch, capsys, mode):
    """The first collective on a communicator: no channel to ask the peers on exists yet, so the
    warning says that some rank is late without naming it."""
    monkeypatch.setattr(gflow.config, "stall_warning_s", 1.0)
    comm = WORLD.Dup()  # new to gflow
    x = np.ones(1 << 10, np.float32)
    late = WORLD.size - 1
    WORLD.barrier()
    if WORLD.rank == late:
        time.sleep(3.5)
    start = time.monotonic()
    y = gflow.allreduce(x, comm=comm) if mode == "blocking" else gflow.allreduce_async(x, comm=comm).wait()
    waited = time.monotonic() - start
    comm.Free()
    np.testing.assert_array_equal(y, np.full_like(x, WORLD.size))
    err = capsys.readouterr().err
    if WORLD.rank != late:
        assert waited > 2.5, waited
        # (the caller's thread makes the duplicates of an async call too: CommContext.for_async)
        assert f"gflow rank {WORLD.rank}: waited" in err and "on thread MainThread" in err, err
        assert "some rank has not entered gflow's first collective on this communicator" in err, err
        assert "which one cannot be told yet" in err, err
        assert "allreduce of 1024 float32 (host array), op=sum" in err, err
        if mode == "async":  # (not entered yet: said as the call that makes the duplicates)
            assert "on thread MainThread (allreduce) in collective #1; on a communicator" in err, err
    else:
        assert "waited" not in err, err


@pytest.mark.parallel([2, 3])
def test_a_rank_late_for_the_first_async_call_after_a_failed_one_is_named(monkeypatch, capsys):
    """After a failed async call every rank makes a fresh background channel at its next async call,
    on the caller's thread (CommContext.for_async): the peer late for that call is named (the
    warning said every rank had entered it: helper-69)."""
    monkeypatch.setattr(gflow.config, "stall_warning_s", 1.0)
    comm = WORLD.Dup()
    x = random_array(rank_rng(70), 40, np.float64)
    expected = mpi_allreduce(x)
    gflow.allreduce(x, comm=comm)
    wrong = random_array(rank_rng(71), 3 if WORLD.rank == 0 else 4, np.float64)
    with pytest.raises(gflow.MismatchError):
        gflow.allreduce_async(wrong, comm=comm).wait(timeout=20)
    capsys.readouterr()
    late = WORLD.size - 1
    if WORLD.rank == late:
        time.sleep(3.5)
    got = gflow.allreduce_async(x, comm=comm).wait(timeout=20)
    comm.Free()
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    line = only_stall_line(capsys.readouterr().err)  # (from whichever waiting rank was due first)
    assert f"rank {late} has not entered it yet" in line, line
    assert "every rank has entered it" not in line, line
    assert f"of {WORLD.size} ranks: allreduce of 40 float64 (host array), op=sum" in line, line


def _fail_an_async_call(comm, rng):
    """An allreduce_async of another length on rank 0: every rank's wait raises MismatchError."""
    wrong = random_array(rng, 3 if WORLD.rank == 0 else 4, np.float64)
    handle = gflow.allreduce_async(wrong, comm=comm)
    on_all_ranks(lambda: pytest.raises(gflow.MismatchError, handle.wait, 20))


def _async_and_blocking_in_either_order(comm, rng):
    """Rank 0 starts an async call and then a blocking one, the others the blocking one first (an
    order that works at any time without a failure). Returns each rank's errors, or checks the results
    against MPI's own allreduce."""
    x, y = random_array(rng, 10, np.float64), random_array(rng, 1, np.float64)
    errors, results = [], {}

    def attempt(name, call):
        try:
            results[name] = call()
        except gflow.GflowError as exc:
            errors.append(str(exc))

    if WORLD.rank == 0:
        late = gflow.allreduce_async(x, comm=comm)
        attempt("y", lambda: gflow.allreduce(y, comm=comm))
        attempt("x", lambda: late.wait(timeout=20))
    else:
        attempt("y", lambda: gflow.allreduce(y, comm=comm))
        attempt("x", lambda: gflow.allreduce_async(x, comm=comm).wait(timeout=20))
    everyone = WORLD.allgather(errors)
    if not any(everyone):
        for name, mine in (("x", x), ("y", y)):
            expected = np.empty_like(mine)
            comm.Allreduce(mine, expected)
            np.testing.assert_allclose(results[name], expected, rtol=1e-12, atol=1e-12)
    return everyone


@pytest.mark.parallel([2, 3])
def test_after_a_failure_an_async_and_a_blocking_call_in_either_order_work_once():
    """helper-84: after a failed async call each rank made a fresh background channel at its next
    async call, which waited for every rank's: an async call before a blocking one on rank 0 and
    after it on the others (an order that works at any other time) crossed waits, and the
    communicator ended. The first failure's channel is now made with the first (a spare): the
    program works. After a second failure the fresh channel is made at the next async call again,
    and the crossed waits there say why ("The ranks made different calls" said they had not)."""
    comm = WORLD.Dup()
    rng = rank_rng(86)
    gflow.allreduce(random_array(rng, 2, np.float64), comm=comm)
    _fail_an_async_call(comm, rng)
    everyone = _async_and_blocking_in_either_order(comm, rng)
    assert not any(everyone), everyone
    _fail_an_async_call(comm, rng)
    everyone = _async_and_blocking_in_either_order(comm, rng)
    comm.Free()
    assert all(len(mine) == 2 for mine in everyone), everyone  # (every call of every rank raised)
    texts = [text for mine in everyone for text in mine]
    assert any("crossed waits" in t and "This follows a second failed async call" in t for t in texts), texts
    assert not any("The ranks made different calls" in t for t in texts), texts


def run_stall_case(mode: str, seconds: int):
    env = dict(os.environ, GFLOW_STALL_WARNING_S="1", GFLOW_STALL_ABORT_S="3")
    start = time.monotonic()
    done = subprocess.run(
        ["mpiexec", "-n", "3", sys.executable, os.path.join(HERE, "stall_case.py"), str(seconds), mode],
        env=env, capture_output=True, text=True, timeout=seconds + 30,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


@pytest.mark.parametrize("mode", ["sync", "async", "first-async"])
def test_stall_abort_ends_the_job_with_the_message(mode):
    status, output, elapsed = run_stall_case(mode, 30 if mode != "first-async" else 15)
    assert status != 0, output
    assert elapsed < 20, f"{mode}: took {elapsed:.0f} s"
    assert "rank 2 has not entered it yet" in output, output
    assert "ending the job (GFLOW_STALL_ABORT_S=3)" in output, output
    assert "finished" not in output, output
    # helper-56: MPI_Abort returned before the launcher's kill, and the line came again, as a warning
    # (its wait's seconds, timed when the peers have answered, may differ: matched by the rank)
    lines = output.splitlines()
    first = next(i for i, line in enumerate(lines) if line.endswith("ending the job (GFLOW_STALL_ABORT_S=3)"))
    teller = re.match(r"gflow rank \d+:", lines[first]).group(0)
    again = [line for line in lines[first + 1 :] if line.startswith(teller) and ": waited" in line]
    assert not again, output


def test_stall_abort_ends_a_job_late_for_its_first_collective():
    status, output, elapsed = run_stall_case("first", 15)
    assert status != 0, output
    assert elapsed < 20, f"took {elapsed:.0f} s"
    assert "some rank has not entered gflow's first collective on this communicator" in output, output
    assert "ending the job (GFLOW_STALL_ABORT_S=3)" in output, output
    assert "finished" not in output, output


def test_malformed_stall_settings_are_named():
    for name, value in [("GFLOW_STALL_WARNING_S", "-1"), ("GFLOW_STALL_ABORT_S", "soon")]:
        done = subprocess.run(
            [sys.executable, "-c", "import gflow"], env=dict(os.environ, **{name: value}),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode != 0 and name in done.stderr and repr(value) in done.stderr, done.stderr


@pytest.mark.parallel([2, 3])
def test_after_crossed_waits_no_collective_starts_on_that_communicator():
    # A step in which rank 0 reduces a metric in a blocking call while the others wait for their
    # async work (a trainer's step), which rank 0 has not started: rank 0 finds the crossed waits and
    # raises, out of its step; the others, told, raise out of theirs. The blocking call's messages
    # stay posted, so no blocking collective of any kind starts on that communicator again, on any
    # rank (here an allgather used to meet them on a peer and hang it), each naming the failure; nor
    # does an async one: which of the ranks' steps would pair after the error depends on the program
    # (helper-77), so each fails at once, sending nothing. (A duplicate of WORLD: the failed
    # communicator is never used again.)
    comm = WORLD.Dup()
    x = np.arange(4, dtype=np.float64)
    gflow.allreduce(x, comm=comm)  # (the communicator's contexts made, as in a trainer's later steps)
    gflow.allreduce_async(x, comm=comm).wait()
    with pytest.raises(gflow.MismatchError, match="crossed waits"):
        if WORLD.rank == 0:
            gflow.allreduce(x, comm=comm)  # the metric, on rank 0 only
        gflow.allreduce_async(x, comm=comm).wait()  # the step
    for _ in range(2):
        with pytest.raises(gflow.GflowError, match="crossed waits ended this communicator's collectives"):
            gflow.allreduce_async(x, comm=comm, op="sum").wait(timeout=20)
    for call in (gflow.allgather, gflow.broadcast, gflow.allreduce):
        with pytest.raises(gflow.GflowError, match="an earlier collective on this communicator failed"):
            call(x, comm=comm)
    WORLD.Barrier()


@pytest.mark.parallel([3, 4])
def test_a_rank_in_join_leaves_it_when_a_stray_call_ends_the_communicator():
    # helper-78: rank 0 runs out of data and joins; the last rank alone reduces a metric after its
    # step, which ends the communicator. The others' join() is refused at once, and rank 0's join()
    # waited for them until the stall abort. Now it raises too, within seconds, and every rank goes
    # on on a new communicator.
    comm = WORLD.Dup()
    lazy = gflow.LazyAllreduce(threshold_bytes=8, op="sum", comm=comm)
    said = "another kind of call|disagree on the collective"
    start = time.monotonic()
    for step in range(1 if WORLD.rank == 0 else 3):
        try:
            for _ in range(3):
                lazy.push(np.full(3, 100.0 * step + WORLD.rank))
            lazy.flush()
        except gflow.GflowError as error:
            assert step == 2 and re.search(said, str(error)), (step, error)
        if step == 1 and WORLD.rank == LAST:
            with pytest.raises(gflow.MismatchError, match="disagree on the collective"):
                gflow.allreduce_async(np.ones(2), comm=comm).wait()
    with pytest.raises(gflow.GflowError, match=said):
        gflow.join(comm)
    assert time.monotonic() - start < 20
    np.testing.assert_array_equal(gflow.allreduce(np.ones(1), comm=WORLD.Dup()), WORLD.size)
    # join()'s own background job failed with it: not a failure the program lost (said at exit)
    lost = engine.shutdown()
    assert not [line for line in lost if line.startswith("join:")], lost


@pytest.mark.parallel([2, 3])
@pytest.mark.parametrize("threshold", [None, 256])  # (segments all at synchronize(), or some before)
@pytest.mark.parametrize("where", ["between", "after"])  # (the metric before the last push, or after)
@pytest.mark.parametrize("order", ["backward", "model"])  # (model: DataParallel holds them all back)
@pytest.mark.parametrize("metric", ["blocking", "async"])
def test_after_crossed_waits_every_later_step_fails_on_every_rank(
    threshold, where, order, metric, monkeypatch
):
    # The last rank reduces a metric alone, between its pushes and synchronize() or after its step,
    # while the others are in their step: crossed waits (a blocking metric) or a step that met another
    # kind of call (an async one), on every rank. Then every later step fails on every rank, sending
    # nothing: which of the ranks' steps pair after it depends on the program, and going on paired a
    # rank's step k with the others' k + 1 (helper-73, helper-77). The steps before are the float64
    # sums of their gradients on every rank.
    monkeypatch.setattr(stall, "CROSSED_S", 0.25)  # (checked sooner: the same check, a quarter of the wait)
    comm = WORLD.Dup()
    shapes = {"w": (40, 3), "b": (40,), "v": (7,)}
    dp = gflow.DataParallel({k: np.zeros(s) for k, s in shapes.items()}, op="sum", threshold_bytes=threshold,
                            comm=comm)  # fmt: skip
    rng = rank_rng(73)
    grads = [{k: random_array(rng, s, np.float64) for k, s in shapes.items()} for _ in range(4)]
    everyone = WORLD.allgather(grads)
    failed, got, last = [], {}, WORLD.rank == LAST
    said = "crossed waits" if metric == "blocking" else "disagree on the collective|another kind of call"

    def reduce_metric():  # (on the last rank only)
        if metric == "blocking":
            gflow.allreduce(np.ones(1), comm=comm)
        else:
            gflow.allreduce_async(np.ones(1), comm=comm).wait()

    for step in range(4):
        pushed = {k: g.copy() for k, g in grads[step].items()}
        try:
            keys = list(reversed(shapes) if order == "backward" else shapes)
            for key in keys:
                if step == 1 and last and key == keys[-1] and where == "between":  # (in model order,
                    reduce_metric()  # the others are still held back) the metric
                dp.push(key, pushed[key])
            dp.synchronize()
            got[step] = pushed
            if step == 1 and last and where == "after":
                reduce_metric()
        except gflow.GflowError as error:
            assert re.search(said, str(error)), error
            failed.append(step)
    assert failed == list(range(2 if where == "after" and not last else 1, 4)), failed
    for step, reduced in got.items():
        for key in shapes:
            want = sum(everyone[r][step][key] for r in range(WORLD.size))
            np.testing.assert_allclose(reduced[key], want, rtol=1e-12, err_msg=f"step {step}, {key}")
    WORLD.Barrier()
