"""Gradient pipeline benchmark: per-tensor allreduce against lazy (fused) allreduce, fp16 and overlap.

    python bench/fusion.py                                   # the default matrix (minutes)
    python bench/fusion.py --models resnet50 --procs 4 --networks shm 1gbit --ratios 0

The gradient tensors are AlexNet's and ResNet-50's, as torchvision lists their parameters (written out
below; backward produces them last layer first), plus 1,000 tensors of 1,000 float32 where per-call
latency dominates. Each iteration replays a backward pass: for every layer, synthetic compute (NumPy
matmuls, sized so that compute in all = ratio x the time of one allreduce of all the bytes), then the
layer's gradient appears and is communicated:

    per-tensor            allreduce each gradient as it appears (blocking)
    per-tensor + overlap  allreduce_async each as it appears, wait for all at the end
    lazy                  after backward, push every gradient into LazyAllreduce and flush
    lazy + overlap        push each gradient as it appears (segments go out while compute goes on)
    lazy + fp16 + overlap the same with compression="fp16" (and "bf16")
(The lazy contenders' gradients live in the fusion pool, LazyAllreduce.gradient_buffers, as DDP's
gradient_as_bucket_view: pushing costs no copy; flush() copies the results back, except in "lazy,
reduced in place" (reduce_in_place=True). With fp16 the pool is float16, so pushing casts.)
Without compute (ratio 0) an iteration is the communication alone, on the gradients as they are.
    single buffer (+fp16) one allreduce of all the bytes at once, no compute: the floor for fusion
    compute only          the compute alone

Networks: "shm" (MPICH shared memory) or a per-link rate such as "1gbit" (bench/netem.py: a private
network namespace with a rate-limited loopback; needs root). Contenders alternate, one iteration each;
the figure is the median iteration time (slowest rank). Bytes on the wire are per rank, modelled from
the algorithms (ring: 2(p-1)/p of the bytes; recursive doubling: the bytes once per round).
Writes bench/out/fusion.json, a markdown table and a PNG.
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

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")

from gflow.tools.cost_model import segments as model_segments  # noqa: E402
from gflow.tools.workloads import ALEXNET, RESNET50  # noqa: E402

MODELS = {"alexnet": ALEXNET, "resnet50": RESNET50, "1000x1000": [(1000,)] * 1000}
EXPECTED_PARAMS = {"alexnet": 61_100_840, "resnet50": 25_557_032, "1000x1000": 1_000_000}


def wire_bytes(nbytes: int, p: int, small: int) -> float:
    """Bytes one rank sends for one allreduce of nbytes (the algorithm auto picks)."""
    if p == 1:
        return 0.0
    if nbytes <= small:
        return nbytes * math.ceil(math.log2(p))
    return 2 * (p - 1) / p * nbytes


class Compute:
    """Synthetic backward compute: float32 matmuls of a fixed size, repeated."""

    def __init__(self):
        self.a = np.random.default_rng(0).standard_normal((96, 96)).astype(np.float32)
        self.b = self.a.copy()
        self.run(200)
        t = time.perf_counter()
        self.run(400)
        self.seconds_each = (time.perf_counter() - t) / 400

    def run(self, reps: int) -> None:
        for _ in range(reps):
            np.matmul(self.a, self.b, out=self.b)
            self.b *= 0.01


def worker(args) -> None:
    from mpi4py import MPI

    import gflow

    comm = MPI.COMM_WORLD
    p, rank = comm.size, comm.rank
    shapes = MODELS[args.model]
    sizes = [math.prod(s) for s in shapes][::-1]  # backward: last layer first
    assert sum(sizes) == EXPECTED_PARAMS[args.model]
    total = sum(sizes)
    rng = np.random.default_rng(rank)
    pristine = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    grads = [g.copy() for g in pristine]  # the trainer's own arrays: per-tensor and fp16 use these
    flat = np.concatenate(pristine)
    flat_out = np.empty_like(flat)
    small = gflow.config.small_message_bytes

    def single(compression=None):
        gflow.allreduce(flat, "mean", out=flat_out, compression=compression)

    single()
    t_comm = float(np.median([_common.timed(comm, single) for _ in range(3)]))
    compute = Compute()
    layer_reps = [round(args.ratio * t_comm * n / total / compute.seconds_each) for n in sizes]
    lazy = gflow.LazyAllreduce(threshold_bytes=args.threshold, op="mean")
    pooled = lazy.gradient_buffers([(n,) for n in sizes])  # gradients living in the fusion pool
    lazy_ip = gflow.LazyAllreduce(threshold_bytes=args.threshold, op="mean")
    pooled_ip = lazy_ip.gradient_buffers([(n,) for n in sizes], reduce_in_place=True)
    for g, g_ip, v in zip(pooled, pooled_ip, pristine, strict=True):
        g[...] = v
        g_ip[...] = v
    lazy16 = gflow.LazyAllreduce(threshold_bytes=args.threshold, op="mean", compression="fp16")
    lazy_bf16 = gflow.LazyAllreduce(threshold_bytes=args.threshold, op="mean", compression="bf16")

    def backward(on_grad, into=grads):
        for i, g in enumerate(into):
            if args.ratio > 0:
                compute.run(layer_reps[i])
                g[...] = pristine[i]  # the layer's gradient appears (without compute: left as it is)
            on_grad(g)

    def per_tensor():
        backward(lambda g: gflow.allreduce(g, "mean", out=g))

    def per_tensor_overlap():
        handles = []
        backward(lambda g: handles.append(gflow.allreduce_async(g, "mean", out=g)))
        for h in handles:
            h.wait()

    def lazy_after(fuser=lazy, into=pooled):
        backward(lambda g: None, into)
        for g in into:
            fuser.push(g)
        fuser.flush()

    def lazy_overlap(fuser=lazy, into=pooled):
        backward(fuser.push, into)
        fuser.flush()

    runs = {
        "per-tensor": per_tensor,
        "per-tensor + overlap": per_tensor_overlap,
        "lazy": lazy_after,
        "lazy, reduced in place": lambda: lazy_after(lazy_ip, pooled_ip),
        "lazy + overlap": lazy_overlap,
        "lazy + fp16 + overlap": lambda: lazy_overlap(lazy16, grads),
        "lazy + bf16 + overlap": lambda: lazy_overlap(lazy_bf16, grads),
        "single buffer": single,
        "single buffer, fp16": lambda: single("fp16"),
        "single buffer, bf16": lambda: single("bf16"),
    }
    if args.only:
        unknown = set(args.only) - set(runs)
        assert not unknown, f"--only: no contender {sorted(unknown)}; there are {sorted(runs)}"
        runs = {name: fn for name, fn in runs.items() if name in args.only or name == "per-tensor"}
    if args.ratio > 0:
        runs["compute only"] = lambda: backward(lambda g: None)
    else:  # without compute, overlap changes nothing: keep the run short
        for name in ("per-tensor + overlap", "lazy + overlap"):
            runs.pop(name, None)
    if args.timeline:  # the lazy step again with the timeline on (its cost), alternating with the rest
        from gflow.runtime import timeline

        timeline.start_timeline(args.timeline)
        tracing, timeline._active = timeline._active, None  # on only inside the traced contender
        lazy_step = runs.get("lazy + overlap", lazy_after)

        def traced():
            timeline._active = tracing
            try:
                timeline.instant("step")
                lazy_step()
            finally:
                timeline._active = None

        runs["lazy, timeline on" if args.ratio == 0 else "lazy + overlap, timeline on"] = traced
    nbytes = 4 * np.array(sizes)
    segments = model_segments([int(b) for b in nbytes], args.threshold)
    wire = {
        "per-tensor": sum(wire_bytes(int(b), p, small) for b in nbytes),
        "lazy": sum(wire_bytes(s, p, small) for s in segments),
        "lazy, reduced in place": sum(wire_bytes(s, p, small) for s in segments),
        "lazy + fp16": sum(wire_bytes(s // 2, p, small) for s in segments),
        "lazy + bf16": sum(wire_bytes(s // 2, p, small) for s in segments),
        "single buffer": wire_bytes(int(nbytes.sum()), p, small),
        "single buffer, fp16": wire_bytes(int(nbytes.sum()) // 2, p, small),
        "single buffer, bf16": wire_bytes(int(nbytes.sum()) // 2, p, small),
        "compute only": 0.0,
    }
    for fn in runs.values():
        fn()  # warm-up: connections, pools, page faults
    times = {name: [] for name in runs}
    for rep in range(args.reps):
        for name, fn in runs.items():
            times[name].append(_common.timed(comm, fn))
        if rank == 0:
            print(
                f"  {args.model} p={p} {args.network} ratio={args.ratio}: repetition {rep + 1}/{args.reps}",
                flush=True,
            )
    if args.timeline:
        timeline._active = tracing
        timeline.stop_timeline()
    if rank == 0:
        rows = []
        base = float(np.median(times["per-tensor"]))
        for name, ts in times.items():
            t = float(np.median(ts))
            key = next(k for k in sorted(wire, key=len, reverse=True) if name.startswith(k))
            rows.append({"contender": name, "seconds": t, "speedup": base / t, "wire_bytes": wire[key]})
        result = {
            "model": args.model, "p": p, "network": args.network, "ratio": args.ratio,
            "threshold": args.threshold, "t_comm_single": t_comm, "tensors": len(sizes),
            "bytes": int(nbytes.sum()), "rows": rows,
        }  # fmt: skip
        path = os.path.join(args.out, f"fusion_{args.model}_p{p}_{args.network}_r{args.ratio}.json")
        _common.write_json(path, result)
        for row in rows:
            print(
                f"    {row['contender']:24s} {row['seconds'] * 1e3:9.1f} ms  {row['speedup']:5.2f}x",
                flush=True,
            )


def report(out_dir: str, paths: list[str]) -> None:
    results = [json.load(open(path)) for path in paths]
    lines = [
        "| model | p | network | compute/comm | contender | iteration (ms) | vs per-tensor | wire MB/rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for row in r["rows"]:
            lines.append(
                f"| {r['model']} | {r['p']} | {r['network']} | {r['ratio']:g} | {row['contender']} | "
                f"{row['seconds'] * 1e3:.1f} | {row['speedup']:.2f}x | {row['wire_bytes'] / 1e6:.1f} |"
            )
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "fusion.md"), "w") as f:
        f.write(text)
    print(text)
    _common.write_json(
        os.path.join(out_dir, "fusion.json"), {"machine": _common.machine(), "results": results}
    )
    plot(results, os.path.join(out_dir, "fusion.png"))


def plot(results, path: str) -> None:
    plt = _common.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 4.2), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        names = [row["contender"] for row in r["rows"]]
        ax.barh(names, [row["seconds"] * 1e3 for row in r["rows"]], color="tab:blue")
        ax.invert_yaxis()
        ax.set_title(f"{r['model']}, p={r['p']}, {r['network']}, ratio {r['ratio']:g}", fontsize=9)
        ax.set_xlabel("iteration (ms)")
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--models", nargs="+", default=["resnet50", "alexnet", "1000x1000"], choices=list(MODELS)
    )
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--networks", nargs="+", default=["shm", "500mbit", "1gbit"])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.0, 1.0], help="compute / communication")
    parser.add_argument(
        "--timeline",
        help="also run the lazy step with gflow's timeline on, written to this path (one file per rank)",
    )
    parser.add_argument("--threshold", type=int, default=None, help="LazyAllreduce threshold_bytes")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", nargs="+", help="only these contenders (and per-tensor, the baseline)")
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--report", action="store_true", help="only rebuild the table and plot from --out")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--network", help=argparse.SUPPRESS)
    parser.add_argument("--ratio", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threshold is None:
        from gflow.fusion.lazy import DEFAULT_THRESHOLD_BYTES

        args.threshold = DEFAULT_THRESHOLD_BYTES
    if args.worker:
        worker(args)
        return
    if args.report:
        import glob

        report(args.out, sorted(glob.glob(os.path.join(args.out, "fusion_*_p*_*_r*.json"))))
        return
    os.environ.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")  # one core per rank
    paths = []
    for model in args.models:
        for network in args.networks:
            for p in args.procs:
                for ratio in args.ratios:
                    print(f"--- {model}, p={p}, {network}, compute/comm {ratio:g} ---", flush=True)
                    worker_args = ["--worker", "--model", model, "--network", network, "--ratio", str(ratio)]
                    worker_args += [
                        "--threshold",
                        str(args.threshold),
                        "--reps",
                        str(args.reps),
                        "--out",
                        args.out,
                    ]
                    if args.only:
                        worker_args += ["--only", *args.only]
                    if args.timeline:
                        root, ext = os.path.splitext(args.timeline)
                        worker_args += [
                            "--timeline",
                            f"{root}_{model}_p{p}_{network}_r{ratio:g}{ext or '.json'}",
                        ]
                    rate = None if network == "shm" else netem.parse_rate(network)
                    netem.launch(os.path.abspath(__file__), p, worker_args, rate)
                    paths.append(os.path.join(args.out, f"fusion_{model}_p{p}_{network}_r{ratio}.json"))
    report(args.out, paths)


if __name__ == "__main__":
    main()
