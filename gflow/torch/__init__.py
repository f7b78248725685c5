"""Horovod's PyTorch API on gflow: `import gflow.torch as hvd` runs scripts written for
`import horovod.torch as hvd`, on CPU and CUDA tensors, launched with `mpiexec -n N python train.py`.

    import gflow.torch as hvd
    hvd.init()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Where gflow differs from Horovod (each is documented where it applies): every rank must start its
collectives in the same order (a name= is checked, not used to reorder); Adasum runs on the host;
broadcast_optimizer_state does not step an empty optimizer; no elastic mode (gflow.torch.elastic raises
ImportError saying what to do instead). The full list: README.md, "gflow.torch".
Horovod's environment variables: see _settings.py. gflow's errors (MismatchError, ...) raised here are
also HorovodInternalErrors. `import gflow` never imports torch; this module does.
"""

from ._allreduce import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
)
from ._basics import (
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    Product,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    size,
)
from ._gather import (
    allgather,
    allgather_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    join,
    sparse_allreduce_async,
)
from ._grouped import (
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
)
from ._handles import poll, shutdown, synchronize
from ._init import init
from ._scatter import (
    alltoall,
    alltoall_async,
    grouped_allgather,
    grouped_allgather_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)
from .compression import Compression, Compressor
from .functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    start_timeline,
    stop_timeline,
)
from .optimizer import DistributedOptimizer
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "reducescatter_async",
    "reducescatter",
    "grouped_reducescatter_async",
    "grouped_reducescatter",
    "grouped_allgather_async",
    "grouped_allgather",
    "alltoall_async",
    "alltoall",
    "Adasum",
    "Average",
    "Compression",
    "Compressor",
    "DistributedOptimizer",
    "HorovodInternalError",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "SyncBatchNorm",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "global_process_set",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
