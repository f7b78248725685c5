"""LazyAllreduce's checkpoints (a mixin of LazyAllreduce, lazy.py): what a step carries to the
next (the settings, the threshold tuner's position, each sparse segment's residual), saved and
loaded, and undone for a caller whose own load failed."""

import pickle
import warnings

import numpy as np

from ..collectives.operations import allreduce_on
from ..runtime import checkpoint as st
from ..runtime.checkpoint import compression_name
from ..runtime.context import context
from .autotune import ThresholdTuner
from .sparse import SparseAllreduce
from .strategies import Sparse


class LazyCheckpoint:
    """state_dict()/load_state_dict() and their helpers, over LazyAllreduce's attributes."""

    def snapshot(self):
        """What load_state_dict() changes, for a caller that must undo a load (DataParallel's). The
        tuner itself is enough: a load replaces it (and _csc), never changes it."""
        return self._tuner, self.threshold_bytes, dict(self._csc)

    def restore(self, snapshot) -> None:
        """Undo a load: back to what snapshot() gave."""
        self._tuner, self.threshold_bytes, segments = snapshot
        if isinstance(self._strategy, Sparse):
            self._strategy.segments = segments

    def tuning_position(self) -> dict | None:
        """With threshold "auto": where the tuning is (the tuner's state_dict()), for adopt_tuning()
        on other ranks; None with a fixed threshold."""
        return None if self._tuner is None else self._tuner.state_dict()

    def joined(self, last: int) -> None:
        """A join() on this kit's communicator ended (gflow.join, DataParallel.join, hvd.join): the
        ranks' tuners stopped where each joined, and their position is in every segment's checksum,
        so every step after an uneven epoch failed on every rank (helper-76). At the next step's
        first push every rank takes the position of `last`, the rank that joined last (_follow_join)."""
        self._follow = last

    def _follow_join(self) -> None:
        """Take the tuning position of the rank that joined last (or, where that rank is in join()
        again, with no data this epoch, of the rank still stepping that tuned longest): its bytes
        summed with every other rank's zeros, in allreduces, which a rank in join() serves with zeros
        (a broadcast failed on the others alone: helper-77)."""
        ctx = context(self._comm)
        mine = (ctx.rank == self._follow) * 2**40 + self._tuner.steps  # (who to follow: the largest)
        key = allreduce_on(ctx, np.array([mine * ctx.size + ctx.rank], np.int64), "max")[0]
        own = pickle.dumps(self.tuning_position()) if key % ctx.size == ctx.rank else b""
        size = int(allreduce_on(ctx, np.array([len(own)], np.int64), "max")[0])
        words = np.zeros(-(-size // 8), np.int64)  # (bytes travel as int64 words)
        words.view(np.uint8)[: len(own)] = np.frombuffer(own, np.uint8)
        payload = allreduce_on(ctx, words, "sum").view(np.uint8)[:size]
        self.adopt_tuning(pickle.loads(payload.tobytes()))  # (the same job's own bytes)
        self._follow = None

    def adopt_tuning(self, tuning) -> None:
        """Take another rank's tuning (broadcast_optimizer_state): its whole position (a tuner
        state_dict(), so every rank goes on with root's schedule) or its settled threshold (an int;
        None: tuning from the start). Every rank calls it, between steps.

        Raises:
            ValueError: a malformed position (nothing is changed then).
        """
        if self._tuner is None:
            return
        if isinstance(tuning, dict):
            self._tuner = ThresholdTuner.from_state(tuning)
        elif tuning is None or tuning != self._tuner.settled:
            self._tuner = ThresholdTuner()
            self._tuner.settled = tuning
        self.threshold_bytes = self._tuner.threshold

    def _settings(self) -> dict:
        sparse = None
        if self.sparse is not None:  # as SparseAllreduce reads them, so {} and the defaults compare equal
            csc = SparseAllreduce(op=self.op, compression=self.compression, **self.sparse)
            sparse = {k: v for k, v in csc.settings().items() if k not in ("op", "compression")}
        return {
            "threshold_bytes": "auto" if self._tuner is not None else self.threshold_bytes, "op": self.op,
            "compression": compression_name(self.compression), "sparse": sparse,
        }  # fmt: skip

    def state_dict(self) -> dict:
        """The settings, the world size and, with sparse=, each segment's SparseAllreduce state
        (keyed by segment index; per rank: every rank saves its own). Dense fusion keeps nothing
        from step to step besides its settings and, with threshold_bytes="auto", where its tuning
        is: "tuner" holds the whole position (the round, the candidates, the steps and this rank's
        step times so far), so a run restarted mid-tuning goes on with the same schedule, and
        tuned_threshold_bytes the threshold settled on (None while tuning; what older checkpoints
        hold alone: loading one of those tunes again from the start).

        Raises:
            RuntimeError: a step is in flight (pushed, not flushed).
        """
        if self._in_step():
            raise RuntimeError("LazyAllreduce.state_dict: a step is in flight (pushed, not flushed)")
        rank, size = st.world(self._comm)
        segments = {}
        for index, csc in sorted(self._csc.items()):
            segment = csc.state_dict()
            # The segments' SparseAllreduce objects run on this object's communicator (see _fire).
            segment["rank"], segment["world_size"] = rank, size
            layout = getattr(self._strategy, "layouts", {}).get(index)  # (its residual's: check_size)
            if layout is not None:
                segment["layout"] = [[list(shape), dtype] for shape, dtype in layout]
            segments[index] = segment
        state = st.header("LazyAllreduce")
        state.update(self._settings())
        state.update(world_size=size, segments=segments)
        # With "auto", the threshold settled on (what older gflow reads) and the tuner's whole position.
        state["tuned_threshold_bytes"] = None if self._tuner is None else self._tuner.settled
        state["tuner"] = None if self._tuner is None else self._tuner.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict() of this rank.

        A dense state loads at another world size (the job resumed on fewer or more ranks): it holds
        nothing per rank; with threshold_bytes="auto" the tuning starts again there, with a warning.

        Raises:
            ValueError: the state was saved with other settings, with sparse= at another world size
                or on another rank, or is malformed. Nothing is changed then.
            RuntimeError: a step is in flight (pushed, not flushed).
        """
        who = "LazyAllreduce.load_state_dict"
        if self._in_step():
            raise RuntimeError(f"{who}: a step is in flight (pushed, not flushed); load between steps")
        st.check_header(state, "LazyAllreduce", who)
        st.check_equal(state, self._settings(), who)
        size = st.world(self._comm)[1]
        if self.sparse is not None:  # (CSC's residuals are per rank: a job of another size has others)
            st.check_world_size(state, size, who)
        saved_at = st.saved_world_size(state, who)
        segments = st.get(state, "segments", who)
        if not isinstance(segments, dict):
            raise ValueError(f"{who}: segments must be a dict, got {type(segments).__name__}")
        if segments and self.sparse is None:
            raise ValueError(f"{who}: the state holds sparse segments; this object is dense")
        loaded, layouts = {}, {}
        for index, segment in segments.items():
            csc = SparseAllreduce(op=self.op, compression=self.compression, comm=self._comm, **self.sparse)
            try:
                csc.load_state_dict(segment)
                layout = segment.get("layout")  # (none in a state of older gflow: the next step sets it)
                if layout is not None:
                    layouts[int(index)] = tuple(
                        (tuple(int(n) for n in shape), str(dtype)) for shape, dtype in layout
                    )
            except ValueError as exc:
                raise ValueError(f"{who}: segment {index}: {exc}") from None
            except (TypeError, AttributeError):
                raise ValueError(f"{who}: segment {index}: layout must be a list of [shape, dtype]") from None
            loaded[int(index)] = csc
        tuned = st.plain_value(state.get("tuned_threshold_bytes"))
        if tuned is not None and (isinstance(tuned, bool) or not isinstance(tuned, int) or tuned < 1):
            raise ValueError(f"{who}: tuned_threshold_bytes must be an int >= 1 or None, got {tuned!r}")
        tuner = self._load_tuner(state, tuned, who)
        if saved_at != size and self._tuner is not None:  # (its timings, of the other size, say little)
            warnings.warn(
                f"{who}: saved at {saved_at} ranks, loaded at {size}: the fusion threshold is tuned "
                "again from the start (its tuning timed steps at the other size)",
                stacklevel=2,
            )
            tuner = tuned = None
        if isinstance(self._strategy, Sparse):
            self._strategy.segments = loaded
            self._strategy.layouts = layouts
        if tuner is None:  # a state without the tuner's position (older gflow): tune again unless settled
            self.adopt_tuning(tuned)
        else:
            self._tuner, self.threshold_bytes = tuner, tuner.threshold

    def _load_tuner(self, state: dict, tuned: int | None, who: str):
        """load_state_dict's tuner: the state's position as a new ThresholdTuner; None for a fixed
        threshold, or for a state saved before the position was (tuned_threshold_bytes alone)."""
        if "tuner" not in state:
            return None
        saved = st.plain_value(state["tuner"])
        if self._tuner is None or saved is None:
            if (saved is None) != (self._tuner is None):
                expected = "None (a fixed threshold)" if self._tuner is None else "a dict (threshold 'auto')"
                raise ValueError(f"{who}: tuner: expected {expected}, got {type(saved).__name__}")
            return None
        try:
            tuner = ThresholdTuner.from_state(saved)
        except ValueError as exc:
            raise ValueError(f"{who}: {exc}") from None
        if tuner.settled != tuned:
            raise ValueError(
                f"{who}: tuned_threshold_bytes and tuner.settled differ: expected the same threshold, "
                f"got {tuned!r} and {tuner.settled!r}"
            )
        return tuner
