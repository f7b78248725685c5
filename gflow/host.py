"""Per-element operations on host (NumPy) arrays.

The CUDA twins live in gflow/cuda/kernels.py with the same names and meaning; gflow/_array.py picks
one set per array, so the collectives are written once and never ask what kind of array they hold.
"""

import numpy as np

kind = "host"

_UFUNC = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def empty(n: int, dtype) -> np.ndarray:
    return np.empty(n, dtype=dtype)


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src (same length)."""
    np.copyto(dst, src)


def reduce(out: np.ndarray, low: np.ndarray, high: np.ndarray, op: str) -> None:
    """out = low op high, elementwise; out may alias either operand.

    Callers pass the operand from the lower rank(s) first, so every rank that combines the same two
    partial results gets the same bits even where op is not bitwise commutative (NaN payloads, +-0).
    """
    _UFUNC[op](low, high, out=out)


def divide(x: np.ndarray, divisor: int) -> None:
    """x /= divisor in place (op='mean', floating dtypes only)."""
    np.divide(x, x.dtype.type(divisor), out=x)
