"""``hvd.elastic`` for TensorFlow 2 (Horovod 0.28's ``horovod.tensorflow.elastic``):
training that survives lost workers and takes in new ones, under
``perseusrun --min-np M --max-np X`` (docs/elastic.md).

Typical use::

    @hvd.elastic.run
    def train(state):
        for state.batch in range(state.batch, batches):
            step()
            state.commit()

    state = hvd.elastic.TensorFlowKerasState(model, optimizer, batch=0)
    train(state)
"""

import contextlib
import functools

import tensorflow as tf

from perseus.common import basics
from perseus.common.elastic import ObjectState, State, run_fn
from perseus.common.exceptions import HorovodInternalError
from perseus.common.objects import broadcast_object
from perseus.tensorflow.horovod import errors
from perseus.tensorflow.horovod.functions import broadcast_variables

__all__ = ["ObjectState", "State", "TensorFlowKerasState", "TensorFlowState", "run"]


def run(func):
    """Decorate ``func(state, ...)`` to run elastically (see
    :func:`perseus.common.elastic.run_fn`). A collective's error inside a TensorFlow
    function (``model.fit``'s step) reaches Python as a ``tf.errors.OpError`` that
    carries the ``HorovodInternalError``; it is raised as the latter again, so that the
    ranks re-form."""

    @functools.wraps(func)
    def unwrapped(state, *args, **kwargs):
        with _internal_errors():
            return func(state, *args, **kwargs)

    return run_fn(unwrapped, basics.restart)


@contextlib.contextmanager
def _internal_errors():
    """Raise a ``tf.errors.OpError`` that carries a ``HorovodInternalError`` (a
    collective failed inside a TensorFlow function or a session's run) as the latter."""
    errors.forget_internal_error()
    try:
        yield
    except tf.errors.OpError as e:
        carried = errors.internal_error_behind()
        if carried is None:
            raise
        raise HorovodInternalError(str(carried)) from e


def _broadcast(obj):
    return broadcast_object(obj, 0, name="elastic.state")


class TensorFlowState(ObjectState):
    """Variables and picklable attributes kept across resets: ``commit()`` copies the
    variables' values, ``restore()`` assigns the copies back, ``sync()`` sends rank 0's
    to every rank.

    Eager: ``variables`` are ``tf.Variable`` objects. With ``session`` (a
    ``tf.compat.v1`` session): the variables of its graph (its global variables when
    none are given), read and written through ``session.run``. The ops that do so are
    added to the graph here, so make the state once the variables are initialized and
    before the graph is finalized (before a ``MonitoredTrainingSession``).
    """

    def __init__(self, variables=None, session=None, **kwargs):
        self.session = session
        self._values = []
        if session is None:
            self._variable_list = list(variables or [])
        else:
            with session.graph.as_default():
                self._variable_list = list(variables if variables is not None
                                           else tf.compat.v1.global_variables())
                self._feeds = [tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape)
                               for v in self._variable_list]
                self._assign = tf.group(*[v.assign(feed) for v, feed in
                                          zip(self._variable_list, self._feeds)])
                self._broadcast = broadcast_variables(self._variable_list, root_rank=0)
        super().__init__(_broadcast, basics.rank, **kwargs)
        self._save_variables()

    def _variables(self):
        return self._variable_list

    def _save_variables(self):
        if self.session is not None:
            self._values = self.session.run(self._variable_list)
        else:
            self._values = [v.numpy() for v in self._variables()]

    def save(self):
        self._save_variables()
        super().save()

    def restore(self):
        if self.session is not None:
            self.session.run(self._assign, feed_dict=dict(zip(self._feeds, self._values)))
        else:
            for variable, value in zip(self._variables(), self._values):
                variable.assign(value)
        super().restore()

    def sync(self):
        if self.session is not None:
            with _internal_errors():
                self.session.run(self._broadcast)
        elif self._variables():
            broadcast_variables(self._variables(), root_rank=0)
        super().sync()
        self._save_variables()  # a new rank's copy is rank 0's, not its own start


class TensorFlowKerasState(TensorFlowState):
    """A Keras model, its optimizer (``model.optimizer`` when not given) and picklable
    attributes, kept across resets as :class:`TensorFlowState` keeps variables. The
    optimizer's variables are created here if it has none yet, so that a new rank
    holds the same list as rank 0 to receive its values."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        from perseus.tensorflow.keras_module import build_optimizer

        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer",
                                                                        None)
        if self.optimizer is not None:
            build_optimizer(self.optimizer, model.trainable_variables)
        super().__init__(**kwargs)

    def _variables(self):
        from perseus.tensorflow.keras_module import optimizer_variables

        return list(self.model.variables) + optimizer_variables(self.optimizer)

