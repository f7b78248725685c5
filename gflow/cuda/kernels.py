"""Numba CUDA kernels for gflow's per-element work.

Each kernel is a grid-stride loop, so any launch size covers any length. gflow/cuda/ops.py launches them
and gflow/arrays/host_ops.py holds their NumPy twins (same names, same meaning); tests run these under
NUMBA_ENABLE_CUDASIM=1 against the twins.
"""

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


@cuda.jit(device=True)
def _combine(x, y, op):
    """x op y; op 0 sum, 1 max, 2 min, as the kernels above (float16 adds in float16)."""
    if op == 0:
        return x + y
    if op == 1:
        return x if (x > y or not x == x) else y
    return x if (x < y or not x == x) else y


@cuda.jit
def reduce_parts(out, parts, op):
    """out = ((parts[0] op parts[1]) op parts[2]) ..., elementwise, in one launch: each part read
    once and out written once, where pairwise kernels make len(parts) - 1 launches and passes (the
    node phase's k-way reduction). parts: a tuple of arrays of one type; out may be any of them
    (every part is read at i before out[i] is written). Each step rounds to the dtype, as the
    pairwise kernels do (Numba adds float16 in float16; integer sums wrap alike)."""
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < out.size:
        v = parts[0][i]
        for q in range(1, len(parts)):
            v = _combine(v, parts[q][i], op)
        out[i] = v
        i += stride


@cuda.jit
def gather_blocks(out, blocks, bounds):
    """out[bounds[q]:bounds[q + 1]] = blocks[q][bounds[q]:bounds[q + 1]] for every q, in one launch
    (a node allgather's copies from its peers' slots). bounds: a tuple of len(blocks) + 1 ints."""
    i, stride = cuda.grid(1), cuda.gridsize(1)
    q = 0
    while i < out.size:
        while i >= bounds[q + 1]:  # (i only grows, so q does)
            q += 1
        out[i] = blocks[q][i]
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
    +-limit (dst's largest finite value, in the product's dtype), so an overflow is reported
    instead of stored silently. The general case (float32 <-> float64, same dtype); float16 and
    bfloat16 take the kernels below. Four elements per thread in flight (loads before stores: the
    arrays may alias), the flag written once per thread."""
    i, stride = cuda.grid(1), cuda.gridsize(1)
    n = dst.size
    bad = False
    while i + 3 * stride < n:
        v0 = src[i] * scale
        v1 = src[i + stride] * scale
        v2 = src[i + 2 * stride] * scale
        v3 = src[i + 3 * stride] * scale
        dst[i] = v0
        dst[i + stride] = v1
        dst[i + 2 * stride] = v2
        dst[i + 3 * stride] = v3
        if not (abs(v0) <= limit and abs(v1) <= limit and abs(v2) <= limit and abs(v3) <= limit):
            bad = True
        i += 4 * stride
    while i < n:
        v = src[i] * scale
        dst[i] = v
        if not abs(v) <= limit:
            bad = True
        i += stride
    if bad:
        flag[0] = 1


def _cast_kernel(convert, special):
    """A cast kernel (dst, src, scale, flag): dst[i] = convert(src[i], scale); flag[0] = 1 if
    special(that value) for any i. Four elements per thread in flight (every load before the stores:
    dst may be src), the flag written once per thread. The float16 and bfloat16 casts below."""

    @cuda.jit
    def cast(dst, src, scale, flag):
        i, stride = cuda.grid(1), cuda.gridsize(1)
        n = dst.size
        bad = False
        while i + 3 * stride < n:
            v0 = convert(src[i], scale)
            v1 = convert(src[i + stride], scale)
            v2 = convert(src[i + 2 * stride], scale)
            v3 = convert(src[i + 3 * stride], scale)
            dst[i] = v0
            dst[i + stride] = v1
            dst[i + 2 * stride] = v2
            dst[i + 3 * stride] = v3
            if special(v0) or special(v1) or special(v2) or special(v3):
                bad = True
            i += 4 * stride
        while i < n:
            v = convert(src[i], scale)
            dst[i] = v
            if special(v):
                bad = True
            i += stride
        if bad:
            flag[0] = 1

    return cast


# float32 values from this magnitude up round to float16's inf (65520 is halfway between 65504,
# the largest finite float16, and 2**16; the tie goes to the even 2**16).
_F16_INF_FROM = np.float32(65520.0)
_F32_INF = np.float32(np.inf)


@cuda.jit(device=True)
def _times32(x, scale):
    return float32(x) * scale


@cuda.jit(device=True)
def _rounds_to_f16_inf(v):
    return not abs(v) < _F16_INF_FROM


@cuda.jit(device=True)
def _not_finite(v):
    return not abs(v) < _F32_INF


# dst (float16) = float32(src) * scale, one rounding; flag if any result is inf or NaN (host_ops'
# encode_half twin: values that round down to 65504 do not count).
encode_f16 = _cast_kernel(_times32, _rounds_to_f16_inf)
# dst = float32(src float16) * scale; flag if any result is inf or NaN.
decode_f16 = _cast_kernel(_times32, _not_finite)


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


# The chunk kernels take a 2-D block: threadIdx.x runs along a chunk, threadIdx.y picks one of the
# block's blockDim.y chunks, and the grid strides over the listed chunks. No per-element division.


@cuda.jit
def pack(dst, src, ids, chunk):
    """dst[k*chunk + j] = src[ids[k]*chunk + j]: gather the listed chunks into one buffer, in list
    order. Only the chunk with the highest index may be short, so list ids in ascending order."""
    tx, ty = cuda.blockDim.x, cuda.blockDim.y
    k = cuda.blockIdx.x * ty + cuda.threadIdx.y
    while k < ids.size:
        s0 = ids[k] * chunk
        d0 = k * chunk
        n = min(min(chunk, src.size - s0), dst.size - d0)
        j = cuda.threadIdx.x
        while j + 3 * tx < n:
            x0 = src[s0 + j]
            x1 = src[s0 + j + tx]
            x2 = src[s0 + j + 2 * tx]
            x3 = src[s0 + j + 3 * tx]
            dst[d0 + j] = x0
            dst[d0 + j + tx] = x1
            dst[d0 + j + 2 * tx] = x2
            dst[d0 + j + 3 * tx] = x3
            j += 4 * tx
        while j < n:
            dst[d0 + j] = src[s0 + j]
            j += tx
        k += cuda.gridDim.x * ty


@cuda.jit
def scatter_add(dst, packed, ids, chunk):
    """dst[ids[k]*chunk + j] += packed[k*chunk + j]: the inverse of pack, adding. ids must be unique."""
    tx, ty = cuda.blockDim.x, cuda.blockDim.y
    k = cuda.blockIdx.x * ty + cuda.threadIdx.y
    while k < ids.size:
        d0 = ids[k] * chunk
        p0 = k * chunk
        n = min(min(chunk, dst.size - d0), packed.size - p0)
        j = cuda.threadIdx.x
        while j + 3 * tx < n:
            x0 = dst[d0 + j] + packed[p0 + j]
            x1 = dst[d0 + j + tx] + packed[p0 + j + tx]
            x2 = dst[d0 + j + 2 * tx] + packed[p0 + j + 2 * tx]
            x3 = dst[d0 + j + 3 * tx] + packed[p0 + j + 3 * tx]
            dst[d0 + j] = x0
            dst[d0 + j + tx] = x1
            dst[d0 + j + 2 * tx] = x2
            dst[d0 + j + 3 * tx] = x3
            j += 4 * tx
        while j < n:
            dst[d0 + j] += packed[p0 + j]
            j += tx
        k += cuda.gridDim.x * ty


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
    """x[ids[k]*chunk : (ids[k]+1)*chunk] = 0 for every k (the last chunk may be short); 2-D
    blocks, as pack."""
    tx, ty = cuda.blockDim.x, cuda.blockDim.y
    k = cuda.blockIdx.x * ty + cuda.threadIdx.y
    while k < ids.size:
        d0 = ids[k] * chunk
        n = min(chunk, x.size - d0)
        j = cuda.threadIdx.x
        while j < n:
            x[d0 + j] = 0
            j += tx
        k += cuda.gridDim.x * ty


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
def reduce_parts_bf16(out, parts, op):
    """reduce_parts on bfloat16 bits: each step in float32, rounded to bfloat16 (as reduce_bf16)."""
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < out.size:
        v = parts[0][i]
        for q in range(1, len(parts)):
            v = _to_bf16(_combine(_from_bf16(v), _from_bf16(parts[q][i]), op))
        out[i] = v
        i += stride


@cuda.jit(device=True)
def _bf16_special(h):
    """Whether the bfloat16 bits h are inf or NaN (exponent all ones)."""
    return (h & uint16(0x7F80)) == uint16(0x7F80)


@cuda.jit(device=True)
def _to_bf16_times(x, scale):
    return _to_bf16(float32(x) * scale)


@cuda.jit(device=True)
def _from_bf16_times(h, scale):
    return _from_bf16(h) * scale


@cuda.jit(device=True)
def _bf16_times(h, scale):
    return _to_bf16((_from_bf16(h) * scale) * float32(1.0))


# dst (bfloat16 bits) = src * scale in float32; flag if any result is inf or NaN.
encode_bf16 = _cast_kernel(_to_bf16_times, _bf16_special)
# dst = float(src bits) * scale; flag if any result is inf or NaN.
decode_bf16 = _cast_kernel(_from_bf16_times, _not_finite)
# dst (bfloat16 bits) = src (bfloat16 bits) * scale in float32, one rounding: decode_bf16 into float32
# then encode_bf16 with scale 1, in one pass; flag if any result is inf or NaN (a finite float32
# product that rounds to inf included). dst may be src (LossScaler.unscale).
rescale_bf16 = _cast_kernel(_bf16_times, _bf16_special)


@cuda.jit
def divide_bf16(x, divisor):
    """x (bfloat16 bits) = x / divisor in float32, one rounding (op='mean')."""
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < x.size:
        x[i] = _to_bf16(_from_bf16(x[i]) / divisor)
        i += stride
