"""Two ranks on one host exchange the agreement's messages in shared memory (collectives/shared_slots.py):
every exchange of such a context goes that way, results stay MPI's, bitwise alike on both ranks, and
calls that differ still raise on both, whichever side of the payload and latency-path limits each is."""

import numpy as np
import pytest
from helpers import (
    WORLD,
    assert_close_to_reference,
    assert_same_on_all_ranks,
    on_all_ranks,
    random_array,
    rank_rng,
)

import gflow
from gflow.collectives.recursive_doubling import PAIR_INLINE_BYTES, SEPARATE_PAYLOAD_BYTES
from gflow.runtime.config import TWO_RANKS_FACTOR
from gflow.runtime.context import context
from gflow.runtime.signature import BFLOAT16

SEED = WORLD.bcast(int(np.random.SeedSequence().entropy % 2**32))  # new inputs every run


def sizes() -> list:
    """float32 counts: small, both sides of MPI's and the slots' limits for a payload in the header's
    message (the first call, before the set-up, is MPI's), the latency path's last, a ring."""
    limit = TWO_RANKS_FACTOR * gflow.config.small_message_bytes
    mpi, pair = SEPARATE_PAYLOAD_BYTES // 4, PAIR_INLINE_BYTES // 4
    return [1, mpi - 1, mpi, pair - 1, pair, limit // 4, limit // 4 + 1000]


@pytest.mark.parallel([2])
@pytest.mark.parametrize("op", ["sum", "max", "mean"])
def test_results_are_mpis_through_the_slots_sync_and_async(op):
    comm = WORLD.Dup()
    for n in sizes():
        x = random_array(rank_rng(SEED + n), n, np.float32)
        for _ in range(2):  # (the fast lane's first call, then its own)
            y = np.full_like(x, np.nan)
            gflow.allreduce(x, op, comm=comm, out=y)
            on_all_ranks(lambda y=y, x=x: assert_close_to_reference(y, x, op), f"n={n}")
            assert_same_on_all_ranks(y)
        z = gflow.allreduce_async(x, op, comm=comm).wait()
        np.testing.assert_array_equal(z, y)
    pair, background = context(comm).slots, context(comm).background().slots
    assert pair and background, (pair, background)
    # (each context's first exchange goes over MPI: the set-up follows it)
    assert pair.sequence >= 2 * len(sizes()) - 1 and background.sequence >= len(sizes()) - 1


@pytest.mark.parallel([2])
def test_calls_that_differ_across_the_limits_raise_on_both_ranks():
    comm = WORLD.Dup()
    gflow.allreduce(np.ones(3), comm=comm)  # (the set-up follows the first exchange)
    assert context(comm).slots
    limit = TWO_RANKS_FACTOR * gflow.config.small_message_bytes
    inline = (PAIR_INLINE_BYTES - 1) // 4
    last = WORLD.rank == 1
    pairs = ((inline, inline + 1), (100, inline + 1), (100, limit // 4 + 1), (inline + 1, limit // 4 + 1))
    for mine, theirs in pairs:
        x = np.ones(theirs if last else mine, np.float32)

        def check(x=x):
            with pytest.raises(gflow.MismatchError, match="the number of elements"):
                gflow.allreduce(x, comm=comm)

        on_all_ranks(check, f"{mine} against {theirs}")
    x = random_array(rank_rng(SEED), 50, np.float64)  # then calls alike work
    on_all_ranks(lambda: assert_close_to_reference(gflow.allreduce(x, comm=comm), x, "sum"))


@pytest.mark.parallel([2])
@pytest.mark.parametrize("refusing_rank", [0, 1])
def test_a_rank_that_turns_it_off_keeps_mpi_on_both(monkeypatch, refusing_rank):
    if WORLD.rank == refusing_rank:
        monkeypatch.setattr(gflow.config, "shared_slots", False)
    comm = WORLD.Dup()
    x = random_array(rank_rng(SEED + 1), 1000, np.float32)
    for _ in range(3):
        y = gflow.allreduce(x, comm=comm)
        on_all_ranks(lambda y=y: assert_close_to_reference(y, x, "sum"))
    assert context(comm).slots is False


@pytest.mark.parallel([2])
def test_join_with_uneven_steps_through_the_slots():
    """The rank that runs out of data first takes part with zeros (collectives/join.py's serve, what
    gflow.torch's join() runs) through the slots: the other's allreduces are its own values plus
    zeros, of every size, and serve() returns on both once both are in it."""
    from gflow.collectives.join import serve

    comm = WORLD.Dup()
    gflow.allreduce(np.ones(2), comm=comm)
    assert context(comm).slots
    counts = [300, SEPARATE_PAYLOAD_BYTES // 8 + 10, 200_000, 400_000, 7]  # inline, apart, a ring
    x = random_array(rank_rng(SEED), 9, np.float64)
    for _ in range(4):  # (a shape whose exchange is compiled by now: it meets the joined rank's header)
        gflow.allreduce(x, comm=comm)
    if WORLD.rank == 0:
        serve(context(comm))
    else:
        for _ in range(2):
            np.testing.assert_array_equal(gflow.allreduce(x, comm=comm), x)
        for n in counts:
            x = random_array(rank_rng(SEED + n), n, np.float64)
            np.testing.assert_array_equal(gflow.allreduce(x, comm=comm), x)  # (plus rank 0's zeros)
        serve(context(comm))


@pytest.mark.parallel([2])
@pytest.mark.parametrize("when", ["in the wait", "as soon as posted"])
def test_a_wait_interrupted_after_its_message_was_posted_refuses_the_next_call(when):
    """Ctrl-C in a wait whose message is in shared memory already: the peer takes that message for its
    own call (as it would an MPI message sent eagerly), so this rank's next call on the communicator
    would pair with the peer's next one: it raises instead, and the peer's call completes. "As soon
    as posted": while the compiled exchange spins (the interrupt is raised as it returns, outside
    the watched wait)."""
    import _thread
    import threading
    import time

    comm = WORLD.Dup()
    for _ in range(3):  # (the set-up, which remakes the plans; then calls that make the compiled
        gflow.allreduce(np.ones(10), comm=comm)  # exchange: the next is one)
    assert context(comm).slots
    x = random_array(rank_rng(SEED + 2), 10, np.float64)
    everyone = WORLD.allgather(x)
    if WORLD.rank == 0 and when == "in the wait":
        threading.Timer(0.3, _thread.interrupt_main).start()
    elif WORLD.rank == 0:
        pair = context(comm).slots
        sequence = pair.sequence + 1
        posted = pair.memory[0, sequence & 1, :8].view(np.int64)

        def interrupt():
            while posted[0] != sequence:
                time.sleep(0)
            _thread.interrupt_main()

        threading.Thread(target=interrupt, daemon=True).start()
    if WORLD.rank == 0:
        with pytest.raises(KeyboardInterrupt):
            gflow.allreduce(x, comm=comm)  # (the peer sleeps: this wait is interrupted)
        with pytest.raises(gflow.GflowError, match="interrupted while its message was with the other ranks"):
            gflow.allreduce(x, comm=comm)
    else:
        time.sleep(1.0)
        y = gflow.allreduce(x, comm=comm)
        np.testing.assert_array_equal(y, everyone[0] + everyone[1])
    WORLD.Barrier()


@pytest.mark.parallel([2])
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16, np.float32, np.float64, np.int32, np.int64])
def test_the_compiled_exchange_pairs_with_pythons_and_gives_its_bits(monkeypatch, dtype):
    """Rank 0 exchanges through the compiled step (native.slots_step, from a shape's second call),
    rank 1 in Python (GFLOW_NATIVE=0): the messages are the same, so they pair; the results are MPI's
    and bitwise alike on both, for every dtype and op, read-only, empty and strided arrays; and a call
    that differs, met by the compiled step, raises on both."""
    if WORLD.rank == 1:
        monkeypatch.setattr(gflow.config, "native", False)

    def random(seed, n):
        if dtype is BFLOAT16:  # (random_array makes NumPy's dtypes)
            return random_array(rank_rng(seed), n, np.float32).astype(BFLOAT16)
        return random_array(rank_rng(seed), n, dtype)

    def check(y, x, op):
        if dtype is not BFLOAT16:
            return assert_close_to_reference(y, x, op)
        low, high = (part.astype(np.float32) for part in WORLD.allgather(x))  # (exact in float32,
        expected = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op](low, high)  # rounded once)
        np.testing.assert_array_equal(y.view(np.uint16), expected.astype(BFLOAT16).view(np.uint16))

    comm = WORLD.Dup()
    gflow.allreduce(np.ones(3), comm=comm)  # (the set-up follows the first exchange)
    for n in (0, 1, 37, 5000):
        x = random(SEED + n, n)
        x.setflags(write=False)
        for op in ("sum", "max", "min"):
            for _ in range(3):
                y = gflow.allreduce(x, op, comm=comm)
                on_all_ranks(lambda y=y, x=x, op=op: check(y, x, op), f"n={n} {op}")
                assert_same_on_all_ranks(y)
            out = np.full_like(x, 7)
            gflow.allreduce(np.ascontiguousarray(x), op, comm=comm, out=out)
            np.testing.assert_array_equal(out.view(np.uint8), y.view(np.uint8))
    wide = random(SEED, 80)[::2]  # (not contiguous: Python's copy, then the slot)
    for _ in range(3):
        on_all_ranks(lambda: check(gflow.allreduce(wide, comm=comm), wide, "sum"))
    compiled = [plan.slots_step is not None for plan in context(comm).rd_plans.values()]
    assert any(compiled) == (WORLD.rank == 0), compiled
    x = random(SEED, 37)
    op = "max" if WORLD.rank == 1 else "sum"  # (rank 0's plan for sum is compiled)

    def differs():
        with pytest.raises(gflow.MismatchError, match="op"):
            gflow.allreduce(x, op, comm=comm)

    on_all_ranks(differs)
    on_all_ranks(lambda: check(gflow.allreduce(x, comm=comm), x, "sum"))


@pytest.mark.parallel([2])
def test_an_interrupt_as_the_compiled_exchange_hands_over_refuses_the_next_call(monkeypatch):
    """The fast lane's compiled exchange meets a header that is not the rank's own (the peer is in
    join()) and hands it to Python's general code; a Ctrl-C that lands there still marks the call
    abandoned (its message is with the peer), so the next call raises instead of pairing with the
    peer's next exchange (which would fold zeros into it, silently)."""
    from gflow.collectives import recursive_doubling
    from gflow.collectives.join import serve

    comm = WORLD.Dup()
    x = random_array(rank_rng(SEED + 3), 16, np.float64)
    for _ in range(4):  # (the set-up, then the plan's compiled exchange)
        gflow.allreduce(x, comm=comm)
    if WORLD.rank == 0:
        general = recursive_doubling._run_plan

        def interrupted(*args, **kwargs):
            if kwargs.get("exchanged"):  # (where a pending SIGINT would be raised)
                raise KeyboardInterrupt
            return general(*args, **kwargs)

        monkeypatch.setattr(recursive_doubling, "_run_plan", interrupted)
        with pytest.raises(KeyboardInterrupt):
            gflow.allreduce(x, comm=comm)
        monkeypatch.setattr(recursive_doubling, "_run_plan", general)
        with pytest.raises(gflow.GflowError, match="interrupted while its message was with the other ranks"):
            gflow.allreduce(x, comm=comm)
    serve(context(comm))  # (rank 1 took the interrupted call's message and serves until both are in it)
    WORLD.Barrier()
