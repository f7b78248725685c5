"""DistributedOptimizer(op=hvd.Adasum): Horovod's Adasum optimizer, a delta optimizer.

Each rank runs the wrapped optimizer's step on its own gradients, so the update it would apply alone
is delta = p_after - p_before; the ranks then combine their deltas with Adasum (collectives/adasum.py:
each parameter on its own, all of them fused in one collective) and every rank applies the combined
delta to the parameters it started the step from. The wrapped optimizer's state (momentum, Adam's
moments) stays each rank's own, as in Horovod.

Where it differs from Horovod's: the local steps and the combination run in step(), not as each
gradient becomes ready (no overlap with backward), and the wrapped optimizer steps all its
parameters at once rather than one at a time (the same for optimizers whose update is per
parameter: SGD, Adam, ...). backward_passes_per_step is accepted: gradients accumulate in p.grad
until the program calls step(), as Horovod's. synchronize() does nothing (as Horovod's);
skip_synchronize() raises, as Horovod's does for Adasum.

torch.amp.GradScaler unscales each rank's own gradients; the ranks then agree on its inf check (an
inf on any rank is an inf on all), so they skip a step together and keep one loss scale. Without
that, the rank that found an inf would skip its step() and the others would combine their deltas
with its next step's (gflow's hook in optimizer.py calls _after_unscale).
"""

from contextlib import contextmanager

import torch

from ._allreduce import allreduce
from ._basics import Adasum, Max, with_methods
from ._grouped import grouped_allreduce_


class _AdasumStep:
    """The methods that make an optimizer class step as Horovod's Adasum optimizer."""

    def _gflow_adasum_init(self, compression, names) -> None:
        self._gflow_wrapped = False  # (not gflow's kit: broadcast_optimizer_state takes the plain path)
        self._adasum_compression = compression
        self._adasum_names = names
        self._adasum_no_sync = False

    def _after_unscale(self, found_inf_per_device: dict) -> None:
        """GradScaler found infs on this rank's devices (or not): make it an inf on every rank's
        devices if any rank found one, so every rank skips the step, or none does."""
        mine = sum(float(v.item()) for v in found_inf_per_device.values())
        anywhere = allreduce(torch.tensor([mine], dtype=torch.float64), op=Max, name="GradScaler found_inf")
        if not found_inf_per_device:  # no gradient on this rank: its step() still takes part
            found_inf_per_device[torch.device("cpu")] = torch.zeros((), dtype=torch.float32)
        for v in found_inf_per_device.values():
            v.fill_(1.0 if anywhere.item() > 0 else 0.0)

    def _adasum_params(self) -> list:
        """The parameters every rank combines: all that require grad, in the param groups' order (the
        same on every rank, whatever gradients this rank has)."""
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def step(self, closure=None):
        if self._adasum_no_sync:
            raise RuntimeError(
                "optimizer.step() inside optimizer.no_sync(): step() combines the ranks' updates; "
                "leave no_sync() for the last backward pass before the step (as DDP's no_sync)"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._adasum_params()
        with torch.no_grad():
            starts = [p.detach().clone() for p in params]
            super().step()
            deltas = []
            for p, start in zip(params, starts, strict=True):
                delta = p.detach() - start
                compressed, ctx = self._adasum_compression.compress(delta)
                deltas.append((compressed.contiguous(), ctx))
            if deltas:
                combined = grouped_allreduce_([d for d, _ in deltas], op=Adasum, name="adasum deltas")
                for p, start, c, (_, ctx) in zip(params, starts, combined, deltas, strict=True):
                    p.copy_(start + self._adasum_compression.decompress(c, ctx).to(p.dtype))
        return loss

    def synchronize(self) -> None:
        """Nothing to wait for: the Adasum optimizer combines in step() (as Horovod's)."""

    @contextmanager
    def no_sync(self):
        """DDP's no_sync(): gradients accumulate in p.grad (as they always do here, where nothing is
        reduced before step()); step() inside raises."""
        self._adasum_no_sync = True
        try:
            yield
        finally:
            self._adasum_no_sync = False

    @contextmanager
    def skip_synchronize(self):
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover


def adasum_optimizer(optimizer, compression, names):
    """The optimizer's Adasum form: an instance of a subclass of its class, sharing its state."""
    wrapped = with_methods(_AdasumStep, optimizer)
    wrapped._gflow_adasum_init(compression, names)
    return wrapped
