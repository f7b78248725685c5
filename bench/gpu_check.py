"""GPU check: each CUDA kernel against its NumPy twin and against the device's copy bandwidth, then
allreduce on device arrays at 2 and 4 ranks sharing the GPU, staged and (if the MPI is CUDA-aware) direct.

    bash bench/gpu_check.sh                # the wrapper: sets paths, bounds the time, then runs this
    python bench/gpu_check.py --size 256M  # kernels at 256 MB, then the allreduce runs

Installs nothing. Bandwidth counts bytes read + written; the reference is a device-to-device copy of
the same size measured the same way (bytes read + written). Prints a markdown table and writes the
kernels' JSON, as soon as they are measured, to gpu_check.json in --out ($OUT, else bench/out).
"""

import argparse
import math
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
    return timed_round_robin([fn], reps, events=False)[0][0]


_SPIN = None


def _spin_kernel():
    """A one-thread kernel that keeps the default stream busy for about a millisecond, so that the
    launches queued behind it (and their events) run back to back: the event interval is then the
    kernel's own time, not Python's launch overhead."""
    global _SPIN
    if _SPIN is None:
        from numba import cuda

        @cuda.jit
        def spin(x, n):
            acc = x[0]
            for _ in range(n):
                acc = acc * 0.999 + 1.0
            x[0] = acc

        _SPIN = spin, cuda.to_device(np.zeros(1, np.float32))
    return _SPIN


def timed_round_robin(fns, reps: int, events: bool = True):
    """For each fn: (median seconds by the host timer with the device synchronized around each call,
    median seconds between CUDA events recorded around the call queued behind a busy kernel or None).
    The fns take turns, rep by rep, so a before/after pair sees the same device state."""
    from numba import cuda

    from gflow.cuda.memory import SIMULATED

    spin, spin_x = _spin_kernel()
    spin_n = 1 if SIMULATED else 500_000
    for fn in fns:
        fn()
    cuda.synchronize()
    host = [[] for _ in fns]
    event = [[] for _ in fns]
    for _ in range(reps):
        for k, fn in enumerate(fns):
            cuda.synchronize()
            t = time.perf_counter()
            fn()
            cuda.synchronize()
            host[k].append(time.perf_counter() - t)
            if events:
                start, stop = cuda.event(), cuda.event()
                spin[1, 1](spin_x, spin_n)
                start.record()
                fn()
                stop.record()
                stop.synchronize()
                event[k].append(start.elapsed_time(stop) / 1e3)
    return [
        (float(np.median(h)), float(np.median(e)) if events and min(e) > 0 else None)
        for h, e in zip(host, event, strict=True)
    ]


# The kernels before issue 26's rework (the [before] contenders); module level, where the simulator
# finds `cuda` to replace.
from numba import cuda, float32, uint16  # noqa: E402

from gflow.cuda.kernels import _from_bf16, _to_bf16  # noqa: E402


@cuda.jit
def _old_cast_scaled(dst, src, scale, limit, flag):
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < dst.size:
        v = src[i] * scale
        if not abs(v) <= limit:
            flag[0] = 1
        dst[i] = v
        i += stride


@cuda.jit
def _old_encode_bf16(dst, src, scale, flag):
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < dst.size:
        h = _to_bf16(float32(src[i]) * scale)
        if (h & uint16(0x7F80)) == uint16(0x7F80):
            flag[0] = 1
        dst[i] = h
        i += stride


@cuda.jit
def _old_decode_bf16(dst, src, scale, flag):
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < dst.size:
        v = _from_bf16(src[i]) * scale
        if not abs(v) < math.inf:
            flag[0] = 1
        dst[i] = v
        i += stride


@cuda.jit
def _old_pack(dst, src, ids, chunk):
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < dst.size:
        s = ids[i // chunk] * chunk + i % chunk
        if s < src.size:
            dst[i] = src[s]
        i += stride


@cuda.jit
def _old_scatter_add(dst, packed, ids, chunk):
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < packed.size:
        d = ids[i // chunk] * chunk + i % chunk
        if d < dst.size:
            dst[d] += packed[i]
        i += stride


@cuda.jit
def _old_zero_chunks(x, ids, chunk):
    i, stride = cuda.grid(1), cuda.gridsize(1)
    while i < ids.size * chunk:
        d = ids[i // chunk] * chunk + i % chunk
        if d < x.size:
            x[d] = 0
        i += stride


def _before():
    """The kernels and ops as they were before issue 26's rework (the 'before' contenders): a fresh
    flag array per cast, per-element 64-bit division in the chunk kernels, one element per thread."""
    from types import SimpleNamespace

    from numba import cuda

    from gflow.cuda import ops as dev

    cast_scaled_k, encode_bf16, decode_bf16 = _old_cast_scaled, _old_encode_bf16, _old_decode_bf16
    pack_k, scatter_add_k, zero_chunks_k = _old_pack, _old_scatter_add, _old_zero_chunks
    bits = np.dtype(np.uint16)

    def cast_scaled(dst, src, scale):
        flag = cuda.to_device(np.zeros(1, dtype=np.int32))
        if dst.size:
            blocks, threads = dev._grid(dst.size)
            if dst.dtype == bits and src.dtype != bits:
                encode_bf16[blocks, threads](dst, src, np.float32(scale), flag)
            elif src.dtype == bits and dst.dtype != bits:
                decode_bf16[blocks, threads](dst, src, np.float32(scale), flag)
            elif dst.dtype == bits:
                wide = cuda.device_array(src.size, np.float32)
                decode_bf16[blocks, threads](wide, src, np.float32(scale), flag)
                encode_bf16[blocks, threads](dst, wide, np.float32(1.0), flag)
            else:
                limit = float(np.finfo(dst.dtype).max)
                cast_scaled_k[blocks, threads](dst, src, np.float32(scale), limit, flag)
        return bool(flag.copy_to_host()[0])

    def chunked(kernel, count):
        def launch(a, b, ids, chunk):
            if count(a, b, ids, chunk):
                blocks, threads = dev._grid(count(a, b, ids, chunk))
                kernel[blocks, threads](a, b, ids, chunk)

        return launch

    def zero_chunks(x, ids, chunk):
        if ids.size:
            blocks, threads = dev._grid(ids.size * chunk)
            zero_chunks_k[blocks, threads](x, ids, chunk)

    return SimpleNamespace(
        cast_scaled=cast_scaled,
        cast_scaled_k=cast_scaled_k,
        encode_bf16=encode_bf16,
        decode_bf16=decode_bf16,
        pack=chunked(pack_k, lambda dst, src, ids, chunk: dst.size),
        scatter_add=chunked(scatter_add_k, lambda dst, packed, ids, chunk: packed.size),
        zero_chunks=zero_chunks,
        pack_k=pack_k,
        scatter_add_k=scatter_add_k,
        zero_chunks_k=zero_chunks_k,
    )


BEFORE = " [before]"


def kernel_rows(nbytes: int, reps: int, check_elems: int):
    """Per kernel: name, correct, GB/s and share of the copy bandwidth by the host timer (the whole
    call: GBps, of_copy) and by CUDA events around the kernel alone (kernel_GBps, kernel_of_copy);
    plus the copy bandwidth (host timer, and events). Rows marked [before] are the pre-rework
    versions, timed alternately with the new ones."""
    from numba import cuda

    from gflow.cuda import kernels
    from gflow.cuda import ops as dev

    old = _before()
    n = nbytes // 4
    rng = np.random.default_rng(0)
    a32 = cuda.to_device(rng.standard_normal(n, dtype=np.float32))
    b32 = cuda.to_device(rng.standard_normal(n, dtype=np.float32))
    out32 = cuda.device_array(n, np.float32)
    out16 = cuda.device_array(n, np.float16)
    bf_a, bf_b, out_bf = (cuda.device_array(n, np.uint16) for _ in range(3))  # bfloat16 as its bits
    dev.cast_scaled(bf_a, a32, 1.0)
    dev.cast_scaled(bf_b, b32, 1.0)
    dev.cast_scaled(out16, a32, 0.5)
    chunk = 1024
    nchunks = (n + chunk - 1) // chunk
    ids = np.sort(rng.choice(nchunks, size=max(1, nchunks // 10), replace=False)).astype(np.int64)
    d_ids = cuda.to_device(ids)
    packed = cuda.device_array(ids.size * chunk, np.float32)
    dev.pack(packed, a32, d_ids, chunk)
    norms = cuda.device_array(nchunks, np.float32)
    flag = dev._flag()
    old_flag = cuda.to_device(np.zeros(1, np.int32))
    g = dev._grid(n)
    cg = dev._chunk_grid(ids.size, chunk)
    gp = dev._grid(packed.size)
    s_half, s_two = np.float32(0.5), np.float32(2.0)
    wide = cuda.device_array(n, np.float32)

    def old_bf_bf_kernels():
        old.decode_bf16[g](wide, bf_b, s_half, old_flag)
        old.encode_bf16[g](out_bf, wide, np.float32(1.0), old_flag)

    parts = [a32, b32, cuda.to_device(rng.standard_normal(n, dtype=np.float32)), wide]
    quarters = [q * n // 4 for q in range(5)]

    def copies(out, blocks, bounds):
        for q, block in enumerate(blocks):
            dev.copy(out[bounds[q] : bounds[q + 1]], block[bounds[q] : bounds[q + 1]])

    copy_host, copy_event = timed_round_robin([lambda: out32.copy_to_device(a32)], reps)[0]
    copy_bw = 2 * 4 * n / copy_host
    copy_bw_event = 2 * 4 * n / copy_event if copy_event else None
    # (name, the ops call, the kernel(s) alone, bytes moved); a list of two is a new/before pair.
    groups = [
        [("copy (kernel)", lambda: dev.copy(out32, a32), lambda: kernels.copy[g](out32, a32), 8 * n)],
        [("reduce sum f32", lambda: dev.reduce(out32, a32, b32, "sum"), None, 12 * n)],
        [("reduce max f32", lambda: dev.reduce(out32, a32, b32, "max"), None, 12 * n)],
        [("divide f32", lambda: dev.divide(out32, 3), None, 8 * n)],
        [  # (the node phase's k-way fold and allgather at k = 4: one launch against the pairwise/copies)
            ("reduce_many sum f32 k=4", lambda: dev.reduce_many(out32, parts, "sum"), None, 20 * n),
            (
                "reduce_many sum f32 k=4" + BEFORE,
                lambda: dev._reduce_pairwise(out32, parts, "sum"),
                None,
                20 * n,
            ),
        ],
        [
            ("gather f32 k=4", lambda: dev.gather(out32, parts, quarters), None, 8 * n),
            ("gather f32 k=4" + BEFORE, lambda: copies(out32, parts, quarters), None, 8 * n),
        ],
        [
            (
                "cast f32->f16 x scale",
                lambda: dev.cast_scaled(out16, a32, 0.5),
                lambda: kernels.encode_f16[g](out16, a32, s_half, flag),
                6 * n,
            ),
            (
                "cast f32->f16 x scale" + BEFORE,
                lambda: old.cast_scaled(out16, a32, 0.5),
                lambda: old.cast_scaled_k[g](out16, a32, s_half, 65504.0, old_flag),
                6 * n,
            ),
        ],
        [
            (
                "cast f16->f32 x scale",
                lambda: dev.cast_scaled(out32, out16, 2.0),
                lambda: kernels.decode_f16[g](out32, out16, s_two, flag),
                6 * n,
            ),
            (
                "cast f16->f32 x scale" + BEFORE,
                lambda: old.cast_scaled(out32, out16, 2.0),
                lambda: old.cast_scaled_k[g](out32, out16, s_two, float(np.finfo(np.float32).max), old_flag),
                6 * n,
            ),
        ],
        [("reduce sum bf16", lambda: dev.reduce(out_bf, bf_a, bf_b, "sum"), None, 6 * n)],
        [("reduce sum bf16 in place", lambda: dev.reduce(bf_a, bf_a, bf_b, "sum"), None, 6 * n)],
        [
            (
                "cast f32->bf16 x scale",
                lambda: dev.cast_scaled(out_bf, a32, 0.5),
                lambda: kernels.encode_bf16[g](out_bf, a32, s_half, flag),
                6 * n,
            ),
            (
                "cast f32->bf16 x scale" + BEFORE,
                lambda: old.cast_scaled(out_bf, a32, 0.5),
                lambda: old.encode_bf16[g](out_bf, a32, s_half, old_flag),
                6 * n,
            ),
        ],
        [
            (
                "cast bf16->f32 x scale",
                lambda: dev.cast_scaled(out32, bf_b, 2.0),
                lambda: kernels.decode_bf16[g](out32, bf_b, s_two, flag),
                6 * n,
            ),
            (
                "cast bf16->f32 x scale" + BEFORE,
                lambda: old.cast_scaled(out32, bf_b, 2.0),
                lambda: old.decode_bf16[g](out32, bf_b, s_two, old_flag),
                6 * n,
            ),
        ],
        [
            (
                "cast bf16->bf16 x scale",
                lambda: dev.cast_scaled(out_bf, bf_b, 0.5),
                lambda: kernels.rescale_bf16[g](out_bf, bf_b, s_half, flag),
                4 * n,
            ),
            (
                "cast bf16->bf16 x scale" + BEFORE,
                lambda: old.cast_scaled(out_bf, bf_b, 0.5),
                old_bf_bf_kernels,
                4 * n,
            ),
        ],
        [("divide bf16", lambda: dev.divide(out_bf, 3), None, 4 * n)],
        [("chunk L1 norms f32", lambda: dev.chunk_norms(a32, chunk, out=norms), None, 4 * n + 4 * nchunks)],
        [
            (
                "pack 10% of chunks",
                lambda: dev.pack(packed, a32, d_ids, chunk),
                lambda: kernels.pack[cg](packed, a32, d_ids, chunk),
                8 * packed.size,
            ),
            (
                "pack 10% of chunks" + BEFORE,
                lambda: old.pack(packed, a32, d_ids, chunk),
                lambda: old.pack_k[gp](packed, a32, d_ids, chunk),
                8 * packed.size,
            ),
        ],
        [
            (
                "scatter-add 10% of chunks",
                lambda: dev.scatter_add(out32, packed, d_ids, chunk),
                lambda: kernels.scatter_add[cg](out32, packed, d_ids, chunk),
                12 * packed.size,
            ),
            (
                "scatter-add 10% of chunks" + BEFORE,
                lambda: old.scatter_add(out32, packed, d_ids, chunk),
                lambda: old.scatter_add_k[gp](out32, packed, d_ids, chunk),
                12 * packed.size,
            ),
        ],
        [
            (
                "zero 10% of chunks",
                lambda: dev.zero_chunks(out32, d_ids, chunk),
                lambda: kernels.zero_chunks[cg](out32, d_ids, chunk),
                4 * packed.size,
            ),
            (
                "zero 10% of chunks" + BEFORE,
                lambda: old.zero_chunks(out32, d_ids, chunk),
                lambda: old.zero_chunks_k[gp](out32, d_ids, chunk),
                4 * packed.size,
            ),
        ],
    ]
    rows = []
    for group in groups:
        calls = timed_round_robin([fn for _, fn, _, _ in group], reps, events=False)
        alone = timed_round_robin([kern or fn for _, fn, kern, _ in group], reps)
        for (name, _, _, moved), (seconds, _), (_, kernel_s) in zip(group, calls, alone, strict=True):
            row = {"kernel": name, "GBps": moved / seconds / 1e9, "of_copy": moved / seconds / copy_bw}
            row["kernel_GBps"] = moved / kernel_s / 1e9 if kernel_s else None
            row["kernel_of_copy"] = moved / kernel_s / copy_bw_event if kernel_s and copy_bw_event else None
            rows.append(row)
    correctness = check_kernels(check_elems, dev)
    correctness.update({k + BEFORE: v for k, v in check_kernels(check_elems, old).items()})
    for row in rows:
        row["correct"] = correctness.get(row["kernel"], correctness.get(row["kernel"].replace(BEFORE, "")))
    timed = {row["kernel"] for row in rows} | {row["kernel"].replace(BEFORE, "") for row in rows}
    untimed = {name: ok for name, ok in correctness.items() if name not in timed and BEFORE not in name}
    return rows, copy_bw, copy_bw_event, untimed


def check_kernels(n: int, impl=None) -> dict:
    """Each kernel against its host twin on random data, outputs poisoned first. impl: the module
    (or _before()'s namespace) whose cast_scaled, pack, scatter_add and zero_chunks are checked."""
    from numba import cuda

    from gflow.arrays import host_ops as host
    from gflow.cuda import ops as dev

    impl = impl or dev
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
    c = rng.standard_normal(n, dtype=np.float32)
    parts, host_parts = [d_a, d_b, cuda.to_device(c), d_a], [a, b, c, a]
    quarters = [q * n // 4 for q in range(5)]
    o, e = poisoned(n, np.float32), np.empty(n, np.float32)
    dev.reduce_many(o, parts, "sum")  # (one launch; the pairwise fold before it is _reduce_pairwise)
    host.reduce_many(e, host_parts, "sum")
    ok["reduce_many sum f32 k=4"] = same(o, e)
    o, e = poisoned(n, np.float32), np.empty(n, np.float32)
    dev.gather(o, parts, quarters)
    host.gather(e, host_parts, quarters)
    ok["gather f32 k=4"] = same(o, e)
    o16, e16 = poisoned(n, np.float16), np.empty(n, np.float16)
    flags = impl.cast_scaled(o16, d_a, 0.5), host.cast_scaled(e16, a, 0.5)
    ok["cast f32->f16 x scale"] = same(o16, e16) and flags[0] == flags[1]
    o, e = poisoned(n, np.float32), np.empty(n, np.float32)
    flags = impl.cast_scaled(o, cuda.to_device(e16), 2.0), host.cast_scaled(e, e16, 2.0)
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
    flags = impl.cast_scaled(o, d_bbf, 0.5), host.cast_scaled(e, b_bf, 0.5)
    ok["cast bf16->bf16 x scale"] = same(o, e.view(np.uint16)) and flags[0] == flags[1]
    o, e = cuda.to_device(np.full(n, 0x7FBF, np.uint16)), np.empty(n, ml_dtypes.bfloat16)
    flags = impl.cast_scaled(o, d_a, 0.5), host.cast_scaled(e, a, 0.5)
    ok["cast f32->bf16 x scale"] = same(o, e.view(np.uint16)) and flags[0] == flags[1]
    o32, e32 = poisoned(n, np.float32), np.empty(n, np.float32)
    flags = impl.cast_scaled(o32, d_bbf, 2.0), host.cast_scaled(e32, b_bf, 2.0)
    ok["cast bf16->f32 x scale"] = same(o32, e32) and flags[0] == flags[1]
    dev.divide(d_bbf, 3)
    host.divide(b_bf, 3)
    ok["divide bf16"] = same(d_bbf, b_bf.view(np.uint16))
    chunk = 1000
    ok["chunk L1 norms f32"] = same(dev.chunk_norms(d_a, chunk), host.chunk_norms(a, chunk), exact=False)
    nchunks = (n + chunk - 1) // chunk
    ids = np.sort(rng.choice(nchunks, size=max(1, nchunks // 10), replace=False)).astype(np.int64)
    ids[-1] = nchunks - 1  # the short last chunk too
    ids = np.unique(ids)
    size = sum(min(chunk, n - i * chunk) for i in ids)
    o, e = poisoned(size, np.float32), np.empty(size, np.float32)
    impl.pack(o, d_a, cuda.to_device(ids), chunk)
    host.pack(e, a, ids, chunk)
    ok["pack 10% of chunks"] = same(o, e)
    target, e_target = cuda.to_device(b), b.copy()
    impl.scatter_add(target, o, cuda.to_device(ids), chunk)
    host.scatter_add(e_target, e, ids, chunk)
    ok["scatter-add 10% of chunks"] = same(target, e_target)
    impl.zero_chunks(target, cuda.to_device(ids), chunk)
    host.zero_chunks(e_target, ids, chunk)
    ok["zero 10% of chunks"] = same(target, e_target)
    # CSC's momentum correction: the host path fuses it with the norms (fastmath, may contract
    # momentum * u + g into an FMA, as NVVM does by default); the simulator rounds twice (helper-55)
    if impl is dev:
        u, v, g = (rng.standard_normal(n, dtype=np.float32) for _ in range(3))
        u_dev, v_dev = poisoned(n, np.float32), poisoned(n, np.float32)
        dev.accumulate(u_dev, v_dev, cuda.to_device(u), cuda.to_device(v), cuda.to_device(g), 0.9)
        u_fused, v_fused = np.empty(n, np.float32), np.empty(n, np.float32)
        host.accumulate_norms(u_fused, v_fused, u, v, g, 0.9, chunk)
        u_plain, v_plain = np.empty(n, np.float32), np.empty(n, np.float32)
        host.accumulate(u_plain, v_plain, u, v, g, 0.9)
        ok["accumulate momentum 0.9 = host fused"] = same(u_dev, u_fused) and same(v_dev, v_fused)
        ok["accumulate momentum 0.9 = host plain"] = same(u_dev, u_plain) and same(v_dev, v_plain)
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
    parser.add_argument("--out", default=os.environ.get("OUT") or OUT, help="where gpu_check.json goes")
    parser.add_argument("--allreduce-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [parse_bytes(s) for s in args.allreduce_sizes.split(",")]
    if args.allreduce_worker:
        allreduce_worker(sizes, args.reps)
        return

    rows, copy_bw, copy_bw_event, untimed = kernel_rows(args.size, args.reps, args.check_elems)
    result = os.path.join(args.out, "gpu_check.json")  # (written now: the allreduces may run out of time)
    _common.write_json(
        result, {"copy_Bps": copy_bw, "copy_event_Bps": copy_bw_event, "kernels": rows, "bits": untimed}
    )
    event_note = (
        f"{copy_bw_event / 1e9:.1f} GB/s by CUDA events" if copy_bw_event else "no CUDA event timings"
    )
    print(
        f"kernels at {_common.human_bytes(args.size)} of float32; device copy: {copy_bw / 1e9:.1f} GB/s "
        f"by the host timer, {event_note}"
    )
    print(
        "(call: the ops function, host timer with the device synchronized around it; kernel: the kernel "
        "alone between CUDA events, queued behind a busy kernel. [before]: the version before issue 26)"
    )
    print("| kernel | correct vs NumPy | call GB/s | call of copy | kernel GB/s | kernel of copy |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        correct = "yes" if row["correct"] else "NO"
        kernel_bw = f"{row['kernel_GBps']:.1f}" if row["kernel_GBps"] else "-"
        kernel_share = f"{row['kernel_of_copy']:.0%}" if row["kernel_of_copy"] else "-"
        print(
            f"| {row['kernel']} | {correct} | {row['GBps']:.1f} | {row['of_copy']:.0%} | "
            f"{kernel_bw} | {kernel_share} |"
        )
    print("bit-identical to the host twin, not timed: " + ", ".join(f"{k}: {v}" for k, v in untimed.items()))

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


if __name__ == "__main__":
    main()
