"""The public operations' argument checks, shared by the general path (operations.py) and the
latency path's fast lane (latency.py)."""

import struct
import zlib

from ..arrays.codecs import COMPRESSIONS, check_compression
from ..arrays.kinds import check_array, kind_of
from ..runtime.signature import check_op, dtype_code
from .dispatch import choose


def check_allreduce(x, op, out, algorithm, compression, *, ranks: int, need_out: bool = True, holds=None):
    """allreduce's local checks on a communicator of `ranks`: (kind, dtype, op name, algorithm,
    compression, result array).
    `holds`: for gflow's own flat buffers (the compressed wire, LazyAllreduce's segments), the dtype
    they hold, which on the device may differ from the array's own (bfloat16 as uint16 bits)."""
    if holds is None:
        kind, dtype = check_array(x)
    else:
        kind, dtype = kind_of(x), holds
    name = check_op(op, dtype)
    codec = check_compression(compression, dtype) if compression is not None else None
    count = kind.size(x)
    nbytes = count * (2 if codec else dtype.itemsize)
    chosen = choose(algorithm, nbytes, ranks)
    result = kind.prepare_out(x, out, dtype, count) if (need_out or out is not None) else None
    return kind, dtype, name, chosen, codec, result


FINGERPRINT_BITS = 31  # broadcast keeps the root in the low 32 bits of the same int64 field


def shape_fingerprint(shape, dtype=None, codec=None) -> int:
    """What the ranks of a user's allreduce, broadcast or allgather agree on besides the element
    count: a checksum of the shape (allgather: of the axes after the first), so that (2, 3) against
    (3, 2) fails as Horovod's shape check does instead of reducing or reshaping. 0 for (). With
    compression, also the input's dtype and the codec: the ranks compare the wire buffer, the same
    for float32 and float64 sent as bf16, or for a bfloat16 array sent as it is."""
    fields = (*shape, dtype_code(dtype), COMPRESSIONS.index(codec)) if codec else tuple(shape)
    if not len(fields):
        return 0
    return zlib.crc32(struct.pack(f"<{len(fields)}q", *fields)) & ((1 << FINGERPRINT_BITS) - 1)
