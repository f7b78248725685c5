"""What the caller's polling wait costs (issue 11): gflow.allreduce with the waits of this tree against
the waits before it (MPI's blocking Waitall, and a blocking Sendrecv for the ring's allgather steps),
in one job, alternating call blocks, so the machine's drift between jobs does not enter the ratio.

    mpiexec -n 2 python bench/wait_cost.py            # 4 KiB ... 16 MiB
    mpiexec -n 4 python bench/wait_cost.py 4096 65536

The figure per size is the median over 30 blocks of the slowest rank's mean time per call. Only the
communicator's own waits are swapped: the hierarchical node phase (auto from 256 KiB at p >= 3) waits
in its barrier the same way in both.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

import gflow
from gflow.runtime import context as _context
from gflow.runtime.waiting import watched

DEFAULT_SIZES = [4096, 16384, 65536, 1 << 20, 4 << 20, 16 << 20]


def blocking_sendrecv(self, sendbuf, dest, sendtag, recvbuf, source, recvtag):
    self.comm.Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag)


def main() -> None:
    comm = MPI.COMM_WORLD
    sizes = [int(s) for s in sys.argv[1:]] or DEFAULT_SIZES
    ctx = _context.context(None)
    waits = {"before": watched(MPI.Request.Waitall), "now": ctx.waitall}
    sendrecvs = {"before": blocking_sendrecv, "now": _context.CommContext.sendrecv}
    if comm.rank == 0:
        print("| p | size | before (us) | now (us) | now / before |\n|---|---|---|---|---|", flush=True)
    for nbytes in sizes:
        x = np.random.default_rng(comm.rank).standard_normal(nbytes // 4).astype(np.float32)
        out = np.empty_like(x)
        calls = 20 if nbytes < 1 << 20 else 5
        times = {"before": [], "now": []}
        for block in range(30):
            for name in ("before", "now") if block % 2 else ("now", "before"):
                ctx.waitall, _context.CommContext.sendrecv = waits[name], sendrecvs[name]
                gflow.allreduce(x, out=out)
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    gflow.allreduce(x, out=out)
                times[name].append(comm.allreduce((time.perf_counter() - start) / calls, op=MPI.MAX))
        if comm.rank == 0:
            before, now = np.median(times["before"]), np.median(times["now"])
            size = f"{nbytes // 1024} KiB"
            print(f"| {comm.size} | {size} | {before * 1e6:.1f} | {now * 1e6:.1f} | {now / before:.3f} |")
    ctx.waitall, _context.CommContext.sendrecv = waits["now"], sendrecvs["now"]


if __name__ == "__main__":
    main()
