"""Elastic training on the worker's side (seed 004; Horovod 0.28's elastic API).

``perseusrun --min-np M --max-np X ...`` (runner/elastic.py) starts workers without
ranks. Each ``init()`` of such a worker takes its place in a *round*: the launcher
publishes each round's table at its rendezvous store (``elastic/round/<k>``: one line
per worker, ``id rank size local_rank local_size cross_rank cross_size``), and the
worker's connections are made under that round's keys (PERSEUS_RENDEZVOUS_SCOPE).

A worker leaves a round by resetting (``shutdown()`` then ``init()``, which
:func:`run` does after an error or a host change) and says so at the store
(``elastic/ready/<k>/<id>``). The launcher publishes the next round once every live
worker of the current one has said so or ended, so a round never waits for a worker
that is gone, and no worker joins a round that still holds a dead one. A worker that
found ranks of the round silent (stopped or frozen, or their host unreachable) names
them there, and the launcher stops them, since they would never say so themselves.

State (:class:`State`, :class:`ObjectState`, the front-ends' subclasses) is what the
training keeps across resets: ``commit()`` saves it and checks for host changes,
``restore()`` rolls back to the last commit after an error, ``sync()`` sends rank 0's
to every rank at the start of each round.
"""

import copy
import functools
import os
import sys
import time
import traceback

from perseus import _core
from perseus import _topology as topology
from perseus.common import knobs
from perseus.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

#: Set to "1" by perseusrun in the workers of an elastic job.
ELASTIC_VAR = "PERSEUS_ELASTIC"

#: Where a worker that failed in a reset callback leaves its traceback for the
#: launcher (``elastic/fatal/<worker id>``), which then stops the job at once.
FATAL_KEY = "elastic/fatal/"

_store = None  # this worker's connection to the launcher's rendezvous store
_round = None  # the round this worker took part in last, and its table's host version
_hosts_version = 0


class RoundTimeout(HorovodInternalError):
    """No round of the job took this worker within PERSEUS_ELASTIC_TIMEOUT."""


def enabled():
    """True in a worker that perseusrun started with ``--min-np``/``--max-np``/
    ``--host-discovery-script`` (an elastic job)."""
    return knobs.text(ELASTIC_VAR) == "1"


def _timeout():
    return knobs.get("PERSEUS_ELASTIC_TIMEOUT")


def _client():
    global _store
    if _store is None:
        where = knobs.rendezvous()
        if where is None:
            raise ValueError("an elastic worker needs perseusrun's rendezvous "
                             "(PERSEUS_RENDEZVOUS_ADDR and PERSEUS_RENDEZVOUS_PORT)")
        _store = _core.RendezvousClient(*where, _timeout())
    return _store


def worker_id():
    """This worker's name in the launcher's tables (``host[slot]``)."""
    wid = knobs.text("PERSEUS_ELASTIC_ID")
    if wid is None:
        raise ValueError("an elastic worker needs its name from perseusrun (PERSEUS_ELASTIC_ID)")
    return wid


def current_round():
    """The round this worker last joined (None before its first)."""
    return _round


def parse_table(text):
    """A round's table: ``{worker id: (rank, size, local_rank, local_size, cross_rank,
    cross_size)}`` and the host version it was made with (its first line)."""
    lines = text.splitlines()
    version = int(lines[0].split()[1])
    places = {}
    for line in lines[1:]:
        wid, *numbers = line.split()
        places[wid] = tuple(int(x) for x in numbers)
    return places, version


#: What a worker leaving a round says at ``elastic/ready/<k>/<id>``: this, or
#: ``silent R ...`` naming the ranks its engine found silent in the round (their pings
#: unanswered for GLOO_TIMEOUT_SECONDS), which the launcher then stops.
READY = b"1"
SILENT = "silent"


def ready_text(silent):
    """The value of a worker's ``elastic/ready`` key, given the ranks it found silent."""
    return f"{SILENT} {' '.join(map(str, silent))}".encode() if silent else READY


def silent_in(text):
    """The ranks a worker's ``elastic/ready`` value names silent (none for ``1``)."""
    words = text.decode(errors="replace").split()
    if words[:1] != [SILENT]:
        return []
    return [int(w) for w in words[1:] if w.isdigit()]


def join():
    """Take this worker's place in the next round that holds it (``init()`` calls it in
    an elastic worker before the core starts): its ranks become the topology
    variables, and its connections are made under the round's keys."""
    global _round, _hosts_version
    store, me = _client(), worker_id()
    if _round is None:
        k = int(knobs.text("PERSEUS_ELASTIC_ROUND") or 0)
    else:
        store.set(f"elastic/ready/{_round}/{me}", ready_text(_core.silent_ranks()))
        k = max(_round + 1, int(store.get("elastic/latest", _timeout())))
    deadline = time.monotonic() + _timeout()
    while True:
        left = deadline - time.monotonic()
        try:
            text = store.get(f"elastic/round/{k}", max(left, 0.0)).decode()
        except HorovodInternalError:
            raise RoundTimeout(
                f"elastic worker {me}: no round of the job took it within "
                f"{_timeout():g} s (PERSEUS_ELASTIC_TIMEOUT)") from None
        places, version = parse_table(text)
        if me in places:
            break
        k += 1  # a round without this worker (the launcher is stopping it): the next
    _round, _hosts_version = k, version
    os.environ.update(topology.variables(**dict(zip(topology.NAMES, places[me]))))
    os.environ["PERSEUS_RENDEZVOUS_SCOPE"] = f"elastic/{k}/"


def start(connect):
    """Join the next round (:func:`join`) and ``connect()`` the core in it; while that
    fails (a worker of the round was lost, or never came, while it formed: the
    launcher then makes the next round), join the next. A worker that no round takes
    (:class:`RoundTimeout`) gives up."""
    while True:
        join()
        try:
            return connect()
        except HorovodInternalError as e:
            print(f"perseus: elastic: worker {worker_id()} could not form round {_round} "
                  f"({e}); joining the next", file=sys.stderr, flush=True)
            if _core.is_initialized():
                _core.shutdown()


def hosts_changed():
    """``None`` when the launcher's hosts are those of this worker's round, else
    ``"added"`` or ``"removed"`` (read from the store; rank 0 asks for everyone)."""
    text = _client().get("elastic/hosts", _timeout()).decode().split()
    version, kind = int(text[0]), text[1]
    return kind if version > _hosts_version else None


class State:
    """What training keeps across the resets of an elastic job.

    Subclasses define ``save()``, ``restore()`` and ``sync()``. ``commit()`` saves and
    then raises :class:`HostsUpdatedInterrupt` on every rank at once when the job's
    hosts changed, so that the ranks re-form with the new ones at a known point.
    """

    def __init__(self, broadcast_object, rank):
        self._broadcast_object = broadcast_object
        self._rank = rank
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Functions called after each reset (the number of ranks may have changed:
        a learning rate scaled by it, a data sampler)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def reset(self):
        """Called after each reset, before the callbacks."""

    def commit(self):
        """Save the state, then check for host changes (which raise
        :class:`HostsUpdatedInterrupt` on every rank)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Raise :class:`HostsUpdatedInterrupt` on every rank when the launcher's hosts
        changed since this round began (rank 0 reads the store and tells the rest)."""
        if not enabled():
            return
        change = hosts_changed() if self._rank() == 0 else None
        change = self._broadcast_object(change)
        if change is not None:
            # Only removed: every rank left holds the same state and needs no sync.
            raise HostsUpdatedInterrupt(skip_sync=change == "removed")

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError


class ObjectState(State):
    """State made of picklable attributes: ``ObjectState(bcast, rank, epoch=0, batch=0)``
    gives ``state.epoch`` and ``state.batch``, saved by ``commit()``, restored by
    ``restore()`` and sent from rank 0 by ``sync()``."""

    def __init__(self, broadcast_object, rank, **kwargs):
        super().__init__(broadcast_object, rank)
        self._saved = copy.deepcopy(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)

    def save(self):
        self._saved = {name: copy.deepcopy(getattr(self, name)) for name in self._saved}

    def restore(self):
        self._load_attributes()

    def _load_attributes(self):
        for name, value in self._saved.items():
            setattr(self, name, copy.deepcopy(value))

    def sync(self):
        if self._saved:
            self._saved = self._broadcast_object(self._saved)
            self._load_attributes()  # only these: a subclass's restore() loads more


def run_fn(func, reset):
    """``func(state, ...)`` run elastically: each round starts with ``state.sync()``; an
    error of a collective (a rank lost) restores the last commit, and a host change
    (:class:`HostsUpdatedInterrupt`) keeps the state as it is; either way ``reset()``
    (perseus.common.basics.restart: ``shutdown()``, then ``init()``) re-forms the ranks
    and ``func`` runs again (perseusrun's ``--reset-limit`` caps
    the number of rounds).

    Unlike Horovod, a round after hosts were only removed syncs too (the interrupt's
    ``skip_sync`` is not used): a data sampler's split must be agreed on again, and a
    sync costs one broadcast of the state."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        while True:
            try:
                state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError:
                state.restore()
            except HostsUpdatedInterrupt:
                pass
            reset()
            try:
                state.on_reset()
            except BaseException:
                _report_fatal(traceback.format_exc())
                raise

    return wrapper


def _report_fatal(text):
    """Leave ``text`` (a traceback) for perseusrun, which stops the job when this worker
    ends; outside an elastic job, or with the launcher gone, there is no one to tell."""
    if not enabled():
        return
    try:
        _client().set(f"{FATAL_KEY}{worker_id()}", text.encode())
    except (HorovodInternalError, OSError, KeyError):
        pass
