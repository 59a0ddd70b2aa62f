"""Reduce ops, handles, and the framework-neutral submission of every collective.

A front-end turns its tensors into DLPack capsules and calls the functions here;
each returns a :class:`Handle` that keeps the tensors and capsules alive until the
core is done with them. ``finish`` callbacks turn the raw results (output capsules,
received splits) into framework tensors when the handle is waited on.
"""

import numbers
import time
import warnings

from perseus import _core
from perseus.common import flight_recorder
from perseus.common.process_sets import process_set_id, root_in_set

Average = _core.OP_AVERAGE
Sum = _core.OP_SUM
Adasum = _core.OP_ADASUM
Min = _core.OP_MIN
Max = _core.OP_MAX
Product = _core.OP_PRODUCT

_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
             Product: "Product"}

# Handles whose operation may still touch memory: kept here so that dropping a
# handle without synchronizing can never free a buffer the engine writes to.
_inflight = {}


def check_op(op):
    """Validate a reduce op (Adasum, for allreduce, takes floating tensors: the core says
    so for others)."""
    if isinstance(op, bool) or op not in _OP_NAMES:
        raise ValueError(f"unknown reduce op {op!r}; use Average, Sum, Adasum, Min, Max or "
                         "Product")
    return int(op)


def resolve_op(op, average):
    """Horovod's handling of the deprecated ``average`` argument: returns the op to use."""
    if op is not None:
        if average is not None:
            raise ValueError(
                "The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


class Handle:
    """One asynchronous collective. ``wait()`` (or ``synchronize(handle)``) gives its result.

    ``keep`` holds whatever must outlive the operation (tensors, capsules);
    ``finish(handle)`` computes the result once the core is done, using
    :meth:`output`, :meth:`recv_splits` and :meth:`join_result`. Calling the
    handle is the same as ``wait()``.
    """

    __slots__ = ("__weakref__", "_done", "_error", "_finish", "_id", "_keep", "_out",
                 "_result")

    def __init__(self, core_id, keep=(), finish=None):
        self._id = core_id
        self._keep = keep
        self._finish = finish
        self._done = False
        self._result = None
        self._error = None
        self._out = (None, (), 0)
        _inflight[id(self)] = self

    def poll(self):
        """True once the operation finished (successfully or not); never blocks."""
        return self._done or _core.poll(self._id)

    def wait(self, timeout=None):
        """Block until done and return the result; raise the operation's error. With
        ``timeout`` (seconds), ``TimeoutError`` once it passed: the operation is still
        in flight, and a later ``wait()`` gives its result."""
        if not self._done:
            try:
                self._out = (_core.wait(self._id) if timeout is None else
                             _core.wait(self._id, timeout))
                self._result = self._finish(self) if self._finish is not None else None
            except (KeyboardInterrupt, TimeoutError):
                raise  # still in flight: keep everything alive
            except Exception as e:  # noqa: BLE001 - stored and re-raised below
                self._error = e
                if isinstance(e, _core.HorovodInternalError):
                    flight_recorder.on_failure(e)
            self._done = True
            self._keep = self._finish = None
            self._out = (None, (), 0)
            _inflight.pop(id(self), None)
        if self._error is not None:
            raise self._error
        return self._result

    __call__ = wait

    def _abandon(self):
        """``shutdown()`` came while this operation was pending."""
        if not self._done:
            self._error = _core.HorovodInternalError(
                f"this operation (handle {self._id}) was still pending when shutdown() was "
                "called, so it did not complete: wait for every handle (hvd.synchronize) "
                "before shutdown()")
            self._done = True
            self._keep = self._finish = None

    def output(self):
        """The output capsule the core allocated (inside ``finish`` only, once)."""
        capsule, splits, value = self._out
        self._out = (None, splits, value)
        return capsule

    def recv_splits(self):
        """Rows received from each rank (allgather, alltoall; inside ``finish`` only)."""
        return list(self._out[1])

    def join_result(self):
        """The last rank to join (join; inside ``finish`` only)."""
        return self._out[2]

    def __repr__(self):
        state = "done" if self._done else "in flight"
        return f"<perseus Handle {self._id} {state}>"


class GroupHandle:
    """Several handles waited on as one; the result is ``finish([results])`` (or the list)."""

    __slots__ = ("__weakref__", "_done", "_error", "_finish", "_handles", "_result")

    def __init__(self, handles, finish=None):
        self._handles = list(handles)
        self._finish = finish
        self._done = False
        self._result = None
        self._error = None

    def poll(self):
        """True once every operation finished."""
        return self._done or all(h.poll() for h in self._handles)

    def wait(self, timeout=None):
        """Wait for all (even after a failure) and return the combined result; with
        ``timeout`` (seconds for all of them), ``TimeoutError`` once it passed."""
        if not self._done:
            results, error = [], None
            deadline = None if timeout is None else time.monotonic() + timeout
            for h in self._handles:
                try:
                    results.append(h.wait() if deadline is None else
                                   h.wait(max(0.0, deadline - time.monotonic())))
                except (KeyboardInterrupt, TimeoutError):
                    raise
                except Exception as e:  # noqa: BLE001 - first error re-raised below
                    error = error or e
            if error is None:
                try:
                    self._result = self._finish(results) if self._finish else results
                except Exception as e:  # noqa: BLE001
                    error = e
            self._error, self._done = error, True
            self._finish = None
        if self._error is not None:
            raise self._error
        return self._result

    __call__ = wait

    def __repr__(self):
        return f"<perseus GroupHandle of {len(self._handles)}>"


def _before_shutdown():
    """Collects the results of the operations that finished but were not waited on, so
    that ``wait()`` still gives them after ``shutdown()``."""
    for handle in list(_inflight.values()):
        if _core.poll(handle._id):
            try:
                handle.wait()
            except Exception:  # noqa: BLE001, S110 - kept in the handle, raised by its wait()
                pass


def _after_shutdown():
    """The engine is gone: nothing can write to kept memory any more, and what was still
    in flight never completes: its ``wait()`` says so (as Horovod's does), instead of
    asking a later engine about a number that may by then be another operation's."""
    for handle in list(_inflight.values()):
        handle._abandon()
    _inflight.clear()


#: Outputs of at least this many bytes are worth taking from :func:`empty_like`.
POOL_MIN_BYTES = _core.POOL_MIN_BYTES


def empty_like(capsule):
    """A new contiguous host tensor (as a capsule) shaped and typed like ``capsule``'s,
    from the core's pool of memory already faulted in; it returns there when the
    framework frees it. Contents unspecified: for outputs the caller overwrites."""
    return _core.empty_like(capsule)


#: Copies of at least this many bytes are worth :func:`copy_into` (written past the
#: cache); smaller results stay in cache for their reader.
STREAM_FROM = _core.STREAM_FROM


def copy_into(dst, src):
    """Copies host capsule ``src`` into ``dst`` (same size, no overlap) without the
    GIL, writing a result of :data:`STREAM_FROM` bytes or more past the cache."""
    _core.copy_into(dst, src)


def copy_result(host, nbytes, capsules, framework_copy):
    """Copies a result of ``nbytes`` the way that suits its size, the one place a
    front-end decides it: a host result of :data:`STREAM_FROM` bytes or more through
    :func:`copy_into` (``capsules()`` gives its ``(dst, src)``), anything else by
    ``framework_copy()``, which serves devices and leaves a small result in cache."""
    if host and nbytes >= STREAM_FROM:
        copy_into(*capsules())
    else:
        framework_copy()


def _prepare(name, process_set):
    # No check_initialized() here: the core raises the same ValueError, and this is
    # the per-tensor hot path.
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str or None, got {type(name).__name__}")
    return process_set_id(process_set)


def allreduce_async(inp, out, *, name=None, op=Average, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=None, keep=(), finish=None, gradient=False,
                    blocking=False):
    """Reduce capsule ``inp`` into ``out`` (may be the same capsule) across the set.

    ``gradient``: a gradient reduction, which travels as PERSEUS_ALLREDUCE_DTYPE says.
    ``blocking``: the caller waits for the handle at once, so a small allreduce may
    complete before this returns (PERSEUS_LANE_BYTES).
    """
    hid = submit_allreduce(inp, out, name, op, prescale_factor, postscale_factor, process_set,
                           gradient, blocking)
    return Handle(hid, (keep, inp, out), finish)


def submit_allreduce(inp, out, name, op, prescale_factor, postscale_factor, process_set,
                     gradient=False, blocking=False, now=False):
    """The core's handle of an allreduce of capsule ``inp`` into ``out``: the bare
    :func:`allreduce_async`, for a front-end that makes its own :class:`Handle`. ``now``
    (with ``blocking``): None when it ran among the callers and is done."""
    ps = _prepare(name, process_set)
    return _core.allreduce(inp, out, name, check_op(op), float(prescale_factor),
                           float(postscale_factor), ps, gradient, blocking, now)


def allreduce_now(inp, out, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                  process_set=None, keep=()):
    """:func:`allreduce_async` with ``blocking`` and the wait in one call, without a
    :class:`Handle`: the path of a lone small allreduce, whose own time is a few
    microseconds (PERSEUS_LANE_BYTES). Raises the operation's error as ``wait()`` does."""
    hid = submit_allreduce(inp, out, name, op, prescale_factor, postscale_factor, process_set,
                           blocking=True, now=True)
    if hid is not None:  # else it ran among the callers and is done
        _wait_now(hid, (keep, inp, out))


def _wait_now(hid, keep):
    """The core's ``(output, splits, value)`` for ``hid``, waited for by a ``*_now``
    call (which made no :class:`Handle`): raises as ``wait()`` does, and an operation
    left in flight by an interrupt keeps ``keep`` alive in a handle of its own."""
    try:
        return _core.wait(hid)
    except (KeyboardInterrupt, TimeoutError):
        Handle(hid, keep)
        raise
    except _core.HorovodInternalError as e:
        flight_recorder.on_failure(e)
        raise


def allgather_async(inp, *, name=None, stack=False, process_set=None, keep=(), finish=None,
                    out=None, blocking=False):
    """Concatenate ``inp`` along dim 0 across the set (``stack``: equal shapes required).
    ``out``: a host buffer of the result's size that receives it (the handle's output
    is then None); of another size, the result is the core's own as without it.
    ``blocking``: as for :func:`allreduce_async`."""
    ps = _prepare(name, process_set)
    return Handle(_core.allgather(inp, name, bool(stack), ps, out, blocking), (keep, inp, out),
                  finish)


def allgather_now(inp, name=None, stack=False, process_set=None, keep=()):
    """:func:`allgather_async` with ``blocking`` and the wait in one call, without a
    :class:`Handle`: the capsule of the result (the core's own). Raises the operation's
    error as ``wait()`` does."""
    ps = _prepare(name, process_set)
    hid = _core.allgather(inp, name, bool(stack), ps, None, True)
    return _wait_now(hid, (keep, inp))[0]


def broadcast_async(buf, *, root_rank, name=None, process_set=None, keep=(), finish=None,
                    blocking=False):
    """Overwrite ``buf`` with the root's: ``root_rank`` is a rank of the job, which must
    belong to the set (the core counts it within the set). ``blocking``: as for
    :func:`allreduce_async`."""
    ps = _prepare(name, process_set)
    root = root_in_set(process_set, root_rank)
    return Handle(_core.broadcast(buf, name, root, ps, blocking), (keep, buf), finish)


def alltoall_async(inp, *, splits=None, name=None, process_set=None, keep=(), finish=None,
                   out=None, blocking=False):
    """Send ``splits[i]`` rows of ``inp`` to set rank i; receive the others' rows
    (``out``: as for :func:`allgather_async`; ``blocking``: as for
    :func:`allreduce_async`)."""
    ps = _prepare(name, process_set)
    if splits is not None:
        splits = list(splits)
        if not all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in splits):
            raise TypeError(f"alltoall splits must be integers (rows for each rank), got "
                            f"{splits}")
        splits = [int(s) for s in splits]
        if any(s < 0 for s in splits):
            raise ValueError(f"alltoall splits must be non-negative, got {splits}")
    return Handle(_core.alltoall(inp, splits, name, ps, out, blocking), (keep, inp, out), finish)


def reducescatter_async(inp, *, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                        process_set=None, keep=(), finish=None, out=None, blocking=False):
    """Reduce ``inp`` across the set; each rank receives its block of dim-0 rows
    (``out``: as for :func:`allgather_async`; ``blocking``: as for
    :func:`allreduce_async`)."""
    ps = _prepare(name, process_set)
    op = check_op(op)
    hid = _core.reducescatter(inp, name, op, float(prescale_factor), float(postscale_factor), ps,
                              out, blocking)
    return Handle(hid, (keep, inp, out), finish)


def barrier_async(process_set=None):
    """Start a barrier over the set; the handle completes once every rank reached it."""
    ps = _prepare(None, process_set)
    return Handle(_core.barrier(ps))


def barrier(process_set=None):
    """Block until every rank of the set reached the barrier."""
    barrier_async(process_set).wait()


def join(process_set=None):
    """Stop contributing (zeros go to others' allreduces) until all joined; last joiner's rank."""
    ps = _prepare(None, process_set)
    return Handle(_core.join(ps), finish=Handle.join_result).wait()
