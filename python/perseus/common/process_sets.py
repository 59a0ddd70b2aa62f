"""Process sets: subsets of ranks that run collectives among themselves (Horovod 0.28 API)."""

import operator

from perseus import _core

_GLOBAL_ID = 0


class ProcessSet:
    """A set of ranks that runs collectives together.

    Build one from a list of global ranks, then pass it to ``init(process_sets=[...])``
    or to ``add_process_set()``; either assigns ``process_set_id``. Pass it as
    ``process_set=`` to any collective. Only its members may call those.
    """

    process_set_id = None
    ranks = None
    mpi_comm = None
    #: Registered by its members alone (``add_process_set(..., members_only=True)``).
    members_only = False

    def __init__(self, ranks):
        bad = "ProcessSet should be initialized with a list of process ranks"
        try:
            ranks = sorted(ranks)
        except TypeError:
            raise ValueError(bad) from None
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(bad)
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must be distinct, got {ranks}")
        self.ranks = ranks

    def _registered(self):
        return self.process_set_id is not None and _core.is_initialized()

    def size(self):
        """Number of ranks in the set, or None before it is registered."""
        if not self._registered():
            return None
        return len(self.ranks)

    def rank(self):
        """This process's rank within the set; -1 if not a member; None if unregistered."""
        if not self._registered():
            return None
        me = _core.rank()
        return self.ranks.index(me) if me in self.ranks else -1

    def included(self):
        """Whether this process belongs to the set, or None before it is registered."""
        if not self._registered():
            return None
        return _core.rank() in self.ranks

    def invalidate(self):
        """Forget the registration (after removal or shutdown)."""
        self.process_set_id = None

    def __eq__(self, other):
        if not isinstance(other, ProcessSet):
            return NotImplemented
        return self.process_set_id == other.process_set_id and self.ranks == other.ranks

    def __hash__(self):
        return hash(self.process_set_id)

    def __repr__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __str__ = __repr__


#: The set of all ranks (id 0); its ``ranks`` are filled in by ``init()``.
global_process_set = ProcessSet([])
global_process_set.process_set_id = _GLOBAL_ID

_registry = {}  # id -> [ProcessSet, ...] (several objects may name one set)


def _normalize(process_sets):
    """``init()``'s argument as a list of ProcessSet objects (rank lists wrapped)."""
    if process_sets is None or process_sets == "dynamic":
        return []
    if isinstance(process_sets, ProcessSet):
        process_sets = [process_sets]
    sets = [ps if isinstance(ps, ProcessSet) else ProcessSet(ps) for ps in process_sets]
    seen = set()
    for i, ps in enumerate(sets):
        ranks = tuple(sorted(ps.ranks))
        if ranks in seen:  # Horovod's ValueError, raised here before anything starts
            raise ValueError(f"Perseus could not be initialized because process_sets entry "
                             f"number {i} is a duplicate: {ps}")
        seen.add(ranks)
    return sets


def _after_init(sets):
    """Record the ids ``_core.init`` gave (1, 2, ... in order) and the global ranks."""
    global_process_set.ranks = list(range(_core.size()))
    _registry.clear()
    _registry[_GLOBAL_ID] = [global_process_set]
    for pid, ps in enumerate(sets, start=1):
        ps.process_set_id = pid
        _registry.setdefault(pid, []).append(ps)


def _after_shutdown():
    for pid, sets in _registry.items():
        if pid != _GLOBAL_ID:
            for ps in sets:
                ps.invalidate()
    _registry.clear()


def process_set_id(process_set):
    """The core id of ``process_set`` (a ProcessSet or an int id)."""
    if process_set is None:
        return _GLOBAL_ID
    if isinstance(process_set, ProcessSet):
        if process_set.process_set_id is None:
            raise ValueError(
                f"{process_set} is not registered: pass it to init(process_sets=...) or "
                "add_process_set() first (a removed set cannot be used)")
        return process_set.process_set_id
    if isinstance(process_set, int) and not isinstance(process_set, bool):
        return process_set
    raise TypeError(f"process_set must be a ProcessSet, got {type(process_set).__name__}")


def _ranks_of(process_set):
    """The ranks of ``process_set`` (a ProcessSet or an id), in set order."""
    if isinstance(process_set, ProcessSet) and process_set.ranks:
        return list(process_set.ranks)
    return list(_core.process_set_ranks(process_set_id(process_set)))


def process_set_size(process_set):
    """Number of ranks in ``process_set`` (a ProcessSet or an id)."""
    return len(_ranks_of(process_set))


def root_in_set(process_set, root_rank):
    """The index within ``process_set`` of the root ``root_rank``, a rank of the job as
    in Horovod (its ``broadcast`` takes a global root on every set). ``ValueError`` when
    the job or the set has no such rank."""
    try:
        root_rank = operator.index(root_rank)
    except TypeError:
        raise TypeError(f"root_rank must be an int, got {type(root_rank).__name__}") from None
    pid = process_set_id(process_set)
    if pid == _GLOBAL_ID:
        size = _core.size()
        if not 0 <= root_rank < size:
            raise ValueError(f"broadcast root rank {root_rank} is not a rank of the job "
                             f"(0 to {size - 1})")
        return root_rank
    ranks = _ranks_of(process_set)
    if root_rank not in ranks:
        raise ValueError(f"broadcast root rank {root_rank} is not a member of process set "
                         f"{pid} (ranks {ranks}); root_rank is a rank of the job")
    return ranks.index(root_rank)


def set_rank(process_set):
    """This rank's index within ``process_set`` (a ProcessSet or an id); ``ValueError``
    when it is not a member."""
    ranks = _ranks_of(process_set)
    me = _core.rank()
    if me not in ranks:
        raise ValueError(f"this rank is not a member of {process_set}")
    return ranks.index(me)


def add_process_set(process_set, members_only=False):
    """Register a new process set on every rank (a collective: all ranks must call it).

    ``process_set`` is a :class:`ProcessSet` or a list of ranks; returns the
    registered ProcessSet.

    ``members_only=True`` (a Perseus extension, like torch's
    ``new_group(use_local_synchronization=True)``): only the set's own ranks call
    it, a collective over them alone, and the other ranks never learn of the set.
    Such a set stays until shutdown: ``remove_process_set`` refuses it.
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if not _core.is_initialized():
        raise ValueError("Perseus has not been initialized; use hvd.init().")
    ranks = list(process_set.ranks)
    if members_only:
        if _core.rank() not in ranks:
            raise ValueError(f"rank {_core.rank()} cannot add process set {ranks} with "
                             "members_only=True: only its members call it")
        process_set.process_set_id = _core.form_process_set(ranks)
    else:
        process_set.process_set_id = _core.add_process_set(ranks)
    process_set.members_only = bool(members_only)
    _registry.setdefault(process_set.process_set_id, []).append(process_set)
    return process_set


def remove_process_set(process_set):
    """Unregister ``process_set`` on every rank (a collective); returns whether it was removed.

    The global set is never removed. Every ProcessSet object naming the set is
    invalidated.
    """
    pid = process_set.process_set_id
    if pid is None or pid == _GLOBAL_ID:
        return False
    if process_set.members_only:
        raise ValueError(f"{process_set} was added with members_only=True, which the other "
                         "ranks never saw: it stays until shutdown and cannot be removed")
    _core.remove_process_set(pid)
    for ps in _registry.pop(pid, [process_set]):
        ps.invalidate()
    process_set.invalidate()
    return True


def process_sets():
    """The registered process sets, one object per id, in id order."""
    return [sets[0] for _, sets in sorted(_registry.items())]
