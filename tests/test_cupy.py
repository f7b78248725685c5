"""CuPy arrays on a real GPU. Skipped without one (in the parent: no ranks spawned), unless
GFLOW_TEST_GPU=1, which makes a missing GPU or CuPy a failure (bench/gpu_check.sh sets it)."""

import os

import numpy as np
import pytest
from helpers import WORLD, assert_close_to_reference, on_all_ranks, random_array, rank_rng

import gflow

REQUIRED = os.environ.get("GFLOW_TEST_GPU") == "1"


def _gpu_count() -> int:
    try:
        import cupy  # noqa: PLC0415

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: all mean no GPU here
        return 0


# Decided in the parent, so that no ranks are spawned just to skip (a skipped child reads as a pass).
pytestmark = pytest.mark.skipif(
    not REQUIRED and _gpu_count() == 0, reason="no CuPy or no GPU (GFLOW_TEST_GPU=1 requires them)"
)


def cupy_or_skip():
    import cupy  # noqa: PLC0415 - under GFLOW_TEST_GPU=1 a failure here is the point

    assert cupy.cuda.runtime.getDeviceCount() > 0, "GFLOW_TEST_GPU=1 but no GPU is visible"
    return cupy


@pytest.mark.parallel([1, 2])
def test_cupy_in_cupy_out():
    cupy = cupy_or_skip()
    for n, op in [(1000, "sum"), (1 << 20, "mean")]:
        x = random_array(rank_rng(n), n, np.float32)

        def check(x=x, op=op, n=n):
            d = cupy.asarray(x)
            y = gflow.allreduce(d, op)
            assert isinstance(y, cupy.ndarray)
            assert_close_to_reference(cupy.asnumpy(y), x, op)
            out = cupy.full(n, cupy.nan, dtype=cupy.float32)
            assert gflow.allreduce(d, op, out=out) is out
            shard = gflow.reduce_scatter(d, op)
            assert isinstance(shard, cupy.ndarray)
            assert isinstance(gflow.allgather(d), cupy.ndarray)
            assert isinstance(gflow.broadcast(d), cupy.ndarray)

        on_all_ranks(check, f"n={n}")
    assert WORLD.size >= 1
