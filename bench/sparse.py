"""CSC against dense allreduce on AlexNet- and ResNet-50-sized float32 gradients.

    python bench/sparse.py                                   # p = 2, 4; shared memory and 1 Gbit/s links
    python bench/sparse.py --models alexnet --procs 4 --networks 1gbit

Contenders, one step each in turn, repeatedly: dense fp32, dense fp16, and CSC (SparseAllreduce) at
10%, 1% and 0.1% density with fp32 and fp16 payloads, at the default chunk length. Reports the median
step time (slowest rank), the bytes each rank sends (modelled: ring 2(p-1)/p of the message, norms
included for CSC), and for CSC the time in its local phases (residual update + chunk norms, selection,
pack, scatter-add + clearing) and the bytes those phases touch per second, against the memcpy bandwidth
of p processes copying at once. Writes bench/out/sparse.{json,md}.
"""

import argparse
import glob
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import netem  # noqa: E402
from fusion import wire_bytes  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
MODELS = {"alexnet": 61_100_840, "resnet50": 25_557_032}


def worker(args) -> None:
    from mpi4py import MPI

    import gflow
    from gflow.fusion.sparse import DEFAULT_CHUNK_ELEMS

    comm = MPI.COMM_WORLD
    p, n = comm.size, MODELS[args.model]
    rng = np.random.default_rng(comm.rank)
    grad = rng.standard_normal(n, dtype=np.float32)
    out = np.empty_like(grad)
    small = gflow.config.small_message_bytes
    memcpy = comm.allreduce(_common.memcpy_bandwidth(comm), op=MPI.MIN)
    chunk = DEFAULT_CHUNK_ELEMS
    nchunks = -(-n // chunk)
    runs, wire, cscs = {}, {}, {}
    for compression in (None, "fp16"):
        label = "fp16" if compression else "fp32"
        runs[f"dense {label}"] = lambda c=compression: gflow.allreduce(grad, "mean", out=out, compression=c)
        wire[f"dense {label}"] = wire_bytes(n * (2 if compression else 4), p, small)
        for density in (0.1, 0.01, 0.001):
            name = f"CSC {density:.1%} {label}"
            csc = cscs[name] = gflow.SparseAllreduce(density=density, op="mean", compression=compression)
            runs[name] = lambda csc=csc: csc(grad)
            k = int(np.ceil(density * nchunks))
            wire[name] = wire_bytes(4 * nchunks, p, small) + wire_bytes(
                k * chunk * (2 if compression else 4), p, small
            )
    for fn in runs.values():
        fn()
    times = {name: [] for name in runs}
    phases = {name: [] for name in cscs}
    for rep in range(args.reps):
        for name, fn in runs.items():
            times[name].append(_common.timed(comm, fn))
            if name in cscs:
                phases[name].append(cscs[name].stats["seconds"])
        if comm.rank == 0:
            print(f"  {args.model} p={p} {args.network}: repetition {rep + 1}/{args.reps}", flush=True)
    if comm.rank != 0:
        return
    dense = wire["dense fp32"]
    rows = []
    for name, ts in times.items():
        row = {
            "contender": name,
            "seconds": float(np.median(ts)),
            "wire_bytes": wire[name],
            "of_dense": wire[name] / dense,
        }
        if name in cscs:
            local = {k: float(np.median([ph[k] for ph in phases[name]])) for k in phases[name][0]}
            stats = cscs[name].stats
            k_elems = stats["chunks_sent"] * chunk
            # Bytes the local phases touch: residual update reads u, g, v and writes u, v; the norms
            # read v; pack reads and writes k elements; the update is zeroed and scattered into;
            # the sent chunks of v and u are cleared.
            touched = 4 * (5 * n + n + 2 * k_elems + n + k_elems + 2 * k_elems)
            row.update(local_seconds=local, local_Bps=touched / sum(local.values()), memcpy_Bps=memcpy)
        rows.append(row)
        print(
            f"    {name:22s} {row['seconds'] * 1e3:9.1f} ms  wire {row['of_dense']:7.2%} of dense", flush=True
        )
    result = {
        "model": args.model,
        "p": p,
        "network": args.network,
        "elements": n,
        "chunk_elems": chunk,
        "rows": rows,
    }
    _common.write_json(os.path.join(args.out, f"sparse_{args.model}_p{p}_{args.network}.json"), result)


def report(out_dir: str) -> None:
    local_phases = "local work (ms): residual+norms / select / pack / scatter+clear"
    header = ["model", "p", "network", "contender", "step (ms)", "vs dense fp32", "wire bytes vs dense",
              local_phases, "local GB/s (of memcpy)"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    results = []
    for path in sorted(glob.glob(os.path.join(out_dir, "sparse_*_p*_*.json"))):
        with open(path) as f:
            r = json.load(f)
        results.append(r)
        dense = next(row["seconds"] for row in r["rows"] if row["contender"] == "dense fp32")
        for row in r["rows"]:
            local = bw = ""
            if "local_seconds" in row:
                local = " / ".join(f"{v * 1e3:.1f}" for v in row["local_seconds"].values())
                bw = f"{row['local_Bps'] / 1e9:.2f} ({row['local_Bps'] / row['memcpy_Bps']:.0%})"
            cells = [r["model"], r["p"], r["network"], row["contender"], f"{row['seconds'] * 1e3:.1f}",
                     f"{dense / row['seconds']:.2f}x", f"{row['of_dense']:.2%}", local, bw]  # fmt: skip
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "sparse.md"), "w") as f:
        f.write(text)
    _common.write_json(
        os.path.join(out_dir, "sparse.json"), {"machine": _common.machine(), "results": results}
    )
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["resnet50", "alexnet"], choices=list(MODELS))
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--networks", nargs="+", default=["shm", "1gbit"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--report", action="store_true", help="only rebuild the table from --out")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--network", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if not args.report:
        for model in args.models:
            for network in args.networks:
                for p in args.procs:
                    print(f"--- {model}, p={p}, {network} ---", flush=True)
                    worker_args = [
                        "--worker",
                        "--model",
                        model,
                        "--network",
                        network,
                        "--reps",
                        str(args.reps),
                        "--out",
                        args.out,
                    ]
                    netem.launch(
                        os.path.abspath(__file__),
                        p,
                        worker_args,
                        None if network == "shm" else netem.parse_rate(network),
                    )
    report(args.out)


if __name__ == "__main__":
    main()
