"""Horovod's basics over mpi4py: init, ranks and sizes, what is built, reduction ops, errors
(shutdown is in _handles.py: it forgets the async handles too).

`init()` takes the communicator (COMM_WORLD, an mpi4py intracommunicator, or a list of world ranks, as
Horovod's does) and reads the topology once: local_* from MPI's COMM_TYPE_SHARED split (the ranks
sharing a node's memory), cross_* from the split of the ranks that have the same local rank, and
is_homogeneous (a local query, as in Horovod) from one gflow collective on the communicator. That one
also makes gflow's duplicates of it, so from init() on the stall inspector can ask the peers there: a
rank late for the first training step (an async one) is named, and one that left raises GflowError.
"""

import zlib
from collections import Counter

import numpy as np
import torch
from mpi4py import MPI

import gflow

from ..errors import GflowError
from ..runtime.stall import ranks_text

# Horovod's reduction ops are plain ints (its C library's enum values); so are these.
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}


class HorovodInternalError(RuntimeError):
    """A collective failed as a whole (Horovod's name for it). gflow's own errors (gflow.GflowError:
    MismatchError, NonFiniteError, CompressionOverflowError) raised through gflow.torch are instances
    of this class too, so both `except hvd.HorovodInternalError` and `except gflow.MismatchError`
    catch them."""


_horovod_classes: dict = {}


def as_horovod_error(exc: BaseException) -> BaseException:
    """exc itself, or for a gflow.GflowError the same error as an instance of a class that derives
    from both its own class and HorovodInternalError (same name, same message)."""
    if not isinstance(exc, GflowError) or isinstance(exc, HorovodInternalError):
        return exc
    cls = type(exc)
    both = _horovod_classes.get(cls)
    if both is None:
        both = type(cls.__name__, (cls, HorovodInternalError), {"__module__": cls.__module__})
        both.__qualname__ = cls.__qualname__
        _horovod_classes[cls] = both
    new = both(*exc.args)
    new.__traceback__ = exc.__traceback__
    return new


class ProcessSet:
    """Horovod's process set. gflow.torch supports only the global one (`global_process_set`)."""

    def __init__(self, ranks=None):
        self.ranks = None if ranks is None else list(ranks)

    def size(self) -> int:
        return size() if self.ranks is None else len(self.ranks)

    def rank(self) -> int:
        return rank() if self.ranks is None else self.ranks.index(rank())

    def included(self) -> bool:
        return self.ranks is None or rank() in self.ranks

    def __repr__(self) -> str:
        return "ProcessSet(global)" if self is global_process_set else f"ProcessSet({self.ranks})"


global_process_set = ProcessSet()


def check_process_set(process_set, where: str) -> None:
    if process_set is None or process_set is global_process_set:
        return
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{where}: process_set must be a ProcessSet, got {type(process_set).__name__}")
    raise NotImplementedError(
        f"{where}: gflow.torch supports only the global process set (hvd.global_process_set); "
        f"got {process_set!r}"
    )


def add_process_set(process_set):
    raise NotImplementedError(
        "gflow.torch supports only the global process set; add_process_set is not available"
    )


def remove_process_set(process_set):
    raise NotImplementedError(
        "gflow.torch supports only the global process set; remove_process_set is not available"
    )


class _State:
    comm = None  # the communicator every collective of gflow.torch runs on (gflow duplicates it)
    rank = size = local_rank = local_size = cross_rank = cross_size = -1
    homogeneous = None


_state = _State()


def init(comm=None, process_sets=None) -> None:
    """Initialise gflow.torch (collective over the communicator's ranks; calling it again re-reads it).

    Args:
        comm: None (MPI.COMM_WORLD), an mpi4py intracommunicator, or a list of ranks of COMM_WORLD
            (a sub-communicator of those ranks is made; every rank of COMM_WORLD must call init with
            the same list, and ranks outside it get a ValueError).
        process_sets: None (or an empty list): only the global process set is supported.
    """
    if process_sets not in (None, []) and process_sets != ():
        raise NotImplementedError(
            "init: gflow.torch supports only the global process set (process_sets=None)"
        )
    world = MPI.COMM_WORLD
    is_world = comm is None or (isinstance(comm, MPI.Intracomm) and comm == world)
    if is_world or not isinstance(comm, MPI.Intracomm):
        # COMM_WORLD, or a list of its ranks: every rank of COMM_WORLD is here, so every one checks
        # that all passed the same ranks (None and COMM_WORLD count as all of them, in order), and
        # anything else (not a list of ranks) fails on every rank too, never leaving the others in
        # Comm.Create.
        everyone = list(range(world.Get_size()))
        ranks = _same_ranks_everywhere(everyone if is_world else comm)
        if ranks == everyone:
            comm = world
        else:
            group = world.Get_group().Incl(ranks)
            sub = world.Create(group)  # collective over COMM_WORLD: every rank calls it
            group.Free()
            if sub == MPI.COMM_NULL:
                raise ValueError(f"init: this rank ({world.Get_rank()}) is not in comm={ranks}")
            comm = sub
    elif comm == MPI.COMM_NULL:
        raise TypeError(
            "init: comm must be None, an mpi4py intracommunicator or a list of ranks, got COMM_NULL"
        )
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    cross = comm.Split(color=local.Get_rank(), key=comm.Get_rank())
    _state.rank, _state.size = comm.Get_rank(), comm.Get_size()
    _state.local_rank, _state.local_size = local.Get_rank(), local.Get_size()
    _state.cross_rank, _state.cross_size = cross.Get_rank(), cross.Get_size()
    local.Free()
    cross.Free()
    # The largest and the smallest local size, in one gflow collective (watched, and it makes gflow's
    # duplicates of comm now, so a rank late for the first step is named, not only warned of).
    sizes = np.array([_state.local_size, -_state.local_size], np.int64)
    largest, smallest = gflow.allreduce(sizes, "max", comm=comm)
    _state.homogeneous = bool(largest == -smallest)
    _state.comm = comm
    from . import _settings

    _settings.apply(_state.rank)


_SHOWN = 16  # ranks of a list shown in init's error


def _same_ranks_everywhere(given) -> list:
    """The world ranks of init(comm=[...]), once every rank of COMM_WORLD is seen to have passed the
    same valid list: Comm.Create with different lists would leave some ranks waiting in it forever.
    Raises ValueError on every rank otherwise, saying which ranks passed which list. A gflow collective
    on COMM_WORLD (watched: a rank that never calls init is a stall the inspector reports)."""
    size = MPI.COMM_WORLD.Get_size()
    problem, value = 0, 0  # 1: not a list of ints, 2: a rank out of range, 3: a rank twice, 4: empty
    try:
        if isinstance(given, (str, bytes, set, frozenset, dict)):  # (no order, or not ranks)
            raise TypeError
        ranks = [int(r) for r in given]
    except (TypeError, ValueError):
        ranks, problem = [], 1
    if not problem:
        outside = [r for r in ranks if not 0 <= r < size]
        counts = Counter(ranks)
        twice = [r for r in ranks if counts[r] > 1]
        if outside:
            problem, value = 2, max(-(2**62), min(outside[0], 2**62))
        elif twice:
            problem, value = 3, twice[0]
        elif not ranks:
            problem = 4
    shown = [max(-(2**62), min(r, 2**62)) for r in ranks[:_SHOWN]]
    row = np.full(5 + _SHOWN, -1, np.int64)
    row[:5] = len(ranks), zlib.crc32(repr(ranks).encode()), problem, value, len(shown)
    row[5 : 5 + len(shown)] = shown
    table = gflow.allgather(row[None, :])
    groups: dict = {}  # a row -> the world ranks that passed it
    for r, passed in enumerate(table):
        groups.setdefault(tuple(int(v) for v in passed), []).append(r)
    if len(groups) == 1 and not problem:
        return ranks
    told = [f"{ranks_text(who)} passed {_passed(row, size)}" for row, who in groups.items()]
    if len(groups) == 1:
        raise ValueError(f"init: comm= must be a list of distinct ranks of COMM_WORLD; {told[0]}")
    raise ValueError(
        "init: every rank of COMM_WORLD must pass the same list of ranks as comm=; got different lists: "
        + "; ".join(told)
    )


def _passed(row, size: int) -> str:
    """'[0, 8], and 8 is not a rank of COMM_WORLD (3 ranks)': one rank's list, as in its gathered row."""
    count, _, problem, value, nshown = row[:5]
    if problem == 1:
        return "something that is not a list of ints (comm= takes None, a communicator or a list of ranks)"
    listed = ", ".join(map(str, row[5 : 5 + nshown])) + (f", ... ({count} in all)" if count > nshown else "")
    why = {
        2: f", and {value} is not a rank of COMM_WORLD ({size} ranks)",
        3: f", which names rank {value} twice",
        4: ", which is empty",
    }
    return f"[{listed}]{why.get(problem, '')}"


def forget_comm() -> None:
    """shutdown()'s half here (the other, forgetting async handles, is _handles.py'): is_initialized() is
    then False until the next init()."""
    _state.comm = None
    _state.rank = _state.size = _state.local_rank = _state.local_size = -1
    _state.cross_rank = _state.cross_size = -1
    _state.homogeneous = None


def is_initialized() -> bool:
    return _state.comm is not None


def comm():
    """The communicator gflow.torch runs on; ValueError before init() (as Horovod)."""
    if _state.comm is None:
        raise ValueError("gflow.torch has not been initialized; use hvd.init().")
    return _state.comm


def _get(value: int) -> int:
    if _state.comm is None:
        raise ValueError("gflow.torch has not been initialized; use hvd.init().")
    return value


def rank() -> int:
    return _get(_state.rank)


def size() -> int:
    return _get(_state.size)


def local_rank() -> int:
    return _get(_state.local_rank)


def local_size() -> int:
    return _get(_state.local_size)


def cross_rank() -> int:
    return _get(_state.cross_rank)


def cross_size() -> int:
    return _get(_state.cross_size)


def is_homogeneous() -> bool:
    """Whether every node runs the same number of ranks: a local query (as in Horovod), answered
    from what init() found."""
    _get(0)
    return _state.homogeneous


def mpi_threads_supported() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE (gflow's async collectives need it)."""
    _get(0)
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def cuda_built() -> bool:
    """True when torch was built with CUDA: gflow then reduces CUDA tensors (through Numba's CUDA
    support, directly with a CUDA-aware MPI or staged through host memory)."""
    return torch.version.cuda is not None
