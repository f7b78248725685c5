"""What the optimizer's per-step agreement costs: in the fused step's final exchange, or as a collective
of its own (issue 28, item 7), alternated within one job.

    mpiexec -n 2 python bench/step_agreement.py --rounds 20

gflow.torch's DistributedOptimizer on a small MLP (8 Linear(64, 64) layers, 16 parameter tensors, a
batch of 16): fixed costs rule its step, as in per-layer-heavy models and small batches. Each round runs
--steps steps with the agreement in the final exchange (the default), then as many with it forced onto
its own collective (LazyAllreduce.AGREE_IN_FINAL_BYTES = 0), in turns; the figure is the median over
rounds of rank 0's mean step. One torch/BLAS thread per rank.
"""

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import gflow.torch as hvd  # noqa: E402
from gflow.fusion import lazy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(64, 64), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    x, y = torch.randn(16, 64), torch.randn(16, 64)

    def step():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(50):
        step()
    riding = lazy.AGREE_IN_FINAL_BYTES
    times = {"in the final exchange": [], "a collective of its own": []}
    for done in range(args.rounds):
        for name in times:
            lazy.AGREE_IN_FINAL_BYTES = riding if name == "in the final exchange" else 0
            hvd.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append((time.perf_counter() - start) / args.steps * 1e6)
        if hvd.rank() == 0 and (done + 1) % 5 == 0:
            print(f"round {done + 1}/{args.rounds}", flush=True)
    if hvd.rank() == 0:
        riding_us, own_us = (float(np.median(v)) for v in times.values())
        print(f"p = {hvd.size()}: agreement in the final exchange {riding_us:.0f} us per step, "
              f"as a collective of its own {own_us:.0f} us ({riding_us / own_us:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
