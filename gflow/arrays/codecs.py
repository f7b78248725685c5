"""Mixed-precision communication: float32/float64 values travel as float16 ("fp16") or bfloat16
("bf16") and come back in their dtype.

A stateless codec, as Horovod's: only the 2-byte payload goes on the wire, and each ring step reduces it
in float32 and rounds once. For op="mean" each rank divides by the world size *before* casting (PyTorch
DDP's fp16 hook), so the sum is already the mean and cannot overflow where the mean would not. fp16
keeps 11 significant bits but overflows above 65504, so training needs loss scaling (gflow.LossScaler);
bf16 has float32's range (no overflow below its largest value, 3.39e38, so no scaler) and 8 significant
bits. Values beyond the wire's range are never silently turned into inf: an overflow or a NaN that
reaches the reduced result makes it non-finite on every rank alike, and every rank raises
CompressionOverflowError (a value a max or min leaves out of the result changes nothing). Conversions
compute in float32, as on the GPU: a float64 value is rounded to float32 first, so one closer to a
halfway point between two 2-byte values than float32's precision (about 2**-24 of its magnitude) can
land one unit in the last place from a direct rounding.
"""

import numpy as np

from ..runtime import timeline
from ..runtime.signature import bfloat16, holds, is_bfloat16, is_floating

COMPRESSIONS = (None, "fp16", "bf16")
WIRE_DTYPE = np.dtype(np.float16)
_RANGE = {"fp16": "+-65504", "bf16": "+-3.39e38"}


def wire_dtype(codec: str) -> np.dtype:
    return WIRE_DTYPE if codec == "fp16" else bfloat16()


def check_compression(compression, dtype: np.dtype):
    """Return the canonical compression (None, "fp16" or "bf16"), or raise for unknown names, for
    non-floats and for a 16-bit input sent as the other 16-bit type (it would lose range or digits)."""
    if compression is None or compression == "none":
        return None
    if compression.__class__ is not str or compression not in _RANGE:
        raise ValueError(f"compression: expected None, 'fp16' or 'bf16', got {compression!r}")
    if not is_floating(dtype):
        raise TypeError(f"compression={compression!r} needs a floating dtype, got {dtype}")
    if is_bfloat16(dtype) if compression == "fp16" else dtype == np.float16:
        raise TypeError(
            f"compression={compression!r} on a {dtype} input: {dtype} is already 2 bytes on the wire, and "
            f"as {wire_dtype(compression)} it would lose {'range' if compression == 'fp16' else 'digits'}; "
            f"pass compression=None (or {'bf16' if compression == 'fp16' else 'fp16'!r})"
        )
    return compression


def overflow_message(who: str, codec: str) -> str:
    """What CompressionOverflowError says: why the reduced 2-byte result is not finite."""
    remedy = "scale the values down (gflow.LossScaler) or " if codec == "fp16" else ""
    return (
        f"{who} with compression={codec!r}: the {wire_dtype(codec)} result holds inf or NaN (a value or a "
        f"sum beyond {_RANGE[codec]}, or a NaN/inf input on some rank); {remedy}use compression=None"
    )


def encode(ops, wire, src, op: str, size: int, scale: float = 1.0) -> None:
    """Cast src (times scale) into the 2-byte wire buffer, dividing by size first for a mean."""
    with timeline.span(f"{_name(wire)} encode", elements=wire.size):
        ops.cast_scaled(wire, src, scale / size if op == "mean" else scale)


def decode(ops, dst, wire) -> bool:
    """Cast the reduced wire buffer back into dst; True if any value is NaN or inf."""
    with timeline.span(f"{_name(wire)} decode", elements=wire.size):
        return ops.cast_scaled(dst, wire, 1.0)


def _name(wire) -> str:
    return "bf16" if is_bfloat16(holds(wire.dtype)) else "fp16"
