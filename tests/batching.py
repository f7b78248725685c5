"""Run the multi-rank tests of one world size, from every test file, in a single `mpiexec`, not one per test.

mpi-pytest starts `mpiexec -n N pytest <one test>` for every multi-rank test. Each start imports pytest,
NumPy, Numba (and torch) on every rank: 5-12 s on 2 cores, which was most of the suite's half hour. Here,
when the first test of a world size comes up, the parent starts one `mpiexec` for every test of that size
not yet run (with one per file and size, the suite took 23:52 here; with one per size, 12:28). Every
child rank writes a line per test phase to its own report file; the parent then gives each test the
verdict of all ranks together: passed only if every rank passed, failed with each failing rank's report,
skipped when every rank skipped (mpi-pytest counted a child's skip as a pass).

A test that kills its batch (the deadlock watchdog, a crash) fails with the batch's output; the tests
after it run again in a fresh batch. A batch that crashes or hangs after its last test (at exit:
MPI_Finalize, atexit handlers) fails its last test. `@pytest.mark.isolated` keeps a test in its own
`mpiexec` (mpi-pytest's way, judged by the exit status), and GFLOW_TEST_BATCH=0 turns batching off.

The tests of a batch share their processes, as under `mpiexec -n N pytest tests/`: a test must not depend
on state a fresh process has (a warn-once flag: monkeypatch it; or mark the test isolated).
"""

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest

CHILD_FLAG = "_PYTEST_MPI_CHILD_PROCESS"  # mpi-pytest's: children run their tests unmodified
REPORT_DIR = "GFLOW_TEST_REPORT_DIR"
IN_MPI_CHILD = CHILD_FLAG in os.environ
ENABLED = os.environ.get("GFLOW_TEST_BATCH", "1") != "0"
# GFLOW_TEST_MAX_RANKS=N deselects (not skips) the multi-rank tests of more than N ranks: CI's second
# MPI (.ci/openmpi) runs 2 and 3 ranks, the MPICH run every size.
MAX_RANKS = int(os.environ.get("GFLOW_TEST_MAX_RANKS", "0")) or None
OUTPUT_TAIL = 20000  # characters of a dead batch's output shown with the test it died in

_verdicts = {}  # node id -> (outcome, text), filled by a batch in the parent
_compiled_ahead = False  # `gflow compile` ran before the first batch
_batch_seconds = []  # (seconds, files, world size, tests): the end of the run lists the slowest
_test_seconds = {}  # node id -> its call's seconds in a batch, on its slowest rank


def _world_size(item) -> int:
    from pytest_mpi.plugin import _extract_nprocs_for_single_test

    return _extract_nprocs_for_single_test(item) if item.get_closest_marker("parallel") else 1


def _batched(item) -> bool:
    if IN_MPI_CHILD or not ENABLED or item.get_closest_marker("isolated"):
        return False
    from mpi4py import MPI

    return MPI.COMM_WORLD.size == 1 and _world_size(item) > 1


def _item_budget(item) -> float:
    marker = item.get_closest_marker("timeout")
    return float(marker.args[0]) if marker and marker.args else float(item.config.getini("timeout") or 120)


def pytest_configure(config):
    config.addinivalue_line("markers", "isolated: run this multi-rank test in its own mpiexec")


def pytest_collection_modifyitems(config, items):
    if MAX_RANKS is None or IN_MPI_CHILD:
        return
    over = [it for it in items if _world_size(it) > MAX_RANKS]
    if over:
        config.hook.pytest_deselected(items=over)
        items[:] = [it for it in items if _world_size(it) <= MAX_RANKS]


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    # Outermost, so the batch runs before pytest-timeout arms its per-test timer.
    if _batched(item) and item.nodeid not in _verdicts:
        _run_batch(item)
    yield


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if not _batched(pyfuncitem):
        return None
    outcome, text = _verdicts.pop(pyfuncitem.nodeid)
    if outcome == "skipped":
        pytest.skip(text)
    if outcome == "failed":
        pytest.fail(text, pytrace=False)
    return True


def _compile_ahead(config) -> None:
    """Once, before the first batch: `gflow compile`, its processes sharing the work. Otherwise
    every rank of a batch compiles the loops its first tests use at once while its peers wait on
    it: from a cold cache the 4-rank batch took 430 s here, from a warm one 143 s. A failure here
    is shown and the tests go on (each compiles what it needs). GFLOW_TEST_COMPILE_AHEAD=0: not
    (test_harness.py's own pytest runs)."""
    global _compiled_ahead
    if _compiled_ahead or os.environ.get("GFLOW_TEST_COMPILE_AHEAD") == "0":
        return
    _compiled_ahead = True
    processes = str(max(1, min(4, os.cpu_count() or 1)))
    cmd = ["mpiexec", "-n", processes, sys.executable, "-m", "gflow", "compile"]
    started = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=config.rootpath, capture_output=True, text=True, timeout=900)
        status, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        status, output = "killed after 900 s", _text(e.stdout) + _text(e.stderr)
    except OSError as e:  # no mpiexec on PATH: the batches then fail with the same error, each
        status, output = "not started", str(e)
    _batch_seconds.append((time.monotonic() - started, "gflow compile", int(processes), 0))
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if status != 0 and reporter is not None:
        reporter.write_line(f"gflow compile failed ({status}):\n{output}")


def _run_batch(first):
    _compile_ahead(first.config)
    size = _world_size(first)
    items = first.session.items
    group = [
        it
        for it in items[items.index(first) :]
        if _batched(it) and _world_size(it) == size and it.nodeid not in _verdicts
    ]
    config = first.config
    args = [str(config.rootpath / it.nodeid) for it in group]
    args += ["--rootdir", str(config.rootpath)] + (["-c", str(config.inipath)] if config.inipath else [])
    # --capture=sys: the watchdog's stack dump and MPI's own messages reach the batch's output.
    quiet = ["-q", "--no-header", "--no-summary", "--disable-warnings", "--tb=short", "--capture=sys"]
    with tempfile.TemporaryDirectory(prefix="gflow-batch-") as reports:
        env = dict(os.environ, **{CHILD_FLAG: "1", REPORT_DIR: reports})
        pytest_cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--runxfail", *quiet, *args]
        cmd = ["mpiexec", "-n", str(size), *pytest_cmd]
        budget = sum(_item_budget(it) for it in group) + 60
        started = time.monotonic()
        try:
            done = subprocess.run(
                cmd, env=env, cwd=first.config.rootpath, capture_output=True, text=True, timeout=budget
            )
            status, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            status = f"killed after {budget:.0f} s"
            output = _text(e.stdout) + _text(e.stderr)
        files = sorted({it.path.name for it in group})
        where = files[0] if len(files) == 1 else f"{len(files)} files from {first.path.name}"
        _batch_seconds.append((time.monotonic() - started, where, size, len(group)))
        _judge(group, size, _read_reports(reports), status, output)


def pytest_terminal_summary(terminalreporter):
    """The slowest batches: the per-test durations pytest lists leave their time out."""
    if not _batch_seconds:
        return
    total = sum(seconds for seconds, *_ in _batch_seconds)
    terminalreporter.write_sep("=", f"slowest multi-rank batches ({total:.0f} s in {len(_batch_seconds)})")
    for seconds, name, size, count in sorted(_batch_seconds, reverse=True)[:25]:
        what = f"at {size} ranks ({count} tests)" if count else f"on {size} processes, before the first batch"
        terminalreporter.write_line(f"{seconds:7.1f}s  {name} {what}")
    terminalreporter.write_sep("=", "slowest tests inside them (the call, on the slowest rank)")
    for node, seconds in sorted(_test_seconds.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{seconds:7.1f}s  {node}")


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _read_reports(folder):
    """{rank: {node id: {phase: (outcome, text)}}} from the children's report files."""
    ranks = {}
    for name in os.listdir(folder):
        rank = int(name.split(".")[0])
        tests = ranks.setdefault(rank, {})
        with open(os.path.join(folder, name)) as f:
            for line in f:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # a rank killed mid-line
                    continue
                tests.setdefault(entry["id"], {})[entry["when"]] = (entry["outcome"], entry["text"])
                if entry["when"] == "call":
                    seconds = max(_test_seconds.get(entry["id"], 0.0), entry.get("seconds", 0.0))
                    _test_seconds[entry["id"]] = seconds
    return ranks


def _judge(group, size, ranks, status, output):
    any_failed = False
    for item in group:
        phases = [ranks.get(rank, {}).get(item.nodeid, {}) for rank in range(size)]
        if not all("teardown" in p for p in phases):
            # The batch ended inside this test: it fails; the tests after it go to a fresh batch.
            tail = output[-OUTPUT_TAIL:]
            _verdicts[item.nodeid] = ("failed", f"the batch's mpiexec ended in this test ({status}):\n{tail}")
            return
        failed = [(r, text) for r, p in enumerate(phases) for res, text in p.values() if res == "failed"]
        skipped = [p.get("setup", ("", ""))[1] or p.get("call", ("", ""))[1] for p in phases if _skipped(p)]
        any_failed |= bool(failed)
        if failed:
            shown = "\n".join(f"--- rank {r} ---\n{text}" for r, text in failed[:size])
            ranks_failed = sorted({r for r, _ in failed})
            _verdicts[item.nodeid] = ("failed", f"failed on rank(s) {ranks_failed} of {size}:\n{shown}")
        elif len(skipped) == size:
            _verdicts[item.nodeid] = ("skipped", skipped[0])
        elif skipped:
            text = f"skipped on {len(skipped)} of {size} ranks only: {skipped[0]}"
            _verdicts[item.nodeid] = ("failed", text)
        else:
            _verdicts[item.nodeid] = ("passed", "")
    if status != 0 and not (status == 1 and any_failed):  # every test reported, yet the batch failed
        tail = output[-OUTPUT_TAIL:]
        last = group[-1].nodeid
        _verdicts[last] = (
            "failed",
            f"every test of the batch reported, then its mpiexec ended ({status}):\n{tail}",
        )


def _skipped(phases) -> bool:
    return any(outcome == "skipped" for outcome, _ in phases.values())


# In the children: one JSON line per test phase, flushed at once so a rank that dies leaves what it did.
_report_file = None


def pytest_runtest_logreport(report):
    global _report_file
    folder = os.environ.get(REPORT_DIR)
    if not IN_MPI_CHILD or not folder:
        return
    if _report_file is None:
        from mpi4py import MPI

        _report_file = open(os.path.join(folder, f"{MPI.COMM_WORLD.rank}.jsonl"), "a")
    if report.skipped:
        text = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    elif report.failed:
        text = report.longreprtext
        for title, content in report.sections:
            text += f"\n--- {title} ---\n{content}"
    else:
        text = ""
    entry = {"id": report.nodeid, "when": report.when, "outcome": report.outcome, "text": text}
    entry["seconds"] = report.duration
    _report_file.write(json.dumps(entry) + "\n")
    _report_file.flush()
