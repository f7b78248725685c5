"""A compression of your own, plugged into gflow's fusion: top-k sparsification with error feedback,
as a segment hook (gflow/fusion/strategies.py; PyTorch DDP's communication hooks have this shape).

    mpiexec -n 4 .venv/bin/python examples/train_mlp.py --topk 0.05      # the digits MLP with it

    dp = gflow.DataParallel(params)                 # or gflow.LazyAllreduce(...)
    dp.register_hook(TopK(density=0.05), topk_hook)

Each fused segment of gradients arrives as segment.buffer (flat), on gflow's background thread. The
hook adds the residual it kept from the last steps, sends only the k largest magnitudes (their
indices and values, allgathered: each rank picks its own k), keeps the rest as the new residual, and
returns the reduced segment: the sum (or mean) of every rank's sent values, zeros elsewhere. Nothing
is lost: what is not sent now is sent later (Stich et al., 2018; Lin et al., 2018 add momentum
correction on top). The new residuals wait in `staged` until gflow commits the step: a step that
fails, or that DataParallel skips for a loss-scale overflow, leaves them as they were.

Host arrays here (NumPy); a device version would do the same with CuPy.
"""

import numpy as np


class TopK:
    """The hook's state: the density, and one residual per segment (a segment keeps its index from
    step to step, as long as every step pushes the same gradients)."""

    def __init__(self, density: float):
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        self.density = density
        self.residuals: dict = {}  # segment index -> what this rank still owes the others
        self.staged: dict = {}  # the same, after the step in flight

    def commit(self) -> None:
        """The step succeeded on every rank: its residuals are the ones to go on from."""
        self.residuals.update(self.staged)
        self.staged.clear()

    def discard(self) -> None:
        """The step failed or was skipped: the residuals stay as before it."""
        self.staged.clear()

    def state_dict(self) -> dict:
        return {"density": self.density, "residuals": {i: r.copy() for i, r in self.residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.density = state["density"]
        self.residuals = {int(i): np.array(r) for i, r in state["residuals"].items()}


def topk_hook(state: TopK, segment) -> np.ndarray:
    """The reduced segment: every rank's k largest (gradient + residual) values, summed (or averaged,
    as segment.op says), zeros elsewhere; what this rank did not send stays in its residual."""
    if segment.op not in ("sum", "mean"):
        raise ValueError(f"topk_hook: top-k sums what is sent; op {segment.op!r} is not a sum")
    grad = segment.buffer
    owed = state.residuals.get(segment.index)
    owed = grad.copy() if owed is None or owed.size != grad.size else owed + grad
    k = max(1, int(np.ceil(state.density * grad.size)))
    chosen = np.argpartition(np.abs(owed), grad.size - k)[grad.size - k :].astype(np.int64)
    values = owed[chosen]
    owed[chosen] = 0  # sent: no longer owed
    state.staged[segment.index] = owed
    indices = segment.allgather(chosen)  # every rank's k, in rank order
    sent = segment.allgather(values)
    reduced = np.zeros_like(grad)
    np.add.at(reduced, indices, sent)  # ranks that chose the same index add up
    if segment.op == "mean":
        reduced /= grad.dtype.type(segment.size)
    return reduced
