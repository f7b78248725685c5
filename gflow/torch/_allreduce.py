"""Horovod's allreduce family on torch tensors, over gflow's allreduce (tensors in, tensors out);
grouped_allreduce is in _grouped.py, allgather, broadcast, barrier and join in _gather.py,
alltoall and reducescatter in _scatter.py, the handles in _handles.py.

Where this differs from Horovod, and why:
- Every rank must start its collectives in the same order (MPI's rule, and gflow's). A `name=`, when
  given, is agreed on with the shapes: two tensors of one shape started in another order on some
  rank, under their names, fail with MismatchError on every rank instead of coming back swapped
  (Horovod matches them by name; without names, gflow cannot tell two same-shape tensors apart).
- The *_async calls (allreduce, grouped, allgather, broadcast) run on gflow's background thread, in
  the order each rank started them; the blocking ones run in the caller's thread.
- A rank whose own arguments are bad (not a tensor, not contiguous for an in-place op, a bad op...)
  raises its TypeError/ValueError/NotImplementedError, and its peers raise MismatchError instead of
  waiting for it (blocking calls raise at the call, async ones at synchronize()). Ranks passing
  different shapes (another shape of the same size too; for grouped_allreduce, each tensor's shape, in
  order) or dtypes, or (allreduce) different ops or prescale/postscale factors, raise MismatchError, a
  HorovodInternalError, on every rank, as Horovod's controller checks them.
- dtypes: allreduce takes float16/32/64, bfloat16 and int32/64 (gflow's), and uint8, int8, int16 and
  bool (reduced as int32, cast back: see _common.narrowed); allgather and broadcast move any dtype
  (others travel as bytes). Integer Average is the sum times 1/size truncated toward zero, as
  Horovod's scaling in C. Product is computed from an allgather (p times the memory of the tensor).
  Adasum (floating dtypes, a power-of-two number of ranks, the global set: Horovod's restrictions on
  MPI) runs gflow's Adasum on the host (collectives/adasum.py); CUDA tensors are staged through it,
  as Horovod's MPI Adasum copies them to the CPU; grouped_allreduce combines each tensor on its own.
- Gradients: allreduce's backward is an allreduce with the same op and factors (Average, Sum and, as
  Horovod's, Adasum; the gradient of Min/Max/Product raises NotImplementedError, where Horovod
  returns a meaningless one).
  allgather's and broadcast's backward average the incoming gradients over the ranks, as Horovod's
  does since 0.22 (each rank's loss is taken to be one of p equal shares of the objective).
"""

import torch

import gflow

from ..collectives.exchange import allgather_on
from ..collectives.operations import adasum_on, allreduce_async_on, allreduce_on, background_on
from ..runtime.context import context
from . import _basics
from ._basics import Adasum, Average, Product, Sum, refused_in_join_as
from ._common import (
    GFLOW_OP,
    ITS_OWN_WIRE,
    WIDENED,
    check_factor,
    check_tensor,
    comm,
    dtype_name,
    fingerprint,
    named,
    names_in_flight,
    narrowed,
    reject_async,
    reject_blocking,
    resolve_op,
    scale_,
    scaled,
    set_comm,
    tensors_text,
)
from ._handles import Pending, raise_as_horovod, register
from .compression import wire_compression

# --- allreduce ---------------------------------------------------------------------------------------


class _AllreducePlan:
    """One allreduce, checked: what to send, how, and what to do with the result."""

    def __init__(
        self, tensor, output, op, prescale, postscale, compression, where, members=None, name=None, on=None,
        members_here=None,
    ):  # fmt: skip
        """members: the tensors `tensor` fuses (grouped_allreduce), whose shapes the ranks agree on;
        name: the user's name= (agreed on too, when given); on: the process set's communicator."""
        self.comm = comm() if on is None else on
        check_tensor(tensor, where, in_place=output is not None, reduce=True)
        prescale = check_factor(prescale, where, "prescale_factor")
        postscale = check_factor(postscale, where, "postscale_factor")
        cname, compressor = wire_compression(compression, where)
        if compressor is not None:
            raise TypeError(f"{where}: only Compression.none, .fp16 and .bf16 apply here")
        floating = tensor.dtype.is_floating_point
        self.gop = "mean" if (op == Average and floating) else GFLOW_OP.get(op, "sum")
        self.product = op == Product
        if op == Adasum:
            if not floating:
                raise TypeError(f"{where}: op=hvd.Adasum combines floating-point tensors, got {tensor.dtype}")
            if self.comm is not comm():
                raise NotImplementedError(
                    f"{where}: Adasum does not support non-global process sets (as Horovod)"
                )
        # Adasum combines each tensor on its own: the sizes of the tensors fused in `tensor`
        self.sizes = [t.numel() for t in (members_here or [tensor])]
        self.narrow = tensor.dtype if tensor.dtype in WIDENED else None  # reduced as int32 (narrowed)
        # Integer Average: the sum, then scaled by postscale/size and truncated, as Horovod does in C.
        self.post = postscale / self.comm.Get_size() if (op == Average and not floating) else postscale
        # (the other 16-bit type as compression is passed on, for gflow's TypeError naming both)
        same = ITS_OWN_WIRE.get(tensor.dtype) == cname
        self.compression = cname if (floating and not same) else None
        self.out = None if output is None else output.detach()
        if prescale != 1.0:
            self.src = scaled(tensor, prescale)
        elif output is tensor:
            self.src = self.out  # the very object: gflow then knows it reduces in place
        else:
            self.src = tensor.detach().contiguous()
        self.result_of = output  # the in-place variant returns the tensor itself
        if self.narrow is not None:
            self.src, self.out = self.src.to(torch.int32), None
        # The ranks agree on the shapes (and their order), the op and the factors, as Horovod's
        # controller does: an integer Average travels as a sum and the factors are applied locally,
        # so gflow's own signature would not tell them apart.
        listed, members = members is not None, [tensor] if members is None else members
        shapes = [(dtype_name(t.dtype), tuple(t.shape)) for t in members]
        if self.gop == "adasum" and self.compression is not None:
            raise ValueError(f"{where}: op=hvd.Adasum takes no wire compression (Compression.none)")
        self.tag = ("allreduce", fingerprint(shapes, int(op), prescale, postscale, name))
        self.about = (
            f"{named(name)}{tensors_text(members, listed)}, op={_basics.OP_NAMES[op]}, "
            f"prescale_factor={prescale}, postscale_factor={postscale}"
            + (f", compression={self.compression}" if self.compression else "")  # (helper-70: unsaid)
        )

    def finish(self, result):
        if self.narrow is not None:  # back to the narrow type first: an average divides its wrapped sum
            result = narrowed(result, self.narrow)
            scale_(result, self.post)
            if self.result_of is None:
                return result
            self.result_of.detach().copy_(result)
            return self.result_of
        scale_(result, self.post)
        return result if self.result_of is None else self.result_of

    def run_adasum(self, ctx):
        kw = dict(out=self.out, sizes=self.sizes, fingerprint=self.tag[1], about=self.about)
        return adasum_on(ctx, self.src, **kw)

    def run_product(self):
        """Product: every rank multiplies all ranks' values in rank order (bitwise identical)."""
        rows = self.src.reshape(1, -1)
        with refused_in_join_as("allreduce(op=Product)", "an allgather", "; use op=Sum, Min or Max there"):
            everyone = allgather_on(context(self.comm), rows, fingerprint=self.tag[1], about=self.about)
        product = torch.prod(everyone, dim=0).to(self.src.dtype)  # (torch.prod promotes integers)
        product = product.reshape(self.src.shape)
        if self.out is None:
            return product
        self.out.copy_(product)
        return self.out


def _allreduce_blocking(tensor, output, op, prescale, postscale, compression, where, name=None, on=None):
    try:
        plan = _AllreducePlan(tensor, output, op, prescale, postscale, compression, where, name=name, on=on)
    except Exception as exc:  # noqa: BLE001 - every local failure reaches the peers
        reject_blocking("allreduce", exc, on)
    try:
        if plan.product:
            result = plan.run_product()
        elif plan.gop == "adasum":
            result = plan.run_adasum(context(plan.comm))
        else:
            result = allreduce_on(
                context(plan.comm), plan.src, plan.gop, out=plan.out, compression=plan.compression,
                tag=plan.tag, about=plan.about,
            )  # fmt: skip
    except gflow.GflowError as exc:
        raise_as_horovod(exc)
    return plan.finish(result)


def _allreduce_async(tensor, output, op, prescale, postscale, compression, where, name=None, on=None) -> int:
    try:
        plan = _AllreducePlan(tensor, output, op, prescale, postscale, compression, where, name=name, on=on)
    except Exception as exc:  # noqa: BLE001
        return reject_async("allreduce", exc, on)
    if plan.product:  # no background form: run now, report at synchronize()
        try:
            result = plan.run_product()
        except Exception as exc:  # noqa: BLE001
            return register(Pending(error=exc))
        return register(Pending([], lambda _: plan.finish(result)))
    h = _start(plan)
    return register(Pending([h], lambda results: plan.finish(results[0])))


def _start(plan: _AllreducePlan):
    """The background allreduce of a checked plan (not Product)."""
    if plan.gop == "adasum":
        return background_on(context(plan.comm), "allreduce", plan.run_adasum, plan.src)
    return allreduce_async_on(
        context(plan.comm), plan.src, plan.gop, out=plan.out, compression=plan.compression, tag=plan.tag,
        about=plan.about,
    )  # fmt: skip


def _op_args(op, average, where):
    try:
        return resolve_op(op, average, where), None
    except Exception as exc:  # noqa: BLE001
        return None, exc


@names_in_flight
def allreduce_async(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=None
) -> int:
    """Start reducing `tensor` over all ranks (not modified); return a handle for poll()/synchronize(),
    which returns a new tensor. op: Average (default), Sum, Min, Max, Product. The result is
    postscale_factor * op(prescale_factor * tensor)."""
    on, exc = set_comm(process_set, "allreduce_async")
    if exc is None:
        op, exc = _op_args(op, average, "allreduce_async")
    if exc is not None:
        return reject_async("allreduce", exc, on)
    return _allreduce_async(
        tensor, None, op, prescale_factor, postscale_factor, None, "allreduce_async", name=name, on=on
    )


@names_in_flight
def allreduce_async_(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=None
) -> int:
    """As allreduce_async, in place: synchronize() returns `tensor`, holding the result."""
    on, exc = set_comm(process_set, "allreduce_async_")
    if exc is None:
        op, exc = _op_args(op, average, "allreduce_async_")
    if exc is not None:
        return reject_async("allreduce", exc, on)
    return _allreduce_async(
        tensor, tensor, op, prescale_factor, postscale_factor, None, "allreduce_async_", name=name, on=on
    )


@names_in_flight
def allreduce_(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=None
):
    """Reduce `tensor` over all ranks in place and return it."""
    on, exc = set_comm(process_set, "allreduce_")
    if exc is None:
        op, exc = _op_args(op, average, "allreduce_")
    if exc is not None:
        reject_blocking("allreduce", exc, on)
    return _allreduce_blocking(
        tensor, tensor, op, prescale_factor, postscale_factor, None, "allreduce_", name=name, on=on
    )


class _AllreduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, compression, name, process_set, on):
        ctx.args = (op, prescale, postscale, compression, process_set)
        return _allreduce_blocking(tensor, None, op, prescale, postscale, compression, "allreduce", name, on)

    @staticmethod
    def backward(ctx, grad_output):
        op, prescale, postscale, compression, process_set = ctx.args
        if op not in (Average, Sum, Adasum):
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
            process_set=process_set,
        )
        return grad, None, None, None, None, None, None, None


@names_in_flight
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
    on, exc = set_comm(process_set, "allreduce")
    if exc is None:
        op, exc = _op_args(op, average, "allreduce")
    if exc is None:
        try:
            check_tensor(tensor, "allreduce")
            cname, compressor = wire_compression(compression, "allreduce")
        except Exception as error:  # noqa: BLE001
            exc = error
    if exc is not None:
        reject_blocking("allreduce", exc, on)
    pre, post = prescale_factor, postscale_factor
    if compressor is not None:
        compressed, cctx = compressor.compress(tensor)
        reduced = _AllreduceFunction.apply(compressed, op, pre, post, None, name, process_set, on)
        return compressor.decompress(reduced, cctx)
    wire = compression if cname else None
    return _AllreduceFunction.apply(tensor, op, pre, post, wire, name, process_set, on)
