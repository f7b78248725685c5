"""Multi-rank tests with known verdicts, run only by test_harness.py (not collected otherwise)."""

import os

import pytest
from helpers import WORLD


@pytest.mark.parallel([2, 3])
def test_passes():
    WORLD.barrier()


@pytest.mark.parallel(2)
def test_fails_on_rank_1_only():
    assert WORLD.rank != 1, "rank 1 disagrees"


@pytest.mark.parallel(2)
def test_skips_on_every_rank():
    pytest.skip("nothing to test here")


@pytest.mark.parallel(2)
def test_kills_its_batch():
    if WORLD.rank == 1:
        os._exit(3)
    WORLD.barrier()


@pytest.mark.parallel(2)
def test_after_the_dead_batch_still_runs():
    WORLD.barrier()
