"""The prototype behind gflow's slots for every rank of one host (gflow/collectives/shared_slots.py at
p = 3 and 4, issue 27): k ranks exchange [header | payload] through one shared window, measured
against MPI's own Allreduce, alternated, in plain mpi4py and Numba. It sized what a slot carries
(recursive_doubling.NODE_READ_BYTES); bench/latency.py measures gflow itself.

    python bench/node_exchange.py                  # p = 3 and 4, the MPI under .venv
    python bench/node_exchange.py --procs 2 3 4 8

"Node slots": each rank copies its message into its own slot (two per rank, used alternately, each
behind a sequence number the writer sets last), waits until every other rank's number is there,
compares every header with its own, and sums all payloads in rank order straight from the slots, so
every rank holds the same bits; one compiled call. A rank writes a slot again two exchanges later,
which it cannot begin before every peer has posted the one between, by when each has read it.
Medians of the slowest rank's time per call over rounds, in microseconds. Stores are ordered on
x86-64 only.
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

SIZES = (256, 1024, 4096, 16384, 65536, 262144, 1048576)
HEADER_WORDS = 25  # gflow's header at the default signature length
ROOM = 1 << 20  # the largest payload a slot holds
SLOT = 64 + HEADER_WORDS * 8 + ROOM  # [sequence number, spare | header | payload]


def _compiled_exchange():
    from numba import njit, types

    sched_yield = types.ExternalFunction("sched_yield", types.int32())

    @njit(nogil=True)
    def exchange(slots, header, x, out, seq, rank):
        """slots: (k ranks, 2 parities, SLOT) bytes of the shared window; 1 where a header differs."""
        k = slots.shape[0]
        par = seq & 1
        h = header.size * 8
        nbytes = x.size * x.itemsize
        mine = slots[rank, par]
        mine[64 : 64 + h] = header.view(np.uint8)
        mine[64 + h : 64 + h + nbytes] = x.view(np.uint8)
        mine[:8].view(np.int64)[0] = seq  # last: the peers read nothing before they see this
        for r in range(k):
            flag = slots[r, par, :8].view(np.int64)
            while flag[0] != seq:
                sched_yield()  # (an external call: the load is not hoisted out of the loop)
        for r in range(k):
            theirs = slots[r, par, 64 : 64 + h]
            for b in range(h):
                if theirs[b] != mine[64 + b]:
                    return 1
        first = slots[0, par, 64 + h : 64 + h + nbytes].view(x.dtype)
        second = slots[1, par, 64 + h : 64 + h + nbytes].view(x.dtype)
        for i in range(out.size):
            out[i] = first[i] + second[i]
        for r in range(2, k):
            part = slots[r, par, 64 + h : 64 + h + nbytes].view(x.dtype)
            for i in range(out.size):
                out[i] += part[i]
        return 0

    return exchange


def worker() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    rank, k = comm.rank, comm.size
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    assert node.size == k, "run on one host"
    win = MPI.Win.Allocate_shared(2 * SLOT, 8, comm=node)  # (contiguous: rank r's slots follow r - 1's)
    base, _ = win.Shared_query(0)
    slots = np.frombuffer(MPI.memory.fromaddress(base.address, k * 2 * SLOT), np.uint8).reshape(k, 2, SLOT)
    node.Barrier()
    exchange = _compiled_exchange()
    header = np.arange(1, HEADER_WORDS + 1, dtype=np.int64)
    seq = [0]

    def shared(x, out):
        seq[0] += 1
        if exchange(slots, header, x, out, seq[0], rank):
            raise RuntimeError("headers differ")

    for n in SIZES:
        x = np.random.default_rng(rank).standard_normal(n // 4).astype(np.float32)
        out, reference = np.full_like(x, np.nan), np.empty_like(x)
        parts = comm.allgather(x)
        reference = parts[0] + parts[1]
        for part in parts[2:]:
            reference += part
        shared(x, out)  # (compiles on the first size)
        assert np.array_equal(out, reference), "the slots' sum differs from the rank-order sum"
        runs = {
            "MPI Allreduce": lambda x=x, out=out: comm.Allreduce(x, out),
            "node slots": lambda x=x, out=out: shared(x, out),
        }
        medians = _common.alternated_medians_us(comm, runs, calls=200 if n <= 16384 else 20)
        if rank == 0:
            mpi, slots_us = medians["MPI Allreduce"], medians["node slots"]
            print(
                f"p={k} {_common.human_bytes(n):>7}: MPI Allreduce {mpi:7.1f}  node slots {slots_us:7.1f}"
                f"  ({mpi / slots_us:4.2f}x MPI)",
                flush=True,
            )
    node.Barrier()
    win.Free()


def main() -> None:
    if "--worker" in sys.argv:
        worker()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[3, 4])
    args = parser.parse_args()
    print(f"allreduce with a header check through node slots, us (machine: {_common.machine()})", flush=True)
    for procs in args.procs:
        _common.launch(os.path.abspath(__file__), procs, ["--worker"])


if __name__ == "__main__":
    main()
