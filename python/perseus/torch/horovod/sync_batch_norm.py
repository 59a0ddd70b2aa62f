"""``SyncBatchNorm``: batch normalization with statistics over the whole global batch."""

import torch
import torch.nn.functional as F
from torch.autograd import Function
from torch.nn.modules.batchnorm import _BatchNorm

from perseus.common import batch_stats
from perseus.common.process_sets import global_process_set
from perseus.torch.horovod.mpi_ops import (
    Sum,
    _allgather_concat_async,
    allreduce_async,
    size,
    synchronize,
)


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over N-dimensional input whose statistics span every rank.

    In training mode the mean and variance are those of the batch concatenated
    across ranks (each rank may hold a different number of samples), and the
    backward pass reduces the matching gradient sums; so a model trained on
    ``size()`` ranks normalizes exactly as on one process holding the whole batch.
    In evaluation mode the running statistics are used, as in ``BatchNorm``.
    Works on CPU tensors.

    Arguments are those of ``torch.nn.BatchNorm2d``: ``num_features`` (channels C
    of an ``(N, C, ...)`` input), ``eps``, ``momentum`` (None: cumulative average),
    ``affine`` and ``track_running_stats``.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        """Normalize ``input`` with global batch statistics (training) or running ones."""
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, False, 0.0, self.eps)
        running_mean = self.running_mean if self.training else None
        running_var = self.running_var if self.training else None
        if size() == 1:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                True, factor, self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean,
                                            running_var, self.eps, factor)


def _view(t, ndim):
    return t.view(1, -1, *([1] * (ndim - 2)))


def _acc_dtype(x):
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


class _SyncBatchNormFunction(Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum):
        x = x.contiguous()
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        xf = x.to(_acc_dtype(x))
        count = x.numel() // channels
        if count > 0:
            mean = xf.mean(dims)
            m2 = ((xf - _view(mean, x.dim())) ** 2).sum(dims)
        else:
            mean = m2 = xf.new_zeros(channels)
        local = torch.cat([torch.tensor([float(count)], dtype=torch.float64, device=x.device),
                           mean.double(), m2.double()]).unsqueeze(0)
        stats = synchronize(_allgather_concat_async(local, "sync_batch_norm.stats",
                                                    global_process_set))
        counts = stats[:, :1]
        means, m2s = stats[:, 1:1 + channels], stats[:, 1 + channels:]
        if counts.sum() < 1:
            raise ValueError("SyncBatchNorm got an empty batch on every rank")
        total, g_mean, g_m2 = batch_stats.merge(counts, means, m2s, lambda t: t.sum(0),
                                                torch.div)
        var = g_m2 / total
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(g_mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = g_m2 / max(float(total) - 1, 1.0)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)

        mean_a, invstd = g_mean.to(xf.dtype), torch.rsqrt(var + eps).to(xf.dtype)
        out = (xf - _view(mean_a, x.dim())) * _view(invstd, x.dim())
        if weight is not None:
            out = out * _view(weight.to(xf.dtype), x.dim())
        if bias is not None:
            out = out + _view(bias.to(xf.dtype), x.dim())
        ctx.save_for_backward(x, weight, mean_a, invstd)
        ctx.total = float(total)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, mean, invstd = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        nd, channels = x.dim(), x.shape[1]
        dims = [0] + list(range(2, nd))
        dy = grad_output.contiguous().to(mean.dtype)
        xhat = (x.to(mean.dtype) - _view(mean, nd)) * _view(invstd, nd)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)

        grad_input = None
        if need_input:
            sums = synchronize(allreduce_async(torch.cat([sum_dy, sum_dy_xhat]), op=Sum,
                                               name="sync_batch_norm.grad"))
            mean_dy = sums[:channels] / ctx.total
            mean_dy_xhat = sums[channels:] / ctx.total
            scale = invstd if weight is None else invstd * weight.to(mean.dtype)
            grad_input = ((dy - _view(mean_dy, nd) - xhat * _view(mean_dy_xhat, nd))
                          * _view(scale, nd)).to(x.dtype)
        # Parameter gradients stay local: the optimizer averages them like any other.
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None and need_weight else None
        grad_bias = sum_dy.to(weight.dtype) if weight is not None and need_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None, None
