"""`gflow demo`: gflow's allreduce beside MPI's own Allreduce on random float32 data, each result
checked against float64 and across ranks, both timed (medians, alternating)."""

import sys
import time


def demo(sizes_bytes: list[int], repeats: int) -> int:
    """Allreduce random float32 data with gflow and with MPI's own Allreduce; check and time both."""
    import numpy as np
    from mpi4py import MPI

    import gflow
    from gflow.runtime.mpi import launcher_mismatch, mpi_library

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    if (mismatch := launcher_mismatch()) is not None:  # (each rank would run a one-rank demo, "correct")
        print(f"gflow demo: {mismatch}", file=sys.stderr)
        return 1
    if rank == 0:
        print(f"gflow {gflow.__version__} on {size} rank{'s' if size > 1 else ''}, {mpi_library()}")
        if size == 1:  # (started without mpiexec: MPI against gflow alone says little)
            print("one rank: run it under mpiexec (mpiexec -n 4 python -m gflow demo) to compare ranks")
        print(f"{'size':>9} {'gflow (ms)':>11} {'MPI (ms)':>10} {'speedup':>8}  result")
    failures = 0
    for nbytes in sizes_bytes:
        x = np.random.default_rng(rank).standard_normal(nbytes // 4).astype(np.float32)
        ours, theirs = np.empty_like(x), np.empty_like(x)
        times = {"gflow": [], "mpi": []}
        for _ in range(repeats):  # alternate, so both see the same machine
            for name in times:
                comm.Barrier()
                t = time.perf_counter()
                if name == "gflow":
                    gflow.allreduce(x, out=ours)
                else:
                    comm.Allreduce(x, theirs)
                times[name].append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
        # Both sum in float32 in different orders: compare against float64 with that rounding allowed.
        exact = np.sum(comm.allgather(x.astype(np.float64)), axis=0)
        tol = (
            2 * size * np.finfo(np.float32).eps * np.sum(comm.allgather(np.abs(x).astype(np.float64)), axis=0)
        )
        same_everywhere = len(set(comm.allgather(ours.tobytes()))) == 1
        ok = bool(np.all(np.abs(ours - exact) <= tol)) and same_everywhere
        failures += not ok
        g, m = float(np.median(times["gflow"])), float(np.median(times["mpi"]))
        if rank == 0:
            label = f"{nbytes / 2**20:g} MB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KB"
            verdict = "correct, identical on all ranks" if ok else "WRONG"
            print(f"{label:>9} {g * 1e3:11.3f} {m * 1e3:10.3f} {m / g:7.2f}x  {verdict}", flush=True)
    if rank == 0:
        print("all results correct" if not failures else f"{failures} sizes gave wrong results")
    return 1 if failures else 0
