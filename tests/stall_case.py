"""A job whose last rank is late: run by test_stall.py under mpiexec (not collected by pytest).

argv: seconds the last rank sleeps before its allreduce, and the mode: "sync" or "async" (late for a
later blocking or async allreduce), "first-async" (late for the first async one, after a blocking one)
or "first" (late for the very first gflow collective of the job)."""

import sys
import time

import numpy as np
from mpi4py import MPI

import gflow

world = MPI.COMM_WORLD
mode = sys.argv[2]
x = np.ones(1 << 18, np.float32)
if mode != "first":
    gflow.allreduce(x)  # the communicators exist: the late rank can be asked about the collective
if mode in ("sync", "async"):
    gflow.allreduce_async(x).wait()  # the engine's communicator exists too
if world.rank == world.size - 1:
    time.sleep(float(sys.argv[1]))
if mode in ("async", "first-async"):
    gflow.allreduce_async(x).wait()
else:
    gflow.allreduce(x)
print(f"rank {world.rank} finished", flush=True)
