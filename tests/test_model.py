"""The cost model (gflow/tools/cost_model.py) and its command line: calibrate, predict, and refuse
bad input."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import WORLD

import gflow
from gflow.tools import cost_model as model

CAL = model.Calibration()


@pytest.mark.parallel([1, 2, 3])
def test_a_node_has_the_cores_its_ranks_may_run_on(monkeypatch):
    """helper-48: calibrate counted the machine's cores, not those the job may use (a job bound to 2
    of 16 cores ran as if uncrowded): the union of the node's ranks' affinities counts."""
    node = list(range(WORLD.size))
    monkeypatch.setattr(model.os, "sched_getaffinity", lambda pid: {100 + WORLD.rank % 2}, raising=False)
    assert model._cores_of(WORLD, node) == min(WORLD.size, 2)
    monkeypatch.setattr(model.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert model._cores_of(WORLD, node) == 5
    assert model._cores_of(WORLD, [WORLD.rank]) == 5


def test_allreduce_time_follows_the_algorithms():
    mb = 2**20
    ring = [model.allreduce_time(n, 4, algorithm="ring", calibration=CAL) for n in (mb, 4 * mb, 16 * mb)]
    assert ring[0] < ring[1] < ring[2]
    # Across nodes the bandwidth term of the flat ring is 2(p-1)/p, the hierarchy's 2(m-1)/m: with the
    # latencies off, 64 MB on 8 ranks in 2 nodes of 4 must come out 1.75 / 1.0 faster.
    pure = model.Calibration(
        alpha_inter=0, py_step=0, gamma=1e-15, copy=1e-15, alpha_intra=0, beta_intra=1e-15
    )
    flat = model.allreduce_time(64 * mb, 8, algorithm="ring", ranks_per_node=4, calibration=pure)
    hier = model.allreduce_time(64 * mb, 8, algorithm="hierarchical", ranks_per_node=4, calibration=pure)
    assert flat / hier == pytest.approx(1.75, rel=0.02)
    # fp16 halves the bytes on the wire (and adds the codec, zero here).
    pure.codec = 0
    fp16 = model.allreduce_time(
        64 * mb, 8, algorithm="ring", ranks_per_node=4, compression="fp16", calibration=pure
    )
    assert fp16 == pytest.approx(flat / 2, rel=0.02)
    # The Python cost per step is what the hierarchy saves at 512 ranks.
    slow = model.cluster(CAL, 56e9, 5e-6, 8)
    steps = model.allreduce_time(4096 * 128, 512, algorithm="ring", ranks_per_node=8, calibration=slow)
    assert steps > 2 * 511 * CAL.py_step
    assert (
        model.allreduce_time(4096 * 128, 512, algorithm="hierarchical", ranks_per_node=8, calibration=slow)
        < steps / 3
    )


def test_recursive_doubling_rounds_across_nodes_share_the_link():
    # Only the link costs here. 16 ranks: in nodes of 8, one round crosses, with all 8 ranks of a node
    # sending their whole message over its link at once; in nodes of 1, all four rounds cross, one flow
    # each. (The review's case: a 4 MiB call at 512 ranks, 8 per node, modelled with one flow per link.)
    nbytes, beta = 64 * 2**10, 1e-9
    links_only = model.Calibration(
        alpha_inter=0, beta_inter=beta, alpha_intra=0, beta_intra=0, gamma=0, rd_step=0, py_call=0
    )
    rd = dict(algorithm="recursive_doubling", calibration=links_only)
    assert model.allreduce_time(nbytes, 16, ranks_per_node=8, **rd) == pytest.approx(8 * nbytes * beta)
    assert model.allreduce_time(nbytes, 16, ranks_per_node=1, **rd) == pytest.approx(4 * nbytes * beta)
    # helper-48: sizes that are not powers of two were costed ceil(log2 p) + 2 rounds, log2(k) of them
    # inside a node, every other one with all k ranks crossing. gflow's schedule (rd_schedule) at 12
    # ranks in nodes of 4: the fold and the first round stay inside the nodes, then 2 and 4 ranks of
    # the busiest node cross, and the unfold stays inside; at 6 in nodes of 3, one rank crosses in each
    # of its 4 rounds.
    assert model.rd_rounds(12, 4) == (0, 0, 2, 4, 0)
    assert model.allreduce_time(nbytes, 12, ranks_per_node=4, **rd) == pytest.approx(6 * nbytes * beta)
    assert model.rd_rounds(6, 3) == (1, 1, 1, 1)
    assert [model.rd_round_count(p) for p in (1, 2, 3, 4, 5, 7, 8, 9)] == [0, 1, 3, 2, 4, 4, 3, 5]


def test_explicit_recursive_doubling_is_refused_where_gflow_refuses_it():
    # helper-48: the model costed sizes that gflow refuses (its "lazy recursive doubling" row, 4 MiB).
    limit = gflow.config.small_message_bytes
    assert model.allreduce_time(limit, 4, algorithm="recursive_doubling", calibration=CAL) > 0
    with pytest.raises(ValueError, match="takes at most config.small_message_bytes") as in_model:
        model.allreduce_time(limit + 4, 4, algorithm="recursive_doubling", calibration=CAL)
    with pytest.raises(ValueError, match="takes at most config.small_message_bytes") as in_gflow:
        gflow.allreduce(np.ones((limit + 4) // 4, np.float32), algorithm="recursive_doubling")
    assert str(in_model.value) == str(in_gflow.value)


def test_device_arrays_reduce_on_the_host_in_recursive_doubling():
    # helper-48: the latency path of device arrays goes through the host, but was costed at the
    # GPU's reduction and NVLink rates.
    host = model.Calibration(gamma=1e-9, beta_intra=1e-9, alpha_intra=0, rd_step=0, py_call=0)
    gpu = model.cluster(host, 56e9, 0.0, 4)
    one_node = model.allreduce_time(2**16, 4, algorithm="recursive_doubling", calibration=gpu)
    rounds_on_host = 2 * (gpu.alpha_intra + 2**16 * (host.gamma + host.beta_intra))
    assert one_node == pytest.approx(rounds_on_host + 2 * 2**16 * gpu.pcie + 2 * gpu.launch)


def test_a_cluster_keeps_its_own_latency_inside_a_node():
    # A calibration taken with one rank per core carries that CPU's fixed costs; on a GPU cluster the
    # latency inside a node is the cluster's (cluster()), which they must not replace.
    crowded = model.Calibration(cores=2, uncrowded={"alpha_intra": 1.0, "py_step": CAL.py_step})
    gpu = model.cluster(crowded, 56e9, 5e-6, 8)
    assert "alpha_intra" not in gpu.uncrowded and gpu.alpha_intra == 5e-6
    t = model.allreduce_time(2**20, 16, algorithm="hierarchical", ranks_per_node=8, calibration=gpu)
    assert t < 0.5  # (with the CPU's 1 s latency in it, a second or more)


def test_csc_counts_fp16_gradients_by_their_elements():
    # The same gradients in fp16: half the bytes, the same number of elements to rank and select, so
    # CSC's local pass costs the same (the review found it halved: nbytes // 4 of fp16 bytes).
    elems = 2**22
    kw = dict(lazy_threshold=None, density=0.01, calibration=CAL, ranks_per_node=1)
    csc_only = model.Calibration(**{**vars(CAL), "csc": 1e-3})  # (the local pass dominates)
    kw["calibration"] = csc_only
    fp32 = model.step_time([4 * elems], 1, 0.0, **kw)["comm_s"]
    fp16 = model.step_time([2 * elems], 1, 0.0, dtype_bytes=2, **kw)["comm_s"]
    assert fp16 == pytest.approx(fp32, rel=0.01)


def test_the_device_path_costs_what_gflow_runs():
    """Device buffers: the latency path goes through the host whatever the transport; staged ones pay
    the PCIe copies, whole for the flat ring, overlapped with the rings for the hierarchical
    allreduce's cross-node shards; the node phase reads the peers over the node's links; CSC's own
    allreduces take "auto" whatever the dense path takes."""
    from dataclasses import replace

    mb = 2**20
    direct = model.cluster(CAL, 56e9, 5e-6, 8, transport="direct")
    staged = model.cluster(CAL, 56e9, 5e-6, 8, transport="staged")
    kw = dict(ranks_per_node=8)
    # small: the latency path, through the host (its header is read there) whatever the transport,
    # reduced there and moved through its shared memory inside a node
    host = replace(staged, transport=None, gamma=CAL.gamma, beta_intra=CAL.beta_intra)
    copies = 2 * 4096 * staged.pcie + 2 * staged.launch
    for cal in (direct, staged):
        assert model.allreduce_time(4096, 64, calibration=cal, **kw) == pytest.approx(
            model.allreduce_time(4096, 64, algorithm="recursive_doubling", calibration=host, **kw) + copies
        )
    # the flat ring stages the whole message: the copies add to it
    both = {"direct": direct, "staged": staged}
    flat = {
        name: model.allreduce_time(64 * mb, 64, algorithm="ring", calibration=c, **kw)
        for name, c in both.items()
    }
    assert flat["staged"] == pytest.approx(flat["direct"] + 2 * 64 * mb * staged.pcie + 2 * staged.launch)
    # the hierarchy stages only the shards, and overlaps their copies with the rings: at most one
    # segment's copies more than the slower of the two
    hier = {
        name: model.allreduce_time(64 * mb, 64, algorithm="hierarchical", calibration=c, **kw)
        for name, c in both.items()
    }
    shard_copy = 64 * mb / 8 * staged.pcie
    assert hier["direct"] <= hier["staged"] <= hier["direct"] + shard_copy + 2 * 4 * mb * staged.pcie
    assert hier["staged"] < flat["staged"]
    assert hier["staged"] - hier["direct"] < (flat["staged"] - flat["direct"]) / 4  # (shards: 1/8 of it)
    # CSC's norms and packed chunks go by "auto": asking for the ring changes only the dense rows
    sizes = model.workload_sizes("alexnet")
    csc = dict(density=0.01, calibration=direct, ranks_per_node=8)
    assert model.step_time(sizes, 512, 0.04, algorithm="ring", **csc) == model.step_time(
        sizes, 512, 0.04, algorithm="hierarchical", **csc
    )
    with pytest.raises(ValueError, match="transport"):
        model.cluster(CAL, 56e9, 5e-6, 8, transport="tcp")


def test_auto_takes_the_device_node_phase_from_two_ranks():
    """As dispatch.settle_auto: on one node of two ranks, auto is the ring for host arrays and the
    (CUDA IPC) node phase for device arrays; of three, the node phase for both."""
    device = model.cluster(CAL, 56e9, 5e-6, 8, transport="staged")
    big = 64 * 2**20
    for ranks, cal, expected in [(2, CAL, "ring"), (2, device, "hierarchical"), (3, CAL, "hierarchical"),
                                 (3, device, "hierarchical")]:  # fmt: skip
        auto = model.allreduce_time(big, ranks, calibration=cal)
        chosen = model.allreduce_time(big, ranks, algorithm=expected, calibration=cal)
        assert auto == chosen, (ranks, expected)


def test_device_terms_are_measured_and_kept(tmp_path):
    """`calibrate --device`'s terms: measured on the device (here the simulator's), saved, loaded, and
    kept by cluster(), which otherwise assumes a PCIe rate; a calibration from before them loads."""
    from dataclasses import replace

    terms = model.device_terms(reps=2)
    assert terms["launch"] > 0 and 0 < terms["pcie"] < 1e-6 and terms["device"]
    measured = replace(CAL, launch=terms["launch"], pcie=terms["pcie"], device=terms["device"])
    path = tmp_path / "device.json"
    measured.save(str(path))
    loaded = model.Calibration.load(str(path))
    assert (loaded.launch, loaded.pcie, loaded.device) == (terms["launch"], terms["pcie"], terms["device"])
    assert model.cluster(loaded, 56e9, 5e-6, 8, transport="staged").pcie == terms["pcie"]
    assumed = model.cluster(CAL, 56e9, 5e-6, 8, transport="staged")
    assert assumed.pcie == 1 / model.GPU_NODE["pcie_Bps"] != terms["pcie"]
    old = {k: v for k, v in json.load(open(path)).items() if k != "device"}
    path.write_text(json.dumps(old))
    assert model.Calibration.load(str(path)).device is None


def test_a_busy_machine_is_named():
    assert model.busier_than_cores(4, 2, load=5.0) is None  # this job's 4 ranks, and 1 more: fine
    message = model.busier_than_cores(4, 2, load=11.0)
    assert message and "load 11.0 on 2 cores, 7.0 of it besides this job's 4 ranks" in message, message
    # The load now, not the 1-minute average (which lags): this process, runnable, counts itself
    now = model.runnable_now()
    assert now is None or now >= 1


def test_step_time_compresses_by_the_gradients_element_size():
    # helper-48: step_time did not pass dtype_bytes on, so fp16 compression of float64 gradients was
    # costed as of float32's (half the bytes instead of a quarter).
    sizes = model.workload_sizes("resnet50", dtype_bytes=8)
    kw = dict(ranks_per_node=8, compression="fp16", calibration=CAL)
    float64 = model.step_time(sizes, 64, 0.1, dtype_bytes=8, **kw)["comm_s"]
    as_float32 = model.step_time(sizes, 64, 0.1, dtype_bytes=4, **kw)["comm_s"]
    assert float64 < 0.7 * as_float32
    segments = model.segments(sizes, 4 * 2**20)
    copies = model._slowdown(CAL, 8) * CAL.copy * sum(sizes)
    expected = sum(model.allreduce_time(n, 64, dtype_bytes=8, algorithm="auto", **kw) for n in segments)
    assert float64 == pytest.approx(expected + copies)


def test_step_time_and_segments():
    assert model.segments([3, 3, 3, 3, 1], 5) == [6, 6, 1]
    sizes = model.workload_sizes("resnet50")
    assert sum(sizes) == 25_557_032 * 4
    alone = model.step_time(sizes, 1, 0.1, calibration=CAL)
    assert alone["speedup"] == pytest.approx(1.0, rel=0.01)
    hidden = model.step_time(sizes, 4, 10.0, calibration=CAL)  # compute dwarfs communication
    assert hidden["iteration_s"] < 10.0 + 2 * hidden["comm_s"] and hidden["efficiency"] > 0.9
    exposed = model.step_time(sizes, 4, 10.0, overlap=False, calibration=CAL)
    assert exposed["iteration_s"] == pytest.approx(10.0 + exposed["comm_s"])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="algorithm"):
        model.allreduce_time(10, 2, algorithm="tree", calibration=CAL)
    with pytest.raises(ValueError, match="compression"):
        model.allreduce_time(10, 2, compression="int8", calibration=CAL)
    with pytest.raises(ValueError, match="ranks"):
        model.allreduce_time(10, 0, calibration=CAL)
    with pytest.raises(ValueError, match="workload"):
        model.workload_sizes("vgg")


def run_cli(home, *args):
    """`python -m gflow ...` with a HOME of its own: no earlier calibration (~/.cache/gflow) is found."""
    env = {k: v for k, v in os.environ.items() if k != model.CALIBRATION_ENV}
    env["HOME"] = str(home)
    return subprocess.run(
        [sys.executable, "-m", "gflow", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_calibrate_device_refuses_the_simulator(tmp_path):
    """`calibrate --device` under Numba's simulator would record the simulator's timings as a GPU's."""
    assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"  # (the suite's setting: conftest.py)
    done = run_cli(tmp_path, "calibrate", "--device", "--out", str(tmp_path / "c.json"))
    assert done.returncode == 2 and "simulator" in done.stderr, done.stderr
    assert not (tmp_path / "c.json").exists()


def test_calibrate_refuses_what_it_cannot_measure_before_measuring(tmp_path):
    """helper-48: on 1 rank it wrote the defaults as if measured; a folder as --out failed after a
    minute of measuring."""
    one = run_cli(tmp_path, "calibrate", "--out", str(tmp_path / "c.json"))
    assert one.returncode == 2 and "at least 2 ranks" in one.stderr, one.stderr
    assert not (tmp_path / "c.json").exists()
    args = type("Args", (), {"device": False, "out": str(tmp_path)})
    from gflow.tools.cli import _calibrate_refusal

    assert "expected a file in an existing folder" in _calibrate_refusal(args, 2)
    args.out = str(tmp_path / "missing" / "c.json")
    assert "expected a file in an existing folder" in _calibrate_refusal(args, 2)
    args.out = str(tmp_path / "c.json")
    assert _calibrate_refusal(args, 2) is None


def test_model_command_prints_the_table(tmp_path):
    calib = tmp_path / "c.json"
    CAL.save(str(calib))
    done = run_cli(
        tmp_path,
        "model",
        "--ranks",
        "512",
        "--workload",
        "alexnet",
        "--calibration",
        str(calib),
        "--plot",
        "",
    )
    assert done.returncode == 0, done.stderr
    for technique, *_ in model.TECHNIQUES:
        assert technique in done.stdout
    assert "512 ranks, 8 per node, 56gbit" in done.stdout and "device buffers direct" in done.stdout
    staged = run_cli(tmp_path, "model", "--ranks", "64", "--transport", "staged", "--calibration", str(calib),
                     "--plot", "")  # fmt: skip
    assert staged.returncode == 0 and "device buffers staged" in staged.stdout, staged.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ranks", "0"], "must be positive"),
        (["--ranks", "8", "--workload", "vgg"], "workload"),
        (["--ranks", "8", "--link", "fast"], "expected a rate such as 56gbit"),
        (["--ranks", "8", "--calibration", "BAD"], "calibration"),
        (["--ranks", "8", "--calibration", "MISSING"], "missing"),
        (["--ranks", "8", "--calibration", "CROWDED"], "uncrowded must map"),
        (["--ranks", "8", "--workload", "SIZES"], "--compute-ms"),
        (["--ranks", "8", "--transport", "tcp"], "invalid choice"),
        ([], "--ranks"),
        # helper-48: these ran, silently (batch 0 became 128, a NaN link a table of nan) or to a traceback
        (["--ranks", "8", "--link", "nan"], "must be positive"),
        (["--ranks", "8", "--link", "56Gbps"], "--link '56Gbps'"),
        (["--ranks", "8", "--batch", "0"], "--batch must be at least 1"),
        (["--ranks", "8", "--compute-ms", "0"], "--compute-ms must be a number > 0"),
        (["--ranks", "8", "--latency-us", "-50"], "--latency-us must be a number >= 0"),
        (["--ranks", "8", "--density", "5"], "--density must be in (0, 1]"),
        (["--ranks", "8", "--workload", "INFINITE", "--compute-ms", "1"], "whole, positive element counts"),
        (["--ranks", "8", "--plot", "/nonexistent/x.png"], "expected a file in an existing folder"),
    ],
)
def test_model_command_refuses_bad_input_with_usage(tmp_path, args, message):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"alpha_intra": 1e-6}))
    sizes = tmp_path / "sizes.txt"
    sizes.write_text("1000 2000")
    crowded = tmp_path / "crowded.json"
    crowded.write_text(json.dumps({**vars(CAL), "uncrowded": {"py_step": "fast"}}))
    infinite = tmp_path / "infinite.txt"
    infinite.write_text("1000 inf")
    swap = {"BAD": str(bad), "MISSING": str(partial), "SIZES": str(sizes), "CROWDED": str(crowded)}
    swap["INFINITE"] = str(infinite)
    plot = [] if "--plot" in args else ["--plot", ""]
    done = run_cli(tmp_path, "model", *plot, *[swap.get(a, a) for a in args])
    assert done.returncode == 2
    assert "usage:" in done.stderr and message in done.stderr


def measure_small(monkeypatch, repeats):
    """What calibrate measures, not how steadily nor how large: fewer repeats, and its sizes an eighth to
    a sixteenth of a real calibration's, each still above the one before (512 KiB, 1 MiB, 4 MiB, 8 MiB):
    these tests' 31 s became 9 s."""
    monkeypatch.setattr(model, "REPEATS", repeats)
    monkeypatch.setattr(model, "RING_SCALE_BYTES", (2**20, 4 * 2**20))
    monkeypatch.setattr(model, "LOCAL_BYTES", 4 * 2**20)
    monkeypatch.setattr(model, "HUGE_BYTES", 8 * 2**20)


@pytest.mark.parallel([2, 3])
def test_calibrate_measures_every_constant(monkeypatch):
    measure_small(monkeypatch, 2)
    cal = model.calibrate(progress=lambda line: None)
    base = model.Calibration(**{**vars(cal), "uncrowded": None})
    assert WORLD.allgather(json.dumps(vars(cal))) == [json.dumps(vars(cal))] * WORLD.size  # the same
    for name in (
        "alpha_intra",
        "beta_intra",
        "gamma",
        "copy",
        "codec",
        "csc",
        "py_step",
        "py_call",
        "rd_step",
        "slot_step",  # (the suite's ranks share one host: their exchanges go through the slots)
    ):
        assert 0 < getattr(cal, name) < 1e-2, name
    assert cal.node_passes >= 1
    # The size-resolved terms: the node phase and a ring at 512 KiB, the slots' bytes (one host).
    assert cal.node_passes_small > 0 and cal.slots_scale > 0
    assert all(
        s > 0 for s in (cal.ring_scale_small, cal.ring_scale, cal.ring_scale_large, cal.ring_scale_huge)
    )
    assert cal.node_passes_mid > 0 and cal.node_passes_huge > 0
    assert f"on {WORLD.size} ranks" in cal.source
    # More ranks than cores on one node: the fixed costs again with one rank per core, used by the
    # model for nodes that small.
    if WORLD.size > cal.cores:
        assert set(cal.uncrowded) == {
            "alpha_intra",
            "py_step",
            "py_call",
            "rd_step",
            "node_fixed",
            "slot_step",
        }
        assert all(0 < v < 1e-2 for v in cal.uncrowded.values()), cal.uncrowded
        tiny = [model.allreduce_time(4096, 2, algorithm="hierarchical", calibration=c) for c in (cal, base)]
        assert tiny[0] != tiny[1]
    else:
        assert cal.uncrowded is None


@pytest.mark.parallel([3, 4])
def test_calibrate_on_nodes_of_different_sizes(monkeypatch):
    """Nodes of 2 ranks posed over the world (at p = 3: a node of 2 and a rank alone): every rank
    takes part in the node measurements' collectives (a rank alone in its node once skipped them and
    the others hung), and the node terms are the largest node's."""
    import gflow

    measure_small(monkeypatch, 1)

    before = gflow.config.ranks_per_node
    gflow.config.ranks_per_node = 2
    try:
        cal = model.calibrate(comm=WORLD.Dup(), progress=lambda line: None)
    finally:
        gflow.config.ranks_per_node = before
    assert WORLD.allgather(json.dumps(vars(cal))) == [json.dumps(vars(cal))] * WORLD.size
    if WORLD.size > 1:
        assert cal.node_passes >= 0.5 and cal.node_passes_small > 0 and cal.ring_scale_small > 0
    assert f"on {WORLD.size} ranks" in cal.source


def test_one_hosts_exchanges_go_through_the_slots_where_measured():
    """On one host (slot_step measured) the latency path is one exchange whatever p, the agreement
    before a ring one exchange, and from three ranks "auto" reduces in the slots up to the node
    phase (two exchanges past node_fold_bytes); across nodes nothing changes."""
    from dataclasses import replace

    from gflow.collectives.recursive_doubling import node_fold_bytes

    mpi = model.Calibration(cores=64)
    slots = replace(mpi, slot_step=7e-6)
    one = [model.allreduce_time(256, p, calibration=slots) for p in (2, 3, 4, 8)]
    assert one[0] < one[1] < one[2] < one[3]  # (only the fold grows with p)
    assert one[3] - one[0] < 256 * 7 * slots.gamma + 1e-12
    assert one[0] == pytest.approx(7e-6 + 256 * (slots.copy + slots.gamma))
    assert model.allreduce_time(256, 8, calibration=mpi) > one[3]  # (3 rounds of 25 us over MPI)
    ring = [model.allreduce_time(2**20, 4, algorithm="ring", calibration=c) for c in (mpi, slots)]
    assert ring[0] - ring[1] == pytest.approx(2 * (mpi.alpha_intra + mpi.rd_step) - 7e-6)
    for n in (node_fold_bytes(3), 1536 * 1024):  # (past the latency path's 128 KiB)
        got = model.allreduce_time(n, 3, calibration=slots)
        if n <= node_fold_bytes(3):
            expected = slots.py_call + 7e-6 + n * (slots.copy + 2 * slots.gamma)
        else:
            expected = slots.py_call + 2 * 7e-6 + n * (2 * slots.copy + 2 / 3 * slots.gamma)
        assert got == pytest.approx(expected)
    node = [model.allreduce_time(4 * 2**20, 4, calibration=c) for c in (mpi, slots)]
    assert node[0] - node[1] == pytest.approx(ring[0] - ring[1])  # (the node phase, its agreement the slots')
    for kwargs in (dict(ranks_per_node=8), dict(ranks_per_node=8, algorithm="ring")):
        far = [model.allreduce_time(4096, 512, calibration=c, **kwargs) for c in (mpi, slots)]
        assert far[0] == far[1]


def test_size_resolved_terms_interpolate_in_log_size(tmp_path):
    """ring_scale_small/ring_scale/ring_scale_large/ring_scale_huge, node_passes_small/_mid/node_passes/
    _huge: each measured value
    holds at its size, log-size interpolation between, the end values beyond; slots_scale multiplies
    only the bytes of the slots' paths. A calibration without them (older) loads and costs as before."""
    from dataclasses import replace

    base = model.Calibration(cores=64, slot_step=5e-6)
    sized = replace(base, ring_scale_small=0.5, ring_scale=1.0, ring_scale_large=2.0, node_passes_small=1.0)
    small, mid, large = model.SMALL_BYTES, model.RING_SCALE_BYTES[0], model.RING_SCALE_BYTES[1]
    assert model._ring_scale(sized, small // 8) == 0.5 and model._ring_scale(sized, small) == 0.5
    assert model._ring_scale(sized, mid) == 1.0 and model._ring_scale(sized, 4 * large) == 2.0
    halfway = int(2 ** ((math.log2(small) + math.log2(mid)) / 2))
    assert model._ring_scale(sized, halfway) == pytest.approx(0.75)
    assert model._node_passes(sized, small) == 1.0 and model._node_passes(sized, model.LOCAL_BYTES) == 4.0
    assert model._node_passes(base, small) == base.node_passes  # (not measured: one value)
    # 8 MB and 128 MB, where the buffers leave the last-level cache and then share memory's bandwidth
    huge = model.HUGE_BYTES
    more = replace(sized, node_passes_mid=2.0, node_passes_huge=6.0, ring_scale_huge=3.0)
    assert model._node_passes(more, mid) == 2.0 and model._node_passes(more, model.LOCAL_BYTES) == 4.0
    assert (
        model._node_passes(more, 2 * huge) == 6.0 and model._node_passes(more, 2 * model.LOCAL_BYTES) == 5.0
    )
    assert model._ring_scale(more, 2 * large) == pytest.approx(2.5) and model._ring_scale(more, huge) == 3.0
    assert model._ring_scale(sized, huge) == 2.0  # (not measured: the 32 MB value beyond)
    ring = [model.allreduce_time(2 * small, 2, algorithm="ring", calibration=c) for c in (base, sized)]
    assert ring[1] < ring[0]  # (its bytes at scale 0.5 .. 1.0 there, against 1.0)
    # slots_scale: the latency path's bytes only, its fixed exchange untouched
    n = 64 * 2**10
    fast = replace(base, slots_scale=0.25)
    got, before = (model.allreduce_time(n, 2, calibration=c) for c in (fast, base))
    assert got == pytest.approx(5e-6 + 0.25 * (before - 5e-6))
    assert model.allreduce_time(8, 2, calibration=fast) == pytest.approx(
        5e-6 + 0.25 * 8 * (base.copy + base.gamma)
    )
    path = tmp_path / "old.json"
    for bad in (None, "fast", -1.0, True):
        base.save(str(path))
        path.write_text(json.dumps({**json.load(open(path)), "slots_scale": bad}))
        with pytest.raises(ValueError, match="slots_scale must be a positive number"):
            model.Calibration.load(str(path))
    base.save(str(path))
    old = {k: v for k, v in json.load(open(path)).items()}
    for name in ("ring_scale_small", "slots_scale", "node_passes_small"):
        del old[name]
    path.write_text(json.dumps(old))
    loaded = model.Calibration.load(str(path))
    assert model.allreduce_time(3 * small, 3, calibration=loaded) == model.allreduce_time(
        3 * small, 3, calibration=base
    )


def test_a_calibration_that_is_not_numbers_is_refused_at_load(tmp_path):
    """helper-48: a string or a negative time loaded, and failed deep in the model or gave negative
    milliseconds; the calibrations shipped in bench/results (without slot_step) did not load at all."""
    results = os.path.join(os.path.dirname(__file__), "..", "bench", "results")
    for name in ("calibration_shm.json", "calibration_h200.json"):
        shipped = model.Calibration.load(os.path.join(results, name))
        assert model.allreduce_time(2**20, 512, ranks_per_node=8, calibration=shipped) > 0
    path = tmp_path / "bad.json"
    cases = [("py_step", "abc", "py_step must be a number >= 0"), ("beta_intra", -1e-9, "beta_intra must be"),
             ("gamma", None, "gamma must be"), ("copy", float("nan"), "copy must be"),
             ("cores", 0, "cores must be a whole number >= 1"), ("cores", 2.5, "cores must be"),
             ("transport", "carrier pigeon", "transport must be"),
             ("node_passes", 0, "node_passes must be a positive number"),
             ("copy", 0.0, "copy must be a positive number"),
             ("ring_scale_huge", 0, "ring_scale_huge must be a positive number")]  # fmt: skip
    for field, value, message in cases:
        model.Calibration().save(str(path))
        path.write_text(json.dumps({**json.load(open(path)), field: value}))
        with pytest.raises(ValueError, match=message):
            model.Calibration.load(str(path))


def test_python_share_is_the_part_gflows_own_costs_make():
    kwargs = dict(ranks_per_node=8, algorithm="ring")
    free = model.Calibration(py_step=0.0, py_call=0.0, rd_step=0.0)
    assert model.python_share(4 * 2**20, 512, calibration=free, **kwargs) == 0.0
    shares = [
        model.python_share(4 * 2**20, 512, calibration=model.Calibration(py_step=s, py_call=1e-5), **kwargs)
        for s in (1e-7, 1e-6, 1e-5)
    ]
    assert 0 < shares[0] < shares[1] < shares[2] < 1, shares
    # The hierarchy takes fewer steps, so less of its time is gflow's own.
    cal = model.Calibration(py_step=1e-5, py_call=1e-5)
    flat = model.python_share(4 * 2**20, 512, calibration=cal, **kwargs)
    hier = model.python_share(4 * 2**20, 512, calibration=cal, ranks_per_node=8, algorithm="hierarchical")
    assert hier < flat
