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

The allreduce is part of its step, so if it fails the whole step fails, on every rank, and the next
step retries it. A step that fails is not timed and does not advance the schedule. A step fails on
every rank or on none (collectives/lazy.py), so every rank stays at the same place in the schedule;
LazyAllreduce also folds the threshold into every segment's checksum, so ranks that were told
different things (one rank called retune(), another did not) fail at once with MismatchError.
"""

import statistics

import numpy as np

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
