"""float16 and bfloat16 on the host, fast: Numba CPU loops converting by bit manipulation, fused with
the arithmetic.

NumPy computes float16 one element at a time (about 13 ns per addition here, 20x its float32 add), and
ml_dtypes' bfloat16 ufuncs likewise, which would eat the whole saving of sending half the bytes. These
loops convert float16/bfloat16 <-> float32 with integer operations (round to nearest even, as NumPy,
ml_dtypes and the GPU do), fuse conversion with the reduction or the scaling, and are compiled once
(cache=True) on first use. gflow/arrays/host_ops.py calls them whenever either side is float16 or bfloat16;
results are bit-identical to NumPy's float16 and ml_dtypes' bfloat16 arithmetic on float32 values (one
float32 operation, then one rounding; a float64 input is rounded to float32 first, as on the GPU; a
bfloat16 NaN comes out as the quiet NaN of its sign, where ml_dtypes keeps the payload, and the sign of
NaN + NaN is whatever the hardware gives), and to the CUDA twins in gflow/cuda/kernels.py.
"""

import threading

import numpy as np
from numba import njit, types
from numba.core.extending import intrinsic

from .fp_errors import quiet, unquiet


@intrinsic
def _f32_bits(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return types.uint32(types.float32), codegen


@intrinsic
def _bits_f32(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return types.float32(types.uint32), codegen


_DENORM_MAGIC = np.uint32(((127 - 15) + (23 - 10) + 1) << 23)  # F. Giesen's float/half conversions


@njit(inline="always")
def _to_half(f):
    """float32 -> float16 bits, round to nearest even; overflow gives inf, NaN stays NaN.
    Every branch is computed and one selected, so LLVM can vectorise the loop."""
    u = _f32_bits(f)
    sign = (u >> 16) & np.uint32(0x8000)
    a = u & np.uint32(0x7FFFFFFF)
    special = np.uint32(0x7E00) if a > np.uint32(0x7F800000) else np.uint32(0x7C00)
    # Below 2**-14: adding 0.5 (as a float) lines the subnormal mantissa up and rounds it.
    sub = _f32_bits(_bits_f32(a) + _bits_f32(_DENORM_MAGIC)) - _DENORM_MAGIC
    normal = (a + np.uint32(0xC8000FFF) + ((a >> 13) & np.uint32(1))) >> 13  # rebias by -112, round
    h = special if a >= np.uint32(0x47800000) else (sub if a < np.uint32(0x38800000) else normal)
    return np.uint16(h | sign)


@njit(inline="always")
def _from_half(h):
    """float16 bits -> float32. Every case is computed and one selected (vectorisable); subnormals
    go through an exact integer-to-float conversion, never through float32 denormals (slow on x86)."""
    x = np.uint32(h)
    e = (x >> 10) & np.uint32(0x1F)
    m = x & np.uint32(0x3FF)
    sign = (x & np.uint32(0x8000)) << 16
    normal = sign | ((e + np.uint32(112)) << 23) | (m << 13)
    special = sign | np.uint32(0x7F800000) | (m << 13)
    sub = _f32_bits(np.float32(m) * np.float32(2.0**-24)) | sign
    return _bits_f32(special if e == np.uint32(31) else (sub if e == np.uint32(0) else normal))


@njit(inline="always")
def _to_bf16(f):
    """float32 -> bfloat16 bits (the top half), round to nearest even; overflow gives inf; a NaN
    becomes the quiet NaN of its sign (0x7FC0 or 0xFFC0, as ml_dtypes), never an inf."""
    u = _f32_bits(f)
    rounded = (u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16
    nan = ((u >> 16) & np.uint32(0x8000)) | np.uint32(0x7FC0)
    return np.uint16(nan if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else rounded)


@njit(inline="always")
def _from_bf16(h):
    """bfloat16 bits -> float32: exact (bfloat16 is float32's top half)."""
    return _bits_f32(np.uint32(h) << 16)


_BLOCK = 1 << 16
_scratch = threading.local()  # the engine thread and the caller's may reduce at the same time
_UFUNC = (np.add, np.maximum, np.minimum)


@njit(cache=True, nogil=True)
def _decode(dst, src):
    for i in range(dst.size):
        dst[i] = _from_half(src[i])


@njit(cache=True, nogil=True)
def _encode(dst, src):
    for i in range(dst.size):
        dst[i] = _to_half(src[i])


def reduce_half(out, low, high, op: int) -> None:
    """out = low op high on float16 bit patterns (uint16 views); op 0 sum, 1 max, 2 min (NaN wins,
    as in NumPy). out may be low or high (the ring reduces in place): LLVM vectorises a loop only
    over arrays it can tell apart, so blocks are decoded into float32 scratch, reduced by NumPy in
    float32 (exactly what NumPy's float16 arithmetic does, one element at a time), and encoded back."""
    a = getattr(_scratch, "a", None)
    if a is None:
        a = _scratch.a = np.empty(_BLOCK, np.float32)
        _scratch.b = np.empty(_BLOCK, np.float32)
    b = _scratch.b
    ufunc = _UFUNC[op]
    token = quiet()  # (inf + -inf is NaN without a warning: fp_errors.py)
    try:
        for start in range(0, out.size, _BLOCK):
            stop = min(start + _BLOCK, out.size)
            x, y = a[: stop - start], b[: stop - start]
            _decode(x, low[start:stop])
            _decode(y, high[start:stop])
            ufunc(x, y, out=x)
            _encode(out[start:stop], x)
    finally:
        unquiet(token)


def reduce_bf16(out, low, high, op: int) -> None:
    """reduce_half for bfloat16 bit patterns (uint16 views): float32 arithmetic, one rounding. One
    fused pass (bfloat16's conversions are a shift and a rounding add): a loop over two arrays, in
    place, or over three vectorises, LLVM checking at run time that they do not overlap; only an
    `out` that is an operand itself would defeat that check, so it gets the two-array loop."""
    address = out.ctypes.data
    if address == low.ctypes.data:
        _reduce_bf16_into(out, high, op, True)
    elif address == high.ctypes.data:
        _reduce_bf16_into(out, low, op, False)
    else:
        _reduce_bf16(out, low, high, op)


@njit(inline="always")
def _combine(x, y, op):
    """x op y in float32; max and min let NaN win and give ties (+0 against -0) to y, as np.maximum
    and np.minimum do."""
    if op == 0:
        return x + y
    if op == 1:
        return x if (x > y or x != x) else y
    return x if (x < y or x != x) else y


@njit(cache=True, nogil=True)
def _reduce_bf16(out, low, high, op):
    for i in range(out.size):
        out[i] = _to_bf16(_combine(_from_bf16(low[i]), _from_bf16(high[i]), op))


@njit(cache=True, nogil=True)
def _reduce_bf16_into(acc, other, op, acc_is_low):
    if acc_is_low:
        for i in range(acc.size):
            acc[i] = _to_bf16(_combine(_from_bf16(acc[i]), _from_bf16(other[i]), op))
    else:
        for i in range(acc.size):
            acc[i] = _to_bf16(_combine(_from_bf16(other[i]), _from_bf16(acc[i]), op))


@njit(cache=True, nogil=True)
def encode_half(dst, src, scale):
    """dst (float16 bits) = src * scale, computed in float32 (scale a float32, as on the GPU); True
    if any result is inf or NaN."""
    bad = False
    for i in range(dst.size):
        h = _to_half(np.float32(src[i]) * scale)
        if (h & 0x7C00) == 0x7C00:
            bad = True
        dst[i] = h
    return bad


@njit(cache=True, nogil=True)
def decode_half(dst, src, scale):
    """dst = float(src bits) * scale; True if any result is inf or NaN."""
    bad = False
    for i in range(dst.size):
        v = _from_half(src[i]) * scale
        if not abs(v) < np.inf:  # inf, or NaN (every comparison with NaN is false)
            bad = True
        dst[i] = v
    return bad


@njit(cache=True, nogil=True)
def encode_bf16(dst, src, scale):
    """dst (bfloat16 bits) = src * scale, computed in float32; True if any result is inf or NaN."""
    bad = False
    for i in range(dst.size):
        h = _to_bf16(np.float32(src[i]) * scale)
        if (h & 0x7F80) == 0x7F80:
            bad = True
        dst[i] = h
    return bad


@njit(cache=True, nogil=True)
def decode_bf16(dst, src, scale):
    """dst = float(src bits) * scale; True if any result is inf or NaN."""
    bad = False
    for i in range(dst.size):
        v = _from_bf16(src[i]) * scale
        if not abs(v) < np.inf:
            bad = True
        dst[i] = v
    return bad


@njit(cache=True, nogil=True)
def divide_bf16(x, divisor):
    """x (bfloat16 bits) = x / divisor in place, in float32 with one rounding (op='mean')."""
    for i in range(x.size):
        x[i] = _to_bf16(_from_bf16(x[i]) / divisor)


def kernel_signatures() -> list:
    """(kernel, argument types) for what host_ops runs these kernels on: 2-byte float bits against
    float32 or float64, operands read-only or not. `gflow compile` compiles them ahead."""
    from numba import typeof

    bits, f32, f64 = np.zeros(1, np.uint16), np.zeros(1, np.float32), np.zeros(1, np.float64)
    read_only = bits.copy()
    read_only.setflags(write=False)
    op, scale = np.int64(0), np.float32(1)
    plan = [(_encode, (bits, f32)), (divide_bf16, (bits, scale))]
    for src in (bits, read_only):
        plan += [(_decode, (f32, src)), (_reduce_bf16_into, (bits, src, op, True))]
        plan += [(_reduce_bf16, (bits, src, bits, op)), (_reduce_bf16, (bits, bits, src, op))]
    for wide in (f32, f64):
        fixed = wide.copy()
        fixed.setflags(write=False)
        for src in (wide, fixed):
            plan += [(kernel, (bits, src, scale)) for kernel in (encode_half, encode_bf16)]
        plan += [(kernel, (wide, bits, scale)) for kernel in (decode_half, decode_bf16)]
    return [(kernel, tuple(typeof(x) for x in args)) for kernel, args in plan]
