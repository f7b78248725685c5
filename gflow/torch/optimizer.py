"""Horovod's DistributedOptimizer, built on gflow's data-parallel kit (gflow.DataParallel).

A post-accumulate-grad hook on every parameter that requires grad counts the backward passes; on the
last of backward_passes_per_step it pushes the gradient into the kit, which fuses gradients into
segments and reduces them on gflow's background thread while backward goes on. synchronize() (called
by step()) ends the step: every gradient is then the average (or sum) over the ranks, in place in
`p.grad`, bitwise identical on every rank; then the wrapped optimizer's step runs.
"""

import math
import warnings
import weakref
from contextlib import contextmanager

import numpy as np
import torch

import gflow

from ..data_parallel import DataParallel
from . import _basics
from ._basics import Adasum, Average, Sum, as_horovod_error, check_process_set
from .compression import Compression, wire_compression


class _DistributedOptimizer:
    """The methods a DistributedOptimizer adds to (or overrides on) the optimizer it wraps.

    The class of a DistributedOptimizer derives from this one and from the wrapped optimizer's class,
    so isinstance(opt, torch.optim.SGD) holds, and shares the wrapped instance's attributes (param
    groups, state, hooks), so its state_dict is the wrapped optimizer's, plus gflow's under "gflow".
    """

    _gflow_wrapped = True

    # --- set-up ---------------------------------------------------------------------------------

    def _gflow_init(self, keys, params, names, compression, bpps, op, predivide, threshold_bytes, sparse):
        self._gflow_params = params  # in model order; the kit pushes in the reverse order
        self._gflow_keys = keys
        self._gflow_names = names
        cname, compressor = wire_compression(compression, "DistributedOptimizer")
        self._compressor = compressor
        self._sparse = sparse is not None
        self.backward_passes_per_step = bpps
        self.op = op
        self.gradient_predivide_factor = predivide
        # What the kit reduces per parameter: the gradient itself, or (predivided, compressed) a new
        # tensor; a probe gives its shape and dtype, and the ctx to decompress a zero gradient with.
        probes, self._probe_ctx = [], []
        for p in params:
            probe = torch.zeros_like(p, memory_format=torch.contiguous_format).detach()
            ctx = None
            if compressor is not None:
                probe, ctx = compressor.compress(probe)
                if not isinstance(probe, torch.Tensor):
                    raise TypeError(
                        f"DistributedOptimizer: the compressor's compress() must return (tensor, ctx), "
                        f"got {type(probe).__name__}"
                    )
            probes.append(probe)
            self._probe_ctx.append(ctx)
        kit_params = dict(zip(keys, probes, strict=True)) if isinstance(keys[0], str) else probes
        self._dp = DataParallel(
            kit_params,
            op="mean" if op == Average else "sum",
            threshold_bytes=threshold_bytes,
            compression=cname,
            sparse=sparse,
            comm=_basics.comm(),
        )
        self._should_synchronize = True
        self._synchronized = False
        self._overflow = None
        self._gflow_reset_step()
        self._grad_hooks = []
        for index, p in enumerate(params):
            self._grad_hooks.append(p.register_post_accumulate_grad_hook(_make_hook(self, index)))

    def _gflow_reset_step(self) -> None:
        n = len(self._gflow_params)
        self._delay = [self.backward_passes_per_step] * n
        self._pushed = [None] * n  # per parameter: (tensor pushed into the kit, decompress ctx)
        self._touched = False  # a hook fired since the last synchronize()

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change backward_passes_per_step (between steps)."""
        self.backward_passes_per_step = _check_passes(passes)
        self._delay = [self.backward_passes_per_step] * len(self._gflow_params)

    def add_param_group(self, param_group):
        raise NotImplementedError(
            "DistributedOptimizer: add_param_group after wrapping is not supported (its gradients would "
            "not be reduced); add every group to the optimizer before wrapping it"
        )

    # --- the hook -------------------------------------------------------------------------------

    def _on_grad(self, index: int, p) -> None:
        if self._delay[index] <= 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call to "
                "step(). Increase backward_passes_per_step to accumulate gradients locally."
            )
        self._touched = True
        self._delay[index] -= 1
        if self._delay[index] == 0:
            self._push(index, p)

    def _push(self, index: int, p) -> None:
        grad = p.grad
        if grad.layout != torch.strided:  # sparse gradients (nn.Embedding(sparse=True)) go dense
            grad = grad.to_dense()
            p.grad = grad
        work = grad
        if self.gradient_predivide_factor != 1.0:
            work = grad * (1.0 / self.gradient_predivide_factor)
        elif not grad.is_contiguous():  # e.g. channels_last: reduced in a contiguous copy
            work = grad.contiguous()
        ctx = None
        if self._compressor is not None:
            work, ctx = self._compressor.compress(work)
        self._pushed[index] = (work, ctx)
        self._dp.push(self._gflow_keys[index], work)

    # --- synchronize / step -----------------------------------------------------------------------

    def synchronize(self) -> None:
        """Wait for every gradient's reduction: afterwards each p.grad holds the average (or sum) over
        the ranks, identical on every rank.

        A parameter with a gradient that was not pushed yet (fewer backward passes than
        backward_passes_per_step, or a .grad set by hand) is reduced now. A parameter whose .grad is
        None on this rank (unused in this step) counts as zeros: if another rank used it, its .grad
        becomes the reduced gradient here too; if no rank did, it stays None (as Horovod's and DDP's).

        Raises:
            HorovodInternalError: the reduction failed on every rank (MismatchError: the ranks'
                models differ...). Every p.grad then keeps its local value and the next step works.
            TypeError, ValueError: this rank pushed a bad gradient (the others raise MismatchError).

        An fp16 overflow (compression=fp16, or a NaN/inf with sparse=) is not raised here: the
        gradients then hold inf/NaN on every rank alike, so torch.amp.GradScaler skips the step on
        every rank; step() raises CompressionOverflowError / NonFiniteError instead of applying them.
        """
        params = self._gflow_params
        self._overflow = None
        try:
            for index, p in enumerate(params):
                if self._pushed[index] is None and p.grad is not None:
                    self._push(index, p)
            overflow = None
            try:
                self._dp.synchronize()
            except gflow.NonFiniteError as exc:  # on every rank alike: see the docstring
                overflow = exc
            except Exception as exc:  # noqa: BLE001 - every rank raises (gflow guarantees it)
                raise as_horovod_error(exc).with_traceback(exc.__traceback__) from None
            # Which parameters some rank had a gradient for. Asked only now, when every rank's
            # background queue is empty: whether the kit's segments went out during backward or at
            # synchronize() depends on which parameters each rank used, so a collective queued
            # before them could meet a segment on another rank.
            used = torch.tensor([entry is not None for entry in self._pushed], dtype=torch.int32)
            try:
                used = gflow.allreduce_async(used, "max", comm=_basics.comm()).wait()
            except gflow.GflowError as exc:
                raise as_horovod_error(exc).with_traceback(exc.__traceback__) from None
            self._gflow_write_back(used, overflow)
        finally:
            self._gflow_reset_step()
        self._synchronized = True

    def _gflow_write_back(self, used, overflow) -> None:
        """Put the reduced gradients into p.grad (they are there already when p.grad was pushed as it
        is); after an overflow, make every gradient non-finite on every rank alike."""
        reduced = None
        for index, p in enumerate(self._gflow_params):
            entry = self._pushed[index]
            if entry is None:
                if not used[index]:
                    continue  # no rank used it: .grad stays None
                if reduced is None:
                    reduced = self._dp.gradients()  # the zeros the kit pushed for it, reduced
                entry = (reduced[self._gflow_keys[index]], self._probe_ctx[index])
                p.grad = torch.zeros_like(p)
            work, ctx = entry
            if overflow is not None and self._sparse:
                p.grad.fill_(math.nan)  # the sparse step did not happen: nothing reduced to show
                continue
            if self._compressor is not None:
                work = self._compressor.decompress(work, ctx)
            if self.gradient_predivide_factor != 1.0:
                work = work * self.gradient_predivide_factor
            if work is not p.grad:
                p.grad.copy_(work)
        if overflow is not None:
            self._overflow = overflow

    @contextmanager
    def skip_synchronize(self):
        """step() inside this context does not synchronize: for the pattern

        optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        with optimizer.skip_synchronize():
            optimizer.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Synchronize (unless inside skip_synchronize()), then the wrapped optimizer's step.

        With a closure, the closure's backward is synchronized each time the wrapped step calls it.

        Raises:
            CompressionOverflowError, NonFiniteError (HorovodInternalErrors): the last synchronize()
                overflowed (see synchronize); the step is not applied.
        """
        if closure is not None:
            return super().step(self._synchronized_closure(closure))
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                    "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                    "your code.",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        self._raise_overflow()
        return super().step()

    def _synchronized_closure(self, closure):
        def synchronized():
            with torch.enable_grad():
                loss = closure()
            self.synchronize()
            self._synchronized = False
            self._raise_overflow()
            return loss

        return synchronized

    def _raise_overflow(self) -> None:
        overflow, self._overflow = self._overflow, None
        if overflow is not None:
            error = as_horovod_error(overflow)
            raise type(error)(
                f"{error} (DistributedOptimizer: the gradients hold inf/NaN on every rank; the step was not "
                "applied. Use torch.amp.GradScaler, which skips such steps, or a smaller loss scale)"
            )

    def zero_grad(self, set_to_none: bool = True):
        if self._touched:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(). This is prohibited as it can cause a race condition."
            )
        return super().zero_grad(set_to_none)

    # --- checkpoints ------------------------------------------------------------------------------

    def state_dict(self):
        """The wrapped optimizer's state dict, plus this rank's gflow state (DataParallel.state_dict():
        with sparse=, the residuals, which are per rank) under the key "gflow"."""
        state = super().state_dict()
        state["gflow"] = _as_tensors(self._dp.state_dict())
        return state

    def load_state_dict(self, state_dict):
        """Load a state_dict(); a plain optimizer state dict (without "gflow") loads too, leaving
        gflow's state as it is."""
        state_dict = dict(state_dict)
        kit_state = _as_arrays(state_dict.pop("gflow", None))
        before = None
        if kit_state is not None:
            before = self._dp.state_dict(), self._dp._lazy._snapshot()
            self._dp.load_state_dict(kit_state)
        try:
            super().load_state_dict(state_dict)
        except Exception:
            if before is not None:
                self._dp.load_state_dict(before[0])
                self._dp._lazy._restore(before[1])  # as it was, tuning progress included
            raise
        self._gflow_reset_step()
        self._synchronized = False
        self._overflow = None

    def _wrapped_state_dict(self):
        return super().state_dict()

    def _wrapped_load_state_dict(self, state_dict):
        return super().load_state_dict(state_dict)


# The wrapped class's step already runs torch's step hooks; torch must not wrap this one again.
_DistributedOptimizer.step.hooked = True


def _make_hook(optimizer, index: int):
    ref = weakref.ref(optimizer)  # the hook lives on the parameter: it must not keep the optimizer

    def hook(p):
        opt = ref()
        if opt is not None:
            opt._on_grad(index, p)

    return hook


_classes: dict = {}


def _distributed_class(cls):
    distributed = _classes.get(cls)
    if distributed is None:
        distributed = type(cls.__name__, (_DistributedOptimizer, cls), {"__module__": cls.__module__})
        distributed.__qualname__ = cls.__qualname__
        _classes[cls] = distributed
    return distributed


def _check_passes(passes) -> int:
    if isinstance(passes, bool) or not isinstance(passes, int):
        raise TypeError(f"backward_passes_per_step must be an int, got {type(passes).__name__}")
    if passes < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
    return passes


def _named_parameters(optimizer, named_parameters):
    """(names in model order, params in model order) of the optimizer's parameters that require grad."""
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        order = list(dict.fromkeys(in_optimizer))  # a parameter in two groups counts once
        return None, [p for p in order if p.requires_grad]
    named_parameters = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named_parameters):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), usually produced by "
            "model.named_parameters()"
        )
    seen, dups = set(), []
    for name, _ in named_parameters:
        if name in seen:
            dups.append(name)
        seen.add(name)
    if dups:
        raise ValueError(
            f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}"
        )
    named_ids = {id(p) for _, p in named_parameters}
    unnamed = [p for p in in_optimizer if id(p) not in named_ids]
    if unnamed:
        shapes = ", ".join(str(tuple(p.shape)) for p in unnamed[:5])
        raise ValueError(
            f"named_parameters was specified, but {len(unnamed)} of the optimizer's parameters are not "
            f"named in it (shapes {shapes})"
        )
    optimizer_ids = {id(p) for p in in_optimizer}
    names, params, taken = [], [], set()
    for name, p in named_parameters:
        if id(p) in optimizer_ids and id(p) not in taken and p.requires_grad:
            names.append(str(name))
            params.append(p)
            taken.add(id(p))
    return names, params


def _sgd_momentum_into_csc(optimizer, sparse: dict) -> dict:
    """With sparse= and torch.optim.SGD(momentum=m): CSC applies the momentum (Deep Gradient
    Compression's momentum correction) and SGD's is set to 0, so the update is not accelerated twice."""
    if not isinstance(optimizer, torch.optim.SGD):
        return sparse
    momenta = {float(g.get("momentum", 0.0)) for g in optimizer.param_groups}
    if any(g.get("nesterov", False) for g in optimizer.param_groups):
        raise ValueError(
            "DistributedOptimizer(sparse=...): SGD with nesterov=True is not supported: sparse "
            "communication applies plain momentum (Deep Gradient Compression's momentum correction)"
        )
    if momenta == {0.0}:
        return sparse
    if len(momenta) > 1:
        raise ValueError(
            "DistributedOptimizer(sparse=...): the SGD param groups have different momenta "
            f"{sorted(momenta)}; "
            "sparse communication applies one momentum to all gradients"
        )
    if any(float(g.get("dampening", 0.0)) != 0.0 for g in optimizer.param_groups):
        raise ValueError("DistributedOptimizer(sparse=...): SGD with dampening != 0 is not supported")
    if "momentum" in sparse:
        raise ValueError(
            "DistributedOptimizer(sparse=...): give the momentum once: SGD has momentum "
            f"{momenta.pop()} and sparse has momentum {sparse['momentum']}"
        )
    sparse = dict(sparse, momentum=momenta.pop())
    for group in optimizer.param_groups:
        group["momentum"] = 0.0
    return sparse


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer,
    named_parameters=None,
    compression=Compression.none,
    backward_passes_per_step=1,
    op=Average,
    gradient_predivide_factor=1.0,
    num_groups=0,
    groups=None,
    sparse_as_dense=False,
    process_set=None,
    *,
    threshold_bytes=None,
    sparse=None,
):
    """Wrap a torch optimizer so that step() applies the gradients averaged (or summed) over all ranks.

    Gradients are reduced while backward runs (fused into segments of threshold_bytes on gflow's
    background thread); step() waits for them (synchronize()) and runs the wrapped step. For gradient
    clipping, synchronize() first, clip, then step() inside skip_synchronize().

    Args:
        optimizer: a torch.optim.Optimizer; the result is an instance of its class too, sharing its
            param groups and state.
        named_parameters: model.named_parameters() (recommended: names in checkpoints and messages,
            and the model's order, which lets the reductions overlap backward best). Must name every
            parameter of the optimizer.
        compression: Compression.none, Compression.fp16 (gflow's float16 wire format), or a compressor
            with compress/decompress.
        backward_passes_per_step: backward passes per step(); gradients accumulate locally and are
            reduced once, on the last pass (scale the loss yourself, as with Horovod).
        op: hvd.Average (default) or hvd.Sum. Adasum raises NotImplementedError.
        gradient_predivide_factor: with Average, gradients are scaled by 1/f before the reduction
            and f/size after it (Horovod's split of the average).
        num_groups, groups: accepted for compatibility; gflow fuses gradients by threshold_bytes.
        sparse_as_dense: accepted; sparse gradients are always reduced as dense.
        process_set: only the global process set is supported.
        threshold_bytes: gflow's fusion segment size; by default 25 MiB (DDP's bucket size), 4 MiB with
            Compression.fp16 (gflow.DataParallel's defaults, measured end to end); "auto" tunes it
            during the first steps (gflow.LazyAllreduce).
        sparse: None, or coarse-grained sparse communication settings (a dict: density, chunk_elems,
            momentum, warmup_steps; see gflow.SparseAllreduce). Momentum: with torch.optim.SGD of
            momentum m > 0 the momentum moves into CSC (Deep Gradient Compression's momentum
            correction: sparse momentum m, and the param groups' momentum set to 0, so the update is
            not accelerated twice); SGD with nesterov, dampening or different momenta per group raise
            ValueError. With any other optimizer CSC uses momentum 0 unless sparse gives one. CSC
            clears the velocity of what it sends (DGC's momentum factor masking), so at density 1
            the update is plain SGD's; SGD's weight decay then applies after CSC, not before its
            momentum. The residuals are per rank: each rank saves and loads its own state_dict.
            Keep the loss scale constant (torch.amp.GradScaler's changing scale mixes units in the
            residual).

    Returns:
        The distributed optimizer (its class is a subclass of the wrapped optimizer's class).

    Raises:
        TypeError, ValueError: bad arguments, named; NotImplementedError: Adasum, process sets.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"DistributedOptimizer: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("DistributedOptimizer: the optimizer is already a DistributedOptimizer")
    bpps = _check_passes(backward_passes_per_step)
    if op == Adasum:
        raise NotImplementedError(
            "DistributedOptimizer: op=hvd.Adasum is not implemented by gflow; use Average or Sum"
        )
    if isinstance(op, bool) or op not in (Average, Sum):
        raise ValueError(f"DistributedOptimizer: op must be hvd.Average or hvd.Sum, got {op!r}")
    if isinstance(gradient_predivide_factor, bool) or not isinstance(gradient_predivide_factor, (int, float)):
        raise TypeError(
            f"gradient_predivide_factor must be a number, got {type(gradient_predivide_factor).__name__}"
        )
    predivide = float(gradient_predivide_factor)
    if not (math.isfinite(predivide) and predivide > 0):
        raise ValueError(
            f"gradient_predivide_factor must be a positive number, got {gradient_predivide_factor}"
        )
    if predivide != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups must be an int >= 0, got {num_groups!r}")
    if groups is not None and not isinstance(groups, (int, list, tuple)):
        raise ValueError(
            f"groups must be None, an int or a list of lists of parameters, got {type(groups).__name__}"
        )
    if not isinstance(sparse_as_dense, bool):
        raise TypeError(f"sparse_as_dense must be a bool, got {type(sparse_as_dense).__name__}")
    check_process_set(process_set, "DistributedOptimizer")
    wire_compression(compression, "DistributedOptimizer")
    if sparse is not None and not isinstance(sparse, dict):
        raise TypeError(
            f"sparse must be None or a dict of sparse-communication settings, got {type(sparse).__name__}"
        )
    names, params = _named_parameters(optimizer, named_parameters)
    if not params:
        raise ValueError("DistributedOptimizer: the optimizer has no parameter that requires grad")
    keys = names if names is not None else list(range(len(params)))
    cls = _distributed_class(type(optimizer))
    distributed = cls.__new__(cls)
    distributed.__dict__.update(optimizer.__dict__)
    momentum_moved = None
    if sparse is not None:
        before = [g.get("momentum") for g in optimizer.param_groups]
        sparse = _sgd_momentum_into_csc(optimizer, sparse)
        momentum_moved = before
    try:
        distributed._gflow_init(
            keys, params, names, compression, bpps, op, predivide, threshold_bytes, sparse
        )
    except Exception:
        if momentum_moved is not None:  # leave the user's optimizer as it was
            for group, m in zip(optimizer.param_groups, momentum_moved, strict=True):
                if m is not None:
                    group["momentum"] = m
        raise
    return distributed


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
