"""LazyAllreduce(threshold_bytes="auto") against the best fixed threshold of a sweep.

    python bench/autotune.py                                  # ResNet-50 and AlexNet, p = 4, shm and 1 Gbit/s
    python bench/autotune.py --models resnet50 --networks shm --reps 2

The step is bench/fusion.py's "lazy + overlap": a replayed backward pass (synthetic compute sized so
that compute in all = ratio x one allreduce of all the bytes), each gradient pushed as it appears,
then flush(); the gradients live in each LazyAllreduce's pool (gradient_buffers). First the "auto"
object tunes itself on the real step (its tuning steps are timed too: what tuning costs). Then the
sweep: one fixed-threshold object whose threshold is set before each block, and the settled auto
object, in blocks of one warm-up step (segment buffers change size with the threshold) and --steps
timed steps, every contender once per repetition, --reps repetitions. The figure per contender is the
median step (slowest rank); the target is auto's within 10% of the best fixed one.

Writes bench/out/autotune_<model>_p<p>_<network>.json, bench/out/autotune.md and autotune.png.
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402
import netem  # noqa: E402
from fusion import MODELS, Compute  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def sweep_thresholds(total_bytes: int) -> list[int]:
    """The fixed thresholds: autotune's candidates (up to the first that holds the whole step),
    DDP's 25 MiB and the midpoints 3 and 12 MiB, so that the best fixed one is not autotune's grid."""
    from gflow.fusion.autotune import CANDIDATES

    grid = sorted(set(CANDIDATES) | {3 * 2**20, 12 * 2**20, 25 * 2**20})
    last = next((i for i, c in enumerate(grid) if c >= total_bytes), len(grid) - 1)
    return grid[: last + 1]


def spread(samples) -> float:
    """How much one step differs from the next: interquartile range / median, median over contenders."""
    return float(np.median([np.subtract(*np.percentile(ts, [75, 25])) / np.median(ts) for ts in samples]))


def worker(args) -> None:
    from mpi4py import MPI

    import gflow
    from gflow.fusion.autotune import size_text

    comm = MPI.COMM_WORLD
    p, rank = comm.size, comm.rank
    shapes = MODELS[args.model]
    sizes = [math.prod(s) for s in shapes][::-1]  # backward: last layer first
    total = sum(sizes)
    rng = np.random.default_rng(rank)
    pristine = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    flat = np.concatenate(pristine)

    def single():
        gflow.allreduce(flat, "mean", out=flat)

    single()
    t_comm = float(np.median([_common.timed(comm, single) for _ in range(3)]))
    compute = Compute()
    layer_reps = [round(args.ratio * t_comm * n / total / compute.seconds_each) for n in sizes]

    def step(lazy, pool):
        for i, g in enumerate(pool):
            compute.run(layer_reps[i])
            g[...] = pristine[i]  # the layer's gradient appears
            lazy.push(g)
        lazy.flush()

    auto = gflow.LazyAllreduce("auto", op="mean")
    auto_pool = auto.gradient_buffers([(n,) for n in sizes])
    tuning = []
    started = time.perf_counter()
    while auto.tuning:
        tuning.append(_common.timed(comm, lambda: step(auto, auto_pool)))
        if rank == 0 and len(tuning) % 5 == 0:
            print(f"  tuning: step {len(tuning)}, threshold {size_text(auto.threshold_bytes)}", flush=True)
    tuning_seconds = time.perf_counter() - started
    settled = auto.threshold_bytes

    thresholds = sweep_thresholds(4 * total)
    fixed = gflow.LazyAllreduce(thresholds[0], op="mean")
    fixed_pool = fixed.gradient_buffers([(n,) for n in sizes])
    contenders = [(t, fixed, fixed_pool) for t in thresholds] + [("auto", auto, auto_pool)]
    times = {name: [] for name, _, _ in contenders}
    for rep in range(args.reps):
        for name, lazy, pool in contenders:
            if lazy is fixed:
                fixed.threshold_bytes = name
            step(lazy, pool)  # warm-up: segment buffers of this threshold's sizes
            for _ in range(args.steps):
                times[name].append(_common.timed(comm, lambda lazy=lazy, pool=pool: step(lazy, pool)))
        if rank == 0:
            print(f"  {args.model} p={p} {args.network}: repetition {rep + 1}/{args.reps}", flush=True)
    if rank == 0:
        medians = {name: float(np.median(ts)) for name, ts in times.items()}
        best = min(thresholds, key=lambda t: medians[t])
        result = {
            "model": args.model, "p": p, "network": args.network, "ratio": args.ratio,
            "bytes": 4 * total, "settled": settled, "tuning_steps": len(tuning),
            "tuning_seconds": tuning_seconds, "tuning_median_step": float(np.median(tuning)),
            "agreed": {str(k): v for k, v in (auto.tuning_results or {}).items()},
            "fixed": {str(t): medians[t] for t in thresholds}, "auto": medians["auto"],
            "best_fixed": best, "best_fixed_seconds": medians[best],
            "auto_over_best": medians["auto"] / medians[best],
            "settled_fixed_seconds": medians.get(settled),
            "spread": spread(times.values()),
            "samples": {str(name): ts for name, ts in times.items()}, "tuning_samples": tuning,
        }  # fmt: skip
        path = os.path.join(args.out, f"autotune_{args.model}_p{p}_{args.network}.json")
        _common.write_json(path, result)
        for t in thresholds:
            print(f"    fixed {size_text(t):>8s} {medians[t] * 1e3:9.1f} ms", flush=True)
        print(
            f"    auto ({size_text(settled)}) {medians['auto'] * 1e3:9.1f} ms: "
            f"{result['auto_over_best']:.3f}x the best fixed ({size_text(best)}); "
            f"tuning took {len(tuning)} steps, {tuning_seconds:.1f} s; step-to-step spread (interquartile "
            f"range / median, median over the contenders) {result['spread']:.1%}",
            flush=True,
        )


def report(out_dir: str, paths: list[str]) -> None:
    from gflow.fusion.autotune import size_text

    results = [json.load(open(path)) for path in paths]
    lines = [
        "| model | p | network | settled | auto step (ms) | best fixed | its step (ms) | auto / best | "
        "settled fixed / best | tuning steps (s) | spread |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        settled_fixed = r.get("settled_fixed_seconds")  # the sweep's step at the settled threshold
        settled_ratio = f"{settled_fixed / r['best_fixed_seconds']:.3f}" if settled_fixed else "n/a"
        lines.append(
            f"| {r['model']} | {r['p']} | {r['network']} | {size_text(r['settled'])} | "
            f"{r['auto'] * 1e3:.1f} | {size_text(r['best_fixed'])} | {r['best_fixed_seconds'] * 1e3:.1f} | "
            f"{r['auto_over_best']:.3f} | {settled_ratio} | {r['tuning_steps']} "
            f"({r['tuning_seconds']:.1f}) | {r.get('spread', float('nan')):.1%} |"
        )
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "autotune.md"), "w") as f:
        f.write(text)
    print(text)
    plot(results, os.path.join(out_dir, "autotune.png"))


def plot(results, path: str) -> None:
    plt = _common.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.6), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        xs = [int(t) for t in r["fixed"]]
        ax.plot(xs, [v * 1e3 for v in r["fixed"].values()], "o-", color="tab:blue", label="fixed threshold")
        ax.plot([r["settled"]], [r["auto"] * 1e3], "*", ms=14, color="tab:red", label="auto (settled)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("threshold (bytes)")
        ax.set_ylabel("step (ms)")
        ax.set_title(
            f"{r['model']}, p={r['p']}, {r['network']}: auto {r['auto_over_best']:.2f}x best", fontsize=9
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["resnet50", "alexnet"], choices=list(MODELS))
    parser.add_argument("--procs", type=int, nargs="+", default=[4])
    parser.add_argument("--networks", nargs="+", default=["shm", "1gbit"])
    parser.add_argument("--ratio", type=float, default=1.0, help="compute / communication")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1, help="timed steps per block")
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--report", action="store_true", help="only rebuild the table and plot from --out")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--network", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    paths = [
        os.path.join(args.out, f"autotune_{m}_p{p}_{n}.json")
        for m in args.models
        for n in args.networks
        for p in args.procs
    ]
    if not args.report:
        os.environ.update(
            OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1"
        )  # one core per rank
        for model in args.models:
            for network in args.networks:
                for p in args.procs:
                    print(f"--- {model}, p={p}, {network}, compute/comm {args.ratio:g} ---", flush=True)
                    worker_args = [
                        "--worker",
                        "--model",
                        model,
                        "--network",
                        network,
                        "--ratio",
                        str(args.ratio),
                    ]
                    worker_args += ["--reps", str(args.reps), "--steps", str(args.steps), "--out", args.out]
                    rate = None if network == "shm" else netem.parse_rate(network)
                    netem.launch(os.path.abspath(__file__), p, worker_args, rate)
    report(args.out, paths)


if __name__ == "__main__":
    main()
