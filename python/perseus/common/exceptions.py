"""Exceptions every front-end raises, shared so that user code can catch one type."""

from perseus import _core

#: A collective failed on this rank (mismatched requests, a lost peer, shutdown).
#: Raised by ``synchronize()``; the job can go on with later collectives.
HorovodInternalError = _core.HorovodInternalError

#: Perseus's own name for :data:`HorovodInternalError` (the same class).
PerseusInternalError = HorovodInternalError

#: The ranks disagreed about a collective (its shape, dtype, operation or root); the
#: message names what each rank sent. A :data:`HorovodInternalError`.
MismatchError = _core.MismatchError


#: An operation was submitted under a name that one of this rank's operations still in
#: flight has: a ``ValueError``.
NameInFlightError = _core.NameInFlightError

#: An operation Horovod defines but does not implement for the arguments given (Adasum
#: for a reducescatter): a ``NotImplementedError``, as Horovod raises, and a ``ValueError``.
UnsupportedOperationError = _core.UnsupportedOperationError


class HostsUpdatedInterrupt(RuntimeError):
    """Raised in elastic mode when the set of hosts changed and workers must re-form.

    ``skip_sync`` tells the elastic loop whether state must be synchronized again
    (False when only hosts were added, so that no rank lost its state).
    """

    def __init__(self, skip_sync):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync
