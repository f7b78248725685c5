"""When a rank fails (gflow/runtime/failures.py, stall.goodbye): an uncaught exception on one rank ends the
whole job within seconds, naming the rank; a rank that leaves makes the others raise GflowError
naming it. Each case is a real job under mpiexec (tests/failure_case.py), bounded in time."""

import os
import re
import subprocess
import sys
import time

import pytest
from helpers import MPICH_TCP, skip_unless_mpich
from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))
FAILING = 1  # the rank that fails, in every world size
ENDS_WITHIN_S = 5.0  # the target: the job ends this soon after the failure


def run_job(mode: str, size: int, **env):
    """Run failure_case.py; return (exit status, output, seconds from the failure to the job's end)."""
    environment = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", **env)
    case = os.path.join(HERE, "failure_case.py")
    args = ["mpiexec", "-n", str(size), sys.executable, case, mode, str(FAILING)]
    try:
        done = subprocess.run(args, env=environment, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{mode} at p={size}: the job hung (still running after 60 s): {exc.stdout} {exc.stderr}")
    ended = time.time()
    output = done.stdout + done.stderr
    failed_at = re.search(r"rank \d+ failing at ([0-9.]+)", output)
    after = ended - float(failed_at.group(1)) if failed_at else None
    return done.returncode, output, after


SIZES = [2, 3, 4]


def assert_no_segment_left(output: str) -> None:
    """MPICH's shared-memory file of the job (failure_case.py prints it) is gone after its abort."""
    if "MPICH" not in MPI.Get_library_version():
        return  # (Open MPI's launcher removes its own)
    printed = re.search(r"segments: (.*)", output)
    assert printed and printed.group(1).split(), output
    left = [path for path in printed.group(1).split() if os.path.exists(path)]
    assert not left, f"an aborted job left {left} in /dev/shm"


def every_mode_at_2_and_3(modes, at_4):
    """(mode, size): every mode at 2 and 3 ranks (3: not a power of two, and a rank that is neither
    the failing one nor rank 0), and `at_4` at 4 too: each case is a real job of a few seconds, and a
    fourth rank adds little to what a third showed."""
    return [(m, s) for s in (2, 3) for m in modes] + [(m, 4) for m in at_4]


@pytest.mark.parametrize(
    ("mode", "size"), every_mode_at_2_and_3(["raise", "raise-async", "raise-lazy"], ["raise"])
)
def test_an_uncaught_exception_ends_the_job_naming_the_rank(mode, size):
    status, output, after = run_job(mode, size)
    assert status != 0, output
    named = f"gflow rank {FAILING}: uncaught ValueError: a bad batch on rank {FAILING}; ending the job with"
    assert f"{named} MPI_Abort" in output, output
    assert "Traceback" in output, output  # Python's own report comes first
    assert after is not None and after < ENDS_WITHIN_S, (after, output)
    assert "finished" not in output, output
    assert_no_segment_left(output)


LEAVING = ["exit", "exit-early", "exit-inside", "exit-before-async", "exit-before-blocking", "exit-lazy"]
LEAVING += ["exit-in-flush"]
LEAVING += ["exit-in-join", "exit-in-join-over-mpi"]  # (the joined ranks hung: serve's waits were unwatched)
LEAVING += ["exit-after-refused-in-join"]  # (the joined ranks hung: its only channel had been dropped)
LEAVING += ["exit-before-first-async", "exit-before-first-blocking"]  # (both hung: no goodbye on it)


@pytest.mark.parametrize(("mode", "size"), every_mode_at_2_and_3(LEAVING, ["exit", "exit-in-flush"]))
def test_a_rank_that_leaves_is_named_by_the_others(mode, size):
    status, output, after = run_job(mode, size)
    assert status != 0, output  # the others' GflowError is uncaught: it ends the job
    others = [r for r in range(size) if r != FAILING]
    pattern = rf"gflow rank (\d+): uncaught GflowError: rank {FAILING} has left the job \(its process exited"
    named_by = {int(r) for r in re.findall(pattern, output)}
    assert named_by and named_by <= set(others), output
    assert after is not None and after < ENDS_WITHIN_S, (after, output)
    assert_no_segment_left(output)
    if mode == "exit-in-flush":  # what it pushed before leaving is reduced: the others' step succeeds
        assert all(f"rank {r} finished the step" in output for r in others), output


@pytest.mark.parametrize("size", [2, 3])
def test_a_program_that_catches_the_departure_ends_quietly(size):
    # helper-49: the joined ranks named the rank that left, but at exit freeing the fresh background
    # context they had made for it waited for its duplicate, raised "... left the job" again inside
    # the exit handler (naming a rank that had ended normally) and stopped it there.
    status, output, after = run_job("exit-after-refused-in-join-caught", size)
    others = [r for r in range(size) if r != FAILING]
    assert status == 0, output
    for r in others:
        assert f"rank {r} caught: rank {FAILING} has left the job" in output, output
    assert "Exception ignored" not in output and "Traceback" not in output, output
    assert after is not None and after < ENDS_WITHIN_S, (after, output)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("mode", ["retry-async", "retry-lazy"])
def test_a_retry_after_a_rank_left_fails_again(mode, size):
    status, output, _ = run_job(mode, size)
    assert status == 0, output  # every attempt failed (not hung), then the case ends normally
    for r in range(size):
        if r != FAILING:
            for attempt in range(3):
                match = re.search(rf"\[rank {r} attempt {attempt}: ([0-9.]+) s, named True\]", output)
                assert match and float(match.group(1)) < ENDS_WITHIN_S, (r, attempt, output)


@pytest.mark.parametrize("size", SIZES)
def test_an_exit_with_an_async_allreduce_in_flight_finishes_it_first(size):
    status, output, _ = run_job("exit-async", size)
    assert status == 0, output
    assert all(f"rank {r} finished" in output for r in range(size) if r != FAILING), output
    assert "left the job" not in output and "no wait() collected" not in output, output


@pytest.mark.parametrize(
    ("mode", "size"), [("exit-unwaited", s) for s in SIZES] + [("exit-unwaited-failed", 3)]
)
def test_async_work_that_an_exit_loses_is_said(mode, size):
    """Said whether the job was still in flight at exit or had failed before it (the others' goodbye
    came first: in CI once, and then the line was missing)."""
    status, output, _ = run_job(mode, size)
    assert status == 0, output
    lost = re.findall(r"gflow rank (\d+): the program ended with async work that no wait", output)
    assert lost == [str(FAILING)], output  # that rank only, once
    assert "allreduce: GflowError" in output and "left the job" in output, output


@pytest.mark.parametrize("size", SIZES)
def test_ranks_that_end_at_different_times_are_not_taken_for_failures(size):
    status, output, _ = run_job("ok", size)
    assert status == 0, output
    assert all(f"rank {r} finished" in output for r in range(size)), output
    assert "left the job" not in output and "MPI_Abort" not in output, output


@pytest.mark.parametrize("size", [2, 3])
def test_a_program_that_calls_mpi_finalize_itself_ends_cleanly(size):
    """Ranks that call MPI.Finalize() themselves, at different times: MPICH's waits there for the
    others', and the stall inspector's next question met it ("after finalizing", exit status 1:
    helper-88). gflow's exit work now runs as MPI_Finalize begins (lifecycle.py), the inspector
    stopped."""
    status, output, _ = run_job("ok-finalize", size)
    assert status == 0, output
    assert all(f"rank {r} finished" in output for r in range(size)), output
    assert "finaliz" not in output.lower() and "left the job" not in output, output


@pytest.mark.parametrize("size", [2, 3])
def test_ranks_that_end_at_different_times_exit_over_mpichs_tcp_transport(size):
    """The same over MPICH's TCP transport: the rank that ended last hung in its goodbye to the
    others, which had left (stall._processes_gone); in the suite, now and then, a job whose ranks
    left a second apart (test_shared_slots.py's ranks on nodes of their own)."""
    skip_unless_mpich()
    status, output, _ = run_job("ok", size, **MPICH_TCP)
    assert status == 0, output
    assert all(f"rank {r} finished" in output for r in range(size)), output
    assert "left the job" not in output and "MPI_Abort" not in output, output


@pytest.mark.parametrize(
    "mode", ["exit-before-first-async", "exit-before-first-blocking", "exit-after-freeing", "exit-inside"]
)
def test_a_rank_that_leaves_is_named_by_the_others_over_mpichs_tcp_transport(mode):
    """A rank that left before the others' first call on a communicator it never used: their
    duplicate of it, posted there, never returned over TCP (its first send went to the process that
    had exited; nothing, stall abort included, could end the job). Now the goodbye heard on another
    communicator refuses the call before anything is posted (stall.refuse_if_gone). So too for a
    later call on a communicator it freed before it left (stall._raise_left_unsaid; helper-88)."""
    skip_unless_mpich()
    status, output, after = run_job(mode, 3, **MPICH_TCP)
    assert status != 0, output
    pattern = rf"gflow rank (\d+): uncaught GflowError: rank {FAILING} has left the job \(its process exited"
    named_by = {int(r) for r in re.findall(pattern, output)}  # (the first to abort may end the other)
    assert named_by and named_by <= {0, 2}, output
    assert after is not None and after < ENDS_WITHIN_S, (after, output)


def test_with_the_switch_off_the_rank_exits_and_the_others_name_it():
    status, output, after = run_job("raise", 3, GFLOW_ABORT_ON_EXCEPTION="0")
    assert status != 0, output
    assert "ValueError: a bad batch on rank 1" in output and "uncaught ValueError" not in output, output
    assert "uncaught GflowError: rank 1 has left the job" not in output  # no abort at all ...
    assert re.search(r"GflowError: rank 1 has left the job", output), output  # ... but the others raise
    assert after is not None and after < ENDS_WITHIN_S, (after, output)


def test_an_unknown_switch_value_warns_and_keeps_the_default():
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", "import gflow; print(gflow.config.abort_on_exception)"],
        env=dict(os.environ, GFLOW_ABORT_ON_EXCEPTION="maybe"), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "GFLOW_ABORT_ON_EXCEPTION" in done.stderr and "'maybe'" in done.stderr, done.stderr
    assert done.stdout.strip() == "True", done.stdout


def test_a_caught_exception_is_not_fatal():
    script = (
        "import sys, numpy as np, gflow\n"
        "from mpi4py import MPI\n"
        "x = np.ones(1000, np.float32)\n"
        "try:\n"
        "    gflow.allreduce(x[: 1000 - MPI.COMM_WORLD.rank])\n"
        "except gflow.MismatchError as exc:\n"
        "    handled = type(exc).__name__\n"
        "sys.stdout.write(f'[handled {handled}, then sum {gflow.allreduce(x)[0]}]\\n')\n"
    )  # one write per rank: the launcher interleaves separate ones
    done = subprocess.run(
        ["mpiexec", "-n", "3", sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("[handled MismatchError, then sum 3.0]") == 3, done.stdout


INTERRUPTED_FIRST_CALL = """
import _thread, sys, threading, time
import numpy as np
from mpi4py import MPI
import gflow

then = sys.argv[1]
world = MPI.COMM_WORLD
rank = world.rank
rng = np.random.default_rng([rank, int(time.time())])
x = rng.standard_normal(7)  # (small: the retry once took the fast lane, which skipped the first exchange)
y = rng.standard_normal(300 * 1024 // 4).astype(np.float32)
want = [np.empty_like(x), np.empty_like(y)]
world.Allreduce(x, want[0])  # (MPI's own, before gflow's first collective on WORLD)
world.Allreduce(y, want[1])
if rank == 2:
    time.sleep(3)  # late to the first collective: rank 1 is still waiting for the duplicates then
if rank == 1:
    threading.Timer(1.0, _thread.interrupt_main).start()
try:
    if then == "join" and rank == 1:
        gflow.join()  # (its first call: the others' allreduces wait for it)
    got = [gflow.allreduce(x), gflow.allreduce(y)]
except KeyboardInterrupt:
    if then == "join":  # (join's serving threads were given up: refused, the others told it left)
        try:
            gflow.join()
        except gflow.GflowError as exc:
            print(f"[{rank} refused: {exc}]", flush=True)
        sys.exit(0)
    if then == "leave":
        sys.exit(0)  # (it leaves; the others wait in the first collective's making of duplicates)
    got = [gflow.allreduce(x), gflow.allreduce(y)]  # the retry is the first collective: it pairs
except gflow.GflowError as exc:
    print(f"[{rank} told: {exc}]", flush=True)
    sys.exit(0)
close = all(np.allclose(g, w, rtol=1e-5, atol=1e-5) for g, w in zip(got, want))
print(f"[{rank} {'matches' if close else 'DIFFERS from'} MPI's allreduce]", flush=True)
"""


@pytest.mark.parametrize("size", [3, 4])
@pytest.mark.parametrize("then", ["retry", "leave", "join"])
def test_a_rank_interrupted_in_the_first_collectives_making_may_retry_or_leave(then, size):
    """Ctrl-C on one rank while the first collective on a communicator waits for a late rank to make
    gflow's duplicates. Nothing of that call was sent (no duplicate to send it on), so its retry is
    the first collective and pairs with the others' (helper-87 found it refused, the others left
    waiting); a rank that leaves instead is named by the others, still in that first collective.
    They waited forever before (helper-31): the goodbye goes on the monitor duplicate, made after
    the first, which the leaving rank never had (context.py, finish_duplicates, at exit). join() as
    that first call is refused after the interrupt (its serving threads were given up), as collective
    #1 (it said #0, and its goodbye lost the count: helper-88)."""
    environment = dict(
        os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", GFLOW_ABORT_ON_EXCEPTION="0"
    )
    args = ["mpiexec", "-n", str(size), sys.executable, "-c", INTERRUPTED_FIRST_CALL, then]
    try:
        done = subprocess.run(args, env=environment, capture_output=True, text=True, timeout=45)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"p={size}: the job hung (still running after 45 s): {exc.stdout} {exc.stderr}")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    if then == "retry":
        assert output.count("matches MPI's allreduce]") == size, output
    elif then == "join":
        assert "[1 refused: collective #1 on this communicator was interrupted" in output, output
        told = "told: rank 1 has left the job (its process exited: rank 1 after #0)"
        assert output.count(told) == size - 1, output
    else:
        assert output.count("told: rank 1 has left the job") == size - 1, output
