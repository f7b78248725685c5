"""Allreduce side by side: gflow ring, hierarchical, auto and auto from a gradient pool, MPI's own
Allreduce (and torch gloo if installed).

    python bench/allreduce.py                      # p = 2, 3, 4; 4 KB .. 256 MB; writes bench/out/
    python bench/allreduce.py --procs 2 --max-bytes 16M --quick

For each world size it starts the ranks under mpiexec; for each message size the contenders run in
turn, one repetition each, again and again (so drift and noise hit all of them alike); the figure is
the median over repetitions of the slowest rank's time. algbw = bytes / time; busbw = algbw * 2(p-1)/p
(nccl-tests), the bytes each rank's link must carry, comparable across p and against the machine's
memcpy bandwidth, measured here with p processes copying at once. Writes JSON, a markdown table and a
PNG (busbw against size).
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def parse_bytes(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def repetitions(nbytes: int, quick: bool) -> int:
    reps = 50 if nbytes <= 2**20 else 20 if nbytes <= 16 * 2**20 else 7
    return max(3, reps // 4) if quick else reps


def contenders(comm, x, y, gloo: bool):
    """name -> zero-argument callable doing one allreduce of x into y on every rank. "gflow pool":
    x's values sit in a LazyAllreduce gradient pool (gradient_buffers), as a trainer's gradients do,
    which the node phase reads in place."""
    from mpi4py import MPI

    import gflow

    pooled = gflow.LazyAllreduce(comm=comm).gradient_buffers([x.shape], x.dtype)[0]
    pooled[...] = x
    runs = {
        "gflow ring": lambda: gflow.allreduce(x, out=y, algorithm="ring", comm=comm),
        "gflow hierarchical": lambda: gflow.allreduce(x, out=y, algorithm="hierarchical", comm=comm),
        "gflow auto": lambda: gflow.allreduce(x, out=y, comm=comm),
        "gflow pool": lambda: gflow.allreduce(pooled, out=y, comm=comm),
        "MPI Allreduce": lambda: comm.Allreduce(x, y, op=MPI.SUM),
    }
    if not gloo:
        return runs
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return runs
    torch.set_num_threads(1)  # one rank per core, as the MPI contenders run
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getppid() % 1000))
        dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)
    tensor = torch.from_numpy(y)

    def gloo():
        tensor.copy_(torch.from_numpy(x))
        dist.all_reduce(tensor)

    runs["torch gloo"] = gloo
    return runs


def worker(args) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    p, rank = comm.size, comm.rank
    results = {"p": p, "memcpy_Bps": _common.memcpy_bandwidth(comm), "rows": []}
    results["memcpy_Bps"] = comm.allreduce(results["memcpy_Bps"], op=MPI.MIN)
    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        n = nbytes // 4
        x = np.random.default_rng(rank).random(n, dtype=np.float32)
        y = np.empty_like(x)
        runs = contenders(comm, x, y, not args.no_gloo)
        expected = np.empty_like(x)
        comm.Allreduce(x, expected)
        for name, fn in runs.items():  # warm up (page faults, caches, connections) and check
            y.fill(np.nan)
            fn()
            if not np.allclose(y, expected, rtol=1e-5, atol=1e-5 * p):
                raise SystemExit(f"{name} gave a wrong result at {nbytes} bytes, p={p}")
        times = {name: [] for name in runs}
        for _ in range(repetitions(nbytes, args.quick)):
            for name, fn in runs.items():
                times[name].append(_common.timed(comm, fn))
        row = {"bytes": nbytes, "median_s": {k: float(np.median(v)) for k, v in times.items()}}
        results["rows"].append(row)
        if rank == 0:
            mpi = row["median_s"]["MPI Allreduce"]
            cells = "  ".join(f"{k} {v * 1e3:8.3f} ms ({mpi / v:4.2f}x)" for k, v in row["median_s"].items())
            print(f"p={p} {_common.human_bytes(nbytes):>7}: {cells}", flush=True)
        del x, y
        nbytes *= 4 if args.quick else 2
    if rank == 0:
        _common.write_json(os.path.join(args.out, f"allreduce_p{p}.json"), results)


def report(args) -> None:
    """Merge the per-p JSON files into one JSON, a markdown table and a plot."""
    runs = []
    for p in args.procs:
        with open(os.path.join(args.out, f"allreduce_p{p}.json")) as f:
            runs.append(__import__("json").load(f))
    summary = {"machine": _common.machine(), "command": " ".join(["python"] + sys.argv), "runs": runs}
    _common.write_json(os.path.join(args.out, "allreduce.json"), summary)

    m = summary["machine"]
    lines = [
        f"Machine: {m['cores']} cores, {m['cpu']}, {m['mpi']}",
        "",
        "| p | size | contender | time (ms) | algbw (GB/s) | busbw (GB/s) | busbw / memcpy | vs MPI |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        p, memcpy = run["p"], run["memcpy_Bps"]
        for row in run["rows"]:
            mpi = row["median_s"]["MPI Allreduce"]
            for name, t in row["median_s"].items():
                algbw = row["bytes"] / t
                busbw = algbw * 2 * (p - 1) / p
                size = _common.human_bytes(row["bytes"])
                lines.append(
                    f"| {p} | {size} | {name} | {t * 1e3:.3f} | {algbw / 1e9:.2f} | "
                    f"{busbw / 1e9:.2f} | {busbw / memcpy:.0%} | {mpi / t:.2f}x |"
                )
    lines.append("")
    lines.append(
        "memcpy bandwidth per process, p processes copying at once: "
        + ", ".join(f"p={r['p']}: {r['memcpy_Bps'] / 1e9:.2f} GB/s" for r in runs)
    )
    with open(os.path.join(args.out, "allreduce.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(runs, os.path.join(args.out, "allreduce.png"))


def plot(runs, path: str) -> None:
    plt = _common.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4), sharey=True, squeeze=False)
    for ax, run in zip(axes[0], runs, strict=True):
        p = run["p"]
        sizes = [row["bytes"] for row in run["rows"]]
        for name in run["rows"][0]["median_s"]:
            busbw = [row["bytes"] / row["median_s"][name] * 2 * (p - 1) / p / 1e9 for row in run["rows"]]
            ax.plot(sizes, busbw, marker="o", ms=3, label=name)
        ax.axhline(run["memcpy_Bps"] / 1e9, color="gray", ls="--", lw=1, label="memcpy (p copying)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"allreduce, p = {p}")
        ax.set_xlabel("message size (bytes)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("busbw (GB/s)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--min-bytes", type=parse_bytes, default=4 * 2**10)
    parser.add_argument("--max-bytes", type=parse_bytes, default=256 * 2**20)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument("--no-gloo", action="store_true", help="leave torch.distributed's gloo out")
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    passthrough = [a for a in sys.argv[1:]]
    for p in args.procs:
        print(f"--- p = {p} ---", flush=True)
        _common.launch(os.path.abspath(__file__), p, passthrough + ["--worker"])
    report(args)


if __name__ == "__main__":
    main()
