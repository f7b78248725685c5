"""Horovod's DistributedOptimizer, built on gflow's data-parallel kit (gflow.DataParallel).

A post-accumulate-grad hook on every parameter that requires grad counts the backward passes; on the
last of backward_passes_per_step it pushes the gradient into the kit, which fuses gradients into
segments and reduces them on gflow's background thread while backward goes on. synchronize() (called
by step()) ends the step: every gradient is then the average (or sum) over the ranks, in place in
`p.grad`, bitwise identical on every rank; then the wrapped optimizer's step runs.
"""

import math
from contextlib import contextmanager

import torch

from . import _basics, _settings
from ._adasum_optimizer import adasum_optimizer
from ._basics import Adasum, Average, Sum, with_methods
from ._distributed import _DistributedOptimizer, check_passes
from .compression import Compression, wire_compression
from .process_sets import NotInSet, comm_of


class _LocalStep:
    """A DistributedOptimizer on a rank outside its process set (Horovod's): the wrapped optimizer's
    own step, with the methods programs call on a DistributedOptimizer doing nothing."""

    _gflow_wrapped = False

    def synchronize(self) -> None:
        """Nothing to reduce on a rank outside the optimizer's process set."""

    @contextmanager
    def skip_synchronize(self):
        yield

    @contextmanager
    def no_sync(self):
        yield


def _patch_grad_scaler() -> None:
    """Have torch.amp.GradScaler reduce a DistributedOptimizer's gradients before it reads them (and
    the Adasum optimizer's ranks agree on what it found after: _adasum_optimizer.py). Its
    _unscale_grads_ is where unscale_() and the inf check of its step() read the gradients (torch
    2.4 to 2.14); without it, the optimizer's step() refuses a gradient unscaled before the
    reduction (synchronize's changed-gradient check) instead of applying it silently."""
    scaler_class = getattr(getattr(torch, "amp", None), "GradScaler", None)
    original = getattr(scaler_class, "_unscale_grads_", None)
    if original is None or getattr(original, "_gflow", False):
        return

    def _unscale_grads_(self, optimizer, *args, **kwargs):
        before = getattr(optimizer, "_before_unscale", None)
        if before is not None and getattr(optimizer, "_gflow_wrapped", False):
            before(self)
        found_inf_per_device = original(self, optimizer, *args, **kwargs)
        after = getattr(optimizer, "_after_unscale", None)
        if after is not None:
            after(found_inf_per_device)
        return found_inf_per_device

    _unscale_grads_._gflow = True
    scaler_class._unscale_grads_ = _unscale_grads_


_patch_grad_scaler()


def _adasum(optimizer, named_parameters, compression, comm, sparse, predivide):
    """DistributedOptimizer(op=hvd.Adasum), after the common checks, with Horovod's restrictions."""
    size = comm.Get_size()
    if comm is not _basics.comm():
        raise NotImplementedError("DistributedOptimizer: Adasum does not support non-global process sets yet")
    if size & (size - 1):
        raise NotImplementedError(
            f"DistributedOptimizer: Adasum needs a power-of-two number of ranks, got {size}"
        )
    if sparse is not None or predivide != 1.0:
        raise ValueError(
            "DistributedOptimizer: op=hvd.Adasum takes neither sparse= nor gradient_predivide_factor"
        )
    names = _named_parameters(optimizer, named_parameters)
    cname, compressor = wire_compression(compression, "DistributedOptimizer")
    if cname is not None:  # (Horovod's compressors cast: so do gflow's here)
        compressor = Compression.fp16 if cname == "fp16" else Compression.bf16
    return adasum_optimizer(optimizer, compressor or Compression.none, names)


def _named_parameters(optimizer, named_parameters):
    """{parameter: name}, in named_parameters' order (the model's), for the optimizer's parameters
    (frozen ones too: one may be unfrozen later); None without named_parameters."""
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return None
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
    names = {}
    for name, p in named_parameters:
        if id(p) in optimizer_ids and p not in names:
            names[p] = str(name)
    return names


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
    gradient_as_bucket_view=False,
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
        op: hvd.Average (default), hvd.Sum, or hvd.Adasum (Horovod's delta optimizer: each rank steps
            alone, the updates are combined by Adasum; see _adasum_optimizer.py; a power-of-two number
            of ranks, the global process set).
        gradient_predivide_factor: with Average, gradients are scaled by 1/f before the reduction
            and f/size after it (Horovod's split of the average).
        num_groups, groups: accepted for compatibility; gflow fuses gradients by threshold_bytes.
        sparse_as_dense: reduce sparse gradients (nn.Embedding(sparse=True)) as dense ones, in the
            fused buffers (True), or as Horovod's sparse allreduce (False, the default): every
            rank's indices and values gathered, so p.grad stays sparse (as torch.optim.SparseAdam
            needs) and holds every rank's entries, divided by the size for Average.
        process_set: the ranks whose gradients are reduced together (a registered hvd.ProcessSet
            including this rank; default all).
        threshold_bytes: gflow's fusion segment size; by default HOROVOD_FUSION_THRESHOLD when set
            ("auto" under HOROVOD_AUTOTUNE=1), else 25 MiB (DDP's bucket size), 4 MiB with
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

        gradient_as_bucket_view: DDP's option: each p.grad becomes a view of gflow's fusion pool, so
            backward accumulates into the buffer that is reduced and the reduced gradient needs no
            copy back (with zero_grad(set_to_none=False), no copy at all). CPU parameters of one
            dtype (float32 or float64), no compression, gradient_predivide_factor 1. Do not keep
            p.grad across steps expecting the local gradient: it holds the reduced one. The pool is
            reduced in place, as DDP's buckets are: after a step that raised, p.grad may hold
            reduced values, so recompute the gradients before retrying (as with DDP).

    Returns:
        The distributed optimizer (its class is a subclass of the wrapped optimizer's class).

    Raises:
        TypeError, ValueError: bad arguments, named; NotImplementedError: Adasum on a number of ranks
            that is not a power of two, or on a process set.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"DistributedOptimizer: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("DistributedOptimizer: the optimizer is already a DistributedOptimizer")
    bpps = check_passes(backward_passes_per_step)
    if isinstance(op, bool) or op not in (Average, Sum, Adasum):
        raise ValueError(f"DistributedOptimizer: op must be hvd.Average, hvd.Sum or hvd.Adasum, got {op!r}")
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
    if not isinstance(gradient_as_bucket_view, bool):
        raise TypeError(
            f"gradient_as_bucket_view must be a bool, got {type(gradient_as_bucket_view).__name__}"
        )
    if gradient_as_bucket_view and (compression is not Compression.none or predivide != 1.0 or op == Adasum):
        raise ValueError(
            "DistributedOptimizer: gradient_as_bucket_view=True takes neither compression, nor a "
            "gradient_predivide_factor, nor op=Adasum (the pool holds the gradients as they are reduced)"
        )
    try:
        comm = comm_of(process_set, "DistributedOptimizer")
    except NotInSet:  # as Horovod: outside its set, the optimizer steps on this rank's own gradients
        return with_methods(_LocalStep, optimizer)
    if op == Adasum:
        return _adasum(optimizer, named_parameters, compression, comm, sparse, predivide)
    wire_compression(compression, "DistributedOptimizer")
    if sparse is not None and not isinstance(sparse, dict):
        raise TypeError(
            f"sparse must be None or a dict of sparse-communication settings, got {type(sparse).__name__}"
        )
    if threshold_bytes is None:
        threshold_bytes = _settings.fusion_threshold()  # (HOROVOD_FUSION_THRESHOLD, HOROVOD_AUTOTUNE)
    names = _named_parameters(optimizer, named_parameters)
    distributed = with_methods(_DistributedOptimizer, optimizer)
    distributed._gflow_comm = comm
    momentum_moved = None
    if sparse is not None:
        before = [g.get("momentum") for g in optimizer.param_groups]
        sparse = _sgd_momentum_into_csc(optimizer, sparse)
        momentum_moved = before
    momentum_in_csc = sparse is not None and isinstance(optimizer, torch.optim.SGD)
    try:
        distributed._gflow_init(
            names, compression, bpps, op, predivide, threshold_bytes, sparse, momentum_in_csc,
            sparse_as_dense=sparse_as_dense, bucket_view=gradient_as_bucket_view,
        )  # fmt: skip
    except Exception:
        if momentum_moved is not None:  # leave the user's optimizer as it was
            for group, m in zip(optimizer.param_groups, momentum_moved, strict=True):
                if m is not None:
                    group["momentum"] = m
        raise
    return distributed
