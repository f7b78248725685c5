"""Coarse-grained sparse communication (CSC, GradientFlow): send only the gradient chunks that matter.

Each rank keeps a residual v of what it has not sent yet (with Deep Gradient Compression's momentum
correction: u = m*u + g; v = v + u). Every step the flat v is cut into chunks of chunk_elems; the
chunks' L1 norms are allreduced (small: one float32 per chunk), so every rank sees the same norms and
picks the same top-k chunks (k = ceil(density * chunks), ties to the lower index) without exchanging
index lists. Those chunks are packed and allreduced by the ordinary dense path (optionally fp16),
scattered into the returned update (zeros elsewhere), and cleared from v and u (momentum factor
masking). Nothing is lost: with momentum 0, the updates applied so far plus every rank's residual add
up to every gradient pushed (divided by the world size for "mean").

With compression="bf16" the packed chunks travel as bfloat16 (float32's range: no scaling needed),
what each rank's rounding did not send staying in its residual, as below.

With compression="fp16" the packed chunks travel as float16, scaled by a power of two chosen from the
allreduced norms (which every rank already holds, so no message is added): a chunk's norm bounds every
value and every partial sum in it, so the float16 payload cannot overflow, and small gradients are
scaled up into float16's range instead of vanishing. What each rank's float16 rounding did not send
stays in its residual; only the float16 rounding of the sums themselves is not kept anywhere. Norms
travel as float32, clipped for finite chunks too large for float32 sums and NaN for chunks holding
NaN or inf, so a huge gradient is still sent (a step whose norms are beyond any float32 scale, about
2**115, sends its chunks uncompressed: every rank sees the same norms, so every rank agrees) and a
non-finite one fails the step on every rank.

A step is atomic: the new residual is written beside the old one and becomes the state only when the
step has succeeded on every rank (commit()), so a step that raises (ranks disagree, a NaN or inf
somewhere) leaves every rank's residual, velocity and step count exactly as before it.

With warmup_steps = W the density starts at 1 (dense) and falls geometrically to the target:
density_t = density ** (t / W) for t < W.
"""

import math
import struct
import time
import zlib

import numpy as np

from ..arrays.codecs import check_compression, overflow_message, wire_dtype
from ..arrays.kinds import check_array, from_host, ops_for_memory, to_host
from ..collectives import recursive_doubling
from ..collectives.operations import allreduce_on, reject
from ..errors import CompressionOverflowError, MismatchError, NonFiniteError
from ..runtime import timeline
from ..runtime.context import CommContext, context
from ..runtime.signature import Words, check_op, dtype_code

# 1024 float32 per chunk: the norms then add 1/1024 (0.1%) of the dense bytes, so CSC at 1% sends
# about 1.1% of what a dense allreduce sends (bench/RESULTS.md).
DEFAULT_CHUNK_ELEMS = 1024
# The float16 payload is scaled so that every chunk's bound is at most this: half of float16's
# largest value (65504), leaving room for the rounding of the bound and of partial sums.
_WIRE_BOUND = 2.0**15
# The scale's range: it and its inverse stay normal float32 numbers (the ops take float32 scales).
_MIN_SCALE, _MAX_SCALE = 2.0**-100, 2.0**100


def _norm_limit(size: int) -> float:
    """The largest chunk norm a rank puts on the wire: the float32 sum over `size` ranks stays finite."""
    return float(np.finfo(np.float32).max) / size * (1 - 2.0**-10)


def _wire_norms(ops, norms, v, chunk: int, size: int):
    """The float32 chunk norms to allreduce: NaN for a chunk holding NaN or inf (every rank then
    refuses the step), at most _norm_limit(size) for a finite one whose norm is larger (checked
    again, only for those chunks, on the values themselves)."""
    limit = _norm_limit(size)
    for c in np.flatnonzero(~(norms <= limit)):
        values = ops.to_numpy(v[c * chunk : (c + 1) * chunk])
        norms[c] = limit if np.isfinite(values).all() else np.nan
    return norms


def check_dtype(dtype) -> None:
    """Raise TypeError unless CSC can keep a residual of this dtype (its own precision)."""
    if dtype.kind != "f" or dtype.itemsize < 4:
        raise TypeError(
            f"SparseAllreduce needs a floating gradient of float32 or float64 (the residual "
            f"accumulates in its dtype), got {dtype}"
        )


class SparseAllreduce:
    """Stateful sparse allreduce of one gradient (same size every call); see the module docstring.

    Args:
        density: fraction of chunks sent each step, in (0, 1].
        chunk_elems: elements per chunk (the last chunk may be short).
        momentum: momentum correction factor m in [0, 1); 0 plain residual accumulation.
        warmup_steps: steps over which the density falls from 1 to `density`.
        op: "mean" or "sum" over ranks (or MPI.SUM).
        compression: None, "fp16" or "bf16" for the packed payload.
        comm: the communicator (default COMM_WORLD).

    Calling it with a gradient returns the update to apply (same shape and kind of array).
    `residual` is what this rank has not sent yet; `stats` describes the last step.
    """

    def __init__(self, density=0.01, chunk_elems=DEFAULT_CHUNK_ELEMS, momentum=0.0, warmup_steps=0,
                 op="mean", compression=None, comm=None):  # fmt: skip
        if isinstance(density, bool) or not isinstance(density, (int, float, np.floating)):
            raise TypeError(f"density must be a number, got {type(density).__name__}")
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density}")
        if isinstance(chunk_elems, bool) or not isinstance(chunk_elems, (int, np.integer)):
            raise TypeError(f"chunk_elems must be an int, got {type(chunk_elems).__name__}")
        if chunk_elems < 1:
            raise ValueError(f"chunk_elems must be >= 1, got {chunk_elems}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if (
            isinstance(warmup_steps, bool)
            or not isinstance(warmup_steps, (int, np.integer))
            or warmup_steps < 0
        ):
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        name = check_op(op, np.dtype(np.float32))
        if name not in ("mean", "sum"):
            raise ValueError(f"op must be 'mean' or 'sum' (residuals accumulate), got {op!r}")
        if compression is not None:
            compression = check_compression(compression, np.dtype(np.float32))
        self.density, self.chunk_elems = float(density), int(chunk_elems)
        self.momentum, self.warmup_steps = float(momentum), int(warmup_steps)
        self.op, self.compression, self._comm = name, compression, comm
        self.step_count = 0
        self.stats: dict = {}
        self._ops = self._shape = None
        self._state = None  # (u, v): velocity (empty at momentum 0) and residual, flat; None before step 1
        self._spare = None  # (u, v) buffers the next step writes its new state into
        self._staged = None  # what commit() makes the state: the last step's new (u, v), ops, shape, stats

    @property
    def residual(self):
        """What this rank has accumulated but not sent (None before the first step). A view of the
        current state: read it between steps; the next step may reuse its memory."""
        if self._state is None:
            return None
        return self._ops.shaped(self._state[1], self._shape)

    def set_momentum(self, momentum: float) -> None:
        """Change the momentum correction factor between steps (a momentum schedule: OneCycleLR,
        CyclicLR). The velocity is kept while the momentum stays above 0, starts from zero when it
        becomes so, and is dropped at 0. Every rank changes it alike (the ranks agree on it each step).

        Raises:
            ValueError: momentum not in [0, 1). RuntimeError: a step is in flight.
        """
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float, np.floating)):
            raise TypeError(f"momentum must be a number, got {type(momentum).__name__}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if self._staged is not None:
            raise RuntimeError("SparseAllreduce.set_momentum: a step is in flight; change it between steps")
        momentum = float(momentum)
        if (momentum > 0) != (self.momentum > 0) and self._state is not None:
            u, v = self._state
            self._state = (self._ops.zeros(v.size if momentum else 0, np.dtype(v.dtype)), v)
            self._spare = None  # (sized for the old velocity)
        self.momentum = momentum

    def current_density(self) -> float:
        if self.warmup_steps and self.step_count < self.warmup_steps:
            return self.density ** (self.step_count / self.warmup_steps)
        return self.density

    def __call__(self, grad):
        update = self.step_on(context(self._comm), grad)
        self.commit()
        return update

    def _check(self, grad):
        kind, dtype = check_array(grad, "grad")
        check_dtype(dtype)
        shape, flat = kind.shape(grad), kind.read(grad, "grad")
        if self._state is not None:
            v = self._state[1]
            if kind.ops is not self._ops and (v.size, np.dtype(v.dtype)) == (flat.size, dtype):
                # The gradient is in the other memory (host or device) than the state: a checkpoint
                # taken on the other, or a trainer that moved. The state follows it (helper-55: the
                # step refused it, saying "the gradient changed").
                self._state = tuple(from_host(to_host(a, self._ops), kind.ops) for a in self._state)
                self._ops, self._spare = kind.ops, None
            if (v.size, np.dtype(v.dtype), self._ops) != (flat.size, dtype, kind.ops):
                raise ValueError(
                    f"SparseAllreduce: the gradient changed: expected {v.size} {np.dtype(v.dtype)} "
                    f"elements ({self._ops.memory} memory), got {flat.size} {dtype} ({kind.memory} memory)"
                )
        return kind, dtype, shape, flat

    def _fingerprint(self, shape: tuple, dtype, density: float, extra: int) -> int:
        """What the ranks must agree on besides the payload sizes: the gradient's shape and dtype (as
        allreduce's: a (100, 50) gradient beside a (50, 100) one sums elements of different places),
        the settings, the density of this step, and the caller's `extra`."""
        flags = (self.op == "mean") + 2 * (self.compression == "fp16") + 4 * (self.compression == "bf16")
        fields = (self.density, self.momentum, density, self.chunk_elems, self.warmup_steps, flags,
                  zlib.crc32(repr(tuple(shape)).encode()), dtype_code(np.dtype(dtype)), extra)  # fmt: skip
        return zlib.crc32(struct.pack("<dddqqqqqq", *fields))

    def _describe(self, shape: tuple, dtype, density: float) -> str:
        return f"This rank's SparseAllreduce: {self._words(shape, dtype, density)}"

    def _words(self, shape: tuple, dtype, density: float) -> str:
        n = math.prod(shape)
        return (
            f"a gradient of {n} {np.dtype(dtype).name} elements (shape {tuple(shape)}), "
            f"step {self.step_count} (density {density:g}), density={self.density:g}, "
            f"chunk_elems={self.chunk_elems}, momentum={self.momentum:g}, "
            f"warmup_steps={self.warmup_steps}, op={self.op}, compression={self.compression}"
        )

    def step_on(self, ctx: CommContext, grad, extra: int = 0, out=None):
        """One step on a given context (the caller's, or the engine's inside LazyAllreduce), not yet
        committed: the state changes only at commit(), so a step that raises or is never committed
        leaves this object as it was. `extra` (an int < 2**63) is folded into what the ranks agree
        on (LazyAllreduce's push-order checksum). `out`: a flat array of grad's kind, size and dtype
        (grad itself may be it: grad is read in full before the update is written) that the update
        goes into instead of a new array; LazyAllreduce reuses its segment buffers so."""
        self._staged = None
        times = {}
        try:  # everything before the first message: a failure here must reach the peers
            kind, dtype, shape, g = self._check(grad)
            ops = kind.ops
            n, chunk, momentum = g.size, self.chunk_elems, self.momentum
            u, v = self._state or (ops.zeros(n if momentum else 0, dtype), ops.zeros(n, dtype))
            u_new, v_new = self._spare or (ops.empty(n if momentum else 0, dtype), ops.empty(n, dtype))
            nchunks = (n + chunk - 1) // chunk
            density = self.current_density()
            tag = ("sparse", self._fingerprint(shape, dtype, density, extra))
            t = time.perf_counter()
            with timeline.span("CSC residual + norms", elements=n):
                norms = ops.to_numpy(ops.accumulate_norms(u_new, v_new, u, v, g, momentum, chunk))
                local_norms = _wire_norms(ops, norms, v_new, chunk, ctx.size)
            times["residual + norms"] = time.perf_counter() - t
        except Exception:
            reject(ctx, "sparse")
            raise
        # what this rank passed, shared with its peers on a mismatch
        with recursive_doubling.passing(Words(self._words, shape, dtype, density)):
            try:
                norms = allreduce_on(ctx, local_norms, "sum", tag=tag)
                if not np.isfinite(norms).all():
                    error = CompressionOverflowError if self.compression else NonFiniteError
                    raise error(
                        "SparseAllreduce: a gradient holds inf or NaN on some rank; this step was not "
                        "applied and every rank's residual is as before it (under loss scaling: skip the "
                        "step)"
                    )
                t = time.perf_counter()
                k = min(nchunks, math.ceil(density * nchunks))
                with timeline.span("CSC selection", chunks=nchunks, sent=k):
                    order = np.lexsort((np.arange(nchunks), -norms))  # by norm, descending; ties: lower index
                    ids = np.sort(order[:k]).astype(np.int64)
                times["selection"] = time.perf_counter() - t

                t = time.perf_counter()
                packed_len = k * chunk - (chunk * nchunks - n if k and ids[-1] == nchunks - 1 else 0)
                with timeline.span("CSC pack", elements=packed_len):
                    packed = ops.empty(packed_len, dtype)
                    device_ids = ops.index_array(ids)
                    ops.pack(packed, v_new, device_ids, chunk)
                times["pack"] = time.perf_counter() - t
                scale = self._wire_scale(norms[ids], ctx.size) if self.compression else None
                if scale is not None:
                    self._allreduce_compressed(
                        ctx, packed, v_new, ops=ops, ids=device_ids, scale=scale, tag=tag
                    )
                else:  # uncompressed, or values beyond the wire's reach even scaled (every rank agrees)
                    # A norm clipped on some rank (_wire_norms): the chunks' sum may pass the dtype's
                    # range (float32's; float64's only near its own, where sum-then-divide stays exact)
                    clipped = k > 0 and norms[ids].max() >= _norm_limit(ctx.size)
                    op = self.op
                    divide_first = self.compression or (clipped and np.dtype(dtype) == np.float32)
                    if divide_first and op == "mean":  # huge values: divide first (a float32 scale)
                        ops.cast_scaled(packed, packed, 1.0 / ctx.size)
                        op = "sum"
                    ops.fence()
                    allreduce_on(ctx, packed, op, out=packed, tag=tag)
                    if clipped and not np.isfinite(ops.to_numpy(packed)).all():  # (alike on every rank)
                        error = CompressionOverflowError if self.compression else NonFiniteError
                        raise error(
                            f"SparseAllreduce: the {op} of finite gradients passed the range of "
                            f"{np.dtype(dtype).name}; this step was not applied and every rank's residual "
                            "is as before it (under loss scaling: skip the step)"
                        )
                    ops.zero_chunks(v_new, device_ids, chunk)  # all of it was sent
            except MismatchError as exc:
                raise MismatchError(f"{exc}. {self._describe(shape, dtype, density)}") from exc

        t = time.perf_counter()
        with timeline.span("CSC scatter-add", elements=n):
            result = kind.new(grad, shape, dtype) if out is None else out
            flat_result = kind.write_view(result, "result")
            ops.clear(flat_result)
            ops.scatter_add(flat_result, packed, device_ids, chunk)
            if momentum:
                ops.zero_chunks(u_new, device_ids, chunk)
            ops.fence()
        times["scatter-add + clear"] = time.perf_counter() - t

        payload = packed_len * (2 if scale is not None else np.dtype(dtype).itemsize)
        stats = {
            "step": self.step_count, "density": density, "chunks": nchunks, "chunks_sent": k,
            "payload_bytes": payload, "norm_bytes": 4 * nchunks, "dense_bytes": n * np.dtype(dtype).itemsize,
            "seconds": times,
        }  # fmt: skip
        self._staged = ((u_new, v_new), ops, shape, stats)
        return result

    def _wire_scale(self, selected_norms, size: int):
        """fp16: the power of two that brings the largest bound of the selected chunks (its
        allreduced L1 norm, over the world size for a mean) just under _WIRE_BOUND, so no float16
        sum can overflow and small gradients keep float16's precision. bf16 has float32's range:
        1. None where no float32 scale can (norms beyond about 2**115, or clipped on some rank):
        that step's payload then goes uncompressed."""
        bound = float(selected_norms.max()) if selected_norms.size else 0.0
        if bound >= _norm_limit(size):  # a rank's norm may have been clipped: the bound is unknown
            return None
        if self.compression == "bf16":
            return 1.0
        if self.op == "mean":
            bound /= size
        scale = 1.0
        while bound * scale > _WIRE_BOUND:
            scale *= 0.5
            if scale < _MIN_SCALE:
                return None
        while 0 < bound * scale * 2 <= _WIRE_BOUND and scale < _MAX_SCALE:
            scale *= 2.0
        return scale

    def _allreduce_compressed(self, ctx: CommContext, packed, v_new, *, ops, ids, scale: float, tag) -> None:
        """Allreduce `packed` as float16 or bfloat16, scaled by `scale` (see _wire_scale), and leave
        the reduced values in it. What this rank's rounding to the wire type left out stays in v_new."""
        size = ctx.size
        per_rank = scale / size if self.op == "mean" else scale  # the mean divides before the cast
        wire = ops.empty(packed.size, wire_dtype(self.compression))
        ops.cast_scaled(wire, packed, per_rank)
        unsent = ops.empty(packed.size, packed.dtype)
        ops.cast_scaled(unsent, wire, -1.0 / per_rank)  # minus what was sent, in the residual's units
        ops.scatter_add(v_new, unsent, ids, self.chunk_elems)  # v_new = v_new - sent: the rounding stays
        ops.fence()
        allreduce_on(ctx, wire, "sum", out=wire, tag=tag, holds=wire_dtype(self.compression))
        if ops.cast_scaled(packed, wire, 1.0 / scale):
            raise CompressionOverflowError(
                overflow_message("SparseAllreduce", self.compression)
                + "; this step was not applied and every rank's residual is as before it"
            )

    def commit(self) -> None:
        """Make the last step's new residual the state. A direct call commits at once; LazyAllreduce
        commits each segment's step when the whole fused step has succeeded on every rank."""
        if self._staged is None:
            return
        (state, self._ops, self._shape, self.stats), self._staged = self._staged, None
        self._spare, self._state = self._state, state
        self.step_count += 1

    def discard(self) -> None:
        """Forget the last step: the state stays as before it."""
        self._staged = None

    def settings(self) -> dict:
        from ..runtime.checkpoint import compression_name

        return {
            "density": self.density, "chunk_elems": self.chunk_elems, "momentum": self.momentum,
            "warmup_steps": self.warmup_steps, "op": self.op,
            "compression": compression_name(self.compression),
        }  # fmt: skip

    def state_dict(self) -> dict:
        """This rank's state, for a checkpoint: settings, world size and rank, step count, and host
        copies of the residual and velocity (None before the first step), with the gradient's shape
        and dtype and the memory they lived in (host or device).

        Residuals are per rank: every rank saves its own state and loads it back on the same rank.

        Raises:
            RuntimeError: a step is in flight (inside LazyAllreduce: pushed, not flushed).
        """
        from ..runtime import checkpoint as st

        if self._staged is not None:
            raise RuntimeError("SparseAllreduce.state_dict: a step is in flight; take it between steps")
        rank, size = st.world(self._comm)
        u, v = self._state or (None, None)
        state = st.header("SparseAllreduce")
        state.update(self.settings())
        state.update(
            world_size=size,
            rank=rank,
            step_count=self.step_count,
            residual=to_host(v, self._ops),
            velocity=to_host(u, self._ops),
            grad_shape=None if v is None else np.array(self._shape, dtype=np.int64),
            grad_dtype=None if v is None else np.dtype(v.dtype).name,
            memory=None if v is None else self._ops.memory,
        )
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict() of this rank, into the memory (host or device) it was saved from
        (a step on gradients in the other memory moves it there).

        Raises:
            ValueError: the state was saved with other settings, at another world size or on another
                rank (residuals are per rank: each rank must save and load its own checkpoint), or is
                malformed. Nothing is changed then.
            RuntimeError: a step is in flight.
        """
        from ..runtime import checkpoint as st

        who = "SparseAllreduce.load_state_dict"
        if self._staged is not None:
            raise RuntimeError(f"{who}: a step is in flight; load between steps")
        st.check_header(state, "SparseAllreduce", who)
        st.check_equal(state, self.settings(), who)
        rank, size = st.world(self._comm)
        st.check_world_size(state, size, who)
        saved_rank = st.get(state, "rank", who)
        if saved_rank != rank:
            raise ValueError(
                f"{who}: rank differs: expected {rank} (this rank), got {saved_rank} (the state dict was "
                "saved on another rank); residuals are per rank, so each rank must save and load its own "
                "checkpoint"
            )
        step_count = st.get_count(state, "step_count", who)
        v, u = st.get(state, "residual", who), st.get(state, "velocity", who)
        if v is None:
            if u is not None:
                raise ValueError(f"{who}: the state has a velocity but no residual")
            self._state, self._ops, self._shape = None, None, None
        else:
            shape = tuple(int(s) for s in st.get(state, "grad_shape", who))
            dtype = np.dtype(st.get(state, "grad_dtype", who))
            n = int(np.prod(shape, dtype=np.int64))
            for name, a, length in (("residual", v, n), ("velocity", u, n if self.momentum else 0)):
                if not isinstance(a, np.ndarray) or a.size != length or a.dtype != dtype:
                    got = f"{a.size} {a.dtype} elements" if isinstance(a, np.ndarray) else type(a).__name__
                    raise ValueError(f"{who}: {name}: expected {length} {dtype} elements, got {got}")
            ops = ops_for_memory(st.get(state, "memory", who))
            self._state = (from_host(u, ops), from_host(v, ops))
            self._ops, self._shape = ops, shape
        self._spare, self._staged, self.stats = None, None, {}
        self.step_count = step_count
