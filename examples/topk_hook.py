"""A compression of your own, plugged into gflow's fusion: top-k sparsification with error feedback,
as a segment hook (gflow/fusion/strategies.py; PyTorch DDP's communication hooks have this shape).

    mpiexec -n 4 .venv/bin/python examples/train_mlp.py --topk 0.05      # the digits MLP with it

    dp = gflow.DataParallel(params)                 # or gflow.LazyAllreduce(...)
    dp.register_hook(TopK(density=0.05), topk_hook)

Each fused segment of gradients arrives as segment.buffer (flat). The hook adds the residual it kept
from the last steps, sends only the k largest magnitudes (their indices and values, allgathered:
each rank picks its own k), keeps the rest as the new residual, and returns the reduced segment:
the sum (or mean) of every rank's sent values, zeros elsewhere. Nothing is lost: what is not sent
now is sent later (Stich et al., 2018; Lin et al., 2018 add momentum correction on top).

A hook runs on the caller's thread, once per segment, in the same order on every rank, and must
call the same collectives on every rank. Host arrays here (NumPy); a device version would do the
same with CuPy.
"""

import numpy as np

import gflow


class TopK:
    """The hook's state: the density, and one residual per segment (segments keep their index from
    step to step, as long as every step pushes the same gradients)."""

    def __init__(self, density: float):
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        self.density = density
        self.residuals: dict = {}

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
    residual = state.residuals.get(segment.index)
    if residual is None or residual.size != grad.size:
        residual = state.residuals[segment.index] = np.zeros_like(grad)
    residual += grad  # what this rank has to send, now and later
    k = max(1, int(np.ceil(state.density * grad.size)))
    chosen = np.argpartition(np.abs(residual), grad.size - k)[grad.size - k :].astype(np.int64)
    values = residual[chosen]
    residual[chosen] = 0  # sent: no longer owed
    indices = gflow.allgather(chosen, comm=segment.comm)  # every rank's k, in rank order
    sent = gflow.allgather(values, comm=segment.comm)
    reduced = np.zeros_like(grad)
    np.add.at(reduced, indices, sent)  # ranks that chose the same index add up
    if segment.op == "mean":
        reduced /= grad.dtype.type(len(indices) // k)  # the number of ranks
    return reduced
