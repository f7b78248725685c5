"""CuPy arrays on a real GPU, with GFLOW_TEST_GPU=1 (bench/gpu_check.sh sets it), under which a missing
GPU or CuPy is a failure. Without it they are skipped in the parent (no ranks spawned)."""

import os

import numpy as np
import pytest
from helpers import WORLD, assert_close_to_reference, on_all_ranks, random_array, rank_rng

import gflow

REQUIRED = os.environ.get("GFLOW_TEST_GPU") == "1"


# Decided in the parent, so that no ranks are spawned just to skip (a skipped child reads as a pass).
# Only with GFLOW_TEST_GPU=1: otherwise conftest.py runs gflow's kernels on Numba's simulator, which
# would read the GPU's memory as host memory.
pytestmark = pytest.mark.skipif(
    not REQUIRED,
    reason="CuPy on a GPU: run with GFLOW_TEST_GPU=1",
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
