"""DistributedOptimizer's checkpoints (a mixin of its class, _distributed.py): the wrapped optimizer's
state dict plus this rank's gflow state under "gflow", as tensors so torch.save/torch.load take it."""

import numpy as np
import torch


class OptimizerCheckpoint:
    """state_dict()/load_state_dict() of a DistributedOptimizer; super() is the wrapped optimizer's
    class (the MRO: the distributed class, _DistributedOptimizer, this, the wrapped class)."""

    def state_dict(self):
        """The wrapped optimizer's state dict, plus this rank's gflow state (DataParallel.state_dict():
        with sparse=, the residuals, which are per rank) under the key "gflow"."""
        self._check_between_steps("state_dict")
        state = super().state_dict()
        state["gflow"] = _as_tensors(self._dp.state_dict())
        return state

    def load_state_dict(self, state_dict):
        """Load a state_dict(); a plain optimizer state dict (without "gflow") loads too, leaving
        gflow's state as it is. One saved at another world size loads as Horovod's does (the job
        resumed on fewer or more ranks): gflow's own state holds nothing per rank (with
        threshold_bytes="auto" the tuning starts again, with a warning), unless it holds sparse=
        residuals: those are per rank, and refused (DataParallel.load_state_dict)."""
        self._check_between_steps("load_state_dict")
        state_dict = dict(state_dict)
        kit_state = _as_arrays(state_dict.pop("gflow", None))
        kit = (
            self._dp,
            self._gflow_params,
            self._gflow_keys,
            self._probe_ctx,
            self._index_of,
            self._gflow_layouts,
            self._views,
            self._view_samples,
        )
        before = None
        try:
            if kit_state is not None:
                self._gflow_adopt_saved_parameters(kit_state)  # (a new kit, or the same one)
                before = self._dp.state_dict(), self._dp.snapshot(), self._dp.sparse
                if self._momentum_in_csc:  # CSC's momentum as it was saved (a schedule may have moved it)
                    self._dp.set_momentum(_saved_momentum(kit_state))
                self._dp.load_state_dict(kit_state)
            super().load_state_dict(state_dict)
            self._gflow_take_momentum()  # a plain SGD state dict brings its momentum back
        except Exception:
            if before is not None and self._dp is kit[0]:  # as it was, tuning progress included
                if before[2] is not None:
                    self._dp.set_momentum(before[2].get("momentum", 0.0))
                self._dp.load_state_dict(before[0])
                self._dp.restore(before[1])
            self._dp, self._gflow_params, self._gflow_keys, self._probe_ctx, self._index_of = kit[:5]
            self._gflow_layouts, self._views, self._view_samples = kit[5:]
            self._gflow_reset_step()
            raise
        self._gflow_reset_step()
        self._reduced = self._user_synchronized = False
        self._overflow = None

    def _gflow_adopt_saved_parameters(self, kit_state) -> None:
        """A checkpoint saved after a parameter was unfrozen or added (or frozen) names other
        parameters than this optimizer reduces now: reduce those it names, where each name is one of
        this optimizer's (its next step takes the parameters as they then require grad). Without
        named_parameters the names are Horovod's "allreduce.noname.<i>", by place in the groups."""
        saved = kit_state.get("names") if isinstance(kit_state, dict) else None
        if not isinstance(saved, list) or saved == self._gflow_keys:
            return  # (the kit's own load reports whatever else differs)
        grouped = list(dict.fromkeys(p for group in self.param_groups for p in group["params"]))
        by_name = dict(zip(self._gflow_keys_of(grouped), grouped, strict=True))
        if self._gflow_names is not None:
            by_name.update((name, p) for p, name in self._gflow_names.items())
        params = [by_name.get(name) for name in saved]
        if all(p is not None for p in params) and len(set(map(id, params))) == len(params) and params:
            self._gflow_build(params)
            self._gflow_reset_step()

    def _wrapped_state_dict(self):
        return super().state_dict()

    def _wrapped_load_state_dict(self, state_dict):
        return super().load_state_dict(state_dict)


def _saved_momentum(kit_state) -> float:
    try:
        return float(kit_state["lazy"]["sparse"]["momentum"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            "DistributedOptimizer.load_state_dict: the gflow state holds no sparse momentum "
            "(gflow.lazy.sparse.momentum); it was not saved by a DistributedOptimizer(sparse=...)"
        ) from None


def _as_tensors(state):
    """The kit's state with its NumPy arrays (and NumPy scalars) as tensors and Python values, so that
    torch.save/torch.load(weights_only=True), the default since torch 2.6, take the optimizer's state."""
    if isinstance(state, dict):
        return {key: _as_tensors(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_as_tensors(value) for value in state)
    if isinstance(state, np.ndarray):
        return torch.from_numpy(state.copy())
    if isinstance(state, np.generic):
        return state.item()
    return state


def _as_arrays(state):
    """_as_tensors undone: tensors back to the NumPy arrays the kit's load_state_dict reads."""
    if isinstance(state, dict):
        return {key: _as_arrays(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_as_arrays(value) for value in state)
    if isinstance(state, torch.Tensor):
        return state.detach().cpu().numpy().copy()
    return state
