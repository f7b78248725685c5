"""Horovod's alltoall, reducescatter, grouped_allgather and grouped_reducescatter on torch tensors, over
gflow's alltoall and reduce_scatter(rows=True) (where they differ from Horovod: see _allreduce.py's
docstring; the grouped forms run their tensors one after another, not fused).

- alltoall: rank r sends rows splits[d] of its tensor to rank d (equal parts without splits) and gets
  the rows every rank addressed to it, in rank order; with splits it also returns the received
  splits (int32), as Horovod since 0.22. Any dtype; the trailing axes and the dtype must agree.
- reducescatter: the ranks' tensors (same shape) are reduced (Average or Sum, prescale/postscale as
  allreduce's) and rank r keeps rows np.array_split gives it of the first axis (the first
  shape[0] % size ranks one row more), as Horovod's.
- Gradients as Horovod's: alltoall's is the alltoall of the incoming gradient back along the received
  splits; reducescatter's the allgather of the incoming gradient (times the set's size for Sum, and
  the factors); grouped_allgather's, allgather's.
"""

import numpy as np
import torch

import gflow

from ..collectives.exchange import alltoall_on, check_splits, reduce_scatter_on
from ..collectives.operations import background_on
from ..runtime.context import context
from . import _basics
from ._basics import Average, Sum
from ._common import (
    WIDENED,
    check_factor,
    check_tensor,
    dtype_name,
    fingerprint,
    named,
    names_in_flight,
    narrowed,
    reject_async,
    reject_blocking,
    scale_,
    scaled,
    set_comm,
    tensors_text,
)
from ._gather import _AllgatherPlan, allgather, allgather_member
from ._handles import Pending, raise_as_horovod, register
from .compression import Compression, wire_compression

# --- alltoall ----------------------------------------------------------------------------------------


def _splits(splits, where: str, size: int, rows: int):
    """splits as a list of ints, checked (ValueError, as Horovod raises for splits that are not
    integers or do not fit the tensor)."""
    if splits is None:
        check_splits(None, (rows,), size)
        return None
    if isinstance(splits, torch.Tensor):
        if splits.dtype.is_floating_point or splits.dtype.is_complex or splits.dtype == torch.bool:
            raise ValueError(f"{where}: splits must hold integers (int32), got dtype {splits.dtype}")
        splits = splits.detach().cpu().reshape(-1).tolist()
    try:
        counts = check_splits(splits, (rows,), size)
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    return [int(c) for c in counts]


class _AlltoallPlan(_AllgatherPlan):
    """One alltoall, checked (raises on bad arguments): an allgather's rows (dtypes gflow does not move
    travel as int32 words), sent by `splits`; the result reads back as the allgather's does."""

    def __init__(self, tensor, splits, where, name, on):
        check_tensor(tensor, where)
        if tensor.dim() == 0:
            raise ValueError(f"{where}: tensor must have at least one dimension, got a 0-d tensor")
        super().__init__(tensor, where, name)
        self.splits = _splits(splits, where, on.Get_size(), tensor.shape[0])

    def run(self, ctx):
        return alltoall_on(ctx, self.words, self.splits, fingerprint=self.fingerprint, about=self.about)

    def finish(self, result):
        received, counts = result
        return super().finish(received), torch.from_numpy(counts.astype(np.int32))


def _alltoall_now(tensor, splits, where, name, on):
    try:
        plan = _AlltoallPlan(tensor, splits, where, name, on)
    except Exception as exc:  # noqa: BLE001 - every local failure reaches the peers
        reject_blocking("alltoall", exc, on)
    try:
        return plan.finish(plan.run(context(on)))
    except gflow.GflowError as exc:
        raise_as_horovod(exc)


@names_in_flight
def alltoall_async(tensor, splits=None, name=None, process_set=None) -> int:
    """Start an alltoall on gflow's background thread; synchronize() returns (output, received_splits)."""
    on, exc = set_comm(process_set, "alltoall_async")
    if exc is None:
        try:
            plan = _AlltoallPlan(tensor, splits, "alltoall_async", name, on)
        except Exception as error:  # noqa: BLE001 - reported by synchronize(); the peers' fails too
            exc = error
    if exc is not None:
        return reject_async("alltoall", exc, on)
    handle = background_on(context(on), "alltoall", plan.run, plan.words)
    return register(Pending([handle], lambda results: plan.finish(results[0])))


class _AlltoallFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set, on):
        output, received = _alltoall_now(tensor, splits, "alltoall", name, on)
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, *unused):
        grad, _ = alltoall(grad_output.contiguous(), splits=ctx.received, process_set=ctx.process_set)
        return grad, None, None, None, None


@names_in_flight
def alltoall(tensor, splits=None, name=None, process_set=None):
    """Send slices of the first axis to every rank (splits: rows per rank, in rank order; equal
    parts by default) and return what every rank sent this one, concatenated in rank order; with
    splits, (output, received_splits). Differentiable. The tensor is not modified."""
    on, exc = set_comm(process_set, "alltoall")
    if exc is None and not isinstance(tensor, torch.Tensor):
        exc = TypeError(f"alltoall: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if exc is not None:
        reject_blocking("alltoall", exc, on)
    return _AlltoallFunction.apply(tensor, splits, name, process_set, on)


# --- reducescatter -----------------------------------------------------------------------------------


class _ReducescatterPlan:
    """One reducescatter, checked: what to send, and what to do with this rank's rows."""

    def __init__(self, tensor, op, prescale, postscale, where, name, on, members=None):
        check_tensor(tensor, where, reduce=True)
        if tensor.dim() == 0:
            raise ValueError(f"{where}: tensor must have at least one dimension, got a 0-d tensor")
        if isinstance(op, bool) or op not in (Average, Sum):
            name_of = _basics.OP_NAMES.get(op, repr(op)) if not isinstance(op, bool) else repr(op)
            # (a known op reducescatter lacks is NotImplementedError, a RuntimeError, as Horovod's
            # error for Adasum is; anything else is not an op at all)
            known = not isinstance(op, bool) and op in _basics.OP_NAMES
            raise (NotImplementedError if known else ValueError)(
                f"{where}: op must be hvd.Average or hvd.Sum, got {name_of}"
            )
        prescale = check_factor(prescale, where, "prescale_factor")
        postscale = check_factor(postscale, where, "postscale_factor")
        floating = tensor.dtype.is_floating_point
        self.gop = "mean" if (op == Average and floating) else "sum"
        self.narrow = tensor.dtype if tensor.dtype in WIDENED else None
        self.post = postscale / on.Get_size() if (op == Average and not floating) else postscale
        self.src = scaled(tensor, prescale) if prescale != 1.0 else tensor.detach().contiguous()
        if self.narrow is not None:
            self.src = self.src.to(torch.int32)
        listed, members = members is not None, [tensor] if members is None else members
        shapes = [(dtype_name(t.dtype), tuple(t.shape)) for t in members]
        self.fingerprint = fingerprint("reducescatter", shapes, int(op), prescale, postscale, name)
        self.about = (
            f"{named(name)}{tensors_text(members, listed)}, op={_basics.OP_NAMES[op]}, "
            f"prescale_factor={prescale}, postscale_factor={postscale}"
        )

    def run(self, ctx):
        kw = dict(rows=True, fingerprint=self.fingerprint, about=self.about)
        return reduce_scatter_on(ctx, self.src, self.gop, **kw)

    def finish(self, result):
        if self.narrow is not None:
            result = narrowed(result, self.narrow)
        scale_(result, self.post)
        return result


def _plans(tensors, op, prescale, postscale, where, name, on):
    """The checked plans of a grouped reducescatter (each agreeing on every tensor's shape, in order)."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{where}: tensors must be a list of tensors, got {type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"{where}: tensors is empty")
    for i, t in enumerate(tensors):
        check_tensor(t, where, f"tensors[{i}]", reduce=True)
    return [
        _ReducescatterPlan(t, op, prescale, postscale, where, name, on, members=list(tensors))
        for t in tensors
    ]


def _reducescatter_now(tensors, op, prescale, postscale, where, name, on) -> list:
    try:
        plans = _plans(tensors, op, prescale, postscale, where, name, on)
    except Exception as exc:  # noqa: BLE001
        reject_blocking("reduce_scatter", exc, on)
    try:
        return [plan.finish(plan.run(context(on))) for plan in plans]
    except gflow.GflowError as exc:
        raise_as_horovod(exc)


def _reducescatter_async(tensors, op, prescale, postscale, process_set, where, name, single) -> int:
    on, exc = set_comm(process_set, where)
    if exc is None:
        try:
            plans = _plans(tensors, op, prescale, postscale, where, name, on)
        except Exception as error:  # noqa: BLE001
            exc = error
    if exc is not None:
        return reject_async("reduce_scatter", exc, on)
    handle = background_on(
        context(on), "reduce_scatter", lambda c: [p.run(c) for p in plans], *[p.src for p in plans]
    )

    def finish(results):
        outputs = [p.finish(r) for p, r in zip(plans, results[0], strict=True)]
        return outputs[0] if single else outputs

    return register(Pending([handle], finish))


@names_in_flight
def reducescatter_async(
    tensor, name=None, op=Average, process_set=None, prescale_factor=1.0, postscale_factor=1.0
) -> int:
    """Start a reducescatter on gflow's background thread; synchronize() returns this rank's rows."""
    where = "reducescatter_async"
    pre, post = prescale_factor, postscale_factor
    return _reducescatter_async([tensor], op, pre, post, process_set, where, name, True)


@names_in_flight
def grouped_reducescatter_async(
    tensors, name=None, op=Average, process_set=None, prescale_factor=1.0, postscale_factor=1.0
) -> int:
    """Start a reducescatter of each tensor; synchronize() returns the list of this rank's rows."""
    where = "grouped_reducescatter_async"
    pre, post = prescale_factor, postscale_factor
    return _reducescatter_async(tensors, op, pre, post, process_set, where, name, False)


class _ReducescatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, prescale, postscale, name, process_set, on, *tensors):
        ctx.args = (op, prescale, postscale, process_set, on)
        where = "reducescatter" if len(tensors) == 1 else "grouped_reducescatter"
        return tuple(_reducescatter_now(list(tensors), op, prescale, postscale, where, name, on))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, process_set, on = ctx.args
        factor = (on.Get_size() if op == Sum else 1) * prescale * postscale
        gathered = [allgather(g.contiguous() * factor, process_set=process_set) for g in grads]
        return (None, None, None, None, None, None, *gathered)


def _reducescatter(tensors, compression, op, process_set, prescale, postscale, name, where):
    on, exc = set_comm(process_set, where)
    if exc is None:
        try:
            cname, compressor = wire_compression(compression, where)
            if cname is not None:  # (Horovod's fp16 is a cast: so is gflow's here)
                compressor = Compression.fp16 if cname == "fp16" else Compression.bf16
            if not isinstance(tensors, (list, tuple)):
                raise TypeError(f"{where}: tensors must be a list of tensors, got {type(tensors).__name__}")
            for i, t in enumerate(tensors):
                check_tensor(t, where, "tensor" if where == "reducescatter" else f"tensors[{i}]")
        except Exception as error:  # noqa: BLE001
            exc = error
    if exc is not None:
        reject_blocking("reduce_scatter", exc, on)
    pairs = [(t, None) if compressor is None else compressor.compress(t) for t in tensors]
    outputs = _ReducescatterFunction.apply(
        op, prescale, postscale, name, process_set, on, *[c for c, _ in pairs]
    )
    if compressor is None:
        return list(outputs)
    return [compressor.decompress(o, cctx) for o, (_, cctx) in zip(outputs, pairs, strict=True)]


@names_in_flight
def reducescatter(
    tensor,
    name=None,
    compression=None,
    op=Average,
    process_set=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """Reduce the ranks' tensors (same shape; Average or Sum) and return this rank's rows of the first
    axis (np.array_split's share); differentiable. The tensor is not modified."""
    pre, post = prescale_factor, postscale_factor
    return _reducescatter([tensor], compression, op, process_set, pre, post, name, "reducescatter")[0]


@names_in_flight
def grouped_reducescatter(
    tensors,
    name=None,
    compression=None,
    op=Average,
    process_set=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """reducescatter of each tensor of a list; returns the list of this rank's rows; differentiable."""
    where = "grouped_reducescatter"
    pre, post = prescale_factor, postscale_factor
    return _reducescatter(tensors, compression, op, process_set, pre, post, name, where)


# --- grouped allgather -------------------------------------------------------------------------------


@names_in_flight
def grouped_allgather_async(tensors, name=None, process_set=None) -> int:
    """Start an allgather of each tensor of a list, on gflow's background thread; synchronize()
    returns the list of gathered tensors."""
    where = "grouped_allgather_async"
    on, exc = set_comm(process_set, where)
    if exc is None:
        try:
            if not isinstance(tensors, (list, tuple)) or not tensors:
                raise TypeError(f"{where}: tensors must be a non-empty list of tensors, got {tensors!r}")
            plans = [_AllgatherPlan(t, where, name, (i, len(tensors))) for i, t in enumerate(tensors)]
        except Exception as error:  # noqa: BLE001
            exc = error
    if exc is not None:
        return reject_async("allgather", exc, on)
    handle = background_on(
        context(on), "allgather", lambda c: [p.run(c) for p in plans], *[p.words for p in plans]
    )
    return register(
        Pending([handle], lambda results: [p.finish(r) for p, r in zip(plans, results[0], strict=True)])
    )


@names_in_flight
def grouped_allgather(tensors, name=None, process_set=None) -> list:
    """allgather of each tensor of a list; returns the list of gathered tensors; differentiable."""
    if not isinstance(tensors, (list, tuple)):
        on, exc = set_comm(process_set, "grouped_allgather")
        what = type(tensors).__name__
        reject_blocking(
            "allgather", exc or TypeError(f"grouped_allgather: tensors must be a list, got {what}"), on
        )
    return [allgather_member(t, name, process_set, (i, len(tensors))) for i, t in enumerate(tensors)]
