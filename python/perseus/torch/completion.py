"""Futures that Perseus completes: one thread per process waits for collectives in the
order they were handed to it and completes each one's ``torch.futures.Future``. DDP's
hooks and the ``perseus`` backend's ``Work.get_future()`` return such futures, which
torch waits on from C++ (the end of backward) or chains with ``then``."""

import os
import queue
import threading

import torch


class _Completer:
    """One thread that finishes each submission in order: ``finish()`` waits for its
    collectives and returns the value that completes its future (DDP's reduced bucket,
    a Work's output tensors)."""

    def __init__(self):
        self.pid = os.getpid()
        self._queue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="perseus-ddp", daemon=True).start()

    def submit(self, finish, future):
        self._queue.put((finish, future))

    def _run(self):
        while True:
            finish, future = self._queue.get()
            try:
                value = finish()
            except Exception as e:  # noqa: BLE001 - handed to DDP, raised from backward
                future.set_exception(e)
            else:
                future.set_result(value)


_completer = None
_completer_lock = threading.Lock()


def completions():
    """This process's :class:`_Completer` (a new one in a forked child)."""
    global _completer
    with _completer_lock:
        if _completer is None or _completer.pid != os.getpid():
            _completer = _Completer()
        return _completer


def completed(buf, finish):
    """The future a hook returns for bucket ``buf``: Perseus's DDP thread runs
    ``finish()`` (wait for the collectives, return the reduced bucket) and completes it."""
    future = torch.futures.Future(devices=[buf.device] if buf.is_cuda else None)
    completions().submit(finish, future)
    # DDP reads the future from C++, where set_exception's value is no error; a callback
    # that raises it is: backward then raises the collective's error.
    return future.then(_value)


def _value(future):
    return future.value()
