"""What a rank in join() costs the ranks still training: its CPU, their allreduces' latency, and their
computation's speed, with the joined rank's caller channel waiting as it does now (sleeping between
polls, collectives/join._politely) and as it did before stop 59 (polling without sleep), alternated
block by block in one job.

    mpiexec -n 3 python bench/joined_rank.py     # (gflow.torch; one torch/BLAS thread per rank)

Rank 0 joins at once in each block; the others either make 100 allreduces of 16 or 262,144 float32
(back to back, or 2 ms of computation before each), or compute for 1 s, then join. Each figure is
the median over the blocks of that contender.
"""

import contextlib
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

import gflow.torch as hvd
from gflow.collectives import join as join_module

torch.set_num_threads(1)
BLOCKS = 6  # (per contender and case)
CASES = [("16 floats, back to back", 16, 0.0), ("16 floats, 2 ms apart", 16, 0.002)]
CASES += [("1 MB, back to back", 262_144, 0.0), ("computation (work units in 1 s)", 0, 1.0)]


@contextlib.contextmanager
def _spinning(ctx):
    yield


def one_block(case, contender) -> tuple:
    """(rank 0's CPU / wall in join(), the others' median allreduce in us or work units)."""
    _, count, gap = case
    join_module._politely = _spinning if contender == "polling" else POLITELY
    MPI.COMM_WORLD.Barrier()
    if hvd.rank() == 0:
        wall, cpu = time.monotonic(), time.process_time()
        hvd.join()
        return (time.process_time() - cpu) / (time.monotonic() - wall), None
    if count == 0:  # computation alone
        end, units = time.monotonic() + gap, 0
        while time.monotonic() < end:
            sum(range(20_000))
            units += 1
        hvd.join()
        return None, units
    x, times = torch.rand(count), []
    for _ in range(100):
        end = time.perf_counter() + gap
        while time.perf_counter() < end:
            pass
        start = time.perf_counter()
        hvd.allreduce(x, name="x")
        times.append(time.perf_counter() - start)
    hvd.join()
    return None, float(np.median(times)) * 1e6


POLITELY = join_module._politely


def main() -> None:
    hvd.init()
    comm = MPI.COMM_WORLD
    hvd.allreduce(torch.ones(1))
    if comm.rank == 0:
        print(f"p = {comm.size}; {BLOCKS} blocks per contender and case, alternated", flush=True)
        print("| case | contender | joined rank's CPU / wall | the others' figure |\n|---|---|---|---|")
    for case in CASES:
        figures = {"polling": [], "sleeping": []}
        for block in range(BLOCKS):
            for contender in ("polling", "sleeping") if block % 2 else ("sleeping", "polling"):
                share, figure = one_block(case, contender)
                gathered = comm.gather((share, figure), root=0)
                if comm.rank == 0:
                    others = [f for _, f in gathered[1:]]
                    figures[contender].append((gathered[0][0], float(np.mean(others))))
        if comm.rank == 0:
            unit = "units" if case[1] == 0 else "us"
            for contender, rows in figures.items():
                share, figure = np.median([r[0] for r in rows]), np.median([r[1] for r in rows])
                print(f"| {case[0]} | {contender} | {share:.2f} | {figure:.0f} {unit} |", flush=True)
    join_module._politely = POLITELY
    sys.stdout.flush()


if __name__ == "__main__":
    main()
