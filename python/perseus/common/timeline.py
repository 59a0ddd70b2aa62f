"""Timeline control: a Chrome-trace JSON of every operation (``chrome://tracing``), in
Horovod's layout and names (a row ``<op>.<name>`` per tensor: ``NEGOTIATE_ALLREDUCE``,
``ALLREDUCE``, ...; docs/environment.md lists them), valid JSON on disk while it is
written."""

import os

from perseus import _core
from perseus.common.basics import check_initialized


def start_timeline(file_path, mark_cycles=False):
    """Start writing the timeline to ``file_path`` (replacing a running one).

    Rank 0 writes ``file_path``; rank r > 0 writes ``file_path`` + ``".r"``.

    ``mark_cycles`` also marks each engine cycle. ``PERSEUS_TIMELINE`` (or
    ``HOROVOD_TIMELINE``) starts one at ``init()`` instead.
    """
    check_initialized()
    if not file_path:
        raise ValueError("start_timeline needs a file path")
    _core.start_timeline(os.fspath(file_path), bool(mark_cycles))


def timeline_file(file_path, rank=None):
    """The file rank ``rank`` (this rank when None) writes for the timeline
    ``file_path``: rank 0 ``file_path`` itself, rank r ``file_path`` + ``".r"``."""
    if rank is None:
        check_initialized()
        rank = _core.rank()
    return _core.timeline_path(os.fspath(file_path), int(rank))


def stop_timeline():
    """Stop writing the timeline and close its file."""
    check_initialized()
    _core.stop_timeline()
