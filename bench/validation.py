"""What the cross-rank argument check costs: gflow auto with and without it, and the check alone.

    python bench/validation.py            # p = 2, 3, 4; writes bench/out/validation.{json,md}

The check alone is the header-only recursive-doubling exchange that runs before a ring (log2 p
tiny messages). On the latency path the same header travels in front of the payload, so
there is nothing to switch off there. Contenders alternate, one repetition each; medians of the
slowest rank's time.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
SIZES = [4 * 2**10, 64 * 2**10, 2**20, 16 * 2**20]


def worker(out_dir: str) -> None:
    from mpi4py import MPI

    import gflow
    from gflow.collectives.recursive_doubling import allreduce_with_agreement
    from gflow.runtime.context import context
    from gflow.runtime.signature import signature

    comm = MPI.COMM_WORLD
    ctx = context(comm)
    rows = []
    for nbytes in SIZES:
        x = np.random.default_rng(comm.rank).random(nbytes // 4, dtype=np.float32)
        y = np.empty_like(x)
        sig = signature("allreduce", "ring", x.size, x.dtype, "sum")

        def with_check(x=x, y=y):
            gflow.config.validate = True
            gflow.allreduce(x, out=y, comm=comm)

        def without_check(x=x, y=y):
            gflow.config.validate = False
            gflow.allreduce(x, out=y, comm=comm)

        runs = {
            "auto, validate on": with_check,
            "auto, validate off": without_check,
            "check alone": lambda: allreduce_with_agreement(ctx, sig, gflow.config.small_message_bytes),  # noqa: B023
        }
        times = {name: [] for name in runs}
        for _ in range(200 if nbytes <= 2**20 else 30):
            for name, fn in runs.items():
                times[name].append(_common.timed(comm, fn))
        gflow.config.validate = True
        row = {"bytes": nbytes, "median_s": {k: float(np.median(v)) for k, v in times.items()}}
        rows.append(row)
        if comm.rank == 0:
            cells = "  ".join(f"{k}: {v * 1e3:.4f} ms" for k, v in row["median_s"].items())
            print(f"p={comm.size} {_common.human_bytes(nbytes):>6}: {cells}", flush=True)
    if comm.rank == 0:
        _common.write_json(
            os.path.join(out_dir, f"validation_p{comm.size}.json"), {"p": comm.size, "rows": rows}
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.out)
        return
    lines = ["| p | size | auto, validate on (ms) | auto, validate off (ms) | check alone (ms) | on / off |"]
    lines.append("|---|---|---|---|---|---|")
    for p in args.procs:
        _common.launch(os.path.abspath(__file__), p, ["--out", args.out, "--worker"])
        with open(os.path.join(args.out, f"validation_p{p}.json")) as f:
            run = __import__("json").load(f)
        for row in run["rows"]:
            on, off, alone = row["median_s"].values()
            size = _common.human_bytes(row["bytes"])
            lines.append(
                f"| {p} | {size} | {on * 1e3:.3f} | {off * 1e3:.3f} | {alone * 1e3:.4f} | {on / off:.2f} |"
            )
    with open(os.path.join(args.out, "validation.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
