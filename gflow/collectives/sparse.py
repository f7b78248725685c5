"""Coarse-grained sparse communication (CSC, GradientFlow): send only the gradient chunks that matter.

Each rank keeps a residual v of what it has not sent yet (with Deep Gradient Compression's momentum
correction: u = m*u + g; v = v + u). Every step the flat v is cut into chunks of chunk_elems; the
chunks' L1 norms are allreduced (small: one float32 per chunk), so every rank sees the same norms and
picks the same top-k chunks (k = ceil(density * chunks), ties to the lower index) without exchanging
index lists. Those chunks are packed and allreduced by the ordinary dense path (optionally fp16),
scattered into the returned update (zeros elsewhere), and cleared from v and u (momentum factor
masking). Nothing is lost: with momentum 0, the updates applied so far plus every rank's residual add
up to every gradient pushed (divided by the world size for "mean").

With warmup_steps = W the density starts at 1 (dense) and falls geometrically to the target:
density_t = density ** (t / W) for t < W.
"""

import math
import struct
import time
import zlib

import numpy as np

from .._array import check_array
from .._context import CommContext, context
from ..compression import check_compression
from .api import allreduce_on, reject

# 1024 float32 per chunk: the norms then add 1/1024 (0.1%) of the dense bytes, so CSC at 1% sends
# about 1.1% of what a dense allreduce sends (bench/RESULTS.md).
DEFAULT_CHUNK_ELEMS = 1024


class SparseAllreduce:
    """Stateful sparse allreduce of one gradient (same size every call); see the module docstring.

    Args:
        density: fraction of chunks sent each step, in (0, 1].
        chunk_elems: elements per chunk (the last chunk may be short).
        momentum: momentum correction factor m in [0, 1); 0 plain residual accumulation.
        warmup_steps: steps over which the density falls from 1 to `density`.
        op: "mean" or "sum" over ranks.
        compression: None or "fp16" for the packed payload.
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
        if op not in ("mean", "sum"):
            raise ValueError(f"op must be 'mean' or 'sum' (residuals accumulate), got {op!r}")
        if compression is not None:
            check_compression(compression, np.dtype(np.float32))
        self.density, self.chunk_elems = float(density), int(chunk_elems)
        self.momentum, self.warmup_steps = float(momentum), int(warmup_steps)
        self.op, self.compression, self._comm = op, compression, comm
        self.step_count = 0
        self.stats: dict = {}
        self._ops = self._u = self._v = None
        self._shape = None
        # What the ranks must agree on besides sizes, folded into every agreement of this object.
        settings = struct.pack("<ddqqq", self.density, self.momentum, self.chunk_elems, self.warmup_steps,
                               (op == "mean") + 2 * (compression == "fp16"))  # fmt: skip
        self._fingerprint = zlib.crc32(settings)

    @property
    def residual(self):
        """What this rank has accumulated but not sent (None before the first call)."""
        return (
            None if self._v is None else self._v.reshape(self._shape) if self._ops.kind == "host" else self._v
        )

    def current_density(self) -> float:
        if self.warmup_steps and self.step_count < self.warmup_steps:
            return self.density ** (self.step_count / self.warmup_steps)
        return self.density

    def __call__(self, grad):
        return self.step_on(context(self._comm), grad)

    def _check(self, grad):
        ops, dtype = check_array(grad, "grad")
        if dtype.kind != "f":
            raise TypeError(f"SparseAllreduce needs a floating gradient, got {dtype}")
        if ops.kind == "device":
            from ..cuda import arrays

            shape, flat = arrays.describe(grad)[0], arrays.input_view(grad, "grad")
        else:
            shape, flat = grad.shape, np.ascontiguousarray(grad).reshape(-1)
        if self._v is not None:
            before = (self._v.size, np.dtype(self._v.dtype), self._ops.kind)
            if before != (flat.size, dtype, ops.kind):
                raise ValueError(
                    "SparseAllreduce: the gradient changed: expected {} {} elements ({} array), ".format(
                        *before
                    )
                    + f"got {flat.size} {dtype} ({ops.kind} array)"
                )
        return ops, dtype, shape, flat

    def step_on(self, ctx: CommContext, grad):
        """One step on a given context (the caller's, or the engine's inside LazyAllreduce)."""
        try:
            ops, dtype, shape, g = self._check(grad)
        except (TypeError, ValueError):
            reject(ctx, "sparse")
            raise
        if self._v is None:
            self._ops, self._shape = ops, shape
            self._u, self._v = ops.zeros(g.size, dtype), ops.zeros(g.size, dtype)
        n, chunk = g.size, self.chunk_elems
        nchunks = (n + chunk - 1) // chunk
        density = self.current_density()
        tag = ("sparse", self._fingerprint)
        times = {}

        t = time.perf_counter()
        local_norms = ops.to_numpy(ops.accumulate_norms(self._u, self._v, g, self.momentum, chunk))
        times["residual + norms"] = time.perf_counter() - t

        norms = allreduce_on(ctx, local_norms, "sum", None, "auto", None, tag)
        t = time.perf_counter()
        k = min(nchunks, math.ceil(density * nchunks))
        order = np.lexsort((np.arange(nchunks), -norms))  # by norm, descending; ties: lower index
        ids = np.sort(order[:k]).astype(np.int64)
        times["selection"] = time.perf_counter() - t

        t = time.perf_counter()
        packed_len = k * chunk - (chunk * nchunks - n if k and ids[-1] == nchunks - 1 else 0)
        packed = ops.empty(packed_len, dtype)
        device_ids = ops.index_array(ids)
        ops.pack(packed, self._v, device_ids, chunk)
        ops.fence()
        times["pack"] = time.perf_counter() - t

        allreduce_on(ctx, packed, self.op, packed, "auto", self.compression, tag)

        t = time.perf_counter()
        result, flat_result = self._new_result(grad, ops, dtype, shape)
        ops.scatter_add(flat_result, packed, device_ids, chunk)
        ops.zero_chunks(self._v, device_ids, chunk)
        ops.zero_chunks(self._u, device_ids, chunk)
        ops.fence()
        times["scatter-add + clear"] = time.perf_counter() - t

        payload = packed_len * (2 if self.compression else np.dtype(dtype).itemsize)
        self.stats = {
            "step": self.step_count, "density": density, "chunks": nchunks, "chunks_sent": k,
            "payload_bytes": payload, "norm_bytes": 4 * nchunks, "dense_bytes": n * np.dtype(dtype).itemsize,
            "seconds": times,
        }  # fmt: skip
        self.step_count += 1
        return result

    @staticmethod
    def _new_result(grad, ops, dtype, shape):
        if ops.kind == "device":
            from ..cuda import arrays

            result = arrays.new_like(grad, shape, dtype)
            flat = arrays.flat_view(result, "result")
            ops.clear(flat)
            return result, flat
        flat = np.zeros(int(np.prod(shape, dtype=np.int64)), dtype)
        return flat.reshape(shape), flat
