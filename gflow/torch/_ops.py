"""Horovod's collectives on torch tensors, over gflow's collectives (tensors in, tensors out).

Where this differs from Horovod, and why:
- Every rank must start its collectives in the same order (MPI's rule, and gflow's). A `name=`, when
  given, is agreed on with the shapes: two tensors of one shape started in another order on some
  rank, under their names, fail with MismatchError on every rank instead of coming back swapped
  (Horovod matches them by name; without names, gflow cannot tell two same-shape tensors apart).
- allreduce and the allreduce_async family run on gflow's background thread (gflow.allreduce_async);
  blocking allreduce/allreduce_ runs in the caller's thread. allgather and broadcast have no
  background form in gflow: their *_async variants run at the call and return a finished handle
  (errors are still raised by synchronize(), as for the others).
- A rank whose own arguments are bad (not a tensor, not contiguous for an in-place op, a bad op...)
  raises its TypeError/ValueError/NotImplementedError, and its peers raise MismatchError instead of
  waiting for it (blocking calls raise at the call, async ones at synchronize()). Ranks passing
  different shapes (another shape of the same size too; for grouped_allreduce, each tensor's shape, in
  order) or dtypes, or (allreduce) different ops or prescale/postscale factors, raise MismatchError, a
  HorovodInternalError, on every rank, as Horovod's controller checks them.
- dtypes: allreduce takes float16/32/64, bfloat16 and int32/64 (gflow's); allgather and broadcast move
  any dtype (others travel as bytes). Integer Average is the sum times 1/size truncated toward zero, as
  Horovod's scaling in C. Product is computed from an allgather (p times the memory of the tensor);
  Adasum raises NotImplementedError.
- Gradients: allreduce's backward is an allreduce with the same op and factors (Average and Sum only;
  the gradient of Min/Max/Product raises NotImplementedError, where Horovod returns a meaningless one).
  allgather's and broadcast's backward average the incoming gradients over the ranks, as Horovod's
  does since 0.22 (each rank's loss is taken to be one of p equal shares of the objective).
"""

import itertools
import math
import time
import zlib

import numpy as np
import torch

import gflow

from ..collectives.operations import (
    FINGERPRINT_BITS,
    allgather_on,
    allreduce_async_on,
    allreduce_on,
    broadcast_on,
    reject,
    rejected_in_background,
)
from ..runtime.context import context
from . import _basics
from ._basics import Adasum, Average, Max, Min, Product, Sum, as_horovod_error, check_process_set
from .compression import wire_compression

_REDUCIBLE = (torch.float16, torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16)
_ITS_OWN_WIRE = {torch.float16: "fp16", torch.bfloat16: "bf16"}  # compression that changes nothing
_MOVABLE_DIRECT = _REDUCIBLE  # moved by gflow as they are; other dtypes travel as int32 words
_GFLOW_OP = {Sum: "sum", Min: "min", Max: "max"}


# --- handles ---------------------------------------------------------------------------------------


class _Pending:
    """An operation started by an *_async call: gflow handles to wait for, then finish(results)."""

    __slots__ = ("handles", "finish", "error")

    def __init__(self, handles=(), finish=None, error=None):
        self.handles = list(handles)
        self.finish = finish
        self.error = error


_handle_map: dict = {}
_counter = itertools.count()


def _register(pending: _Pending) -> int:
    handle = next(_counter)
    _handle_map[handle] = pending
    return handle


def shutdown() -> None:
    """Forget the communicator and the async handles; is_initialized() is then False until the next
    init(). MPI stays up (mpi4py finalizes it at exit), and async operations started before still
    complete."""
    _handle_map.clear()
    _basics.forget_comm()


def poll(handle) -> bool:
    """True once the operation of `handle` has finished; synchronize() then does not block."""
    pending = _handle_map.get(handle)
    if pending is None:
        raise ValueError(f"poll: handle {handle!r} was not created or has already been synchronized")
    return all(h.done() for h in pending.handles)


def synchronize(handle):
    """Wait for the operation of `handle` and return its output tensor (the input tensor itself for the
    in-place variants; a list for the grouped ones). An unknown or already synchronized handle
    returns None, as in Horovod.

    Raises:
        HorovodInternalError: the collective failed on every rank (gflow's MismatchError etc., which
            are instances of it); TypeError/ValueError: this rank's own arguments were bad.
    """
    pending = _handle_map.pop(handle, None)
    if pending is None:
        return None
    error, results = pending.error, []
    for h in pending.handles:  # wait for all of them, even after a failure: the channel resets
        try:
            results.append(h.wait())
        except Exception as exc:  # noqa: BLE001 - raised below, once all have finished
            error = error or exc
    if error is not None:
        raise as_horovod_error(error).with_traceback(error.__traceback__)
    return pending.finish(results)


def _raise(exc):
    raise as_horovod_error(exc).with_traceback(exc.__traceback__) from None


# --- argument checks -------------------------------------------------------------------------------


def resolve_op(op, average, where: str):
    """Horovod's op/average rule: op supersedes average; both given is a ValueError; default Average."""
    if op is not None:
        if average is not None:
            raise ValueError(f"{where}: the op parameter supersedes average; provide only one of them")
    elif average is not None:
        op = Average if average else Sum
    else:
        op = Average
    if isinstance(op, bool) or op not in _basics.OP_NAMES:
        raise ValueError(f"{where}: op must be hvd.Average, Sum, Min, Max or Product, got {op!r}")
    if op == Adasum:
        raise NotImplementedError(f"{where}: op=hvd.Adasum is not implemented by gflow; use Average or Sum")
    return op


def check_tensor(tensor, where: str, arg: str = "tensor", in_place: bool = False, reduce: bool = False):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where}: {arg} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"{where}: {arg} is on device {tensor.device}; gflow.torch takes cpu and cuda tensors"
        )
    if tensor.layout != torch.strided:
        raise TypeError(f"{where}: {arg} must be a dense (strided) tensor, got layout {tensor.layout}")
    if reduce and tensor.dtype not in _REDUCIBLE:
        supported = ", ".join(str(t) for t in _REDUCIBLE)
        raise TypeError(f"{where}: {arg} has dtype {tensor.dtype}; allreduce takes {supported}")
    if in_place and not tensor.is_contiguous():
        raise ValueError(
            f"{where}: {arg} must be contiguous to be written in place; got strides {tensor.stride()} "
            f"for shape {tuple(tensor.shape)}"
        )


def _check_factor(value, where: str, arg: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{where}: {arg} must be a number, got {type(value).__name__}")
    return float(value)


def _comm():
    return _basics.comm()


def _reject_blocking(collective: str, exc: Exception):
    """This rank's arguments are bad: make the peers' blocking collective fail too, then raise."""
    reject(context(_comm()), collective)
    raise exc


def _reject_async(collective: str, exc: Exception) -> int:
    """As _reject_blocking, for a call whose peers queued a background collective: the rejection takes
    this rank's place in the queue, and synchronize() raises exc."""
    return _register(_Pending([rejected_in_background(context(_comm()), collective, exc)], None))


# --- what the ranks agree on ------------------------------------------------------------------------


def _fingerprint(*parts) -> int:
    """A checksum of what the ranks must agree on beyond gflow's own signature (the tensors' shapes and
    torch dtypes, Horovod's op and scale factors), as Horovod's controller compares them; it travels
    in the signature's fingerprint field (collectives/api.py)."""
    return zlib.crc32(repr(parts).encode()) & ((1 << FINGERPRINT_BITS) - 1)


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _named(name) -> str:
    """'name='w', ' in a MismatchError, when the user gave one."""
    return "" if name is None else f"name={name!r}, "


def _tensors_text(tensors) -> str:
    """How this rank's tensors read in a MismatchError."""
    if len(tensors) == 1:
        t = tensors[0]
        return f"a tensor of shape {tuple(t.shape)} and dtype {_dtype_name(t.dtype)}"
    shown = ", ".join(f"{_dtype_name(t.dtype)} {tuple(t.shape)}" for t in tensors[:8])
    more = f", ... ({len(tensors)} in all)" if len(tensors) > 8 else ""
    return f"tensors [{shown}{more}]"


# --- scaling -----------------------------------------------------------------------------------------


def _scale_(t, factor: float) -> None:
    """t *= factor in place; for integers, the product in float64 truncated toward zero (Horovod's C)."""
    if factor == 1.0:
        return
    if t.dtype.is_floating_point:
        t.mul_(factor)
    else:
        t.copy_((t.to(torch.float64) * factor).to(t.dtype))


def _scaled(t, factor: float):
    """A new tensor holding t * factor (as _scale_)."""
    out = t.detach().clone(memory_format=torch.contiguous_format)
    _scale_(out, factor)
    return out


# --- allreduce ---------------------------------------------------------------------------------------


class _Plan:
    """One allreduce, checked: what to send, how, and what to do with the result."""

    def __init__(self, tensor, output, op, prescale, postscale, compression, where, members=None, name=None):
        """members: the tensors `tensor` fuses (grouped_allreduce), whose shapes the ranks agree on;
        name: the user's name= (agreed on too, when given)."""
        check_tensor(tensor, where, in_place=output is not None, reduce=True)
        prescale = _check_factor(prescale, where, "prescale_factor")
        postscale = _check_factor(postscale, where, "postscale_factor")
        cname, compressor = wire_compression(compression, where)
        if compressor is not None:
            raise TypeError(f"{where}: only Compression.none, .fp16 and .bf16 apply here")
        floating = tensor.dtype.is_floating_point
        self.gop = "mean" if (op == Average and floating) else _GFLOW_OP.get(op, "sum")
        self.product = op == Product
        # Integer Average: the sum, then scaled by postscale/size and truncated, as Horovod does in C.
        self.post = postscale / _basics.size() if (op == Average and not floating) else postscale
        # (the other 16-bit type as compression is passed on, for gflow's TypeError naming both)
        same = _ITS_OWN_WIRE.get(tensor.dtype) == cname
        self.compression = cname if (floating and not same) else None
        self.out = None if output is None else output.detach()
        if prescale != 1.0:
            self.src = _scaled(tensor, prescale)
        elif output is tensor:
            self.src = self.out  # the very object: gflow then knows it reduces in place
        else:
            self.src = tensor.detach().contiguous()
        self.result_of = output  # the in-place variant returns the tensor itself
        # The ranks agree on the shapes (and their order), the op and the factors, as Horovod's
        # controller does: an integer Average travels as a sum and the factors are applied locally,
        # so gflow's own signature would not tell them apart.
        members = [tensor] if members is None else members
        shapes = [(_dtype_name(t.dtype), tuple(t.shape)) for t in members]
        self.tag = ("allreduce", _fingerprint(shapes, int(op), prescale, postscale, name))
        self.about = (
            f"{_named(name)}{_tensors_text(members)}, op={_basics.OP_NAMES[op]}, "
            f"prescale_factor={prescale}, postscale_factor={postscale}"
        )

    def finish(self, result):
        _scale_(result, self.post)
        return result if self.result_of is None else self.result_of

    def run_product(self):
        """Product: every rank multiplies all ranks' values in rank order (bitwise identical)."""
        rows = self.src.reshape(1, -1)
        everyone = allgather_on(context(_comm()), rows, self.tag[1], self.about)
        product = torch.prod(everyone, dim=0).reshape(self.src.shape)
        if self.out is None:
            return product
        self.out.copy_(product)
        return self.out


def _allreduce_blocking(tensor, output, op, prescale, postscale, compression, where, name=None):
    try:
        plan = _Plan(tensor, output, op, prescale, postscale, compression, where, name=name)
    except Exception as exc:  # noqa: BLE001 - every local failure reaches the peers
        _reject_blocking("allreduce", exc)
    try:
        if plan.product:
            result = plan.run_product()
        else:
            result = allreduce_on(
                context(_comm()), plan.src, plan.gop, plan.out, "auto", plan.compression, plan.tag, plan.about
            )
    except gflow.GflowError as exc:
        _raise(exc)
    return plan.finish(result)


def _allreduce_async(tensor, output, op, prescale, postscale, compression, where, name=None) -> int:
    try:
        plan = _Plan(tensor, output, op, prescale, postscale, compression, where, name=name)
    except Exception as exc:  # noqa: BLE001
        return _reject_async("allreduce", exc)
    if plan.product:  # no background form: run now, report at synchronize()
        try:
            result = plan.run_product()
        except Exception as exc:  # noqa: BLE001
            return _register(_Pending(error=exc))
        return _register(_Pending([], lambda _: plan.finish(result)))
    h = _start(plan)
    return _register(_Pending([h], lambda results: plan.finish(results[0])))


def _start(plan: _Plan):
    """The background allreduce of a checked plan (not Product)."""
    return allreduce_async_on(
        context(_comm()), plan.src, plan.gop, out=plan.out, compression=plan.compression, tag=plan.tag,
        about=plan.about,
    )  # fmt: skip


def _op_args(op, average, where):
    try:
        return resolve_op(op, average, where), None
    except Exception as exc:  # noqa: BLE001
        return None, exc


def allreduce_async(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=None
) -> int:
    """Start reducing `tensor` over all ranks (not modified); return a handle for poll()/synchronize(),
    which returns a new tensor. op: Average (default), Sum, Min, Max, Product. The result is
    postscale_factor * op(prescale_factor * tensor)."""
    op, exc = _op_args(op, average, "allreduce_async")
    if exc is None:
        exc = _process_set_error(process_set, "allreduce_async")
    if exc is not None:
        return _reject_async("allreduce", exc)
    return _allreduce_async(
        tensor, None, op, prescale_factor, postscale_factor, None, "allreduce_async", name=name
    )


def allreduce_async_(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=None
) -> int:
    """As allreduce_async, in place: synchronize() returns `tensor`, holding the result."""
    op, exc = _op_args(op, average, "allreduce_async_")
    if exc is None:
        exc = _process_set_error(process_set, "allreduce_async_")
    if exc is not None:
        return _reject_async("allreduce", exc)
    return _allreduce_async(
        tensor, tensor, op, prescale_factor, postscale_factor, None, "allreduce_async_", name=name
    )


def allreduce_(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=None
):
    """Reduce `tensor` over all ranks in place and return it."""
    op, exc = _op_args(op, average, "allreduce_")
    if exc is None:
        exc = _process_set_error(process_set, "allreduce_")
    if exc is not None:
        _reject_blocking("allreduce", exc)
    return _allreduce_blocking(
        tensor, tensor, op, prescale_factor, postscale_factor, None, "allreduce_", name=name
    )


def _process_set_error(process_set, where):
    try:
        check_process_set(process_set, where)
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


class _AllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, compression, name):
        ctx.args = (op, prescale, postscale, compression)
        return _allreduce_blocking(tensor, None, op, prescale, postscale, compression, "allreduce", name)

    @staticmethod
    def backward(ctx, grad_output):
        op, prescale, postscale, compression = ctx.args
        if op not in (Average, Sum):
            raise NotImplementedError(
                f"the gradient of allreduce with op={_basics.OP_NAMES[op]} is not implemented "
                "(Average and Sum are)"
            )
        grad = allreduce(
            grad_output.contiguous(),
            op=op,
            compression=compression,
            prescale_factor=prescale,
            postscale_factor=postscale,
        )
        return grad, None, None, None, None, None


def allreduce(
    tensor,
    average=None,
    name=None,
    compression=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=None,
):
    """Reduce `tensor` over all ranks and return a new tensor (the input is not modified).

    Differentiable: the gradient is the allreduce of the incoming gradient with the same op and
    factors. compression: Compression.none (default), Compression.fp16 (float16 on the wire),
    Compression.bf16 (bfloat16 on the wire) or a
    compressor of your own (compress, reduce, decompress, as Horovod runs it).
    """
    op, exc = _op_args(op, average, "allreduce")
    if exc is None:
        exc = _process_set_error(process_set, "allreduce")
    if exc is None:
        try:
            check_tensor(tensor, "allreduce")
            cname, compressor = wire_compression(compression, "allreduce")
        except Exception as error:  # noqa: BLE001
            exc = error
    if exc is not None:
        _reject_blocking("allreduce", exc)
    if compressor is not None:
        compressed, cctx = compressor.compress(tensor)
        reduced = _AllreduceFunction.apply(compressed, op, prescale_factor, postscale_factor, None, name)
        return compressor.decompress(reduced, cctx)
    wire = compression if cname else None
    return _AllreduceFunction.apply(tensor, op, prescale_factor, postscale_factor, wire, name)


# --- grouped allreduce -------------------------------------------------------------------------------


def _grouped_start(tensors, in_place, op, prescale, postscale, compression, where, name=None) -> int:
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
            plan = _Plan(
                flat, flat, op, prescale, postscale, compression, where, members=list(tensors), name=name
            )
            plans.append((members, plan))
    except Exception as exc:  # noqa: BLE001
        return _reject_async("allreduce", exc)
    handles = []
    for _, plan in plans:
        handles.append(None if plan.product else _start(plan))
    products = {}
    for k, (_, plan) in enumerate(plans):
        if plan.product:
            try:
                products[k] = plan.run_product()
            except Exception as exc:  # noqa: BLE001
                return _register(_Pending([h for h in handles if h is not None], error=exc))

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

    return _register(_Pending([h for h in handles if h is not None], finish))


def _grouped(
    tensors, in_place, average, op, prescale, postscale, process_set, compression, where, name=None
) -> int:
    op, exc = _op_args(op, average, where)
    if exc is None:
        exc = _process_set_error(process_set, where)
    if exc is not None:
        return _reject_async("allreduce", exc)
    return _grouped_start(tensors, in_place, op, prescale, postscale, compression, where, name)


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


def grouped_allreduce_(
    tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=None
):
    """Reduce a list of tensors in place (fused); return the list."""
    pre, post, where = prescale_factor, postscale_factor, "grouped_allreduce_"
    handle = _grouped(tensors, True, average, op, pre, post, process_set, None, where, name)
    return synchronize(handle)


class _GroupedAllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, prescale, postscale, compression, name, *tensors):
        ctx.args = (op, prescale, postscale, compression)
        handle = _grouped_start(
            list(tensors), False, op, prescale, postscale, compression, "grouped_allreduce", name
        )
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx, *grads):
        op, prescale, postscale, compression = ctx.args
        if op not in (Average, Sum):
            raise NotImplementedError(
                f"the gradient of grouped_allreduce with op={_basics.OP_NAMES[op]} is not implemented"
            )
        reduced = grouped_allreduce(
            [g.contiguous() for g in grads],
            op=op,
            compression=compression,
            prescale_factor=prescale,
            postscale_factor=postscale,
        )
        return (None, None, None, None, None, *reduced)


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
    op, exc = _op_args(op, average, "grouped_allreduce")
    if exc is None:
        exc = _process_set_error(process_set, "grouped_allreduce")
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
        return synchronize(_reject_async("allreduce", exc))
    if compressor is not None:
        pairs = [compressor.compress(t) for t in tensors]
        reduced = _GroupedAllreduceFunction.apply(
            op, prescale_factor, postscale_factor, None, name, *[c for c, _ in pairs]
        )
        return [compressor.decompress(r, cctx) for r, (_, cctx) in zip(reduced, pairs, strict=True)]
    wire = compression if cname else None
    return list(_GroupedAllreduceFunction.apply(op, prescale_factor, postscale_factor, wire, name, *tensors))


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


def _agreed(x, shape, name=None):
    """What the ranks of an allgather or broadcast agree on besides gflow's own signature: the
    tensor's `shape` (allgather: its axes after the first) and torch dtype, which dtypes moved as int32
    words would otherwise not show, and the user's name=; and how this rank's call reads in a
    MismatchError."""
    about = f"{_named(name)}a tensor of shape {tuple(x.shape)} and dtype {_dtype_name(x.dtype)}"
    if x.dtype not in _MOVABLE_DIRECT:
        about += " (moved as int32 words)"
    return _fingerprint(_dtype_name(x.dtype), tuple(shape), name), about


def _allgather_now(tensor, where, name=None):
    try:
        check_tensor(tensor, where)
        x = tensor.detach()
        if x.dtype in _MOVABLE_DIRECT:
            words, nbytes = x.contiguous(), None
        else:
            words, nbytes = _to_words(x)
        fingerprint, about = _agreed(x, x.shape[1:], name)
    except Exception as exc:  # noqa: BLE001 - every local failure reaches the peers
        _reject_blocking("allgather", exc)
    try:
        gathered = allgather_on(context(_comm()), words, fingerprint, about)
    except gflow.GflowError as exc:
        _raise(exc)
    if nbytes is None:
        return gathered
    return _from_words(gathered, nbytes, x.dtype, x.shape[1:] if x.dim() else ())


def allgather_async(tensor, name=None, process_set=None) -> int:
    """Concatenate every rank's tensor along the first dimension, in rank order (ranks may differ in
    the first dimension only). Runs at the call; synchronize() returns the new tensor."""
    exc = _process_set_error(process_set, "allgather_async")
    try:
        if exc is not None:
            _reject_blocking("allgather", exc)
        result = _allgather_now(tensor, "allgather_async", name)
    except Exception as error:  # noqa: BLE001 - reported by synchronize(), as for the others
        return _register(_Pending(error=error))
    return _register(_Pending([], lambda _: result))


class _AllgatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name):
        ctx.dim0 = tensor.shape[0] if tensor.dim() else 1
        ctx.scalar = tensor.dim() == 0
        return _allgather_now(tensor, "allgather", name)

    @staticmethod
    def backward(ctx, grad_output):
        reduced = allreduce(grad_output.contiguous(), op=Average)
        sizes = gflow.allgather(torch.tensor([ctx.dim0], dtype=torch.int64), comm=_comm())
        offset = int(sizes[: _basics.rank()].sum())
        grad = reduced.narrow(0, offset, ctx.dim0)
        return grad.reshape(()) if ctx.scalar else grad, None


def allgather(tensor, name=None, process_set=None):
    """Concatenate every rank's tensor along the first dimension, in rank order; differentiable
    (the gradient is this rank's slice of the ranks' average incoming gradient, as Horovod's)."""
    exc = _process_set_error(process_set, "allgather")
    if exc is None and not isinstance(tensor, torch.Tensor):
        exc = TypeError(f"allgather: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if exc is not None:
        _reject_blocking("allgather", exc)
    return _AllgatherFunction.apply(tensor, name)


# --- broadcast ---------------------------------------------------------------------------------------


def _broadcast_now(tensor, root_rank, in_place: bool, where, name=None):
    try:
        check_tensor(tensor, where, in_place=in_place)
        if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
            raise TypeError(f"{where}: root_rank must be an int, got {type(root_rank).__name__}")
        if not 0 <= root_rank < _basics.size():
            raise ValueError(f"{where}: root_rank must be in [0, {_basics.size()}), got {root_rank}")
        x = tensor.detach()
        if x.dtype in _MOVABLE_DIRECT:
            words = nbytes = None
        else:
            words, nbytes = _to_words(x.reshape(1, x.numel()))
        fingerprint, about = _agreed(x, x.shape, name)
    except Exception as exc:  # noqa: BLE001
        _reject_blocking("broadcast", exc)
    root, ctx = int(root_rank), context(_comm())
    try:
        if words is None:
            if in_place:
                broadcast_on(ctx, x, root, x, fingerprint, about)
                return tensor
            return broadcast_on(ctx, x.contiguous(), root, None, fingerprint, about)
        words = broadcast_on(ctx, words, root, None, fingerprint, about)
    except gflow.GflowError as exc:
        _raise(exc)
    result = _from_words(words, nbytes, x.dtype, (x.numel(),)).reshape(x.shape)
    if in_place:
        x.copy_(result)
        return tensor
    return result


def _broadcast_async(tensor, root_rank, process_set, in_place, where, name=None) -> int:
    exc = _process_set_error(process_set, where)
    try:
        if exc is not None:
            _reject_blocking("broadcast", exc)
        result = _broadcast_now(tensor, root_rank, in_place, where, name)
    except Exception as error:  # noqa: BLE001 - reported by synchronize()
        return _register(_Pending(error=error))
    return _register(_Pending([], lambda _: result))


def broadcast_async(tensor, root_rank, name=None, process_set=None) -> int:
    """root_rank's tensor on every rank (a new tensor; the input is not modified). Runs at the call;
    synchronize() returns the result."""
    return _broadcast_async(tensor, root_rank, process_set, False, "broadcast_async", name)


def broadcast_async_(tensor, root_rank, name=None, process_set=None) -> int:
    """As broadcast_async, in place: synchronize() returns `tensor`, holding root_rank's values."""
    return _broadcast_async(tensor, root_rank, process_set, True, "broadcast_async_", name)


def broadcast_(tensor, root_rank, name=None, process_set=None):
    """Overwrite `tensor` with root_rank's values on every rank; return it."""
    exc = _process_set_error(process_set, "broadcast_")
    if exc is not None:
        _reject_blocking("broadcast", exc)
    return _broadcast_now(tensor, root_rank, True, "broadcast_", name)


class _BroadcastFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.root_rank = root_rank
        return _broadcast_now(tensor, root_rank, False, "broadcast", name)

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output.contiguous(), op=Average)
        if _basics.rank() != ctx.root_rank:
            grad = torch.zeros_like(grad)
        return grad, None, None


def broadcast(tensor, root_rank, name=None, process_set=None):
    """root_rank's tensor on every rank, as a new tensor; differentiable (root's gradient is the ranks'
    average incoming gradient, the others' zero, as Horovod's)."""
    exc = _process_set_error(process_set, "broadcast")
    if exc is None and not isinstance(tensor, torch.Tensor):
        exc = TypeError(f"broadcast: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if exc is not None:
        _reject_blocking("broadcast", exc)
    return _BroadcastFunction.apply(tensor, root_rank, name)


# --- barrier and join --------------------------------------------------------------------------------


def barrier(process_set=None) -> None:
    """Wait until every rank has reached the barrier (async operations already started go on). A
    tiny blocking gflow allreduce, not MPI's Barrier: it waits where gflow's collectives wait, so a
    late rank is named by the stall inspector (and GFLOW_STALL_ABORT_S ends the job), a rank that left
    raises GflowError, and a barrier on some ranks only while the others are in step() is found as
    crossed waits. It runs on the caller's channel, as other blocking calls: on the background one it
    would queue behind the optimizer's segments, which ranks that used other parameters send at
    other times."""
    check_process_set(process_set, "barrier")
    try:
        tag, about = ("allreduce", _fingerprint("barrier")), "barrier()"  # (no tensor's call matches it)
        allreduce_on(context(_comm()), np.zeros(1, np.int32), "sum", None, "auto", None, tag, about)
    except gflow.GflowError as exc:
        _raise(exc)


def join(device=-1) -> int:
    """Wait until every rank has called join(); return the rank that called it last.

    Horovod lets ranks that joined serve the others' allreduces with zeros, so ranks may run
    different numbers of steps. gflow cannot: every rank must make the same collective calls. Here
    join() works when every rank calls it (a barrier that reports the last rank to arrive, by each
    rank's wall clock at the call: exact on one node, as good as the clocks' agreement across nodes;
    not MPI.Wtime, whose zero Open MPI sets per process). It runs on gflow's background channel,
    after the async operations already started: a rank still running DistributedOptimizer steps or
    async allreduces while the others wait in join() makes every rank raise MismatchError (a
    HorovodInternalError) rather than hang. (A blocking allreduce/allgather/broadcast facing peers
    in join() still waits, as in MPI.)
    `device` is accepted and ignored.
    """
    arrival = torch.full((_basics.size(),), -np.inf, dtype=torch.float64)
    arrival[_basics.rank()] = time.time()
    try:
        latest = gflow.allreduce_async(arrival, "max", comm=_comm()).wait()
    except gflow.GflowError as exc:
        _raise(exc)
    return int(torch.argmax(latest).item())  # ties: the lowest rank
