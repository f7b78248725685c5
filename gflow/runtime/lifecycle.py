"""The exit order, in one place.

Python runs exit handlers last-registered first. mpi4py registers MPI_Finalize when it is imported,
which happens above, before ours: so this one handler runs before MPI finalizes, and does in order
what each part needs done while MPI still works. A program that calls MPI.Finalize() itself runs it
there, first (MPI_Finalize deletes MPI_COMM_SELF's attributes before anything else), and then not
again at exit.
"""

import atexit
import sys

from mpi4py import MPI  # imported first: its finalizer must run after at_exit

from . import context, engine, stall, timeline


def at_exit() -> None:
    """Stop the background thread (its collectives use gflow's duplicates), tell peers this rank has
    left (those waiting for it in a collective it will never make raise at once), free the
    duplicates, then close the timeline file (it records up to the end). Async work that exit
    loses (started and never waited for, as Horovod's shutdown fails it) is said on stderr."""
    global _done
    if _done:
        return
    _done = True
    lost = engine.shutdown()
    if lost:
        shown = "; ".join(lost[:3]) + (f"; and {len(lost) - 3} more" if len(lost) > 3 else "")
        print(
            f"gflow rank {MPI.COMM_WORLD.Get_rank()}: the program ended with async work that no wait() "
            f"collected, and it did not complete (its results are lost): {shown}. Wait for every "
            "async call (Handle.wait, hvd.synchronize) on every rank before the program ends",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    context.finish_duplicates()  # (so that peers still waiting in their making can be told, below)
    stall.goodbye()
    stall.stop()
    context.free_all()
    timeline.stop_timeline()


_done = False
atexit.register(at_exit)
if MPI.Is_initialized() and not MPI.Is_finalized():
    _at_finalize = MPI.Comm.Create_keyval(delete_fn=lambda comm, keyval, value: at_exit())
    MPI.COMM_SELF.Set_attr(_at_finalize, True)
