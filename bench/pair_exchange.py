"""What could make a two-rank latency path faster than MPI's own Allreduce (issue 27): two candidates
measured against MPI's Allreduce at p = 2 on one host, alternated, in plain mpi4py and Numba.

    python bench/pair_exchange.py              # the MPI under .venv (mpiexec from bench/_common)

Contenders, each an allreduce (sum, float32) that checks a 16-word header as gflow's latency path does:
- "MPI Allreduce": the payload alone, for scale (no header, no check).
- "two calls": the header agreed by one MPI_Allreduce (MIN of [h, -h]: every rank sees any
  difference), then MPI's Allreduce of the payload; and the same with Iallreduce and a polling wait
  (what a watched wait would need).
- "shared memory": both ranks' [header | payload] in one shared window (two slots per rank, used
  alternately, each behind a sequence number the writer sets last); each rank copies its message in,
  waits for its peer's number, compares the headers and sums the payloads, lower rank first (so both
  get the same bits). The whole call is one compiled function. Stores are ordered on x86-64 only.
Medians of the slowest rank's time per call over rounds, in microseconds.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

SIZES = (256, 1024, 4096, 8192, 16384, 65536)
HEADER_WORDS = 16
ROOM = 64 * 1024  # the largest payload a slot holds
SLOT = 16 + HEADER_WORDS * 8 + ROOM  # [sequence number, spare | header | payload]


def _compiled_exchange():
    from numba import njit, types

    sched_yield = types.ExternalFunction("sched_yield", types.int32())

    @njit
    def exchange(slots, header, x, out, seq, rank):
        """slots: (2 ranks, 2 parities, SLOT) bytes of the shared window."""
        par = seq & 1
        nbytes = x.size * x.itemsize
        words = header.size
        mine = slots[rank, par]
        mine[16 : 16 + words * 8].view(np.int64)[:] = header
        mine[16 + words * 8 : 16 + words * 8 + nbytes] = x.view(np.uint8)
        mine[:8].view(np.int64)[0] = seq  # last: the peer reads nothing before it sees this
        theirs = slots[1 - rank, par]
        flag = theirs[:8].view(np.int64)
        while flag[0] != seq:
            sched_yield()  # (an external call: the load is not hoisted out of the loop)
        their_header = theirs[16 : 16 + words * 8].view(np.int64)
        for k in range(words):
            if their_header[k] != header[k]:
                return 1
        low = slots[0, par, 16 + words * 8 : 16 + words * 8 + nbytes].view(x.dtype)
        high = slots[1, par, 16 + words * 8 : 16 + words * 8 + nbytes].view(x.dtype)
        for i in range(out.size):
            out[i] = low[i] + high[i]
        return 0

    return exchange


def worker() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    rank = comm.rank
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    assert node.size == 2, "run at p = 2 on one host"
    win = MPI.Win.Allocate_shared(2 * SLOT, 8, comm=node)
    base, _ = win.Shared_query(0)
    slots = np.frombuffer(MPI.memory.fromaddress(base.address, 2 * 2 * SLOT), np.uint8).reshape(2, 2, SLOT)
    slots[rank] = 0
    node.Barrier()
    exchange = _compiled_exchange()
    header = np.arange(1, HEADER_WORDS + 1, dtype=np.int64)
    extremes = np.concatenate([header, -header])
    agreed = np.empty_like(extremes)
    seq = [0]

    def shared(x, out):
        seq[0] += 1
        if exchange(slots, header, x, out, seq[0], rank):
            raise RuntimeError("headers differ")

    def spin(request):
        while not request.Test():
            pass

    def two_calls(x, out):
        comm.Allreduce(extremes, agreed, op=MPI.MIN)
        comm.Allreduce(x, out)

    def two_calls_polled(x, out):
        spin(comm.Iallreduce(extremes, agreed, op=MPI.MIN))
        spin(comm.Iallreduce(x, out))

    for n in SIZES:
        x = np.random.default_rng(rank).standard_normal(n // 4).astype(np.float32)
        out, reference = np.full_like(x, np.nan), np.empty_like(x)
        comm.Allreduce(x, reference)
        shared(x, out)  # (compiles on the first size)
        assert np.array_equal(out, reference), "shared memory's sum differs from MPI's"
        runs = {
            "MPI Allreduce": lambda x=x, out=out: comm.Allreduce(x, out),
            "two calls": lambda x=x, out=out: two_calls(x, out),
            "two calls polled": lambda x=x, out=out: two_calls_polled(x, out),
            "shared memory": lambda x=x, out=out: shared(x, out),
        }
        medians = _common.alternated_medians_us(comm, runs, calls=400 if n <= 16384 else 100)
        if rank == 0:
            cells = "  ".join(f"{name} {t:6.1f}" for name, t in medians.items())
            print(f"{_common.human_bytes(n):>7}: {cells}", flush=True)
    node.Barrier()
    win.Free()


def main() -> None:
    if "--worker" in sys.argv:
        worker()
        return
    print(f"allreduce at p = 2 with a header check, us (machine: {_common.machine()})", flush=True)
    _common.launch(os.path.abspath(__file__), 2, ["--worker"])


if __name__ == "__main__":
    main()
