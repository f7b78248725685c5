"""Horovod's grouped_allreduce family: the tensors of each (device, dtype) fused into one flat buffer,
reduced as one allreduce (_allreduce.py's plan), and split back. Where this differs from Horovod:
see _allreduce.py's docstring."""

import torch

from . import _basics
from ._allreduce import _AllreducePlan, _op_args, _start
from ._basics import Adasum, Average, Sum
from ._common import check_tensor, names_in_flight, reject_async, set_comm
from ._handles import Pending, register, synchronize
from .compression import wire_compression


def _grouped_start(tensors, in_place, op, prescale, postscale, compression, where, name=None, on=None) -> int:
    """Fuse the tensors of each (device, dtype) into one flat buffer, allreduce each buffer in the
    background, and split the results back (in place, or into new tensors)."""
    try:
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(f"{where}: tensors must be a list of tensors, got {type(tensors).__name__}")
        if not tensors:
            raise ValueError(f"{where}: tensors is empty")
        for i, t in enumerate(tensors):
            check_tensor(t, where, f"tensors[{i}]", in_place=in_place, reduce=True)
        groups: dict = {}
        for i, t in enumerate(tensors):
            groups.setdefault((t.device, t.dtype), []).append(i)
        plans = []
        for members in groups.values():
            flat = torch.cat([tensors[i].detach().reshape(-1) for i in members])
            # Every group's allreduce carries the fingerprint of all the tensors' shapes, in order:
            # the flat buffers alone would let [(3,), (2,)] meet [(2,), (3,)] and mix their elements.
            plan = _AllreducePlan(
                flat,
                flat,
                op,
                prescale,
                postscale,
                compression,
                where,
                members=list(tensors),
                name=name,
                on=on,
                members_here=[tensors[i] for i in members],
            )
            plans.append((members, plan))
    except Exception as exc:  # noqa: BLE001
        return reject_async("allreduce", exc, on)
    handles = []
    for _, plan in plans:
        handles.append(None if plan.product else _start(plan))
    products = {}
    for k, (_, plan) in enumerate(plans):
        if plan.product:
            try:
                products[k] = plan.run_product()
            except Exception as exc:  # noqa: BLE001
                return register(Pending([h for h in handles if h is not None], error=exc))

    def finish(results):
        it = iter(results)
        outputs = [None] * len(tensors)
        for k, (members, plan) in enumerate(plans):
            flat = plan.finish(products[k] if plan.product else next(it))
            offset = 0
            for i in members:
                t = tensors[i]
                piece = flat[offset : offset + t.numel()].view(t.shape)
                offset += t.numel()
                if in_place:
                    t.detach().copy_(piece)
                    outputs[i] = t
                else:
                    outputs[i] = piece.clone()
        return outputs

    return register(Pending([h for h in handles if h is not None], finish))


def _grouped(
    tensors, in_place, average, op, prescale, postscale, process_set, compression, where, name=None
) -> int:
    on, exc = set_comm(process_set, where)
    if exc is None:
        op, exc = _op_args(op, average, where)
    if exc is not None:
        return reject_async("allreduce", exc, on)
    return _grouped_start(tensors, in_place, op, prescale, postscale, compression, where, name, on)


@names_in_flight
def grouped_allreduce_async(
    tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=None
) -> int:
    """Start reducing a list of tensors (fused); synchronize() returns a list of new tensors."""
    return _grouped(
        tensors,
        False,
        average,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
        None,
        "grouped_allreduce_async",
        name,
    )


@names_in_flight
def grouped_allreduce_async_(
    tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=None
) -> int:
    """As grouped_allreduce_async, in place: synchronize() returns the tensors themselves."""
    return _grouped(
        tensors,
        True,
        average,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
        None,
        "grouped_allreduce_async_",
        name,
    )


@names_in_flight
def grouped_allreduce_(
    tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=None
):
    """Reduce a list of tensors in place (fused); return the list."""
    pre, post, where = prescale_factor, postscale_factor, "grouped_allreduce_"
    handle = _grouped(tensors, True, average, op, pre, post, process_set, None, where, name)
    return synchronize(handle)


class _GroupedAllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, prescale, postscale, compression, name, process_set, on, *tensors):
        ctx.args = (op, prescale, postscale, compression, process_set)
        handle = _grouped_start(
            list(tensors), False, op, prescale, postscale, compression, "grouped_allreduce", name, on
        )
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, compression, process_set = ctx.args
        if op not in (Average, Sum, Adasum):
            raise NotImplementedError(
                f"the gradient of grouped_allreduce with op={_basics.OP_NAMES[op]} is not implemented"
            )
        reduced = grouped_allreduce(
            [g.contiguous() for g in grads],
            op=op,
            compression=compression,
            prescale_factor=prescale,
            postscale_factor=postscale,
            process_set=process_set,
        )
        return (None, None, None, None, None, None, None, *reduced)


@names_in_flight
def grouped_allreduce(
    tensors,
    average=None,
    name=None,
    compression=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=None,
):
    """Reduce a list of tensors (fused) and return a list of new tensors; differentiable."""
    on, exc = set_comm(process_set, "grouped_allreduce")
    if exc is None:
        op, exc = _op_args(op, average, "grouped_allreduce")
    if exc is None:
        try:
            cname, compressor = wire_compression(compression, "grouped_allreduce")
            if not isinstance(tensors, (list, tuple)):
                raise TypeError(
                    f"grouped_allreduce: tensors must be a list of tensors, got {type(tensors).__name__}"
                )
        except Exception as error:  # noqa: BLE001
            exc = error
    if exc is not None:
        return synchronize(reject_async("allreduce", exc, on))
    args = (op, prescale_factor, postscale_factor)
    if compressor is not None:
        pairs = [compressor.compress(t) for t in tensors]
        reduced = _GroupedAllreduceFunction.apply(*args, None, name, process_set, on, *[c for c, _ in pairs])
        return [compressor.decompress(r, cctx) for r, (_, cctx) in zip(reduced, pairs, strict=True)]
    wire = compression if cname else None
    return list(_GroupedAllreduceFunction.apply(*args, wire, name, process_set, on, *tensors))
