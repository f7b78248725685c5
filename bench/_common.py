"""Shared pieces of the benchmarks: launching MPI workers, timing side by side, memcpy bandwidth."""

import json
import os
import platform
import subprocess
import sys
import time

import numpy as np


def mpiexec() -> str:
    """The mpiexec beside this Python (the MPICH wheel's), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else "mpiexec"


ONE_THREAD = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def launch(script: str, nprocs: int, args: list[str], env=None, timeout=3600) -> None:
    """Run `script` under mpiexec with nprocs ranks; its stdout streams through (progress). Each rank
    gets one BLAS/OpenMP thread unless `env` (default: this process's) says otherwise: ranks share
    the cores, and several threads each thrash them."""
    env = dict(os.environ if env is None else env)
    for name in ONE_THREAD:
        env.setdefault(name, "1")
    cmd = [mpiexec(), "-n", str(nprocs), sys.executable, script, *args]
    subprocess.run(cmd, check=True, env=env, timeout=timeout)


def machine() -> dict:
    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    info["python"] = sys.version.split()[0]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    from mpi4py import MPI

    info["mpi"] = MPI.Get_library_version().splitlines()[0].strip()
    info["numpy"] = np.__version__
    return info


def memcpy_bandwidth(comm, nbytes: int = 64 * 2**20, reps: int = 10) -> float:
    """Bytes/s one rank copies while every rank of comm copies at once (read + write counted once,
    as a copy's size; the usual memcpy figure)."""
    src = np.random.default_rng(comm.rank).random(nbytes // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(reps):
        comm.Barrier()
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return nbytes / float(np.median(times))


def timed(comm, fn) -> float:
    """One synchronized run of fn on every rank; the slowest rank's seconds."""
    from mpi4py import MPI

    comm.Barrier()
    t = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - t
    return comm.allreduce(elapsed, op=MPI.MAX)


def alternated_medians_us(comm, runs: dict, calls: int, rounds: int = 15) -> dict:
    """For each named function of runs, the median over rounds of the slowest rank's microseconds per
    call; each round runs every contender once, `calls` times back to back, so drift hits all alike."""
    from mpi4py import MPI

    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append(comm.allreduce((time.perf_counter() - start) / calls * 1e6, op=MPI.MAX))
    return {name: float(np.median(t)) for name, t in times.items()}


def write_json(path: str, data) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def human_bytes(n: int) -> str:
    """4096 -> '4 KB', 268435456 -> '256 MB' (binary units, as the sizes are powers of two)."""
    for unit in ("B", "KB", "MB"):
        if n < 1024:
            return f"{n:g} {unit}"
        n /= 1024
    return f"{n:g} GB"


def pyplot():
    """matplotlib.pyplot on a file-only backend, or None (with a note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install gflow[bench])")
        return None
    return plt
