"""`python -m gflow bench` (gflow/tools/benchmark.py): the nccl-tests style table, its check against MPI's own
Allreduce (which must be able to fail), and its refusals of bad input."""

import argparse
import io
import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import WORLD, random_array, rank_rng

from gflow.tools import benchmark


def bench_args(**overrides):
    parser = argparse.ArgumentParser()
    benchmark.add_arguments(parser)
    args = parser.parse_args(["-b", "4K", "-e", "1M", "-f", "16", "-n", "3", "-w", "1", "--check"])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


@pytest.mark.parallel([1, 2, 3])
@pytest.mark.parametrize(
    "settings",
    [{}, {"op": "mean", "compression": "fp16"}, {"dtype": "int64", "op": "max"}, {"algorithm": "ring"}],
)
def test_bench_prints_the_table_and_checks_every_size(tmp_path, settings):
    path = tmp_path / "bench.json" if WORLD.rank == 0 else None
    out = io.StringIO()
    status = benchmark.run(bench_args(json=path and str(path), **settings), out=out)
    assert status == 0
    if WORLD.rank:
        assert out.getvalue() == ""  # one table, from rank 0
        return
    text = out.getvalue()
    assert f"allreduce on {WORLD.size} rank(s)" in text and "every result matched" in text
    rows = [line.split() for line in text.splitlines() if not line.startswith("#")]
    assert [int(r[0]) for r in rows] == [4096, 65536, 1048576]
    assert all(r[-1] == "0" for r in rows)  # #wrong
    report = json.loads(path.read_text())
    assert [r["bytes"] for r in report["rows"]] == [4096, 65536, 1048576]
    assert all(r["time_us"] > 0 and r["busbw_GBps"] > 0 for r in report["rows"])


@pytest.mark.parallel([2, 3])
def test_the_check_counts_wrong_and_diverging_results():
    x = random_array(rank_rng(3), 1000, np.float32)
    exact = np.sum(WORLD.allgather(x.astype(np.float64)), axis=0).astype(np.float32)
    assert benchmark._wrong_elements(WORLD, x, exact.copy(), "sum", np.float32, None) == 0
    off = exact.copy()
    if WORLD.rank == 1:
        off[[5, 17]] += 1.0  # wrong on one rank only: every rank reports it
    assert benchmark._wrong_elements(WORLD, x, off, "sum", np.float32, None) == x.size  # and not the same
    off = exact.copy()
    off[[5, 17, 99]] = np.nan
    assert benchmark._wrong_elements(WORLD, x, off, "sum", np.float32, None) == 3


def test_sizes_always_grow():
    assert benchmark.sizes_from(1, 100, 1.5)[:4] == [1, 2, 3, 4]
    sizes = benchmark.sizes_from(4096, 65536, 1.0001)
    assert sizes == sorted(set(sizes)) and sizes[-1] <= 65536


def test_one_rank_with_bad_arguments_stops_every_rank():
    common = ["-b", "4K", "-e", "8K", "-w", "0"]
    python = [sys.executable, "-m", "gflow", "bench", *common]
    done = subprocess.run(
        ["mpiexec", "-n", "1", *python, "-n", "2", ":", "-n", "1", *python, "-n", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "-n must be" in done.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dtype", "int32", "--compression", "fp16"], "floating dtype"),
        (["--dtype", "int32", "--op", "mean"], "mean"),
        (["-b", "1M", "-e", "4K"], "must be at least -b"),
        (["-b", "0"], "positive"),
        (["-n", "0"], "-n must be"),
        (["--algorithm", "recursive_doubling", "-e", "64M"], "small_message_bytes"),
        (["--op", "prod"], "invalid choice"),
        # helper-48: these ended in a traceback, ran one size, or failed after every size had run
        (["-b", "inf"], "at most 1T"),
        (["-b", "1e30"], "at most 1T"),
        (["-f", "nan"], "-f must be a number above 1"),
        (["-f", "inf"], "-f must be a number above 1"),
        (["--json", "/nonexistent/x.json"], "expected a file in an existing folder"),
        (["--plot", "/nonexistent/x.png"], "expected a file in an existing folder"),
        (["demo", "--sizes", "1X"], "not a size"),
        (["demo", "--sizes", "4K,"], "not a size"),
        (["demo", "--sizes", "1e30"], "at most 1T"),
        (["demo", "--repeats", "0"], "a whole number >= 1"),
    ],
)
def test_bench_refuses_bad_input_with_usage(args, message):
    command = args if args[0] == "demo" else ["bench", *args]
    done = subprocess.run(
        [sys.executable, "-m", "gflow", *command], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "usage:" in done.stderr and message in done.stderr, done.stderr
