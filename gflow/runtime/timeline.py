"""A timeline of gflow's work on each rank, as a Chrome trace (chrome://tracing, ui.perfetto.dev).

    GFLOW_TIMELINE=trace.json mpiexec -n 4 python train.py     # or gflow.start_timeline("trace.json")
    python -m gflow timeline merge trace.*.json -o trace.json  # one file, one process row per rank
    python -m gflow timeline plot trace.json -o step.png       # a picture of it

Horovod's HOROVOD_TIMELINE, per rank: each rank writes its own file (trace.json on one rank; with more,
trace.<rank>.json, or the path with {rank} in it), one process row per rank and one thread row each for
the caller's thread and gflow's background engine. Spans: each collective (bytes, dtype, op, algorithm
as arguments) and its phases (agreement, reduce-scatter, allgather, the hierarchical node phase and
cross-node ring, fp16 encode/decode, CSC's norms, selection, pack and scatter-add), every wait on a
peer, LazyAllreduce's flush and each engine job; instants for pushes and segment fires; a counter of
the engine's queue. Times are wall-clock microseconds, so files of several machines line up as far as
their clocks agree.

Off (the default) an instrumented point costs a call and a global read (about 0.4 us). On, recording
an event costs a few microseconds and turning it into JSON a few more, in batches of Timeline.BATCH
and at stop_timeline() or exit (bench/RESULTS.md, "Timeline").
"""

import json
import os
import threading
import time
import warnings

_active = None  # the Timeline being written, or None: span() then returns OFF at once


class _Off:
    """The span of a timeline that is off: does nothing."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def note(self, **args) -> None:
        pass


OFF = _Off()


class _Span:
    __slots__ = ("timeline", "name", "args", "start")

    def __init__(self, timeline, name: str, args: dict):
        self.timeline, self.name, self.args = timeline, name, args

    def __enter__(self):
        self.start = time.time_ns()
        return self

    def __exit__(self, error_type, error, trace):
        end = time.time_ns()
        if error_type is not None:
            self.args["error"] = error_type.__name__
        self.timeline.record("X", self.name, self.start, self.args, end - self.start)
        return False

    def note(self, **args) -> None:
        """Add arguments known only inside the span (the algorithm auto settled on)."""
        self.args.update(args)


def active() -> bool:
    """Whether a timeline is being written (callers skip building a span's arguments when not)."""
    return _active is not None


def span(name: str, **args):
    """A context manager timing `name` on this thread's row (OFF when no timeline is on)."""
    timeline = _active
    return OFF if timeline is None else _Span(timeline, name, args)


def complete(name: str, start_ns: int, **args) -> None:
    """A span from start_ns (time.time_ns()) to now, recorded after the fact."""
    timeline = _active
    if timeline is not None:
        timeline.record("X", name, start_ns, args, time.time_ns() - start_ns)


def instant(name: str, **args) -> None:
    timeline = _active
    if timeline is not None:
        timeline.record("i", name, time.time_ns(), args)


def counter(name: str, value: float) -> None:
    timeline = _active
    if timeline is not None:
        timeline.record("C", name, time.time_ns(), {name: value})


class Timeline:
    """One rank's trace file. Events are kept as tuples (recording one costs about 1.5 us) and
    turned into JSON in batches of BATCH, and at close (about 4.5 us each, bench/RESULTS.md)."""

    BATCH = 100_000

    def __init__(self, path: str, rank: int):
        self.path, self.rank = path, rank
        self._file = open(path, "w")  # noqa: SIM115 - kept open until close()
        self._file.write("[\n")
        self._file.flush()
        self._events: list = []  # (phase, name, thread row, start ns, duration ns or None, args)
        self._lock = threading.Lock()
        self._threads: dict = {}
        self._first = True
        self._meta = [
            {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
            {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
        ]

    def record(self, phase: str, name: str, start_ns: int, args: dict, dur_ns=None) -> None:
        tid = self._threads.get(threading.get_ident())
        if tid is None:
            tid = self._new_thread()
        with self._lock:
            self._events.append((phase, name, tid, start_ns, dur_ns, args))
            if len(self._events) >= self.BATCH:
                self._write()

    def _new_thread(self) -> int:
        with self._lock:
            tid = self._threads[threading.get_ident()] = len(self._threads) + 1
            name = threading.current_thread().name
            self._meta.append(
                {"ph": "M", "name": "thread_name", "pid": self.rank, "tid": tid, "args": {"name": name}}
            )
        return tid

    def _write(self) -> None:
        started = time.time_ns()
        events, self._events = self._events, []
        rows, self._meta = self._meta, []
        for phase, name, tid, start, dur, args in events:
            row = {"ph": phase, "name": name, "pid": self.rank, "tid": tid, "ts": start / 1000}
            if dur is not None:
                row["dur"] = dur / 1000
            if phase == "i":
                row["s"] = "t"
            if args:
                row["args"] = args
            rows.append(row)
        if rows:
            text = json.dumps(rows, default=str)[1:-1]
            self._file.write(("" if self._first else ",\n") + text)
            self._file.flush()
            self._first = False
        if len(events) >= self.BATCH:  # a pause in this rank's work: shown where it happened
            tid = self._threads.get(threading.get_ident(), 0)
            self._events.append(
                ("X", "timeline writing", tid, started, time.time_ns() - started, {"events": len(events)})
            )

    def close(self) -> None:
        with self._lock:
            self._write()
            self._file.write("\n]\n")
            self._file.close()


def _rank_path(path: str, rank: int, size: int) -> str:
    if "{rank}" in path:
        return path.format(rank=rank)
    if size == 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.{rank}{ext or '.json'}"


def start_timeline(path: str) -> str | None:
    """Start writing this rank's timeline (see the module docstring); returns the file's path, or None
    when it cannot be written (one warning; the program goes on without a timeline). Not collective:
    each rank starts and stops its own."""
    global _active
    from mpi4py import MPI

    stop_timeline()
    world = MPI.COMM_WORLD
    try:
        target = _rank_path(os.fspath(path), world.rank, world.size)
        timeline = Timeline(target, world.rank)
    except (OSError, KeyError, IndexError, ValueError) as exc:
        target = path
        warnings.warn(f"gflow: no timeline: cannot write {target!r} ({exc})", RuntimeWarning, stacklevel=2)
        return None
    _active = timeline
    return target


def stop_timeline() -> None:
    """Finish and close this rank's timeline file (nothing when none is on)."""
    global _active
    timeline, _active = _active, None
    if timeline is not None:
        timeline.close()


def merge(paths: list[str], out: str) -> int:
    """One trace of several ranks' files; returns the number of events."""
    events = []
    for path in paths:
        events += load(path)
    with open(out, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    return len(events)


def load(path: str) -> list[dict]:
    """A trace's events: a rank's file (also one its rank left unfinished) or a merged trace."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a gflow timeline (not text; the timeline is JSON)") from None
    if text in ("", "["):  # a rank that ended before writing any event
        return []
    if text.startswith("[") and not text.endswith("]"):  # ... or before closing its file
        text = text.rstrip(",") + "]"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a gflow timeline ({exc})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list) or not all(_an_event(e) for e in events):
        raise ValueError(
            f"{path}: not a gflow timeline (expected a Chrome trace: a list of events, or an object "
            "whose traceEvents is one, each with name, ph, pid, tid and ts)"
        )
    return events


def _an_event(event) -> bool:
    return (
        isinstance(event, dict)
        and all(k in event for k in ("name", "ph", "pid", "tid"))
        and (event["ph"] == "M" or isinstance(event.get("ts"), (int, float)))
    )


def plot(path: str, out: str, start_ms: float | None = None, end_ms: float | None = None, title=None) -> None:
    """A PNG of a trace's spans: one row per rank and thread, a colour per family of span (numbered
    ones, "gradient step segment 3", share one), spans inside spans drawn thinner on top. Times in
    ms from start_ms (default: the first span)."""
    import re

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = load(path)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: (e["ts"], -e.get("dur", 0)))
    if not spans:
        raise ValueError(f"{path}: no spans to plot")
    origin = spans[0]["ts"]
    start = start_ms if start_ms is not None else 0.0
    if end_ms is not None and end_ms <= start:
        raise ValueError(f"--end-ms ({end_ms}) must be after --start-ms ({start})")
    rows = sorted({(e["pid"], e["tid"]) for e in spans})
    family = {e["name"]: re.sub(r" \d+$", "", e["name"]) for e in spans}  # "segment 3" -> "segment"
    families = sorted(set(family.values()))
    colours = {k: plt.get_cmap("tab20")(i % 20) for i, k in enumerate(families)}
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(rows) + 2.5))
    open_spans: dict = {row: [] for row in rows}  # per row, the ends of the spans enclosing this one
    for e in spans:
        row = (e["pid"], e["tid"])
        stack = open_spans[row]
        while stack and stack[-1] <= e["ts"]:
            stack.pop()
        depth = len(stack)
        stack.append(e["ts"] + e.get("dur", 0))
        begin = (e["ts"] - origin) / 1000 - start
        width = e.get("dur", 0) / 1000
        if begin + width < 0 or (end_ms is not None and begin > end_ms - start):
            continue
        height = 0.8 * 0.7**depth
        y = rows.index(row)
        ax.broken_barh([(begin, width)], (y - height / 2, height), color=colours[family[e["name"]]])
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {p} {names.get((p, t), t)}" for p, t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_xlim(0, None if end_ms is None else end_ms - start)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[k]) for k in families]
    ax.legend(handles, families, fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    ax.set_title(title or f"gflow timeline: {os.path.basename(path)}")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
