"""The cost model (gflow/tools/cost_model.py) against measurement, on points the calibration never saw.

    python bench/model_check.py                     # shared memory p = 2, 3, 4 and a 2 x 2 emulated cluster
    python bench/model_check.py --quick             # fewer sizes and repetitions

`gflow.tools.cost_model.calibrate` runs at every p of every environment (shared memory at p = 4, 3, 2:
a calibration describes nodes of the size it ran on; the emulated cluster of 2 nodes x 2 ranks at 1
Gbit/s per node link, bench/netem.py), in the same job as that p's timings, just before them and just
after them, and the model predicts with the mean of the two (this machine's speed drifts by up to 1.5x
between runs minutes apart, and by 1.3x within one), measuring ping-pongs, local loops and
gflow's own allreduces at a few sizes that are not among those checked (see gflow/tools/cost_model.py;
on shared memory it also measures the fixed costs with one rank per core). Then gflow.allreduce is timed
at sizes 4 KB .. 256 MB (64 MB in the cluster), with the ring, the hierarchical allreduce and auto, at
p = 4, 3, 2 on shared memory and p = 4 in the cluster: none of these timings was used to calibrate, so
all are held out. Each point is timed as MPI's benchmarks time a collective (calls back to back after a
barrier, per call: about 4 MB of payload a batch, at most 100 calls), contenders alternating batch by
batch; medians over the batches of the slowest rank.
Last, bench/fusion.py's lazy ResNet-50 step at p = 4 under the emulated network (every rank a host, 1
Gbit/s per link), without and with compute, against gflow.tools.cost_model.step_time (`--fusion-only`
runs just that). Writes bench/out/model_check.{json,md,png}: predicted against measured, and the share
within 20%.
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import netem  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
ALGORITHMS = ["ring", "hierarchical", "auto"]


def worker(args) -> None:
    from mpi4py import MPI

    import gflow
    import gflow.tools.cost_model

    comm = MPI.COMM_WORLD

    def calibrate(path):
        cal = gflow.tools.cost_model.calibrate(comm, progress=print if comm.rank == 0 else lambda _: None)
        if comm.rank == 0:
            cal.save(path)

    if args.calibrate:  # in this job, just before the timings: the machine's speed drifts between runs
        calibrate(args.calibrate)
    rows = []
    for nbytes in args.sizes:
        x = np.random.default_rng(comm.rank).random(nbytes // 4, dtype=np.float32)
        y = np.empty_like(x)
        runs = {a: (lambda a=a, x=x, y=y: gflow.allreduce(x, out=y, algorithm=a)) for a in ALGORITHMS}
        for fn in runs.values():
            fn()
        # As MPI's own benchmarks time a collective (OSU's osu_allreduce): calls back to back after a
        # barrier, per call; a lone call after a barrier would add the barrier's exit skew, which on
        # more ranks than cores is the scheduler's and outweighs a small allreduce.
        calls = max(1, min(100, 2**22 // nbytes))  # (about 4 MB of payload a batch)
        rounds = 3 if nbytes >= 32 * 2**20 else 7 if nbytes >= 2**20 else 15
        rounds = rounds if not args.quick else max(3, rounds // 3)
        times = _common.alternated_medians_us(comm, runs, calls, rounds)
        for a, t in times.items():
            rows.append({"bytes": nbytes, "algorithm": a, "measured_s": t * 1e-6})
        if comm.rank == 0:
            cells = "  ".join(f"{a} {t * 1e-3:.3f} ms" for a, t in times.items())
            print(f"  p={comm.size} {_common.human_bytes(nbytes):>7}: {cells}", flush=True)
    if args.calibrate:  # and just after them: the two bracket the timings
        calibrate(_after(args.calibrate))
    if comm.rank == 0:
        with open(args.result, "w") as f:
            json.dump({"p": comm.size, "rows": rows}, f)


def calibrate_cmd(out: str) -> list[str]:
    return ["-m", "gflow", "calibrate", "--out", out]


def _after(path: str) -> str:
    return path.removesuffix(".json") + "_after.json"


def bracketing(before, after):
    """The mean of two calibrations of one machine taken just before and just after the timings (each
    constant the mean of its two measurements): this machine's speed drifts by 1.3x within minutes,
    and a calibration on one side only of the timings then misses them by that much."""
    from dataclasses import asdict

    from gflow.tools import cost_model as model

    first, second = asdict(before), asdict(after)
    merged = {}
    for name, value in first.items():
        other = second[name]
        if isinstance(value, float) and isinstance(other, (int, float)):
            merged[name] = (value + other) / 2
        elif isinstance(value, dict) and isinstance(other, dict):
            merged[name] = {k: (v + other[k]) / 2 for k, v in value.items() if k in other}
        else:
            merged[name] = value
    return model.Calibration(**merged)


def run_environment(args, name, nprocs_list, sizes, ranks_per_node, cluster=None):
    """Calibrate, then measure at each p, in one environment; returns the result records."""
    from gflow.tools import cost_model as model

    records = []
    script = os.path.abspath(__file__)
    for p in sorted(nprocs_list, reverse=True):
        # Each p calibrates for itself: a calibration describes nodes of the size it ran on (on this
        # machine's 2 cores, 2, 3 and 4 ranks share them differently), as a cluster's is taken on its nodes.
        calib = os.path.join(args.out, f"calibration_{name}_p{p}.json")
        result = os.path.join(args.out, f"model_check_{name}_p{p}.json")
        worker_args = ["--worker", "--result", result, "--sizes", *map(str, sizes), "--calibrate", calib]
        worker_args += ["--quick"] if args.quick else []
        print(f"--- {name}: calibrate and measure at p = {p} ---", flush=True)
        if args.reuse and os.path.exists(result):
            pass
        elif cluster is None:
            _common.launch(script, p, worker_args)
        else:
            cluster.launch(script, worker_args)
        before = model.Calibration.load(calib)
        after = model.Calibration.load(_after(calib)) if os.path.exists(_after(calib)) else before
        cals = {"predicted_s": bracketing(before, after), "before_s": before, "after_s": after}
        with open(result) as f:
            measured = json.load(f)
        for row in measured["rows"]:
            predicted = {
                key: model.allreduce_time(
                    row["bytes"], p, algorithm=row["algorithm"], ranks_per_node=ranks_per_node or p,
                    calibration=cal,
                )
                for key, cal in cals.items()
            }  # fmt: skip
            records.append({"environment": name, "p": p, **row, **predicted})
    return records


def fusion_check(args) -> list[dict]:
    """bench/fusion.py's lazy ResNet-50 step at p = 4 under the emulated network (1 Gbit/s per link),
    without compute ("lazy") and with compute equal to one allreduce of all the bytes ("lazy +
    overlap"), against gflow.tools.cost_model.step_time on a calibration made in the same network."""
    from gflow.tools import cost_model as model

    calib = os.path.join(args.out, "calibration_net4-1gbit.json")
    fusion = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fusion.py")
    sizes = model.workload_sizes("resnet50")
    records = []
    with netem.ShapedNetwork(1e9, 4) as net:  # (the network is made even when all is reused: cheap)
        print("--- flat network, 4 x 1 Gbit/s: calibrate ---", flush=True)
        calibrate = [_common.mpiexec(), "-n", "4", sys.executable, *calibrate_cmd(calib)]
        if not (args.reuse and os.path.exists(calib)):
            subprocess.run(net.command(calibrate), check=True)
        for ratio in (0, 1):
            print(f"--- fusion.py resnet50 p = 4, 1 Gbit/s, compute/comm {ratio} ---", flush=True)
            worker_args = ["--worker", "--model", "resnet50", "--network", "1gbit", "--ratio", str(ratio)]
            worker_args += ["--reps", "3", "--out", args.out]
            if not (
                args.reuse
                and os.path.exists(os.path.join(args.out, f"fusion_resnet50_p4_1gbit_r{float(ratio)}.json"))
            ):
                net.launch(fusion, 4, worker_args)
            with open(os.path.join(args.out, f"fusion_resnet50_p4_1gbit_r{float(ratio)}.json")) as f:
                result = json.load(f)
            rows = {row["contender"]: row["seconds"] for row in result["rows"]}
            compute = rows.get("compute only", 0.0)
            name = "lazy + overlap" if ratio else "lazy"
            predicted = model.step_time(
                sizes, 4, compute, ranks_per_node=1, lazy_threshold=result["threshold"],
                overlap=bool(ratio), calibration=model.Calibration.load(calib),
            )["iteration_s"]  # fmt: skip
            records.append(
                {"environment": "fusion.py resnet50, 4 x 1gbit", "p": 4, "bytes": result["bytes"],
                 "algorithm": f"{name} (compute {compute * 1e3:.0f} ms)", "measured_s": rows[name],
                 "predicted_s": predicted}
            )  # fmt: skip
    return records


def report(args, records, name: str) -> None:
    ratios = np.array([r["predicted_s"] / r["measured_s"] for r in records])
    within = float(np.mean(np.abs(ratios - 1) <= 0.2))
    bracketed = [r for r in records if "before_s" in r]
    before = np.array([r["before_s"] / r["measured_s"] for r in bracketed])
    drift = np.array([r["after_s"] / r["before_s"] for r in bracketed])
    lines = [
        f"Machine: {_common.machine()['cores']} cores; "
        f"command: python bench/model_check.py {' '.join(sys.argv[1:])}",
        "",
        f"Held-out points: {len(records)}; predicted within 20% of measured: {within:.0%}",
        "",
        f"Predicted with the calibrations taken before and after the timings (their mean). With the one "
        f"before alone: {np.mean(np.abs(before - 1) <= 0.2):.0%} of those {len(bracketed)} points within "
        f"20%; the two calibrations predict a point more than 20% apart for "
        f"{np.mean(np.abs(drift - 1) > 0.2):.0%} of them (the machine's drift during the timings).",
        "",
        "| environment | p | size | algorithm | measured (ms) | predicted (ms) | predicted / measured |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['environment']} | {r['p']} | {_common.human_bytes(r['bytes'])} | {r['algorithm']} | "
            f"{r['measured_s'] * 1e3:.3f} | {r['predicted_s'] * 1e3:.3f} | "
            f"{r['predicted_s'] / r['measured_s']:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump({"within_20pct": within, "records": records}, f, indent=1)
    print(text)
    plt = _common.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 6))
    for env in sorted({r["environment"] for r in records}):
        pts = [(r["measured_s"], r["predicted_s"]) for r in records if r["environment"] == env]
        ax.scatter(*zip(*pts, strict=True), s=12, label=env)
    lo = min(min(r["measured_s"], r["predicted_s"]) for r in records)
    hi = max(max(r["measured_s"], r["predicted_s"]) for r in records)
    ax.plot([lo, hi], [lo, hi], color="gray", lw=1)
    ax.fill_between(
        [lo, hi], [lo * 0.8, hi * 0.8], [lo * 1.2, hi * 1.2], color="gray", alpha=0.15, label="±20%"
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured (s)")
    ax.set_ylabel("predicted (s)")
    ax.set_title(f"gflow cost model, held-out allreduces: {within:.0%} within 20%")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, f"{name}.png"), dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--no-cluster", action="store_true", help="shared memory only (no root needed)")
    parser.add_argument("--fusion-only", action="store_true", help="only the fusion.py iteration check")
    parser.add_argument("--reuse", action="store_true", help="reuse calibrations and timings found in --out")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", type=int, nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--calibrate", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    os.makedirs(args.out, exist_ok=True)
    step = 16 if args.quick else 4
    sizes = [4 * 2**10 * step**i for i in range(20) if 4 * 2**10 * step**i <= 256 * 2**20]
    if args.fusion_only:
        report(args, fusion_check(args), "model_check_fusion")
        return
    records = run_environment(args, "shm", [2, 3, 4], sizes, None)
    if not args.no_cluster:
        with netem.EmulatedCluster(1e9, 2, 2) as cluster:
            if not args.reuse:
                print(cluster.describe(cluster.latency_us()), flush=True)
            net_sizes = [s for s in sizes if s <= 64 * 2**20]
            records += run_environment(args, "cluster2x2-1gbit", [4], net_sizes, 2, cluster)
        records += fusion_check(args)
    report(args, records, "model_check")


if __name__ == "__main__":
    main()
