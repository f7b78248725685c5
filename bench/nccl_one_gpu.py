"""Does NCCL take two ranks on one GPU? (issue 26: the GPU check compares gflow's device path with
torch.distributed on the one H200 that is lent, and needs to know which backends can run there.)

    mpiexec -n 2 python bench/nccl_one_gpu.py     # bounded by the caller (gpu_check.sh: timeout)

Every rank takes GPU 0 and allreduces a CUDA tensor through a NCCL process group; rank 0 prints the
result or the error, as NCCL words it.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import _init_store  # noqa: E402


def main() -> None:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    store = _init_store(comm)
    outcome = "ok"
    try:
        dist.init_process_group("nccl", store=store, rank=comm.rank, world_size=comm.size)
        x = torch.full((1024,), float(comm.rank + 1), device="cuda:0")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        expected = comm.size * (comm.size + 1) / 2
        outcome = "correct" if bool((x == expected).all()) else f"WRONG: {x[0].item()} != {expected}"
    except Exception as exc:  # noqa: BLE001 - the answer is the error itself
        outcome = f"refused: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    outcomes = comm.gather(outcome, root=0)
    if comm.rank == 0:
        said = "; ".join(f"rank {r}: {o}" for r, o in enumerate(outcomes))
        print(f"NCCL, {comm.size} ranks on one GPU: {said}")


if __name__ == "__main__":
    main()
