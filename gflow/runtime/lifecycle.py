"""The exit order, in one place.

Python runs exit handlers last-registered first. mpi4py registers MPI_Finalize when it is imported,
which happens above, before ours: so this one handler runs before MPI finalizes, and does in order
what each part needs done while MPI still works.
"""

import atexit

from mpi4py import MPI  # noqa: F401 - imported first: its finalizer must run after at_exit

from . import context, engine, stall, timeline


def at_exit() -> None:
    """Stop the background thread (its collectives use gflow's duplicates), tell peers this rank has
    left (those waiting for it in a collective it will never make raise at once), free the
    duplicates, then close the timeline file (it records up to the end)."""
    engine.shutdown()
    context.finish_duplicates()  # (so that peers still waiting in their making can be told, below)
    stall.goodbye()
    context.free_all()
    timeline.stop_timeline()


atexit.register(at_exit)
