"""A job whose last rank is late: run by test_stall.py under mpiexec (not collected by pytest).

argv: seconds the last rank sleeps before its allreduce, and "sync" or "async"."""

import sys
import time

import numpy as np
from mpi4py import MPI

import gflow

world = MPI.COMM_WORLD
x = np.ones(1 << 18, np.float32)
gflow.allreduce(x)
gflow.allreduce_async(x).wait()  # the engine's communicator exists: its stalls can be inspected
if world.rank == world.size - 1:
    time.sleep(float(sys.argv[1]))
if sys.argv[2] == "async":
    gflow.allreduce_async(x).wait()
else:
    gflow.allreduce(x)
print(f"rank {world.rank} finished", flush=True)
