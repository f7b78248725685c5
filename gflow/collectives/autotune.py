"""LazyAllreduce(threshold_bytes="auto"): try fusion thresholds during the first steps, keep the fastest.

Why: the best segment size depends on the model (how many tensors, how large), the network and how
much of backward there is to hide communication behind; PyTorch's 25 MiB bucket and Horovod's 64 MiB
threshold are each wrong for many models (bench/RESULTS.md, "Fusion threshold").

How: the candidates are CANDIDATES (256 KiB to 64 MiB, doubling). After the first step, those at or
above the step's bytes all fuse it into one segment, so only the smallest of them is kept. Each
candidate runs WARMUP_STEPS steps (segment buffers change size, pages are faulted in) and then
MEASURED_STEPS steps, each timed from its first push to the end of its flush: everything the threshold
changes (forward and the optimizer do not depend on it). The step after the last measurement adds one
small allreduce behind its segments: the ranks' medians per candidate, averaged over the ranks, so that
every rank settles on the same threshold; rank 0 logs the choice once on stderr. That allreduce is
part of the step, so if it fails the whole step fails, on every rank, and the next step retries it.

A step that fails is not timed and does not advance the schedule. A step fails on every rank or on
none (collectives/lazy.py), so every rank stays at the same place in the schedule; LazyAllreduce also
folds the threshold into every segment's checksum, so ranks that were told different things (one rank
called retune(), another did not) fail at once with MismatchError.
"""

import statistics

import numpy as np

CANDIDATES = tuple(2**k for k in range(18, 27))  # 256 KiB ... 64 MiB
WARMUP_STEPS = 1
MEASURED_STEPS = 3


def size_text(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


class ThresholdTuner:
    """Where one LazyAllreduce is in its tuning schedule (see the module docstring)."""

    def __init__(self):
        self.candidates = list(CANDIDATES)
        self.index = 0  # the candidate being tried
        self.steps_here = 0  # successful steps under it so far
        self.samples: list = [[] for _ in self.candidates]  # measured seconds per candidate
        self.pruned = False
        self.settled: int | None = None
        self.results: dict | None = None  # threshold -> seconds agreed by the ranks, once settled
        self.steps = 0  # successful steps since tuning began

    @property
    def threshold(self) -> int:
        return self.settled if self.settled is not None else self.candidates[self.index]

    @property
    def deciding(self) -> bool:
        """Every candidate is measured: the current step carries the agreement."""
        return self.settled is None and len(self.samples[-1]) >= MEASURED_STEPS

    def step_done(self, seconds: float, step_bytes: int) -> str | None:
        """A step under self.threshold succeeded on every rank and took `seconds` here. Returns the
        line to log if that settled the threshold (one candidate left: no agreement needed)."""
        if self.settled is not None:
            return None
        self.steps += 1
        if not self.pruned:
            self.pruned = True
            keep = next(
                (i for i, c in enumerate(self.candidates) if c >= step_bytes), len(self.candidates) - 1
            )
            self.candidates, self.samples = self.candidates[: keep + 1], self.samples[: keep + 1]
            if keep == 0:  # every candidate fuses the step into one segment: nothing to compare
                self.settled = self.candidates[0]
                return (
                    f"settled on {size_text(self.settled)} at once: a step's {step_bytes} bytes fit in "
                    "one segment of the smallest candidate"
                )
        if self.deciding:
            return None
        self.steps_here += 1
        if self.steps_here > WARMUP_STEPS:
            self.samples[self.index].append(seconds)
        if len(self.samples[self.index]) >= MEASURED_STEPS and self.index + 1 < len(self.candidates):
            self.index += 1
            self.steps_here = 0
        return None

    def medians(self) -> np.ndarray:
        """This rank's median step time per candidate, for the agreement."""
        return np.array([statistics.median(s) for s in self.samples], dtype=np.float64)

    def settle(self, summed: np.ndarray, size: int) -> str:
        """Take the candidate whose time, summed over the ranks, is least: the same on every rank.
        Returns the line to log."""
        self.steps += 1
        mean = summed / size
        self.settled = self.candidates[int(np.argmin(mean))]
        self.results = {c: float(t) for c, t in zip(self.candidates, mean, strict=True)}
        times = ", ".join(f"{size_text(c)} {t * 1e3:.1f} ms" for c, t in self.results.items())
        return (
            f"settled on {size_text(self.settled)} after {self.steps} steps (median time from a step's "
            f"first push to the end of its flush, mean over {size} ranks: {times})"
        )
