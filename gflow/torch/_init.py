"""hvd.init(): the communicator, the topology queries' answers, the process sets, Horovod's settings."""

import numpy as np
from mpi4py import MPI

import gflow

from ..runtime.context import ended as gflow_ended
from . import _basics, _settings
from . import process_sets as process_sets_module

# A communicator whose collectives gflow ended -> the duplicate init() goes on with (by handle).
_replacements: dict = {}


def _usable(comm):
    """comm, or where gflow ended its collectives (crossed waits, a stray async call that met a step),
    the duplicate init() goes on with: Horovod's init() starts afresh (it duplicates its communicator
    every time), and `hvd.shutdown(); hvd.init()` must recover (helper-83). One duplicate per ended
    communicator, kept for later init() calls on it (wrappers call init() again). The ranks decide
    together: MPI's own Allreduce (mpi4py's lowercase one makes a duplicate of its own at its first
    call: pmodels/mpich#3794)."""
    replacement = _replacements.get(comm.handle)
    if replacement is not None and gflow_ended(comm):  # (not a later communicator of that handle)
        return _usable(replacement)  # (itself ended since, maybe)
    refused = np.array([gflow_ended(comm)], np.int32)
    comm.Allreduce(MPI.IN_PLACE, refused, op=MPI.MAX)
    if not refused[0]:
        return comm
    replacement = _replacements[comm.handle] = comm.Dup()
    return replacement


def init(comm=None, process_sets=None) -> None:
    """Initialise gflow.torch (collective over the communicator's ranks; calling it again re-reads it,
    and keeps the process sets registered unless the communicator is another).

    Args:
        comm: None (MPI.COMM_WORLD), an mpi4py intracommunicator, or a list of ranks of COMM_WORLD
            (a sub-communicator of those ranks is made; every rank of COMM_WORLD must call init with
            the same list, and ranks outside it get a ValueError).
        process_sets: None, "dynamic", or a list of hvd.ProcessSet to register (see process_sets.py;
            sets can also be added later, "dynamic" or not).
    """
    state = _basics._state
    world = MPI.COMM_WORLD
    is_world = comm is None or (isinstance(comm, MPI.Intracomm) and comm == world)
    if is_world or not isinstance(comm, MPI.Intracomm):
        # COMM_WORLD, or a list of its ranks: every rank of COMM_WORLD is here, so every one checks
        # that all passed the same ranks (None and COMM_WORLD count as all of them, in order), and
        # anything else (not a list of ranks) fails on every rank too, never leaving the others in
        # Comm.Create.
        everyone = list(range(world.Get_size()))
        base = _usable(world)
        ranks = _basics.same_ranks_everywhere(everyone if is_world else comm, base, "init: comm=")
        if ranks == everyone:
            comm = base
        else:
            group = base.Get_group().Incl(ranks)
            sub = base.Create(group)  # collective over COMM_WORLD: every rank calls it
            group.Free()
            if sub == MPI.COMM_NULL:
                raise ValueError(f"init: this rank ({world.Get_rank()}) is not in comm={ranks}")
            comm = sub
    elif comm == MPI.COMM_NULL:
        raise TypeError(
            "init: comm must be None, an mpi4py intracommunicator or a list of ranks, got COMM_NULL"
        )
    else:
        comm = _usable(comm)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    cross = comm.Split(color=local.Get_rank(), key=comm.Get_rank())
    state.rank, state.size = comm.Get_rank(), comm.Get_size()
    state.local_rank, state.local_size = local.Get_rank(), local.Get_size()
    state.cross_rank, state.cross_size = cross.Get_rank(), cross.Get_size()
    local.Free()
    cross.Free()
    # The largest and the smallest local size, in one gflow collective (watched, and it makes gflow's
    # duplicates of comm now, so a rank late for the first step is named, not only warned of).
    sizes = np.array([state.local_size, -state.local_size], np.int64)
    largest, smallest = gflow.allreduce(sizes, "max", comm=comm)
    state.homogeneous = bool(largest == -smallest)
    previous, state.comm = state.comm, comm
    process_sets_module.setup_global(comm, previous)
    process_sets_module.init_sets(process_sets)
    _settings.apply(state.rank)
