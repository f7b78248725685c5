"""Device peer memory through CUDA IPC: each rank of a node allocates its device buffer, exports it
with an IPC handle, and opens every peer's handle once per allocation (collectives/peer_memory.py
keeps the allocation across calls and grows it rarely). The node phase's kernels then read and
write the peers' device memory directly: no host staging inside a node.

Ordering: a rank waits for its kernels (device synchronize) before the node barrier, so that what
they wrote is complete when a peer's kernels read it after the barrier.

IPC is refused where it cannot work: GFLOW_CUDA_IPC=0 (containers that forbid it), not Linux, a
peer's GPU not peer-accessible from this one, or an allocation or an open that fails on any rank of
the node. Then every rank of the node takes the node's ring, and gflow says once why.

Under Numba's simulator, device memory is host memory: there the mapping is a host shared window
seen as device arrays, so the device node phase (its kernels, its ordering) runs and is tested
without a GPU; only the IPC calls themselves are GPU-only.
"""

import os
import sys

import numpy as np
from numba import cuda

from ..runtime.shared_memory import HostWindow, PeerMemoryUnavailable
from .memory import SIMULATED
from .memory import address as device_address

ENV = "GFLOW_CUDA_IPC"


def mapping(shared_memory: bool):
    """(a mapping of device memory for the node's ranks, None) or (None, why not)."""
    if os.environ.get(ENV, "") == "0":
        return None, f"{ENV}=0 turns CUDA IPC off"
    if not shared_memory:  # (ranks posed as one node across machines cannot map each other's GPUs)
        return None, "the node's ranks share no memory (MPI's shared-memory communicator says so)"
    if SIMULATED:
        return SimulatedIpc(), None
    if not sys.platform.startswith("linux"):
        return None, "CUDA IPC needs Linux"
    return CudaIpc(), None


class CudaIpc:
    """Every node rank's device buffer, opened through IPC handles (see the module docstring)."""

    memory = "device"
    where = "device memory"

    def __init__(self):
        self._own = None
        self._opened = []
        self._comm = None

    def room(self) -> int:
        """Free device memory (very large when the allocator cannot tell: an external pool's)."""
        try:
            free, _total = cuda.current_context().get_memory_info()
        except NotImplementedError:
            return 2**62
        return free

    def allocate(self, node_comm, nbytes: int, local: int) -> list:
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        from numba.cuda.cudadrv.driver import device_memset

        self._comm = node_comm
        error, handle = None, None
        try:
            self._own = cuda.device_array(nbytes, np.uint8)
            device_memset(self._own, 0, nbytes)
            handle = cuda.current_context().get_ipc_handle(self._own.gpu_data)
        except Exception as failure:  # one rank's failure must not leave the others in the allgather
            error = f"rank {node_comm.rank} of the node could not export {nbytes} bytes: {failure}"
        handles = node_comm.allgather(handle)
        errors = node_comm.allgather(error)
        memory = [self._own] * node_comm.size
        if not any(errors):
            context = cuda.current_context()
            try:
                for q, peer in enumerate(handles):
                    if q == local:
                        continue
                    if not peer.can_access_peer(context):
                        raise PeerMemoryUnavailable(f"node rank {q}'s GPU is not peer-accessible from here")
                    pointer = peer.open_direct(context)
                    self._opened.append(peer)
                    memory[q] = DeviceNDArray(shape=(nbytes,), strides=(1,), dtype=np.uint8, gpu_data=pointer)
            except Exception as failure:
                error = f"rank {node_comm.rank} of the node could not open a peer's IPC handle: {failure}"
            errors = node_comm.allgather(error)
        cuda.synchronize()  # the zeroing is done before any peer may write
        if any(errors):
            self.free()
            raise PeerMemoryUnavailable(next(e for e in errors if e))
        return memory

    def address(self, x):
        return device_address(x)

    def before_barrier(self) -> None:
        cuda.synchronize()

    def after_barrier(self) -> None:
        """(kernels launched after the barrier see what the peers' finished kernels wrote)"""

    def free(self) -> None:
        """Close the peers' buffers, then, once every node rank has, drop this rank's own."""
        for peer in self._opened:
            peer.close()
        self._opened = []
        if self._comm is not None:
            self._comm.Barrier()
        self._own = None
        self._comm = None


class SimulatedIpc(HostWindow):
    """The simulator's twin of CudaIpc: a host window whose memory is handed out as the simulator's
    device arrays (its device memory is host memory)."""

    memory = "device"
    where = "device memory (simulated: a host shared window)"

    def address(self, x):
        return device_address(x)

    def allocate(self, node_comm, nbytes: int, local: int) -> list:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return [FakeCUDAArray(m) for m in super().allocate(node_comm, nbytes, local)]
