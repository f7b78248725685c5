"""A sparse embedding's zero slot: the time of a DistributedOptimizer step over nn.Embedding(sparse=True)
plus a small dense head, with the embedding's dense slot of zeros in the fused buffers (gflow before
0975af6) and without it (from its second step, gflow now). Run one tree per launch, alternating:

    python bench/netem.py --per-link 1gbit --procs 4 -- bench/sparse_embedding.py
    PYTHONPATH=<older tree> python bench/netem.py --per-link 1gbit --procs 4 -- bench/sparse_embedding.py

Prints the median step time over --steps steps after one warm-up step (the first step of each
optimizer still carries the slot: it learns which gradients are sparse), and gflow's commit.
"""

import argparse
import os
import subprocess
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=250_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    import torch

    import gflow
    import gflow.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(args.rows, args.dim, sparse=True)
    head = torch.nn.Sequential(torch.nn.Linear(args.dim, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2))
    params = [("embedding.weight", embedding.weight), *(("head." + n, p) for n, p in head.named_parameters())]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.01), named_parameters=params)
    rng = np.random.default_rng(hvd.rank())
    times = []
    for step in range(args.steps + 1):
        idx = torch.from_numpy(rng.integers(0, args.rows, (64, 8)))
        hvd.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        head(embedding(idx).mean(dim=1)).pow(2).mean().backward()
        opt.step()
        hvd.barrier()
        if step:
            times.append(time.perf_counter() - start)
    if hvd.rank() == 0:
        where = os.path.dirname(os.path.dirname(os.path.abspath(gflow.__file__)))
        git = ["git", "-C", where, "rev-parse", "--short", "HEAD"]
        commit = subprocess.run(git, capture_output=True, text=True).stdout.strip() or "?"
        mb = args.rows * args.dim * 4 / 2**20
        ms = np.array(times) * 1e3
        print(
            f"gflow {commit} ({where}): {hvd.size()} ranks, a {mb:.0f} MiB sparse embedding: "
            f"median step {np.median(ms):.1f} ms (min {ms.min():.1f}, max {ms.max():.1f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
