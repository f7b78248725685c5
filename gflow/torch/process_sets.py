"""Horovod's process sets on MPI sub-communicators: `hvd.add_process_set([0, 2])`, then
`process_set=` on any collective, DistributedOptimizer, broadcast_* and *_object, SyncBatchNorm.

A registered set holds the sub-communicator of its ranks (made collectively over gflow.torch's
communicator, so every rank must register the same sets in the same order, as Horovod requires);
gflow's collectives take any communicator, so a set's collective is gflow's on that one. As in
Horovod: a set's ranks are ranks of hvd.rank()'s numbering, root_rank= of a broadcast too (not the
rank within the set), a rank outside a set that calls its collective gets a ValueError, and sets are
added and removed at any time (Horovod's HOROVOD_DYNAMIC_PROCESS_SETS is implied).
"""

import numpy as np
from mpi4py import MPI

import gflow

from ..runtime import engine
from ..runtime.context import context
from ..runtime.stall import ranks_text
from . import _basics


class ProcessSet:
    """A set of ranks that run collectives together: ProcessSet([0, 2]) (ranks of hvd.rank()), or
    ProcessSet(an mpi4py communicator) in hvd.init(process_sets=[...]). Usable once registered by
    hvd.init(process_sets=...) or hvd.add_process_set(); process_set_id is then set."""

    process_set_id = None
    ranks = None
    mpi_comm = None
    removed = ""  # how it was unregistered on every rank (a call with it then raises locally)

    def __init__(self, ranks_or_comm):
        if isinstance(ranks_or_comm, MPI.Comm):
            self.mpi_comm = ranks_or_comm
            return
        try:
            if isinstance(ranks_or_comm, (str, bytes, dict)):
                raise TypeError
            ranks = sorted(_basics.as_rank(r) for r in ranks_or_comm)
        except TypeError:
            raise ValueError(
                f"ProcessSet takes a list of ranks (ints) or an mpi4py communicator, got {ranks_or_comm!r}"
            ) from None
        self.ranks = ranks
        self._comm = None  # this set's communicator once registered (COMM_NULL on ranks outside it)

    def size(self):
        """The number of ranks in the set, or None while it is not registered."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self):
        """This process's rank within the set (None while not registered; ValueError outside it)."""
        if self.process_set_id is None:
            return None
        if _basics.rank() not in self.ranks:
            raise ValueError(f"rank {_basics.rank()} is not part of {self}")
        return self.ranks.index(_basics.rank())

    def included(self):
        """Whether this process is in the set (None when the ranks are not known yet)."""
        return None if self.ranks is None else _basics.rank() in self.ranks

    def __str__(self) -> str:
        return (
            f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"
        )

    __repr__ = __str__


class NotInSet(ValueError):
    """A rank called a collective of a process set it is not part of."""


class RemovedSet(ValueError):
    """A rank called a collective of a process set hvd.remove_process_set removed: every rank removed
    it, so its ranks make the same call with it, and no peer waits for this one elsewhere."""


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

_registered: dict = {}  # id -> ProcessSet, the global one included (id 0)
_next_id = [1]


def setup_global(comm, previous) -> None:
    """init()'s part: the global set is every rank of the communicator. The other sets stay where
    init() is called again on the same ranks (as in Horovod, where a second init() changes nothing:
    wrappers call it again), and are forgotten where its communicator is another."""
    global_process_set.ranks = list(range(comm.Get_size()))
    global_process_set._comm = comm
    if previous is not None and MPI.Comm.Compare(previous, comm) in (MPI.IDENT, MPI.CONGRUENT):
        return
    for ps in list(_registered.values()):
        if ps is not global_process_set:
            _forget(ps, "a later hvd.init() on another communicator dropped it")
    _registered.clear()
    _registered[0] = global_process_set
    _next_id[0] = 1


def init_sets(process_sets) -> None:
    """Register init(process_sets=...): a list of ProcessSets, or "dynamic" (none now). Collective:
    the sets of communicators are exchanged even where none is given (a rank outside them all may
    pass none)."""
    if process_sets is None or (isinstance(process_sets, str) and process_sets.lower() == "dynamic"):
        _register_comms([])
        return
    if isinstance(process_sets, (str, bytes, ProcessSet)):
        raise TypeError(
            f"init: process_sets must be a list of hvd.ProcessSet or 'dynamic', got {process_sets!r}"
        )
    for ps in process_sets:
        if not isinstance(ps, ProcessSet):
            raise TypeError(f"init: process_sets must hold hvd.ProcessSet objects, got {type(ps).__name__}")
    for ps in process_sets:
        if ps.ranks is not None:
            add_process_set(ps)
    _register_comms([ps for ps in process_sets if ps.ranks is None])


def add_process_set(process_set):
    """Register a set (a ProcessSet or a list of ranks) and return it: collective over every rank of
    gflow.torch's communicator, each passing the same ranks. ValueError (on every rank) for ranks
    that differ between ranks, are not ranks of the communicator, or form a set already registered."""
    of_comm = isinstance(process_set, ProcessSet) and process_set.ranks is None
    comm = _basics.comm()
    given = process_set.ranks if isinstance(process_set, ProcessSet) else process_set
    try:  # (a set: its order is not the ranks' to agree on; what does not sort is refused below)
        given = given if isinstance(given, (str, bytes, dict)) else sorted(given)
    except (TypeError, ValueError):
        pass
    # The ranks are checked everywhere before a ProcessSet is made of them: a list one rank alone
    # refuses must fail on every rank, not leave the others waiting in the check.
    try:
        with _basics.refused_in_join_as("add_process_set", "an allgather"):
            ranks = _basics.same_ranks_everywhere(given, comm, "add_process_set")
    except ValueError as exc:
        if of_comm:
            raise NotImplementedError(
                "add_process_set: a process set of an MPI communicator is registered by "
                "hvd.init(process_sets=[...]); build this one from a list of ranks"
            ) from exc
        raise
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(ranks)
    for ps in _registered.values():
        if ps.ranks == ranks and ps.process_set_id is not None:
            raise ValueError(f"add_process_set: a process set of these ranks is registered already: {ps}")
    group = comm.Get_group().Incl(ranks)
    sub = comm.Create(group)  # collective over comm: every rank calls it
    group.Free()
    process_set.ranks = ranks
    _adopt(process_set, sub)
    return process_set


def _register_comms(given: list) -> None:
    """Register the sets given by mpi4py communicators (init only; each rank passes those it is in,
    as Horovod's split-communicator example does): every rank learns every rank's, so each set has
    one id everywhere, a rank outside it refuses its collectives, and add_process_set of the same
    ranks raises on every rank (helper-71: it left the ranks outside in Comm.Create). A set's
    communicator is used itself (gflow talks on its duplicate). Raises ValueError on every rank for
    a COMM_NULL, a communicator with ranks outside gflow.torch's, one that not all its members
    passed, or a set registered already."""
    comm = _basics.comm()
    size, me = comm.Get_size(), comm.Get_rank()
    rows = np.zeros((len(given), size + 2), np.int64)  # (passed by, problem, one column per member)
    mine: dict = {}  # this rank's sets: their ranks -> the ProcessSet it passed
    for row, ps in zip(rows, given, strict=True):
        row[0] = me
        if ps.mpi_comm == MPI.COMM_NULL:
            row[1] = 1
            continue
        groups = ps.mpi_comm.Get_group(), comm.Get_group()
        members = MPI.Group.Translate_ranks(groups[0], list(range(ps.mpi_comm.Get_size())), groups[1])
        for group in groups:
            group.Free()
        if MPI.UNDEFINED in members:
            row[1] = 2
        else:
            row[2 + np.array(members, np.int64)] = 1
            mine[tuple(sorted(members))] = ps
    table = gflow.allgather(rows, comm=comm) if size > 1 else rows
    problems = {1: "a COMM_NULL", 2: "a communicator with ranks outside gflow.torch's communicator"}
    told = [f"rank {int(r[0])} passed {problems[int(r[1])]}" for r in table if r[1]]
    passers: dict = {}  # a set's ranks -> the ranks that passed it
    for r in table:
        if not r[1]:
            passers.setdefault(tuple(int(m) for m in np.flatnonzero(r[2:])), []).append(int(r[0]))
    for ranks, who in passers.items():
        if who != list(ranks):  # (a member that passed it twice, or not at all)
            told.append(f"the set of ranks {list(ranks)} was passed by {ranks_text(sorted(who))}")
        elif any(ps.ranks == list(ranks) for ps in _registered.values()):
            told.append(f"the set of ranks {list(ranks)} is registered already")
    if told:
        raise ValueError(
            "init: every rank passes a ProcessSet of each communicator it is in, and only once (each "
            f"member passes it); {'; '.join(told)}"
        )
    for ranks in passers:
        process_set = mine.get(ranks)
        if process_set is None:  # (a set this rank is not in: known, so that ids agree and it is refused)
            process_set = ProcessSet(list(ranks))
            _adopt(process_set, MPI.COMM_NULL)
        else:
            process_set.ranks = list(ranks)
            _adopt(process_set, process_set.mpi_comm)


def communicators_of_this_rank() -> list:
    """The communicators of the registered sets (the global one aside) that this rank is in."""
    return [ps._comm for set_id, ps in sorted(_registered.items()) if set_id and ps._comm != MPI.COMM_NULL]


def _adopt(process_set, comm) -> None:
    if comm != MPI.COMM_NULL:
        # gflow's duplicates of the set's communicator, made now, on every member in the same order:
        # a rank in join() serves the set on them even where it never called on it, and under Open
        # MPI a duplicate pending on one rank stops its others from being made.
        context(comm).comm  # noqa: B018 (the property makes them)
    process_set._comm = comm
    process_set.process_set_id = _next_id[0]
    _registered[_next_id[0]] = process_set
    _next_id[0] += 1


def remove_process_set(process_set) -> bool:
    """Unregister a set (every rank calls it, with the same set), once the async collectives this
    rank started before have ended (as Horovod's background loop removes it in turn); False for the
    global set or one not registered.

    Raises:
        ValueError: on every rank, where the ranks passed different sets (a rank that removed a set
            alone went on while its peers waited in the set's next collective, for ever: helper-53).
    """
    registered = (
        isinstance(process_set, ProcessSet)
        and process_set.process_set_id not in (None, 0)
        and _registered.get(process_set.process_set_id) is process_set
    )
    if not _basics.is_initialized():
        return False
    mine = np.array([[process_set.process_set_id if registered else -1]], np.int64)
    with _basics.refused_in_join_as("remove_process_set", "an allgather"):
        passed = [int(v) for v in gflow.allgather(mine, comm=_basics.comm())[:, 0]]
    if len(set(passed)) > 1:
        groups: dict = {}
        for rank, set_id in enumerate(passed):
            groups.setdefault(set_id, []).append(rank)
        told = [
            f"{ranks_text(who)} {'no registered set' if set_id < 0 else _registered_text(set_id)}"
            for set_id, who in groups.items()
        ]
        raise ValueError(f"remove_process_set: every rank must remove the same set; got {'; '.join(told)}")
    if not registered:
        return False
    engine.drain()  # async collectives started before, on this set too, end before its communicator
    _forget(process_set, "hvd.remove_process_set removed it")
    return True


def _registered_text(set_id: int) -> str:
    known = _registered.get(set_id)
    return f"process set {set_id}" + (f" (ranks {known.ranks})" if known is not None else "")


def _forget(process_set, how: str) -> None:
    _registered.pop(process_set.process_set_id, None)
    comm = process_set._comm
    if comm is not None and comm != MPI.COMM_NULL and process_set.mpi_comm is None:
        comm.Free()
    process_set._comm = None
    process_set.process_set_id = None
    process_set.removed = how


def comm_of(process_set, where: str):
    """The communicator of `process_set` (None: the global one) for a collective called `where`;
    TypeError/ValueError, before any communication, for anything but a registered set that includes
    this rank (NotInSet and RemovedSet: on this rank only; see _common.set_comm)."""
    if process_set is None or process_set is global_process_set:
        return _basics.comm()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{where}: process_set must be an hvd.ProcessSet, got {type(process_set).__name__}")
    if _registered.get(process_set.process_set_id) is not process_set:
        error = RemovedSet if process_set.removed else ValueError
        raise error(
            f"{where}: {process_set} is not registered"
            f"{f' ({process_set.removed})' if process_set.removed else ''}; "
            "register it with hvd.add_process_set() or hvd.init(process_sets=[...])"
        )
    if _basics.rank() not in process_set.ranks:
        raise NotInSet(f"{where}: rank {_basics.rank()} is not part of {process_set}")
    return process_set._comm


def rank_in(process_set, global_rank: int, where: str) -> int:
    """A root_rank= (a rank of hvd.rank()'s numbering, as Horovod takes it) as a rank of the set."""
    ranks = global_process_set.ranks if process_set is None else process_set.ranks
    if global_rank not in ranks:
        raise ValueError(f"{where}: root_rank {global_rank} is not a rank of the process set ({ranks})")
    return ranks.index(global_rank)
