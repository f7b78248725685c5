"""Horovod's environment variables, read by init(): those gflow has a knob for set that knob; every
other HOROVOD_* variable that is set is ignored, with one warning line each (on the lowest rank), so a
job script written for Horovod says what no longer applies instead of silently losing it.

Honoured: HOROVOD_TIMELINE (gflow's timeline, one file per rank, started by the first init();
DYNAMIC: only when the script calls hvd.start_timeline), HOROVOD_FUSION_THRESHOLD
(DistributedOptimizer's threshold_bytes when not given), HOROVOD_AUTOTUNE=1 (threshold_bytes="auto"),
HOROVOD_STALL_CHECK_TIME_SECONDS, HOROVOD_STALL_SHUTDOWN_TIME_SECONDS and HOROVOD_STALL_CHECK_DISABLE
(gflow's stall warning and abort; disabling the check disables both), HOROVOD_HIERARCHICAL_ALLREDUCE
(on: "auto" takes the hierarchical allreduce from every size above the latency path; off, Horovod's
default: gflow's own thresholds). Switches are on for a positive number or true/yes/on, as Horovod
reads them.
"""

import os
import warnings

import gflow

from ..runtime import timeline

_HONOURED = {
    "HOROVOD_TIMELINE",
    "HOROVOD_FUSION_THRESHOLD",
    "HOROVOD_AUTOTUNE",
    "HOROVOD_STALL_CHECK_TIME_SECONDS",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
    "HOROVOD_STALL_CHECK_DISABLE",
    "HOROVOD_HIERARCHICAL_ALLREDUCE",
}
# Why a Horovod variable has no gflow counterpart (the rest: "gflow has no such setting").
_WHY_IGNORED = {
    "HOROVOD_CYCLE_TIME": "gflow starts a fused segment as soon as it is full, not on a timer",
    "HOROVOD_CACHE_CAPACITY": "gflow has no response cache: every collective is agreed in its first exchange",
    "HOROVOD_TIMELINE_MARK_CYCLES": "gflow has no cycles to mark",
    "HOROVOD_HIERARCHICAL_ALLGATHER": "gflow's allgather is one MPI collective",
    "HOROVOD_MPI_THREADS_DISABLE": "gflow needs MPI_THREAD_MULTIPLE for its background thread",
}


_warned: set = set()  # ignored variables already named (init() may run again)
_timeline_started = False


def _on(name: str) -> bool:
    """A Horovod switch: on for a positive number or true/yes/on."""
    value = os.environ.get(name, "").strip().lower()
    try:
        return int(value) > 0
    except ValueError:
        return value in ("true", "yes", "on")


def fusion_threshold():
    """DistributedOptimizer's threshold_bytes when the script gives none: Horovod's variables, else
    None (gflow's default)."""
    if _on("HOROVOD_AUTOTUNE"):
        return "auto"
    value = os.environ.get("HOROVOD_FUSION_THRESHOLD")
    if value is None:
        return None
    try:
        threshold = int(value)
    except ValueError:
        threshold = -1
    if threshold < 0:
        raise ValueError(f"HOROVOD_FUSION_THRESHOLD must be a number of bytes >= 0, got {value!r}")
    return max(1, threshold)  # (Horovod's 0 turns fusion off: gflow then fuses nothing beyond a tensor)


def apply(rank: int) -> None:
    """Set gflow's knobs from Horovod's variables and warn (rank 0) of those set and ignored."""
    global _timeline_started
    env = os.environ
    path = env.get("HOROVOD_TIMELINE", "")
    if path and path != "DYNAMIC" and not _timeline_started and not timeline.active():
        _timeline_started = True  # (a later init() must not reopen, and so empty, the file)
        gflow.start_timeline(path)
    if "HOROVOD_STALL_CHECK_TIME_SECONDS" in env:
        gflow.config.stall_warning_s = _seconds("HOROVOD_STALL_CHECK_TIME_SECONDS")
    if "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" in env:
        gflow.config.stall_abort_s = _seconds("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
    if _on("HOROVOD_STALL_CHECK_DISABLE"):
        gflow.config.stall_warning_s = gflow.config.stall_abort_s = 0.0
    if _on("HOROVOD_HIERARCHICAL_ALLREDUCE"):
        gflow.config.hierarchical_min_bytes = gflow.config.shared_memory_min_bytes = 0
    fusion_threshold()  # (a malformed value fails at init, not at the first optimizer)
    if rank == 0:
        for name in sorted(n for n in env if n.startswith("HOROVOD_") and n not in _HONOURED | _warned):
            _warned.add(name)
            why = _WHY_IGNORED.get(name, "gflow has no such setting")
            warnings.warn(f"gflow.torch: {name} is set and ignored ({why})", RuntimeWarning, stacklevel=3)


def _seconds(name: str) -> float:
    value = os.environ[name]
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if seconds < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return seconds
