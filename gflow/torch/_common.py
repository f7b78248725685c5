"""What every gflow.torch collective shares: Horovod's op rule, the checks of a tensor argument, the
rejection of bad arguments on every rank, what the ranks agree on beyond gflow's own signature, and
Horovod's scaling."""

import functools
import inspect
import zlib

import numpy as np
import torch

from ..collectives.checks import FINGERPRINT_BITS
from ..collectives.operations import reject, rejected_in_background
from ..runtime.context import context
from . import _basics
from ._basics import Adasum, Average, Max, Min, Sum
from ._handles import Pending, in_flight, name_handle, register, synchronize
from .process_sets import NotInSet, RemovedSet, comm_of

REDUCIBLE = (torch.float16, torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16)
# Horovod also reduces these; gflow reduces them as int32 and casts the result back (see widened).
WIDENED = (torch.uint8, torch.int8, torch.int16, torch.bool)
ITS_OWN_WIRE = {torch.float16: "fp16", torch.bfloat16: "bf16"}  # compression that changes nothing
MOVABLE_DIRECT = REDUCIBLE  # moved by gflow as they are; other dtypes travel as int32 words
GFLOW_OP = {Sum: "sum", Min: "min", Max: "max", Adasum: "adasum"}


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
    if reduce and tensor.dtype not in REDUCIBLE and tensor.dtype not in WIDENED:
        supported = ", ".join(str(t) for t in REDUCIBLE + WIDENED)
        raise TypeError(f"{where}: {arg} has dtype {tensor.dtype}; allreduce takes {supported}")
    if in_place and not tensor.is_contiguous():
        raise ValueError(
            f"{where}: {arg} must be contiguous to be written in place; got strides {tensor.stride()} "
            f"for shape {tuple(tensor.shape)}"
        )


def check_factor(value, where: str, arg: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{where}: {arg} must be a number, got {type(value).__name__}")
    return float(value)


def comm():
    return _basics.comm()


def reject_blocking(collective: str, exc: Exception, on=None):
    """This rank's arguments are bad: make the peers' blocking collective on `on` (default the global
    communicator) fail too, then raise. on=False: raise only (see set_comm)."""
    if on is not False:
        reject(context(comm() if on is None else on), collective, exc)
    raise exc


def reject_async(collective: str, exc: Exception, on=None) -> int:
    """As reject_blocking, for a call whose peers queued a background collective: the rejection takes
    this rank's place in the queue, and synchronize() raises exc."""
    if on is False:
        return register(Pending(error=exc))
    return register(
        Pending([rejected_in_background(context(comm() if on is None else on), collective, exc)], None)
    )


def set_comm(process_set, where: str):
    """(the communicator of process_set, None), or (where to reject, the error) when this rank cannot
    take part: False (raise only) for a registered set that excludes this rank (its ranks are not
    waiting for this one, and this rank's own peers may be in that set's collective) or a set every
    rank removed (its ranks make the same mistake, Horovod raises at once), else None, the global
    communicator (something that is not a registered set: the peers most likely wait there)."""
    try:
        return comm_of(process_set, where), None
    except (NotInSet, RemovedSet) as exc:
        return False, exc
    except (TypeError, ValueError) as exc:
        return None, exc


# The collective each named blocking call of gflow.torch starts first (the one a rejection takes the
# place of), and whether it runs on the background channel (grouped_allreduce: an async call and its
# synchronize)
_STARTS = {
    "allreduce": ("allreduce", False),
    "grouped_allreduce": ("allreduce", True),
    **dict.fromkeys(("allgather", "grouped_allgather"), ("allgather", False)),
    **dict.fromkeys(("reducescatter", "grouped_reducescatter"), ("reduce_scatter", False)),
    "broadcast": ("broadcast", False),
    "alltoall": ("alltoall", False),
}


def names_in_flight(fn):
    """Decorate a call taking name=: a second operation under a name whose handle is not synchronized
    yet raises ValueError at the call, as in Horovod, and starts nothing (no collective: ranks that
    all make the same mistake all raise and go on in step; a peer that started something there
    instead meets this rank's next collective, whose signature and name differ: MismatchError on
    both). A blocking call is refused too (Horovod's is an async call and its synchronize), and its
    peers' call fails with it (reject_blocking); an *_async call's handle is named, until
    synchronize(). As Horovod keys a name (its operation's, "allreduce.w", in each process set's own
    queue), one name may be in flight once per operation and set (helper-71: an allgather_async under
    an allreduce_async's name was refused)."""
    parameters = list(inspect.signature(fn).parameters)
    position, set_position = parameters.index("name"), parameters.index("process_set")
    is_async = fn.__name__.rstrip("_").endswith("_async")
    operation = fn.__name__.rstrip("_").removesuffix("_async")

    @functools.wraps(fn)
    def call(*args, **kwargs):
        name = kwargs["name"] if "name" in kwargs else args[position] if len(args) > position else None
        if name is None:
            return fn(*args, **kwargs)
        on = kwargs.get("process_set", args[set_position] if len(args) > set_position else None)
        key = (operation, getattr(on, "process_set_id", 0) or 0, name)
        if in_flight(key) is not None:
            error = ValueError(
                f"{fn.__name__}: an operation named {name!r} is in flight on this rank (handle "
                f"{in_flight(key)}, not synchronized yet); synchronize it first, or use another name"
            )
            if is_async:
                raise error
            comm_or_where, bad_set = set_comm(on, fn.__name__)
            if bad_set is not None:
                return fn(*args, **kwargs)  # (which raises that, as it does)
            collective, in_background = _STARTS[operation]
            if in_background:
                return synchronize(reject_async(collective, error, comm_or_where))
            reject_blocking(collective, error, comm_or_where)
        if not is_async:
            return fn(*args, **kwargs)
        handle = fn(*args, **kwargs)
        name_handle(key, handle)
        return handle

    return call


# --- what the ranks agree on ------------------------------------------------------------------------


def fingerprint(*parts) -> int:
    """A checksum of what the ranks must agree on beyond gflow's own signature (the tensors' shapes and
    torch dtypes, Horovod's op and scale factors), as Horovod's controller compares them; it travels
    in the signature's fingerprint field (collectives/operations.py)."""
    return zlib.crc32(repr(parts).encode()) & ((1 << FINGERPRINT_BITS) - 1)


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def named(name) -> str:
    """'name='w', ' in a MismatchError, when the user gave one."""
    return "" if name is None else f"name={name!r}, "


def tensors_text(tensors, listed: bool = False) -> str:
    """How this rank's tensors read in a MismatchError; `listed`: passed as a list (a grouped call),
    whose length the ranks compare (recursive_doubling._mismatch_message), even a list of one."""
    if len(tensors) == 1 and not listed:
        t = tensors[0]
        return f"a tensor of shape {tuple(t.shape)} and dtype {dtype_name(t.dtype)}"
    shown = ", ".join(f"{dtype_name(t.dtype)} {tuple(t.shape)}" for t in tensors[:8])
    more = ", ..." if len(tensors) > 8 else ""
    return f"a list of {len(tensors)} tensor{'s' * (len(tensors) != 1)} [{shown}{more}]"


# --- scaling -----------------------------------------------------------------------------------------


def narrowed(t, dtype):
    """An int32 result of a WIDENED dtype's reduction, back in that dtype: integers wrap as the
    narrow type's own arithmetic would have (sums and products modulo 2**bits agree either way); a
    bool is True where the int32 is not zero (its sum is a logical or, its min an and)."""
    return t != 0 if dtype == torch.bool else t.to(dtype)


def scale_(t, factor: float) -> None:
    """t *= factor in place; for integers, the product in float64 truncated toward zero (Horovod's C)."""
    if factor == 1.0:
        return
    if t.dtype.is_floating_point:
        t.mul_(factor)
    else:
        t.copy_((t.to(torch.float64) * factor).to(t.dtype))


def scaled(t, factor: float):
    """A new tensor holding t * factor (as scale_)."""
    out = t.detach().clone(memory_format=torch.contiguous_format)
    scale_(out, factor)
    return out
