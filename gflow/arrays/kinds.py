"""One adapter per kind of array: the collectives are written once over it and never ask what they hold.

`check_array(x)` validates an argument and returns (kind, dtype). A kind knows how to view an array of
its own flat (to read, or to read and write back), make a result of the same kind, check an `out=`,
run a background collective as if in the caller's thread, and hand buffers to MPI through its
transport: host memory directly; device memory directly (a CUDA-aware MPI) or staged through pinned
host memory. The kinds:

- HOST: NumPy arrays (ndarray subclasses are read as plain arrays; results are plain arrays);
- device arrays: anything with __cuda_array_interface__ (CuPy, Numba, ...), gflow/cuda/arrays.py;
- PyTorch tensors, gflow/arrays/torch_tensors.py: a CPU tensor is handled through a zero-copy NumPy view
  and its results are tensors; a CUDA tensor goes through __cuda_array_interface__. torch is never
  imported here: a tensor can only exist once its user has imported torch.

These checks run on every call, so the common case (a NumPy array) is kept to a few lookups.
"""

import sys

import numpy as np

from ..runtime.signature import check_dtype
from . import host_ops
from .numpy_arrays import HOST, is_device, raise_read_only


def kind_of(x, name: str = "x"):
    """The kind of x (see the module docstring); a TypeError naming what was got otherwise."""
    if isinstance(x, np.ndarray):
        return HOST
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        from .torch_tensors import tensor_kind

        return tensor_kind(x, name)
    if is_device(x):
        from ..cuda.arrays import DEVICE

        return DEVICE
    got = type(x).__name__
    if isinstance(x, np.generic):
        got = f"the NumPy scalar {got} (pass np.array(value))"
    raise TypeError(
        f"{name}: expected a NumPy array, a torch tensor or an object with __cuda_array_interface__, "
        f"got {got}"
    )


def check_array(x, name: str = "x"):
    """Validate an input array; return (kind, dtype)."""
    if type(x) is np.ndarray:
        return HOST, check_dtype(x.dtype)
    kind = kind_of(x, name)
    return kind, kind.check(x, name)


def check_writable(x, name: str, kind=None) -> None:
    """Results are written into x: refuse a read-only array before any data moves."""
    if not (kind or kind_of(x, name)).writable(x):
        raise_read_only(name)


def to_host(x, ops):
    """A host copy of a state array (None stays None)."""
    if x is None:
        return None
    return np.array(ops.to_numpy(x), copy=True)


def ops_for_memory(memory: str):
    """The ops module of the memory ("host" or "device") state arrays were saved from."""
    if memory == "host":
        return host_ops
    if memory == "device":
        from ..cuda import ops

        return ops
    raise ValueError(f"unknown memory {memory!r} in the state dict (expected 'host' or 'device')")


def from_host(a: np.ndarray, ops):
    """A new array in ops' memory holding a copy of the host array a (flat)."""
    a = np.ascontiguousarray(a).reshape(-1)
    if ops.memory == "host":
        return a.copy()
    from ..cuda import memory

    x = ops.empty(a.size, a.dtype)
    memory.from_host(x, a)
    return x
