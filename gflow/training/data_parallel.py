"""A framework-neutral kit for data-parallel training: what a trainer needs between backward and the
optimizer step, over arrays (NumPy, CuPy, torch tensors: anything gflow reduces).

    params = {"w1": w1, "b1": b1, "w2": w2, "b2": b2}      # the model's parameters, in model order
    gflow.broadcast_parameters(params)                       # every rank starts from rank 0's weights
    dp = gflow.DataParallel(params, compression="fp16", loss_scaler=gflow.LossScaler())
    grads = dp.gradient_buffers()                            # where backward writes (pool views)
    for batch in batches:
        ...backward, last layer first: write grads["b2"], then dp.push("b2"); grads["w2"]; ...
        if dp.synchronize():                                 # False: a skipped (overflowed) step
            for name, p in params.items():
                p -= lr * grads[name]                        # the mean gradient, unscaled

Gradients go into gflow.LazyAllreduce in a fixed order, the reverse of the parameters' order (backward
produces the last layer first), whatever order the trainer pushes them in: a gradient that is ready
waits until every earlier one is, as DDP's buckets fire in order. LazyAllreduce needs every rank to push
the same sizes in the same order, and backward's order may differ between ranks (threads, unused
parameters); the fixed order makes that the kit's problem, not the trainer's. A parameter that no
gradient reached in a step (unused on this rank) is pushed as zeros at synchronize().

(Long: the step, push order, zeros for missing gradients, the loss-scale agreement and the
commit, and its checkpoint are one contract, read together.)
"""

import warnings
import zlib
from collections.abc import Mapping

import numpy as np
from mpi4py import MPI

from ..arrays.codecs import check_compression
from ..arrays.kinds import check_array, check_writable
from ..collectives.checks import FINGERPRINT_BITS
from ..collectives.exchange import broadcast, broadcast_on
from ..collectives.join import join
from ..collectives.operations import reject
from ..errors import GflowError, NonFiniteError
from ..fusion.lazy import LazyAllreduce
from ..fusion.sparse import check_dtype as check_sparse_dtype
from ..runtime import checkpoint as st
from ..runtime.context import context
from ..runtime.signature import is_floating
from .loss_scaler import LossScaler

# The fusion segment size for training (DataParallel, gflow.torch), measured end to end (bench/RESULTS.md,
# "The fusion threshold for training"). With float32 on the wire, 25 MiB (DDP's bucket_cap_mb): with
# backward computing on the same cores, fewer and larger segments cost less than LazyAllreduce's own
# 4 MiB (ResNet-18, 4 ranks on 2 cores: 1.00x DDP gloo against 0.90-0.94x). With fp16 on the wire, 4 MiB:
# halved transfers leave less to hide, and small segments start during backward (AlexNet under 1 Gbit/s:
# 1.03x DDP's fp16 hook at 4 MiB, 0.98x at 12.5 MiB, 0.94x at 25 MiB).
TRAINING_THRESHOLD_BYTES = 25 * 2**20
TRAINING_THRESHOLD_BYTES_FP16 = 4 * 2**20
# A step's first segment is DDP's first bucket (1 MiB): the wire starts while backward computes the
# rest (AlexNet under 1 Gbit/s: its last layer's 16 MB went out 120 ms sooner than with the layer
# before it, bench/RESULTS.md, "AlexNet against DDP").
FIRST_SEGMENT_BYTES = 2**20


def training_threshold(compression, sparse) -> int:
    """The default segment size for training with these settings (see above)."""
    return TRAINING_THRESHOLD_BYTES_FP16 if compression and sparse is None else TRAINING_THRESHOLD_BYTES


def _shape_of(x) -> tuple:
    shape = getattr(x, "shape", None)
    if shape is None:  # a bare __cuda_array_interface__ object
        shape = x.__cuda_array_interface__["shape"]
    return tuple(int(s) for s in shape)


def _same_communicator(a, b) -> bool:
    """Whether a and b are one communicator (None: MPI.COMM_WORLD; two mpi4py objects of one handle)."""
    return (MPI.COMM_WORLD if a is None else a) == (MPI.COMM_WORLD if b is None else b)


def _named(params, who: str):
    """(keys, arrays, named) of a dict name -> array, a list/tuple of arrays (keys: indices) or of
    (name, array) pairs (as torch's named_parameters() gives)."""
    if isinstance(params, Mapping):
        keys, arrays, named = list(params.keys()), list(params.values()), True
        for key in keys:
            if not isinstance(key, str):
                raise TypeError(f"{who}: parameter names must be strings, got {key!r}")
    else:
        if isinstance(params, np.ndarray) or not hasattr(params, "__iter__"):
            raise TypeError(
                f"{who}: params must be a dict name -> array or a list of arrays, got {type(params).__name__}"
            )
        items = list(params)
        named = bool(items) and all(
            isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) for i in items
        )
        if named:
            keys, arrays = [k for k, _ in items], [a for _, a in items]
            seen = set()
            for key in keys:
                if key in seen:
                    raise ValueError(f"{who}: the parameter name {key!r} appears twice")
                seen.add(key)
        else:
            keys, arrays = list(range(len(items))), items
    if not arrays:
        raise ValueError(f"{who}: no parameters given")
    first = {}
    for key, a in zip(keys, arrays, strict=True):
        if id(a) in first:
            raise ValueError(
                f"{who}: parameters {first[id(a)]!r} and {key!r} are the same array; pass a shared "
                "(tied) parameter once, or its gradient is counted twice"
            )
        first[id(a)] = key
    return keys, arrays, named


def _fill_zero(x) -> None:
    if isinstance(x, np.ndarray):
        x[...] = 0
        return
    kind = check_array(x, "grad")[0]
    kind.ops.clear(kind.write_view(x, "grad"))
    kind.ops.fence()


def _zeros_like(x):
    """A zeroed array of x's kind, shape and dtype."""
    if isinstance(x, np.ndarray):
        return np.zeros(x.shape, x.dtype)
    kind, dtype = check_array(x, "param")
    z = kind.new(x, _shape_of(x), dtype)
    _fill_zero(z)
    return z


def broadcast_parameters(params, root: int = 0, *, comm=None) -> None:
    """Overwrite every parameter, in place, with root's values: every rank starts from the same weights.

    Args:
        params: a dict name -> array, a list/tuple of arrays, or of (name, array) pairs; each a
            writable, C-contiguous NumPy, device array or tensor. Every rank passes the same shapes
            and dtypes in the same order.
        root: the rank whose values are sent.
        comm: an mpi4py intracommunicator (default COMM_WORLD).

    Raises:
        TypeError, ValueError: bad params on this rank (the peers raise MismatchError).
        MismatchError: the ranks passed different parameters.
    """
    try:
        keys, arrays, named = _named(params, "broadcast_parameters")
    except Exception:
        reject(context(comm), "broadcast")  # the peers wait in their first broadcast: fail them too
        raise
    _agree_on_keys(context(comm), keys if named else None, len(arrays), root)
    for a in arrays:
        broadcast(a, root, comm=comm, out=a)


def _agree_on_keys(ctx, keys: list | None, count: int, root: int) -> None:
    """MismatchError on every rank, before any parameter moves, where the ranks pass different numbers
    of parameters or different names (None: an unnamed list). Each broadcast agrees on its array's
    size and shape only: a parameter more on one rank was broadcast on that rank alone, into the
    peers' next collective, and names that differ swapped values silently (helper-83). One small
    broadcast agrees on the count (its size) and a checksum of the names (its fingerprint)."""
    words = "\0".join(keys) if keys is not None else ""
    fingerprint = zlib.crc32(words.encode()) & ((1 << FINGERPRINT_BITS) - 1)
    shown = (
        "" if keys is None else f" named {', '.join(map(repr, keys[:6]))}{', ...' if len(keys) > 6 else ''}"
    )
    broadcast_on(ctx, np.zeros(count, np.int32), root=root, fingerprint=fingerprint,
                 about=f"broadcast_parameters with {count} parameters{shown}")  # fmt: skip


class _Absent:
    """In the place of a parameter set_absent() took out of the fusion: its slot counts as gone."""


_ABSENT = _Absent()


def _pool_memory(params) -> str | None:
    """ "host" when every parameter is a NumPy array, "device" when every one is a Numba device
    array (the kind a device pool hands out), else None (no pool: new arrays of each kind)."""
    if all(type(p) is np.ndarray for p in params):
        return "host"
    if params and all(type(p).__name__ in ("DeviceNDArray", "FakeCUDAArray") for p in params):
        return "device"
    return None


class DataParallel:
    """Data-parallel gradient averaging for a custom trainer: fusion, overlap, fp16 or sparse
    communication and loss scaling behind push() and synchronize() (see the module docstring).

    Args:
        params: the model's parameters, in model order: a dict name -> array, a list/tuple of arrays
            (keys are then indices), or of (name, array) pairs. Gradients have their shapes and dtypes.
        op: "mean" (data parallelism's average) or "sum".
        threshold_bytes: LazyAllreduce's segment size; by default 25 MiB (DDP's bucket size), 4 MiB
            with compression="fp16" (training_threshold: measured end to end); "auto" tunes it
            during the first steps (LazyAllreduce).
        compression: None or "fp16" (LazyAllreduce's).
        sparse: None, or SparseAllreduce settings (density, chunk_elems, momentum, warmup_steps):
            coarse-grained sparse communication of each segment (each rank keeps a residual).
        loss_scaler: a gflow.LossScaler, or None. The trainer multiplies its loss by loss_scale;
            synchronize() unscales the gradients and skips a step that overflowed on any rank.
        comm: an mpi4py intracommunicator (default COMM_WORLD).

    Raises:
        TypeError, ValueError: bad parameters or settings.
    """

    def __init__(
        self,
        params,
        *,
        op="mean",
        threshold_bytes: int | str | None = None,
        compression=None,
        sparse=None,
        loss_scaler: LossScaler | None = None,
        comm=None,
    ):
        keys, arrays, self._named = _named(params, "DataParallel")
        shapes, dtypes = [], []
        for key, a in zip(keys, arrays, strict=True):
            dtype = check_array(a, f"DataParallel: parameter {key!r}")[1]
            if not is_floating(dtype):
                raise TypeError(f"DataParallel: parameter {key!r} must be floating, got {dtype}")
            try:  # (here, not in every step after: those would each fail on every rank)
                check_compression(compression, dtype)
                if sparse is not None:
                    check_sparse_dtype(dtype)
            except TypeError as exc:
                raise TypeError(f"DataParallel: parameter {key!r}: {exc}") from None
            shapes.append(_shape_of(a))
            dtypes.append(dtype)
        if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
            raise TypeError(
                f"loss_scaler must be a gflow.LossScaler or None, got {type(loss_scaler).__name__}"
            )
        if loss_scaler is not None and not _same_communicator(loss_scaler.comm, comm):
            raise ValueError(
                "loss_scaler must agree on overflow over DataParallel's communicator: make it with "
                "gflow.LossScaler(comm=...) and the same comm you pass here"
            )
        if threshold_bytes is None:
            threshold_bytes = training_threshold(compression, sparse)
        self._lazy = LazyAllreduce(
            threshold_bytes, op=op, compression=compression, comm=comm, sparse=sparse,
            first_segment_bytes=FIRST_SEGMENT_BYTES,
        )  # fmt: skip
        self._scaler = loss_scaler
        self._comm = comm
        self.agreed = None  # the last synchronize(agree=...)'s maximum over the ranks
        self._keys = keys
        # Slot i is the i-th gradient pushed into LazyAllreduce: parameters in reverse order.
        n = len(keys)
        self._slot_of = {key: n - 1 - i for i, key in enumerate(keys)}
        self._slot_params = arrays[::-1]
        # Named parameters are agreed on by name too (LazyAllreduce.push): ranks that list two
        # parameters of one shape in another order fail instead of averaging one into the other.
        self._slot_names = keys[::-1] if self._named else [None] * n
        self._slot_shapes, self._slot_dtypes = shapes[::-1], dtypes[::-1]
        self._buffers = None  # per slot, what gradient_buffers() handed out
        self._handed = None  # the dict (list) gradient_buffers() returned last: push(key) checks it
        self._zeros: dict = {}  # per slot, a zero gradient for a parameter unused on this rank
        self._last = None  # per slot, the arrays holding the last step's reduced gradients
        self._absent: frozenset = frozenset()  # slots set_absent() took out of the fusion
        self.step_count = 0
        self._reset_step()

    def _reset_step(self) -> None:
        # per slot, the gradient pushed in this step (_ABSENT: a slot out of the fusion)
        self._ready: list = [_ABSENT if slot in self._absent else None for slot in range(len(self._keys))]
        self._next = 0  # slots below this went into LazyAllreduce
        self._error = None  # a push that failed its checks: synchronize() raises it

    def _by_key(self, per_slot):
        n = len(self._keys)
        values = [None if per_slot[n - 1 - i] is _ABSENT else per_slot[n - 1 - i] for i in range(n)]
        return dict(zip(self._keys, values, strict=True)) if self._named else values

    @property
    def loss_scale(self) -> float:
        """What to multiply the loss by before backward (1.0 without a loss scaler)."""
        return 1.0 if self._scaler is None else self._scaler.scale

    def gradient_buffers(self, *, private: bool = False, reduce_in_place: bool = False):
        """Arrays for the gradients, keyed as params (a dict or a list): write each gradient into
        its array and push(key) it.

        When every parameter is a NumPy floating array of one dtype, or every one a Numba device
        array of one dtype (not bfloat16), and not with dense fp16 (whose pool holds float16), they
        are views of LazyAllreduce's fusion pool (in host or device memory), so pushing costs no
        copy; otherwise new arrays of each parameter's kind. The same arrays on every call, zeroed on the
        first. After synchronize() they hold the reduced gradients. The first call is collective
        when it carves the pool (LazyAllreduce.gradient_buffers): every rank calls it then, unless
        private=True (the pool in this rank's private memory). reduce_in_place=True: the pool is
        reduced where it is, saving the copy back (see LazyAllreduce.gradient_buffers: after a step
        that raised, the arrays may hold reduced values).
        """
        if self._buffers is None:
            lazy = self._lazy
            dtypes = set(self._slot_dtypes)
            memory = _pool_memory(self._slot_params)
            pool = (
                memory is not None
                and len(dtypes) == 1
                and not (memory == "device" and next(iter(dtypes)).kind == "V")  # (no bfloat16 on Numba)
                and not (lazy.compression and not lazy.sparse)
            )
            if pool:  # (zeroed where it is made: pool_memory's memory is)
                buffers = lazy.gradient_buffers(
                    self._slot_shapes, dtypes.pop(), private=private, reduce_in_place=reduce_in_place,
                    memory=memory,
                )  # fmt: skip
            else:
                buffers = [_zeros_like(p) for p in self._slot_params]
            self._buffers = buffers
        self._handed = self._by_key(self._buffers)
        return self._handed

    def gradients(self):
        """The arrays holding the last synchronize()'s reduced gradients, keyed as params: the arrays
        pushed, or the zero arrays used for unused parameters. Also after a synchronize() that raised
        NonFiniteError (what the step left in them); None before the first step."""
        return None if self._last is None else self._by_key(self._last)

    def push(self, key, grad=None) -> None:
        """This parameter's gradient is ready (call it during backward, as soon as it is).

        It goes to LazyAllreduce once every parameter after it in model order has been pushed too;
        do not modify it until synchronize() has returned, which leaves the reduced gradient in it.

        Args:
            key: the parameter's name (params given as a dict or pairs) or index (a list).
            grad: the gradient: an array of the parameter's shape and dtype, writable and C-contiguous
                (any kind gflow reduces: NumPy, device array, tensor). Default: this parameter's
                array from gradient_buffers().

        Raises:
            KeyError: no such parameter. ValueError: this parameter was already pushed in this step,
                or grad is None and gradient_buffers() was never called. RuntimeError: the last
                synchronize() was interrupted (Ctrl-C) and not called again. The step is unchanged.

        A grad that fails its checks (not an array, another shape or dtype, read-only) fails the step:
        synchronize() raises its TypeError/ValueError on this rank and MismatchError on the others.
        """
        try:
            slot = self._slot_of.get(key)
        except TypeError:  # unhashable
            slot = None
        if slot is None:
            raise KeyError(f"DataParallel.push: unknown parameter {key!r}; the parameters are {self._keys}")
        if self.synchronize_interrupted:
            raise RuntimeError(
                "DataParallel.push: the last synchronize() (in gflow.torch, step()) was interrupted while it "
                "waited for its step's results, which the other ranks have; call it again to finish that "
                "step, then push"
            )
        if self._ready[slot] is _ABSENT:
            raise ValueError(
                f"DataParallel.push: parameter {key!r} is out of the fusion (set_absent()); its gradient "
                "travels another way"
            )
        if self._ready[slot] is not None and self.cut_short() is not None:
            self._forget_cut_step()  # (the program began its next step: see cut_short)
        if self._ready[slot] is not None:
            raise ValueError(
                f"DataParallel.push: parameter {key!r} was already pushed in this step; push each "
                "parameter at most once between synchronize() calls"
            )
        given = grad is not None
        if not given:
            if self._buffers is None:
                raise ValueError(
                    f"DataParallel.push({key!r}): no grad given and no gradient_buffers() to take it from"
                )
            grad = self._buffers[slot]
        # (after the refusals above, which leave the step unchanged: not begun by a refused push)
        self._lazy.mark_begun()  # (its pushes reach it in model order, maybe later)
        if self._error is None:
            try:
                if given:
                    self._check_grad(slot, key, grad)
                else:
                    self._check_not_rebound(key, grad)
                if any(g is grad for g in self._ready):  # its reduced values would land twice
                    raise ValueError(
                        f"DataParallel.push({key!r}): grad is the array already pushed for another "
                        "parameter in this step"
                    )
            except (TypeError, ValueError) as exc:
                self._fail(exc)
        self._ready[slot] = grad
        self._drain()

    def cut_short(self) -> str | None:
        """Why this step was cut short on this rank, or None (LazyAllreduce.cut_short): crossed waits,
        or a step that met another kind of call, ended the communicator after the step's first push.
        This rank's synchronize() raises and forgets it; so does a push of a parameter already pushed
        in it (the program's next step, after the error)."""
        return self._lazy.cut_short()

    def _forget_cut_step(self) -> None:
        """Forget a step cut short, as the peers forgot theirs: synchronize() raises, and resets."""
        try:
            self.synchronize()
        except GflowError:
            return
        raise AssertionError("DataParallel: a step cut short was reduced")  # (cut_short said it cannot be)

    def _check_not_rebound(self, key, buffer) -> None:
        """push(key) takes the array gradient_buffers() made; a trainer that put another array in its
        place (grads[key] = g, not grads[key][...] = g) would have the buffer's old values reduced."""
        handed = self._handed
        if (handed.get(key, buffer) if self._named else handed[key]) is not buffer:
            raise ValueError(
                f"DataParallel.push({key!r}): the gradient_buffers() entry for {key!r} is another array "
                f"now, so its buffer still holds an older gradient; write into it (grads[{key!r}][...] = g), "
                f"push({key!r}, g), or take gradient_buffers() again"
            )

    def _check_grad(self, slot: int, key, grad) -> None:
        name = f"DataParallel.push({key!r}): grad"
        dtype = check_array(grad, name)[1]
        shape, want = _shape_of(grad), self._slot_shapes[slot]
        if shape != want or dtype != self._slot_dtypes[slot]:
            raise (TypeError if dtype != self._slot_dtypes[slot] else ValueError)(
                f"{name}: expected the parameter's shape {want} and dtype {self._slot_dtypes[slot]}, "
                f"got {shape} {dtype}"
            )
        check_writable(grad, name)
        if isinstance(grad, np.ndarray) and not grad.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous (the reduced gradient is written back into it)")

    def _drain(self) -> None:
        """Push, in slot order, every gradient ready whose predecessors have all gone."""
        ready, n = self._ready, len(self._ready)
        while self._next < n and ready[self._next] is not None:
            grad = ready[self._next]
            self._next += 1
            if self._error is not None or grad is _ABSENT:
                continue  # (the step failed here; LazyAllreduce ignores its pushes anyway)
            name = self._slot_names[self._next - 1]
            if name is None and self._absent:  # unnamed: ranks with other absent slots of one shape
                name = f"#{self._next - 1}"  # would pair one parameter with another; the name tells
            if self._scaler is not None and self._lazy.keeps_state:
                # A sparse residual (or a hook's state) carries gradients from step to step: it must
                # hold them unscaled, or a change of scale would mix units. They are unscaled on their
                # way into the fusion buffer, so a failed step leaves the pushed array as it was (a
                # retry neither loses nor doubles it). Non-finite values still fail the step on every
                # rank (NonFiniteError, from CSC or the hook's check), which synchronize() counts as an
                # overflow.
                self._lazy.push(grad, scale=1.0 / self._scaler.scale, name=name)
            else:
                self._lazy.push(grad, name=name)

    def _fail(self, error: Exception) -> None:
        """This rank's step failed before its reduction: synchronize() raises `error` here. It fails
        LazyAllreduce's step too, so the peers' synchronize() raises MismatchError (with this error's
        first line) instead of waiting for this rank, and the next step starts in step everywhere."""
        if self._error is None:
            self._error = error
            self._lazy.fail_step(error)

    def synchronize(self, *, commit: bool = True, agree=None) -> bool:
        """End the step: push what is missing (zeros for parameters no gradient reached), reduce,
        and with a loss scaler unscale and agree on overflow.

        commit=False (for a caller with checks of its own after the reduction, as gflow.torch's
        optimizer has): with sparse=, the new residuals wait for commit_step(), or discard_step()
        to forget the step. agree: such a caller's int64 vector, reduced with max in the step's
        final exchange (LazyAllreduce.flush); the result is self.agreed afterwards, None where it
        did not ride there (the caller then agrees on its own, alike on every rank).

        Returns:
            True when the step should be applied (always without a loss scaler); False when some
            rank's gradients overflowed: every rank then skips it, and the scale is lowered.

        Raises:
            TypeError, ValueError: one of this rank's pushes in this step failed its checks (the
                others raise MismatchError).
            GflowError: the collective failed: ranks disagree, or without a loss scaler a non-finite
                value with sparse= or compression (NonFiniteError, CompressionOverflowError; plain
                float32/float64 pass inf and NaN through, as MPI's allreduce). On any error the step
                is forgotten: the next one starts afresh, and the pushed arrays keep their local
                values (LazyAllreduce's guarantee; dense fp16 overflow without a scaler leaves the
                reduced values, as there).

        Call it once per step on every rank: a synchronize() more on some ranks pairs with the
        others' next step, which nothing can tell from a rank whose batch reached no parameter
        (neither DDP nor Horovod does either).
        """
        ready = self._ready
        overflow = False
        if self._error is None:
            try:
                for slot in range(self._next, len(ready)):
                    if ready[slot] is None:
                        ready[slot] = self._zero_gradient(slot)
                self._drain()
            except Exception as exc:  # noqa: BLE001 - raised below, after the peers were told
                self._fail(exc)
        error = self._error
        self.agreed = None
        vector, refuse = agree, None
        mine = None if agree is None else np.asarray(agree).reshape(-1)
        if self._scaler is not None and (mine is None or not mine.size or np.can_cast(mine.dtype, np.int64)):
            # The scales and the scaler's settings, compared in the final exchange before any write
            # (where the vector rides there: else LossScaler.update compares them, after the write).
            # A vector of another dtype goes as it is, for flush() to refuse naming it.
            words = np.array(self._scaler.words(), np.int64)
            vector = words if mine is None else np.concatenate([mine.astype(np.int64), words])
            refuse = lambda agreed: self._scaler.check_same(agreed[-4:], "DataParallel.synchronize")  # noqa: E731
        try:
            try:
                agreed = self._lazy.flush(commit=False, agree=vector, refuse=refuse)
                if agree is not None and agreed is not None:
                    self.agreed = agreed[: mine.size]
            except NonFiniteError:
                if self._scaler is None or error is not None:
                    raise
                overflow = True
            if self._scaler is not None:
                if not self._lazy.keeps_state and not overflow:
                    for grad in ready:
                        if grad is not _ABSENT:
                            overflow |= self._scaler.unscale(grad)
                apply = self._scaler.update(overflow)
            else:
                apply = True
        except Exception as exc:
            self._lazy.discard_step()  # (a scale the ranks disagree on: the residuals stay as they were)
            if error is None and isinstance(exc, NonFiniteError):
                self._last = ready  # the step ran on every rank; gradients() shows what it left
            self._reset_step()
            if error is not None:
                raise error from exc
            raise
        self._last = ready
        self._reset_step()
        if commit:
            self.commit_step()
        return apply

    @property
    def synchronize_interrupted(self) -> bool:
        """The last synchronize() was interrupted while it waited (Ctrl-C): its step's reduction went
        on, and the other ranks have its results; the next synchronize() finishes it here, and no
        gradient can be pushed until then."""
        return self._lazy.flush_interrupted

    def join(self) -> int:
        """This rank has run out of data (uneven inputs: Horovod's join, DDP's Join): until every rank
        has called join(), take part with zeros in the other ranks' steps, so their synchronize()
        goes on; a joined rank counts as zeros and a mean still divides by every rank, as Horovod
        divides. Returns the rank that joined last (the one with the most data: broadcast the
        parameters from it if the ranks' steps differed); a loss scaler takes that rank's scale on
        every rank (one that joined early missed the others' updates, and the scales would differ).
        Call it between steps, on every rank once; not with sparse= (CSC's exchanges are not
        allreduces: the other ranks' steps would fail)."""
        if self.sparse is not None:  # (refused here, not in the others' next step: see join.py)
            raise ValueError(
                "DataParallel.join: not with sparse= (CSC's exchanges are not allreduces, which is all a "
                "joined rank takes part in): run the last steps dense, or give every rank the same batches"
            )
        if self._in_step():
            raise RuntimeError(
                "DataParallel.join: a step is in flight (pushed, not synchronized): join between steps"
            )
        last = join(self._comm)
        if self._scaler is not None:
            self._scaler.follow(last)
        return last

    def commit_step(self) -> None:
        """Commit the step of the last synchronize(commit=False) (sparse residuals, step_count)."""
        self._lazy.commit_step()
        self.step_count += 1

    def discard_step(self) -> None:
        """Forget the step of the last synchronize(commit=False): sparse residuals as before it."""
        self._lazy.discard_step()

    def set_momentum(self, momentum: float) -> None:
        """With sparse=: change CSC's momentum correction factor between steps, on every rank alike
        (a momentum schedule). See LazyAllreduce.set_momentum."""
        self._lazy.set_momentum(momentum)

    @property
    def sparse(self) -> dict | None:
        """The SparseAllreduce settings in use (with a momentum schedule: the current momentum), or None."""
        return self._lazy.sparse

    def snapshot(self):
        """What load_state_dict() changes beyond state_dict() (the tuner's position, the sparse
        segments' objects), for a caller that must undo a load: see restore()."""
        return self._lazy.snapshot()

    def restore(self, snapshot) -> None:
        """Undo a load: back to what snapshot() gave (after load_state_dict of the state before)."""
        self._lazy.restore(snapshot)

    def tuning_position(self):
        """See LazyAllreduce.tuning_position (threshold_bytes="auto")."""
        return self._lazy.tuning_position()

    def adopt_tuning(self, tuning) -> None:
        """See LazyAllreduce.adopt_tuning: every rank, between steps."""
        self._lazy.adopt_tuning(tuning)

    def register_hook(self, state, hook) -> None:
        """Reduce each fused segment of gradients with `hook(state, segment)`: your own compression
        (DDP's register_comm_hook). See LazyAllreduce.register_hook and gflow/fusion/strategies.py."""
        if self._in_step():
            raise RuntimeError("DataParallel.register_hook: a step is in flight (pushed, not synchronized)")
        self._lazy.register_hook(state, hook)

    def _zero_gradient(self, slot: int):
        if self._buffers is not None:
            grad = self._buffers[slot]
        else:
            grad = self._zeros.get(slot)
            if grad is None:
                grad = self._zeros[slot] = _zeros_like(self._slot_params[slot])
        _fill_zero(grad)  # the last step's reduced values may be in it
        return grad

    def _in_step(self) -> bool:
        return self._error is not None or any(g is not None and g is not _ABSENT for g in self._ready)

    def set_absent(self, keys) -> None:
        """Take these parameters out of the fusion from the next step (and put back those absent now
        and not in keys): they are neither pushed nor reduced as zeros, and gradients() gives None for
        them. For gradients that travel another way: gflow.torch's optimizer gathers sparse ones on
        their own. Every rank must give the same keys (other segments fail the step with
        MismatchError everywhere). Between steps; not saved in state_dict() (a caller's choice). Not
        with sparse=: CSC keeps each fused segment's residual by its place in the step, and a parameter
        taken out moves the others into segments whose residuals are another parameter's (a frozen
        parameter needs nothing: its gradient counts as zeros, and its residual waits)."""
        if self._in_step():
            raise RuntimeError("DataParallel.set_absent: a step is in flight (pushed, not synchronized)")
        slots = []
        for key in keys:
            slot = self._slot_of.get(key)
            if slot is None:
                raise KeyError(f"DataParallel.set_absent: no parameter {key!r}; the parameters: {self._keys}")
            slots.append(slot)
        if self.sparse is not None and frozenset(slots) != self._absent:
            raise ValueError(
                "DataParallel.set_absent: not with sparse= (CSC keeps each fused segment's residual by its "
                "place in the step: taking parameters out would hand one parameter's residual to another); "
                "a parameter left unpushed counts as zeros"
            )
        self._absent = frozenset(slots)
        self._reset_step()

    def state_dict(self) -> dict:
        """This rank's state for a checkpoint: the settings, the parameters' names, shapes and dtypes,
        step_count, the world size, and LazyAllreduce's and the LossScaler's states (plain dicts of
        Python values and NumPy arrays). With sparse, residuals are per rank: each rank saves its own.

        Raises:
            RuntimeError: a step is in flight (pushed, not synchronized).
        """
        if self._in_step():
            raise RuntimeError("DataParallel.state_dict: a step is in flight (pushed, not synchronized)")
        state = st.header("DataParallel")
        state.update(
            names=list(self._keys),
            shapes=[tuple(s) for s in self._slot_shapes[::-1]],
            dtypes=[d.name for d in self._slot_dtypes[::-1]],
            step_count=self.step_count,
            world_size=st.world(self._comm)[1],
            lazy=self._lazy.state_dict(),
            loss_scaler=None if self._scaler is None else self._scaler.state_dict(),
        )
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict() (this rank's own, with sparse communication). A dense one loads at
        another world size too (LazyAllreduce.load_state_dict): it holds nothing per rank.

        Raises:
            ValueError: the state was saved for other parameters, with other settings, with sparse= at
                another world size or on another rank, or with(out) a loss scaler where this object
                has none (one); the message names what differs. Nothing is changed then.
            RuntimeError: a step is in flight (pushed, not synchronized).
        """
        who = "DataParallel.load_state_dict"
        if self._in_step():
            raise RuntimeError(f"{who}: a step is in flight (pushed, not synchronized); load between steps")
        st.check_header(state, "DataParallel", who)
        if self.sparse is not None:  # (CSC's residuals are per rank; a dense state holds nothing per rank)
            st.check_world_size(state, st.world(self._comm)[1], who)
        else:
            st.saved_world_size(state, who)
        mine = {
            "names": list(self._keys),
            "shapes": [tuple(s) for s in self._slot_shapes[::-1]],
            "dtypes": [d.name for d in self._slot_dtypes[::-1]],
        }
        for field, expected in mine.items():
            got = st.get(state, field, who)
            got = [tuple(int(s) for s in g) for g in got] if field == "shapes" else [_scalar(g) for g in got]
            if len(got) != len(expected):
                raise ValueError(
                    f"{who}: the number of parameters differs: expected {len(expected)} (this object), "
                    f"got {len(got)} (the state dict)"
                )
            for i, (a, b) in enumerate(zip(expected, got, strict=True)):
                if a != b:
                    raise ValueError(
                        f"{who}: parameter {self._keys[i]!r}: {field[:-1]} differs: expected {a!r} "
                        f"(this object), got {b!r} (the state dict)"
                    )
        step_count = st.get_count(state, "step_count", who)
        scaler_state = st.get(state, "loss_scaler", who)
        if (scaler_state is None) != (self._scaler is None):
            raise ValueError(
                f"{who}: loss scaler differs: this object has "
                f"{'none' if self._scaler is None else 'one'}, the state dict "
                f"{'has none' if scaler_state is None else 'has one'}"
            )
        lazy_state = st.get(state, "lazy", who)
        before = self._lazy.snapshot()
        with warnings.catch_warnings(record=True) as held:  # (said once the whole load succeeded)
            warnings.simplefilter("always")
            self._lazy.load_state_dict(lazy_state)
            if self._scaler is not None:
                try:
                    self._scaler.load_state_dict(scaler_state)
                except Exception:
                    self._lazy.restore(before)
                    raise
        self.step_count = step_count
        for warning in held:
            warnings.warn(warning.message, warning.category, stacklevel=2)


def _scalar(value):
    return value.item() if isinstance(value, np.generic) else value
