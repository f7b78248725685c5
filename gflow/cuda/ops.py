"""Per-element operations on device arrays: the CUDA twins of gflow/arrays/host_ops.py (same names,
same meaning).

Arguments are Numba device arrays (gflow/cuda/arrays.py turns CuPy arrays and other
__cuda_array_interface__ objects into zero-copy Numba views). bfloat16 lives on the device as uint16
bits (Numba has no bfloat16 arrays; gflow reduces no uint16 otherwise), so a uint16 array here is
bfloat16 and takes the *_bf16 kernels. Kernels run on the default stream;
functions whose result the host needs (an overflow flag) synchronize before returning.
"""

import threading

import numpy as np
from numba import cuda

from ..runtime.signature import is_bfloat16
from . import kernels
from .memory import SIMULATED, mpi_buffer

memory = "device"
buffer = mpi_buffer

_THREADS = 256
_MAX_BLOCKS = 4096
_REDUCE = {"sum": kernels.add, "max": kernels.maximum, "min": kernels.minimum}
_BF16_OP = {"sum": 0, "max": 1, "min": 2}
_BITS = np.dtype(np.uint16)
_HALF = np.dtype(np.float16)
_local = threading.local()  # per thread: the engine's background thread casts too


def storage(dtype) -> np.dtype:
    """The dtype device memory of `dtype` is held in: bfloat16 as its uint16 bits."""
    dtype = np.dtype(dtype)
    return _BITS if is_bfloat16(dtype) else dtype


def _grid(n: int) -> tuple[int, int]:
    if SIMULATED:  # every simulated thread is a Python thread: keep launches small
        return 1, 32
    return max(1, min(_MAX_BLOCKS, (n + _THREADS - 1) // _THREADS)), _THREADS


def fence() -> None:
    """Wait for the kernels launched so far (default stream) before MPI reads their output."""
    cuda.synchronize()


def empty(n: int, dtype):
    return cuda.device_array(n, dtype=storage(dtype))


def copy(dst, src) -> None:
    """dst[...] = src (flat, same length)."""
    if dst.size:
        blocks, threads = _grid(dst.size)
        kernels.copy[blocks, threads](dst, src)


def reduce(out, low, high, op: str) -> None:
    """out = low op high, elementwise; out may alias either operand. Lower ranks' operand first."""
    if out.size:
        blocks, threads = _grid(out.size)
        if out.dtype == _BITS:
            kernels.reduce_bf16[blocks, threads](out, low, high, _BF16_OP[op])
        else:
            _REDUCE[op][blocks, threads](out, low, high)


def reduce_many(out, parts: list, op: str) -> None:
    """out = ((parts[0] op parts[1]) op parts[2]) ..., elementwise, in that order; out may alias any
    part. One launch over all parts (kernels.reduce_parts), with the association and the roundings
    of the host twin (host_ops.reduce_many), so the bits match: the node phase reduces its peers'
    slots with it."""
    if len(parts) == 1:
        copy(out, parts[0])
        return
    if not out.size:
        return
    if not _one_type(parts):  # (a kernel takes a tuple of arrays of one Numba type only)
        _reduce_pairwise(out, parts, op)
        return
    blocks, threads = _grid(out.size)
    if out.dtype == _BITS:
        kernels.reduce_parts_bf16[blocks, threads](out, tuple(parts), _BF16_OP[op])
    else:
        kernels.reduce_parts[blocks, threads](out, tuple(parts), _BF16_OP[op])


def gather(out, blocks: list, bounds: list) -> None:
    """out[bounds[q]:bounds[q + 1]] = blocks[q][bounds[q]:bounds[q + 1]] for each q (flat arrays of
    out's length), in one launch: a node allgather from its peers' slots."""
    if not out.size:
        return
    if not _one_type(blocks):
        for q, block in enumerate(blocks):
            copy(out[bounds[q] : bounds[q + 1]], block[bounds[q] : bounds[q + 1]])
        return
    grid, threads = _grid(out.size)
    kernels.gather_blocks[grid, threads](out, tuple(blocks), tuple(int(b) for b in bounds))


def _one_type(arrays: list) -> bool:
    """Whether the flat arrays would type alike in a kernel: one dtype, all contiguous."""
    first = arrays[0].dtype
    return all(a.dtype == first and a.is_c_contiguous() for a in arrays)


def _reduce_pairwise(out, parts: list, op: str) -> None:
    acc = _scratch(out.size, out.dtype) if len(parts) > 2 else out
    for q in range(1, len(parts)):
        reduce(out if q == len(parts) - 1 else acc, parts[0] if q == 1 else acc, parts[q], op)


def _scratch(n: int, dtype):
    """n elements of dtype of this thread's accumulator for _reduce_pairwise, kept between calls and
    grown when too small (a device allocation per node phase costs more than its kernels)."""
    held = getattr(_local, "scratch", {})
    _local.scratch = held
    buffer = held.get(dtype)
    if buffer is None or buffer.size < n:
        buffer = held[dtype] = cuda.device_array(n, dtype)
    return buffer[:n]


def divide(x, divisor: int) -> None:
    if x.size:
        blocks, threads = _grid(x.size)
        if x.dtype == _BITS:
            kernels.divide_bf16[blocks, threads](x, np.float32(divisor))
        else:
            kernels.divide[blocks, threads](x, x.dtype.type(divisor))


def _flag():
    """This thread's overflow flag, zeroed: host-mapped memory, reused (a fresh device array and
    copies to and from it cost more than the kernel at a few MB). Read it after a synchronize."""
    flag = getattr(_local, "flag", None)
    if flag is None:
        flag = _local.flag = cuda.mapped_array(1, np.int32)
    flag[0] = 0
    return flag


def cast_scaled(dst, src, scale: float) -> bool:
    """dst = src * scale, cast to dst's dtype. Returns True if any value overflowed dst's range or
    was NaN/inf (those elements hold inf/NaN in dst). Synchronizes (the host reads the flag)."""
    if not dst.size:
        return False
    flag = _flag()
    blocks, threads = _grid(dst.size)
    scale32 = np.float32(scale)
    if dst.dtype == _BITS and src.dtype != _BITS:
        kernels.encode_bf16[blocks, threads](dst, src, scale32, flag)
    elif src.dtype == _BITS and dst.dtype != _BITS:
        kernels.decode_bf16[blocks, threads](dst, src, scale32, flag)
    elif dst.dtype == _BITS:  # bfloat16 to bfloat16 (LossScaler.unscale): through float32, one pass
        kernels.rescale_bf16[blocks, threads](dst, src, scale32, flag)
    elif dst.dtype == _HALF and src.dtype != _HALF:
        kernels.encode_f16[blocks, threads](dst, src, scale32, flag)
    elif src.dtype == _HALF and dst.dtype != _HALF:
        kernels.decode_f16[blocks, threads](dst, src, scale32, flag)
    else:
        # The product's dtype, as on the host (src * float32); dst's finite max is exact in it.
        wide = np.result_type(src.dtype, np.float32)
        limit = wide.type(min(float(np.finfo(dst.dtype).max), float(np.finfo(wide).max)))
        kernels.cast_scaled[blocks, threads](dst, src, scale32, limit, flag)
    cuda.synchronize()
    return bool(flag[0])


def chunk_norms(x, chunk: int, out=None):
    """float32 L1 norm of each chunk of the flat x (the last chunk may be short)."""
    nchunks = (x.size + chunk - 1) // chunk
    if out is None:
        out = cuda.device_array(nchunks, dtype=np.float32)
    if nchunks:
        blocks = 1 if SIMULATED else min(nchunks, 65535)
        threads = 32 if SIMULATED else kernels.NORM_THREADS
        kernels.chunk_norms[blocks, threads](out, x, chunk)
    return out


def _chunk_grid(nids: int, chunk: int):
    """Blocks and (x, y) threads for the chunk kernels: x along a chunk, y over chunks, so a block
    stays busy with short chunks too and no thread divides by chunk."""
    if SIMULATED:  # 32 threads, as _grid; short chunks still get several chunks per block
        tx = 8 if chunk <= 8 else 32
        return 1, (tx, 32 // tx)
    tx = min(_THREADS, (chunk + 31) // 32 * 32)
    ty = _THREADS // tx
    return max(1, min(_MAX_BLOCKS, (nids + ty - 1) // ty)), (tx, ty)


def pack(dst, src, ids, chunk: int) -> None:
    """Gather chunks ids (ascending, device int64 array) of src into dst, one after another."""
    if dst.size and ids.size:
        blocks, threads = _chunk_grid(ids.size, chunk)
        kernels.pack[blocks, threads](dst, src, ids, chunk)


def scatter_add(dst, packed, ids, chunk: int) -> None:
    """Add the packed chunks back into dst at chunks ids (unique, ascending)."""
    if packed.size and ids.size:
        blocks, threads = _chunk_grid(ids.size, chunk)
        kernels.scatter_add[blocks, threads](dst, packed, ids, chunk)


def accumulate(u_out, v_out, u, v, g, momentum: float) -> None:
    """u_out = momentum * u + g; v_out = v + u_out (outputs may be the inputs; u unused at momentum 0)."""
    if v.size:
        blocks, threads = _grid(v.size)
        kernels.accumulate[blocks, threads](u_out, v_out, u, v, g, v.dtype.type(momentum))


def zero_chunks(x, ids, chunk: int) -> None:
    """Set the listed chunks of x to zero (ids: device int64 array)."""
    if ids.size and x.size:
        blocks, threads = _chunk_grid(ids.size, chunk)
        kernels.zero_chunks[blocks, threads](x, ids, chunk)


def clear(x) -> None:
    """x[...] = 0 (flat)."""
    if x.size:
        blocks, threads = _grid(x.size)
        kernels.fill[blocks, threads](x, x.dtype.type(0))


def shaped(x, shape):
    """State a caller inspects stays flat on the device (a zero-copy Numba view)."""
    return x


def zeros(n: int, dtype):
    x = cuda.device_array(n, dtype=storage(dtype))
    clear(x)
    return x


def neutral(n: int, dtype, op: str):
    """n elements of host_ops.neutral_value(dtype, op) (a rank in join()'s operand), in storage(dtype)."""
    from ..arrays.host_ops import neutral_value

    x = cuda.device_array(n, dtype=storage(dtype))
    if n:
        value = np.array(neutral_value(dtype, op), dtype=dtype).view(x.dtype)[()]
        blocks, threads = _grid(n)
        kernels.fill[blocks, threads](x, value)
    return x


def index_array(ids: np.ndarray):
    """Chunk indices chosen on the host, where the kernels read them."""
    return cuda.to_device(ids)


def to_numpy(x) -> np.ndarray:
    """A small device array (chunk norms) as a host array."""
    return x.copy_to_host()


def accumulate_norms(u_out, v_out, u, v, g, momentum: float, chunk: int):
    """accumulate() then chunk_norms() of v_out (two kernels on the device, where each is one pass)."""
    accumulate(u_out, v_out, u, v, g, momentum)
    return chunk_norms(v_out, chunk)
