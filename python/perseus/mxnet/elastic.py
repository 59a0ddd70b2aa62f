"""``hvd.elastic`` for MXNet gluon: training that survives lost workers and takes in new
ones under ``perseusrun --min-np M --max-np X`` (docs/elastic.md). Horovod 0.28 has no
MXNet elastic API; this one follows its PyTorch and TensorFlow ones.

Typical use::

    state = hvd.elastic.MXNetState(net.collect_params(), trainer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.batch in range(state.batch, batches):
            step()
            state.commit()

    train(state)
"""

import mxnet as mx

from perseus.common import basics
from perseus.common.elastic import ObjectState, State, run_fn
from perseus.mxnet.functions import broadcast_object, broadcast_parameters

__all__ = ["MXNetState", "ObjectState", "State", "run"]

def run(func):
    """Decorate ``func(state, ...)`` to run elastically (see
    :func:`perseus.common.elastic.run_fn`)."""
    return run_fn(func, basics.restart)


def _broadcast(obj):
    return broadcast_object(obj, 0, name="elastic.state")


class MXNetState(ObjectState):
    """A gluon model's parameters, a ``Trainer``'s optimizer state (momentum, Adam's
    moments and step counts) and picklable attributes, kept across resets:
    ``commit()`` copies them, ``restore()`` puts the copies back, ``sync()`` sends rank
    0's to every rank.

    ``params``: ``net.collect_params()`` (or a dict of gluon Parameters), with data:
    make the state after the parameters are initialized with their shapes (after a
    first forward pass when their initialization is deferred).
    """

    def __init__(self, params, trainer=None, **kwargs):
        self.params = params
        self.trainer = trainer
        self._values = {}
        self._trainer_state = None
        super().__init__(_broadcast, basics.rank, **kwargs)
        self._save_model()

    def _data(self):
        found = {}
        for name, p in sorted(self.params.items()):
            try:
                found[name] = p.data()
            except mx.gluon.parameter.DeferredInitializationError:
                raise ValueError(
                    f"MXNetState: parameter {name!r} has no data yet (deferred "
                    "initialization): make the state after a first forward pass") from None
        return found

    def _get_trainer_state(self):
        if self.trainer is None:
            return None
        opt = self.trainer._optimizer
        return {"updaters": [u.get_states(dump_optimizer=False)
                             for u in self.trainer._updaters],
                "counts": dict(opt._index_update_count), "num_update": opt.num_update}

    def _set_trainer_state(self, saved):
        if self.trainer is None or saved is None:
            return
        for updater, states in zip(self.trainer._updaters, saved["updaters"]):
            updater.set_states(states)
        opt = self.trainer._optimizer
        opt._index_update_count = dict(saved["counts"])
        opt.num_update = saved["num_update"]
        reset = getattr(self.trainer, "_reset_gradient_state", None)
        if reset is not None:
            reset()

    def _save_model(self):
        self._values = {name: data.asnumpy() for name, data in self._data().items()}
        self._trainer_state = self._get_trainer_state()

    def save(self):
        self._save_model()
        super().save()

    def restore(self):
        for name, p in sorted(self.params.items()):
            p.set_data(mx.nd.array(self._values[name], dtype=self._values[name].dtype))
        self._set_trainer_state(self._trainer_state)
        super().restore()

    def sync(self):
        broadcast_parameters(self.params, root_rank=0, prefix="elastic.")
        self._set_trainer_state(self._broadcast_object(self._get_trainer_state()))
        super().sync()
        self._save_model()  # a new rank's copy is rank 0's, not its own start
