"""Command line: `python -m gflow demo` (under mpiexec) and `python -m gflow info`.

mpiexec -n 4 python -m gflow demo     # gflow's allreduce beside MPI's own, checked and timed
python -m gflow info                  # what this installation sees: paste it into bug reports
mpiexec -n 4 python -m gflow info     # ... and the nodes (topology) gflow finds among the ranks
"""

import argparse
import sys
import time


def demo(sizes_bytes: list[int], repeats: int) -> int:
    """Allreduce random float32 data with gflow and with MPI's own Allreduce; check and time both."""
    import numpy as np
    from mpi4py import MPI

    import gflow

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    if rank == 0:
        print(
            f"gflow {gflow.__version__} on {size} ranks, {MPI.Get_library_version().splitlines()[0].strip()}"
        )
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


def info() -> int:
    """Print the MPI library, thread level, package versions and whether a GPU is seen."""
    import numpy as np
    from mpi4py import MPI

    import gflow

    levels = {
        MPI.THREAD_SINGLE: "single",
        MPI.THREAD_FUNNELED: "funneled",
        MPI.THREAD_SERIALIZED: "serialized",
        MPI.THREAD_MULTIPLE: "multiple",
    }
    lines = {
        "gflow": gflow.__version__,
        "python": sys.version.split()[0],
        "mpi4py": __import__("mpi4py").__version__,
        "MPI library": MPI.Get_library_version().splitlines()[0].strip(),
        "MPI standard": "{}.{}".format(*MPI.Get_version()),
        "thread level": levels.get(MPI.Query_thread(), str(MPI.Query_thread())),
        "world size": MPI.COMM_WORLD.size,
        "topology": _topology(),
        "numpy": np.__version__,
        "validate": gflow.config.validate,
        "small_message_bytes": gflow.config.small_message_bytes,
        "ring_segment_bytes": gflow.config.ring_segment_bytes,
    }
    for name in ("numba", "numba_cuda", "cupy", "torch"):
        try:
            module = __import__(name)
            lines[name] = getattr(module, "__version__", "installed")
        except ImportError:
            lines[name] = "not installed"
    try:
        from numba import cuda

        lines["GPU"] = ", ".join(
            d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in cuda.gpus
        )
    except Exception as exc:  # noqa: BLE001 - any failure here just means no usable GPU
        lines["GPU"] = f"none seen ({type(exc).__name__})"
    if not lines["GPU"]:
        lines["GPU"] = "none seen"
    try:
        from .cuda import transport

        lines["device buffers"] = transport.describe()
    except Exception as exc:  # noqa: BLE001 - Numba's CUDA support may fail to load without a GPU
        lines["device buffers"] = f"unavailable ({type(exc).__name__})"
    if MPI.COMM_WORLD.rank == 0:
        width = max(map(len, lines))
        for key, value in lines.items():
            print(f"{key:>{width}}: {value}")
    return 0


def _topology() -> str:
    """The nodes gflow sees on COMM_WORLD (collective: under mpiexec every rank runs info)."""
    from mpi4py import MPI

    from .collectives.topology import discover

    try:
        return discover(MPI.COMM_WORLD).describe()
    except Exception as exc:  # noqa: BLE001 - a bad setting is what info is asked to show
        return f"unknown ({type(exc).__name__}: {exc})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="gflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo", help="allreduce with gflow and with MPI's own, side by side (run under mpiexec)"
    )
    d.add_argument(
        "--sizes", default="4K,64K,1M,4M,16M", help="message sizes (K/M suffixes), comma-separated"
    )
    d.add_argument("--repeats", type=int, default=15)
    sub.add_parser("info", help="versions, MPI library and thread level, GPU seen or not")
    args = parser.parse_args(argv)
    if args.command == "info":
        return info()
    units = {"K": 2**10, "M": 2**20}
    sizes = [
        int(float(s[:-1]) * units[s[-1].upper()]) if s[-1].upper() in units else int(s)
        for s in args.sizes.split(",")
    ]
    return demo(sizes, args.repeats)


if __name__ == "__main__":
    sys.exit(main())
