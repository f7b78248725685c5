"""The timeline (gflow/runtime/timeline.py): GFLOW_TIMELINE / start_timeline write a Chrome trace per
rank with
the collectives, their phases, waits, LazyAllreduce's pushes, fires and flush and the engine's jobs;
`gflow timeline merge|plot` read them; an unwritable path warns and training goes on."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import WORLD, assert_close_to_reference, on_all_ranks, random_array, rank_rng

import gflow
from gflow.collectives.dispatch import latency_path_bytes
from gflow.runtime import timeline


def cli(*args):
    """`python -m gflow ...` as a program of its own (not a rank of this job: no PMI_* from mpiexec)."""
    launcher = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "ORTE_", "OPAL_")  # MPICH's and Open MPI's
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    return subprocess.run(
        [sys.executable, "-m", "gflow", *args], capture_output=True, text=True, timeout=120, env=env
    )


def spans(events, name):
    return [e for e in events if e.get("ph") == "X" and e["name"] == name]


@pytest.mark.parallel([1, 2, 3])
def test_a_lazy_step_and_an_allreduce_are_traced(tmp_path):
    folder = WORLD.bcast(str(tmp_path), root=0)
    path = gflow.start_timeline(os.path.join(folder, "trace.json"))
    assert path == (
        os.path.join(folder, "trace.json")
        if WORLD.size == 1
        else os.path.join(folder, f"trace.{WORLD.rank}.json")
    )
    # fp16 halves the bytes on the wire: above the latency path's end (2 MiB at p = 2), the ring
    x = random_array(rank_rng(1), latency_path_bytes(WORLD.size) // 2 + 1000, np.float32)
    y = gflow.allreduce(x, compression="fp16")
    lazy = gflow.LazyAllreduce(threshold_bytes=2**16, op="sum")
    grads = [random_array(rank_rng(2), n, np.float32) for n in (20_000, 30, 50_000)]
    expected = [g.copy() for g in grads]
    for g in grads:
        lazy.push(g)
    lazy.flush()
    gflow.stop_timeline()
    for g, e in zip(grads, expected, strict=True):
        on_all_ranks(lambda g=g, e=e: assert_close_to_reference(g, e, "sum"))
    np.testing.assert_allclose(
        y, np.sum(WORLD.allgather(x.astype(np.float64)), axis=0), rtol=4e-3, atol=0.05 * WORLD.size
    )
    events = timeline.load(path)
    assert all(e["pid"] == WORLD.rank for e in events)
    # The fp16 call, and inside it the allreduce of its float16 wire buffer (half the bytes).
    outer = [e for e in spans(events, "allreduce") if e["args"].get("compression") == "fp16"]
    assert len(outer) == 1 and outer[0]["args"]["bytes"] == x.nbytes
    inner = [e for e in spans(events, "allreduce") if e["args"]["bytes"] == x.nbytes // 2]
    assert (
        inner
        and outer[0]["ts"] <= inner[0]["ts"]
        and inner[0]["ts"] + inner[0]["dur"] <= outer[0]["ts"] + outer[0]["dur"]
    )
    assert spans(events, "fp16 encode") and spans(events, "fp16 decode") and spans(events, "lazy flush")
    filling = [(e["args"]["segment"], e["args"]["tensors"]) for e in spans(events, "segment filling")]
    assert filling == ([(0, 1), (1, 2)] if WORLD.size > 1 else [])  # (alone, pushes need no segment)
    threads = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    if WORLD.size > 1:
        assert {"MainThread", "gflow-engine"} <= threads
        assert spans(events, "gradient step segment 0")
    if WORLD.size == 2:  # (the ring, after its agreement)
        assert spans(events, "agreement") and spans(events, "wait") and spans(events, "reduce-scatter")
    if WORLD.size > 2:  # (one host: the fp16 call and the larger segment reduce in the slots)
        assert len(spans(events, "shared slots")) == 2
    # Every span lies inside the step's wall time, with a non-negative duration.
    assert all(e["dur"] >= 0 for e in events if e.get("ph") == "X")
    WORLD.barrier()
    if WORLD.rank == 0 and WORLD.size > 1:
        files = [os.path.join(folder, f"trace.{r}.json") for r in range(WORLD.size)]
        merged = os.path.join(folder, "merged.json")
        done = cli("timeline", "merge", *files, "-o", merged)
        assert done.returncode == 0, done.stderr
        data = json.load(open(merged))
        assert {e["pid"] for e in data["traceEvents"]} == set(range(WORLD.size))
        png = os.path.join(folder, "step.png")
        done = cli("timeline", "plot", merged, "-o", png)
        assert done.returncode == 0, done.stderr
        assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_off_records_nothing_and_an_unwritable_path_warns(tmp_path):
    assert timeline._active is None and timeline.span("x") is timeline.OFF
    with pytest.warns(RuntimeWarning, match="no timeline"):
        assert gflow.start_timeline(str(tmp_path / "missing" / "trace.json")) is None
    assert timeline._active is None
    y = gflow.allreduce(np.ones(10))  # training goes on
    np.testing.assert_array_equal(y, np.ones(10))


def test_the_environment_variable_starts_it(tmp_path):
    path = tmp_path / "env.json"
    code = "import numpy as np, gflow; gflow.allreduce(np.ones(10))"
    env = dict(os.environ, GFLOW_TIMELINE=str(path))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    events = timeline.load(str(path))
    assert spans(events, "allreduce")


def test_unfinished_and_merged_files_load(tmp_path):
    """A rank that died before writing, or before closing its file, still merges; so does a merged
    trace; a file that is not a trace is named."""
    empty, cut, junk = tmp_path / "empty.json", tmp_path / "cut.json", tmp_path / "junk.json"
    empty.write_text("[\n")
    cut.write_text('[\n{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 1.0, "dur": 2.0},\n')
    junk.write_text("{oops")
    assert timeline.load(str(empty)) == [] and len(timeline.load(str(cut))) == 1
    merged = str(tmp_path / "merged.json")
    assert timeline.merge([str(empty), str(cut)], merged) == 1
    assert timeline.merge([merged], str(tmp_path / "again.json")) == 1
    with pytest.raises(ValueError, match="junk.json"):
        timeline.load(str(junk))
    # helper-48: JSON that is not a trace read as events ("hello": 5 of them), or failed later with
    # an AttributeError or a bare KeyError: 'ts'
    for text in ('"hello"', "[1, 2]", '{"x": 1}', '[{"ph": "X", "name": "a", "pid": 1, "tid": 1}]'):
        junk.write_text(text)
        with pytest.raises(ValueError, match="junk.json: not a gflow timeline"):
            timeline.load(str(junk))
    junk.write_bytes(b"\x89PNG\r\n\x1a\n")  # helper-56: a plot passed to merge ("'utf-8' codec can't ...")
    with pytest.raises(ValueError, match="junk.json: not a gflow timeline \\(not text"):
        timeline.load(str(junk))
    with pytest.warns(RuntimeWarning, match="no timeline"):
        assert gflow.start_timeline(str(tmp_path / "t{rank}{step}.json")) is None


def test_bad_timeline_commands_exit_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"ph": "M", "name": "x", "pid": 0, "tid": 0}]')
    done = subprocess.run(
        [sys.executable, "-m", "gflow", "timeline", "plot", str(bad), "-o", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "no spans" in done.stderr
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gflow",
            "timeline",
            "merge",
            str(tmp_path / "none.json"),
            "-o",
            str(tmp_path / "m.json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "usage:" in done.stderr
