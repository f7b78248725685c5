"""GPU check: each CUDA kernel against its NumPy twin and against the device's copy bandwidth, then
allreduce on device arrays at 2 and 4 ranks sharing the GPU, staged and (if the MPI is CUDA-aware) direct.

    bash bench/gpu_check.sh                # the wrapper: sets paths, bounds the time, then runs this
    python bench/gpu_check.py --size 256M  # kernels at 256 MB, then the allreduce runs

Installs nothing. Bandwidth counts bytes read + written; the reference is a device-to-device copy of
the same size measured the same way (bytes read + written). Prints a markdown table and writes JSON
to bench/out/gpu_check.json.
"""

import argparse
import os
import subprocess
import sys
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def parse_bytes(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def timed_gpu(fn, reps: int) -> float:
    """Median seconds of fn() with the device synchronized around each run."""
    from numba import cuda

    fn()
    cuda.synchronize()
    times = []
    for _ in range(reps):
        cuda.synchronize()
        t = time.perf_counter()
        fn()
        cuda.synchronize()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def kernel_rows(nbytes: int, reps: int, check_elems: int):
    """(name, correct, GB/s, bytes moved) for each kernel, plus the copy bandwidth."""
    from numba import cuda

    from gflow.cuda import ops as dev

    n = nbytes // 4
    rng = np.random.default_rng(0)
    a32 = cuda.to_device(rng.standard_normal(n, dtype=np.float32))
    b32 = cuda.to_device(rng.standard_normal(n, dtype=np.float32))
    out32 = cuda.device_array(n, np.float32)
    out16 = cuda.device_array(n, np.float16)
    bf_a, bf_b, out_bf = (cuda.device_array(n, np.uint16) for _ in range(3))  # bfloat16 as its bits
    dev.cast_scaled(bf_a, a32, 1.0)
    dev.cast_scaled(bf_b, b32, 1.0)
    chunk = 1024
    nchunks = (n + chunk - 1) // chunk
    ids = np.sort(rng.choice(nchunks, size=max(1, nchunks // 10), replace=False)).astype(np.int64)
    d_ids = cuda.to_device(ids)
    packed = cuda.device_array(ids.size * chunk, np.float32)
    norms = cuda.device_array(nchunks, np.float32)

    copy_s = timed_gpu(lambda: out32.copy_to_device(a32), reps)
    copy_bw = 2 * 4 * n / copy_s
    cases = [
        ("copy (kernel)", lambda: dev.copy(out32, a32), 8 * n),
        ("reduce sum f32", lambda: dev.reduce(out32, a32, b32, "sum"), 12 * n),
        ("reduce max f32", lambda: dev.reduce(out32, a32, b32, "max"), 12 * n),
        ("divide f32", lambda: dev.divide(out32, 3), 8 * n),
        ("cast f32->f16 x scale", lambda: dev.cast_scaled(out16, a32, 0.5), 6 * n),
        ("cast f16->f32 x scale", lambda: dev.cast_scaled(out32, out16, 2.0), 6 * n),
        ("reduce sum bf16", lambda: dev.reduce(out_bf, bf_a, bf_b, "sum"), 6 * n),
        ("reduce sum bf16 in place", lambda: dev.reduce(bf_a, bf_a, bf_b, "sum"), 6 * n),
        ("cast f32->bf16 x scale", lambda: dev.cast_scaled(out_bf, a32, 0.5), 6 * n),
        ("cast bf16->f32 x scale", lambda: dev.cast_scaled(out32, bf_b, 2.0), 6 * n),
        ("divide bf16", lambda: dev.divide(out_bf, 3), 4 * n),
        ("chunk L1 norms f32", lambda: dev.chunk_norms(a32, chunk, out=norms), 4 * n + 4 * nchunks),
        ("pack 10% of chunks", lambda: dev.pack(packed, a32, d_ids, chunk), 8 * packed.size),
        ("scatter-add 10% of chunks", lambda: dev.scatter_add(out32, packed, d_ids, chunk), 12 * packed.size),
    ]
    rows = []
    for name, fn, moved in cases:
        seconds = timed_gpu(fn, reps)
        rows.append({"kernel": name, "GBps": moved / seconds / 1e9, "of_copy": moved / seconds / copy_bw})
    correctness = check_kernels(check_elems)
    for row in rows:
        row["correct"] = correctness[row["kernel"]]
    return rows, copy_bw


def check_kernels(n: int) -> dict:
    """Each kernel against its host twin on random data, outputs poisoned first."""
    from numba import cuda

    from gflow.arrays import host_ops as host
    from gflow.cuda import ops as dev

    rng = np.random.default_rng(1)
    a = rng.standard_normal(n, dtype=np.float32) * 3
    b = rng.standard_normal(n, dtype=np.float32) * 3
    d_a, d_b = cuda.to_device(a), cuda.to_device(b)

    def poisoned(count, dtype):
        return cuda.to_device(np.full(count, np.nan, dtype=dtype))

    def same(device, expected, exact=True):
        got = device.copy_to_host()
        return bool(np.array_equal(got, expected) if exact else np.allclose(got, expected, rtol=1e-5))

    ok = {}
    o = poisoned(n, np.float32)
    dev.copy(o, d_a)
    ok["copy (kernel)"] = same(o, a)
    for op in ("sum", "max"):
        o, e = poisoned(n, np.float32), np.empty(n, np.float32)
        dev.reduce(o, d_a, d_b, op)
        host.reduce(e, a, b, op)
        ok[f"reduce {op} f32"] = same(o, e)
    o = cuda.to_device(a)
    dev.divide(o, 3)
    e = a.copy()
    host.divide(e, 3)
    ok["divide f32"] = same(o, e)
    o16, e16 = poisoned(n, np.float16), np.empty(n, np.float16)
    flags = dev.cast_scaled(o16, d_a, 0.5), host.cast_scaled(e16, a, 0.5)
    ok["cast f32->f16 x scale"] = same(o16, e16) and flags[0] == flags[1]
    o, e = poisoned(n, np.float32), np.empty(n, np.float32)
    flags = dev.cast_scaled(o, cuda.to_device(e16), 2.0), host.cast_scaled(e, e16, 2.0)
    ok["cast f16->f32 x scale"] = same(o, e) and flags[0] == flags[1]
    # bfloat16: uint16 bits on the device, ml_dtypes.bfloat16 on the host; bit-identical twins
    a_bf, b_bf = a.astype(ml_dtypes.bfloat16), b.astype(ml_dtypes.bfloat16)
    d_abf, d_bbf = cuda.to_device(a_bf.view(np.uint16)), cuda.to_device(b_bf.view(np.uint16))
    o, e = cuda.to_device(np.full(n, 0x7FBF, np.uint16)), np.empty(n, ml_dtypes.bfloat16)
    dev.reduce(o, d_abf, d_bbf, "sum")
    host.reduce(e, a_bf, b_bf, "sum")
    ok["reduce sum bf16"] = same(o, e.view(np.uint16))
    dev.reduce(d_abf, d_abf, d_bbf, "sum")
    ok["reduce sum bf16 in place"] = same(d_abf, e.view(np.uint16))
    o, e = cuda.to_device(np.full(n, 0x7FBF, np.uint16)), np.empty(n, ml_dtypes.bfloat16)
    flags = dev.cast_scaled(o, d_a, 0.5), host.cast_scaled(e, a, 0.5)
    ok["cast f32->bf16 x scale"] = same(o, e.view(np.uint16)) and flags[0] == flags[1]
    o32, e32 = poisoned(n, np.float32), np.empty(n, np.float32)
    flags = dev.cast_scaled(o32, d_bbf, 2.0), host.cast_scaled(e32, b_bf, 2.0)
    ok["cast bf16->f32 x scale"] = same(o32, e32) and flags[0] == flags[1]
    dev.divide(d_bbf, 3)
    host.divide(b_bf, 3)
    ok["divide bf16"] = same(d_bbf, b_bf.view(np.uint16))
    chunk = 1000
    ok["chunk L1 norms f32"] = same(dev.chunk_norms(d_a, chunk), host.chunk_norms(a, chunk), exact=False)
    nchunks = (n + chunk - 1) // chunk
    ids = np.sort(rng.choice(nchunks, size=max(1, nchunks // 10), replace=False)).astype(np.int64)
    size = sum(min(chunk, n - i * chunk) for i in ids)
    o, e = poisoned(size, np.float32), np.empty(size, np.float32)
    dev.pack(o, d_a, cuda.to_device(ids), chunk)
    host.pack(e, a, ids, chunk)
    ok["pack 10% of chunks"] = same(o, e)
    target, e_target = cuda.to_device(b), b.copy()
    dev.scatter_add(target, o, cuda.to_device(ids), chunk)
    host.scatter_add(e_target, e, ids, chunk)
    ok["scatter-add 10% of chunks"] = same(target, e_target)
    return ok


def allreduce_worker(sizes: list[int], reps: int) -> None:
    """Under mpiexec: gflow.allreduce on CuPy arrays (Numba ones if CuPy is missing), checked."""
    from mpi4py import MPI

    import gflow
    from gflow.cuda import transport

    comm = MPI.COMM_WORLD
    try:
        import cupy as xp

        kind = "cupy"
    except ImportError:
        xp, kind = None, "numba"
    from numba import cuda

    for nbytes in sizes:
        host_x = np.random.default_rng(comm.rank).standard_normal(nbytes // 4).astype(np.float32)
        d = xp.asarray(host_x) if xp else cuda.to_device(host_x)
        out = xp.empty_like(d) if xp else cuda.device_array_like(d)
        result = gflow.allreduce(d, out=out)
        got = xp.asnumpy(result) if xp else result.copy_to_host()
        exact = np.sum(comm.allgather(host_x.astype(np.float64)), axis=0)
        ok = bool(np.allclose(got, exact, rtol=1e-4, atol=1e-4 * comm.size))
        ok = all(comm.allgather(ok))
        times = []
        for _ in range(reps):
            times.append(_common.timed(comm, lambda d=d, out=out: gflow.allreduce(d, out=out)))
        ref = np.empty_like(host_x)
        mpi_times = [_common.timed(comm, lambda h=host_x, r=ref: comm.Allreduce(h, r)) for _ in range(reps)]
        if comm.rank == 0:
            t, m = float(np.median(times)), float(np.median(mpi_times))
            print(
                f"| {comm.size} | {transport.describe()} | {kind} | {_common.human_bytes(nbytes)} | "
                f"{'yes' if ok else 'NO'} | {t * 1e3:.3f} | {nbytes / t / 1e9:.2f} | {m * 1e3:.3f} |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=parse_bytes, default=256 * 2**20, help="kernel benchmark size")
    parser.add_argument("--check-elems", type=int, default=1_000_003)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--allreduce-sizes", default="4M,64M")
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--allreduce-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [parse_bytes(s) for s in args.allreduce_sizes.split(",")]
    if args.allreduce_worker:
        allreduce_worker(sizes, args.reps)
        return

    rows, copy_bw = kernel_rows(args.size, args.reps, args.check_elems)
    print(f"kernels at {_common.human_bytes(args.size)} of float32; device copy: {copy_bw / 1e9:.1f} GB/s")
    print("| kernel | correct vs NumPy | GB/s | of copy bandwidth |")
    print("|---|---|---|---|")
    for row in rows:
        correct = "yes" if row["correct"] else "NO"
        print(f"| {row['kernel']} | {correct} | {row['GBps']:.1f} | {row['of_copy']:.0%} |")

    print(
        "\nallreduce on device arrays, ranks sharing one GPU (MPI's own Allreduce on host copies beside it)"
    )
    print("| p | transport | arrays | size | correct | gflow (ms) | algbw (GB/s) | MPI host (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    from gflow.cuda import transport

    modes = ["0"] + (["1"] if transport.cuda_aware() else [])
    for p in args.procs:
        for mode in modes:
            env = dict(os.environ, GFLOW_CUDA_AWARE_MPI=mode)
            worker_args = [
                "--allreduce-worker",
                "--allreduce-sizes",
                args.allreduce_sizes,
                "--reps",
                str(args.reps),
            ]
            try:
                _common.launch(os.path.abspath(__file__), p, worker_args, env=env, timeout=240)
            except subprocess.SubprocessError as exc:
                print(f"| {p} | {'direct' if mode == '1' else 'staged'} | - | - | FAILED: {exc} | | | |")
    if len(modes) == 1:
        print("(the MPI library does not report CUDA support: the direct transport was not run)")
    _common.write_json(os.path.join(OUT, "gpu_check.json"), {"copy_Bps": copy_bw, "kernels": rows})


if __name__ == "__main__":
    main()
