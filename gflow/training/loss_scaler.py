"""Dynamic loss scaling for fp16 training, agreed across ranks (a training concern: it calls
allreduce, so it sits above the collectives, not beside the codecs)."""

import struct
import zlib

import numpy as np

from ..arrays.kinds import check_array, check_writable
from ..collectives.exchange import broadcast
from ..collectives.operations import allreduce
from ..errors import MismatchError
from ..runtime import checkpoint as st
from ..runtime.signature import is_floating

_TOP = np.iinfo(np.int64).max


# Where the scale stops growing. A larger scale helps no gradient (fp16 spans 2^-24..2^16), and
# growing on reached inf, whose unscale is a multiplication by 0: every gradient zero, no overflow
# reported, and a state_dict that load_state_dict refuses (helper-51).
MAX_SCALE = 2.0**64


def bounds(value: float) -> tuple:
    """A value >= 0 as two int64 whose max over the ranks gives the largest and the smallest value,
    exactly: its IEEE bits (ordered as the values are) and _TOP minus them. A rank in join() sends
    zeros (collectives/join.py), which neither maximum sees (where max(-value) would see 0)."""
    bits = int(np.array(value, np.float64).view(np.int64))
    return bits, _TOP - bits


def value_range(agreed) -> tuple:
    """(largest, smallest) of the values whose bounds() were maximized over the ranks."""
    largest = float(np.array(agreed[0], np.int64).view(np.float64))
    smallest = float(np.array(_TOP - agreed[1], np.int64).view(np.float64))
    return largest, smallest


class LossScaler:
    """Dynamic loss scaling for mixed-precision training, agreed across ranks.

    Multiply the loss by `scale` before backward; after the gradients are reduced, `unscale` each
    one (True if it holds inf/NaN), then call `update(overflow)` once per step: it tells every rank
    whether to apply the step. An overflow on any rank makes every rank skip the step and lower the
    scale, so one rank's inf never leaves ranks with different weights. After `growth_interval`
    steps in a row without overflow the scale grows.

        overflow = False
        try:
            gflow.allreduce(grad, "mean", out=grad, compression="fp16")
        except gflow.CompressionOverflowError:   # raised on every rank alike
            overflow = True
        overflow |= scaler.unscale(grad)
        if scaler.update(overflow):
            optimizer_step()
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
        comm=None,
    ):
        if not 0 < init_scale <= MAX_SCALE:
            raise ValueError(f"init_scale must be in (0, 2**64], got {init_scale!r}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
        if not 0 < min_scale <= init_scale:
            raise ValueError(f"min_scale must be in (0, init_scale], got {min_scale!r}")
        self._scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.min_scale = growth_interval, float(min_scale)
        self._comm = comm
        self._good_steps = 0
        self.skipped_steps = 0

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def comm(self):
        """The communicator the scale is agreed on (None: MPI.COMM_WORLD)."""
        return self._comm

    def unscale(self, grad) -> bool:
        """Divide grad by the scale in place (host or device array); True if it holds inf or NaN.

        Raises:
            TypeError: grad is not a floating array gflow accepts. ValueError: grad is read-only, or a device
                array that is not C-contiguous (host arrays of any layout are unscaled in place).
        """
        kind, dtype = check_array(grad, "grad")
        if not is_floating(dtype):
            raise TypeError(f"unscale needs a floating gradient, got {dtype}")
        check_writable(grad, "grad", kind)
        flat = kind.read(grad, "grad")  # a copy only for a non-contiguous host array: written back
        overflow = kind.ops.cast_scaled(flat, flat, 1.0 / self._scale)
        kind.write_back(grad, flat)
        kind.written(grad)
        return overflow

    def update(self, overflow: bool) -> bool:
        """Agree with every rank whether any overflowed, and that every rank scaled by the same
        factor; adjust the scale. True: apply this step.

        Raises:
            MismatchError: the ranks' scales differ (on every rank): each would unscale the reduced
                sum by its own factor. A checkpoint loaded on some ranks only does that: load the
                scaler's state on every rank (it is the same on all of them).
        """
        # One exchange: max(overflow), the largest and smallest scale and settings (ranks in join()
        # count as zeros, which bounds() keeps out of each).
        agreed = allreduce(np.array([int(overflow), *self.words()], np.int64), "max", comm=self._comm)
        self.check_same(agreed[1:], "LossScaler.update")
        if agreed[0]:
            self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            self._good_steps = 0
            self.skipped_steps += 1
            return False
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self._scale = min(self._scale * self.growth_factor, MAX_SCALE)
            self._good_steps = 0
        return True

    def words(self) -> list:
        """What the ranks must agree on, as int64 words maximized over the ranks: the scale's
        bounds() and those of a fingerprint of the settings (where they differ, the scales part
        ways later: after growth_interval steps, or at the first overflow)."""
        settings = struct.pack("<dddq", self.growth_factor, self.backoff_factor, self.min_scale,
                               self.growth_interval)  # fmt: skip
        return [*bounds(self._scale), *bounds(float(zlib.crc32(settings) + 1))]

    def check_same(self, agreed_words, where: str) -> None:
        """Raise MismatchError where the ranks' scales or settings differ: `agreed_words` is words()
        maximized over the ranks (alike on every rank, so every rank raises)."""
        most, least = value_range(agreed_words[2:4])  # (the settings' fingerprints)
        if most != least:
            raise MismatchError(
                f"{where}: the ranks' LossScaler settings differ (this rank's: {self._settings()}): their "
                "scales would part ways. Make the LossScaler with the same arguments on every rank"
            )
        largest, smallest = value_range(agreed_words[:2])
        if largest != smallest:
            raise MismatchError(
                f"{where}: the ranks' loss scales differ (from {smallest:g} to {largest:g}; this rank's is "
                f"{self._scale:g}), so each would unscale the reduced gradients by its own factor; the "
                "step is not applied. Load the scaler's state_dict on every rank, not on one"
            )

    def _settings(self) -> dict:
        return {
            "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval, "min_scale": self.min_scale,
        }  # fmt: skip

    def follow(self, root: int) -> None:
        """Take rank `root`'s scale and run of good steps, on every rank (collective over the
        scaler's comm): after join(), a rank that joined early saw none of the others' updates."""
        state = broadcast(np.array([self._scale, self._good_steps], np.float64), root, comm=self._comm)
        self._scale, self._good_steps = float(state[0]), int(state[1])

    def state_dict(self) -> dict:
        """The scale and its counters, with the settings and world size, for a checkpoint (the same
        on every rank: the scale is agreed by all of them; it loads at any world size)."""
        state = st.header("LossScaler")
        state.update(self._settings())
        state.update(
            world_size=st.world(self._comm)[1],
            scale=self._scale,
            good_steps=self._good_steps,
            skipped_steps=self.skipped_steps,
        )
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict().

        Raises:
            ValueError: the state was saved with other settings, or is malformed. Nothing is
                changed then.
        """
        who = "LossScaler.load_state_dict"
        st.check_header(state, "LossScaler", who)
        st.check_equal(state, self._settings(), who)
        st.saved_world_size(state, who)  # (checked, not compared: the scale is about the values' range)
        scale = st.get(state, "scale", who)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < np.inf:
            raise ValueError(f"{who}: scale must be a positive finite number, got {scale!r}")
        scale = min(scale, MAX_SCALE)  # (gflow before 2**64 was the cap let a scale grow past it)
        good = st.get_count(state, "good_steps", who)
        skipped = st.get_count(state, "skipped_steps", who)
        self._scale, self._good_steps, self.skipped_steps = float(scale), good, skipped
