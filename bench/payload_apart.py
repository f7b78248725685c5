"""Why the latency path sends payloads from 16 KB apart from their header (recursive_doubling.py's
SEPARATE_PAYLOAD_BYTES): one exchange at p = 2 in plain mpi4py, three ways, alternated.

    python bench/payload_apart.py            # the MPI under .venv (mpiexec from bench/_common)

"copied": the payload copied behind a 160-byte header, one message each way (the latency path below
16 KB); "apart": the header, then the payload as a message of its own straight from the array; and
MPI's own Allreduce of the payload for scale; "split" (above 8 KB): two messages each under MPICH's
eager limit, both posted at once. Medians of 7 rounds, in microseconds.
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

HEADER, ROOM = 160, 4 * 2**20
EAGER = 8000  # split's first message, header included: under MPICH's eager limit
SIZES = (1024, 4096, 6144, 8192, 12288, 16384, 65536, 131072)


def copied(comm, peer, send, recv, src, n) -> None:
    """The payload copied behind the header: one message each way, then the reduction."""
    from mpi4py import MPI

    send[HEADER : HEADER + n] = src.view(np.uint8)
    requests = [comm.Irecv([recv, MPI.BYTE], peer, 3), comm.Isend([send[: HEADER + n], MPI.BYTE], peer, 3)]
    MPI.Request.Waitall(requests)
    np.add(send[HEADER : HEADER + n].view(np.float32), recv[HEADER : HEADER + n].view(np.float32))


def apart(comm, peer, send, recv, src, n) -> None:
    """The header, then the payload straight from src; the payload's receive posted once the header is in."""
    from mpi4py import MPI

    requests = [
        comm.Irecv([recv, MPI.BYTE], peer, 3),
        comm.Isend([send[:HEADER], MPI.BYTE], peer, 3),
        comm.Isend([src, MPI.BYTE], peer, 3),
    ]
    requests[0].Wait()
    requests.append(comm.Irecv([recv[HEADER:], MPI.BYTE], peer, 3))
    MPI.Request.Waitall(requests)
    np.add(src, recv[HEADER : HEADER + n].view(np.float32))


def split(comm, peer, send, recv, src, n) -> None:
    """Two messages under MPICH's eager limit (8,150 B): the header with the payload's first bytes
    copied behind it, then the rest; both receives posted at once (what "apart" cannot do at 8 KB)."""
    from mpi4py import MPI

    head = min(n, EAGER - HEADER)
    send[HEADER : HEADER + n] = src.view(np.uint8)
    requests = [
        comm.Irecv([recv[: HEADER + head], MPI.BYTE], peer, 3),
        comm.Irecv([recv[HEADER + head : HEADER + n], MPI.BYTE], peer, 3),
        comm.Isend([send[: HEADER + head], MPI.BYTE], peer, 3),
        comm.Isend([send[HEADER + head : HEADER + n], MPI.BYTE], peer, 3),
    ]
    MPI.Request.Waitall(requests)
    np.add(send[HEADER : HEADER + n].view(np.float32), recv[HEADER : HEADER + n].view(np.float32))


def worker() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    peer = 1 - comm.rank
    send, recv = np.zeros(HEADER + ROOM, np.uint8), np.zeros(HEADER + ROOM, np.uint8)

    def timed(fn, calls):
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        return comm.allreduce((time.perf_counter() - start) / calls * 1e6, op=MPI.MAX)

    for n in SIZES:
        src = np.random.default_rng(comm.rank).random(n // 4, dtype=np.float32)
        dst = np.empty_like(src)
        runs = {
            "MPI Allreduce": lambda src=src, dst=dst: comm.Allreduce(src, dst),
            "copied": lambda n=n, src=src: copied(comm, peer, send, recv, src, n),
            "apart": lambda n=n, src=src: apart(comm, peer, send, recv, src, n),
            "split": lambda n=n, src=src: split(comm, peer, send, recv, src, n),
        }
        calls = 2000 if n <= 16384 else 300
        times = {name: [] for name in runs}
        for _ in range(7):
            for name, fn in runs.items():
                times[name].append(timed(fn, calls))
        if comm.rank == 0:
            cells = "  ".join(f"{name} {np.median(t):6.2f}" for name, t in times.items())
            print(f"{_common.human_bytes(n):>7}: {cells}", flush=True)


def main() -> None:
    if "--worker" in sys.argv:
        worker()
        return
    print(f"payload exchange at p = 2, us (machine: {_common.machine()})", flush=True)
    _common.launch(os.path.abspath(__file__), 2, ["--worker"])


if __name__ == "__main__":
    main()
