"""NumPy arrays, the HOST kind (the kinds are described in kinds.py), and Direct: the transport of
memory MPI reads as it is (host memory; device memory with a CUDA-aware MPI)."""

import numpy as np

from ..runtime.signature import check_dtype
from . import host_ops as host


def is_device(x) -> bool:
    """Whether x is a device array: it exposes __cuda_array_interface__, or it is one of the CUDA
    simulator's arrays (NUMBA_ENABLE_CUDASIM=1), which do not."""
    return hasattr(x, "__cuda_array_interface__") or type(x).__name__ == "FakeCUDAArray"


def plain(x):
    """x as a plain np.ndarray view when it is an ndarray subclass (np.memmap, np.matrix, a user's
    subclass), so that reshape and slicing behave as on any array; anything else unchanged."""
    if type(x) is np.ndarray or not isinstance(x, np.ndarray):
        return x
    return x.view(np.ndarray)


def raise_read_only(name: str):
    raise ValueError(f"{name} is read-only; the result is written into it: pass a writable array")


class Direct:
    """The transport of memory MPI reads as it is: a buffer stands for itself."""

    name = "direct"

    def __init__(self, ops, latency_path=None):
        self.ops = ops  # the per-element ops on the buffers handed to MPI
        # The latency path's transport: this one, or for device memory one through the host (the latency
        # path reads its header on the host, and a small message costs less copied than in a ring).
        self.latency_path = latency_path or self

    def buffer_for(self, ctx, name: str, view):
        """A buffer MPI can use in place of the flat `view`: the view itself."""
        return view

    def load(self, buffer, view) -> None:
        """Make `buffer` hold `view`'s values."""
        if buffer is not view:
            self.ops.copy(buffer, view)

    def store(self, view, buffer) -> None:
        """Write `buffer`'s values into `view`."""
        if buffer is not view:
            self.ops.copy(view, buffer)

    def send(self, ctx, view, name: str = "stage_in"):
        """`view`'s values in a buffer MPI can read (a staging transport's scratch buffer `name`)."""
        return view

    def result(self, kind, x, flat, shape, dtype):
        """A result of x's kind holding the flat buffer's values (made by a collective)."""
        return kind.adopt(x, flat, shape, dtype)


class HostArrays:
    """NumPy arrays: any layout is read (copied when not contiguous); results are plain ndarrays."""

    memory = "host"  # what the ranks agree on in their signatures
    ops = host
    _transport = Direct(host)

    def check(self, x, name: str):
        return check_dtype(x.dtype)

    def shape(self, x) -> tuple:
        return x.shape

    def size(self, x) -> int:
        return x.size

    def read(self, x, name: str = "x", spare=None):
        """x's values as a flat contiguous array: x itself when contiguous, else a copy (into the
        flat `spare` when given, which the caller may then overwrite)."""
        x = plain(x)
        if x.flags.c_contiguous:
            return x.reshape(-1)
        if spare is None:
            return np.ascontiguousarray(x).reshape(-1)
        np.copyto(spare.reshape(x.shape), x)
        return spare

    def write_view(self, x, name: str = "x"):
        """A flat view of x that writes into x; a clear error when x is not contiguous."""
        if not x.flags.c_contiguous:
            raise ValueError(
                f"{name} must be C-contiguous to be written in place; got an array with strides {x.strides}"
            )
        return plain(x).reshape(-1)

    def inout_view(self, x, name: str = "x"):
        """A flat view gflow reads now and writes results into later (LazyAllreduce's pushes)."""
        return self.write_view(x, name)

    def write_back(self, x, flat) -> None:
        """After working on read(x)'s flat array in place: make x hold its values."""
        x = plain(x)
        if not x.flags.c_contiguous:
            x[...] = flat.reshape(x.shape)

    def writable(self, x) -> bool:
        return bool(x.flags.writeable)

    def new(self, x, shape, dtype):
        return np.empty(shape, dtype=dtype)

    def adopt(self, x, flat, shape, dtype):
        return flat.reshape(shape)

    def shaped(self, flat, shape):
        """A flat array of this kind's memory, seen with `shape` (for state a caller inspects)."""
        return flat.reshape(shape)

    def prepare_out(self, x, out, dtype, count: int, name: str = "out"):
        """The array the result goes into: a new one, or `out` after checking it."""
        if out is None:
            return np.empty(x.shape, dtype=dtype)
        if out is x:
            self.write_view(out, name)
            if not out.flags.writeable:
                raise_read_only(name)
            return out
        if not isinstance(out, np.ndarray):
            raise TypeError(
                f"{name} must be the same kind of array as x (a NumPy array), got {type(out).__name__}"
            )
        if out.dtype != dtype:
            raise TypeError(f"{name}: expected dtype {dtype}, got {out.dtype}")
        if out.size != count:
            raise ValueError(f"{name}: expected {count} elements, got {out.size}")
        self.write_view(out, name)
        if not out.flags.writeable:
            raise_read_only(name)
        if np.may_share_memory(out, x) and not _same_memory(out, x):
            raise ValueError(
                f"{name} overlaps x in part: pass out=x (or an array over exactly x's memory) to "
                "write the result over x, or a separate array"
            )
        return out

    def transport(self):
        return self._transport

    def in_background(self, fn, *arrays):
        """fn, to run on gflow's background thread as it would in the caller's: nothing to carry."""
        return fn

    def done(self, result):
        """The result as the caller gets it, once nothing of gflow's is pending on it."""
        return result

    def written(self, x) -> None:
        """gflow wrote into x behind its library's back (through a view): tell the library. Nothing
        to tell NumPy."""


HOST = HostArrays()


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether a and b are the same bytes (views of one buffer, start and length alike)."""
    return (
        a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
        and a.nbytes == b.nbytes
        and a.flags.c_contiguous
        and b.flags.c_contiguous
    )
