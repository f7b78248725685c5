"""The latency path's fast lane: a small NumPy allreduce of a shape, dtype and op this rank has
reduced before skips the general checks and dispatch, reusing what the first such call decided
(which took the general path).

The general path spends about 7 us of Python at p = 2 (kinds, transports, signature, dispatch)
around a recursive-doubling exchange that itself costs what MPI's own Allreduce does. Here a dict
keyed by (dtype, shape, op, algorithm, small_message_bytes) on the context holds the signature, the
recursive-doubling plan and the text of a mismatch; each call checks only what may differ from the
first (x contiguous, `out`, a timeline on). The ranks still exchange the whole signature in every
call's header, so a mismatch raises on every rank exactly as before: only this rank's local work is
cached. A call the fast lane does not serve (anything it has not seen, a non-contiguous x, an out= of
another kind, compression, a mean of 2-byte floats) takes the general path, which raises its errors.

Why not one MPI_Allreduce with a compiled reduction operator over [header | payload] (measured,
issue 27): such an operator (a Numba cfunc registered with MPI_Op_create) ran as fast as MPI.SUM, but
MPI_Allreduce needs the same message size on every rank, and ranks that disagree on the size are the
very case the header must catch: MPICH 5 then aborted the job ("Message truncated") at p = 2 and 4 and
hung at p = 3. gflow's own recursive doubling receives into room for any peer's message, so a
mismatch of any kind still raises on every rank.
"""

import numpy as np

from ..arrays import host_ops as host
from ..errors import MismatchError
from ..runtime import timeline
from ..runtime.config import config
from ..runtime.context import CommContext
from ..runtime.signature import signature
from . import recursive_doubling
from .checks import check_allreduce, shape_fingerprint
from .dispatch import latency_path_bytes

_UNSEEN = object()
_MAX_ENTRIES = 256  # a trainer reduces a handful of shapes; a script that makes new ones forever is bounded


class SmallCall:
    """What the first call of one (dtype, shape, op, algorithm) decided."""

    __slots__ = ("plan", "sig", "dtype", "shape", "flat", "count", "op", "mean", "about")

    def __init__(self, sig, dtype, shape, op: str, mean: bool):
        self.plan = None  # recursive_doubling's, made by the first call (on the general path)
        self.sig, self.dtype, self.shape, self.op, self.mean = sig, dtype, shape, op, mean
        self.flat = len(shape) == 1
        self.count = int(np.prod(shape, dtype=np.int64))
        self.about = f"an array of shape {shape}"


def allreduce(ctx: CommContext, x: np.ndarray, op: str, out, algorithm: str):
    """allreduce of the ndarray x through the fast lane, or None where the general path must run."""
    if timeline.active():
        return None
    small = ctx.small_calls.get((x.dtype, x.shape, op, algorithm, config.small_message_bytes), _UNSEEN)
    if small.__class__ is not SmallCall:
        if small is _UNSEEN:
            if len(ctx.small_calls) >= _MAX_ENTRIES:
                ctx.small_calls.clear()
            key = (x.dtype, x.shape, op, algorithm, config.small_message_bytes)
            ctx.small_calls[key] = _learn(ctx, x, op, algorithm)
        return None  # (a first call takes the general path: it makes the plan, and the context)
    if not x.flags.c_contiguous or ctx.slots is None:  # (None: the context's first exchange, which sets
        return None  # them up, has not been made: its first call was interrupted before it, say)
    if small.plan is None:
        small.plan = recursive_doubling.plan_for(ctx, small.sig, latency_path_bytes(ctx.size), x)
    if out is None:
        result = np.empty(small.shape, small.dtype)
    elif out is x and x.flags.writeable:
        result = x
    elif (
        out.__class__ is np.ndarray
        and out.dtype == small.dtype
        and out.size == small.count
        and out.flags.c_contiguous
        and out.flags.writeable
        and not np.may_share_memory(out, x)
    ):
        result = out
    else:
        return None
    if ctx.failed is not None or ctx.abandoned is not None or ctx.ended is not None:
        ctx.check_usable()
    plan = small.plan
    flat = small.flat and result.ndim == 1  # (a reshape costs 0.3 us: about what this lane adds)
    dst = result if flat else result.reshape(-1)
    try:
        if flat and plan.slots_step is not None and ctx.slots and (out is None or dst.flags.aligned):
            recursive_doubling.run_compiled_slots(ctx, plan, small.sig, x, dst, small.op, small.about)
        else:
            src = x if flat else x.reshape(-1)
            recursive_doubling.run(ctx, plan, small.sig, src, dst, small.op, small.about)
    except MismatchError as exc:
        raise MismatchError(f"{exc}.\nThis rank passed {small.about}") from exc
    if small.mean:
        host.divide(dst, ctx.size)
    return result


def _learn(ctx: CommContext, x: np.ndarray, op: str, algorithm: str):
    """A SmallCall for calls like this one, or None where the fast lane does not serve them."""
    try:
        checked = check_allreduce(x, op, None, algorithm, None, ranks=ctx.size, need_out=False)
        _, dtype, name, chosen, _, _ = checked
    except Exception:  # the general path raises it, after telling the peers
        return None
    if chosen != "recursive_doubling" or ctx.size == 1:  # (x is a plain ndarray: operations.allreduce)
        return None
    if name == "mean" and dtype.itemsize == 2:  # (divided before the sum: dispatch._predivided)
        return None
    sig = signature("allreduce", chosen, x.size, dtype, name, extra=shape_fingerprint(x.shape), memory="host")
    return SmallCall(sig, dtype, x.shape, "sum" if name == "mean" else name, name == "mean")
