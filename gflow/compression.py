"""Mixed-precision communication: float32/float64 values travel as float16 ("fp16") or bfloat16
("bf16") and come back in their dtype.

A stateless codec, as Horovod's: only the 2-byte payload goes on the wire, and each ring step reduces it
in float32 and rounds once. For op="mean" each rank divides by the world size *before* casting (PyTorch
DDP's fp16 hook), so the sum is already the mean and cannot overflow where the mean would not. fp16
keeps 11 significant bits but overflows above 65504, so training needs loss scaling (gflow.LossScaler);
bf16 has float32's range (no overflow below its largest value, 3.39e38, so no scaler) and 8 significant
bits. Values beyond the wire's range are never silently turned into inf: an overflow or a NaN anywhere
makes the reduced result non-finite on every rank alike, and every rank raises CompressionOverflowError.
"""

import numpy as np

from . import timeline
from ._validate import BFLOAT16, holds, is_floating
from .errors import MismatchError

COMPRESSIONS = (None, "fp16", "bf16")
WIRE_DTYPES = {"fp16": np.dtype(np.float16), "bf16": BFLOAT16}
WIRE_DTYPE = WIRE_DTYPES["fp16"]
_RANGE = {"fp16": "+-65504", "bf16": "+-3.39e38"}


def wire_dtype(codec: str) -> np.dtype:
    return WIRE_DTYPES[codec]


def check_compression(compression, dtype: np.dtype):
    """Return the canonical compression (None, "fp16" or "bf16"), or raise for unknown names, for
    non-floats and for a 16-bit input sent as the other 16-bit type (it would lose range or digits)."""
    if compression is None or compression == "none":
        return None
    if compression.__class__ is not str or compression not in WIRE_DTYPES:
        raise ValueError(f"compression: expected None, 'fp16' or 'bf16', got {compression!r}")
    if not is_floating(dtype):
        raise TypeError(f"compression={compression!r} needs a floating dtype, got {dtype}")
    other = {"fp16": BFLOAT16, "bf16": np.dtype(np.float16)}[compression]
    if dtype == other:
        raise TypeError(
            f"compression={compression!r} on a {dtype} input: {dtype} is already 2 bytes on the wire, and "
            f"as {WIRE_DTYPES[compression]} it would lose {'range' if compression == 'fp16' else 'digits'}; "
            f"pass compression=None (or {'bf16' if compression == 'fp16' else 'fp16'!r})"
        )
    return compression


def overflow_message(who: str, codec: str) -> str:
    """What CompressionOverflowError says: why the reduced 2-byte result is not finite."""
    remedy = "scale the values down (gflow.LossScaler) or " if codec == "fp16" else ""
    return (
        f"{who} with compression={codec!r}: the {WIRE_DTYPES[codec]} result holds inf or NaN (a value or a "
        f"sum beyond {_RANGE[codec]}, or a NaN/inf input on some rank); {remedy}use compression=None"
    )


def encode(ops, wire, src, op: str, size: int, scale: float = 1.0) -> None:
    """Cast src (times scale) into the 2-byte wire buffer, dividing by size first for a mean."""
    with timeline.span(f"{_name(wire)} encode", elements=wire.size):
        ops.cast_scaled(wire, src, scale / size if op == "mean" else scale)


def decode(ops, dst, wire) -> bool:
    """Cast the reduced wire buffer back into dst; True if any value is NaN or inf."""
    with timeline.span(f"{_name(wire)} decode", elements=wire.size):
        return ops.cast_scaled(dst, wire, 1.0)


def _name(wire) -> str:
    return "bf16" if holds(wire.dtype) == BFLOAT16 else "fp16"


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
        if not (np.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale!r}")
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

    def unscale(self, grad) -> bool:
        """Divide grad by the scale in place (host or device array); True if it holds inf or NaN.

        Raises:
            TypeError: grad is not a floating array gflow accepts. ValueError: grad is read-only, or a device
                array that is not C-contiguous (host arrays of any layout are unscaled in place).
        """
        from ._array import check_array, check_writable

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
        from .collectives.api import allreduce

        # One exchange: max(overflow), max(scale) and max(-scale), so the scales agree iff the last two
        # are opposite.
        mine = np.array([1.0 if overflow else 0.0, self._scale, -self._scale])
        agreed = allreduce(mine, "max", comm=self._comm)
        if agreed[1] != -agreed[2]:
            raise MismatchError(
                f"LossScaler.update: the ranks' loss scales differ (from {-agreed[2]:g} to {agreed[1]:g}; "
                f"this rank's is {self._scale:g}), so each unscaled the reduced gradients by its own "
                "factor; the step is not applied. Load the scaler's state_dict on every rank, not on one"
            )
        if agreed[0]:
            self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            self._good_steps = 0
            self.skipped_steps += 1
            return False
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self._scale *= self.growth_factor
            self._good_steps = 0
        return True

    def _settings(self) -> dict:
        return {
            "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval, "min_scale": self.min_scale,
        }  # fmt: skip

    def state_dict(self) -> dict:
        """The scale and its counters, with the settings and world size, for a checkpoint (the same
        on every rank: the scale is agreed by all of them)."""
        from . import _state as st

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
            ValueError: the state was saved with other settings or at another world size, or is
                malformed. Nothing is changed then.
        """
        from . import _state as st

        who = "LossScaler.load_state_dict"
        st.check_header(state, "LossScaler", who)
        st.check_equal(state, self._settings(), who)
        st.check_world_size(state, st.world(self._comm)[1], who)
        scale = st.get(state, "scale", who)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < np.inf:
            raise ValueError(f"{who}: scale must be a positive finite number, got {scale!r}")
        good = st.get_count(state, "good_steps", who)
        skipped = st.get_count(state, "skipped_steps", who)
        self._scale, self._good_steps, self.skipped_steps = float(scale), good, skipped
