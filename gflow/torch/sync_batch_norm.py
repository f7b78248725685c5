"""Horovod's SyncBatchNorm on gflow: batch normalization whose batch statistics are those of every
rank's batch together, as if one process had normalized the concatenation of the ranks' batches.

    model = torchvision.models.resnet50(norm_layer=hvd.SyncBatchNorm)

Forward (training, or whenever batch statistics are used): each rank computes, per channel, its element
count n, mean and sum of squared deviations m2 (torch.var_mean, in float32 or float64); one gflow
allgather of [n, mean, m2] in float64 (2C + 1 numbers per rank) gives every rank the same rows, which
every rank combines the same way (Chan et al.'s pairwise update: no sum-of-squares cancellation), so
the global mean, variance and running statistics are bitwise identical on every rank. The running
statistics are updated as torch's BatchNorm does: momentum (or the cumulative average when momentum
is None) towards the global mean and the unbiased global variance m2 / (N - 1).

Backward: each rank sums dy and dy * xhat per channel; one gflow allreduce (sum, float64) of the 2C
sums gives the input gradient of the global objective (the sum of every rank's loss). The weight and
bias gradients stay local (this rank's share, as in Horovod and torch.nn.SyncBatchNorm): the
DistributedOptimizer's allreduce averages them like every other gradient.

Where this differs from Horovod (and torch.nn.SyncBatchNorm), and why:
- CPU tensors work (Horovod's raises for them); CUDA tensors too, through gflow's device path.
- Ranks may pass different batch sizes, including empty batches (their count is 0).
- A global count of one element per channel in training raises ValueError on every rank (torch's
  BatchNorm rule, "Expected more than 1 value per channel when training"), decided after the
  allgather so that no rank is left waiting.
- A rank whose own input is bad (fewer than 2 dimensions, wrong channel count, not floating) raises
  its ValueError/TypeError and its peers raise MismatchError (a HorovodInternalError), instead of
  waiting for it forever.
- With one rank it is torch's F.batch_norm, as Horovod's. Eval mode with running statistics never
  communicates (and does not need hvd.init()); eval mode without running statistics normalizes with
  the global batch statistics (Horovod's rule; torch.nn.SyncBatchNorm uses the local ones there).
- Every rank must run the layer's forward (and, when its input needs a gradient, its backward) in the
  same order as its peers: each one is a collective. Double backward is not supported.
"""

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

import gflow

from ..collectives.operations import reject
from ..runtime.context import context
from ._basics import as_horovod_error
from .process_sets import ProcessSet, comm_of

__all__ = ["SyncBatchNorm"]


def _raise(exc: BaseException):
    raise as_horovod_error(exc).with_traceback(exc.__traceback__) from None


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics and normalization are computed in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _channel_view(v: torch.Tensor, dim: int) -> torch.Tensor:
    """A per-channel vector (C,) shaped to broadcast against an (N, C, ...) tensor of `dim` dims."""
    return v.view((1, -1) + (1,) * (dim - 2))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum, comm):
        channels = input.size(1)
        acc = _acc_dtype(input.dtype)
        x = input.to(acc)
        dims = [0, *range(2, input.dim())]
        n_local = input.numel() // channels if channels else 0

        # This rank's count, mean and sum of squared deviations, per channel.
        if n_local > 0:
            var, mean = torch.var_mean(x, dim=dims, correction=0)
            local = torch.cat(
                [
                    torch.full((1,), float(n_local), dtype=torch.float64, device=input.device),
                    mean.to(torch.float64),
                    var.to(torch.float64) * n_local,
                ]
            )
        else:
            local = torch.zeros(2 * channels + 1, dtype=torch.float64, device=input.device)
        try:
            rows = gflow.allgather(local.view(1, -1), comm=comm)  # (p, 2C + 1), same on every rank
        except Exception as exc:  # noqa: BLE001 - raised as gflow.torch raises collective errors
            _raise(exc)

        counts = rows[:, :1]
        total = float(counts.sum())
        if total == 1:
            raise ValueError(
                "SyncBatchNorm: expected more than 1 value per channel when training, got 1 over all "
                f"ranks (this rank's input size {list(input.shape)})"
            )
        if total == 0:  # every rank's batch is empty: nothing to normalize, nothing to learn from
            ctx.save_for_backward(input, weight, None, None)
            ctx.total, ctx.comm = total, comm
            return input.clone()

        means, m2s = rows[:, 1 : channels + 1], rows[:, channels + 1 :]
        mean64 = (counts * means).sum(0) / total
        m2_64 = (m2s + counts * (means - mean64) ** 2).sum(0)
        invstd64 = torch.rsqrt(m2_64 / total + eps)

        if running_mean is not None:
            running_mean.copy_(running_mean.to(torch.float64) * (1 - momentum) + mean64 * momentum)
        if running_var is not None:
            var_unbiased = m2_64 / (total - 1)
            running_var.copy_(running_var.to(torch.float64) * (1 - momentum) + var_unbiased * momentum)

        mean, invstd = mean64.to(acc), invstd64.to(acc)
        scale = invstd if weight is None else invstd * weight.to(acc)
        out = (x - _channel_view(mean, x.dim())) * _channel_view(scale, x.dim())
        if bias is not None:
            out = out + _channel_view(bias.to(acc), x.dim())

        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.total, ctx.comm = total, comm
        return out.to(input.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        input, weight, mean, invstd = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        if mean is None:  # every rank's batch was empty
            grad_input = torch.zeros_like(input) if need_input else None
            grad_weight = torch.zeros_like(weight) if weight is not None and need_weight else None
            grad_bias = torch.zeros_like(weight) if weight is not None and need_bias else None
            return grad_input, grad_weight, grad_bias, None, None, None, None, None

        acc = mean.dtype
        d = input.dim()
        dims = [0, *range(2, d)]
        dy = grad_output.to(acc)
        xhat = (input.to(acc) - _channel_view(mean, d)) * _channel_view(invstd, d)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)

        grad_input = None
        if need_input:
            local = torch.cat([sum_dy.to(torch.float64), sum_dy_xhat.to(torch.float64)])
            try:
                sums = gflow.allreduce(local, "sum", comm=ctx.comm)
            except Exception as exc:  # noqa: BLE001 - raised as gflow.torch raises collective errors
                _raise(exc)
            channels = mean.numel()
            mean_dy = (sums[:channels] / ctx.total).to(acc)
            mean_dy_xhat = (sums[channels:] / ctx.total).to(acc)
            scale = invstd if weight is None else invstd * weight.to(acc)
            grad_input = (dy - _channel_view(mean_dy, d) - xhat * _channel_view(mean_dy_xhat, d)) * (
                _channel_view(scale, d)
            )
            grad_input = grad_input.to(input.dtype)

        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None and need_weight else None
        grad_bias = sum_dy.to(weight.dtype) if weight is not None and need_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the ranks' batches together (Horovod's hvd.SyncBatchNorm).

    A drop-in for torch.nn.BatchNorm1d/2d/3d (any input of shape (N, C, ...) with at least 2
    dimensions; same parameters, buffers and state_dict keys). In training mode, and in eval mode when
    it keeps no running statistics, the mean and variance are those of every rank's batch together,
    and running_mean/running_var move towards them as torch's BatchNorm would on the concatenated
    batch. In eval mode with running statistics it is plain batch normalization with them.

    Args:
        num_features: C, the number of channels of an input (N, C, ...).
        eps: added to the variance for numerical stability. Default: 1e-5.
        momentum: the weight of the new statistics in the running ones; None for the cumulative
            average. Default: 0.1.
        affine: learnable per-channel weight and bias. Default: True.
        track_running_stats: keep running_mean/running_var (and use them in eval mode). Default: True.
        process_set: the ranks whose batches are normalized together (a registered hvd.ProcessSet,
            default all; a gflow extension of Horovod's SyncBatchNorm).
        device, dtype: of the parameters and buffers, as torch's BatchNorm.

    The module needs hvd.init() before a forward that communicates. See the module docstring for the
    collectives it runs and where it differs from Horovod.
    """

    def __init__(
        self,
        num_features,
        eps=1e-5,
        momentum=0.1,
        affine=True,
        track_running_stats=True,
        process_set=None,
        device=None,
        dtype=None,
    ):
        if process_set is not None and not isinstance(process_set, ProcessSet):
            raise TypeError(
                f"SyncBatchNorm: process_set must be an hvd.ProcessSet, got {type(process_set).__name__}"
            )
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected at least 2D input (got {input.dim()}D input)")

    def _check_input(self, input):
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"SyncBatchNorm: input must be a torch.Tensor, got {type(input).__name__}")
        self._check_input_dim(input)
        if input.size(1) != self.num_features:
            raise ValueError(
                f"SyncBatchNorm: expected {self.num_features} channels (dimension 1), got input of size "
                f"{list(input.shape)}"
            )
        if not input.dtype.is_floating_point:
            raise TypeError(f"SyncBatchNorm: input must be floating point, got {input.dtype}")

    def forward(self, input):
        # As torch's _BatchNorm: the factor of the running-statistics update, and when batch statistics
        # are used (training, or no running statistics to normalize with).
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        update = not self.training or self.track_running_stats
        running_mean = self.running_mean if update else None
        running_var = self.running_var if update else None

        if not batch_stats:  # eval with running statistics: local, no communication
            self._check_input(input)
            return F.batch_norm(
                input, running_mean, running_var, self.weight, self.bias, False, 0.0, self.eps
            )

        comm = comm_of(self.process_set, "SyncBatchNorm")
        try:
            self._check_input(input)
        except Exception:
            if comm.Get_size() > 1:  # the peers' allgather fails with MismatchError instead of waiting
                reject(context(comm), "allgather")
            raise
        if comm.Get_size() == 1:
            return F.batch_norm(
                input, running_mean, running_var, self.weight, self.bias, True, factor, self.eps
            )
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor, comm
        )
