"""Process-wide settings, read once from the environment and changeable at run time.

Every rank must use the same settings: they decide which algorithm runs and whether the argument
agreement runs, and ranks that disagree on them cannot talk to each other.
"""

import operator
import os
import warnings
from dataclasses import dataclass


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 0 or 1, got {value!r}")


def _env_switch(name: str, default: bool) -> bool:
    """A switch whose bad value must not stop the program (it guards the failure path): warn, keep
    the default."""
    try:
        return _env_flag(name, default)
    except ValueError:
        warnings.warn(
            f"{name} must be 0 or 1, got {os.environ[name]!r}: keeping the default ({int(default)})",
            RuntimeWarning,
            stacklevel=3,
        )
        return default


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"{name} must be a number of seconds >= 0 (0: off), got {value!r}")
    return seconds


def _env_int(name: str, default: int, unit: str = "bytes", least: int = 0) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < least:
        raise ValueError(f"{name} must be a whole number of {unit} >= {least}, got {value!r}")
    return number


# Measured with bench/allreduce.py on the 2-core development machine (bench/RESULTS.md): recursive
# doubling with the agreement header riding along beats the ring up to about this size at p = 2..4.
DEFAULT_SMALL_MESSAGE_BYTES = 128 * 1024
# Every rank's latency-path receives have room for this much payload, whatever small_message_bytes
# each rank holds, so that ranks with different settings get MismatchError and no message is ever
# truncated: Open MPI 4.1's shared-memory transport overruns the receive buffer of a truncated
# rendezvous message (bench/RESULTS.md, "Open MPI"). Above a few MiB the ring wins anyway.
MAX_SMALL_MESSAGE_BYTES = 4 * 2**20
# At two ranks recursive doubling is one exchange of the whole message each way, where the ring makes
# two of half of it plus the agreement: the same bytes, fewer latencies. "auto" takes it up to this many
# times small_message_bytes there (2 MiB at the default; at 4 MiB the ring's halved reduction won:
# bench/RESULTS.md, "The cost of a call"), within MAX_SMALL_MESSAGE_BYTES.
TWO_RANKS_FACTOR = 16


def latency_path_limit(ranks: int, small_message_bytes: int) -> int:
    """The largest message "auto" sends by recursive doubling on a communicator of `ranks`, given
    small_message_bytes (collectives/dispatch.py with the live setting; the cost model with the default)."""
    if ranks == 2:
        return min(MAX_SMALL_MESSAGE_BYTES, TWO_RANKS_FACTOR * small_message_bytes)
    return small_message_bytes


# The ring's reduce-scatter moves each chunk in segments of this size, so that what a rank has just
# received is still in cache when it is reduced, and a segment lasts long enough on a slow link that a
# background thread woken late by the scheduler finds the next one still moving (1 MiB against 256 KiB:
# 0.81-0.99x the time on shared memory, and under 1 Gbit/s in training the ring ran 190 ms a step
# closer to the link's rate: bench/RESULTS.md, "Where AlexNet's step goes against DDP").
DEFAULT_RING_SEGMENT_BYTES = 2**20
# The background thread sleeps this long between polls of its messages, leaving the core to the
# computation it overlaps with (bench/fusion.py, bench/RESULTS.md); the pause doubles while a wait
# lasts, up to 64x (a slow link's waits: bench/RESULTS.md, "AlexNet against DDP").
DEFAULT_BACKGROUND_POLL_US = 20
BACKGROUND_POLL_BACKOFF = 64  # (the pause's doubling stops at this many times the first)
# Under algorithm="auto", from these sizes up the hierarchical allreduce replaces the ring: on one node
# (host arrays: the shared-memory node phase alone), and across nodes (bench/RESULTS.md, "Scale"). On
# one node the compiled ring beat the node phase at p = 3 and 4 up to 1 MB (1.2-1.7x), and they were
# even at 2 MB (bench/RESULTS.md, "Every rank of one host through the slots"); below it the ranks of
# one host now reduce in the shared slots (collectives/recursive_doubling.reduce_in_slots).
DEFAULT_SHARED_MEMORY_MIN_BYTES = 2 * 1024 * 1024
DEFAULT_HIERARCHICAL_MIN_BYTES = 256 * 1024
# The hierarchical allreduce moves larger messages in pieces of this size, which bounds its shared
# window (two slots of this size per rank and context).
DEFAULT_SHARED_MEMORY_MAX_BYTES = 16 * 2**20


@dataclass
class Config:
    """gflow's settings.

    Attributes:
        validate: check on every call that all ranks passed the same length, dtype, op and algorithm
            (GFLOW_VALIDATE, default on). On small messages the check rides along with the data and
            costs nothing measurable; on ring-sized messages it is one header-only recursive-doubling
            exchange (log2 p tiny messages). Off, a mismatched call is undefined behaviour: it may hang.
        small_message_bytes: messages up to this size take the latency path (recursive doubling)
            under algorithm="auto"; larger ones take the ring (GFLOW_SMALL_MESSAGE_BYTES).
        ring_segment_bytes: the ring's reduce-scatter pipelines each chunk in pieces of this size
            (GFLOW_RING_SEGMENT_BYTES).
        background_poll_us: the background thread's first pause between polls, in microseconds;
            it doubles while a wait lasts, up to 64 times this (GFLOW_BACKGROUND_POLL_US).
        ranks_per_node: "" (the nodes are what MPI says share memory), or k (a string or an int):
            consecutive ranks of each communicator form nodes of k, the last one possibly smaller
            (GFLOW_RANKS_PER_NODE). Read when a communicator is first used for a bandwidth-sized
            allreduce; every rank must hold the same.
        shared_memory_min_bytes: under algorithm="auto", on a single node, host arrays from this size
            take the hierarchical allreduce, i.e. its shared-memory node phase
            (GFLOW_SHARED_MEMORY_MIN_BYTES).
        hierarchical_min_bytes: under algorithm="auto", with more than one node, messages from this
            size take the hierarchical allreduce (GFLOW_HIERARCHICAL_MIN_BYTES).
        shared_memory_max_bytes: the hierarchical allreduce moves larger messages in pieces of this
            size, so its shared-memory window holds two slots of at most this per rank and
            communicator (GFLOW_SHARED_MEMORY_MAX_BYTES).
        stall_warning_s: a rank that has waited on its peers this long in a collective says which
            ranks have not entered it yet, on stderr (GFLOW_STALL_WARNING_S; 0: never;
            gflow/runtime/stall.py).
        stall_abort_s: ... and after this long ends the job with MPI_Abort (GFLOW_STALL_ABORT_S;
            default 0: never).
        native: the ring's steps run in compiled loops that call the MPI library's C functions
            (GFLOW_NATIVE, default on; gflow/collectives/native.py); off, in Python.
        shared_slots: the ranks of a communicator that all share one host exchange the agreement's
            messages through shared memory (GFLOW_SHARED_SLOTS, default on;
            gflow/collectives/shared_slots.py); off on any rank, MPI's messages. Read when a
            communicator is first used.
        abort_on_exception: an exception that nothing catches ends the whole job with MPI_Abort,
            naming this rank, instead of leaving the other ranks waiting for it
            (GFLOW_ABORT_ON_EXCEPTION, default on; gflow/runtime/failures.py).
    """

    validate: bool = True
    small_message_bytes: int = DEFAULT_SMALL_MESSAGE_BYTES
    ring_segment_bytes: int = DEFAULT_RING_SEGMENT_BYTES
    background_poll_us: int = DEFAULT_BACKGROUND_POLL_US
    ranks_per_node: str = ""
    shared_memory_min_bytes: int = DEFAULT_SHARED_MEMORY_MIN_BYTES
    hierarchical_min_bytes: int = DEFAULT_HIERARCHICAL_MIN_BYTES
    shared_memory_max_bytes: int = DEFAULT_SHARED_MEMORY_MAX_BYTES
    stall_warning_s: float = 60.0
    stall_abort_s: float = 0.0
    abort_on_exception: bool = True
    native: bool = True
    shared_slots: bool = True

    def __setattr__(self, name, value):
        if name == "small_message_bytes":
            value = _byte_count(value, name, "GFLOW_SMALL_MESSAGE_BYTES", 0, MAX_SMALL_MESSAGE_BYTES)
        elif name == "ring_segment_bytes":
            value = _byte_count(value, name, "GFLOW_RING_SEGMENT_BYTES", 1, None)
        super().__setattr__(name, value)

    @classmethod
    def from_env(cls) -> "Config":
        return cls(
            validate=_env_flag("GFLOW_VALIDATE", True),
            small_message_bytes=_env_int("GFLOW_SMALL_MESSAGE_BYTES", DEFAULT_SMALL_MESSAGE_BYTES),
            ring_segment_bytes=_env_int("GFLOW_RING_SEGMENT_BYTES", DEFAULT_RING_SEGMENT_BYTES),
            # (at least 1: the pause doubles from it, and from 0 the thread would spin)
            background_poll_us=_env_int(
                "GFLOW_BACKGROUND_POLL_US", DEFAULT_BACKGROUND_POLL_US, "microseconds", least=1
            ),
            ranks_per_node=os.environ.get("GFLOW_RANKS_PER_NODE", ""),
            shared_memory_min_bytes=_env_int(
                "GFLOW_SHARED_MEMORY_MIN_BYTES", DEFAULT_SHARED_MEMORY_MIN_BYTES
            ),
            hierarchical_min_bytes=_env_int("GFLOW_HIERARCHICAL_MIN_BYTES", DEFAULT_HIERARCHICAL_MIN_BYTES),
            shared_memory_max_bytes=_env_int(
                "GFLOW_SHARED_MEMORY_MAX_BYTES", DEFAULT_SHARED_MEMORY_MAX_BYTES
            ),
            stall_warning_s=_env_seconds("GFLOW_STALL_WARNING_S", 60.0),
            stall_abort_s=_env_seconds("GFLOW_STALL_ABORT_S", 0.0),
            abort_on_exception=_env_switch("GFLOW_ABORT_ON_EXCEPTION", True),
            native=_env_flag("GFLOW_NATIVE", True),
            shared_slots=_env_flag("GFLOW_SHARED_SLOTS", True),
        )


def _byte_count(value, name: str, env: str, low: int, high) -> int:
    """A byte-count setting, checked when set on the rank that sets it: small_message_bytes beyond
    what every rank's receives have room for, or a ring segment of no bytes, cannot work."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None or number < low or (high is not None and number > high):
        limit = (
            f"from {low} to {high} (4 MiB, what every rank's receives have room for)" if high else f">= {low}"
        )
        raise ValueError(f"{name} ({env}) must be an integer number of bytes {limit}, got {value!r}")
    return number


config = Config.from_env()
