"""Two versions of gflow side by side, alternated: what a change costs a training step, and (with
--bench) the allreduce itself.

    git worktree add /tmp/base <commit before the change>
    python bench/step_overhead.py --baseline /tmp/base --procs 4 --rounds 5
    python bench/step_overhead.py --baseline /tmp/base --procs 4 --rounds 5 --bench   # + gflow bench

A step on ResNet-50's 161 parameter shapes (gflow.tools.workloads.RESNET50, 25.6M float32), at p ranks on
shared memory, through both training layers as trainers use them:

    DistributedOptimizer  gflow.torch: zero_grad, a backward whose gradients are cheap to compute
                          (each parameter's gradient is a constant times its values, so the hooks
                          fire one by one, last layer first, as in a real backward), step() (SGD)
    DataParallel          gflow.DataParallel on NumPy arrays: every gradient written into its pool
                          view and pushed, last layer first, then synchronize() (the LazyAllreduce step)

both at their default fusion threshold (25 MiB). Each round runs both versions once each, in alternating
order, --steps timed steps after --warmup; the figure per version is the median over rounds of each
run's median step time (the slowest rank's), and the ratio is the median over rounds of each round's
ratio this tree / baseline (above 1: slower; a round's two runs are side by side, so the machine's
drift cancels). With --bench, each round also runs `python -m gflow bench -b 4K -e 64M -f 4` (nccl-tests'
all_reduce_perf: the median of the slowest rank per size) under each version, in the same alternating
order, and the ratio per size is the median of the rounds' ratios. Writes bench/out/step_overhead.json.
Every rank runs with one BLAS/OpenMP/torch thread.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(HERE, "bench", "out")
LAYERS = ("DistributedOptimizer", "DataParallel")


def worker(args) -> None:
    """One version's run (gflow from PYTHONPATH): median seconds per step of each layer, as JSON."""
    import torch
    from mpi4py import MPI

    import gflow
    import gflow.torch as hvd

    try:
        from gflow.tools.workloads import RESNET50
    except ImportError:  # a baseline from before gflow/tools/ (issue 25)
        from gflow._workloads import RESNET50

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    hvd.init()
    results = {}

    params = [torch.nn.Parameter(torch.randn(shape) * 0.01) for shape in RESNET50]
    weights = [torch.full(shape, 1e-3 * (i % 7 + 1)) for i, shape in enumerate(RESNET50)]
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(params, lr=1e-3), named_parameters=[(f"p{i}", p) for i, p in enumerate(params)]
    )

    def torch_step():
        opt.zero_grad()
        sum((p * w).sum() for p, w in zip(params, weights, strict=True)).backward()
        opt.step()

    arrays = {
        f"p{i}": np.random.default_rng(i).standard_normal(s).astype(np.float32)
        for i, s in enumerate(RESNET50)
    }
    dp = gflow.DataParallel(arrays)
    grads = dp.gradient_buffers()
    sources = {k: np.full(a.shape, 1e-3, np.float32) for k, a in arrays.items()}

    def kit_step():
        for key in reversed(list(arrays)):
            np.copyto(grads[key], sources[key])  # backward writes the gradient into the pool
            dp.push(key)
        dp.synchronize()

    for name, step in (("DistributedOptimizer", torch_step), ("DataParallel", kit_step)):
        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.steps):
            comm.Barrier()
            t = time.perf_counter()
            step()
            times.append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
        results[name] = float(np.median(times))
    if comm.rank == 0:
        with open(args.json, "w") as f:
            json.dump(results, f)


def run(tree: str, procs: int, args) -> dict:
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.pop("GFLOW_TIMELINE", None)
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "steps.json")
        command = [_common.mpiexec(), "-n", str(procs), sys.executable, os.path.abspath(__file__), "--worker"]
        command += ["--json", path, "--steps", str(args.steps), "--warmup", str(args.warmup)]
        subprocess.run(command, check=True, env=env, cwd=scratch, timeout=3600)
        with open(path) as f:
            return json.load(f)


def run_bench(tree: str, procs: int) -> dict:
    """`gflow bench` under `tree`: {bytes: median microseconds of the slowest rank}."""
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.pop("GFLOW_TIMELINE", None)
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "bench.json")
        command = [_common.mpiexec(), "-n", str(procs), sys.executable, "-m", "gflow", "bench"]
        command += ["-b", "4K", "-e", "64M", "-f", "4", "--json", path]
        subprocess.run(command, check=True, env=env, cwd=scratch, timeout=3600, stdout=subprocess.DEVNULL)
        with open(path) as f:
            return {row["bytes"]: row["time_us"] for row in json.load(f)["rows"]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", help="a checkout of the version to compare with")
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=15, help="timed steps per layer and run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--bench", action="store_true", help="also gflow bench, 4 KB to 64 MB")
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if not args.baseline:
        parser.error("--baseline is required")
    trees = {"baseline": os.path.abspath(args.baseline), "this tree": HERE}
    times = {name: {layer: [] for layer in LAYERS} for name in trees}
    bench = {name: [] for name in trees}  # per round, {bytes: us}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(trees)[::-1]
        for name in order:
            got = run(trees[name], args.procs, args)
            for layer in LAYERS:
                times[name][layer].append(got[layer])
            print(f"round {r + 1}/{args.rounds} {name}: "
                  + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in got.items()), flush=True)  # fmt: skip
            if args.bench:
                bench[name].append(run_bench(trees[name], args.procs))
    rows = []
    for layer in LAYERS:
        base, this = (float(np.median(times[name][layer])) for name in trees)
        paired = [t / b for b, t in zip(times["baseline"][layer], times["this tree"][layer], strict=True)]
        ratio, low, high = float(np.median(paired)), min(paired), max(paired)
        rows.append({"layer": layer, "baseline_ms": base * 1e3, "this_ms": this * 1e3, "ratio": ratio,
                     "ratio_range": [low, high]})  # fmt: skip
    bench_rows = []
    for size in sorted(bench["baseline"][0]) if args.bench else []:
        base = [run_[size] for run_ in bench["baseline"]]
        this = [run_[size] for run_ in bench["this tree"]]
        paired = [t / b for b, t in zip(base, this, strict=True)]
        medians = {"baseline_us": float(np.median(base)), "this_us": float(np.median(this))}
        bench_rows.append(dict(medians, bytes=size, ratio=float(np.median(paired)),
                               ratio_range=[min(paired), max(paired)]))  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "step_overhead.json"), "w") as f:
        report = {"machine": _common.machine(), "procs": args.procs, "times": times, "rows": rows}
        json.dump(dict(report, bench=bench_rows), f, indent=1)
    print(f"\np = {args.procs}, ResNet-50 shapes, median of {args.rounds} rounds x {args.steps} steps")
    print("| layer | baseline ms | this tree ms | this / baseline (rounds' range) |\n|---|---|---|---|")
    for row in rows:
        low, high = row["ratio_range"]
        print(
            f"| {row['layer']} | {row['baseline_ms']:.1f} | {row['this_ms']:.1f} | "
            f"{row['ratio']:.3f} ({low:.2f}-{high:.2f}) |"
        )
    if bench_rows:
        print(
            f"\ngflow bench, p = {args.procs}: median of {args.rounds} rounds (slowest rank, 20 calls each)"
        )
        print("| size | baseline us | this tree us | this / baseline (rounds' range) |\n|---|---|---|---|")
        for row in bench_rows:
            low, high = row["ratio_range"]
            print(f"| {row['bytes']} | {row['baseline_us']:.1f} | {row['this_us']:.1f} | "
                  f"{row['ratio']:.3f} ({low:.2f}-{high:.2f}) |")  # fmt: skip


if __name__ == "__main__":
    main()
