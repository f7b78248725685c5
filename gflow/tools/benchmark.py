"""`python -m gflow bench`: nccl-tests' all_reduce_perf for gflow.

    mpiexec -n 4 python -m gflow bench -b 4K -e 256M -f 2 --check

For each size from -b to -e (times -f each step) every rank allreduces random data of --dtype with --op,
--algorithm and --compression: -w warm-up calls, then -n timed ones, each started together (a barrier)
and timed by the slowest rank; the row shows their median. algbw = bytes / time; busbw = algbw *
2(p-1)/p, the bytes each rank's link carries in a ring (nccl-tests' definition), comparable across p
(at p = 1, algbw itself).
--check allreduces fresh random data once more and counts the elements that differ from MPI's own
Allreduce in float64 by more than the rounding the dtype (or float16 on the wire) allows, plus every
element of a result that is not bitwise the same on all ranks.
"""

import hashlib
import json
import math
import os
import sys
import time

import numpy as np

UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def _dtype(name: str) -> np.dtype:
    """--dtype's dtype: NumPy knows the name bfloat16 only once ml_dtypes is imported (gflow.signature)."""
    from ..runtime.signature import bfloat16

    return bfloat16() if name == "bfloat16" else np.dtype(name)


MAX_SIZE = 2**40  # (1 TiB: past anything one rank's memory holds, and still an exact float)


def parse_size(text: str) -> int:
    """'4K' -> 4096, '256M', '1G', or a plain number of bytes; ValueError for anything else."""
    text = text.strip().upper().removesuffix("B")
    scale = UNITS.get(text[-1:], 1)
    number = float(text[:-1] if text[-1:] in UNITS else text)  # (ValueError: not a number)
    if not 0 < number * scale <= MAX_SIZE:  # (NaN too)
        raise ValueError(f"a size must be positive and at most 1T, got {text!r}")
    return max(1, int(number * scale))


def _size_argument(text: str) -> int:
    import argparse

    try:
        return parse_size(text)
    except ValueError as exc:  # argparse shows an ArgumentTypeError's message, not a ValueError's
        raise argparse.ArgumentTypeError(
            str(exc) if "positive" in str(exc) else f"not a size (4K, 64M, 1G or bytes): {text!r}"
        ) from None


def not_a_new_file(path: str) -> bool:
    """Whether `path` cannot be written as a file (a folder, or in a folder that does not exist):
    checked before a command's work, so that its results are not lost after it."""
    return os.path.isdir(path) or not os.path.isdir(os.path.dirname(os.path.abspath(path)))


def size_list_argument(text: str) -> list[int]:
    """'4K,64K,1M' for argparse: each a size, or ArgumentTypeError naming the one that is not."""
    return [_size_argument(part) for part in text.split(",")]


def sizes_from(begin: int, end: int, factor: float) -> list[int]:
    if end < begin:
        raise ValueError(f"-e ({end}) must be at least -b ({begin})")
    if not (math.isfinite(factor) and factor > 1) and end > begin:
        raise ValueError(f"-f must be a number above 1, got {factor}")
    sizes = [begin]
    while end > begin and sizes[-1] * factor <= end:
        sizes.append(max(int(sizes[-1] * factor), sizes[-1] + 1))  # (a factor near 1 still moves on)
    return sizes


def human(nbytes: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return str(nbytes)


def _wrong_elements(comm, x, y, op: str, dtype, compression) -> int:
    """Elements of y (gflow's result on this rank) that MPI's own float64 Allreduce of x disowns,
    plus all of them when y is not bitwise the same on every rank. Collective."""
    from mpi4py import MPI

    p = comm.size
    wide = x.astype(np.float64)
    exact = np.empty_like(wide)
    comm.Allreduce(wide, exact, op={"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op])
    if op == "mean":
        exact /= p
    if np.dtype(dtype).kind in "iu" and not compression:
        wrong = int(np.count_nonzero(y != exact.astype(dtype)))
    else:
        from ..arrays.codecs import wire_dtype
        from ..runtime.signature import finfo

        eps = finfo(wire_dtype(compression) if compression else dtype).eps
        magnitude = np.empty_like(wide)
        comm.Allreduce(np.abs(wide), magnitude, op=MPI.SUM)  # what the rounding errors scale with
        if op == "mean":
            magnitude /= p
        elif op in ("max", "min"):
            magnitude = np.abs(exact)
        half = compression == "fp16" or np.dtype(dtype) == np.float16
        floor = p * 2.0**-24 if half else 0.0  # float16's subnormal spacing: tiny values lose digits
        error = np.abs(y.astype(np.float64) - exact)
        wrong = int(np.count_nonzero(~(error <= 2 * (p + 1) * eps * magnitude + floor)))  # NaN: wrong
    digests = comm.allgather(hashlib.sha1(y.tobytes()).hexdigest())
    if len(set(digests)) > 1:
        wrong = y.size
    return comm.allreduce(wrong, op=MPI.MAX)


def check_arguments(args) -> None:
    """ValueError naming the setting, for what gflow.allreduce would refuse at every size."""
    from ..arrays.codecs import check_compression
    from ..runtime.config import config
    from ..runtime.signature import check_op

    if args.iters < 1 or args.warmup < 0:
        raise ValueError(f"-n must be >= 1 and -w >= 0, got -n {args.iters} -w {args.warmup}")
    for option, path in (("--json", args.json), ("--plot", args.plot)):  # (before the sizes run, not after)
        if path and not_a_new_file(path):
            raise ValueError(f"{option} {path!r}: expected a file in an existing folder")
    sizes_from(args.begin, args.end, args.factor)
    dtype = _dtype(args.dtype)
    try:
        check_op(args.op, dtype)
        if args.compression != "none":
            check_compression(args.compression, dtype)
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    if args.algorithm == "recursive_doubling" and args.end > config.small_message_bytes:
        raise ValueError(
            f"--algorithm recursive_doubling takes at most config.small_message_bytes = "
            f"{config.small_message_bytes} bytes; got -e {args.end}"
        )


def run(args, out=sys.stdout) -> int:
    """The benchmark under the current MPI world (every rank calls it). Returns the exit status."""
    from mpi4py import MPI

    import gflow

    from ..collectives.topology import discover
    from ..runtime.mpi import mpi_library

    comm = MPI.COMM_WORLD
    p, rank = comm.size, comm.rank
    dtype = _dtype(args.dtype)
    compression = None if args.compression == "none" else args.compression
    sizes = sizes_from(args.begin, args.end, args.factor)
    tty = rank == 0 and out.isatty()
    topology = discover(comm).describe() if p > 1 else "one rank"

    def say(line: str = "") -> None:
        if rank == 0:
            print(line, file=out, flush=True)

    say(f"# gflow {gflow.__version__} bench: allreduce on {p} rank(s), {topology}")
    say(f"# {mpi_library()}")
    say(
        f"# dtype {dtype.name}, op {args.op}, algorithm {args.algorithm}, compression {args.compression}, "
        f"{args.warmup} warm-up + {args.iters} timed calls per size, median of the slowest rank"
    )
    say("#")
    columns = ("size", 12), ("count", 12), ("type", 8), ("redop", 6), ("time", 10), ("algbw", 8), ("busbw", 8)
    header = " ".join(f"{name:>{width}}" for name, width in columns) + f" {'#wrong':>7}"
    say("# " + header[2:])
    say(f"# {'(B)':>10} {'(elements)':>12} {'':>8} {'':>6} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8}")
    rng = np.random.default_rng(1000 + rank)
    rows, failures = [], 0
    for nbytes in sizes:
        count = max(1, nbytes // dtype.itemsize)
        nbytes = count * dtype.itemsize
        if tty:
            print(f"  running {human(nbytes)} ...", end="\r", file=out, flush=True)
        x = _random(rng, count, dtype)
        y = np.empty_like(x)

        def call(x=x, y=y):
            gflow.allreduce(x, args.op, out=y, algorithm=args.algorithm, compression=compression)

        for _ in range(args.warmup):
            call()
        times = np.empty(args.iters)
        for i in range(args.iters):
            comm.Barrier()
            start = time.perf_counter()
            call()
            times[i] = time.perf_counter() - start
        slowest = np.empty_like(times)
        comm.Allreduce(times, slowest, op=MPI.MAX)
        seconds = float(np.median(slowest))
        wrong = None
        if args.check:
            x = _random(rng, count, dtype)
            gflow.allreduce(x, args.op, out=y, algorithm=args.algorithm, compression=compression)
            wrong = _wrong_elements(comm, x, y, args.op, dtype, compression)
            failures += wrong > 0
        algbw = nbytes / seconds / 1e9
        busbw = algbw * (2 * (p - 1) / p if p > 1 else 1.0)
        row = {"bytes": nbytes, "count": count, "type": dtype.name, "op": args.op, "time_us": seconds * 1e6,
               "algbw_GBps": algbw, "busbw_GBps": busbw, "wrong": wrong}  # fmt: skip
        rows.append(row)
        shown = "N/A" if wrong is None else str(wrong)
        say(
            f"{nbytes:>12} {count:>12} {dtype.name:>8} {args.op:>6} {seconds * 1e6:>10.1f} "
            f"{algbw:>8.2f} {busbw:>8.2f} {shown:>7}"
        )
    if rows:
        say(f"# average busbw: {np.mean([r['busbw_GBps'] for r in rows]):.2f} GB/s")
    if args.check:
        say("# every result matched MPI's Allreduce" if not failures else f"# {failures} size(s) WRONG")
    if rank == 0:
        settings = {
            k: getattr(args, k) for k in ("dtype", "op", "algorithm", "compression", "warmup", "iters")
        }
        report = {"ranks": p, "topology": topology, "mpi": mpi_library(),
                  "settings": settings, "rows": rows}  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
            say(f"# wrote {args.json}")
        if args.plot:
            _plot(report, args.plot, say)
    return 1 if failures else 0


def _random(rng, count: int, dtype):
    if dtype.kind in "iu":
        return rng.integers(-1000, 1000, count).astype(dtype)
    return rng.standard_normal(count).astype(dtype)


def _plot(report: dict, path: str, say) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("# no plot: matplotlib is not installed (pip install matplotlib)")
        return
    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows], marker="o", ms=3)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    s = report["settings"]
    ax.set_title(f"gflow allreduce, {report['ranks']} ranks, {s['dtype']} {s['op']}, {s['algorithm']}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    say(f"# wrote {path}")


def add_arguments(parser) -> None:
    parser.add_argument(
        "-b", "--minbytes", dest="begin", type=_size_argument, default=4096, help="smallest size (default 4K)"
    )
    parser.add_argument(
        "-e", "--maxbytes", dest="end", type=_size_argument, default=64 * 2**20, help="largest (default 64M)"
    )
    parser.add_argument(
        "-f", "--stepfactor", dest="factor", type=float, default=2.0, help="size growth per row (default 2)"
    )
    parser.add_argument("-n", "--iters", type=int, default=20, help="timed calls per size (default 20)")
    parser.add_argument("-w", "--warmup", type=int, default=3, help="untimed calls per size (default 3)")
    parser.add_argument("--op", default="sum", choices=["sum", "mean", "max", "min"])
    parser.add_argument(
        "--dtype", default="float32", choices=["float16", "bfloat16", "float32", "float64", "int32", "int64"]
    )
    parser.add_argument(
        "--algorithm", default="auto", choices=["auto", "ring", "hierarchical", "recursive_doubling"]
    )
    parser.add_argument("--compression", default="none", choices=["none", "fp16", "bf16"])
    parser.add_argument("-c", "--check", action="store_true", help="compare every size with MPI's Allreduce")
    parser.add_argument("--json", help="write the rows to this JSON file")
    parser.add_argument("--plot", help="write busbw against size to this PNG")
