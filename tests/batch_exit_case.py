"""Multi-rank tests that pass, in a batch whose rank 1 then fails at exit: run only by test_harness.py."""

import atexit
import os

import pytest
from helpers import WORLD


@pytest.mark.parallel(2)
def test_passes_first():
    WORLD.barrier()


@pytest.mark.parallel(2)
def test_passes_then_rank_1_fails_at_exit():
    if WORLD.rank == 1:
        atexit.register(os._exit, 7)
    WORLD.barrier()
