"""One adapter over the kinds of array gflow accepts.

check_array() checks that an argument is an array gflow can communicate and returns the ops module for
its kind (gflow/host.py for NumPy). Everything below the public functions works on flat views and
calls that module for per-element work, so it never asks what kind of array it holds.
These checks run on every call, so the common case is kept to a few attribute lookups.
"""

import numpy as np

from . import host
from ._validate import check_dtype


def ops_for(x):
    """The per-element ops for x's kind of array."""
    if isinstance(x, np.ndarray):
        return host
    if hasattr(x, "__cuda_array_interface__"):
        raise TypeError(
            "device arrays (__cuda_array_interface__) are not supported by this build of gflow yet; "
            "pass a NumPy array"
        )
    raise TypeError(
        f"expected a NumPy array or an object with __cuda_array_interface__, got {type(x).__name__}"
    )


def check_array(x, name: str = "x"):
    """Validate an input array; return (ops, dtype)."""
    if type(x) is np.ndarray:
        ops = host
    else:
        try:
            ops = ops_for(x)
        except TypeError as exc:
            raise TypeError(f"{name}: {exc}") from None
    return ops, check_dtype(x.dtype)


def flat_view(x, name: str = "x"):
    """A 1-D view of x without copying; a clear error when x is not contiguous."""
    if not x.flags.c_contiguous:
        raise ValueError(
            f"{name} must be C-contiguous to be written in place; got an array with strides {x.strides}"
        )
    return x.reshape(-1)


def prepare_out(x, out, ops, dtype, count: int, name: str = "out"):
    """Return the array the result goes into (new, or out after checking it)."""
    if out is None:
        return np.empty(x.shape, dtype=dtype)
    if out is x:
        flat_view(out, name)
        return out
    if (host if type(out) is np.ndarray else ops_for(out)) is not ops:
        raise TypeError(f"{name} must be the same kind of array as x")
    if out.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {out.dtype}")
    if out.size != count:
        raise ValueError(f"{name}: expected {count} elements, got {out.size}")
    flat_view(out, name)
    return out
