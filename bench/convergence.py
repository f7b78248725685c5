"""Convergence with gflow's transports: dense, fp16 and CSC at 1% with warm-up, same global batch.

    python bench/convergence.py          # 4 ranks; prints the curves, writes bench/out/convergence.{json,png}

A NumPy MLP on scikit-learn's digits (bench/digits_mlp.py), data-parallel under mpiexec.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def worker(args) -> None:
    import digits_mlp
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    curves = {}
    for variant in ("dense", "fp16", "csc"):
        curves[variant] = digits_mlp.train(variant, comm, epochs=args.epochs)
        if comm.rank == 0:
            print(f"{variant:5s} " + " ".join(f"{a:.3f}" for a in curves[variant]), flush=True)
    if comm.rank == 0:
        _common.write_json(os.path.join(args.out, "convergence.json"), {"p": comm.size, "curves": curves})
        plot(curves, comm.size, os.path.join(args.out, "convergence.png"))


def plot(curves, p: int, path: str) -> None:
    plt = _common.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in curves.items():
        label = {"dense": "dense fp32", "fp16": "dense fp16", "csc": "CSC 1% (+ warm-up)"}[name]
        ax.plot(range(1, len(curve) + 1), curve, marker="o", ms=3, label=label)
    ax.set_xlabel("epoch")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(f"digits MLP, {p} ranks, same global batch")
    ax.set_ylim(0.8, 1.0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    _common.launch(
        os.path.abspath(__file__), args.procs, ["--worker", "--epochs", str(args.epochs), "--out", args.out]
    )


if __name__ == "__main__":
    main()
