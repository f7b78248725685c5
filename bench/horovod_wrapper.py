"""Run Horovod's PyTorch synthetic benchmark on gflow.torch, the script itself left as it is.

    mpiexec -n 2 python bench/horovod_wrapper.py bench/horovod_synthetic_benchmark.py --no-cuda \\
        --model resnet18 --batch-size 8
    mpiexec -n 2 python bench/horovod_wrapper.py --sparse-density 0.01 \\
        bench/horovod_synthetic_benchmark.py ...

The script (bench/horovod_synthetic_benchmark.py: Horovod's examples/pytorch/pytorch_synthetic_benchmark.py
with `import horovod.torch as hvd` changed to `import gflow.torch as hvd`) runs unmodified in this
process, with its own command line. What this wrapper adds around it:
  - one torch thread per rank (torch.set_num_threads(1)), as every contender of bench/train.py runs;
  - with --sparse-density D, gflow.torch.DistributedOptimizer is called with sparse=dict(density=D)
    added (gflow's coarse-grained sparse communication; the one keyword the CSC row adds).
bench/train.py runs it and reads the script's "Total img/sec" line.
"""

import functools
import os
import runpy
import sys


def main() -> None:
    argv = sys.argv[1:]
    density = None
    if argv[:1] == ["--sparse-density"]:
        density, argv = float(argv[1]), argv[2:]
    if not argv:
        raise SystemExit(__doc__)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    import torch

    torch.set_num_threads(1)
    if density is not None:
        import gflow.torch as hvd

        hvd.DistributedOptimizer = functools.partial(hvd.DistributedOptimizer, sparse=dict(density=density))
    script = argv[0]
    sys.argv = argv
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
