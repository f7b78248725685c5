"""Training still converges with CSC: a NumPy MLP on scikit-learn's digits at 4 ranks, same global batch,
fixed seeds; CSC at 1% (with warm-up) must end within one point of dense held-out accuracy."""

import os
import sys

import pytest
from helpers import WORLD

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import digits_mlp  # noqa: E402


@pytest.mark.parallel(4)
@pytest.mark.timeout(240)
def test_csc_at_one_percent_converges_within_a_point_of_dense():
    dense = digits_mlp.train("dense", WORLD)
    csc = digits_mlp.train("csc", WORLD, density=0.01)
    assert dense[-1] > 0.95, f"dense itself did not learn: {dense}"
    assert csc[-1] >= dense[-1] - 0.01, f"CSC ended at {csc[-1]:.3f}, dense at {dense[-1]:.3f}"


@pytest.mark.parallel(4)
@pytest.mark.timeout(240)
def test_torch_csc_at_one_percent_converges_within_a_point_of_dense():
    """The Horovod-style torch example (examples/train_torch.py) on gflow.torch: CSC at 1% through
    DistributedOptimizer(sparse=...) ends within one point of dense, with the same steps."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import train_torch

    dense = train_torch.main(["--epochs", "30"])
    csc = train_torch.main(["--epochs", "30", "--density", "0.01"])
    assert dense > 0.95, f"dense itself did not learn: {dense}"
    assert csc >= dense - 0.01, f"CSC ended at {csc:.3f}, dense at {dense:.3f}"
