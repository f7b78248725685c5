"""What gflow asks of each kind of array, its per-element ops and its transport, written down.

The collectives are written once over these three protocols and never ask what they hold. The
implementations: kinds HOST (numpy_arrays.py), TorchCPU/TorchCUDA (torch_tensors.py) and DEVICE
(cuda/arrays.py); ops host_ops.py and cuda/ops.py (modules: the same names, the same meaning);
transports Direct (numpy_arrays.py) and Staged (cuda/arrays.py). tests/test_layers.py checks that
each implementation has every member.
"""

from typing import Protocol, runtime_checkable


@runtime_checkable
class ArrayOps(Protocol):
    """Per-element work on flat contiguous buffers in one memory (host or device)."""

    memory: str  # "host" or "device"

    def storage(self, dtype): ...  # the dtype that holds `dtype` there (bfloat16: its uint16 bits on a GPU)
    def empty(self, n: int, dtype): ...
    def zeros(self, n: int, dtype): ...
    def neutral(self, n: int, dtype, op: str): ...  # n values that leave an operand as it is under op
    def copy(self, dst, src) -> None: ...
    def reduce(self, out, low, high, op: str) -> None: ...  # low: the lower rank's operand
    def divide(self, x, divisor: int) -> None: ...
    def cast_scaled(self, dst, src, scale: float) -> bool: ...  # True: inf/NaN met
    def chunk_norms(self, x, chunk: int, out=None): ...
    def pack(self, dst, src, ids, chunk: int) -> None: ...
    def scatter_add(self, dst, packed, ids, chunk: int) -> None: ...
    def accumulate(self, u_out, v_out, u, v, g, momentum: float) -> None: ...
    def accumulate_norms(self, u_out, v_out, u, v, g, momentum: float, chunk: int): ...
    def zero_chunks(self, x, ids, chunk: int) -> None: ...
    def clear(self, x) -> None: ...
    def shaped(self, x, shape): ...
    def index_array(self, ids): ...
    def to_numpy(self, x): ...
    def fence(self) -> None: ...  # the work queued so far has finished


@runtime_checkable
class Transport(Protocol):
    """How a flat view's bytes reach MPI: as they are (Direct) or through a host buffer (Staged)."""

    name: str  # "direct" or "staged"
    ops: ArrayOps  # the ops on the buffers handed to MPI (where the reductions run)
    latency_path: "Transport"  # the latency path's (it reads its header on the host: device memory stages)

    def buffer_for(self, ctx, name: str, view): ...  # a buffer MPI can use in place of view
    def load(self, buffer, view) -> None: ...  # make buffer hold view's values
    def store(self, view, buffer) -> None: ...  # write buffer's values into view
    def send(self, ctx, view): ...  # a buffer holding view's values, ready for MPI
    def result(self, kind, x, flat, shape, dtype): ...  # a result of x's kind holding flat


@runtime_checkable
class ArrayKind(Protocol):
    """One kind of array (NumPy, a torch tensor, a device array) as the collectives see it."""

    memory: str  # "host" or "device": what the ranks agree on in their signatures

    @property
    def ops(self) -> ArrayOps: ...

    def check(self, x, name: str): ...  # its gflow dtype, or TypeError/ValueError
    def shape(self, x) -> tuple: ...
    def size(self, x) -> int: ...
    def read(self, x, name: str = "x", spare=None): ...  # a flat view to read (a copy if it must)
    def write_view(self, x, name: str = "x"): ...  # a flat view to write a result into
    def inout_view(self, x, name: str = "x"): ...  # a flat view to read and write back
    def write_back(self, x, flat) -> None: ...  # after inout_view: make x hold flat
    def writable(self, x) -> bool: ...
    def new(self, x, shape, dtype): ...  # a new array of x's kind
    def adopt(self, x, flat, shape, dtype): ...  # a result of x's kind holding flat
    def shaped(self, flat, shape): ...
    def prepare_out(self, x, out, dtype, count: int, name: str = "out"): ...  # check out=, its view
    def transport(self) -> Transport: ...
    def in_background(self, fn, *arrays): ...  # fn as run on gflow's thread (the caller's device)
    def done(self, result): ...  # the result, once usable by the caller
    def written(self, x) -> None: ...  # gflow wrote into x behind its library's back: tell it
