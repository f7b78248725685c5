"""bfloat16 (issue 13): as a dtype of the collectives (NumPy arrays of ml_dtypes.bfloat16, torch
tensors, device arrays), and as compression="bf16" on the wire, against float64 NumPy references.

Error bound of a bfloat16 sum (stated once, used below): bfloat16 keeps 8 significant bits, so each
rounding to nearest is off by at most half a unit in the last place, 2**-8 of the value rounded. The
ring (and recursive doubling) rounds each partial sum once per step, at most p - 1 times, and every
partial sum is bounded by the sum of the magnitudes S = sum_r |x_r|; so |result - exact| <=
(p - 1) * 2**-8 * S, plus, with compression, each rank's own rounding of its input (2**-8 |x_r|, at most
2**-8 S in all) and, for a mean, one more rounding of the result. The tests allow (p + 1) * 2**-8 * S
(over p for a mean), plus the smallest subnormal bfloat16 per rounding for values that underflow.
"""

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from helpers import WORLD, assert_same_on_all_ranks, on_all_ranks, rank_rng
from numba import cuda

import gflow
from gflow.arrays import host_ops as host
from gflow.cuda import ops as dev

BF16 = np.dtype(ml_dtypes.bfloat16)
SIZES = [1, 2, 3, 4]
TINY = float(np.finfo(BF16).smallest_subnormal)


def fresh_rng():
    """Different values every run, the same seed on every rank (then mixed with the rank)."""
    seed = WORLD.bcast(int(np.random.SeedSequence().entropy % 2**32))
    return rank_rng(seed)


def everyone64(x):
    return np.stack(WORLD.allgather(np.asarray(x, dtype=np.float64)))


def bf16_bound(x64, op):
    """The error bound of the module docstring for the float64 values x64 (every rank's stacked)."""
    p = x64.shape[0]
    magnitude = np.abs(x64).sum(axis=0)
    if op == "mean":
        magnitude = magnitude / p
    return (p + 1) * 2.0**-8 * magnitude + (p + 1) * TINY


def assert_bf16_close(y, x64, op):
    y64 = np.asarray(y, dtype=np.float64)
    if op in ("max", "min"):
        np.testing.assert_array_equal(y64, getattr(np, op)(x64, axis=0))
        return
    exact = x64.sum(axis=0) / (x64.shape[0] if op == "mean" else 1)
    err, bound = np.abs(y64 - exact), bf16_bound(x64, op)
    assert np.all(err <= bound), f"worst excess {np.max(err - bound):.3g} at {np.argmax(err - bound)}"


# --- host loops and CUDA kernels: bit-exact twins of ml_dtypes' arithmetic --------------------------


def awkward_float32(rng, n):
    """Values across float32's whole range, with NaN, +-inf, +-0, subnormals and rounding ties."""
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-90, 88, n))).astype(np.float32)
    specials = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 3.39e38, -3.4e38, 1e-40, 1.00390625, 1.01171875]
    x[: len(specials)] = specials
    # each special once more where the other operand holds another (+0 against -0, NaN against inf, ...)
    x[len(specials) : 2 * len(specials)] = rng.permutation(specials)
    return x


def test_ties_and_signed_zeros_go_as_numpy_decides():
    # Review: max(+0, -0) must be NumPy's (the second operand), on the host and on the device alike.
    a = np.array([0.0, -0.0, 0.0, -0.0, 1.0], np.float32).astype(BF16)
    b = np.array([-0.0, 0.0, -0.0, 0.0, 1.0], np.float32).astype(BF16)
    for op, ufunc in (("max", np.maximum), ("min", np.minimum)):
        expected = ufunc(a.astype(np.float32), b.astype(np.float32)).astype(BF16)
        out = np.empty(5, BF16)
        host.reduce(out, a, b, op)
        np.testing.assert_array_equal(out.view(np.uint16), expected.view(np.uint16))
        d_out = cuda.to_device(np.zeros(5, np.uint16))
        dev.reduce(d_out, cuda.to_device(a.view(np.uint16)), cuda.to_device(b.view(np.uint16)), op)
        np.testing.assert_array_equal(d_out.copy_to_host(), expected.view(np.uint16))


def same_bits_or_both_nan(got, expected):
    """Bit for bit, except that a NaN need only be a NaN (its sign and payload are not specified)."""
    got, expected = np.asarray(got).view(np.uint16), np.asarray(expected).view(np.uint16)
    nan_got = (got & 0x7FFF) > 0x7F80
    nan_expected = (expected & 0x7FFF) > 0x7F80
    np.testing.assert_array_equal(nan_got, nan_expected)
    np.testing.assert_array_equal(got[~nan_got], expected[~nan_got])


@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_host_reduce_is_ml_dtypes_arithmetic(op):
    rng = np.random.default_rng()
    n = 200_003  # several of the loop's blocks, and a tail
    a, b = awkward_float32(rng, n).astype(BF16), awkward_float32(rng, n).astype(BF16)
    out = np.full(n, np.nan, BF16)
    with np.errstate(invalid="ignore", over="ignore"):
        host.reduce(out, a, b, op)
        ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op]
        expected = ufunc(a.astype(np.float32), b.astype(np.float32)).astype(BF16)
    same_bits_or_both_nan(out, expected)
    host.reduce(a, a, b, op)  # in place, as the ring reduces
    same_bits_or_both_nan(a, expected)


def test_host_casts_and_divide_are_exact():
    rng = np.random.default_rng()
    x32 = awkward_float32(rng, 100_001)
    wire = np.full(x32.size, np.nan, BF16)
    overflow = host.cast_scaled(wire, x32, 1.0)
    assert overflow  # the NaN, the infs and 3.4e38 (which rounds up to inf)
    same_bits_or_both_nan(wire, x32.astype(BF16))
    finite = x32[np.isfinite(x32) & (np.abs(x32) < 3e38)]
    assert not host.cast_scaled(np.empty(finite.size, BF16), finite, 1.0)
    back = np.full(wire.size, np.nan, np.float64)
    host.cast_scaled(back, wire, 1.0)
    np.testing.assert_array_equal(back, wire.astype(np.float64))
    x64 = rng.standard_normal(10_000) * 1e30
    same_bits_or_both_nan(_encoded(x64, 0.25), (x64.astype(np.float32) * np.float32(0.25)).astype(BF16))
    y = (rng.standard_normal(10_000) * 5).astype(BF16)
    expected = (y.astype(np.float32) / np.float32(3)).astype(BF16)
    host.divide(y, 3)
    same_bits_or_both_nan(y, expected)


def _encoded(x, scale):
    wire = np.empty(x.size, BF16)
    host.cast_scaled(wire, x, scale)
    return wire


@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_device_kernels_match_their_host_twins(op):
    # On the simulator unless GFLOW_TEST_GPU=1 (conftest.py): bfloat16 is uint16 bits on the device.
    rng = np.random.default_rng()
    n = 301
    a, b = awkward_float32(rng, n).astype(BF16), awkward_float32(rng, n).astype(BF16)
    out = cuda.to_device(np.full(n, 0x7FBF, np.uint16))  # a NaN no kernel writes
    with np.errstate(invalid="ignore", over="ignore"):
        dev.reduce(out, cuda.to_device(a.view(np.uint16)), cuda.to_device(b.view(np.uint16)), op)
        expected = np.empty(n, BF16)
        host.reduce(expected, a, b, op)
    # NaN against NaN of the other sign: IEEE leaves the sign of the sum open (LLVM may swap operands)
    same_bits_or_both_nan(out.copy_to_host(), expected)


def test_device_casts_and_divide_match_their_host_twins():
    rng = np.random.default_rng()
    x32 = awkward_float32(rng, 257)
    wire = cuda.to_device(np.full(x32.size, 0x7FBF, np.uint16))
    with np.errstate(invalid="ignore", over="ignore"):
        assert dev.cast_scaled(wire, cuda.to_device(x32), 2.0)
        expected = np.empty(x32.size, BF16)
        host.cast_scaled(expected, x32, 2.0)
    np.testing.assert_array_equal(wire.copy_to_host(), expected.view(np.uint16))
    back = cuda.to_device(np.full(x32.size, np.nan, np.float32))
    assert dev.cast_scaled(back, wire, 0.5)  # the non-finite values are still there
    expected_back = np.empty(x32.size, np.float32)
    host.cast_scaled(expected_back, expected, 0.5)
    np.testing.assert_array_equal(back.copy_to_host(), expected_back)
    y = (rng.standard_normal(129) * 7).astype(BF16)
    d_y = cuda.to_device(y.view(np.uint16))
    dev.divide(d_y, 3)
    host.divide(y, 3)
    np.testing.assert_array_equal(d_y.copy_to_host(), y.view(np.uint16))


# --- the collectives ---------------------------------------------------------------------------------


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
@pytest.mark.parametrize("n", [0, 3, 1000, 70_001, 300_000])  # latency path, ring and node phase
def test_bfloat16_arrays_reduce_within_the_bound(op, n):
    x = (fresh_rng().standard_normal(n) * 4).astype(BF16)
    before = x.copy()
    y = gflow.allreduce(x, op)

    def check():
        assert y.dtype == BF16 and y.shape == x.shape
        np.testing.assert_array_equal(x.view(np.uint16), before.view(np.uint16))
        assert_bf16_close(y, everyone64(x), op)
        assert_same_on_all_ranks(y.view(np.uint16))

    on_all_ranks(check)


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "hierarchical"])
def test_every_algorithm_and_async_take_bfloat16(algorithm):
    x = (fresh_rng().standard_normal(20_001) * 4).astype(BF16)
    y = gflow.allreduce(x, "sum", algorithm=algorithm)
    z = gflow.allreduce_async(x, "sum", algorithm=algorithm).wait()
    on_all_ranks(lambda: assert_bf16_close(y, everyone64(x), "sum"))
    on_all_ranks(lambda: np.testing.assert_array_equal(z.view(np.uint16), y.view(np.uint16)))


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bf16_on_the_wire_carries_what_fp16_cannot(op, dtype):
    # Values near 1e30: beyond float16 (65504) by far, well inside bfloat16's range.
    x = (fresh_rng().standard_normal(50_000) * 1e30).astype(dtype)
    y = gflow.allreduce(x, op, compression="bf16")

    def check():
        assert y.dtype == np.dtype(dtype)
        assert_bf16_close(y, everyone64(x), op)
        assert_same_on_all_ranks(y)

    on_all_ranks(check)
    with pytest.raises(gflow.CompressionOverflowError, match="fp16"):
        gflow.allreduce(x, op, compression="fp16")


@pytest.mark.parallel([1, 2, 3])
def test_nan_with_bf16_on_the_wire_fails_every_rank():
    x = fresh_rng().standard_normal(5000).astype(np.float32)
    if WORLD.rank == WORLD.size - 1:
        x[17] = np.nan
    with pytest.raises(gflow.CompressionOverflowError, match="compression='bf16'"):
        gflow.allreduce(x, "sum", compression="bf16")
    x[17] = 1.0
    y = gflow.allreduce(x, "sum", compression="bf16")
    on_all_ranks(lambda: assert_bf16_close(y, everyone64(x), "sum"))


@pytest.mark.parallel([1, 2, 3])
def test_lazy_allreduce_fuses_bf16_gradients_and_bf16_on_the_wire():
    rng = fresh_rng()
    grads32 = [(rng.standard_normal(n) * 1e20).astype(np.float32) for n in (1000, 30_000, 7, 120_000)]
    grads16 = [(rng.standard_normal(n) * 3).astype(BF16) for n in (500, 64_000)]
    wire = gflow.LazyAllreduce(threshold_bytes=50_000, op="mean", compression="bf16")
    native = gflow.LazyAllreduce(threshold_bytes=50_000, op="sum")
    originals32 = [g.copy() for g in grads32]
    originals16 = [g.copy() for g in grads16]
    for g in grads32:
        wire.push(g)
    for g in grads16:
        native.push(g)
    wire.flush()
    native.flush()
    for g, x in zip(grads32, originals32, strict=True):
        on_all_ranks(lambda g=g, x=x: assert_bf16_close(g, everyone64(x), "mean"))
    for g, x in zip(grads16, originals16, strict=True):
        on_all_ranks(lambda g=g, x=x: assert_bf16_close(g, everyone64(x), "sum"))
        on_all_ranks(lambda g=g: assert_same_on_all_ranks(g.view(np.uint16)))


@pytest.mark.parallel([1, 2, 3])
def test_sparse_payload_as_bf16_loses_nothing_but_the_rounding_of_sums():
    n, chunk = 10_001, 64
    csc = gflow.SparseAllreduce(density=0.1, chunk_elems=chunk, op="sum", compression="bf16")
    rng = fresh_rng()
    applied, pushed = np.zeros(n), np.zeros(n)
    for step in range(8):
        g = (rng.standard_normal(n) * 4).astype(np.float32)
        pushed += g
        update = csc(g)
        applied += update
        sent = csc.stats["chunks_sent"]
        assert 2 * (sent - 1) * chunk < csc.stats["payload_bytes"] <= 2 * sent * chunk  # 2 bytes a value
        everyone = WORLD.allgather(update.tobytes())
        all_pushed = np.sum(WORLD.allgather(pushed), axis=0)
        all_residual = np.sum(WORLD.allgather(csc.residual.astype(np.float64)), axis=0)

        def check(
            everyone=everyone, all_pushed=all_pushed, all_residual=all_residual, step=step, applied=applied
        ):
            assert all(b == everyone[0] for b in everyone), "updates differ between ranks"
            # Each step's sums are rounded p - 1 times (2**-8 each) over values of at most ~30 per rank.
            tol = 2.0**-8 * WORLD.size * 30 * WORLD.size * (step + 1)
            np.testing.assert_allclose(applied + all_residual, all_pushed, atol=tol)

        on_all_ranks(check, f"step {step}")


@pytest.mark.parallel([1, 2])
@pytest.mark.parametrize("transport", ["staged", "direct"])
def test_device_bfloat16_arrays_and_bf16_wire_on_the_device(monkeypatch, transport):
    # Simulator device arrays (bfloat16 ones exist only there: Numba has no bfloat16 type on a GPU,
    # where bfloat16 device memory comes from torch): the device path reduces uint16 bits, in the
    # kernels ("direct": a CUDA-aware MPI, the ring's steps on the device) or on the host ("staged").
    from gflow.cuda import transport as device_transport

    monkeypatch.setenv("GFLOW_CUDA_AWARE_MPI", "1" if transport == "direct" else "0")
    monkeypatch.setattr(device_transport, "_decided", None)
    rng = fresh_rng()
    x = (rng.standard_normal(3000) * 4).astype(BF16)
    y = gflow.allreduce(cuda.to_device(x), "mean").copy_to_host()
    on_all_ranks(lambda: assert_bf16_close(y, everyone64(x), "mean"))
    w = (rng.standard_normal(3000) * 1e30).astype(np.float32)
    z = gflow.allreduce(cuda.to_device(w), "sum", compression="bf16").copy_to_host()
    on_all_ranks(lambda: assert_bf16_close(z, everyone64(w), "sum"))


@pytest.mark.parallel([1, 2])
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_lazy_allreduce_of_device_bfloat16_gradients(op):
    # Review: LazyAllreduce took the device views' uint16 bits for the gradients' dtype (op='mean'
    # refused them, 'sum' had no signature for them) and reallocated its bf16 wire every step.
    rng = fresh_rng()
    host_grads = [(rng.standard_normal(n) * 3).astype(BF16) for n in (700, 2000)]
    wire32 = (rng.standard_normal(1500) * 1e30).astype(np.float32)
    native = gflow.LazyAllreduce(threshold_bytes=1000, op=op)
    compressed = gflow.LazyAllreduce(threshold_bytes=1000, op=op, compression="bf16")
    buffers = None
    for _ in range(2):
        grads = [cuda.to_device(g) for g in host_grads]
        big = cuda.to_device(wire32)
        for g in grads:
            native.push(g)
        compressed.push(big)
        native.flush()
        compressed.flush()
        for g, x in zip(grads, host_grads, strict=True):
            on_all_ranks(lambda g=g, x=x: assert_bf16_close(g.copy_to_host(), everyone64(x), op))
        on_all_ranks(lambda big=big: assert_bf16_close(big.copy_to_host(), everyone64(wire32), op))
        ids = [id(b) for b in compressed._buffers]
        assert buffers is None or ids == buffers, "the bf16 segment buffer was reallocated"
        buffers = ids


@pytest.mark.parallel([2, 3])
def test_ranks_sending_other_dtypes_over_the_same_wire_all_raise():
    # Review: float32 with compression='bf16' on one rank and a bfloat16 array (or float64 with
    # 'bf16') on another put the same bytes on the wire; the ranks must still disagree.
    n = 3000
    cases = [
        (np.ones(n, np.float32), "bf16") if WORLD.rank == 0 else (np.ones(n, BF16), None),
        (np.ones(n, np.float32), "bf16") if WORLD.rank == 0 else (np.ones(n, np.float64), "bf16"),
        (np.ones(n, np.float32), "fp16") if WORLD.rank == 0 else (np.ones(n, np.float16), None),
    ]
    for x, codec in cases:
        with pytest.raises(gflow.MismatchError, match="disagree"):
            gflow.allreduce(x, compression=codec)
    y = gflow.allreduce(np.ones(n, np.float32), compression="bf16")
    on_all_ranks(lambda: np.testing.assert_array_equal(y, WORLD.size))


def test_the_cost_model_prices_bf16_as_fp16():
    from gflow.tools import cost_model as model

    kwargs = dict(ranks=8, ranks_per_node=4, algorithm="ring")
    assert (
        model.allreduce_time(64 << 20, compression="bf16", **kwargs)
        == model.allreduce_time(64 << 20, compression="fp16", **kwargs)
        < model.allreduce_time(64 << 20, **kwargs)
    )


# --- what bad input gets -----------------------------------------------------------------------------


def test_the_other_16_bit_type_as_compression_is_a_type_error_naming_both():
    x16 = np.ones(10, BF16)
    with pytest.raises(TypeError, match=r"compression='fp16' on a bfloat16 input.*range"):
        gflow.allreduce(x16, compression="fp16")
    with pytest.raises(TypeError, match=r"compression='bf16' on a float16 input.*digits"):
        gflow.allreduce(np.ones(10, np.float16), compression="bf16")
    with pytest.raises(TypeError, match=r"compression='bf16' needs a floating dtype, got int32"):
        gflow.allreduce(np.ones(10, np.int32), compression="bf16")
    with pytest.raises(ValueError, match=r"expected None, 'fp16' or 'bf16', got 'bfloat16'"):
        gflow.allreduce(np.ones(10, np.float32), compression="bfloat16")
    with pytest.raises(TypeError, match=r"unsupported dtype \|V2"):
        gflow.allreduce(np.zeros(10, np.dtype("V2")))


@pytest.mark.parallel([2, 3])
def test_ranks_passing_bfloat16_against_float16_all_raise():
    dtype = BF16 if WORLD.rank == 0 else np.float16
    for n in (100, 200_000):  # the latency path and the ring's agreement
        x = np.ones(n, dtype)
        with pytest.raises(gflow.MismatchError, match=r"bfloat16.*float16|float16.*bfloat16"):
            gflow.allreduce(x)
    y = gflow.allreduce(np.ones(100, BF16))
    on_all_ranks(lambda: np.testing.assert_array_equal(y.astype(np.float32), WORLD.size))


@pytest.mark.parallel([2, 3])
def test_ranks_sending_fp16_against_bf16_all_raise():
    codec = "bf16" if WORLD.rank == 0 else "fp16"
    with pytest.raises(gflow.MismatchError, match="disagree"):
        gflow.allreduce(np.ones(1000, np.float32), compression=codec)
    assert gflow.allreduce(np.ones(10, np.float32), compression="bf16")[0] == WORLD.size


# --- torch ---------------------------------------------------------------------------------------------


@pytest.mark.parallel([1, 2, 3])
def test_torch_bfloat16_tensors_and_bf16_compression():
    torch = pytest.importorskip("torch")
    import gflow.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    rng = fresh_rng()
    x = torch.from_numpy((rng.standard_normal(5000) * 4).astype(np.float32)).to(torch.bfloat16)
    x64 = everyone64(x.float().numpy())
    y = gflow.allreduce(x, "sum")
    out = torch.full_like(x, float("nan"))
    gflow.allreduce(x, "max", out=out)
    z = hvd.allreduce(x, op=hvd.Average)
    w32 = torch.from_numpy((rng.standard_normal(7000) * 1e30).astype(np.float32))
    w = hvd.allreduce(w32, op=hvd.Sum, compression=hvd.Compression.bf16)
    same = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.bf16)  # its own type: as it is

    def check():
        assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and z.dtype == torch.bfloat16
        assert_bf16_close(y.float().numpy(), x64, "sum")
        assert_bf16_close(out.float().numpy(), x64, "max")
        assert_bf16_close(z.float().numpy(), x64, "mean")
        assert w.dtype == torch.float32
        assert_bf16_close(w.numpy(), everyone64(w32.numpy()), "sum")
        assert torch.equal(same, y)

    on_all_ranks(check)
    with pytest.raises(TypeError, match=r"compression='fp16' on a bfloat16 input"):
        hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    compressed, ctx = hvd.Compression.bf16.compress(w32)
    assert compressed.dtype == torch.bfloat16
    assert hvd.Compression.bf16.decompress(compressed, ctx).dtype == torch.float32


def test_import_and_a_float32_step_leave_ml_dtypes_unimported_and_bfloat16_works_after():
    """ml_dtypes 0.7 takes about 0.9 s to import, most of gflow's import, on every rank of every job:
    gflow imports it only where a bfloat16 is made. A program that passes bfloat16 arrays imported it."""
    code = (
        "import sys, numpy as np, gflow\n"
        "x = np.arange(5, dtype=np.float32)\n"
        "assert (gflow.allreduce(x, compression='fp16') == x).all()\n"
        "lazy = gflow.LazyAllreduce(threshold_bytes=8); lazy.push(x); lazy.flush()\n"
        "assert 'ml_dtypes' not in sys.modules, 'imported'\n"
        "import ml_dtypes\n"
        "b = np.arange(5).astype(ml_dtypes.bfloat16)\n"
        "assert (gflow.allreduce(b) == b).all() and gflow.allreduce(b).dtype == b.dtype\n"
        "assert gflow.allreduce(x, compression='bf16').dtype == np.float32\n"
    )
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)  # (numba.cuda imports ml_dtypes itself; gflow's host path does not)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)
    bench = [sys.executable, "-m", "gflow", "bench", "--dtype", "bfloat16", "-b", "4K", "-e", "8K"]
    bench += ["-n", "2", "-w", "1"]
    done = subprocess.run([*bench, "--check"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and "bfloat16" in done.stdout, done.stdout + done.stderr  # (helper-86)


def test_a_byte_swapped_bfloat16_is_refused():
    """helper-86: bfloat16 told by its name let a big-endian one through, reduced as little-endian bits."""
    swapped = np.arange(4).astype(BF16).astype(BF16.newbyteorder(">"))
    with pytest.raises(TypeError, match="unsupported dtype >V2: expected one of .*bfloat16"):
        gflow.allreduce(swapped)
    with pytest.raises(TypeError, match="unsupported dtype >V2"):
        gflow.LossScaler().unscale(swapped)
