"""What both kinds of DistributedOptimizer (``tf.compat.v1`` and Keras) share: their
argument checks, the number of backward passes a step accumulates, and the local
aggregation of those passes' gradients."""

import warnings

import tensorflow as tf

from perseus.common import knobs
from perseus.common.basics import config as _config
from perseus.common.gradients import check_optimizer_args


def check_common(op, gradient_predivide_factor, num_groups, groups):
    check_optimizer_args(op, gradient_predivide_factor, num_groups, stacklevel=4)
    if groups is not None and not isinstance(groups, list) and (
            isinstance(groups, bool) or not isinstance(groups, int) or groups < 0):
        raise ValueError("groups should be a non-negative integer or a list of lists of "
                         "tf.Variable.")


def passes_per_step(backward_passes_per_step, average_aggregated_gradients):
    """The effective (passes, average) pair: PERSEUS_ACCUMULATE_N_STEPS=N, when the caller
    left backward_passes_per_step at 1, accumulates N passes and averages them."""
    passes = int(backward_passes_per_step)
    if passes < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
    env = knobs.get("PERSEUS_ACCUMULATE_N_STEPS", _config())
    if passes == 1 and env > 1:
        return env, True
    return passes, bool(average_aggregated_gradients)


_tape_warned = set()


def warn_tape_does_not_accumulate(stacklevel=3):
    """PERSEUS_ACCUMULATE_N_STEPS=N set: say once a process (and an engine generation)
    that a DistributedGradientTape reduces on every ``gradient()`` call all the same: the
    script applies whatever the tape returns, so it has no calls to skip. Returns N, or
    None when the switch is off."""
    from perseus.common.basics import generation

    n = knobs.get("PERSEUS_ACCUMULATE_N_STEPS", _config())
    if n <= 1 or generation() in _tape_warned:
        return None
    _tape_warned.add(generation())
    warnings.warn(f"PERSEUS_ACCUMULATE_N_STEPS={n} acts on DistributedOptimizer only: a "
                  "DistributedGradientTape reduces the gradients of every gradient() call, "
                  "since the loop applies what it returns. Accumulate with "
                  f"hvd.DistributedOptimizer(opt, backward_passes_per_step={n}) instead",
                  RuntimeWarning, stacklevel=stacklevel)
    return n


class LocalAggregation:
    """Gradients summed locally over ``passes`` calls; every ``passes``-th call reduces
    them (averaged over the passes when ``average``) and applies. Works eagerly and in
    graphs (``tf.cond`` on a step counter, the same on every rank)."""

    def __init__(self, passes, average):
        self.passes, self.average = passes, average
        self._acc = None
        self._counter = None
        self._is_step = None

    def _build(self, grads):
        with tf.init_scope():
            self._counter = tf.Variable(0, dtype=tf.int64, trainable=False,
                                        name="perseus_backward_passes")
            self._acc = [None if g is None else
                         tf.Variable(tf.zeros(g.shape, g.dtype), trainable=False,
                                     name="perseus_aggregated_gradient")
                         for g in grads]

    def reduce(self, grads, reduce_fn):
        """Add ``grads`` to the accumulators; on an update call return ``reduce_fn`` of the
        aggregate (other calls return the running aggregate, which is not applied)."""
        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
        if self._acc is None:
            self._build(grads)
        adds = [a.assign_add(g) for a, g in zip(self._acc, grads) if a is not None]
        with tf.control_dependencies(adds):
            count = self._counter.assign_add(1)
        scale = 1.0 / self.passes if self.average else 1.0

        def aggregate():
            return [None if a is None else a.read_value() * tf.cast(scale, a.dtype)
                    for a in self._acc]

        if tf.executing_eagerly():
            self._is_step = int(count) % self.passes == 0
            return reduce_fn(aggregate()) if self._is_step else aggregate()
        self._is_step = tf.equal(count % self.passes, 0)
        present = [i for i, a in enumerate(self._acc) if a is not None]

        def reduced():
            vals = reduce_fn(aggregate())
            return [vals[i] for i in present]

        def running():
            vals = aggregate()
            return [vals[i] for i in present]

        picked = tf.cond(self._is_step, reduced, running)
        out = [None] * len(grads)
        for i, v in zip(present, picked):
            out[i] = v
        return out

    def apply(self, apply_fn, skip_fn=None):
        """Run ``apply_fn`` (and clear the accumulators) on update calls only; on the
        others ``skip_fn`` when given (a Keras optimizer counts every pass in its
        ``iterations``, as Horovod's aggregation does)."""
        def do():
            applied = apply_fn()
            with tf.control_dependencies([] if applied is None else [applied]):
                return tf.group(*[a.assign(tf.zeros_like(a)) for a in self._acc
                                  if a is not None])

        def skip():
            if skip_fn is None:
                return tf.no_op()
            return tf.group(skip_fn())

        if tf.executing_eagerly():
            if self._is_step:
                do()
            elif skip_fn is not None:
                skip_fn()
            return None
        return tf.cond(self._is_step, do, skip)
