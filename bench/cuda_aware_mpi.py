"""Is the MPI library that mpi4py loaded CUDA-aware? Asks it, then tries it (issue 26, item 3).

    python bench/cuda_aware_mpi.py            # under the MPI to probe (its mpiexec first on PATH)

Prints the library, what it answers to MPIX_Query_cuda_support / MPIX_GPU_query_support, and then,
in a job of 2 ranks bounded by a timeout, hands MPI's own Allreduce a CuPy array's device memory
(2 Mi float32 of random data) and checks the sum against the host's. A library that is not CUDA-aware
reads the device pointer as host memory: the job crashes (or, in a unified address space, sums
nothing it should), which is reported as such rather than taken for an answer.
"""

import os
import subprocess
import sys

import numpy as np


def worker() -> None:
    import cupy
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    host = np.random.default_rng(comm.rank).standard_normal(2 * 2**20).astype(np.float32)
    src, dst = cupy.asarray(host), cupy.full(host.size, np.nan, np.float32)
    cupy.cuda.runtime.deviceSynchronize()
    comm.Allreduce(src, dst)
    expected = np.sum(comm.allgather(host.astype(np.float64)), axis=0)
    ok = bool(np.allclose(cupy.asnumpy(dst), expected, rtol=1e-5, atol=1e-5))
    if comm.rank == 0:
        print(f"device-memory Allreduce at p = {comm.size}: {'correct' if ok else 'WRONG'}", flush=True)


def main() -> None:
    if "--worker" in sys.argv:
        worker()
        return
    from mpi4py import MPI

    from gflow.cuda import transport

    library = MPI.Get_library_version().splitlines()[0].strip()
    answer = transport._library_cuda_support()
    said = {True: "yes", False: "no", None: "has no such query"}[answer]
    print(f"MPI library: {library}")
    print(f"CUDA-aware, by MPIX_Query_cuda_support / MPIX_GPU_query_support: {said}", flush=True)
    command = ["mpiexec", "-n", "2", sys.executable, os.path.abspath(__file__), "--worker"]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        print("device-memory Allreduce at p = 2: hung (killed after 90 s)")
        return
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    if run.returncode == 0 and lines:
        print(lines[-1])
    else:
        print(f"device-memory Allreduce at p = 2: failed (exit {run.returncode}): " + " | ".join(lines[-4:]))


if __name__ == "__main__":
    main()
