"""Horovod's allgather, broadcast, barrier and join on torch tensors (where they differ from Horovod:
see _allreduce.py's docstring)."""

import math

import numpy as np
import torch

import gflow

from ..collectives.exchange import allgather_on, broadcast_on
from ..collectives.join import join as join_on
from ..collectives.operations import allreduce_on, background_on
from ..runtime.context import context
from . import _basics
from . import process_sets as process_sets_module
from ._allreduce import allreduce
from ._basics import Average, Sum
from ._common import (
    MOVABLE_DIRECT,
    check_tensor,
    comm,
    dtype_name,
    fingerprint,
    named,
    names_in_flight,
    reject_async,
    reject_blocking,
    set_comm,
)
from ._handles import Pending, raise_as_horovod, register
from .process_sets import rank_in

# --- allgather ---------------------------------------------------------------------------------------


def _to_words(t):
    """A tensor of a dtype gflow does not move, as int32 words: (rows, words per row), each row of
    t.shape[1:] padded to a multiple of 4 bytes; and the row's length in bytes."""
    rows = t.reshape(1, 1) if t.dim() == 0 else t.reshape(t.shape[0], math.prod(t.shape[1:]))
    nbytes = rows.shape[1] * rows.element_size()
    padded = torch.zeros((rows.shape[0], -(-nbytes // 4) * 4), dtype=torch.uint8, device=t.device)
    if nbytes and rows.shape[0]:
        padded[:, :nbytes] = rows.contiguous().view(torch.uint8)
    return padded.view(torch.int32) if padded.shape[1] else padded.to(torch.int32), nbytes


def _from_words(words, nbytes, dtype, tail_shape):
    """Undo _to_words for the rows in `words`."""
    shape = (words.shape[0], *tail_shape)
    if nbytes == 0 or words.shape[0] == 0:
        return torch.empty(shape, dtype=dtype, device=words.device)
    raw = words.contiguous().view(torch.uint8)[:, :nbytes].contiguous()
    return raw.view(dtype).reshape(shape)


def _agreed(x, shape, name=None, member=None):
    """What the ranks of an allgather or broadcast agree on besides gflow's own signature: the
    tensor's `shape` (allgather: its axes after the first) and torch dtype, which dtypes moved as int32
    words would otherwise not show, the user's name=, and for the i-th of a grouped call's n tensors
    (member=(i, n)) both: ranks passing different numbers disagree at the first one, saying so, and
    never pair another call's data; and how this rank's call reads in a MismatchError."""
    about = named(name) + ("" if member is None else f"tensors=a list of {member[1]} ([{member[0]}] of it), ")
    about += f"a tensor of shape {tuple(x.shape)} and dtype {dtype_name(x.dtype)}"
    if x.dtype not in MOVABLE_DIRECT:
        about += " (moved as int32 words)"
    return fingerprint(dtype_name(x.dtype), tuple(shape), name, member), about


class _AllgatherPlan:
    """One allgather, checked (raises on bad arguments): the rows to send and how to read the result."""

    def __init__(self, tensor, where, name=None, member=None):
        check_tensor(tensor, where)
        self.x = x = tensor.detach()
        if x.dtype in MOVABLE_DIRECT:
            self.words, self.nbytes = x.contiguous(), None
        else:
            self.words, self.nbytes = _to_words(x)
        self.fingerprint, self.about = _agreed(x, x.shape[1:], name, member)

    def run(self, ctx):
        return allgather_on(ctx, self.words, fingerprint=self.fingerprint, about=self.about)

    def finish(self, gathered):
        if self.nbytes is None:
            return gathered
        x = self.x
        return _from_words(gathered, self.nbytes, x.dtype, x.shape[1:] if x.dim() else ())


def _allgather_now(tensor, where, name=None, on=None, member=None):
    try:
        plan = _AllgatherPlan(tensor, where, name, member)
    except Exception as exc:  # noqa: BLE001 - every local failure reaches the peers
        reject_blocking("allgather", exc, on)
    try:
        gathered = plan.run(context(comm() if on is None else on))
    except gflow.GflowError as exc:
        raise_as_horovod(exc)
    return plan.finish(gathered)


@names_in_flight
def allgather_async(tensor, name=None, process_set=None) -> int:
    """Concatenate every rank's tensor along the first dimension, in rank order (ranks may differ in
    the first dimension only), on gflow's background thread; synchronize() returns the new tensor.
    Do not modify the tensor before then."""
    on, exc = set_comm(process_set, "allgather_async")
    if exc is not None:
        return reject_async("allgather", exc, on)
    try:
        plan = _AllgatherPlan(tensor, "allgather_async", name)
    except Exception as exc:  # noqa: BLE001 - reported by synchronize(); the peers' fails too
        return reject_async("allgather", exc, on)
    handle = background_on(context(on), "allgather", plan.run, plan.words)
    return register(Pending([handle], lambda results: plan.finish(results[0])))


class _AllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set, on, member):
        ctx.dim0 = tensor.shape[0] if tensor.dim() else 1
        ctx.scalar = tensor.dim() == 0
        ctx.process_set, ctx.on = process_set, on
        return _allgather_now(tensor, "allgather", name, on, member)

    @staticmethod
    def backward(ctx, grad_output):
        reduced = allreduce(grad_output.contiguous(), op=Average, process_set=ctx.process_set)
        sizes = gflow.allgather(torch.tensor([ctx.dim0], dtype=torch.int64), comm=ctx.on)
        offset = int(sizes[: ctx.on.Get_rank()].sum())
        grad = reduced.narrow(0, offset, ctx.dim0)
        return grad.reshape(()) if ctx.scalar else grad, None, None, None, None


@names_in_flight
def allgather(tensor, name=None, process_set=None):
    """Concatenate every rank's tensor along the first dimension, in rank order; differentiable
    (the gradient is this rank's slice of the ranks' average incoming gradient, as Horovod's)."""
    return allgather_member(tensor, name, process_set, None)


def allgather_member(tensor, name, process_set, member):
    """allgather; member: (i, n) for the i-th of grouped_allgather's n tensors."""
    on, exc = set_comm(process_set, "allgather")
    if exc is None and not isinstance(tensor, torch.Tensor):
        exc = TypeError(f"allgather: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if exc is not None:
        reject_blocking("allgather", exc, on)
    return _AllgatherFunction.apply(tensor, name, process_set, on, member)


# --- broadcast ---------------------------------------------------------------------------------------


class _BroadcastPlan:
    """One broadcast, checked (raises on bad arguments): what to send and where the result goes."""

    def __init__(self, tensor, root_rank, in_place: bool, where, name=None, process_set=None):
        """root_rank: a rank of hvd.rank()'s numbering (in process_set, as in Horovod)."""
        check_tensor(tensor, where, in_place=in_place)
        if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
            raise TypeError(f"{where}: root_rank must be an int, got {type(root_rank).__name__}")
        if not 0 <= root_rank < _basics.size():
            raise ValueError(f"{where}: root_rank must be in [0, {_basics.size()}), got {root_rank}")
        root = rank_in(process_set, int(root_rank), where)
        self.tensor, self.root, self.in_place = tensor, root, in_place
        self.x = x = tensor.detach()
        if x.dtype in MOVABLE_DIRECT:
            self.words, self.nbytes = (x if in_place else x.contiguous()), None
        else:
            self.words, self.nbytes = _to_words(x.reshape(1, x.numel()))
        self.fingerprint, self.about = _agreed(x, x.shape, name)

    def run(self, ctx):
        out = self.x if self.in_place and self.nbytes is None else None
        kw = dict(root=self.root, out=out, fingerprint=self.fingerprint, about=self.about)
        return broadcast_on(ctx, self.words, **kw)

    def finish(self, received):
        if self.nbytes is None:
            return self.tensor if self.in_place else received
        x = self.x
        result = _from_words(received, self.nbytes, x.dtype, (x.numel(),)).reshape(x.shape)
        if self.in_place:
            x.copy_(result)
            return self.tensor
        return result


def _broadcast_now(tensor, root_rank, in_place: bool, where, name=None, process_set=None, on=None):
    try:
        plan = _BroadcastPlan(tensor, root_rank, in_place, where, name, process_set)
    except Exception as exc:  # noqa: BLE001
        reject_blocking("broadcast", exc, on)
    try:
        received = plan.run(context(comm() if on is None else on))
    except gflow.GflowError as exc:
        raise_as_horovod(exc)
    return plan.finish(received)


def _broadcast_async(tensor, root_rank, process_set, in_place, where, name=None) -> int:
    """A broadcast on gflow's background thread; synchronize() returns its result."""
    on, exc = set_comm(process_set, where)
    if exc is not None:
        return reject_async("broadcast", exc, on)
    try:
        plan = _BroadcastPlan(tensor, root_rank, in_place, where, name, process_set)
    except Exception as exc:  # noqa: BLE001 - reported by synchronize(); the peers' fails too
        return reject_async("broadcast", exc, on)
    handle = background_on(context(on), "broadcast", plan.run, plan.words)
    return register(Pending([handle], lambda results: plan.finish(results[0])))


@names_in_flight
def broadcast_async(tensor, root_rank, name=None, process_set=None) -> int:
    """root_rank's tensor on every rank (a new tensor; the input is not modified), on gflow's
    background thread; synchronize() returns the result."""
    return _broadcast_async(tensor, root_rank, process_set, False, "broadcast_async", name)


@names_in_flight
def broadcast_async_(tensor, root_rank, name=None, process_set=None) -> int:
    """As broadcast_async, in place: synchronize() returns `tensor`, holding root_rank's values."""
    return _broadcast_async(tensor, root_rank, process_set, True, "broadcast_async_", name)


@names_in_flight
def broadcast_(tensor, root_rank, name=None, process_set=None):
    """Overwrite `tensor` with root_rank's values on every rank; return it."""
    return broadcast_into(tensor, root_rank, name, process_set, "broadcast_")


def broadcast_into(tensor, root_rank, name, process_set, where: str):
    """broadcast_, its errors naming the call `where` (broadcast_object's, which is made of it)."""
    on, exc = set_comm(process_set, where)
    if exc is not None:
        reject_blocking("broadcast", exc, on)
    return _broadcast_now(tensor, root_rank, True, where, name, process_set, on)


class _BroadcastFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set, on):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _broadcast_now(tensor, root_rank, False, "broadcast", name, process_set, on)

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output.contiguous(), op=Average, process_set=ctx.process_set)
        if _basics.rank() != ctx.root_rank:
            grad = torch.zeros_like(grad)
        return grad, None, None, None, None


@names_in_flight
def broadcast(tensor, root_rank, name=None, process_set=None):
    """root_rank's tensor on every rank, as a new tensor; differentiable (root's gradient is the ranks'
    average incoming gradient, the others' zero, as Horovod's)."""
    on, exc = set_comm(process_set, "broadcast")
    if exc is None and not isinstance(tensor, torch.Tensor):
        exc = TypeError(f"broadcast: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if exc is not None:
        reject_blocking("broadcast", exc, on)
    return _BroadcastFunction.apply(tensor, root_rank, name, process_set, on)


# --- barrier and join --------------------------------------------------------------------------------


def barrier(process_set=None) -> None:
    """Wait until every rank has reached the barrier (async operations already started go on). A
    tiny blocking gflow allreduce, not MPI's Barrier: it waits where gflow's collectives wait, so a
    late rank is named by the stall inspector (and GFLOW_STALL_ABORT_S ends the job), a rank that left
    raises GflowError, and a barrier on some ranks only while the others are in step() is found as
    crossed waits. It runs on the caller's channel, as other blocking calls: on the background one it
    would queue behind the optimizer's segments, which ranks that used other parameters send at
    other times."""
    on, exc = set_comm(process_set, "barrier")
    if exc is not None:
        reject_blocking("allreduce", exc, on)
    try:
        tag, about = ("allreduce", fingerprint("barrier")), "barrier()"  # (no tensor's call matches it)
        allreduce_on(context(on), np.zeros(1, np.int32), "sum", tag=tag, about=about)
    except gflow.GflowError as exc:
        raise_as_horovod(exc)


def join(device=-1) -> int:
    """This rank has no more data: until every rank has called join(), take part in the other
    ranks' allreduces with zeros (theirs, DistributedOptimizer's, grouped and async ones; averages
    divide by the whole size, as Horovod's); return the rank that called join() last.

    Horovod's semantics (collectives/join.py): ranks may run different numbers of steps. Other
    collectives (allgather, broadcast, alltoall, reducescatter, Adasum) called while some rank is in
    join() raise on the ranks that called them, as in Horovod; the joined ranks wait on. A rank that
    joins first waits for the async operations it started (they run before). `device` is accepted
    and ignored (zeros are on the host; CUDA tensors of the others are staged or direct as usual).
    The last rank is found by each rank's wall clock at the call (exact on one node). A joined rank
    serves the process sets it is in as well, with zeros, and a mean divides by the set's size
    (Horovod's join() serves the global set only: a call on another set beside a joined rank stalls).
    """
    for before in BEFORE_JOIN:
        before()
    try:
        return join_on(comm(), subsets=process_sets_module.communicators_of_this_rank())
    except gflow.GflowError as exc:
        raise_as_horovod(exc)


BEFORE_JOIN: list = []  # called by join() first (DistributedOptimizer's: _distributed.drop_partial_steps)


# --- sparse tensors --------------------------------------------------------------------------------


def sparse_allreduce_async(tensor, name=None, op=None, process_set=None):
    """Horovod's sparse allreduce of a torch.sparse_coo tensor: every rank's indices and values are
    allgathered (at the call, as allgather_async), so the result holds every rank's entries
    (duplicates summed once coalesced); op Average divides the values by the size. The ranks agree on
    the dense size, the sparse dimensions and the dtype (the size travels in the checked name), so a
    rank with another fails every rank with MismatchError. Returns a callable (Horovod's handle for
    this one): calling it, or hvd.synchronize(it), gives the sparse result."""
    where = "sparse_allreduce_async"
    on, exc = set_comm(process_set, where)
    if exc is not None:
        reject_blocking("allgather", exc, on)
    try:
        op = Average if op is None else op
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
            got = type(tensor).__name__ if not isinstance(tensor, torch.Tensor) else f"layout {tensor.layout}"
            raise TypeError(f"{where}: tensor must be a torch.sparse_coo tensor, got {got}")
        if isinstance(op, bool) or op not in (Average, Sum):
            raise ValueError(f"{where}: op must be hvd.Average or hvd.Sum, got {op!r}")
    except Exception as exc:  # noqa: BLE001 - the peers' first allgather fails too
        reject_blocking("allgather", exc, on)
    result = sparse_allreduce_on(tensor, on, op, where, name)
    return lambda: result


def sparse_allreduce_on(tensor, on, op, where, name=None):
    """The sparse allreduce of a checked torch.sparse_coo tensor over communicator `on`, now."""
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    label = f"{'' if name is None else name + '.'}indices of a sparse {tuple(t.size())} tensor"
    # Allgather concatenates along the first dimension: the indices go transposed (one row each).
    indices = _allgather_now(t.indices().t().contiguous(), where, label, on)
    values = _allgather_now(t.values().contiguous(), where, None if name is None else f"{name}.values", on)
    if op == Average:
        values = values / on.Get_size()
    return torch.sparse_coo_tensor(indices.t(), values, t.size(), check_invariants=True)
