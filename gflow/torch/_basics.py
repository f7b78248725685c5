"""Horovod's basics over mpi4py: the state init() fills, ranks and sizes, what is built, reduction
ops, errors (init is in _init.py; shutdown in _handles.py: it forgets the async handles too).

`init()` takes the communicator (COMM_WORLD, an mpi4py intracommunicator, or a list of world ranks,
as Horovod's does) and reads the topology once: local_* from MPI's COMM_TYPE_SHARED split (the
ranks sharing a node's memory), cross_* from the split of the ranks that have the same local rank,
and is_homogeneous (a local query, as in Horovod) from one gflow collective on the communicator.
That one also makes gflow's duplicates of it, so from init() on the stall inspector can ask the
peers there: a rank late for the first training step (an async one) is named, and one that left
raises GflowError.
"""

import operator
import weakref
import zlib
from collections import Counter
from contextlib import contextmanager

import numpy as np
import torch
from mpi4py import MPI

import gflow

from ..errors import GflowError, NotServedInJoinError
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


_derived_classes: dict = {}


def derived_class(bases: tuple, like: type) -> type:
    """The class deriving from `bases`, named as `like` (so reprs and messages show the user's own
    class's name), made once per bases."""
    derived = _derived_classes.get(bases)
    if derived is None:
        derived = type(like.__name__, bases, {"__module__": like.__module__})
        derived.__qualname__ = like.__qualname__
        _derived_classes[bases] = derived
    return derived


class _SharedWithInner:
    """The wrapper and the optimizer it wraps share their param groups and state (with_methods), and
    go on sharing them after a load_state_dict (broadcast_optimizer_state's on the other ranks, a
    checkpoint's): torch's replaces both with new objects on the wrapper alone, and an LR scheduler
    made on the inner optimizer before wrapping then set the learning rate of groups nothing steps
    with (helper-70: the ranks stepped with different rates, replicas apart, no error)."""

    def load_state_dict(self, state_dict):
        _load_keeping_shared(self, super().load_state_dict, state_dict)


def _load_keeping_shared(optimizer, load, state_dict) -> None:
    """load(state_dict), torch's load_state_dict of `optimizer`, with its param groups and state
    loaded into the objects it had (which the wrapper or the wrapped optimizer shares)."""
    groups, state = optimizer.param_groups, optimizer.state
    dicts = list(groups)
    load(state_dict)
    if optimizer.param_groups is not groups:  # (its length is checked: one group per group)
        for shared, loaded in zip(dicts, optimizer.param_groups, strict=True):
            shared.clear()
            shared.update(loaded)
        groups[:] = dicts
        optimizer.param_groups = groups
    if optimizer.state is not state:
        loaded = optimizer.state
        state.clear()
        state.update(loaded)
        optimizer.state = state


def _keep_sharing_on_load(optimizer) -> None:
    """The wrapped optimizer's own load_state_dict (a checkpoint loaded into it after wrapping, the
    program holding it too) loads into the objects the wrapper shares: torch's replaced them on the
    wrapped optimizer alone, and the wrapper stepped and broadcast its empty state (helper-94)."""
    own = optimizer.__dict__.get("load_state_dict")  # (one a library set on the instance: kept)
    load, held = type(optimizer).load_state_dict, weakref.ref(optimizer)  # (no reference cycle)

    def load_state_dict(state_dict):
        inner = held()
        _load_keeping_shared(inner, own or (lambda loaded: load(inner, loaded)), state_dict)

    optimizer.load_state_dict = load_state_dict


def with_methods(mixin: type, optimizer):
    """The optimizer as an instance of a subclass of its class with `mixin`'s methods first, sharing
    its attributes (param groups, state): how DistributedOptimizer wraps an optimizer."""
    cls = derived_class((mixin, _SharedWithInner, type(optimizer)), type(optimizer))
    wrapped = cls.__new__(cls)
    # Not an instance attribute that would hide one of mixin's methods: an LR scheduler made before
    # wrapping patches optimizer.step on the instance, and that copy ran the inner step, unreduced
    # (helper-50). The scheduler's check that step() ran (it reads the optimizer it holds) still sees it.
    methods = {name for c in mixin.__mro__ if c is not object for name in vars(c)}
    hidden = [name for name in optimizer.__dict__ if name in methods]
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k not in hidden})
    if "step" in hidden and getattr(optimizer.step, "_wrapped_by_lr_sched", False):
        wrapped.step = _tracked_step(type(wrapped).step, optimizer, wrapped)
    _keep_sharing_on_load(optimizer)
    return wrapped


def _tracked_step(step, held, wrapped):
    """wrapped's step, marking it and `held` (the optimizer a torch LR scheduler made before wrapping
    holds) as stepped, as the scheduler's own patch of held.step did, so that neither that scheduler
    nor one made on the wrapper (which, seeing this mark, patches no further) warns it came first.
    Weak references, as torch's patch holds its optimizer."""
    held_ref, wrapped_ref = weakref.ref(held), weakref.ref(wrapped)

    def tracked(*args, **kwargs):
        for ref in (held_ref, wrapped_ref):
            if ref() is not None:
                ref()._opt_called = True
        return step(wrapped_ref(), *args, **kwargs)

    tracked._wrapped_by_lr_sched = True
    return tracked


def as_horovod_error(exc: BaseException) -> BaseException:
    """exc itself, or for a gflow.GflowError the same error as an instance of a class that derives
    from both its own class and HorovodInternalError (same name, same message)."""
    if not isinstance(exc, GflowError) or isinstance(exc, HorovodInternalError):
        return exc
    cls = type(exc)
    new = derived_class((cls, HorovodInternalError), cls)(*exc.args)
    new.__traceback__ = exc.__traceback__
    return new


@contextmanager
def refused_in_join_as(where: str, made_of: str, hint: str = ""):
    """Word the refusal of a collective beside ranks in join() as the refusal of `where`, the call of
    gflow.torch made of `made_of` (the core's names its own collective: "allgather is not supported"
    from allgather_object or add_process_set, helper-72)."""
    try:
        yield
    except NotServedInJoinError as exc:
        error = NotServedInJoinError(
            f"{where} is not supported while ranks are in join(): it is made of {made_of}, and ranks in "
            f"join() take part only in allreduces, as in Horovod{hint}"
        )
        raise as_horovod_error(error) from exc


class _State:
    comm = None  # the communicator every collective of gflow.torch runs on (gflow duplicates it)
    rank = size = local_rank = local_size = cross_rank = cross_size = -1
    homogeneous = None


_state = _State()


_SHOWN = 16  # ranks of a list shown in init's error


def as_rank(r) -> int:
    """An int (Python's or NumPy's: anything with __index__, never a bool or a float) as a rank."""
    if isinstance(r, (bool, np.bool_)):
        raise TypeError(f"a rank must be an int, got {r!r}")
    return operator.index(r)


def same_ranks_everywhere(given, comm, where: str) -> list:
    """The ranks of `comm` that every rank of it passed (init's comm=[...] over COMM_WORLD,
    add_process_set's over gflow.torch's communicator), once seen to be the same valid list
    everywhere: Comm.Create with different lists would leave some ranks waiting in it forever.
    Raises ValueError on every rank otherwise, saying which ranks passed which list. A gflow
    collective on comm (watched: a rank that never calls is a stall the inspector reports)."""
    size = comm.Get_size()
    problem, value = 0, 0  # 1: not a list of ints, 2: a rank out of range, 3: a rank twice, 4: empty
    try:
        if isinstance(given, (str, bytes, set, frozenset, dict)):  # (no order, or not ranks)
            raise TypeError
        ranks = [as_rank(r) for r in given]
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
    table = gflow.allgather(row[None, :], comm=comm)
    groups: dict = {}  # a row -> the ranks that passed it
    for r, passed in enumerate(table):
        groups.setdefault(tuple(int(v) for v in passed), []).append(r)
    if len(groups) == 1 and not problem:
        return ranks
    whose = "COMM_WORLD" if comm == MPI.COMM_WORLD else "the communicator"
    told = [f"{ranks_text(who)} passed {_passed(row, size, whose)}" for row, who in groups.items()]
    if len(groups) == 1:
        raise ValueError(f"{where} must be a list of distinct ranks of {whose}; {told[0]}")
    raise ValueError(
        f"{where}: every rank of {whose} must pass the same list of ranks; got different lists: "
        + "; ".join(told)
    )


def _passed(row, size: int, whose: str) -> str:
    """'[0, 8], and 8 is not a rank of COMM_WORLD (3 ranks)': one rank's list, as in its gathered row."""
    count, _, problem, value, nshown = row[:5]
    if problem == 1:
        return "something that is not a list of ints (a list of ranks was expected)"
    listed = ", ".join(map(_shown_rank, row[5 : 5 + nshown])) + (
        f", ... ({count} in all)" if count > nshown else ""
    )
    why = {
        2: f", and {_shown_rank(value)} is not a rank of {whose} ({size} rank{'s' if size != 1 else ''})",
        3: f", which names rank {value} twice",
        4: ", which is empty",
    }
    return f"[{listed}]{why.get(problem, '')}"


def _shown_rank(value) -> str:
    """A rank as gathered: past +-2**62 the rows hold the bound (int64), so say so."""
    if abs(int(value)) < 2**62:
        return str(int(value))
    return ">= 2**62" if value > 0 else "<= -2**62"


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
