"""PyTorch tensors as kinds of array (see gflow/arrays/kinds.py).

A CPU tensor is worked on through a zero-copy NumPy view of its storage (`t.detach().numpy()`), so it
takes exactly the host path; results are tensors. A CUDA tensor is a device array: its
__cuda_array_interface__ (of the detached tensor: torch refuses one on a tensor that requires grad)
goes through gflow/cuda/arrays.py; results are CUDA tensors on the input's device. Only strided
(dense) tensors of the dtypes gflow reduces are accepted. This module is imported when the first
tensor arrives, so `import gflow` never imports torch.
"""

import numpy as np
import torch
from torch.autograd.graph import increment_version

from ..runtime.signature import bfloat16, is_bfloat16
from .numpy_arrays import HOST

_NUMPY_OF = {
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.bfloat16: None,  # (ml_dtypes' bfloat16, imported where one is met: _numpy_of)
}
_TORCH_OF = {dtype: t for t, dtype in _NUMPY_OF.items() if dtype is not None}


def _numpy_of(dtype) -> np.dtype | None:
    """The NumPy dtype of a torch dtype gflow reduces (None for another)."""
    return bfloat16() if dtype == torch.bfloat16 else _NUMPY_OF.get(dtype)


def _torch_of(dtype: np.dtype):
    return torch.bfloat16 if is_bfloat16(dtype) else _TORCH_OF[dtype]


def _written(x) -> None:
    """gflow wrote into the tensor x through a view torch does not track (NumPy's, or the CUDA array
    interface): bump its version counter as a torch in-place op would, so that autograd refuses a
    backward that saved x before (instead of silently using the new values)."""
    increment_version(x)


def _check_tensor(x, name: str) -> np.dtype:
    if x.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {x.layout}")
    dtype = _numpy_of(x.dtype)
    if dtype is None:
        supported = ", ".join(str(t) for t in _NUMPY_OF)
        raise TypeError(f"{name}: unsupported dtype {x.dtype}; supported: {supported}")
    return dtype


def _check_out_tensor(x, out, name: str) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} must be a tensor like x, got {type(out).__name__}")
    if out.device != x.device:
        raise ValueError(f"{name} must be on x's device ({x.device}), got a tensor on {out.device}")


class TorchCPU:
    """CPU tensors, through NumPy views of their storage: the host path, tensors back."""

    memory = "host"
    ops = HOST.ops

    @staticmethod
    def _np(x):
        """A NumPy view of x's storage; bfloat16 through its bits (torch has no NumPy bfloat16)."""
        if x.dtype == torch.bfloat16:
            return x.detach().view(torch.int16).numpy().view(bfloat16())
        return x.detach().numpy()

    @staticmethod
    def _tensor(flat):
        if is_bfloat16(flat.dtype):
            return torch.from_numpy(flat.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(flat)

    def check(self, x, name: str):
        return _check_tensor(x, name)

    def shape(self, x) -> tuple:
        return tuple(x.shape)

    def size(self, x) -> int:
        return x.numel()

    def read(self, x, name: str = "x", spare=None):
        return HOST.read(self._np(x), name, spare)

    def write_view(self, x, name: str = "x"):
        return HOST.write_view(self._np(x), name)

    def inout_view(self, x, name: str = "x"):
        return HOST.inout_view(self._np(x), name)

    def write_back(self, x, flat) -> None:
        HOST.write_back(self._np(x), flat)

    def writable(self, x) -> bool:
        return True

    def new(self, x, shape, dtype):
        return torch.empty(tuple(shape), dtype=_torch_of(np.dtype(dtype)))

    def adopt(self, x, flat, shape, dtype):
        return self._tensor(flat.reshape(shape))

    def shaped(self, flat, shape):
        return self._tensor(flat.reshape(shape))

    def prepare_out(self, x, out, dtype, count: int, name: str = "out"):
        if out is None:
            return self.new(x, x.shape, dtype)
        _check_out_tensor(x, out, name)
        HOST.prepare_out(self._np(x), self._np(out), dtype, count, name)
        return out

    def transport(self):
        return HOST.transport()

    def in_background(self, fn, *arrays):
        return fn

    def done(self, result):
        self.written(result)
        return result

    def written(self, x) -> None:
        _written(x)


def _cuda_view(x):
    """What the device path reads x through: the detached tensor, or for bfloat16 (which torch's
    __cuda_array_interface__ refuses) its int16 bits."""
    x = x.detach()
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def _as_bits(view, x):
    """bfloat16 travels and is reduced on the device as uint16 bits (gflow/cuda/ops.py)."""
    return view.view(np.uint16) if x.dtype == torch.bfloat16 else view


class TorchCUDA:
    """CUDA tensors, through the __cuda_array_interface__ of the detached tensor: the device path,
    CUDA tensors on the input's device back."""

    memory = "device"

    def __init__(self):
        from ..cuda.arrays import DEVICE

        self._device = DEVICE

    @property
    def ops(self):
        return self._device.ops

    def check(self, x, name: str):
        dtype = _check_tensor(x, name)
        if not x.is_contiguous():
            raise ValueError(
                f"{name}: device arrays must be C-contiguous; got a tensor of shape {tuple(x.shape)} "
                f"with strides {x.stride()}"
            )
        return dtype

    def shape(self, x) -> tuple:
        return tuple(x.shape)

    def size(self, x) -> int:
        return x.numel()

    def read(self, x, name: str = "x", spare=None):
        return _as_bits(self._device.read(_cuda_view(x), name), x)

    def write_view(self, x, name: str = "x"):
        return _as_bits(self._device.write_view(_cuda_view(x), name), x)

    def inout_view(self, x, name: str = "x"):
        return _as_bits(self._device.inout_view(_cuda_view(x), name), x)

    def write_back(self, x, flat) -> None:
        """read() was a view of x (CUDA tensors must be contiguous): nothing to write back."""

    def writable(self, x) -> bool:
        return True

    def new(self, x, shape, dtype):
        return torch.empty(tuple(shape), dtype=_torch_of(np.dtype(dtype)), device=x.device)

    def adopt(self, x, flat, shape, dtype):
        result = self.new(x, shape, dtype)
        self.ops.copy(self.write_view(result, "result"), flat)
        return result

    def shaped(self, flat, shape):
        return flat

    def prepare_out(self, x, out, dtype, count: int, name: str = "out"):
        if out is None:
            return self.new(x, x.shape, dtype)
        _check_out_tensor(x, out, name)
        if _numpy_of(out.dtype) != np.dtype(dtype):
            raise TypeError(f"{name}: expected dtype {dtype}, got {out.dtype}")
        view_dtype = np.dtype(np.int16) if x.dtype == torch.bfloat16 else dtype
        self._device.prepare_out(_cuda_view(x), _cuda_view(out), view_dtype, count, name)
        return out

    def transport(self):
        return self._device.transport()

    def in_background(self, fn, *arrays):
        return self._device.in_background(fn, *(_cuda_view(a) for a in arrays))

    def done(self, result):
        self._device.done(result)
        self.written(result)
        return result

    def written(self, x) -> None:
        _written(x)


TORCH_CPU = TorchCPU()
_torch_cuda = None


def tensor_kind(x, name: str = "x"):
    """The kind of a tensor, by its device."""
    global _torch_cuda
    if x.device.type == "cpu":
        return TORCH_CPU
    if x.device.type == "cuda":
        if _torch_cuda is None:
            _torch_cuda = TorchCUDA()
        return _torch_cuda
    raise TypeError(f"{name}: tensors on {x.device.type} devices are not supported; expected cpu or cuda")
