"""Perseus's errors as the ``tf.errors`` types Horovod's TensorFlow ops raise.

Horovod raises ``tf.errors.FailedPreconditionError`` when ranks disagree about a
collective and ``tf.errors.InvalidArgumentError`` for bad arguments (alltoall splits, a
first dimension that does not divide, a scalar to reducescatter), in eager mode and from
``session.run`` alike. Each class here is that TensorFlow type and Perseus's own
(``HorovodInternalError`` for a mismatch, ``ValueError`` or ``TypeError`` for an
argument), so ``except`` clauses written for either catch it.

Inside a graph (a ``tf.compat.v1`` session, a ``tf.function``) each collective is a
``py_function``, and TensorFlow keeps no ``tf.errors`` code raised there: it maps a
``ValueError`` or ``TypeError`` to ``InvalidArgumentError`` (so argument errors arrive
as Horovod's type) and anything else to ``UnknownError`` with the message (so a
mismatch arrives as ``UnknownError`` naming ``MismatchError``, where Horovod's own op
raises ``FailedPreconditionError``; docs/tensorflow.md, "Differences from Horovod").
"""

import threading

import tensorflow as tf

from perseus import _core
from perseus.common.exceptions import HorovodInternalError


class _Converted:
    """What the classes below share: made from a message alone, and picklable so."""

    def __init__(self, message):
        super().__init__(None, None, message)

    def __reduce__(self):
        return type(self), (self.message,)


class MismatchError(_Converted, tf.errors.FailedPreconditionError, _core.MismatchError):
    """Ranks disagreed about a collective (name, shape, dtype, op or root)."""


class InvalidArgumentError(_Converted, tf.errors.InvalidArgumentError, ValueError):
    """A collective's arguments are wrong (splits, root, shape)."""


class InvalidTypeError(_Converted, tf.errors.InvalidArgumentError, TypeError):
    """A collective got a tensor of a type it cannot take."""


class _Carried:
    """The last ``HorovodInternalError`` raised inside a TensorFlow op. TensorFlow turns
    an exception raised in a ``py_function`` into a ``tf.errors.OpError`` that keeps only
    its text; this keeps the error itself, for :func:`internal_error_behind`."""

    lock = threading.Lock()
    error = None


def forget_internal_error():
    """Drop what an earlier op left in :class:`_Carried`."""
    with _Carried.lock:
        _Carried.error = None


def internal_error_behind():
    """The ``HorovodInternalError`` a collective raised inside a TensorFlow op (the one
    behind a ``tf.errors.OpError`` just caught), or None when none did since the last
    :func:`forget_internal_error`."""
    with _Carried.lock:
        error, _Carried.error = _Carried.error, None
    return error


def as_tf_error(e):
    """``e`` as the ``tf.errors`` type Horovod raises for it, or ``e`` itself."""
    if isinstance(e, (tf.errors.OpError, NotImplementedError)):
        return e
    if isinstance(e, _core.MismatchError):
        return MismatchError(str(e))
    if isinstance(e, HorovodInternalError):
        # Kept as it is (a lost peer, a shut-down engine): elastic code re-forms on it.
        with _Carried.lock:
            _Carried.error = e
    if isinstance(e, ValueError):
        return InvalidArgumentError(str(e))
    if isinstance(e, TypeError):
        return InvalidTypeError(str(e))
    return e
