"""One adapter over the kinds of array gflow accepts.

check_array() checks that an argument is an array gflow can communicate and returns the ops module for
its kind (gflow/host.py for NumPy). Everything below the public functions works on flat views and
calls that module for per-element work, so it never asks what kind of array it holds.
These checks run on every call, so the common case is kept to a few attribute lookups.
"""

import numpy as np

from . import host
from ._validate import check_dtype


def is_device(x) -> bool:
    """Whether x is a device array: it exposes __cuda_array_interface__, or it is one of the CUDA
    simulator's arrays (NUMBA_ENABLE_CUDASIM=1), which do not."""
    return hasattr(x, "__cuda_array_interface__") or type(x).__name__ == "FakeCUDAArray"


def ops_for(x):
    """The per-element ops for x's kind of array (gflow/host.py or gflow/cuda/ops.py)."""
    if isinstance(x, np.ndarray):
        return host
    if is_device(x):
        from .cuda import ops

        return ops
    raise TypeError(
        f"expected a NumPy array or an object with __cuda_array_interface__, got {type(x).__name__}"
    )


def plain(x):
    """x as a plain np.ndarray view when it is an ndarray subclass (np.memmap, np.matrix, a user's
    subclass), so that reshape and slicing behave as on any array; anything else unchanged."""
    if type(x) is np.ndarray or not isinstance(x, np.ndarray):
        return x
    return x.view(np.ndarray)


def check_array(x, name: str = "x"):
    """Validate an input array; return (ops, dtype). Device arrays must be C-contiguous."""
    if type(x) is np.ndarray:
        return host, check_dtype(x.dtype)
    try:
        ops = ops_for(x)
    except TypeError as exc:
        raise TypeError(f"{name}: {exc}") from None
    if ops is host:
        return ops, check_dtype(x.dtype)
    from .cuda import arrays

    shape, dtype, contiguous = arrays.describe(x, name)
    check_dtype(dtype)
    if not contiguous:
        raise ValueError(
            f"{name}: device arrays must be C-contiguous; got one of shape {shape} with other strides"
        )
    return ops, dtype


def size_of(x) -> int:
    if isinstance(x, np.ndarray):
        return x.size
    from .cuda import arrays

    return int(np.prod(arrays.describe(x)[0], dtype=np.int64))


def check_writable(x, name: str) -> None:
    """Results are written into x: refuse a read-only array before any data moves."""
    if isinstance(x, np.ndarray):
        writable = x.flags.writeable
    else:
        from .cuda import arrays

        writable = arrays.writable(x)
    if not writable:
        raise ValueError(f"{name} is read-only; the result is written into it: pass a writable array")


def flat_view(x, name: str = "x"):
    """A 1-D view of x without copying; a clear error when x is not contiguous."""
    if not x.flags.c_contiguous:
        raise ValueError(
            f"{name} must be C-contiguous to be written in place; got an array with strides {x.strides}"
        )
    return plain(x).reshape(-1)


def prepare_out(x, out, ops, dtype, count: int, name: str = "out"):
    """Return the array the result goes into (new, or out after checking it)."""
    if ops is not host:
        from .cuda import arrays

        return arrays.prepare_out(x, out, dtype, count, name)
    if out is None:
        return np.empty(x.shape, dtype=dtype)
    if out is x:
        flat_view(out, name)
        check_writable(out, name)
        return out
    if not isinstance(out, np.ndarray):
        raise TypeError(
            f"{name} must be the same kind of array as x (a NumPy array), got {type(out).__name__}"
        )
    if out.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {out.dtype}")
    if out.size != count:
        raise ValueError(f"{name}: expected {count} elements, got {out.size}")
    flat_view(out, name)
    check_writable(out, name)
    return out
