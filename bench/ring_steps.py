"""The ring's cost per step, compiled loops (GFLOW_NATIVE=1) against the Python loop, side by side.

    python bench/ring_steps.py                 # p = 2, 3, 4; writes bench/out/ring_steps/
    python bench/ring_steps.py --procs 2 --rounds 5

Per step: a ring allreduce of p * S float32 with one element per segment (ring_segment_bytes = 4)
makes (p - 1) * S reduce-scatter exchanges; the slope of its time from S = 1 to S = --segments is
the cost of one exchange-and-reduce (message latency included). Then whole ring allreduces of 4, 16
and 64 MB at the default segment, to show that nothing larger got slower. The two loops take turns
(one repetition each, --rounds times); figures are medians of the slowest rank's time.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "ring_steps")
LOOPS = {"compiled": True, "Python": False}


def worker(args) -> None:
    from mpi4py import MPI

    import gflow
    from gflow.runtime.config import DEFAULT_RING_SEGMENT_BYTES as DEFAULT_SEGMENT

    comm = MPI.COMM_WORLD

    def median_time(x, native: bool, reps: int, segment_bytes: int) -> float:
        gflow.config.native, gflow.config.ring_segment_bytes = native, segment_bytes
        fn = lambda: gflow.allreduce(x, algorithm="ring", out=y[: x.size])  # noqa: E731
        fn()  # warm up (and compile)
        return _common.timed(comm, lambda: [fn() for _ in range(reps)]) / reps

    y = np.empty(64 * 2**20 // 4, np.float32)
    times = {(loop, what): [] for loop in LOOPS for what in ("S=1", "S=many", "4 MB", "16 MB", "64 MB")}
    small = {what: np.ones(comm.size * s, np.float32) for what, s in (("S=1", 1), ("S=many", args.segments))}
    large = {
        f"{mb} MB": np.random.default_rng(comm.rank).random(mb * 2**18, dtype=np.float32)
        for mb in (4, 16, 64)
    }
    for round_ in range(args.rounds):
        for loop, native in LOOPS.items():
            for what, x in small.items():
                times[(loop, what)].append(median_time(x, native, 20, 4))
            for what, x in large.items():
                times[(loop, what)].append(median_time(x, native, 1, DEFAULT_SEGMENT))
        if comm.rank == 0:
            print(f"p={comm.size}: round {round_ + 1} of {args.rounds}", flush=True)
    med = {key: float(np.median(v)) for key, v in times.items()}
    segments = (comm.size - 1) * (args.segments - 1)
    result = {"p": comm.size, "segments": args.segments}
    for loop in LOOPS:
        result[loop] = {
            "per_step_s": (med[(loop, "S=many")] - med[(loop, "S=1")]) / segments,
            "tiny_s": med[(loop, "S=1")],
            **{what: med[(loop, what)] for what in ("4 MB", "16 MB", "64 MB")},
        }
    if comm.rank == 0:
        _common.write_json(os.path.join(args.out, f"ring_steps_p{comm.size}.json"), result)


def report(args) -> None:
    import json

    runs = []
    for p in args.procs:
        with open(os.path.join(args.out, f"ring_steps_p{p}.json")) as f:
            runs.append(json.load(f))
    machine = _common.machine()
    _common.write_json(os.path.join(args.out, "ring_steps.json"), {"machine": machine, "runs": runs})
    lines = [
        f"Machine: {machine['cores']} cores, {machine['cpu']}, {machine['mpi']}",
        "",
        "| p | loop | per step (us) | tiny ring (us) | 4 MB (ms) | 16 MB (ms) | 64 MB (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for loop in LOOPS:
            r = run[loop]
            lines.append(
                f"| {run['p']} | {loop} | {r['per_step_s'] * 1e6:.2f} | {r['tiny_s'] * 1e6:.1f} | "
                f"{r['4 MB'] * 1e3:.2f} | {r['16 MB'] * 1e3:.2f} | {r['64 MB'] * 1e3:.2f} |"
            )
    with open(os.path.join(args.out, "ring_steps.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--segments", type=int, default=201)
    parser.add_argument("--rounds", type=int, default=7)
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
