"""Host speed of the 16-bit loops (gflow/arrays/half_kernels.py) against memcpy, counted alike:
bytes read + written.

    python bench/half_host.py                 # 16M elements, 15 repetitions, one process
    python bench/half_host.py --elements 4M --reps 5

For float16 and bfloat16: encode (float32 -> 16-bit, what compression does before the wire), decode
(16-bit -> float32, after it) and reduce (a + b -> out in 16-bit, what every ring step does), each
against np.copyto of a float32 array of the same element count. The contenders alternate, one run each,
again and again; the figure is the median. NumPy's and ml_dtypes' own casts are listed for contrast.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gflow.arrays import host_ops as host  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


def parse_count(text: str) -> int:
    units = {"K": 2**10, "M": 2**20}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def contenders(n: int):
    """name -> (callable, bytes read + written per run)."""
    rng = np.random.default_rng()
    x32 = rng.standard_normal(n).astype(np.float32)
    copy_out = np.empty_like(x32)
    runs = {"memcpy (np.copyto, float32)": (lambda: np.copyto(copy_out, x32), 8 * n)}
    for name, dtype in (("fp16", np.dtype(np.float16)), ("bf16", BF16)):
        wire = x32.astype(dtype)
        other = rng.standard_normal(n).astype(np.float32).astype(dtype)
        out16, out32 = np.empty(n, dtype), np.empty(n, np.float32)
        runs[f"{name} encode (gflow)"] = (lambda w=out16: host.cast_scaled(w, x32, 1.0), 6 * n)
        runs[f"{name} decode (gflow)"] = (lambda w=wire, o=out32: host.cast_scaled(o, w, 1.0), 6 * n)
        runs[f"{name} reduce (gflow)"] = (lambda a=wire, b=other, o=out16: host.reduce(o, a, b, "sum"), 6 * n)
        acc = wire.copy()  # in place, as the ring's steps reduce (its values grow by `other` each run)
        runs[f"{name} reduce in place (gflow)"] = (lambda a=acc, b=other: host.reduce(a, a, b, "sum"), 6 * n)
        runs[f"{name} encode (NumPy astype)"] = (lambda w=out16: np.copyto(w, x32, casting="unsafe"), 6 * n)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--elements", type=parse_count, default=16 * 2**20)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    runs = contenders(args.elements)
    for fn, _ in runs.values():
        fn()  # compile (Numba, cached) and fault the pages in
    times = {name: [] for name in runs}
    for rep in range(args.reps):
        for name, (fn, _) in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
        print(f"repetition {rep + 1}/{args.reps}", file=sys.stderr, flush=True)
    memcpy = None
    print(f"| operation | {args.elements} elements (ms) | GB/s (read + written) | of memcpy |")
    print("|---|---|---|---|")
    for name, (_, nbytes) in runs.items():
        t = float(np.median(times[name]))
        rate = nbytes / t / 1e9
        memcpy = memcpy or rate
        print(f"| {name} | {t * 1e3:.2f} | {rate:.2f} | {rate / memcpy:.0%} |")


if __name__ == "__main__":
    main()
