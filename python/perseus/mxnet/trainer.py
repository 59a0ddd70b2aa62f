"""``DistributedOptimizer`` (for the Module API and any updater) and ``DistributedTrainer``
(a gluon Trainer): gradients averaged across ranks before each update."""

import mxnet as mx

from perseus.common.gradients import check_optimizer_args
from perseus.common.ops import Average
from perseus.common.process_sets import global_process_set, process_set_size
from perseus.mxnet.compression import Compression
from perseus.mxnet.gradients import Accumulator, GradientReducer

# DistributedOptimizer asks MXNet's Updater for every parameter of a dtype in one call.
_WHOLE_STEP = 1 << 30


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wraps an ``mx.optimizer.Optimizer``: each ``update`` first sums the gradient over
    the ranks, and ``rescale_grad`` is divided by the set size, which makes the average.

    Use it with the Module API (``mod.fit(..., optimizer=hvd.DistributedOptimizer(opt),
    kvstore=None)``) or an updater; gluon users take :class:`DistributedTrainer`.

    MXNet's ``Updater`` hands it every parameter of a dtype in one call (see
    :attr:`aggregate_num`), so a step's gradients are reduced as one group, and the
    PERSEUS_* gradient switches act on the whole step (docs/mxnet.md).
    """

    def __init__(self, optimizer, gradient_predivide_factor=1.0, num_groups=0,
                 process_set=global_process_set):
        check_optimizer_args(Average, gradient_predivide_factor, num_groups)
        self._optimizer = optimizer
        self._predivide = float(gradient_predivide_factor)
        self._process_set = process_set
        self._optimizer.rescale_grad *= self._predivide / process_set_size(process_set)
        self._reducer = GradientReducer("DistributedOptimizer", self._predivide, process_set)
        self._accumulator = Accumulator(self._reducer.accumulate)

    def __getattr__(self, item):
        return getattr(self._optimizer, item)

    @property
    def aggregate_num(self):
        """How many parameters MXNet's ``Updater`` passes to one ``update`` call: all of a
        dtype's, so that a step's gradients are reduced together and the NaN check
        decides for the whole step. The wrapped optimizer still receives them in chunks
        of its own ``aggregate_num`` (one by one when that is 0)."""
        return _WHOLE_STEP

    @aggregate_num.setter
    def aggregate_num(self, value):
        self._optimizer.aggregate_num = value

    def create_state(self, index, weight):
        """The wrapped optimizer's state."""
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index, weight):
        """The wrapped optimizer's state."""
        return self._optimizer.create_state_multi_precision(index, weight)

    def _name(self, index):
        names = getattr(self._optimizer, "idx2name", None) or {}
        return str(names.get(index, index))

    def _step(self, index, weight, grad, state, multi_precision):
        """Accumulate (PERSEUS_ACCUMULATE_N_STEPS), sum over the ranks, then the wrapped
        optimizer's update of the parameters that are due."""
        listed = isinstance(index, (list, tuple))
        indices, weights, grads, states = ((list(index), list(weight), list(grad), list(state))
                                           if listed else ([index], [weight], [grad], [state]))
        due = [i for i in range(len(indices)) if self._accumulator.add(indices[i], grads[i])]
        if not due:
            return
        self._reducer.reduce([self._name(indices[i]) for i in due], [grads[i] for i in due],
                             group=f"DistributedOptimizer.{indices[due[0]]}")
        apply = (self._optimizer.update_multi_precision if multi_precision
                 else self._optimizer.update)
        if not listed:
            apply(index, weight, grad, state)
        else:
            chunk = self._optimizer.aggregate_num
            if chunk > 0:
                for at in range(0, len(due), chunk):
                    part = due[at:at + chunk]
                    apply([indices[i] for i in part], [weights[i] for i in part],
                          [grads[i] for i in part], [states[i] for i in part])
            else:
                for i in due:
                    apply(indices[i], weights[i], grads[i], states[i])
        self._reducer.step_done()

    def update(self, index, weight, grad, state):
        """Sum the gradient over the ranks, then the wrapped optimizer's update."""
        self._step(index, weight, grad, state, multi_precision=False)

    def update_multi_precision(self, index, weight, grad, state):
        """Sum the gradient over the ranks, then the wrapped optimizer's update."""
        self._step(index, weight, grad, state, multi_precision=True)

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

    The PERSEUS_* gradient switches apply (docs/mxnet.md): with
    PERSEUS_ACCUMULATE_N_STEPS=N only every N-th ``step`` communicates and updates, with
    the average of the N gradients; with PERSEUS_ALLREDUCE_NANCHECK=1 a NaN or Inf in the
    reduced gradients raises ``FloatingPointError`` on every rank and the weights stay
    as they were.
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
        self._reducer = GradientReducer(self._prefix.rstrip(".") or "DistributedTrainer",
                                        self._predivide, process_set, compression)
        self._accumulator = Accumulator(self._reducer.accumulate)
        self._holding = False
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)

    def _allreduce_grads(self):
        params = [(i, p) for i, p in enumerate(self._params) if p.grad_req != "null"]
        grads = [p.list_grad()[0] for _, p in params]
        # PERSEUS_ACCUMULATE_N_STEPS: every parameter is at the same count.
        due = [self._accumulator.add(i, g) for (i, _), g in zip(params, grads)]
        self._holding = not all(due)
        if not self._holding:
            # The reduction itself makes the sum an average, with the set's size at this
            # step (an elastic job's resets change it). The Trainer's ``_scale`` stays
            # gluon's: mxnet.contrib.amp divides it by the loss scale and amp.unscale
            # sets it to 1, and each must act once.
            self._reducer.reduce([p.name for _, p in params], grads,
                                 postscale=self._predivide / process_set_size(self._process_set))

    def _update(self, ignore_stale_grad=False):
        if self._holding:  # a step that only accumulated
            self._holding = False
            return
        super()._update(ignore_stale_grad)
        self._reducer.step_done()

    def _reset_gradient_state(self):
        """Forget accumulated gradients and down-sampling residuals (elastic restore)."""
        self._accumulator.reset()
        self._reducer.reset()
        self._holding = False
