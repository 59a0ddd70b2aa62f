"""The base of the ``DistributedOptimizer`` classes that wrap a ``tf.compat.v1.train``
optimizer: the wrapped optimizer keeps its slots and variables."""

import tensorflow as tf


class WrappedLegacyOptimizer(tf.compat.v1.train.Optimizer):
    """A ``tf.compat.v1.train.Optimizer`` around ``optimizer``, whose slots and variables
    are the wrapped one's."""

    def __init__(self, optimizer, name, use_locking):
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer

    def get_slot(self, *args, **kwargs):
        """The wrapped optimizer's slot."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        """The wrapped optimizer's slot names."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        """The wrapped optimizer's variables."""
        return self._optimizer.variables(*args, **kwargs)
