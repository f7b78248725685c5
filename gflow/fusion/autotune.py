"""LazyAllreduce(threshold_bytes="auto"): try fusion thresholds during the first steps, keep the fastest.

Why: the best segment size depends on the model (how many tensors, how large), the network and how
much of backward there is to hide communication behind; PyTorch's 25 MiB bucket and Horovod's 64 MiB
threshold are each wrong for many models (bench/RESULTS.md, "Fusion threshold").

How: the candidates are CANDIDATES (256 KiB to 64 MiB, doubling). After the first step, those at or
above the step's bytes all fuse it into one segment, so only the smallest of them is kept. Then
ROUNDS: in each, every candidate still in runs WARMUP_STEPS steps (segment buffers change size, pages
are faulted in) and then its measured steps, each timed from its first push to the end of its flush:
everything the threshold changes (forward and the optimizer do not depend on it). The step after a
round adds one small allreduce behind its segments: each rank's median per candidate (over every
round so far), summed over the ranks, so that every rank reads the same numbers. The fastest few go
on to the next round; after the last, every rank settles on the fastest, and rank 0 logs it once on
stderr. A second round because one step here can be 30% off its neighbours: three steps of one
candidate in a slow second can crown the wrong one, and timing the finalists again, later, gives each
five samples from two moments (bench/RESULTS.md, "Fusion threshold that tunes itself").

A checkpoint holds the tuner's whole position (state_dict(): the round, the candidates still in, the
one being tried and its steps, every rank's own samples, the agreed results), so a run restarted
mid-tuning takes the same threshold at every following step as the run never stopped; what it then
settles on is decided by the timings, as always.

The allreduce is part of its step, so if it fails the whole step fails, on every rank, and the next
step retries it. A step that fails is not timed and does not advance the schedule. A step fails on
every rank or on none (fusion/lazy.py), so every rank stays at the same place in the schedule;
LazyAllreduce also folds the threshold into every segment's checksum, so ranks that were told
different things (one rank called retune(), another did not) fail at once with MismatchError.
"""

import math
import statistics

import numpy as np

from ..runtime.checkpoint import plain_value

CANDIDATES = tuple(2**k for k in range(18, 27))  # 256 KiB ... 64 MiB
WARMUP_STEPS = 1
# Per round: how many candidates go into it (None: all), and the measured steps of each.
ROUNDS = ((None, 2), (3, 3))


def size_text(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


class ThresholdTuner:
    """Where one LazyAllreduce is in its tuning schedule (see the module docstring)."""

    def __init__(self):
        self.trying = list(CANDIDATES)  # this round's candidates, in increasing order
        self.round = 0
        self.index = 0  # the candidate being tried
        self.steps_here = 0  # successful steps under it in this round
        self.samples: dict = {c: [] for c in CANDIDATES}  # measured seconds, every round
        self.pruned = False
        self.at_once = False  # settled on the first step: every candidate held it whole
        self.settled: int | None = None
        self.results: dict | None = None  # threshold -> seconds agreed by the ranks, after each round
        self.steps = 0  # successful steps since tuning began

    @property
    def threshold(self) -> int:
        return self.settled if self.settled is not None else self.trying[self.index]

    @property
    def _measured_steps(self) -> int:
        return ROUNDS[self.round][1]

    @property
    def deciding(self) -> bool:
        """This round is measured: the current step carries the agreement."""
        return (
            self.settled is None
            and self.index == len(self.trying) - 1
            and self.steps_here >= WARMUP_STEPS + self._measured_steps
        )

    @property
    def active(self) -> bool:
        """Whether steps are still reported: while tuning, and after settling at once (a larger
        step later, e.g. once frozen layers are unfrozen, starts the tuning afresh)."""
        return self.settled is None or self.at_once

    def state_dict(self) -> dict:
        """The whole position, as plain Python values (lists, dicts, ints, floats, None): everything
        the following steps' thresholds and the next decisions depend on."""
        return {
            "trying": list(self.trying),
            "round": self.round,
            "index": self.index,
            "steps_here": self.steps_here,
            "samples": {c: list(s) for c, s in self.samples.items()},
            "pruned": self.pruned,
            "at_once": self.at_once,
            "settled": self.settled,
            "results": None if self.results is None else dict(self.results),
            "steps": self.steps,
        }

    @classmethod
    def from_state(cls, state) -> "ThresholdTuner":
        """A new tuner at the position a state_dict() saved (copied: the state is not kept).

        Raises:
            ValueError: the state is malformed, or is not a position this gflow's schedule
                (CANDIDATES, ROUNDS, WARMUP_STEPS) can be at; the message names the field.
        """
        if not isinstance(state, dict):
            raise ValueError(f"tuner: expected a dict (a tuner state_dict()), got {type(state).__name__}")
        tuner = cls()
        trying = _ints(state, "trying")
        if not trying or trying != sorted(set(trying)) or not set(trying) <= set(CANDIDATES):
            raise ValueError(
                f"tuner.trying: expected an increasing, non-empty list of candidates out of "
                f"{list(CANDIDATES)}, got {trying!r}"
            )
        tuner.trying = trying
        tuner.round = _int(state, "round", 0, len(ROUNDS) - 1)
        tuner.index = _int(state, "index", 0, len(trying) - 1)
        tuner.steps_here = _int(state, "steps_here", 0, WARMUP_STEPS + ROUNDS[tuner.round][1])
        tuner.pruned, tuner.at_once = _bool(state, "pruned"), _bool(state, "at_once")
        settled = _field(state, "settled")
        if settled is not None and (isinstance(settled, bool) or not isinstance(settled, int) or settled < 1):
            raise ValueError(f"tuner.settled: expected an int >= 1 or None, got {settled!r}")
        tuner.settled = settled
        tuner.steps = _int(state, "steps", 0)
        samples = _field(state, "samples")
        if not isinstance(samples, dict):
            raise ValueError(f"tuner.samples: expected a dict, got {type(samples).__name__}")
        for key, times in samples.items():
            c = _candidate(key, "samples")
            tuner.samples[c] = _seconds(times, f"samples[{c}]")
        results = _field(state, "results")
        if results is not None:
            if not isinstance(results, dict):
                raise ValueError(f"tuner.results: expected a dict or None, got {type(results).__name__}")
            tuner.results = {
                _candidate(c, "results"): _seconds([t], f"results[{c}]")[0] for c, t in results.items()
            }
        tuner._check_position()
        return tuner

    def _check_position(self) -> None:
        """A loaded position must be one the schedule reaches: the steps after it would otherwise
        fail (a median of no samples) or part the ranks' ways."""
        if self.at_once and self.settled is None:
            raise ValueError("tuner.at_once: expected False while not settled (settled is None), got True")
        if self.settled is not None:
            return  # the rest is unused: retune() and a larger step after settling at once start afresh
        if not self.pruned:
            start = ThresholdTuner().state_dict()
            got = self.state_dict()
            for key, value in start.items():
                if got[key] != value:
                    raise ValueError(
                        f"tuner.{key}: expected {value!r} before the first step (pruned is False), "
                        f"got {got[key]!r}"
                    )
            return
        if self.round == 0 and self.trying != list(CANDIDATES[: len(self.trying)]):
            raise ValueError(
                f"tuner.trying: expected the smallest candidates in round 0 (those up to the first that "
                f"holds a step), got {self.trying!r}"
            )
        going_on = ROUNDS[self.round][0]
        if going_on is not None and len(self.trying) > going_on:
            raise ValueError(
                f"tuner.trying: expected at most {going_on} candidates in round {self.round}, "
                f"got {len(self.trying)}"
            )
        if (self.results is None) != (self.round == 0):
            raise ValueError(
                f"tuner.results: expected {'None' if self.round == 0 else 'a dict'} in round {self.round}, "
                f"got {self.results!r}"
            )
        last = WARMUP_STEPS + self._measured_steps
        if self.steps_here == last and self.index != len(self.trying) - 1:
            raise ValueError(
                f"tuner.steps_here: expected below {last} for candidate {self.index} of {len(self.trying)} "
                f"(it would have moved on), got {last}"
            )
        before = sum(measured for _, measured in ROUNDS[: self.round])
        for i, c in enumerate(self.trying):
            here = min(max(self.steps_here - WARMUP_STEPS, 0), self._measured_steps)
            count = before + (self._measured_steps if i < self.index else here if i == self.index else 0)
            if len(self.samples[c]) != count:
                raise ValueError(
                    f"tuner.samples[{c}]: expected {count} step times at round {self.round}, candidate "
                    f"{self.index}, step {self.steps_here} of it, got {len(self.samples[c])}"
                )

    def position(self) -> tuple:
        """Where in the schedule this tuner is (the ranks' must match: LazyAllreduce checks it)."""
        if self.settled is not None:
            return (self.settled, -1, -1, -1, self.at_once)
        return (self.round, self.index, self.steps_here, self.deciding, self.pruned)

    def step_done(self, seconds: float, step_bytes: int) -> str | None:
        """A step under self.threshold succeeded on every rank and took `seconds` here. Returns the
        line to log if that settled the threshold (one candidate left: no agreement needed)."""
        if self.at_once and step_bytes > self.settled:
            self.__init__()  # this step, under the smallest candidate, is its first warm-up step
        if self.settled is not None:
            return None
        self.steps += 1
        if not self.pruned:
            self.pruned = True
            keep = next((i for i, c in enumerate(self.trying) if c >= step_bytes), len(self.trying) - 1)
            self.trying = self.trying[: keep + 1]
            if keep == 0:  # every candidate fuses the step into one segment: nothing to compare
                self.settled, self.at_once = self.trying[0], True
                return (
                    f"settled on {size_text(self.settled)} at once: a step's {step_bytes} bytes fit in "
                    "one segment of the smallest candidate"
                )
        if self.deciding:
            return None
        self.steps_here += 1
        if self.steps_here > WARMUP_STEPS:
            self.samples[self.trying[self.index]].append(seconds)
        if self.steps_here >= WARMUP_STEPS + self._measured_steps and self.index + 1 < len(self.trying):
            self.index += 1
            self.steps_here = 0
        return None

    def medians(self) -> np.ndarray:
        """This rank's median step time per candidate of this round, for the agreement."""
        return np.array([statistics.median(self.samples[c]) for c in self.trying], dtype=np.float64)

    def agreed(self, summed: np.ndarray, size: int) -> str | None:
        """The ranks' medians of this round, summed: the same numbers on every rank. Starts the next
        round with the fastest, or settles on the fastest (returning the line to log)."""
        self.steps += 1
        mean = summed / size
        self.results = dict(self.results or {})
        self.results.update((c, float(t)) for c, t in zip(self.trying, mean, strict=True))
        order = sorted(range(len(self.trying)), key=lambda i: (mean[i], i))
        if self.round + 1 < len(ROUNDS) and len(self.trying) > 1:
            self.round += 1
            going_on = ROUNDS[self.round][0]
            self.trying = sorted(self.trying[i] for i in order[:going_on])
            self.index = self.steps_here = 0
            return None
        self.settled = self.trying[order[0]]
        finalists = set(self.trying)
        times = ", ".join(
            f"{size_text(c)}{'*' if c in finalists else ''} {t * 1e3:.1f} ms"
            for c, t in sorted(self.results.items())
        )
        return (
            f"settled on {size_text(self.settled)} after {self.steps} steps (median time from a step's "
            f"first push to the end of its flush, mean over {size} ranks; * timed again: {times})"
        )


def _field(state: dict, key: str):
    if key not in state:
        raise ValueError(f"tuner: the state lacks {key!r}")
    return plain_value(state[key])


def _int(state: dict, key: str, low: int, high: int | None = None) -> int:
    value = _field(state, key)
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        expected = f">= {low}" if high is None else f"from {low} to {high}"
        raise ValueError(f"tuner.{key}: expected an int {expected}, got {value!r}")
    return value


def _bool(state: dict, key: str) -> bool:
    value = _field(state, key)
    if not isinstance(value, bool):
        raise ValueError(f"tuner.{key}: expected True or False, got {value!r}")
    return value


def _sequence(value, name: str) -> list:
    """A list, tuple or 1-d array (what a checkpoint's round trip may make of a list) as a list."""
    if isinstance(value, np.ndarray) and value.ndim == 1:
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"tuner.{name}: expected a list, got {type(value).__name__}")
    return [plain_value(v) for v in value]


def _ints(state: dict, key: str) -> list:
    values = _sequence(_field(state, key), key)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"tuner.{key}: expected a list of ints, got {values!r}")
    return values


def _candidate(key, name: str) -> int:
    key = plain_value(key)
    if isinstance(key, bool) or not isinstance(key, int) or key not in CANDIDATES:
        raise ValueError(f"tuner.{name}: expected candidates out of {list(CANDIDATES)} as keys, got {key!r}")
    return key


def _seconds(values, name: str) -> list:
    values = _sequence(values, name)
    if not all(
        isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t >= 0
        for t in values
    ):
        raise ValueError(f"tuner.{name}: expected finite step times in seconds (>= 0), got {values!r}")
    return [float(t) for t in values]
