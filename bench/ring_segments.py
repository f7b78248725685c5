"""The ring's segment size side by side: gflow.allreduce with config.ring_segment_bytes set per call.

    python bench/ring_segments.py                                 # p = 2, 3, 4; 256 KiB against 1 MiB
    python bench/ring_segments.py --procs 4 --segments 256K 1M 4M --sizes 4M 64M

The ring's reduce-scatter moves each chunk in segments of config.ring_segment_bytes (the default:
gflow/runtime/config.py). Every contender runs in the same job, alternating batch by batch (calls back
to back, about 8 MB of payload a batch), with algorithm "ring" and "auto"; medians of the slowest rank.
Under an emulated network the question is a training step's, not one call's: bench/step_breakdown.py
with GFLOW_RING_SEGMENT_BYTES set.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

from gflow.tools.benchmark import parse_size  # noqa: E402


def worker(args) -> None:
    from mpi4py import MPI

    import gflow

    comm = MPI.COMM_WORLD
    lines = []
    for nbytes in args.sizes:
        x = np.random.default_rng(comm.rank).random(nbytes // 4, dtype=np.float32)
        y = np.empty_like(x)

        def contender(segment, algorithm, x=x, y=y):
            def run():
                gflow.config.ring_segment_bytes = segment  # (alike on every rank: read by the call)
                gflow.allreduce(x, out=y, algorithm=algorithm)

            return run

        runs = {
            (algorithm, segment): contender(segment, algorithm)
            for algorithm in ("ring", "auto")
            for segment in args.segments
        }
        calls = max(1, 2**23 // nbytes)
        medians = _common.alternated_medians_us(comm, runs, calls, rounds=9 if nbytes < 2**25 else 5)
        first = args.segments[0]
        cells = []
        for (algorithm, segment), us in medians.items():
            ratio = us / medians[(algorithm, first)]
            cells.append(f"{algorithm} {_common.human_bytes(segment)} {us / 1e3:.2f} ms ({ratio:.2f}x)")
        lines.append(f"p={comm.size} {_common.human_bytes(nbytes):>7}: " + "  ".join(cells))
    if comm.rank == 0:
        print("\n".join(lines), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--segments", nargs="+", default=["256K", "1M"], help="sizes: 256K, 1M, ...")
    parser.add_argument("--sizes", nargs="+", default=["1M", "4M", "16M", "64M"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.segments = [parse_size(s) for s in args.segments]
    args.sizes = [parse_size(s) for s in args.sizes]
    if args.worker:
        worker(args)
        return
    print(f"ring segments {[_common.human_bytes(s) for s in args.segments]}; ratios against the first")
    for p in args.procs:
        worker_args = ["--worker", "--segments", *map(str, args.segments), "--sizes", *map(str, args.sizes)]
        _common.launch(os.path.abspath(__file__), p, worker_args)


if __name__ == "__main__":
    main()
