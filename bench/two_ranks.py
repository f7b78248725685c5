"""Recursive doubling or the ring at p = 2 (why "auto" takes recursive doubling up to 16x
small_message_bytes there: gflow/runtime/config.py, TWO_RANKS_FACTOR), beside MPI's Allreduce.

    python bench/two_ranks.py                  # 512 KB .. 4 MB, 15 rounds

The three contenders take turns, 20 calls each per round; medians of the slowest rank's time, in us.
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

SIZES = (128 * 2**10, 512 * 2**10, 2**20, 2 * 2**20, 4 * 2**20)


def worker() -> None:
    from mpi4py import MPI

    import gflow

    comm = MPI.COMM_WORLD
    gflow.config.small_message_bytes = 4 * 2**20  # (so that algorithm="recursive_doubling" takes every size)

    def timed(fn, calls=20):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return comm.allreduce((time.perf_counter() - start) / calls * 1e6, op=MPI.MAX)

    for nbytes in SIZES:
        x = np.random.default_rng(comm.rank).random(nbytes // 4, dtype=np.float32)
        y = np.empty_like(x)
        runs = {
            "MPI Allreduce": lambda x=x, y=y: comm.Allreduce(x, y),
            "recursive doubling": lambda x=x, y=y: gflow.allreduce(x, out=y, algorithm="recursive_doubling"),
            "ring": lambda x=x, y=y: gflow.allreduce(x, out=y, algorithm="ring"),
        }
        for fn in runs.values():
            fn()
        times = {name: [] for name in runs}
        for _ in range(15):
            for name, fn in runs.items():
                times[name].append(timed(fn))
        if comm.rank == 0:
            cells = "  ".join(f"{name} {np.median(t):8.1f}" for name, t in times.items())
            print(f"{_common.human_bytes(nbytes):>7}: {cells}", flush=True)


def main() -> None:
    if "--worker" in sys.argv:
        worker()
        return
    print(f"p = 2, us (machine: {_common.machine()})", flush=True)
    _common.launch(os.path.abspath(__file__), 2, ["--worker"])


if __name__ == "__main__":
    main()
