"""What the bucket-view check costs a step: DistributedOptimizer(gradient_as_bucket_view=True) on
80 Linear(64, 64) layers (160 gradients), the median of 50 step() calls (after 10 to warm up).

Run under mpiexec from two checkouts, alternating (bench/RESULTS.md has the figures and command):
    OMP_NUM_THREADS=1 PYTHONPATH=<checkout> mpiexec -n 2 python bench/bucket_view_check.py
"""

import time

import torch

import gflow.torch as hvd

torch.set_num_threads(1)
hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(80)])
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=1e-4),
    named_parameters=model.named_parameters(),
    gradient_as_bucket_view=True,
)
x = torch.randn(4, 64)
times = []
for _ in range(60):
    opt.zero_grad()
    model(x).sum().backward()
    start = time.perf_counter()
    opt.step()
    times.append(time.perf_counter() - start)
times = sorted(times[10:])
if hvd.rank() == 0:
    print(f"step() median {1e3 * times[len(times) // 2]:.2f} ms, p10 {1e3 * times[len(times) // 10]:.2f} ms")
