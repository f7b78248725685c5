"""Fault injection: every public entry point, with ONE rank's arguments made wrong in each way the local
checks know (or with the ranks disagreeing on otherwise valid arguments), against the error-path contract:

A. Every rank raises, quickly (within FAST_S). The rank with the bad argument raises its own TypeError or
   ValueError, naming what was expected and what was got; every other rank raises gflow.MismatchError
   naming the bad rank ("rank K called ... with arguments it rejected"). allreduce_async reports both
   through the handle's wait(), LazyAllreduce through flush() (the bad push itself returns, and that
   rank goes on with its step as every rank does). Where the fault is a disagreement
   of valid arguments, every rank raises MismatchError (LazyAllreduce: GflowError from flush(); with
   sparse segments the rank whose own segments changed size may instead reject the step locally, with
   a ValueError, as SparseAllreduce does for a gradient that changed size).
B. Nothing changed: inputs, and out= arrays that are not the result, are bitwise unchanged; pushed
   LazyAllreduce arrays (gradient_buffers views included) keep their local values; every SparseAllreduce
   (direct, or a segment's inside LazyAllreduce(sparse=...)) keeps its residual and step_count.
C. The next correct calls (at least two) are right on every rank: plain collectives against
   helpers.assert_close_to_reference (MPI's own Allreduce and float64 NumPy) or MPI's own
   allgather/bcast; LazyAllreduce and SparseAllreduce bitwise against a twin of the same settings that
   took the same successful steps but never saw the failed one.

How the tables run: one spawn per world size for a whole table. Each case runs on fresh duplicates of
COMM_WORLD (one for the object under test, one for its twin), so a defect in one case cannot leak into
the next; the calls after the failure use the communicator of the failure. The exception is
test_faults_on_the_default_communicator, which runs a few cases back to back on COMM_WORLD itself
(comm=None), as users call gflow. Each step of a case is one helpers.on_all_ranks call, so an assertion
failing on one rank fails that step on every rank and no rank is left waiting in a collective; a failed
case is recorded (its later steps are skipped) and the table goes on; the test fails at the end listing
every failed case. Rank 0 prints each case as it starts, so a hang (caught by the watchdog of
tests/conftest.py, re-armed for each case) shows which case it hung in; the rest of that table is lost.
The bad rank rotates: case i uses rank i % size.

Besides the faults: ndarray subclasses (np.memmap, a user's subclass) are not faults and must equal
plain arrays everywhere, and LossScaler.unscale must really unscale a non-contiguous array (or refuse).
"""

import faulthandler
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest
from helpers import WORLD, assert_close_to_reference, on_all_ranks, random_array, rank_rng
from mpi4py import MPI
from numba import cuda

import gflow

SIZES = [2, 3]
FAST_S = 10.0  # contract A: a failing call fails within this
WAIT_S = 20.0  # Handle.wait's timeout: a hung async call fails its case rather than the whole test
# The watchdog of tests/conftest.py, re-armed for each case: a hang is reported within this, right after
# the log line of the case it hung in, instead of after the whole table's deadline.
# Each table takes seconds; pytest-timeout (120 s in the parent) bounds a whole spawn.
CASE_DEADLINE_S = min(30.0, float(os.environ.get("GFLOW_TEST_DEADLINE", "60")))
IN_MPI_CHILD = "_PYTEST_MPI_CHILD_PROCESS" in os.environ


def log(text: str) -> None:
    """Rank 0 runs with -s under mpi-pytest: what it prints shows with a failed test."""
    if WORLD.rank == 0:
        print(text, flush=True)


# ---------------------------------------------------------------------------------------------------------
# Running cases


class Case:
    """One case on every rank: its label, its bad rank, its communicators and its steps."""

    def __init__(self, label: str, index: int, seed: int, comm, twin_comm):
        self.label, self.index = label, index
        self.bad = index % WORLD.size
        self.rank = WORLD.rank
        self.rng = rank_rng(seed + index)
        self.comm, self.twin_comm = comm, twin_comm

    @property
    def is_bad(self) -> bool:
        return self.rank == self.bad

    def step(self, name: str, fn: Callable[[], Any]) -> None:
        """Run fn on every rank; if it fails on any, the step fails on all (AssertionError)."""
        on_all_ranks(fn, f"{self.label} / {name}")


class Table:
    """Runs cases one after another; records each outcome and goes on after a failure."""

    def __init__(self, name: str, seed: int, default_comm: bool = False):
        self.name, self.seed, self.default_comm = name, seed, default_comm
        self.results: list = []  # (label, None if it passed, else the first line of its failure)
        self.first_failure = None
        self.stuck = False

    def run(self, label: str, case_fn, *args) -> None:
        index = len(self.results)
        label = f"{self.name} #{index} [{label}] bad rank {index % WORLD.size}"
        if self.stuck:
            self.results.append((label, "not run: an earlier case left gflow's background thread hung"))
            return
        log(f"{label} ...")
        if IN_MPI_CHILD:
            faulthandler.dump_traceback_later(CASE_DEADLINE_S, exit=True, file=sys.__stderr__)
        start = time.monotonic()
        comm = None if self.default_comm else WORLD.Dup()
        twin_comm = WORLD.Dup()
        try:
            case_fn(Case(label, index, self.seed, comm, twin_comm), *args)
        except AssertionError as exc:  # from on_all_ranks: raised on every rank alike
            text = str(exc)
            lines = text.splitlines() + ["", ""]
            summary = f"{lines[0].split(' / ', 1)[-1]} {lines[1]}"[:400]
            self.results.append((label, summary))
            self.first_failure = self.first_failure or text
            self.stuck = "did not finish within" in text  # Handle.wait timed out: the engine is hung
            log(f"    FAILED ({time.monotonic() - start:.2f} s): {summary}")
            return
        self.results.append((label, None))
        log(f"    ok ({time.monotonic() - start:.2f} s)")
        for used in (comm, twin_comm):  # (a failed case keeps its duplicates: gflow may still be on them)
            if used is not None:
                used.Free()

    def check(self) -> None:
        failed = [(label, why) for label, why in self.results if why]
        log(f"{self.name}: {len(self.results) - len(failed)} of {len(self.results)} cases passed")
        assert self.results, "no cases ran"
        if failed:
            log(f"first failure in full:\n{self.first_failure}")
        assert not failed, f"{len(failed)} of {len(self.results)} cases failed:\n" + "\n".join(
            f"{label}: {why}" for label, why in failed
        )


# ---------------------------------------------------------------------------------------------------------
# What a failing call must raise, and what it must leave alone


@dataclass(frozen=True)
class Raises:
    """An exception of one of `types` (and none of `not_types`) whose message matches every regex in
    `says` (case-insensitive; "{n}", "{n1}", "{size}", "{nbytes}" are filled in by format())."""

    types: tuple
    says: tuple = ()
    not_types: tuple = ()

    def format(self, **values) -> "Raises":
        return replace(self, says=tuple(s.format(**values) for s in self.says))

    def __str__(self) -> str:
        names = " or ".join(t.__name__ for t in self.types)
        return names + (f" matching {' and '.join(map(repr, self.says))}" if self.says else "")


def local(types, *says) -> Raises:
    """The bad rank's own argument error: a builtin TypeError/ValueError, never a GflowError."""
    return Raises(types if isinstance(types, tuple) else (types,), says, (gflow.GflowError,))


def rejected_by(bad: int) -> Raises:
    """What every other rank raises when rank `bad` rejected its own arguments."""
    return Raises((gflow.MismatchError,), (rf"rank {bad} called [\w ()]+ with arguments it rejected",))


MISMATCH = Raises((gflow.MismatchError,))
LAZY_FAILED = Raises((gflow.GflowError,))


def raises(call: Callable[[], Any], expected: Raises, then: Callable[[Any], str] | None = None):
    """Run call(); assert that it raised `expected`, within FAST_S. Returns the exception.

    If the call returns instead, then(result) is run before failing (to keep this rank in step with
    its peers, e.g. by waiting on a handle the call should not have returned); it says what happened."""
    start = time.monotonic()
    try:
        got = call()
    except Exception as exc:  # noqa: BLE001 - checked below
        elapsed = time.monotonic() - start
        ok = isinstance(exc, expected.types) and not isinstance(exc, expected.not_types)
        assert ok, f"expected {expected}, got {type(exc).__name__}: {exc}"
        for pattern in expected.says:
            assert re.search(pattern, str(exc), re.I | re.S), (
                f"the {type(exc).__name__} does not say {pattern!r}: {exc}"
            )
        assert elapsed < FAST_S, f"took {elapsed:.1f} s to raise {type(exc).__name__}"
        return exc
    elapsed = time.monotonic() - start
    after = f"; {then(got)}" if then is not None else ""
    raise AssertionError(
        f"expected {expected}, but the call returned {type(got).__name__} after {elapsed:.2f} s{after}"
    )


def outcome(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - described, not judged
        return f"raised {type(exc).__name__}: {exc}"
    return "returned"


def all_of(*checks: Callable[[], Any]) -> None:
    """Run every check even when an earlier one fails; fail with all their messages."""
    problems = []
    for check in checks:
        try:
            check()
        except AssertionError as exc:
            problems.append(str(exc))
    assert not problems, " | ".join(problems)


def host(a) -> np.ndarray:
    """A plain host copy of a NumPy array (subclasses too) or a device array."""
    return np.array(a) if isinstance(a, np.ndarray) else a.copy_to_host()


def is_array(a) -> bool:
    return isinstance(a, np.ndarray) or hasattr(a, "copy_to_host")


def same_bits(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def describe_change(before: np.ndarray, now: np.ndarray) -> str:
    if before.shape != now.shape or before.dtype != now.dtype:
        return f"{before.dtype}{before.shape} -> {now.dtype}{now.shape}"
    as_bytes = lambda a: a.reshape(-1).view(np.uint8).reshape(a.size, -1)  # noqa: E731
    differ = np.flatnonzero((as_bytes(before) != as_bytes(now)).any(axis=1))
    i = int(differ[0])
    was, became = before.reshape(-1)[i], now.reshape(-1)[i]
    return f"{differ.size} of {before.size} elements, first at {i}: {was} -> {became}"


class Snapshot:
    """Bitwise copies of arrays, to tell afterwards whether anything changed them."""

    def __init__(self, **things):
        self.saved = [(name, a, host(a)) for name, a in things.items() if is_array(a)]

    def check(self) -> None:
        changed = []
        for name, a, before in self.saved:
            now = host(a)
            if not same_bits(before, now):
                changed.append(f"{name} ({describe_change(before, now)})")
        assert not changed, "changed by the failed call: " + ", ".join(changed)


def csc_state(cscs: dict) -> dict:
    """Each SparseAllreduce's (residual copy, step_count), by key."""
    return {
        k: (None if csc.residual is None else host(csc.residual), csc.step_count) for k, csc in cscs.items()
    }


def assert_same_state(before: dict, after: dict, what: str) -> None:
    problems = []
    for k, (residual, count) in before.items():
        residual_now, count_now = after.get(k, (None, None))
        if count_now != count:
            problems.append(f"{what} {k}: step_count {count} -> {count_now}")
        if not same_bits(residual, residual_now):
            if residual is None or residual_now is None:
                change = f"{'None' if residual is None else 'an array'} -> " + (
                    "None" if residual_now is None else "an array"
                )
            else:
                change = describe_change(residual, residual_now)
            problems.append(f"{what} {k}: residual changed ({change})")
    assert not problems, "; ".join(problems)


# ---------------------------------------------------------------------------------------------------------
# 1, 2, 6. The plain collectives, blocking and async: arguments and faults

# Element counts: the latency path, the ring (> 128 KiB of float32), and a tiny simulated device array.
ELEMS = {"small": 100, "ring": 40_000, "device": 20}
ROW = 4  # allgather's inputs are (rows, ROW); ranks pass different numbers of rows, as they may
AR = frozenset({"allreduce", "allreduce_async"})
REDUCE = AR | {"reduce_scatter"}
ALL = REDUCE | {"allgather", "broadcast"}
BCAST = frozenset({"broadcast"})
HOST = frozenset({"small", "ring"})
EVERYWHERE = frozenset(ELEMS)


def on(where: str, values: np.ndarray):
    """values as the table's kind of array: a NumPy copy, or a (simulated) device array."""
    return cuda.to_device(values) if where == "device" else values.copy()


def non_contiguous(values: np.ndarray, rng, device: bool):
    """An array with values' values that is not C-contiguous (every other element of a larger one)."""
    both = np.stack([values.reshape(-1), random_array(rng, values.size, values.dtype)], axis=1)
    strided = cuda.to_device(both)[:, 0] if device else both[:, 0]
    contiguous = strided.is_c_contiguous() if device else strided.flags.c_contiguous
    assert not contiguous and np.array_equal(host(strided), values.reshape(-1))
    return strided


def read_only(values: np.ndarray) -> np.ndarray:
    a = values.copy()
    a.flags.writeable = False
    return a


@dataclass
class Args:
    """One rank's arguments to one call, and x's values saved before it (x may also be the out)."""

    x: Any
    kw: dict
    values: np.ndarray


def good_args(entry: str, where: str, rng, index: int) -> Args:
    n = ELEMS[where]
    shape = (n // ROW + WORLD.rank, ROW) if entry == "allgather" else (n,)
    values = random_array(rng, shape, np.float32)
    x = on(where, values)
    kw: dict = {}
    if entry in REDUCE:
        kw["op"] = "sum"
    if entry in AR:  # the good ranks take turns: a new result, a separate out=, in place
        mode = index % 3
        if mode == 1:
            kw["out"] = on(where, random_array(rng, shape, np.float32))
        elif mode == 2:
            kw["out"] = x
    if entry == "broadcast":
        kw["root"] = (index + 1) % WORLD.size
    return Args(x, kw, values)


def without_out(kw: dict) -> dict:
    return {k: v for k, v in kw.items() if k != "out"}


def new_x(make_values):
    """The bad rank passes other values as x, in the table's kind of array (and no out=)."""
    return lambda a, where, rng: (on(where, make_values(a.values, rng)), without_out(a.kw))


def new_kw(**changes):
    return lambda a, where, rng: (a.x, {**a.kw, **changes})


def new_out(make_out):
    return lambda a, where, rng: (a.x, {**a.kw, "out": make_out(a.values, where, rng)})


def ints(values, rng) -> np.ndarray:
    return random_array(rng, values.shape, np.int32)


def uint8s(values, rng) -> np.ndarray:
    return rng.integers(1, 255, size=values.shape, dtype=np.uint8)


def complexes(values, rng) -> np.ndarray:
    return (values + 1j * random_array(rng, values.shape, np.float32)).astype(np.complex64)


@dataclass(frozen=True)
class Fault:
    """What the bad rank passes instead (make(args, where, rng) -> (x, kwargs)) and what it raises; for
    a disagreement, what every rank raises."""

    name: str
    make: Callable
    expect: Raises
    entries: frozenset = ALL
    where: frozenset = EVERYWHERE
    disagreement: bool = False


FAULTS = [
    # The bad rank's own arguments fail its local checks.
    Fault(
        "x is a list",
        lambda a, where, rng: (a.values.tolist(), without_out(a.kw)),
        local(TypeError, "NumPy array", r"\blist\b"),
    ),
    Fault("x is uint8", new_x(uint8s), local(TypeError, "uint8", "float32")),
    Fault("x is complex64", new_x(complexes), local(TypeError, "complex64", "float32")),
    Fault("op='prod'", new_kw(op="prod"), local(ValueError, "prod", "sum"), REDUCE),
    Fault("op=MPI.PROD", new_kw(op=MPI.PROD), local(ValueError, "MPI", "SUM"), REDUCE),
    Fault(
        "op='mean' on int32",
        lambda a, where, rng: (on(where, ints(a.values, rng)), {**without_out(a.kw), "op": "mean"}),
        local(TypeError, "mean", "int32"),
        REDUCE,
    ),
    Fault(
        "out of the wrong size",
        new_out(lambda v, where, rng: on(where, random_array(rng, v.size + 1, np.float32))),
        local(ValueError, r"\b{n}\b", r"\b{n1}\b"),
        AR,
    ),
    Fault(
        "out of the wrong dtype",
        new_out(lambda v, where, rng: on(where, random_array(rng, v.shape, np.float64))),
        local(TypeError, "float32", "float64"),
        AR,
    ),
    Fault(
        "a non-contiguous out",
        new_out(lambda v, where, rng: non_contiguous(v, rng, where == "device")),
        local(ValueError, "contiguous"),
        AR,
    ),
    Fault(
        "a read-only out",
        new_out(lambda v, where, rng: read_only(random_array(rng, v.shape, np.float32))),
        local(ValueError, "read-only|writ"),
        AR,
        HOST,
    ),
    Fault(
        "a read-only x with out=x",
        lambda a, where, rng: (ro := read_only(a.values), {**a.kw, "out": ro}),
        local(ValueError, "read-only|writ"),
        AR,
        HOST,
    ),
    Fault("algorithm='tree'", new_kw(algorithm="tree"), local(ValueError, "tree", "ring"), AR),
    Fault(
        "algorithm='recursive_doubling' on a ring-sized x",
        new_kw(algorithm="recursive_doubling"),
        local(ValueError, "recursive_doubling", r"\b{nbytes}\b"),
        AR,
        frozenset({"ring"}),
    ),
    Fault("compression='int8'", new_kw(compression="int8"), local(ValueError, "int8", "fp16"), AR),
    Fault(
        "compression='fp16' on int32",
        lambda a, where, rng: (on(where, ints(a.values, rng)), {**without_out(a.kw), "compression": "fp16"}),
        local(TypeError, "fp16", "int32"),
        AR,
    ),
    Fault(
        "root out of range",
        lambda a, where, rng: (a.x, {**a.kw, "root": WORLD.size}),
        local(ValueError, "root", r"\b{size}\b"),
        BCAST,
    ),
    Fault("a negative root", new_kw(root=-1), local(ValueError, "root", "-1"), BCAST),
    Fault("root is a float", new_kw(root=1.0), local(TypeError, "root", "int", "float"), BCAST),
    Fault(
        "a non-contiguous device x",
        lambda a, where, rng: (non_contiguous(a.values, rng, device=True), without_out(a.kw)),
        local(ValueError, "contiguous"),
        where=frozenset({"device"}),
    ),
    Fault(
        "a host out for a device x",
        new_out(lambda v, where, rng: random_array(rng, v.shape, np.float32)),
        local(TypeError, "out", "device"),
        AR,
        frozenset({"device"}),
    ),
    Fault(
        "a device out for a host x",
        new_out(lambda v, where, rng: cuda.to_device(random_array(rng, v.shape, np.float32))),
        local(TypeError, "out", "NumPy|host"),
        AR,
        frozenset({"small"}),
    ),
    # The ranks disagree on otherwise valid arguments: every rank raises MismatchError.
    Fault(
        "a different length",
        new_x(lambda v, rng: random_array(rng, v.size + 1, np.float32)),
        MISMATCH,
        REDUCE | BCAST,
        disagreement=True,
    ),
    Fault(
        "a different dtype",
        new_x(lambda v, rng: random_array(rng, v.shape, np.float64)),
        MISMATCH,
        disagreement=True,
    ),
    Fault("a different op", new_kw(op="max"), MISMATCH, REDUCE, disagreement=True),
    Fault(
        "algorithm='ring' on one rank only",
        new_kw(algorithm="ring"),
        MISMATCH,
        AR,
        frozenset({"small"}),
        disagreement=True,
    ),
    Fault("compression='fp16' on one rank only", new_kw(compression="fp16"), MISMATCH, AR, disagreement=True),
    Fault(
        "different trailing axes",
        new_x(lambda v, rng: random_array(rng, (v.shape[0], ROW + 1), np.float32)),
        MISMATCH,
        frozenset({"allgather"}),
        disagreement=True,
    ),
    Fault(
        "a different root",
        lambda a, where, rng: (a.x, {**a.kw, "root": (a.kw["root"] + 1) % WORLD.size}),
        MISMATCH,
        BCAST,
        disagreement=True,
    ),
    Fault(
        "a host x among device arrays",
        lambda a, where, rng: (a.values.copy(), without_out(a.kw)),
        MISMATCH,
        where=frozenset({"device"}),
        disagreement=True,
    ),
    Fault(
        "a device x among host arrays",
        lambda a, where, rng: (cuda.to_device(a.values), without_out(a.kw)),
        MISMATCH,
        where=frozenset({"small"}),
        disagreement=True,
    ),
]
FAULT = {f.name: f for f in FAULTS}

CALLS = {
    "allreduce": gflow.allreduce,
    "reduce_scatter": gflow.reduce_scatter,
    "allgather": gflow.allgather,
    "broadcast": gflow.broadcast,
}


def call(entry: str, x, kw: dict, comm):
    """One call of a plain collective (async ones waited for, with a timeout)."""
    if entry == "allreduce_async":
        return gflow.allreduce_async(x, comm=comm, **kw).wait(timeout=WAIT_S)
    return CALLS[entry](x, comm=comm, **kw)


def check_result(entry: str, result, args: Args) -> None:
    """Collective: the result of a correct call, against MPI's own and NumPy's."""
    got = host(result)
    if entry in AR:
        if args.kw.get("out") is not None:
            assert result is args.kw["out"], "allreduce(out=...) did not return out"
        assert_close_to_reference(got, args.values, args.kw["op"])
    elif entry == "reduce_scatter":
        full = np.concatenate(WORLD.allgather(got))  # the shards, in rank order, are the whole result
        assert full.shape == (args.values.size,), f"the shards add up to {full.shape}"
        assert_close_to_reference(full, args.values.reshape(-1), args.kw["op"])
    elif entry == "allgather":
        expected = np.concatenate(WORLD.allgather(args.values))
        assert same_bits(got, expected), "allgather differs from MPI's own"
    else:
        expected = WORLD.bcast(args.values, root=args.kw["root"])
        assert same_bits(got, expected), "broadcast differs from MPI's own"


def async_fails(x, kw: dict, comm, expected: Raises) -> None:
    """allreduce_async: the call returns a handle on every rank (bad arguments included, so every rank's
    program takes the same path); its wait() raises what is expected on this rank."""
    try:
        handle = gflow.allreduce_async(x, comm=comm, **kw)
    except Exception as exc:  # noqa: BLE001 - reported as what it is
        raise AssertionError(
            f"allreduce_async raised {type(exc).__name__}: {exc}, instead of returning a handle"
        ) from None
    raises(lambda: handle.wait(timeout=WAIT_S), expected)


def collective_case(c: Case, entry: str, where: str, fault: Fault) -> None:
    good = good_args(entry, where, c.rng, c.index)
    x, kw = fault.make(good, where, c.rng) if c.is_bad else (good.x, good.kw)
    n = good.values.size
    expected = fault.expect if (c.is_bad or fault.disagreement) else rejected_by(c.bad)
    expected = expected.format(n=n, n1=n + 1, size=WORLD.size, nbytes=good.values.nbytes)
    before = Snapshot(x=x, out=kw.get("out"))
    if entry == "allreduce_async":
        fail = lambda: async_fails(x, kw, c.comm, expected)  # noqa: E731
    else:
        fail = lambda: raises(lambda: CALLS[entry](x, comm=c.comm, **kw), expected)  # noqa: E731
    c.step("the faulty call", lambda: all_of(fail, before.check))

    if entry == "allreduce_async":  # the protocol of the issue: steps 2, 3, 4 after the failed one
        for s in (2, 3, 4):

            def step_s(s=s):
                y = gflow.allreduce_async(np.full(16, s, np.float32), comm=c.comm).wait(timeout=WAIT_S)
                np.testing.assert_array_equal(y, np.full(16, s * WORLD.size, np.float32))

            c.step(f"allreduce_async step {s}", step_s)
    for k in (1, 2):  # correct calls at the case's size and kind, against the references
        args = good_args(entry, where, c.rng, c.index + k)
        got: dict = {}
        c.step(
            f"correct call {k}", lambda args=args, got=got: got.update(y=call(entry, args.x, args.kw, c.comm))
        )
        c.step(f"correct result {k}", lambda args=args, got=got: check_result(entry, got["y"], args))


def run_collective_table(table: Table, entries, wheres) -> None:
    for where in wheres:
        for entry in entries:
            for fault in FAULTS:
                if entry in fault.entries and where in fault.where:
                    table.run(f"{entry} {where}: {fault.name}", collective_case, entry, where, fault)


PLAIN = ["allreduce", "reduce_scatter", "allgather", "broadcast"]


@pytest.mark.parallel(SIZES)
@pytest.mark.parametrize("where", ["small", "ring", "device"])
def test_blocking_collectives_with_one_bad_rank(where):
    table = Table(f"blocking {where}", seed=100)
    run_collective_table(table, PLAIN, [where])
    table.check()


@pytest.mark.parallel([2, 3, 4])  # the protocol of the issue: one of the two tests run at 4 ranks too
def test_async_allreduce_with_one_bad_rank():
    table = Table("async", seed=200)
    run_collective_table(table, ["allreduce_async"], ["small", "ring", "device"])
    table.check()


# ---------------------------------------------------------------------------------------------------------
# 3. LazyAllreduce: several segments per step, one rank's push bad (or the ranks' pushes disagreeing)

LAZY_SHAPES = [(30, 10), (5,), (700,), (17,), (30, 30), (64,)]
LAZY_THRESHOLD = 1600  # bytes: segments [0, 1, 2], [3, 4], [5]
LAZY_SPARSE = {"density": 0.3, "chunk_elems": 16}
LAZY_CONFIGS = {  # name: (LazyAllreduce settings, whether the gradients are its gradient_buffers)
    "dense": ({"op": "mean"}, False),
    "fp16": ({"op": "mean", "compression": "fp16"}, False),
    "sparse": ({"op": "mean", "sparse": LAZY_SPARSE}, False),
    "sparse+fp16": ({"op": "mean", "compression": "fp16", "sparse": LAZY_SPARSE}, False),
    "dense, gradient_buffers": ({"op": "mean"}, True),
}


class Fused:
    """A LazyAllreduce and its gradients: new arrays every step, or its gradient_buffers (pool views)."""

    def __init__(self, settings: dict, pool: bool, comm):
        self.lazy = gflow.LazyAllreduce(threshold_bytes=LAZY_THRESHOLD, comm=comm, **settings)
        self.grads = self.lazy.gradient_buffers(LAZY_SHAPES) if pool else None

    def tensors(self, values) -> list:
        if self.grads is None:
            return [v.copy() for v in values]
        for g, v in zip(self.grads, values, strict=True):
            g[...] = v
        return list(self.grads)

    def step(self, tensors) -> None:
        for t in tensors:
            self.lazy.push(t)
        self.lazy.flush()

    def state(self) -> dict:
        return csc_state(self.lazy._csc)


def lazy_values(rng, scale=None) -> list:
    if scale is not None:
        return [np.full(s, scale, np.float32) for s in LAZY_SHAPES]
    return [random_array(rng, s, np.float32) for s in LAZY_SHAPES]


def lazy_steps(c: Case, objs: dict, count: int, name: str) -> None:
    """`count` steps pushed alike on every rank, by the object under test and by its twin: equal bitwise."""
    for k in range(1, count + 1):
        values = lazy_values(c.rng)
        mine: dict = {}

        def step_mine(values=values, mine=mine):
            mine["t"] = objs["fused"].tensors(values)
            objs["fused"].step(mine["t"])

        def step_twin_and_compare(values=values, mine=mine):
            theirs = objs["twin"].tensors(values)
            objs["twin"].step(theirs)
            differ = [
                i for i, (a, b) in enumerate(zip(mine["t"], theirs, strict=True)) if not same_bits(a, b)
            ]
            assert not differ, f"tensors {differ} differ from the twin's"
            assert_same_state(objs["twin"].state(), objs["fused"].state(), "segment (vs the twin)")

        c.step(f"{name} {k}", step_mine)
        c.step(f"{name} {k}: equal to the twin", step_twin_and_compare)


def make_fused(c: Case, config: str) -> dict:
    settings, pool = LAZY_CONFIGS[config]
    objs: dict = {}

    def construct():
        objs["fused"] = Fused(settings, pool, c.comm)
        objs["twin"] = Fused(settings, pool, c.twin_comm)

    c.step("construct", construct)
    return objs


@dataclass(frozen=True)
class PushFault:
    """A bad argument the bad rank pushes at position j (bad(t, rng) -> it), or, for a disagreement,
    the whole sequence it pushes instead (sequence(tensors, j, rng) -> list)."""

    name: str
    expect: Raises | None = None
    bad: Callable | None = None
    sequence: Callable | None = None
    configs: tuple = tuple(LAZY_CONFIGS)


def replaced(tensors, j, t) -> list:
    return tensors[:j] + [t] + tensors[j + 1 :]


def swapped(tensors, j) -> list:
    i, k = j, (j + 1) % len(tensors)
    out = list(tensors)
    out[i], out[k] = out[k], out[i]
    return out


PUSH_FAULTS = [
    PushFault("a list", local(TypeError, "NumPy array", r"\blist\b"), bad=lambda t, rng: t.tolist()),
    PushFault("uint8", local(TypeError, "uint8", "float32"), bad=lambda t, rng: uint8s(t, rng)),
    PushFault("complex64", local(TypeError, "complex64", "float32"), bad=lambda t, rng: complexes(t, rng)),
    PushFault("int32 under op='mean'", local(TypeError, "int32", "float"), bad=lambda t, rng: ints(t, rng)),
    PushFault(
        "a non-contiguous array",
        local(ValueError, "contiguous"),
        bad=lambda t, rng: non_contiguous(t, rng, device=False),
    ),
    PushFault("a read-only array", local(ValueError, "read-only|writ"), bad=lambda t, rng: read_only(t)),
    PushFault(
        "a non-contiguous device array",
        local(ValueError, "contiguous"),
        bad=lambda t, rng: non_contiguous(t, rng, device=True),
        configs=("dense", "sparse+fp16"),
    ),
    PushFault(
        "one tensor more",
        sequence=lambda ts, j, rng: ts + [random_array(rng, 50, np.float32)],
    ),
    PushFault("one tensor fewer", sequence=lambda ts, j, rng: ts[:-1]),
    PushFault(
        "a different size",
        sequence=lambda ts, j, rng: replaced(ts, j, random_array(rng, ts[j].size + 1, np.float32)),
    ),
    PushFault("swapped order", sequence=lambda ts, j, rng: swapped(ts, j)),
    PushFault(
        "a float64 tensor",
        sequence=lambda ts, j, rng: replaced(ts, j, random_array(rng, ts[j].shape, np.float64)),
    ),
]
PUSH_FAULT = {f.name: f for f in PUSH_FAULTS}


def lazy_case(c: Case, config: str, fault: PushFault) -> None:
    j = (c.index // WORLD.size) % len(LAZY_SHAPES)  # where the bad push goes; every rank takes a turn
    objs = make_fused(c, config)
    lazy_steps(c, objs, 1, "step before")
    fused = objs["fused"]
    tensors = fused.tensors(lazy_values(c.rng))
    bad_arg = None
    if fault.sequence is not None:
        pushes = fault.sequence(tensors, j, c.rng) if c.is_bad else tensors
        expected = LAZY_FAILED
    elif c.is_bad:
        pushes, bad_arg = tensors[:j], fault.bad(tensors[j], c.rng)
        expected = fault.expect
    else:
        pushes, expected = tensors, Raises((gflow.GflowError,), (rf"rank {c.bad}\b",))
    # With sparse segments a rank whose own segments change size from one step to the next (each keeps
    # its residual) may also reject that locally, with a ValueError from the push or flush that fires it.
    own_check = fault.sequence is not None and c.is_bad and "sparse" in LAZY_CONFIGS[config][0]
    before = Snapshot(bad=bad_arg, **{f"tensor {i}": t for i, t in enumerate(tensors + pushes)})
    state = fused.state()

    def push_all_and_flush():
        for t in pushes:
            fused.lazy.push(t)
        fused.lazy.flush()

    def faulty_step():
        if own_check:
            raises(push_all_and_flush, Raises((gflow.GflowError, ValueError)))
            return
        for t in pushes:
            fused.lazy.push(t)
        if bad_arg is not None:  # reported by flush(), after the rest of the step, as on every rank
            fused.lazy.push(bad_arg)
            for t in tensors[j + 1 :]:
                fused.lazy.push(t)
        raises(fused.lazy.flush, expected)

    c.step(
        "the faulty step",
        lambda: all_of(
            faulty_step, before.check, lambda: assert_same_state(state, fused.state(), "segment CSC")
        ),
    )
    lazy_steps(c, objs, 2, "step after")


@pytest.mark.parallel(SIZES)
def test_lazy_allreduce_with_one_bad_rank():
    table = Table("lazy", seed=400)
    for config in LAZY_CONFIGS:
        for fault in PUSH_FAULTS:
            if config in fault.configs:
                table.run(f"{config}: {fault.name}", lazy_case, config, fault)
    table.check()


# ---------------------------------------------------------------------------------------------------------
# 4. SparseAllreduce: one rank's gradient bad, or the ranks' sizes disagreeing

SPARSE_N = 1000
SPARSE_SETTINGS = {"density": 0.3, "chunk_elems": 64}
SPARSE_CONFIGS = [(compression, op) for compression in (None, "fp16") for op in ("sum", "mean", MPI.SUM)]


@dataclass(frozen=True)
class GradFault:
    """What the bad rank passes (make(g, rng) -> it) after `warmup` good steps, and what it raises (for
    a disagreement: what every rank raises)."""

    name: str
    make: Callable
    expect: Raises
    warmup: int = 2
    disagreement: bool = False
    n: int = SPARSE_N
    settings: dict = field(default_factory=lambda: SPARSE_SETTINGS)


GRAD_FAULTS = [
    GradFault("an int32 gradient at the first call", ints, local(TypeError, "int32", "float"), warmup=0),
    GradFault("an int32 gradient", ints, local(TypeError, "int32", "float")),
    GradFault("a list", lambda g, rng: g.tolist(), local(TypeError, "NumPy array", r"\blist\b")),
    GradFault("a complex64 gradient", complexes, local(TypeError, "complex64", "float")),
    GradFault(
        "a size different from its earlier calls",
        lambda g, rng: random_array(rng, g.size + 10, np.float32),
        local(ValueError, r"\b1000\b", r"\b1010\b"),
    ),
    GradFault(
        "one element more than its earlier calls (same number of chunks)",
        lambda g, rng: random_array(rng, g.size + 1, np.float32),
        local(ValueError, r"\b1000\b", r"\b1001\b"),
    ),
    GradFault(
        "float64 after float32 calls",
        lambda g, rng: g.astype(np.float64),
        local((TypeError, ValueError), "float32", "float64"),
    ),
    GradFault(
        "2000 vs 2001 elements at the first call (the short last chunk not selected)",
        lambda g, rng: np.concatenate([g, random_array(rng, 1, np.float32)]),
        MISMATCH,
        warmup=0,
        disagreement=True,
        n=2000,
        settings={"density": 0.5, "chunk_elems": 1024},
    ),
    GradFault(
        "1000 vs 1064 elements at the first call",
        lambda g, rng: random_array(rng, g.size + 64, np.float32),
        MISMATCH,
        warmup=0,
        disagreement=True,
    ),
]
GRAD_FAULT = {f.name: f for f in GRAD_FAULTS}


def sparse_grad(rng, n: int, chunk: int) -> np.ndarray:
    g = random_array(rng, n, np.float32)
    g[:chunk] *= 10  # the first chunk is the heaviest: with two chunks, the short last one is not sent
    return g


def sparse_steps(c: Case, objs: dict, n: int, chunk: int, count: int, name: str) -> None:
    """`count` steps alike on every rank, by the object under test and its twin: equal bitwise."""
    for k in range(1, count + 1):
        g = sparse_grad(c.rng, n, chunk)
        got: dict = {}

        def step_mine(g=g, got=got):
            got["u"] = objs["csc"](g.copy())

        def step_twin_and_compare(g=g, got=got):
            u = objs["twin"](g.copy())
            assert same_bits(host(got["u"]), host(u)), "the update differs from the twin's"
            assert_same_state(csc_state({0: objs["twin"]}), csc_state({0: objs["csc"]}), "(vs the twin)")

        c.step(f"{name} {k}", step_mine)
        c.step(f"{name} {k}: equal to the twin", step_twin_and_compare)


def make_sparse(c: Case, settings: dict) -> dict:
    objs: dict = {}
    twin_settings = {**settings, "op": "sum" if settings["op"] is MPI.SUM else settings["op"]}

    def construct():
        objs["csc"] = gflow.SparseAllreduce(comm=c.comm, **settings)
        objs["twin"] = gflow.SparseAllreduce(comm=c.twin_comm, **twin_settings)  # MPI.SUM is "sum"

    c.step("construct", construct)
    return objs


def sparse_case(c: Case, compression, op, fault: GradFault) -> None:
    settings = {**fault.settings, "op": op, "compression": compression}
    chunk = settings["chunk_elems"]
    objs = make_sparse(c, settings)
    sparse_steps(c, objs, fault.n, chunk, fault.warmup, "step before")
    g = sparse_grad(c.rng, fault.n, chunk)
    mine = fault.make(g, c.rng) if c.is_bad else g
    expected = fault.expect if (c.is_bad or fault.disagreement) else rejected_by(c.bad)
    before = Snapshot(grad=mine)
    state = csc_state({0: objs["csc"]})

    def after():
        assert_same_state(state, csc_state({0: objs["csc"]}), "SparseAllreduce")

    c.step(
        "the faulty call",
        lambda: all_of(lambda: raises(lambda: objs["csc"](mine), expected), before.check, after),
    )
    sparse_steps(c, objs, fault.n, chunk, 2, "step after")


def op_name(op) -> str:
    return "MPI.SUM" if op is MPI.SUM else repr(op)


@pytest.mark.parallel(SIZES)
def test_sparse_allreduce_with_one_bad_rank():
    table = Table("sparse", seed=500)
    for compression, op in SPARSE_CONFIGS:
        for fault in GRAD_FAULTS:
            label = f"compression={compression!r} op={op_name(op)}: {fault.name}"
            table.run(label, sparse_case, compression, op, fault)
    table.check()


# ---------------------------------------------------------------------------------------------------------
# 5. fp16 and non-finite values in the sparse path

FP16_SPARSE = {"density": 0.5, "chunk_elems": 64, "compression": "fp16"}


def check_sent_within_fp16(update, before, g, after) -> None:
    """Collective. update: this step's (flat) update; before/after: this rank's (flat) residual around
    the step; g: this rank's gradient. What was sent equals the ranks' sum of what they owed within
    float16 rounding, and nothing was lost (op "sum", momentum 0)."""
    p = WORLD.size
    owed = np.sum(WORLD.allgather(before.astype(np.float64) + g), axis=0)
    left = np.sum(WORLD.allgather(after.astype(np.float64)), axis=0)
    tol = (p + 2) * 2.0**-11 * np.abs(owed) + 2.0**-24
    assert np.all(np.isfinite(update)), "the update holds inf or NaN"
    sent = update != 0
    assert sent.any(), "nothing was sent"
    err = np.abs(update.astype(np.float64) - owed)
    assert np.all(err[sent] <= tol[sent]), (
        f"sent values off by up to {np.max(err[sent] / np.abs(owed[sent]))} (relative)"
    )
    lost = np.abs(update + left - owed)
    assert np.all(lost <= tol), f"update + residuals differ from what was owed by up to {lost.max()}"


def flat_or_zeros(a, n) -> np.ndarray:
    return np.zeros(n, np.float32) if a is None else host(a).reshape(-1)


def sparse_large_values_case(c: Case) -> None:
    """40000.0 on every rank, op "sum": the float16 sum would overflow, the sparse path must not."""
    n = SPARSE_N
    objs: dict = {}
    c.step("construct", lambda: objs.update(csc=gflow.SparseAllreduce(op="sum", comm=c.comm, **FP16_SPARSE)))
    csc = objs["csc"]
    g = np.full(n, 40000.0, np.float32)
    for k in range(1, 4):
        got: dict = {}

        def step(got=got):
            got["before"] = flat_or_zeros(csc.residual, n)
            got["u"] = host(csc(g.copy()))

        c.step(f"step {k} of 40000.0 everywhere", step)
        c.step(
            f"step {k}: within float16 rounding",
            lambda got=got: check_sent_within_fp16(
                got["u"], got["before"], g, flat_or_zeros(csc.residual, n)
            ),
        )


def sparse_non_finite_case(c: Case, op: str, bad_value: float) -> None:
    """One rank's gradient holds a non-finite value: every rank raises CompressionOverflowError."""
    n = SPARSE_N
    objs = make_sparse(c, {**FP16_SPARSE, "op": op})
    sparse_steps(c, objs, n, 64, 1, "step before")
    g = sparse_grad(c.rng, n, 64)
    if c.is_bad:
        g[int(c.rng.integers(n))] = bad_value
    before, state = Snapshot(grad=g), csc_state({0: objs["csc"]})

    def after():
        assert_same_state(state, csc_state({0: objs["csc"]}), "SparseAllreduce")

    overflow = Raises((gflow.CompressionOverflowError,))
    c.step(
        "the non-finite step",
        lambda: all_of(lambda: raises(lambda: objs["csc"](g), overflow), before.check, after),
    )
    sparse_steps(c, objs, n, 64, 2, "finite step after")


def lazy_large_values_case(c: Case) -> None:
    """LazyAllreduce(fp16, sparse), op "sum", 40000.0 on every rank: succeeds, within float16 rounding."""
    objs: dict = {}
    settings = {"op": "sum", "compression": "fp16", "sparse": LAZY_SPARSE}
    c.step("construct", lambda: objs.update(fused=Fused(settings, False, c.comm)))
    fused = objs["fused"]
    total = sum(int(np.prod(s)) for s in LAZY_SHAPES)

    def residuals():
        if not fused.lazy._csc:
            return np.zeros(total, np.float32)
        return np.concatenate(
            [flat_or_zeros(fused.lazy._csc[k].residual, 0) for k in sorted(fused.lazy._csc)]
        )

    values = lazy_values(c.rng, scale=40000.0)
    g = np.concatenate([v.reshape(-1) for v in values])
    for k in range(1, 4):
        got: dict = {}

        def step(got=got):
            got["before"] = residuals()
            tensors = fused.tensors(values)
            fused.step(tensors)
            got["u"] = np.concatenate([t.reshape(-1) for t in tensors])

        c.step(f"step {k} of 40000.0 everywhere", step)
        c.step(
            f"step {k}: within float16 rounding",
            lambda got=got: check_sent_within_fp16(got["u"], got["before"], g, residuals()),
        )


def lazy_non_finite_case(c: Case, op: str, bad_value: float) -> None:
    objs: dict = {}
    settings = {"op": op, "compression": "fp16", "sparse": LAZY_SPARSE}

    def construct():
        objs["fused"] = Fused(settings, False, c.comm)
        objs["twin"] = Fused(settings, False, c.twin_comm)

    c.step("construct", construct)
    lazy_steps(c, objs, 1, "step before")
    fused = objs["fused"]
    tensors = fused.tensors(lazy_values(c.rng))
    if c.is_bad:
        t = tensors[(c.index // WORLD.size) % len(tensors)].reshape(-1)
        t[int(c.rng.integers(t.size))] = bad_value
    before = Snapshot(**{f"tensor {i}": t for i, t in enumerate(tensors)})
    state = fused.state()
    overflow = Raises((gflow.CompressionOverflowError,))
    c.step(
        "the non-finite step",
        lambda: all_of(
            lambda: raises(lambda: fused.step(tensors), overflow),
            before.check,
            lambda: assert_same_state(state, fused.state(), "segment CSC"),
        ),
    )
    lazy_steps(c, objs, 2, "finite step after")


@pytest.mark.parallel(SIZES)
def test_fp16_sparse_large_and_non_finite_values():
    table = Table("fp16", seed=600)
    table.run("SparseAllreduce fp16 sum: 40000.0 on every rank", sparse_large_values_case)
    table.run("LazyAllreduce fp16+sparse sum: 40000.0 on every rank", lazy_large_values_case)
    for op in ("sum", "mean"):
        for bad_value in (np.nan, np.inf, -np.inf):
            table.run(
                f"SparseAllreduce fp16 {op}: {bad_value} on one rank", sparse_non_finite_case, op, bad_value
            )
            table.run(
                f"LazyAllreduce fp16+sparse {op}: {bad_value} on one rank",
                lazy_non_finite_case,
                op,
                bad_value,
            )
    table.check()


# ---------------------------------------------------------------------------------------------------------
# 6. ndarray subclasses are not faults: they work, and equal the plain-ndarray result on every rank


class Sub(np.ndarray):
    """A trivial user subclass."""


class Subclasses:
    """Makes memmaps (each over its own file in this rank's temporary folder) and Sub arrays."""

    def __init__(self, folder: str):
        self.folder, self.count = folder, 0

    def make(self, kind: str, values: np.ndarray) -> np.ndarray:
        if kind == "Sub":
            return values.copy().view(Sub)
        self.count += 1
        path = os.path.join(self.folder, f"memmap{self.count}.bin")
        m = np.memmap(path, dtype=values.dtype, mode="w+", shape=values.shape)
        m[...] = values
        return m


SUBCLASS_ENTRIES = [
    "allreduce",
    "allreduce out=subclass",
    "allreduce in place",
    "allreduce_async",
    "reduce_scatter",
    "allgather",
    "broadcast",
    "LazyAllreduce.push",
    "SparseAllreduce",
]


def subclass_case(c: Case, entry: str, kind: str, everyone: bool, subclasses: Subclasses) -> None:
    uses = everyone or c.is_bad  # the ranks passing the subclass; the others pass plain arrays

    def maybe(values):
        return subclasses.make(kind, values) if uses else values.copy()

    if entry == "LazyAllreduce.push":
        objs = make_fused(c, "dense")
        for k in range(1, 3):
            values = lazy_values(c.rng)
            got: dict = {}

            def step(values=values, got=got):
                got["t"] = [maybe(v) for v in values]
                objs["fused"].step(got["t"])

            def compare(values=values, got=got):
                plain = objs["twin"].tensors(values)
                objs["twin"].step(plain)
                differ = [
                    i
                    for i, (a, b) in enumerate(zip(got["t"], plain, strict=True))
                    if not same_bits(host(a), b)
                ]
                assert not differ, f"tensors {differ} differ from the plain arrays' results"

            c.step(f"step {k} with {kind} arrays", step)
            c.step(f"step {k}: equal to plain arrays", compare)
        return
    if entry == "SparseAllreduce":
        objs = make_sparse(c, {**SPARSE_SETTINGS, "op": "mean", "compression": None})
        for k in range(1, 3):
            g = sparse_grad(c.rng, SPARSE_N, 64)
            got: dict = {}

            def step(g=g, got=got):
                x = maybe(g)
                got["u"] = host(objs["csc"](x))
                assert same_bits(host(x), g), "the gradient was modified"

            def compare(g=g, got=got):
                assert same_bits(got["u"], host(objs["twin"](g.copy()))), (
                    "differs from a plain array's update"
                )
                assert_same_state(csc_state({0: objs["twin"]}), csc_state({0: objs["csc"]}), "(vs plain)")

            c.step(f"step {k} with a {kind} gradient", step)
            c.step(f"step {k}: equal to plain arrays", compare)
        return

    base = "allreduce" if entry.startswith("allreduce ") else entry
    shape = (100 // ROW + WORLD.rank, ROW) if entry == "allgather" else (100,)
    values = random_array(c.rng, shape, np.float32)
    kw: dict = {"op": "sum"} if base in REDUCE else {}
    if base == "broadcast":
        kw["root"] = c.bad
    got: dict = {}

    def plain_call():
        got["plain"] = host(call(base, values.copy(), kw, c.comm))

    def subclass_call():
        x = maybe(values)
        sub_kw = dict(kw)
        if entry == "allreduce out=subclass":
            sub_kw["out"] = maybe(random_array(c.rng, shape, np.float32))
        elif entry == "allreduce in place":
            sub_kw["out"] = x
        result = call(base, x, sub_kw, c.comm)
        if "out" in sub_kw:
            assert result is sub_kw["out"], "allreduce(out=...) did not return out"
        if sub_kw.get("out") is not x:
            assert same_bits(host(x), values), "the input was modified"
        got["sub"] = host(result)

    c.step("with plain arrays", plain_call)
    c.step(f"with {kind} arrays", subclass_call)
    c.step("equal", lambda: np.testing.assert_array_equal(got["sub"], got["plain"], strict=True))


@pytest.mark.parallel(SIZES)
def test_ndarray_subclasses_are_not_faults():
    table = Table("subclass", seed=700)
    with tempfile.TemporaryDirectory() as folder:
        subclasses = Subclasses(folder)
        for entry in SUBCLASS_ENTRIES:
            for kind in ("memmap", "Sub"):
                for everyone in (True, False):
                    who = "every rank" if everyone else "one rank"
                    table.run(f"{entry}: {kind} on {who}", subclass_case, entry, kind, everyone, subclasses)
    table.check()


# ---------------------------------------------------------------------------------------------------------
# On COMM_WORLD itself, back to back: what one failure leaves behind meets the next case


@pytest.mark.parallel([2, 3, 4])
def test_faults_on_the_default_communicator():
    table = Table("default comm", seed=800, default_comm=True)
    for entry, where, fault in [
        ("allreduce_async", "small", "x is uint8"),
        ("allreduce_async", "small", "a read-only out"),
        ("allreduce_async", "ring", "a different length"),
        ("allreduce_async", "device", "a non-contiguous device x"),
        ("allreduce", "ring", "a read-only out"),
        ("allreduce", "small", "op='mean' on int32"),
        ("broadcast", "ring", "root out of range"),
    ]:
        table.run(f"{entry} {where}: {fault}", collective_case, entry, where, FAULT[fault])
    table.run("lazy dense: int32 under op='mean'", lazy_case, "dense", PUSH_FAULT["int32 under op='mean'"])
    table.run("lazy sparse+fp16: a different size", lazy_case, "sparse+fp16", PUSH_FAULT["a different size"])
    size_changed = GRAD_FAULT["a size different from its earlier calls"]
    table.run("sparse fp16 sum: a size different from earlier", sparse_case, "fp16", "sum", size_changed)
    table.check()


# ---------------------------------------------------------------------------------------------------------
# LossScaler.unscale on a non-contiguous array: unscaled in place, or a clear error; never nothing


def unscale_or_refuse(scaler, grad):
    try:
        return scaler.unscale(grad)
    except (TypeError, ValueError) as exc:
        assert re.search("contiguous", str(exc), re.I), f"an unclear error: {exc}"
        return "refused"


@pytest.mark.parametrize("kind", ["host", "device"])
def test_loss_scaler_unscale_of_a_non_contiguous_array(kind):
    scaler = gflow.LossScaler(init_scale=1024.0)
    rng = np.random.default_rng(11)
    base = random_array(rng, (6, 8), np.float32) * np.float32(1024)
    original = base.copy()
    stored = cuda.to_device(base) if kind == "device" else base
    view = stored[:, ::2]
    assert not (view.is_c_contiguous() if kind == "device" else view.flags.c_contiguous)
    result = unscale_or_refuse(scaler, view)
    now = host(stored)
    if result == "refused":
        assert same_bits(now, original), "unscale refused but changed the array"
    else:
        assert result is False, "a finite gradient reported as overflowing"
        np.testing.assert_array_equal(now[:, ::2], original[:, ::2] / np.float32(1024))  # exact: a power of 2
        np.testing.assert_array_equal(now[:, 1::2], original[:, 1::2])  # the elements between untouched
    # An inf in a strided element is found.
    base2 = original.copy()
    base2[3, 4] = np.inf
    stored2 = cuda.to_device(base2) if kind == "device" else base2
    result2 = unscale_or_refuse(scaler, stored2[:, ::2])
    expected = "refused" if result == "refused" else True
    assert result2 == expected, f"an inf in a non-contiguous gradient: unscale gave {result2!r}"
