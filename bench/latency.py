"""Small allreduces side by side: what gflow adds to MPI's own Allreduce (issue 27's targets).

    python bench/latency.py                         # p = 2, 3, 4; 256 B .. 1 MB; writes bench/out/latency/
    python bench/latency.py --procs 2 --max-bytes 64K --rounds 20

For each size, the contenders (MPI's Allreduce, gflow without and with out=, validation on as by
default) take turns: one batch of --batch back-to-back calls each, again and again for --rounds
rounds, so drift and noise hit all of them alike. A batch's time is the slowest rank's, divided by
the batch; the figure is the median over rounds. "added" is gflow's time minus MPI's; "vs MPI" is
MPI's time over gflow's (higher is better for gflow).
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
from allreduce import parse_bytes  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "latency")
CONTENDERS = ("MPI Allreduce", "gflow", "gflow out=")


def batch_seconds(comm, fn, batch: int) -> float:
    from mpi4py import MPI

    comm.Barrier()
    start = time.perf_counter()
    for _ in range(batch):
        fn()
    elapsed = (time.perf_counter() - start) / batch
    return comm.allreduce(elapsed, op=MPI.MAX)


def worker(args) -> None:
    from mpi4py import MPI

    import gflow

    comm = MPI.COMM_WORLD
    rows = []
    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        x = np.random.default_rng(comm.rank).random(nbytes // 4, dtype=np.float32)
        y, expected = np.empty_like(x), np.empty_like(x)
        comm.Allreduce(x, expected)
        runs = {
            "MPI Allreduce": lambda: comm.Allreduce(x, y, op=MPI.SUM),  # noqa: B023 - used in this pass
            "gflow": lambda: gflow.allreduce(x),  # noqa: B023
            "gflow out=": lambda: gflow.allreduce(x, out=y),  # noqa: B023
        }
        for name, fn in runs.items():  # warm up and check
            y.fill(np.nan)
            result = fn()
            got = y if result is None else result
            if not np.allclose(got, expected, rtol=1e-5, atol=1e-5 * comm.size):
                raise SystemExit(f"{name} gave a wrong result at {nbytes} bytes, p={comm.size}")
        batch = max(1, args.batch if nbytes <= 64 * 2**10 else args.batch // 10)
        times = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, fn in runs.items():
                times[name].append(batch_seconds(comm, fn, batch))
        medians = {name: float(np.median(t)) for name, t in times.items()}
        rows.append({"bytes": nbytes, "median_s": medians})
        if comm.rank == 0:
            mpi = medians["MPI Allreduce"]
            cells = "  ".join(
                f"{name} {t * 1e6:7.1f} us"
                + ("" if name == "MPI Allreduce" else f" (+{(t - mpi) * 1e6:5.1f}, {mpi / t:4.2f}x)")
                for name, t in medians.items()
            )
            print(f"p={comm.size} {_common.human_bytes(nbytes):>7}: {cells}", flush=True)
        nbytes *= 4 if nbytes < 2**10 else 2
    if comm.rank == 0:
        _common.write_json(
            os.path.join(args.out, f"latency_p{comm.size}.json"), {"p": comm.size, "rows": rows}
        )


def report(args) -> None:
    import json

    runs = []
    for p in args.procs:
        with open(os.path.join(args.out, f"latency_p{p}.json")) as f:
            runs.append(json.load(f))
    summary = {"machine": _common.machine(), "command": " ".join(["python"] + sys.argv), "runs": runs}
    _common.write_json(os.path.join(args.out, "latency.json"), summary)
    m = summary["machine"]
    lines = [
        f"Machine: {m['cores']} cores, {m['cpu']}, {m['mpi']}",
        "",
        "| p | size | MPI Allreduce (us) | gflow (us) | added | vs MPI | gflow out= (us) | added | vs MPI |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for row in run["rows"]:
            t = row["median_s"]
            mpi = t["MPI Allreduce"]
            cells = [f"{mpi * 1e6:.1f}"]
            for name in ("gflow", "gflow out="):
                cells += [f"{t[name] * 1e6:.1f}", f"{(t[name] - mpi) * 1e6:+.1f}", f"{mpi / t[name]:.2f}x"]
            lines.append(f"| {run['p']} | {_common.human_bytes(row['bytes'])} | " + " | ".join(cells) + " |")
    with open(os.path.join(args.out, "latency.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    _plot(runs, os.path.join(args.out, "latency.png"))


def _plot(runs, path: str) -> None:
    """What gflow adds to MPI's Allreduce (us) against size, one line per p."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        sizes = [row["bytes"] for row in run["rows"]]
        added = [(row["median_s"]["gflow"] - row["median_s"]["MPI Allreduce"]) * 1e6 for row in run["rows"]]
        ax.plot(sizes, added, marker="o", ms=3, label=f"p = {run['p']}")
    ax.axhline(0, color="gray", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes")
    ax.set_ylabel("gflow minus MPI Allreduce (us)")
    ax.set_title("What gflow adds to MPI's own Allreduce (validation on)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--min-bytes", type=parse_bytes, default=256)
    parser.add_argument("--max-bytes", type=parse_bytes, default=2**20)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    for p in args.procs:  # (the workers read the same arguments, --worker added)
        _common.launch(os.path.abspath(__file__), p, [*sys.argv[1:], "--worker"])
    report(args)


if __name__ == "__main__":
    main()
