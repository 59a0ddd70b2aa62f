"""``hvd.elastic`` for PyTorch (Horovod 0.28's ``horovod.torch.elastic``): training that
survives lost workers and takes in new ones, under ``perseusrun --min-np M --max-np X``.

Typical use::

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, batches):
                step()
                if state.batch % 10 == 0:
                    state.commit()
            state.batch = 0

    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    train(state)

See docs/elastic.md and perseus.common.elastic for the protocol.
"""

import copy
import math
import random

import torch.utils.data

from perseus.common import basics
from perseus.common.elastic import ObjectState, State, run_fn
from perseus.common.objects import allgather_object, broadcast_object
from perseus.torch.horovod.functions import broadcast_optimizer_state, broadcast_parameters

__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]


def run(func):
    """Decorate ``func(state, ...)`` to run elastically (see
    :func:`perseus.common.elastic.run_fn`)."""
    return run_fn(func, basics.restart)


class TorchState(ObjectState):
    """A model, an optimizer, :class:`ElasticSampler` objects given as keywords, and
    any other picklable attributes (``epoch=0``), kept across resets: ``commit()``
    copies them, ``restore()`` loads the copies back, ``sync()`` sends rank 0's to
    every rank (the new ones too)."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        samplers = {k: v for k, v in kwargs.items() if isinstance(v, ElasticSampler)}
        plain = {k: v for k, v in kwargs.items() if k not in samplers}
        self.model, self.optimizer, self._samplers = model, optimizer, samplers
        for name, sampler in samplers.items():
            setattr(self, name, sampler)
        self._model_saved = self._optimizer_saved = None
        self._samplers_saved = {}
        super().__init__(lambda obj: broadcast_object(obj, 0, name="elastic.state"),
                         basics.rank, **plain)
        self._save_torch()

    def _save_torch(self):
        if self.model is not None:
            self._model_saved = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._optimizer_saved = copy.deepcopy(self.optimizer.state_dict())
        self._samplers_saved = {k: s.state_dict() for k, s in self._samplers.items()}

    def save(self):
        self._save_torch()
        super().save()

    def restore(self):
        if self.model is not None:
            self.model.load_state_dict(self._model_saved)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._optimizer_saved)
        for name, sampler in self._samplers.items():
            sampler.load_state_dict(self._samplers_saved[name])
        super().restore()

    def sync(self):
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for sampler in self._samplers.values():
            sampler.sync()
        super().sync()
        self._save_torch()  # a new rank's copy is rank 0's, not its own start


class ElasticSampler(torch.utils.data.Sampler):
    """Splits a dataset among the ranks of the current round, and skips what any rank
    already processed in this epoch when the ranks change.

    Call ``record_batch(i, batch_size)`` after each batch (``TorchState`` saves it at
    ``commit()``) and ``set_epoch(e)`` at each epoch's start; after a reset the indices
    not yet processed are split again among the new ranks.
    """

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_indices = set()
        self.reset()

    def set_epoch(self, epoch):
        """Start epoch ``epoch``: nothing processed yet, a new shuffle."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Mark this rank's batch ``batch_idx`` (of ``batch_size`` samples) processed."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def get_indices(self, batch_idx, batch_size):
        """The dataset indices of this rank's batch ``batch_idx`` in the current split."""
        start = batch_idx * batch_size
        return self.indices[start:start + batch_size]

    def record_indices(self, indices):
        """Mark dataset ``indices`` processed (a batch that was not a slice of the
        split, for example)."""
        self.processed_indices.update(indices)

    def state_dict(self):
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state):
        self.epoch = state["epoch"]
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def sync(self):
        """Every rank takes the union of what all ranks processed, and rank 0's epoch."""
        processed = set().union(*allgather_object(self.processed_indices,
                                                  name="elastic.sampler.processed"))
        state = broadcast_object(dict(self.state_dict(), processed_indices=processed), 0,
                                 name="elastic.sampler.state")
        self.load_state_dict(state)

    def reset(self):
        """Split the indices left in this epoch among the current ranks."""
        rank = basics.rank() if basics.is_initialized() else 0
        size = basics.size() if basics.is_initialized() else 1
        left = [i for i in range(len(self.dataset)) if i not in self.processed_indices]
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(left)
        self.num_samples = math.ceil(len(left) / size) if left else 0
        total = self.num_samples * size
        padded = left + left[:total - len(left)] if left else []
        self.indices = padded[rank:total:size]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return self.num_samples
