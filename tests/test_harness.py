"""The test harness itself: a deadlocked multi-rank test must fail within seconds, not hang CI."""

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def test_a_deadlock_fails_within_the_deadline():
    env = dict(os.environ, GFLOW_TEST_DEADLINE="5")
    case = os.path.join(HERE, "deadlock_case.py") + "::test_one_rank_never_calls"
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", case],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    elapsed = time.monotonic() - start
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "Timeout" in output or "most recent call first" in output, output  # the watchdog's stack dump
    assert elapsed < 45, f"took {elapsed:.0f} s to fail"
