"""A deliberately deadlocking multi-rank test, run only by test_harness.py (not collected otherwise)."""

import numpy as np
import pytest
from helpers import WORLD

import gflow


@pytest.mark.parallel(2)
def test_one_rank_never_calls():
    if WORLD.rank == 0:
        gflow.allreduce(np.ones(10))  # rank 1 never joins: waits forever without the watchdog
