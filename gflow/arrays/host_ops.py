"""Per-element operations on host (NumPy) arrays.

The CUDA twins live in gflow/cuda/kernels.py with the same names and meaning; gflow/arrays/kinds.py picks
one set per array, so the collectives are written once and never ask what kind of array they hold.
"""

import numpy as np

from ..runtime.signature import finfo, is_bfloat16
from .fp_errors import quiet, unquiet

memory = "host"

_UFUNC = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def buffer(a: np.ndarray) -> np.ndarray:
    """What MPI is handed for a: the array itself; bfloat16 as its bits (NumPy cannot export a
    buffer of ml_dtypes' type, and gflow's traffic is bytes anyway)."""
    return a.view(_U16) if is_bfloat16(a.dtype) else a


def fence() -> None:
    """Wait for this module's pending work before MPI reads its output: nothing is pending on the host."""


def storage(dtype) -> np.dtype:
    """The dtype host memory of `dtype` is held in: itself."""
    return np.dtype(dtype)


def empty(n: int, dtype) -> np.ndarray:
    return np.empty(n, dtype=dtype)


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src (same length)."""
    np.copyto(dst, src)


def gather(out: np.ndarray, blocks: list, bounds: list) -> None:
    """out[bounds[q]:bounds[q + 1]] = blocks[q][bounds[q]:bounds[q + 1]] for each q (flat arrays of
    out's length): a node allgather from its peers' slots."""
    for q, block in enumerate(blocks):
        np.copyto(out[bounds[q] : bounds[q + 1]], block[bounds[q] : bounds[q + 1]])


_HALF_OP = {"sum": 0, "max": 1, "min": 2}
_U16 = np.dtype(np.uint16)


def reduce(out: np.ndarray, low: np.ndarray, high: np.ndarray, op: str) -> None:
    """out = low op high, elementwise; out may alias either operand.

    Callers pass the operand from the lower rank(s) first, so every rank that combines the same two
    partial results gets the same bits even where op is not bitwise commutative (NaN payloads, +-0).
    float16 and bfloat16 go through gflow/arrays/half_kernels.py: NumPy's own float16 arithmetic
    (and ml_dtypes'
    bfloat16) is 20x slower than float32.
    """
    if out.dtype.char == "e":
        from .half_kernels import reduce_half

        reduce_half(out.view(_U16), low.view(_U16), high.view(_U16), _HALF_OP[op])
    elif is_bfloat16(out.dtype):
        from .half_kernels import reduce_bf16

        reduce_bf16(out.view(_U16), low.view(_U16), high.view(_U16), _HALF_OP[op])
    else:
        token = quiet()  # (inf + -inf is NaN without a warning: fp_errors.py)
        try:
            _UFUNC[op](low, high, out=out)
        finally:
            unquiet(token)


# Below this the fused loop's gain is smaller than loading Numba and its compiled loop into a fresh
# process (about 0.5 s here), which every short-lived rank (a test, a short script) would pay.
_FUSED_MIN_BYTES = 2**20


def reduce_many(out: np.ndarray, parts: list, op: str) -> None:
    """out = ((parts[0] op parts[1]) op parts[2]) ..., elementwise, in that order; out may alias any part.

    A sum of float32/64 or int32/64 from _FUSED_MIN_BYTES up is one fused pass (each part read
    once, out written once), where pairwise reductions would make len(parts) - 1 passes: the
    shared-memory node phase reduces a node's slots with it. Other ops, float16 and bfloat16 go
    pairwise, with the same association."""
    if len(parts) == 1:
        if out is not parts[0]:
            np.copyto(out, parts[0])
        return
    if (
        op == "sum"
        and out.nbytes >= _FUSED_MIN_BYTES
        and out.dtype.char != "e"
        and not is_bfloat16(out.dtype)
        and all(part.flags.writeable for part in parts)
    ):
        # (Numba types a read-only array apart from a writable one, and indexes only uniform tuples.)
        from .sum_kernels import fused_sum

        fused_sum(out, tuple(parts))
        return
    acc = np.empty_like(out) if len(parts) > 2 else out
    for q in range(1, len(parts)):
        reduce(out if q == len(parts) - 1 else acc, parts[0] if q == 1 else acc, parts[q], op)


def divide(x: np.ndarray, divisor: int) -> None:
    """x /= divisor in place (op='mean', floating dtypes only)."""
    if is_bfloat16(x.dtype):
        from .half_kernels import divide_bf16

        divide_bf16(x.view(_U16), np.float32(divisor))
        return
    np.divide(x, x.dtype.type(divisor), out=x)


def cast_scaled(dst: np.ndarray, src: np.ndarray, scale: float) -> bool:
    """dst = src * scale, cast to dst's dtype. Returns True if any value overflowed dst's range or
    was NaN/inf (those elements hold inf/NaN in dst)."""
    if dst.dtype.char == "e" and src.dtype.char in "fd":
        from .half_kernels import encode_half

        return bool(encode_half(dst.view(_U16), src, np.float32(scale)))
    if src.dtype.char == "e" and dst.dtype.char in "fd":
        from .half_kernels import decode_half

        return bool(decode_half(dst, src.view(_U16), np.float32(scale)))
    if is_bfloat16(dst.dtype) and src.dtype.char in "fd":
        from .half_kernels import encode_bf16

        return bool(encode_bf16(dst.view(_U16), src, np.float32(scale)))
    if is_bfloat16(src.dtype) and dst.dtype.char in "fd":
        from .half_kernels import decode_bf16

        return bool(decode_bf16(dst, src.view(_U16), np.float32(scale)))
    if is_bfloat16(src.dtype) and is_bfloat16(dst.dtype):
        # LossScaler.unscale: through float32, one rounding, as the device's rescale_bf16; only a
        # result stored as inf or NaN counts (a product that rounds down to bfloat16's max does not)
        from .half_kernels import decode_bf16, encode_bf16

        wide = np.empty(src.shape, np.float32)
        bad_in = decode_bf16(wide, src.view(_U16), np.float32(scale))
        bad_out = encode_bf16(dst.view(_U16), wide, np.float32(1.0))
        return bool(bad_in or bad_out)
    limit = finfo(dst.dtype).max  # (a NumPy scalar: a Python float would compare in src's precision)
    with np.errstate(over="ignore", invalid="ignore"):  # (reported in the result: fp_errors.py)
        scaled = np.multiply(src, np.float32(scale), dtype=np.result_type(src.dtype, np.float32))
        overflow = not bool(np.all(np.abs(scaled) <= limit))
        dst[...] = scaled
    return overflow


def chunk_norms(x: np.ndarray, chunk: int, out=None) -> np.ndarray:
    """float32 L1 norm of each chunk of the flat x (the last chunk may be short)."""
    nchunks = (x.size + chunk - 1) // chunk
    if out is None:
        out = np.empty(nchunks, dtype=np.float32)
    if nchunks:
        np.add.reduceat(np.abs(x, dtype=np.float32), np.arange(0, x.size, chunk), out=out)
    return out


def _chunk_rows(a: np.ndarray, chunk: int):
    """a's full chunks as rows of a 2-D view, and the short tail (may be empty)."""
    full = a.size // chunk
    return a[: full * chunk].reshape(full, chunk), a[full * chunk :]


def pack(dst: np.ndarray, src: np.ndarray, ids: np.ndarray, chunk: int) -> None:
    """Gather chunks ids (ascending) of src into dst, one after another."""
    rows, tail = _chunk_rows(src, chunk)
    if ids.size and ids[-1] == rows.shape[0]:  # the short last chunk, selected: it goes last
        dst[: (ids.size - 1) * chunk].reshape(-1, chunk)[...] = rows[ids[:-1]]
        dst[(ids.size - 1) * chunk :] = tail
    else:
        dst.reshape(-1, chunk)[...] = rows[ids]


def scatter_add(dst: np.ndarray, packed: np.ndarray, ids: np.ndarray, chunk: int) -> None:
    """Add the packed chunks back into dst at chunks ids (unique, ascending)."""
    rows, tail = _chunk_rows(dst, chunk)
    if ids.size and ids[-1] == rows.shape[0]:
        rows[ids[:-1]] += packed[: (ids.size - 1) * chunk].reshape(-1, chunk)
        tail += packed[(ids.size - 1) * chunk :]
    else:
        rows[ids] += packed.reshape(-1, chunk)


def accumulate(u_out, v_out, u, v, g, momentum: float) -> None:
    """u_out = momentum * u + g; v_out = v + u_out (residual accumulation with momentum correction).
    Outputs may be the inputs. With momentum 0, u and u_out are not used (they may be empty)."""
    if momentum:
        np.multiply(u, u.dtype.type(momentum), out=u_out)
        np.add(u_out, g, out=u_out)
        np.add(v, u_out, out=v_out)
    else:
        np.add(v, g, out=v_out)


def zero_chunks(x: np.ndarray, ids: np.ndarray, chunk: int) -> None:
    """Set the listed chunks of x to zero."""
    rows, tail = _chunk_rows(x, chunk)
    if ids.size and ids[-1] == rows.shape[0]:
        rows[ids[:-1]] = 0
        tail[...] = 0
    else:
        rows[ids] = 0


def clear(x: np.ndarray) -> None:
    x.fill(0)


def shaped(x: np.ndarray, shape) -> np.ndarray:
    """x seen with `shape` (for state a caller inspects)."""
    return x.reshape(shape)


def zeros(n: int, dtype) -> np.ndarray:
    return np.zeros(n, dtype=dtype)


def neutral_value(dtype, op: str):
    """The value that leaves any operand as it is under op (sum and mean: 0, for floats -0.0, which
    leaves a -0.0 as it is too; min: the type's largest; max: its smallest): what a rank in join()
    contributes, so that its absence never enters a min or max as a 0 (Horovod's zeros are this for
    its sums and means)."""
    dtype = np.dtype(dtype)
    if op not in ("min", "max"):
        return dtype.type(0) if dtype.kind in "biu" else dtype.type(-0.0)
    largest = op == "min"
    if dtype.kind == "b":
        return np.bool_(largest)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return dtype.type(info.max if largest else info.min)
    return dtype.type(np.inf if largest else -np.inf)  # (floats, bfloat16 included)


def neutral(n: int, dtype, op: str) -> np.ndarray:
    """n elements of neutral_value(dtype, op)."""
    return np.full(n, neutral_value(dtype, op), dtype=dtype)


def index_array(ids: np.ndarray) -> np.ndarray:
    return ids


def to_numpy(x: np.ndarray) -> np.ndarray:
    return x


def accumulate_norms(u_out, v_out, u, v, g, momentum: float, chunk: int) -> np.ndarray:
    """accumulate() then chunk_norms() of v_out, fused into one pass over memory
    (gflow/arrays/csc_kernels.py)."""
    from .csc_kernels import accumulate_norms as fused

    norms = np.empty((v.size + chunk - 1) // chunk, dtype=np.float32)
    fused(u_out, v_out, u, v, g, v.dtype.type(momentum), chunk, norms)
    return norms
