"""Every CUDA kernel against its NumPy twin in gflow/arrays/host_ops.py, on random data with poisoned outputs.

Runs on Numba's CUDA simulator unless GFLOW_TEST_GPU=1 (see conftest.py); the simulator runs about
10k threads a second, so arrays stay small.
"""

import numpy as np
import pytest
from numba import cuda

from gflow.arrays import host_ops as host
from gflow.cuda import ops as dev

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
LENGTHS = [0, 1, 37, 300]


def rand(rng, n, dtype):
    if np.dtype(dtype).kind == "f":
        return (rng.standard_normal(n) * 3).astype(dtype)
    return rng.integers(-1000, 1000, n).astype(dtype)


def poisoned(n, dtype):
    """A device array full of a value no correct kernel writes."""
    fill = np.nan if np.dtype(dtype).kind == "f" else np.iinfo(dtype).min
    return cuda.to_device(np.full(n, fill, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_reduce_matches_numpy(dtype, op):
    rng = np.random.default_rng(1)
    for n in LENGTHS:
        a, b = rand(rng, n, dtype), rand(rng, n, dtype)
        if n > 2 and np.dtype(dtype).kind == "f":
            a[1] = np.nan  # NaN propagates, as in NumPy
        out = poisoned(n, dtype)
        dev.reduce(out, cuda.to_device(a), cuda.to_device(b), op)
        expected = np.empty(n, dtype)
        host.reduce(expected, a, b, op)
        np.testing.assert_array_equal(out.copy_to_host(), expected, err_msg=f"n={n}")


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int32, np.int64, "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_reduce_many_matches_its_host_twin_bitwise(dtype, op):
    """The node phase's k-way reduction (one launch over k parts), for k = 1..8, into a fresh array
    and into one of its parts (the node phase reduces into the slot its own part may be read from):
    the same bits as the host twin's pairwise folds, NaN included."""
    import ml_dtypes

    host_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    bits = np.uint16 if dtype == "bfloat16" else host_dtype  # bfloat16 lives on the device as its bits
    rng = np.random.default_rng()
    for k in (1, 2, 3, 5, 8):
        parts = [rand(rng, 101, np.float32).astype(host_dtype) for _ in range(k)]
        if host_dtype.kind == "f" and k > 1:
            parts[1][7] = np.nan
        expected = np.empty(101, host_dtype)
        host.reduce_many(expected, parts, op)
        on_device = [cuda.to_device(p.view(bits)) for p in parts]
        out = cuda.to_device(np.full(101, 0x7FC1, bits)) if dtype == "bfloat16" else poisoned(101, bits)
        dev.reduce_many(out, on_device, op)
        np.testing.assert_array_equal(out.copy_to_host(), expected.view(bits), err_msg=f"k={k}")
        into = on_device[k // 2]  # into a part it reads too (the middle one: read after others)
        dev.reduce_many(into, on_device, op)
        np.testing.assert_array_equal(into.copy_to_host(), expected.view(bits), err_msg=f"k={k}")


def test_reduce_many_of_parts_that_type_apart_goes_pairwise():
    """A strided part cannot share a kernel's tuple with contiguous ones: the same bits, pairwise."""
    rng = np.random.default_rng()
    parts = [rand(rng, 64, np.float32) for _ in range(3)]
    strided = cuda.to_device(np.repeat(parts[2], 2))[::2]
    expected = np.empty(64, np.float32)
    host.reduce_many(expected, parts, "sum")
    out = poisoned(64, np.float32)
    dev.reduce_many(out, [cuda.to_device(parts[0]), cuda.to_device(parts[1]), strided], "sum")
    np.testing.assert_array_equal(out.copy_to_host(), expected)


@pytest.mark.parametrize("blocks", [1, 3, 4])
def test_gather_takes_each_block_from_its_array(blocks):
    """The node allgather's copies in one launch: block q of out from array q, empty blocks too."""
    rng = np.random.default_rng()
    n = 97
    arrays = [rand(rng, n, np.float64) for _ in range(blocks)]
    cuts = np.sort(rng.integers(0, n, blocks - 1))
    bounds = [0, *cuts.tolist(), n]
    if blocks > 2:
        bounds[2] = bounds[1]  # an empty block
    expected = np.empty(n)
    host.gather(expected, arrays, bounds)
    for q in range(blocks):
        np.testing.assert_array_equal(
            expected[bounds[q] : bounds[q + 1]], arrays[q][bounds[q] : bounds[q + 1]]
        )
    out = poisoned(n, np.float64)
    dev.gather(out, [cuda.to_device(a) for a in arrays], bounds)
    np.testing.assert_array_equal(out.copy_to_host(), expected)


def test_reduce_in_place_and_copy_and_divide():
    rng = np.random.default_rng(2)
    a, b = rand(rng, 200, np.float32), rand(rng, 200, np.float32)
    d_a = cuda.to_device(a)
    dev.reduce(d_a, cuda.to_device(b), d_a, "sum")
    dev.divide(d_a, 3)
    expected = a.copy()
    host.reduce(expected, b, expected, "sum")
    host.divide(expected, 3)
    np.testing.assert_array_equal(d_a.copy_to_host(), expected)
    out = poisoned(200, np.float32)
    dev.copy(out, d_a)
    np.testing.assert_array_equal(out.copy_to_host(), expected)


@pytest.mark.parametrize(("src_dtype", "dst_dtype"), [(np.float32, np.float16), (np.float16, np.float32)])
@pytest.mark.parametrize("scale", [1.0, 1 / 64, 1e5])
def test_cast_scaled_matches_numpy_and_reports_overflow(src_dtype, dst_dtype, scale):
    rng = np.random.default_rng(3)
    src = rand(rng, 300, src_dtype)
    out = poisoned(300, dst_dtype)
    overflow = dev.cast_scaled(out, cuda.to_device(src), scale)
    expected = np.empty(300, dst_dtype)
    expected_overflow = host.cast_scaled(expected, src, scale)
    np.testing.assert_array_equal(out.copy_to_host(), expected)
    assert overflow == expected_overflow
    # float16 tops out at 65504: 1e5 * N(0, 3) values overflow it, the others do not.
    assert overflow == (dst_dtype == np.float16 and scale == 1e5)


def test_cast_scaled_reports_nan_and_inf():
    for bad in (np.nan, np.inf, -np.inf):
        src = np.ones(50, np.float32)
        src[17] = bad
        out = poisoned(50, np.float16)
        assert dev.cast_scaled(out, cuda.to_device(src), 1.0)
        assert host.cast_scaled(np.empty(50, np.float16), src, 1.0)


import ml_dtypes  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
# Every (src, dst) pair cast_scaled serves; bfloat16 lives on the device as its uint16 bits.
CAST_PAIRS = [
    (np.float32, np.float16),
    (np.float64, np.float16),
    (np.float16, np.float32),
    (np.float16, np.float64),
    (np.float32, BF16),
    (np.float64, BF16),
    (BF16, np.float32),
    (BF16, np.float64),
    (BF16, BF16),
    (np.float16, np.float16),
    (np.float32, np.float64),
    (np.float64, np.float32),
    (np.float32, np.float32),
]


def _on_device(a):
    return cuda.to_device(a.view(np.uint16) if a.dtype == BF16 else a)


def _cast_both(src, dst_dtype, scale):
    """(device result, device flag, host result, host flag), results as host arrays of dst_dtype."""
    dst_dtype = np.dtype(dst_dtype)
    bits = np.uint16 if dst_dtype == BF16 else dst_dtype
    out = poisoned(src.size, bits) if dst_dtype != BF16 else cuda.to_device(np.full(src.size, 0x7FBF, bits))
    flag = dev.cast_scaled(out, _on_device(src), scale)
    expected = np.empty(src.size, dst_dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        expected_flag = host.cast_scaled(expected, src, scale)
    return out.copy_to_host().view(dst_dtype), flag, expected, expected_flag


def _assert_same_bits(got, expected, msg=""):
    """Bit for bit, except that any NaN matches any NaN (the GPU's NaN sign is its own)."""
    nan_got, nan_expected = np.isnan(got.astype(np.float64)), np.isnan(expected.astype(np.float64))
    np.testing.assert_array_equal(nan_got, nan_expected, err_msg=msg)
    u = {2: np.uint16, 4: np.uint32, 8: np.uint64}[got.dtype.itemsize]
    np.testing.assert_array_equal(got.view(u)[~nan_got], expected.view(u)[~nan_expected], err_msg=msg)


# 32 simulated threads, 4 elements each per pass: 128 is one full unrolled pass, around it the tails.
@pytest.mark.parametrize(("src_dtype", "dst_dtype"), CAST_PAIRS)
def test_cast_scaled_every_pair_matches_host_bitwise(src_dtype, dst_dtype):
    rng = np.random.default_rng(11)
    for n in (1, 5, 127, 128, 129, 263):
        src = (rng.standard_normal(n) * 3).astype(src_dtype)
        if n > 5:
            src[3] = -0.0
            src[4] = 1e-6  # below float16's normal range in the float16 casts
        for scale in (1.0, 1 / 64):
            got, flag, expected, expected_flag = _cast_both(src, dst_dtype, scale)
            _assert_same_bits(got, expected, f"n={n} scale={scale}")
            assert flag == expected_flag is False


@pytest.mark.parametrize("dst_dtype", [np.float16, BF16])
def test_float64_casts_to_two_bytes_through_float32_on_host_and_device(dst_dtype):
    """Conversions compute in float32, as on the GPU (codecs.py): a float64 input within 2**-29 of a
    halfway point rounds to float32 first (helper-61: one unit from a direct astype), alike on both."""
    ulp = 2.0**-10 if dst_dtype == np.float16 else 2.0**-7  # (at 1; twice that at 2)
    src = np.array([1 + ulp / 2 + 2.0**-40, 1 + 3 * ulp / 2 - 2.0**-40, 1.25, -(2 + ulp + 2.0**-39)])
    got, flag, expected, expected_flag = _cast_both(src, dst_dtype, 1.0)
    _assert_same_bits(got, expected)
    _assert_same_bits(expected, src.astype(np.float32).astype(dst_dtype))
    assert not (flag or expected_flag)
    assert not np.array_equal(expected.view(np.uint16), src.astype(dst_dtype).view(np.uint16))  # (as said)


# A value that overflows dst (with the scale given) where the src dtype can hold it.
def _overflowing(src_dtype, dst_dtype):
    src_dtype, dst_dtype = np.dtype(src_dtype), np.dtype(dst_dtype)
    if dst_dtype == np.float16:
        return 7e4, 1.0
    if dst_dtype == BF16:  # float32's max rounds up to bfloat16's inf
        return (3.4e38, 1.0) if src_dtype != BF16 else (1e38, 8.0)
    if dst_dtype == np.float32:
        return (1e39, 1.0) if src_dtype == np.float64 else (6e4, 1e34)
    return None, 1.0  # float64: only NaN and inf


@pytest.mark.parametrize(("src_dtype", "dst_dtype"), CAST_PAIRS)
def test_cast_scaled_flag_from_one_element(src_dtype, dst_dtype):
    """One bad element (NaN, +-inf or an overflow), in the unrolled middle or the very end: the flag
    is set, the other elements are cast as usual."""
    big, big_scale = _overflowing(src_dtype, dst_dtype)
    cases = [(np.nan, 1.0), (np.inf, 1.0), (-np.inf, 1.0)] + ([(-big, big_scale)] if big else [])
    n = 131
    for bad, scale in cases:
        for at in (70, n - 1):
            src = np.ones(n, np.float64)
            src[at] = bad
            src = src.astype(src_dtype)
            got, flag, expected, expected_flag = _cast_both(src, dst_dtype, scale)
            _assert_same_bits(got, expected, f"bad={bad} at={at}")
            assert flag and expected_flag, (bad, at)


def test_cast_to_float16_flags_only_what_rounds_to_inf():
    """As the host twin: 65519.99 rounds down to 65504 (no overflow), 65520 rounds to inf."""
    for value, overflows in ((65504.0, False), (65519.99, False), (65520.0, True), (-65520.0, True)):
        for src_dtype in (np.float32, np.float64):
            src = np.zeros(40, src_dtype)
            src[37] = value
            got, flag, expected, expected_flag = _cast_both(src, np.float16, 1.0)
            _assert_same_bits(got, expected, f"{value}")
            assert flag == expected_flag == overflows, (value, src_dtype)


def test_cast_bf16_in_place():
    """LossScaler.unscale casts bfloat16 into itself."""
    src = (np.random.default_rng(12).standard_normal(133) * 100).astype(BF16)
    d = _on_device(src)
    assert not dev.cast_scaled(d, d, 0.25)
    expected = np.empty_like(src)
    host.cast_scaled(expected, src, 0.25)
    _assert_same_bits(d.copy_to_host().view(BF16), expected)


def test_cast_bf16_to_bf16_flags_alike_near_the_largest_value():
    """bfloat16 to bfloat16 (LossScaler.unscale): a product just above bfloat16's largest value that
    rounds down to it is no overflow, one that rounds to inf is, on the host and the device alike."""
    import ml_dtypes

    top = float(ml_dtypes.finfo(BF16).max)
    for scale, overflows in [(1.001, False), (1.0, False), (1.01, True), (np.inf, True)]:
        src = np.array([1.0, top, -top, 3.0], BF16)
        expected = np.empty_like(src)
        flag = host.cast_scaled(expected, src, scale)
        d = _on_device(src)
        assert dev.cast_scaled(d, d, scale) == flag == overflows, scale
        _assert_same_bits(d.copy_to_host().view(BF16), expected)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize(("n", "chunk"), [(0, 4), (1, 4), (20, 1), (90, 7), (256, 64), (250, 64)])
def test_chunk_norms_match_numpy(dtype, n, chunk):
    x = rand(np.random.default_rng(n + chunk), n, dtype)
    nchunks = (n + chunk - 1) // chunk
    out = poisoned(nchunks, np.float32)
    dev.chunk_norms(cuda.to_device(x), chunk, out=out)
    expected = host.chunk_norms(x, chunk)
    assert expected.shape == (nchunks,)
    exact = [np.abs(x[c * chunk : (c + 1) * chunk].astype(np.float64)).sum() for c in range(nchunks)]
    np.testing.assert_allclose(out.copy_to_host(), exact, rtol=1e-5)
    np.testing.assert_allclose(expected, exact, rtol=1e-5)


# Chunk geometry (simulated blocks: 32 threads, several chunks per block up to chunk 8, unrolled by
# 4 along a chunk): below, at and above those sizes; one chunk (short or whole); short last chunks.
CHUNK_CASES = [
    (300, 7),
    (256, 64),
    (250, 64),
    (10, 10),
    (9, 10),
    (1, 1),
    (41, 8),
    (40, 3),
    (45, 9),
    (50, 64),
    (64, 64),
    (395, 130),
    (390, 130),
]


@pytest.mark.parametrize(("n", "chunk"), CHUNK_CASES)
def test_pack_and_scatter_add_match_numpy(n, chunk):
    rng = np.random.default_rng(n)
    nchunks = (n + chunk - 1) // chunk
    src = rand(rng, n, np.float32)
    for ids in (
        np.arange(nchunks),  # everything, the short last chunk included
        np.sort(rng.choice(nchunks, size=max(1, nchunks // 3), replace=False)),
        np.array([nchunks - 1]),
        np.array([], dtype=np.int64),
    ):
        ids = ids.astype(np.int64)
        packed_len = sum(min(chunk, n - i * chunk) for i in ids)
        packed = poisoned(packed_len, np.float32)
        dev.pack(packed, cuda.to_device(src), cuda.to_device(ids), chunk)
        expected = np.empty(packed_len, np.float32)
        host.pack(expected, src, ids, chunk)
        reference = np.concatenate(
            [src[i * chunk : (i + 1) * chunk] for i in ids] or [np.empty(0, np.float32)]
        )
        np.testing.assert_array_equal(expected, reference)
        np.testing.assert_array_equal(packed.copy_to_host(), reference)

        dst = rand(rng, n, np.float32)
        by_hand = dst.copy()
        offset = 0
        for i in ids:
            piece = by_hand[i * chunk : (i + 1) * chunk]
            piece += reference[offset : offset + piece.size]
            offset += piece.size
        d_dst = cuda.to_device(dst)
        dev.scatter_add(d_dst, packed, cuda.to_device(ids), chunk)
        host.scatter_add(dst, reference, ids, chunk)
        np.testing.assert_array_equal(dst, by_hand)
        np.testing.assert_array_equal(d_dst.copy_to_host(), by_hand)


def test_host_float16_conversions_are_exact():
    """gflow/arrays/half_kernels.py against NumPy's own float16 casts: every float16 value, and
    random float32."""
    every = np.arange(65536, dtype=np.uint16).view(np.float16)
    decoded = np.full(65536, -1.0, np.float32)
    host.cast_scaled(decoded, every, 1.0)
    np.testing.assert_array_equal(decoded, every.astype(np.float32))  # NaNs compare equal here
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(200_000) * 10.0 ** rng.integers(-10, 6, 200_000)).astype(np.float32)
    edges = [0.0, -0.0, 65504, 65519.99, 65520, 1e9, np.inf, -np.inf, np.nan, 2.9802322e-08, 6.0975552e-05]
    x = np.concatenate([x, np.array(edges, np.float32), every.astype(np.float32)])
    encoded = np.zeros(x.size, np.float16)
    host.cast_scaled(encoded, x, 1.0)
    expected = x.astype(np.float16)
    same_bits = encoded.view(np.uint16) == expected.view(np.uint16)
    assert np.all(same_bits | (np.isnan(encoded) & np.isnan(expected)))


@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_host_float16_reduce_matches_numpy_also_in_place(op):
    rng = np.random.default_rng(6)
    a = (rng.standard_normal(150_001) * 100).astype(np.float16)
    b = (rng.standard_normal(150_001) * 100).astype(np.float16)
    a[10], b[20] = np.nan, np.inf
    expected = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op](a, b)
    out = np.zeros_like(a)
    host.reduce(out, a, b, op)
    np.testing.assert_array_equal(out, expected)
    in_place = b.copy()
    host.reduce(in_place, a, in_place, op)  # the ring reduces into one of its operands
    np.testing.assert_array_equal(in_place, expected)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sparse_kernels_match_numpy(momentum):
    """The CSC hot loop (residual update fused with chunk norms), accumulate and zero_chunks."""
    rng = np.random.default_rng(8)
    n, chunk = 250, 16
    u, v, g = (rand(rng, n, np.float32) for _ in range(3))
    hu, hv = u.copy(), v.copy()
    norms = host.accumulate_norms(hu, hv, hu, hv, g, momentum, chunk)  # in place
    # The same by hand, in float64.
    w = momentum * u.astype(np.float64) + g if momentum else g.astype(np.float64)
    expected_v = v + w
    np.testing.assert_allclose(hv, expected_v, rtol=1e-6, atol=1e-6)
    exact = [np.abs(expected_v[c : c + chunk]).sum() for c in range(0, n, chunk)]
    np.testing.assert_allclose(norms, exact, rtol=1e-5)
    if momentum:
        np.testing.assert_allclose(hu, w, rtol=1e-6, atol=1e-6)
    # Out of place (the old state must survive a failed step), poisoned outputs; host and device alike.
    hu2, hv2 = np.full(n, np.nan, np.float32), np.full(n, np.nan, np.float32)
    # (fastmath lets the compiler sum each chunk in another order when outputs may not alias inputs)
    np.testing.assert_allclose(host.accumulate_norms(hu2, hv2, u, v, g, momentum, chunk), norms, rtol=1e-6)
    np.testing.assert_array_equal(hv2, hv)
    du, dv = cuda.to_device(u), cuda.to_device(v)
    du2, dv2 = cuda.to_device(hu2 * np.nan), cuda.to_device(hv2 * np.nan)
    np.testing.assert_allclose(
        dev.accumulate_norms(du2, dv2, du, dv, cuda.to_device(g), momentum, chunk).copy_to_host(),
        exact,
        rtol=1e-5,
    )
    np.testing.assert_allclose(dv2.copy_to_host(), expected_v, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(dv.copy_to_host(), v)  # the inputs are left as they were
    if momentum:
        np.testing.assert_allclose(du2.copy_to_host(), w, rtol=1e-6, atol=1e-6)
    else:
        assert np.isnan(du2.copy_to_host()).all()  # untouched at momentum 0
    ids = np.array([0, 3, 15], dtype=np.int64)  # 15: the short last chunk
    cleared = rand(rng, n, np.float32)
    d_cleared = cuda.to_device(cleared)
    dev.zero_chunks(d_cleared, cuda.to_device(ids), chunk)
    host.zero_chunks(cleared, ids, chunk)
    np.testing.assert_array_equal(d_cleared.copy_to_host(), cleared)
    assert not cleared[:16].any() and not cleared[48:64].any() and not cleared[240:].any()
    assert cleared[16:48].all()


@pytest.mark.parametrize(("n", "chunk"), CHUNK_CASES)
def test_zero_chunks_matches_numpy(n, chunk):
    rng = np.random.default_rng(n + 1000 * chunk)
    nchunks = (n + chunk - 1) // chunk
    for ids in (np.arange(nchunks), np.array([nchunks - 1]), np.array([0]), np.arange(0, nchunks, 2)):
        ids = ids.astype(np.int64)
        x = rand(rng, n, np.float32) + 5000  # no zeros to begin with
        d = cuda.to_device(x)
        dev.zero_chunks(d, cuda.to_device(ids), chunk)
        host.zero_chunks(x, ids, chunk)
        np.testing.assert_array_equal(d.copy_to_host(), x)
        assert (x == 0).sum() == sum(min(chunk, n - i * chunk) for i in ids)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int8, np.uint8, np.int64, np.bool_, "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_neutral_leaves_every_operand_as_it_is_on_host_and_device(dtype, op):
    """What a rank in join() contributes: the same bits on the device as on the host, and reducing
    random values (NaN and the type's extremes among them) with it changes none of them."""
    import ml_dtypes

    host_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    bits = np.dtype(np.uint16) if dtype == "bfloat16" else host_dtype
    n = 41
    values = rand(np.random.default_rng(), n, np.float32)
    if host_dtype.kind == "f" or dtype == "bfloat16":
        values[:4] = [np.nan, np.inf, -np.inf, -0.0]
        values = values.astype(host_dtype)
    elif host_dtype.kind == "b":
        values = values > 0
    else:
        info = np.iinfo(host_dtype)
        values = np.clip(values, info.min, info.max).astype(host_dtype)
        values[:2] = [info.min, info.max]
    neutral = host.neutral(n, host_dtype, op)
    assert neutral.dtype == host_dtype and neutral.shape == (n,)
    np.testing.assert_array_equal(dev.neutral(n, host_dtype, op).copy_to_host(), neutral.view(bits))
    if host_dtype.kind == "b" or op == "mean":
        return  # (gflow reduces no bool; a mean is summed, then divided)
    for low, high in ((values, neutral), (neutral, values)):
        out = np.empty(n, host_dtype)
        host.reduce(out, low, high, op)
        np.testing.assert_array_equal(out.view(bits), values.view(bits))
