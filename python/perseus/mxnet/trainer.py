"""``DistributedOptimizer`` (for the Module API and any updater) and ``DistributedTrainer``
(a gluon Trainer): gradients averaged across ranks before each update."""

import mxnet as mx

from perseus.common.gradients import check_optimizer_args
from perseus.common.ops import Average, Sum
from perseus.common.process_sets import global_process_set, process_set_size
from perseus.mxnet.compression import Compression
from perseus.mxnet.mpi_ops import grouped_allreduce_


def _reduce_grads(grads, name, predivide, process_set, compression=Compression.none):
    """Sum ``grads`` in place across the set (prescaled by 1/predivide); the optimizer's
    rescale_grad holds the rest of the average."""
    compressed, ctxs = zip(*[compression.compress(g) for g in grads])
    grouped_allreduce_(list(compressed), op=Sum, prescale_factor=1.0 / predivide,
                       process_set=process_set, gradient=True, name=name)
    for g, c, ctx in zip(grads, compressed, ctxs):
        if c is not g:
            g[:] = compression.decompress(c, ctx)


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wraps an ``mx.optimizer.Optimizer``: each ``update`` first sums the gradient over
    the ranks, and ``rescale_grad`` is divided by the set size, which makes the average.

    Use it with the Module API (``mod.fit(..., optimizer=hvd.DistributedOptimizer(opt),
    kvstore=None)``) or an updater; gluon users take :class:`DistributedTrainer`.
    """

    def __init__(self, optimizer, gradient_predivide_factor=1.0, num_groups=0,
                 process_set=global_process_set):
        check_optimizer_args(Average, gradient_predivide_factor, num_groups)
        self._optimizer = optimizer
        self._predivide = float(gradient_predivide_factor)
        self._process_set = process_set
        self._optimizer.rescale_grad *= self._predivide / process_set_size(process_set)

    def __getattr__(self, item):
        return getattr(self._optimizer, item)

    def create_state(self, index, weight):
        """The wrapped optimizer's state."""
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index, weight):
        """The wrapped optimizer's state."""
        return self._optimizer.create_state_multi_precision(index, weight)

    def _do_allreduce(self, index, grad):
        if process_set_size(self._process_set) == 1:
            return
        if isinstance(index, (tuple, list)):
            _reduce_grads(list(grad), f"DistributedOptimizer.{index[0]}", self._predivide,
                          self._process_set)
        else:
            _reduce_grads([grad], f"DistributedOptimizer.{index}", self._predivide,
                          self._process_set)

    def update(self, index, weight, grad, state):
        """Sum the gradient over the ranks, then the wrapped optimizer's update."""
        self._do_allreduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index, weight, grad, state):
        """Sum the gradient over the ranks, then the wrapped optimizer's update."""
        self._do_allreduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr):
        """Set the wrapped optimizer's learning rate."""
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult):
        """Set the wrapped optimizer's per-parameter learning rate multipliers."""
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult):
        """Set the wrapped optimizer's per-parameter weight decay multipliers."""
        self._optimizer.set_wd_mult(args_wd_mult)


class DistributedTrainer(mx.gluon.Trainer):
    """A gluon ``Trainer`` whose ``step`` averages the gradients over the ranks first.

    Arguments as ``gluon.Trainer`` (no kvstore: Perseus replaces it), plus
    ``compression`` (``Compression.fp16``: float16 on the wire),
    ``gradient_predivide_factor`` (divide before the sum, the rest after it), ``prefix``
    (names of the reductions) and ``process_set``.
    """

    def __init__(self, params, optimizer, optimizer_params=None, compression=Compression.none,
                 gradient_predivide_factor=1.0, prefix=None, num_groups=0,
                 process_set=global_process_set):
        check_optimizer_args(Average, gradient_predivide_factor, num_groups)
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._optimizer
        self._compression = compression
        self._predivide = float(gradient_predivide_factor)
        self._prefix = prefix or "DistributedTrainer."
        self._process_set = process_set
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)

    # The sum over the ranks becomes their average through the optimizer's scale, which
    # gluon reads at each step: it follows the number of ranks, which an elastic job's
    # resets change. gluon's own code sets the scale without the ranks.
    @property
    def _scale(self):
        return self._unscaled * self._predivide / process_set_size(self._process_set)

    @_scale.setter
    def _scale(self, value):
        self._unscaled = value

    def _allreduce_grads(self):
        if process_set_size(self._process_set) == 1:
            return
        grads = [p.list_grad()[0] for p in self._params if p.grad_req != "null"]
        if grads:
            _reduce_grads(grads, f"{self._prefix}grads", self._predivide, self._process_set,
                          self._compression)
