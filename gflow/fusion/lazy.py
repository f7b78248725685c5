"""Lazy allreduce: fuse many small allreduces into a few large ones, fired in the background.

GradientFlow's lazy allreduce (Horovod's tensor fusion, DDP's gradient buckets): backward produces
gradients one layer at a time, and one allreduce per tensor pays one latency per tensor. push() copies
(or casts to float16) each gradient into a contiguous segment buffer; as soon as the pending bytes
reach the threshold the segment's allreduce starts on gflow's background thread while backward goes
on; flush() starts the rest, waits, and writes the results back into the pushed arrays.

Every rank must push the same shapes and dtypes in the same order. Each segment's agreement carries a
running checksum of everything pushed so far in the step (each array's size, dtype and shape), and
flush() ends the step with a header-only exchange of the segment count and the final checksum. A
different order, shape (another of the same size too, as allreduce's shape check), size or number of
tensors on any rank therefore fails a segment (or that final exchange) on every rank with a
GflowError; the background channel then fails whatever else each rank had queued, so no rank waits
for calls its peers will never make. A push whose own arguments are bad is reported by flush(): the
step does nothing more on that rank, its rejection is queued behind the segments already fired, and
every rank's flush() fails (that rank's with its TypeError/ValueError), so every rank's program stays
on the same path (push ... flush) and the next step works.

A step is all or nothing: results are written into the pushed arrays (pool views included) only after
every segment and the final exchange succeeded on every rank, and sparse segments commit their new
residuals only then. After an error every rank's pushed arrays keep their local values and every
residual is as before the step: nothing is lost or counted twice, and the step can be retried.

This file is long: it is the step's state machine (push, fire, flush and their failure rules, read
together). Checkpoints are in lazy_state.py, the pool in pool.py, how a segment is reduced in
strategies.py, threshold tuning in autotune.py.
"""

import contextlib
import functools
import struct
import sys
import time
import zlib

import numpy as np

from ..arrays.codecs import check_compression, overflow_message
from ..arrays.kinds import check_array, check_writable
from ..arrays.numpy_arrays import HOST
from ..collectives.join import tell_after_join
from ..collectives.operations import allreduce_on, annotated, rejected_in_background
from ..collectives.recursive_doubling import allreduce_with_agreement
from ..errors import CompressionOverflowError, MismatchError
from ..runtime import engine, timeline
from ..runtime.config import DEFAULT_SMALL_MESSAGE_BYTES, config
from ..runtime.context import context
from ..runtime.signature import Words, check_op, dtype_code, holds, pushes_in_words, signature
from .autotune import ThresholdTuner
from .lazy_state import LazyCheckpoint
from .pool import GradientPool, PooledGradients, shape_bytes
from .sparse import SparseAllreduce
from .strategies import Codec, Dense, Hook, Segment, Sparse

# What the push-order checksum covers, per tensor: size, dtype and number of axes, then the shape.
_SIZE_AND_TYPE = struct.Struct("<qqq")
# Measured with bench/fusion.py (bench/RESULTS.md): larger segments stop paying on this machine.
DEFAULT_THRESHOLD_BYTES = 4 * 2**20
# flush(agree=...): a caller's vector rides in the final exchange up to this size (the default
# latency path's; a constant, not the setting, so that every rank decides alike), else it is None.
AGREE_IN_FINAL_BYTES = DEFAULT_SMALL_MESSAGE_BYTES


class LazyAllreduce(LazyCheckpoint, PooledGradients):
    """Fused, overlapped allreduce of a stream of tensors (see the module docstring).

    Args:
        threshold_bytes: fire a segment once this many bytes are pending (bytes on the wire: float16
            ones with compression="fp16", unless sparse). "auto": try thresholds from 256 KiB to
            64 MiB during the first steps (three steps each, then four more for the three
            fastest: about 40 steps), timing each step, and keep the fastest: the same on every
            rank, logged once by rank 0 (fusion/autotune.py). Steps are correct while it tunes.
            Dense only: sparse segments keep residuals, so their sizes must not change.
        op: "sum", "mean", "max" or "min" (or MPI.SUM/MAX/MIN), applied to every pushed tensor.
        compression: None, "fp16" or "bf16" (float32/float64 gradients travel as float16 or
            bfloat16; see gflow/arrays/codecs.py).
        comm: the communicator (default COMM_WORLD).
        sparse: None, or SparseAllreduce settings (density, chunk_elems, momentum, warmup_steps) to
            send each fused segment by coarse-grained sparse communication: fusion + fp16 + CSC +
            overlap together. Each segment keeps its own residual from step to step, and the
            pushed arrays receive the sparse update (zeros where nothing was sent).
        first_segment_bytes: a step's first segment fires at this many bytes instead (when fewer
            than threshold_bytes), so the wire is busy while backward computes the rest: DDP's
            first bucket (1 MiB in DataParallel and gflow.torch). None: threshold_bytes.

    Attributes:
        threshold_bytes: the threshold in use (with "auto": the candidate being tried, then the one
            settled on).
        tuning: with "auto", whether the threshold is still being tuned.
        tuning_results: with "auto": {candidate: its median seconds per step, averaged over the
            ranks}, as agreed after each round (None before the first, when it settled without
            comparing, or from a checkpoint that holds only the settled threshold).
    """

    def __init__(
        self,
        threshold_bytes: int | str = DEFAULT_THRESHOLD_BYTES,
        op="mean",
        compression=None,
        comm=None,
        sparse=None,
        first_segment_bytes: int | None = None,
    ):
        self._tuner = None
        if isinstance(threshold_bytes, str):
            if threshold_bytes != "auto":
                raise ValueError(f"threshold_bytes: expected an int or 'auto', got {threshold_bytes!r}")
            if sparse is not None:
                raise ValueError(
                    "threshold_bytes='auto' is for dense fusion: with sparse=..., each segment keeps its "
                    "own residual from step to step, so the segments must not change; give an int"
                )
            self._tuner = ThresholdTuner()
            threshold_bytes = self._tuner.threshold
        if isinstance(threshold_bytes, bool) or not isinstance(threshold_bytes, (int, np.integer)):
            raise TypeError(
                f"threshold_bytes: expected an int or 'auto', got {type(threshold_bytes).__name__}"
            )
        if threshold_bytes < 1:
            raise ValueError(f"threshold_bytes must be >= 1, got {threshold_bytes}")
        if first_segment_bytes is not None and (
            isinstance(first_segment_bytes, bool)
            or not isinstance(first_segment_bytes, (int, np.integer))
            or first_segment_bytes < 1
        ):
            raise ValueError(
                f"first_segment_bytes: expected None or an int >= 1, got {first_segment_bytes!r:.40}"
            )
        op = check_op(op, np.dtype(np.float32))
        if compression is not None:
            compression = check_compression(compression, np.dtype(np.float32))
        if sparse is not None:
            if not isinstance(sparse, dict):
                raise TypeError(
                    f"sparse must be a dict of SparseAllreduce settings, got {type(sparse).__name__}"
                )
            SparseAllreduce(op=op, compression=compression, comm=comm, **sparse)  # checks the settings
        self.sparse = sparse
        self.threshold_bytes = int(threshold_bytes)
        self.first_segment_bytes = None if first_segment_bytes is None else int(first_segment_bytes)
        self._checked_dtype = None
        self.op, self.compression, self._comm = op, compression, comm
        self._strategy = self._built_in_strategy()  # how each segment is reduced (strategies.py)
        # per segment, the buffer its result lands in and its memory, reused step after step
        self._buffers: list = []
        self._pool = GradientPool()  # what gradient_buffers() handed out
        self._solo = None  # whether the communicator has one rank (found at the first push)
        self._uncommitted: list = []  # sparse segments of a flush(commit=False), awaiting commit_step()
        self._unfinished = None  # the rest of a flush() interrupted while it waited (Ctrl-C): _collect
        self._follow = None  # after a join(): the rank whose tuning position to take (joined)
        if self._tuner is not None:
            tell_after_join(self, comm)
        self._cuts_before = None  # (a step has not begun: _reset)
        self._reset()

    def _reset(self) -> None:
        if self._cuts_before is not None:  # the step ends: it leaves CommContext.in_a_step's kits
            with contextlib.suppress(Exception):  # (no context: its communicator was freed since)
                context(self._comm).kits.discard(self)
        self._members: list = []  # (flat view, kind, the array pushed) waiting for the next segment
        self._member_arrays: list = []  # the arrays pushed, for telling pool views apart
        self._member_scales: list = []  # what each pushed array is multiplied by on its way in
        self._pending_bytes = 0
        self._fired: list = []  # (handle, members to write the result into, SparseAllreduce or None)
        self._checksum = 0
        self._pushes = 0  # arrays pushed in this step (alone, they need no segment)
        self._pushed: list = []  # (name, shape, dtype) of each, for a MismatchError's words
        self._error = None  # the error of a push that failed its checks: flush() raises it
        self._filling_since = None  # with a timeline on: when the pending segment's first push came
        self._step_started = 0.0  # when the step's first push came (for threshold tuning)
        self._step_bytes = 0  # what the step's pushes put on the wire (for threshold tuning)
        self._cuts_before = None  # the communicator's steps_cut when the step began (mark_begun)
        self._channel = None  # the background channel's generation when it began (mark_begun)

    def fail_step(self, error: Exception) -> None:
        """This rank's step failed its local checks (or a caller's: DataParallel's): it does nothing
        more until flush() raises `error`, whose first line the peers' MismatchError shows. The
        rejection is queued behind the segments already fired, where it meets the peers' next segment
        or final exchange, so their flush() fails too."""
        self._check_cut()  # (a step cut short sends no rejection either: the peers' step is over)
        if self._error is None:
            self._stop_step(error)
            rejection = rejected_in_background(context(self._comm), "lazy", error, kind=engine.STEP_REJECTION)
            self._fired.append((rejection, [], None))

    def _stop_step(self, error: Exception) -> None:
        """flush() raises `error`; the pushes not yet in a segment are dropped (fail_step, _check_cut)."""
        self._error = error
        self._members, self._member_arrays, self._member_scales = [], [], []
        self._pending_bytes = 0
        self._filling_since = None

    def push(self, grad, *, scale: float = 1.0, name: str | None = None) -> None:
        """Queue grad for reduction; the result is written into it by flush(). Do not modify grad
        until then.

        `name`, when given, joins the push-order checksum beside the shape: ranks that push two
        tensors of one shape in another order, under their names, fail the step on every rank
        (MismatchError) instead of swapping their values.

        `scale` multiplies grad's values on their way into the fusion buffer (grad itself is not
        changed, so a failed step leaves it as pushed): how a loss-scaled gradient is unscaled
        before it enters a sparse residual, at no extra pass.

        A grad that is not a writable, C-contiguous array of a dtype this op takes fails the step:
        flush() raises its TypeError/ValueError here and MismatchError on the other ranks.
        """
        if self._error is not None:
            return  # this step already failed here
        if self._unfinished is not None:  # (a new step's pushes would meet the peers' next step)
            raise RuntimeError(
                "LazyAllreduce.push: the last flush() was interrupted while it waited for its step's "
                "results, which the other ranks have; call flush() again to finish that step, then push"
            )
        if not self._pushes:
            if self._uncommitted:  # (a caller's bug: DataParallel always decides)
                raise RuntimeError(
                    "LazyAllreduce.push: the last flush(commit=False) was not committed or discarded"
                )
            self._begin_step()
        if not isinstance(scale, float):  # checked first: a bad scale must not leave half a push
            if isinstance(scale, bool) or not isinstance(scale, (int, np.integer, np.floating)):
                self.fail_step(TypeError(f"scale must be a number, got {type(scale).__name__}"))
                return
            scale = float(scale)
        flags = getattr(grad, "flags", None)
        if (
            type(grad) is np.ndarray
            and grad.dtype is self._checked_dtype
            and flags.writeable
            and flags.c_contiguous
        ):
            kind, dtype = HOST, grad.dtype  # checked for the previous push: the common case, kept cheap
            flat, shape = grad.reshape(-1), grad.shape
        else:
            try:
                kind, dtype = check_array(grad, "grad")
                check_op(self.op, dtype)
                if self.compression:
                    check_compression(self.compression, dtype)
                check_writable(grad, "grad", kind)
                flat = kind.inout_view(grad, "grad")  # results are written back into it
                shape = tuple(kind.shape(grad))
            except Exception as exc:
                self.fail_step(exc)
                return
            self._checked_dtype = dtype if kind is HOST else None
        pushed = _SIZE_AND_TYPE.pack(flat.size, dtype_code(dtype), len(shape)) + shape_bytes(shape)
        if name is not None:
            pushed += str(name).encode()
        self._pushes += 1
        if timeline.active() and self._filling_since is None:
            self._filling_since = time.time_ns()  # the segment's first push (see _fire)
        if self._alone() and scale == 1.0 and type(self._strategy) is Dense:
            # One rank: every op's result is the gradient itself, already where flush() would write it.
            # Skipping the fusion buffer saves two passes over the gradients (as DDP does alone).
            self._checksum = zlib.crc32(pushed, self._checksum)
            return
        if self._members and (
            flat.dtype != self._members[0][0].dtype or kind.ops is not self._members[0][1].ops
        ):
            self._fire()  # a segment holds one dtype and one memory
        self._pushed.append((name, shape, dtype))
        self._members.append((flat, kind, grad))
        self._member_arrays.append(grad)
        self._member_scales.append(scale)
        on_wire = self._strategy.wire_dtype(dtype).itemsize
        self._pending_bytes += flat.size * on_wire
        self._step_bytes += flat.size * on_wire
        self._checksum = zlib.crc32(pushed, self._checksum)
        if self._pending_bytes >= self.threshold_bytes or (
            not self._fired and self._pending_bytes >= (self.first_segment_bytes or self.threshold_bytes)
        ):
            self._fire()

    def _begin_step(self) -> None:
        """The step's first push: its checksum starts from the threshold (ranks that fuse differently
        must disagree at the first segment), and tuning times the step from here."""
        if self._follow is not None and self._tuner is not None:
            self._follow_join()
        where = (self.threshold_bytes, self.first_segment_bytes or 0, self._tuner is not None,
                 isinstance(self._strategy, Hook))  # fmt: skip
        if self._tuner is not None:
            where += self._tuner.position()  # ranks elsewhere in the schedule would part ways later
            self._step_started = time.perf_counter()
        self.mark_begun()
        self._checksum = zlib.crc32(struct.pack(f"<{len(where)}q", *(min(int(v), 2**63 - 1) for v in where)))

    def _alone(self) -> bool:
        if self._solo is None:
            try:
                self._solo = context(self._comm).size == 1
            except Exception:  # noqa: BLE001 - a bad comm: the full path reports it where it always did
                return False
        return self._solo

    def mark_begun(self) -> None:
        """The step has begun, if it had not (its first push, here or in a caller that holds pushes
        back: DataParallel's): an end of its communicator from now on cuts it short (cut_short)."""
        if self._cuts_before is None:
            try:
                ctx = context(self._comm)
            except Exception:  # noqa: BLE001 - a bad comm: the full path reports it where it always did
                return
            self._cuts_before, self._channel = ctx.steps_cut, ctx.channel_generation()
            ctx.kits.add(self)  # (CommContext.in_a_step; until _reset)

    def cut_short(self) -> str | None:
        """Why this step was cut short on this rank, or None: after its first push, crossed waits (a
        metric reduced on one rank alone while the others waited in their step) or a step that met
        another kind of call ended the communicator (stall.cut_steps). Nothing more of a step cut
        short is sent; flush() raises MismatchError, forgetting it (DataParallel and gflow.torch's
        optimizer do so where the program begins its next step, whose pushes are refused)."""
        if self._cuts_before is None:
            return None
        ctx = context(self._comm)
        return ctx.cut_why if ctx.steps_cut != self._cuts_before else None

    def _check_cut(self) -> None:
        """Fail this step on this rank alone where it was cut short (the peers failed theirs), or
        where its background channel was replaced after the step began: a failure there (a bad
        push's rejection on another rank met an async call the program made inside the step, and
        waited on) ended the peers' step, and the rest, sent on the fresh channel, would meet their
        next step, batch k against batch k + 1 silently (helper-78)."""
        if self._error is not None or self._cuts_before is None:
            return
        why = self.cut_short() or context(self._comm).channel_replaced(self._channel)
        if why is not None:  # (no rejection sent: the peers' step is over)
            self._stop_step(MismatchError(
                f"this step was cut short after its first push, and nothing more of it is sent (the pushed "
                f"arrays keep their local values): {why}"
            ))  # fmt: skip

    def _fire(self) -> None:
        self._check_cut()
        if self._error is not None:
            return
        members, self._members, self._pending_bytes = self._members, [], 0
        pushed, self._member_arrays = self._member_arrays, []
        scales, self._member_scales = self._member_scales, []
        if not members:
            return
        kind = members[0][1]
        ops = kind.ops
        strategy = self._strategy
        dtype = strategy.wire_dtype(members[0][0].dtype)
        total = sum(m.size for m, _, _ in members)
        index = len(self._fired)
        ctx = context(self._comm).for_async(f"gradient step segment {index}")
        name = check_op(self.op, holds(members[0][0].dtype))
        try:
            strategy.check_size(index, total, members)
            buffer, memory = self._buffers[index] if index < len(self._buffers) else (None, None)
            # (a step pushes the kind of array the last one did, or the segment's buffer moves with it:
            # a host buffer kept for device pushes would send device gradients as host ones)
            if memory != ops.memory or buffer.size != total or buffer.dtype != ops.storage(dtype):
                buffer = ops.empty(total, dtype)
                self._buffers[index : index + 1] = [(buffer, ops.memory)]
            in_pool = None
            if strategy.uses_pool and all(scale == 1.0 for scale in scales):
                in_pool = self._pool.run(pushed)
            if in_pool is not None:
                # The gradients already sit in the pool: reduce from there into `buffer` and write
                # the result back at flush(), so that a failed step leaves them as they are; or,
                # when asked, straight into the pool.
                source = in_pool
                members = [] if self._pool.reduce_in_place else [(source, kind, None)]
                if self._pool.reduce_in_place:
                    buffer = source
            else:
                source, offset = buffer, 0
                for (flat, _, _), scale in zip(members, scales, strict=True):
                    strategy.fill(ops, buffer[offset : offset + flat.size], flat, name, ctx.size, scale)
                    offset += flat.size
                ops.fence()
            shapes = [tuple(kind.shape(a)) for a in pushed] if isinstance(strategy, Hook) else None
            segment = Segment(
                index, source, name, shapes, context=ctx, out=buffer, checksum=self._checksum, dtype=dtype,
                about=Words(pushes_in_words, self._pushed, len(self._pushed)),
            )  # fmt: skip
            handle, to_commit = strategy.start(segment, kind)
        except Exception as exc:  # noqa: BLE001 - this rank's step fails; the peers' fail with it
            self.fail_step(exc)
            return
        if self._filling_since is not None:  # one span per segment: from its first push to its fire
            timeline.complete("segment filling", self._filling_since, segment=index, tensors=len(pushed),
                              bytes=total * dtype.itemsize)  # fmt: skip
            self._filling_since = None
        self._fired.append((handle, members, to_commit))

    def _built_in_strategy(self):
        if self.sparse is not None:
            return Sparse(self.op, self.compression, self._comm, self.sparse)
        return Codec(self.compression) if self.compression else Dense()

    @property
    def _csc(self) -> dict:
        """Segment index -> its SparseAllreduce, each keeping its residual (empty unless sparse)."""
        return getattr(self._strategy, "segments", {})

    def register_hook(self, state, hook) -> None:
        """Reduce each fused segment with `hook(state, segment)` instead of gflow's allreduce: your own
        compression, in the shape of DDP's communication hooks (gflow/fusion/strategies.py says what
        a hook gets and returns; examples/topk_hook.py is one). hook=None goes back to gflow's own.
        Every rank registers the same hook, between the same two steps (ranks that differ fail the
        step on every rank).

        Raises:
            TypeError: hook is not callable. ValueError: with compression= or sparse= (the
                built-in strategies a hook replaces), or threshold_bytes="auto". RuntimeError: a step
                is in flight.
        """
        if hook is not None and not callable(hook):
            raise TypeError(
                f"register_hook: hook must be callable (state, segment), got {type(hook).__name__}"
            )
        if self.sparse is not None or self.compression:
            raise ValueError(
                "register_hook: a hook replaces gflow's own reduction of the segments; make the object "
                "without compression= and sparse= (it then does its own)"
            )
        if self._tuner is not None and hook is not None:
            raise ValueError(
                "register_hook: with threshold_bytes='auto' the segments change while the threshold is "
                "tuned, and a hook's state follows them by index; give a threshold in bytes"
            )
        if self._in_step():
            raise RuntimeError(
                "register_hook: a step is in flight (pushed, not flushed); register between steps"
            )
        self._strategy = Dense() if hook is None else Hook(state, hook)

    @property
    def keeps_state(self) -> bool:
        """Whether segments carry gradients from step to step (sparse=, or a hook): a caller under loss
        scaling then pushes them unscaled (push(scale=...)), as DataParallel does."""
        return self._strategy.keeps_state

    def set_momentum(self, momentum: float) -> None:
        """With sparse=: change CSC's momentum correction factor, in every segment, between steps
        (a momentum schedule). Every rank changes it alike: the ranks agree on it in each segment.

        Raises:
            ValueError: not sparse, or momentum not in [0, 1). RuntimeError: a step is in flight.
        """
        if self.sparse is None:
            raise ValueError("LazyAllreduce.set_momentum: momentum is CSC's; this object is dense")
        if self._in_step():
            raise RuntimeError("LazyAllreduce.set_momentum: a step is in flight (pushed, not flushed)")
        SparseAllreduce(momentum=momentum)  # checks it before anything changes
        for csc in self._csc.values():
            csc.set_momentum(momentum)
        self.sparse = self._strategy.settings = dict(self.sparse, momentum=float(momentum))

    def flush(self, *, commit: bool = True, agree=None, refuse=None):
        """Fire what is pending, wait for every segment, and write the results into the pushed arrays.

        commit=False keeps the sparse segments' new residuals aside until commit_step() (or
        discard_step(), which leaves them as before the step): for a caller with checks of its own
        after the reduction (DataParallel's loss-scale agreement), so a step they refuse is forgotten.

        agree: an int64 vector of the same length on every rank (a caller's per-step agreement:
        gflow.torch's optimizer), reduced with max in the step's final exchange instead of a
        collective of its own. Returns that maximum; None where it did not ride (agree None or over
        AGREE_IN_FINAL_BYTES), and flush() raised where the step failed: the caller then agrees on
        its own, alike on every rank. refuse: called with that maximum before anything is written
        (where it rode); what it raises is raised on every rank alike (the maximum is the same on
        all), with the pushed arrays and residuals as they were.

        Raises:
            TypeError, ValueError: one of this rank's pushes in this step failed its checks, or agree
                is not a vector of integers (the other ranks raise MismatchError). Nothing was
                written anywhere.
            GflowError (MismatchError): the ranks pushed different sizes, orders or numbers of tensors,
                or another rank's push failed; on every rank, and the pushed arrays keep their local
                values (sparse residuals too).
            NonFiniteError: with sparse, a gradient held inf or NaN on some rank (on every rank; a
                CompressionOverflowError with compression="fp16"); nothing was changed.
            CompressionOverflowError: with dense compression="fp16", a reduced value is inf or NaN (on
                every rank; the pushed arrays hold the reduced values, inf/NaN included).
        """
        with timeline.span("lazy flush"):
            if self._unfinished is not None:  # the last flush() was interrupted: finish it instead
                return self._unfinished()
            return self._flush(commit, agree, refuse)

    def commit_step(self) -> None:
        """Commit the sparse residuals of the last flush(commit=False)."""
        staged, self._uncommitted = self._uncommitted, []
        for csc in staged:
            csc.commit()

    def discard_step(self) -> None:
        """Forget the sparse residuals of the last flush(commit=False): each is as before that step."""
        staged, self._uncommitted = self._uncommitted, []
        for csc in staged:
            csc.discard()

    def _flush(self, commit: bool, agree, refuse):
        self._check_cut()
        ctx = context(self._comm).for_async("gradient step final exchange")
        if agree is not None and np.size(agree) and not np.can_cast(np.asarray(agree).dtype, np.int64):
            # (a float vector was cut to integers: a max of 0.9 came back 0)
            got = np.asarray(agree).dtype
            self.fail_step(TypeError(f"LazyAllreduce.flush: agree must be a vector of integers, got {got}"))
        if self._error is None:
            self._fire()
        src = step_agreed = None  # the caller's vector to agree on, and where its maximum lands
        if agree is not None and self._error is None:
            src = np.ascontiguousarray(agree, dtype=np.int64).reshape(-1)
            step_agreed = np.empty_like(src) if src.nbytes <= AGREE_IN_FINAL_BYTES else None
        if self._error is None and not (self._alone() and not self._fired):
            # the final exchange: one segment count and checksum per rank (none to agree with alone),
            # with the caller's vector as payload (its length in the checksum: lengths must agree)
            op, checksum = None, self._checksum
            if step_agreed is not None:
                op, checksum = "max", zlib.crc32(struct.pack("<q", src.size), checksum)
            count = len(self._fired)
            ends = signature("lazy", "recursive_doubling", count, np.dtype(np.int64), op, extra=checksum)
            capacity = max(config.small_message_bytes, 0 if step_agreed is None else src.nbytes)
            payload = (src, step_agreed, op) if step_agreed is not None else (None, None, None)
            # (bound now: allreduce_with_agreement checks that ctx is usable)
            final = functools.partial(allreduce_with_agreement, ctx, ends, capacity, *payload)
            final = functools.partial(
                annotated, final, Words(pushes_in_words, self._pushed, len(self._pushed))
            )
            self._fired.append(
                (engine.submit("gradient step final exchange", final, ctx=ctx, kind=engine.STEP), [], None)
            )
        elif step_agreed is not None:
            step_agreed[:] = src  # alone: the maximum over one rank
        tuner = self._tuner
        tuning = tuner is not None and tuner.active and self._pushes and self._error is None
        agreed = None  # the ranks' step times per candidate, summed (the step that settles the threshold)
        if tuning and tuner.deciding:
            agreed = self._agree_on_threshold(ctx)
        started, step_bytes = self._step_started, self._step_bytes
        fired, error = self._fired, self._error
        self._reset()
        step = (fired, error, commit, refuse, step_agreed, tuning, agreed, ctx, started, step_bytes)
        self._unfinished = functools.partial(self._collect, step)
        return self._unfinished()

    def _collect(self, step: tuple):
        """flush()'s second half: wait for the step's segments, then write their results. Its segments
        run on the background thread whatever happens here, so a wait interrupted by a signal (Ctrl-C:
        KeyboardInterrupt) leaves this for the next flush() to finish, with the peers' results; a retry
        that pushed the step again would meet their next step (helper-88). (A threshold being tuned
        takes the interrupted step's time as it is: every rank must count the step alike.)"""
        fired, error, commit, refuse, step_agreed, tuning, agreed, ctx, started, step_bytes = step
        tuner = self._tuner
        results = []
        for handle, _, _ in fired:
            try:
                results.append(handle.wait())
            except Exception as exc:  # noqa: BLE001 - raised below, once every segment has finished
                error = error or exc
        self._unfinished = None
        if error is not None:
            parent = context(self._comm)
            for handle, _, csc in fired:
                if csc is not None:
                    csc.discard()
                parent.reset_background(handle.context)
            raise error
        if refuse is not None and step_agreed is not None:
            try:
                refuse(step_agreed)
            except BaseException:
                for _, _, csc in fired:
                    if csc is not None:
                        csc.discard()
                raise
        overflow = False
        for (_, members, csc), result in zip(fired, results, strict=True):
            if csc is not None:
                self._uncommitted.append(csc)
            offset = 0
            for flat, kind, _ in members:
                overflow |= self._strategy.finish(kind.ops, flat, result[offset : offset + flat.size])
                offset += flat.size
            if members:
                members[0][1].ops.fence()
            for _, kind, pushed in members:
                if pushed is not None:
                    kind.written(pushed)
        if tuning:
            if agreed is not None:
                line = tuner.agreed(agreed, ctx.size)
            else:  # an overflowed step did not run as usual: it is not timed
                line = None if overflow else tuner.step_done(time.perf_counter() - started, step_bytes)
            self.threshold_bytes = tuner.threshold
            if line and ctx.rank == 0:
                print(f"gflow: LazyAllreduce(threshold_bytes='auto'): {line}", file=sys.stderr, flush=True)
        if commit:
            self.commit_step()
        if overflow:
            raise CompressionOverflowError(overflow_message("LazyAllreduce", self.compression))
        return step_agreed

    def _agree_on_threshold(self, ctx):
        """Queue, behind the step's segments, the allreduce of this rank's median step time per
        candidate of this tuning round; returns the array the sums land in (valid once the step's
        handles are done)."""
        medians = self._tuner.medians()
        summed = np.empty_like(medians)
        candidates = zlib.crc32(np.array([*self._tuner.trying, self._tuner.round], np.int64).tobytes())
        run = lambda: allreduce_on(  # noqa: E731
            ctx,
            medians,
            "sum",
            out=summed,
            tag=("lazy", candidates),
            about="LazyAllreduce's threshold tuning",
        )
        handle = engine.submit(
            "gradient step threshold agreement", run, keep=(medians, summed), ctx=ctx, kind=engine.STEP
        )
        self._fired.append((handle, [], None))
        return summed

    def retune(self) -> None:
        """Tune the threshold again, from the next step (threshold_bytes="auto"): after the model,
        the batch size or the network changed. Every rank calls it, between the same two steps (a
        rank that does not fails its next step, and every rank's flush raises MismatchError).

        Raises:
            ValueError: the threshold is fixed (not "auto"). RuntimeError: a step is in flight.
        """
        if self._tuner is None:
            raise ValueError(
                f"LazyAllreduce.retune: the threshold is fixed at {self.threshold_bytes} bytes; make the "
                "object with threshold_bytes='auto' to tune it"
            )
        if self._in_step():
            raise RuntimeError("LazyAllreduce.retune: a step is in flight (pushed, not flushed)")
        self._tuner = ThresholdTuner()
        self.threshold_bytes = self._tuner.threshold

    @property
    def tuning(self) -> bool:
        return self._tuner is not None and self._tuner.settled is None

    @property
    def tuning_results(self) -> dict | None:
        return None if self._tuner is None else self._tuner.results

    @property
    def flush_interrupted(self) -> bool:
        """The last flush() was interrupted while it waited (Ctrl-C): the next flush() finishes it, and
        no array can be pushed until then."""
        return self._unfinished is not None

    def _in_step(self) -> bool:
        return bool(
            self._pushes
            or self._members
            or self._fired
            or self._error is not None
            or self._uncommitted
            or self._unfinished is not None
        )
