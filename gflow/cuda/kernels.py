"""Numba CUDA kernels for gflow's per-element work.

Each kernel is a grid-stride loop, so any launch size covers any length. gflow/cuda/ops.py launches them
and gflow/arrays/host_ops.py holds their NumPy twins (same names, same meaning); tests run these under
NUMBA_ENABLE_CUDASIM=1 against the twins.
"""

import math

import numpy as np
from numba import cuda, float32, int32, uint16, uint32

from .memory import SIMULATED

# Threads per block for the chunk-norm reduction (a power of two: the tree reduction halves it).
NORM_THREADS = 128


@cuda.jit
def add(out, a, b):
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < out.size:
        out[i] = a[i] + b[i]
        i += stride


@cuda.jit
def maximum(out, a, b):
    # NaN wins and ties (+0 against -0) go to b, as in np.maximum. `not x == x` finds NaN in every
    # dtype: CUDA's float16 != is ordered (__hne is false for NaN), so `x != x` would not.
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < out.size:
        x, y = a[i], b[i]
        out[i] = x if (x > y or not x == x) else y
        i += stride


@cuda.jit
def minimum(out, a, b):
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < out.size:
        x, y = a[i], b[i]
        out[i] = x if (x < y or not x == x) else y
        i += stride


@cuda.jit
def copy(out, a):
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < out.size:
        out[i] = a[i]
        i += stride


@cuda.jit
def divide(x, divisor):
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < x.size:
        x[i] = x[i] / divisor
        i += stride


@cuda.jit
def cast_scaled(dst, src, scale, limit, flag):
    """dst = src * scale in dst's dtype; flag[0] = 1 if any scaled value is NaN, inf, or beyond
    +-limit (dst's largest finite value), so an overflow is reported instead of stored silently."""
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < dst.size:
        v = src[i] * scale
        if not abs(v) <= limit:
            flag[0] = 1
        dst[i] = v
        i += stride


@cuda.jit
def chunk_norms(out, x, chunk):
    """out[c] = sum(|x[c*chunk : (c+1)*chunk]|), one block per chunk at a time; the last chunk may
    be short. Launch with NORM_THREADS threads per block."""
    partial = cuda.shared.array(NORM_THREADS, float32)
    tid = cuda.threadIdx.x
    c = cuda.blockIdx.x
    while c < out.size:
        lo = c * chunk
        hi = min(lo + chunk, x.size)
        acc = float32(0)
        i = lo + tid
        while i < hi:
            acc += abs(float32(x[i]))
            i += cuda.blockDim.x
        partial[tid] = acc
        cuda.syncthreads()
        half = cuda.blockDim.x // 2
        while half > 0:
            if tid < half:
                partial[tid] += partial[tid + half]
            cuda.syncthreads()
            half //= 2
        if tid == 0:
            out[c] = partial[0]
        cuda.syncthreads()
        c += cuda.gridDim.x


@cuda.jit
def pack(dst, src, ids, chunk):
    """dst[k*chunk + j] = src[ids[k]*chunk + j]: gather the listed chunks into one buffer, in list
    order. Only the chunk with the highest index may be short, so list ids in ascending order."""
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < dst.size:
        s = ids[i // chunk] * chunk + i % chunk
        if s < src.size:
            dst[i] = src[s]
        i += stride


@cuda.jit
def scatter_add(dst, packed, ids, chunk):
    """dst[ids[k]*chunk + j] += packed[k*chunk + j]: the inverse of pack, adding. ids must be unique."""
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < packed.size:
        d = ids[i // chunk] * chunk + i % chunk
        if d < dst.size:
            dst[d] += packed[i]
        i += stride


@cuda.jit
def accumulate(u_out, v_out, u, v, g, momentum):
    """u_out = momentum * u + g; v_out = v + u_out (Deep Gradient Compression's momentum correction).
    Outputs may be the inputs; with momentum 0, u and u_out are not touched (they may be empty)."""
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < v.size:
        if momentum == 0:
            v_out[i] = v[i] + g[i]
        else:
            w = momentum * u[i] + g[i]
            u_out[i] = w
            v_out[i] = v[i] + w
        i += stride


@cuda.jit
def zero_chunks(x, ids, chunk):
    """x[ids[k]*chunk : (ids[k]+1)*chunk] = 0 for every k (the last chunk may be short)."""
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < ids.size * chunk:
        d = ids[i // chunk] * chunk + i % chunk
        if d < x.size:
            x[d] = 0
        i += stride


@cuda.jit
def fill(x, value):
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < x.size:
        x[i] = value
        i += stride


# --- bfloat16, as bits (uint16 device arrays: Numba has no bfloat16 array type) ---------------------
# The twins of gflow/arrays/half_kernels.py's bfloat16 loops: float32 arithmetic, one rounding to
# nearest even; NaN
# becomes the quiet NaN of its sign. Bit casts are libdevice's on the GPU; the simulator runs these
# device functions as Python, where NumPy's scalar views do the same.
if SIMULATED:

    @cuda.jit(device=True)
    def _f32_bits(f):
        return np.float32(f).view(np.uint32)

    @cuda.jit(device=True)
    def _bits_f32(u):
        return np.uint32(u).view(np.float32)

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def _f32_bits(f):
        return uint32(libdevice.float_as_int(f))

    @cuda.jit(device=True)
    def _bits_f32(u):
        return libdevice.int_as_float(int32(u))


@cuda.jit(device=True)
def _to_bf16(f):
    u = _f32_bits(f)
    if (u & uint32(0x7FFFFFFF)) > uint32(0x7F800000):
        return uint16(((u >> uint32(16)) & uint32(0x8000)) | uint32(0x7FC0))
    return uint16((u + uint32(0x7FFF) + ((u >> uint32(16)) & uint32(1))) >> uint32(16))


@cuda.jit(device=True)
def _from_bf16(h):
    return _bits_f32(uint32(h) << uint32(16))


@cuda.jit
def reduce_bf16(out, a, b, op):
    """out = a op b on bfloat16 bits; op 0 sum, 1 max, 2 min (NaN wins, as in np.maximum)."""
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < out.size:
        x, y = _from_bf16(a[i]), _from_bf16(b[i])
        if op == 0:
            v = x + y
        elif op == 1:
            v = x if (x > y or not x == x) else y
        else:
            v = x if (x < y or not x == x) else y
        out[i] = _to_bf16(v)
        i += stride


@cuda.jit
def encode_bf16(dst, src, scale, flag):
    """dst (bfloat16 bits) = src * scale in float32; flag[0] = 1 if any result is inf or NaN."""
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < dst.size:
        h = _to_bf16(float32(src[i]) * scale)
        if (h & uint16(0x7F80)) == uint16(0x7F80):
            flag[0] = 1
        dst[i] = h
        i += stride


@cuda.jit
def decode_bf16(dst, src, scale, flag):
    """dst = float(src bits) * scale; flag[0] = 1 if any result is inf or NaN."""
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < dst.size:
        v = _from_bf16(src[i]) * scale
        if not abs(v) < math.inf:
            flag[0] = 1
        dst[i] = v
        i += stride


@cuda.jit
def divide_bf16(x, divisor):
    """x (bfloat16 bits) = x / divisor in float32, one rounding (op='mean')."""
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < x.size:
        x[i] = _to_bf16(_from_bf16(x[i]) / divisor)
        i += stride
