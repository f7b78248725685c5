"""The test harness itself: a deadlocked multi-rank test must fail within seconds, not hang CI, and the
batches of multi-rank tests (tests/batching.py) must give each test the verdict of all its ranks."""

import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run_pytest(case: str, *options: str, timeout: float = 120, env=None):
    """pytest on `case` in a process of its own: (its exit status, its output)."""
    # (no `gflow compile` before its first batch: from a cold cache it outlasts these runs' bounds;
    # and its cases are multi-rank, whatever GFLOW_TEST_MAX_RANKS the suite runs under)
    env = dict(os.environ if env is None else env, GFLOW_TEST_COMPILE_AHEAD="0")
    env.pop("GFLOW_TEST_MAX_RANKS", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *options, "-p", "no:cacheprovider", case],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done.returncode, done.stdout + done.stderr


def test_a_deadlock_fails_within_the_deadline():
    env = dict(os.environ, GFLOW_TEST_DEADLINE="5")
    case = os.path.join(HERE, "deadlock_case.py") + "::test_one_rank_never_calls"
    start = time.monotonic()
    status, output = run_pytest(case, timeout=90, env=env)
    elapsed = time.monotonic() - start
    assert status != 0, output
    # The watchdog's own stack dump (faulthandler's "Timeout (0:00:05)!"), not just any failure: a
    # launcher that fails to start, or a subprocess's TimeoutExpired, must not pass for it.
    assert re.search(r"Timeout \(0:00:05(\.\d+)?\)!", output), output  # (after pytest's progress dot)
    assert "most recent call first" in output and "test_one_rank_never_calls" in output, output
    assert elapsed < 45, f"took {elapsed:.0f} s to fail"


def test_batched_tests_get_the_verdict_of_every_rank():
    _, output = run_pytest(os.path.join(HERE, "batch_cases.py"), "-rA")
    assert "2 failed, 3 passed, 1 skipped" in output, output
    assert "failed on rank(s) [1] of 2" in output and "rank 1 disagrees" in output, output
    assert "FAILED tests/batch_cases.py::test_kills_its_batch" in output, output
    assert "PASSED tests/batch_cases.py::test_after_the_dead_batch_still_runs" in output, output
    assert "nothing to test here" in output, output


def test_a_batch_that_fails_after_its_tests_fails_its_last_test():
    """A crash at exit (MPI_Finalize, an atexit handler) must not pass unseen."""
    _, output = run_pytest(os.path.join(HERE, "batch_exit_case.py"), "-rA")
    assert "1 failed, 1 passed" in output, output
    assert "FAILED tests/batch_exit_case.py::test_passes_then_rank_1_fails_at_exit" in output, output
    # mpiexec's status: rank 1's 7, or 9 where Hydra's SIGKILL of rank 0 (after rank 1 left) came first
    ended = re.search(r"every test of the batch reported, then its mpiexec ended \((\d+)\)", output)
    assert ended and ended.group(1) in ("7", "9"), output
