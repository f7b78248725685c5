"""gflow.torch's runtime calls when ranks do not keep step: barrier() waits as gflow's collectives do
(a late rank is named by the stall inspector, GFLOW_STALL_ABORT_S ends the job, a rank that left makes
the others raise GflowError), is_homogeneous() is a local query, and init(comm=[ranks]) with different
lists on different ranks raises ValueError on every rank. The jobs that must end or could hang run
under mpiexec (tests/torch_runtime_case.py), each rank with its own watchdog."""

import os
import re
import subprocess
import sys
import time

import pytest
import torch
from helpers import WORLD

import gflow
import gflow.torch as hvd

torch.set_num_threads(1)
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _init():
    hvd.init()


def run_case(size: int, *args, **env):
    """Run torch_runtime_case.py at `size` ranks; return (exit status, output)."""
    environment = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", **env)
    command = ["mpiexec", "-n", str(size), sys.executable, os.path.join(HERE, "torch_runtime_case.py"), *args]
    try:  # (each rank's own watchdog ends a hang 20 s after torch is loaded; this is the backstop)
        done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{args} at p={size}: the job hung: {exc.stdout} {exc.stderr}")
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parallel([2, 3])
def test_a_rank_late_for_barrier_is_named(monkeypatch, capsys):
    monkeypatch.setattr(gflow.config, "stall_warning_s", 1.0)
    comm = WORLD.Dup()
    hvd.init(comm=comm)  # a communicator new to gflow
    late = WORLD.size - 1
    errs, waits = [], []
    for _ in range(2):  # each late arrival is reported
        WORLD.barrier()
        if WORLD.rank == late:
            time.sleep(3.5)
        start = time.monotonic()
        hvd.barrier()
        waits.append(time.monotonic() - start)
        errs.append(capsys.readouterr().err)
    hvd.init()
    comm.Free()
    for episode, (waited, err) in enumerate(zip(waits, errs, strict=True)):
        assert waited > 2.5 or WORLD.rank == late, waited
        # one line per stall, from one of the waiting ranks (gflow/runtime/stall.py)
        lines = [line for text in WORLD.allgather(err) for line in text.splitlines() if ": waited" in line]
        assert len(lines) == 1 and not lines[0].startswith(f"gflow rank {late}:"), (episode, lines)
        assert "on thread MainThread" in lines[0], lines  # (a blocking call, as Horovod's)
        assert f"rank {late} has not entered it yet" in lines[0], lines


@pytest.mark.parallel([2, 3])
def test_is_homogeneous_is_answered_alike_everywhere():
    sizes = WORLD.allgather(hvd.local_size())
    assert hvd.is_homogeneous() == (len(set(sizes)) == 1)


@pytest.mark.parametrize("size", [2, 3])
def test_is_homogeneous_asked_on_one_rank_does_not_wait_for_the_others(size):
    status, output = run_case(size, "homogeneous")
    assert status == 0, output
    assert re.search(r"\[rank 0: homogeneous (True|False)\]", output), output
    told = re.search(r"\[rank 0: homogeneous (\w+)\]", output).group(1)
    for r in range(size):
        assert f"[rank {r}: sum {size}, expected homogeneous {told}]" in output, output


@pytest.mark.parametrize("size", [2, 3])
def test_init_with_different_lists_raises_on_every_rank(size):
    status, output = run_case(size, "init-lists")
    assert status == 0, output
    short, full = list(range(size - 1)), list(range(size))
    others = ", ".join(map(str, range(size - 1)))
    some = f"rank {others}" if size == 2 else f"ranks {others}"
    for r in range(size):
        line = re.search(rf"\[rank {r}: ValueError: (.*)\]", output)
        assert line, output
        text = line.group(1)
        assert "every rank of COMM_WORLD must pass the same list" in text, text
        assert f"{some} passed {short}" in text and f"rank {size - 1} passed {full}" in text, text


def test_init_with_a_rank_that_does_not_exist_raises_on_every_rank():
    status, output = run_case(3, "init-bad-rank")
    assert status == 0, output
    for r in range(3):
        line = re.search(rf"\[rank {r}: ValueError: (.*)\]", output)
        assert line, output
        assert "rank 0 passed [0, 8], and 8 is not a rank of COMM_WORLD (3 ranks)" in line.group(1), output
        assert "ranks 1, 2 passed [0, 1, 2]" in line.group(1), output


def test_init_with_another_form_of_comm_on_one_rank_never_hangs():
    """Rank 0 passes None, COMM_WORLD, a range or an array where the others pass the list of every
    rank: the same ranks, so every rank initialises (rank 0 had gone into Split_type while the others
    waited in the list check); a set or a string: ValueError on every rank (rank 0 raised alone)."""
    status, output = run_case(3, "init-odd", "None,WORLD,set,range,str,ndarray")  # one job, in turn
    assert status == 0, output
    for odd in ("None", "WORLD", "range", "ndarray"):
        assert output.count(f"{odd}: initialised on 3 ranks") == 3, (odd, output)
    for odd in ("set", "str"):
        refused = rf"\[rank \d: {odd}: ValueError: [^\]]*rank 0 passed something that is not a list"
        said = re.findall(refused, output)
        assert len(said) == 3, (odd, output)


def test_barrier_raises_naming_a_rank_that_left():
    status, output = run_case(3, "barrier-exit")
    assert status == 0, output
    for r in (0, 2):
        said = rf"\[rank {r}: barrier raised after ([0-9.]+) s, named True, horovod True\]"
        match = re.search(said, output)
        assert match and float(match.group(1)) < 5, output


def test_stall_abort_ends_a_job_waiting_in_barrier():
    start = time.monotonic()
    status, output = run_case(
        3, "barrier-late", "15", GFLOW_STALL_WARNING_S="1", GFLOW_STALL_ABORT_S="3", CASE_DEADLINE_S="30"
    )
    elapsed = time.monotonic() - start
    assert status != 0, output
    assert "rank 2 has not entered it yet" in output, output
    assert "ending the job (GFLOW_STALL_ABORT_S=3)" in output, output
    assert "finished" not in output, output
    assert elapsed < 60, elapsed


@pytest.mark.parametrize("size", [2, 3])
def test_a_metric_reduced_on_rank_0_only_between_backward_and_step_fails_on_every_rank(size):
    """Rank 0 logs its loss with hvd.allreduce between backward() and step() while the others step:
    the blocking call ran on the caller's channel and the optimizer's reduction on the background one,
    and each rank waited for the other forever (item 11). gflow now finds the crossed waits within
    seconds: MismatchError (a HorovodInternalError on the ranks in step()) on every rank, in the first
    step (the background channel still being made) and later, whether the gradients went during
    backward or at step. On every rank, the same metric works."""
    status, output = run_case(size, "metric", CASE_DEADLINE_S="60", CASE_CROSSED_S="0.25")
    assert status == 0, output
    for when in ("first", "third"):
        for threshold in (1, 1 << 20):
            for r in range(size):
                said = rf"\[rank {r}: rank0 {when} {threshold}: raised after ([0-9.]+) s, crossed True, "
                match = re.search(said + r"horovod True\]", output)
                assert match and float(match.group(1)) < 8, (when, threshold, output)
    assert all(f"[rank {r}: all third 1: trained 3 steps]" in output for r in range(size)), output


def test_a_blocking_collective_on_one_rank_inside_a_data_parallel_step_fails_on_every_rank():
    status, output = run_case(3, "kit-metric", CASE_CROSSED_S="0.25")
    assert status == 0, output
    for r in range(3):
        said = re.search(rf"\[rank {r}: raised after ([0-9.]+) s, crossed True\]", output)
        assert said and float(said.group(1)) < 8, output
