"""gflow.torch jobs for test_torch_runtime.py, run under mpiexec (not collected by pytest).

argv: the mode (see below). Once every rank has loaded torch, each arms a watchdog: a rank still
running CASE_DEADLINE_S (default 20) seconds later prints its stack and exits, so a hang fails its
test within seconds of the start, however long the ranks took to import torch.
"""

import faulthandler
import os
import sys
import time

import torch
from mpi4py import MPI

import gflow
import gflow.torch as hvd

torch.set_num_threads(1)
world = MPI.COMM_WORLD
me, p = world.rank, world.size
mode = sys.argv[1]
world.Barrier()  # every rank has imported torch: the deadline counts from here
faulthandler.dump_traceback_later(float(os.environ.get("CASE_DEADLINE_S", "20")), exit=True)


def say(text: str) -> None:
    sys.stdout.write(f"[rank {me}: {text}]\n")  # one write: the launcher interleaves separate ones
    sys.stdout.flush()


if mode == "init-lists":  # the last rank passes another list of ranks than the others
    ranks = list(range(p)) if me == p - 1 else list(range(p - 1))
    try:
        hvd.init(comm=ranks)
    except ValueError as exc:
        say(f"ValueError: {exc}")
    else:
        say("initialised")
elif mode == "init-bad-rank":  # rank 0 names a rank COMM_WORLD does not have; the others agree
    ranks = [0, p + 5] if me == 0 else list(range(p))
    try:
        hvd.init(comm=ranks)
    except ValueError as exc:
        say(f"ValueError: {exc}")
    else:
        say("initialised")
elif mode == "barrier-exit":  # rank 1 ends its program cleanly; the others call barrier()
    hvd.init()
    if me == 1:
        say("leaving")
        sys.exit(0)
    time.sleep(1.0)
    start = time.monotonic()
    try:
        hvd.barrier()
    except gflow.GflowError as exc:
        named = "rank 1 has left the job" in str(exc)
        horovod = isinstance(exc, hvd.HorovodInternalError)
        say(f"barrier raised after {time.monotonic() - start:.1f} s, named {named}, horovod {horovod}")
    else:
        say("barrier returned")
elif mode == "barrier-late":  # the last rank comes to barrier() long after the others
    hvd.init()
    if me == p - 1:
        time.sleep(float(sys.argv[2]))
    hvd.barrier()
    say("finished")
elif mode == "homogeneous":  # only rank 0 asks (a local query in Horovod); then all reduce
    hvd.init()
    if me == 0:
        say(f"homogeneous {hvd.is_homogeneous()}")
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum)
    sizes = world.allgather(hvd.local_size())
    say(f"sum {total.item():g}, expected homogeneous {len(set(sizes)) == 1}")
else:
    raise SystemExit(f"unknown mode {mode!r}")
faulthandler.cancel_dump_traceback_later()
