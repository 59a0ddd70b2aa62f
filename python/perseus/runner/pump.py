"""One thread relays the output of every rank a launcher starts, and learns of their
exits, whatever their number: the ranks' pipes and exits wait in one ``select``.

A launcher of a thousand ranks holds no thread per rank. Each rank costs it its two
output pipes and, where the kernel has ``pidfd_open`` (Linux 5.3), one descriptor that
becomes readable when the process ends; elsewhere exits are polled a few times a second.
"""

import contextlib
import os
import selectors
import subprocess
import threading
import time

#: How often processes without a pidfd are asked whether they ended.
POLL_SECONDS = 0.1


class _Stream:
    """One pipe being relayed: its lines go to ``sink`` (under ``lock``) with
    ``prefix`` (and the time, with ``timestamps``), and to ``copy`` (a file) too."""

    def __init__(self, stream, sink, prefix, lock, timestamps, copy, done):
        self.stream, self.sink, self.prefix, self.lock = stream, sink, prefix, lock
        self.timestamps, self.copy, self.done = timestamps, copy, done
        self.partial = b""

    def lines(self, data):
        """Relays the whole lines of ``data`` (after what was left over before)."""
        *whole, self.partial = (self.partial + data).split(b"\n")
        self._emit(whole)

    def end(self):
        """The pipe ended: relays what is left, closes, and says so."""
        if self.partial:
            self._emit([self.partial])
            self.partial = b""
        with contextlib.suppress(OSError):
            self.stream.close()
        if self.copy is not None:
            with contextlib.suppress(OSError):
                self.copy.close()
        self.done.set()

    def _emit(self, lines):
        if not lines:
            return
        stamp = time.asctime().encode() if self.timestamps else b""
        text = b"".join(stamp + self.prefix + line + b"\n" for line in lines)
        if self.copy is not None:
            try:
                self.copy.write(text)
                self.copy.flush()
            except (OSError, ValueError):
                pass  # a full disk: the terminal still gets the lines
        with self.lock:
            try:
                self.sink.write(text)
                self.sink.flush()
            except (OSError, ValueError):
                pass  # the terminal went away: keep draining so the rank never blocks


class _Exit:
    """A process whose end is awaited: ``callback(returncode)`` once it ended."""

    def __init__(self, proc, callback, fd=None):
        self.proc, self.callback, self.fd = proc, callback, fd

    def ended(self):
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
        self.callback(self.proc.wait())


class Pump:
    """The relay thread of a launcher (:func:`pump` gives the process's one)."""

    def __init__(self):
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._todo = []  # registrations, applied by the pump's own thread
        self._polled = []  # _Exit without a pidfd
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = None

    def relay(self, stream, sink, prefix, lock, timestamps=False, copy=None):
        """Relays ``stream``'s lines (a pipe's file object) to ``sink`` under ``lock``,
        each after ``prefix`` (and the time), and to ``copy``, a file closed at the end.
        Returns an event set once the pipe ended and everything was relayed."""
        done = threading.Event()
        s = _Stream(stream, sink, prefix, lock, timestamps, copy, done)
        os.set_blocking(stream.fileno(), False)
        self._add(lambda: self._sel.register(stream.fileno(), selectors.EVENT_READ, s))
        return done

    def watch(self, proc, callback):
        """Calls ``callback(returncode)`` on the pump's thread once ``proc`` (a
        ``subprocess.Popen``) ended. A process a cluster manager runs (anything else
        with a blocking ``wait()``) is waited for on a thread of its own."""
        if not isinstance(proc, subprocess.Popen):
            threading.Thread(target=lambda: callback(proc.wait()), daemon=True).start()
            return
        try:
            fd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            fd = None
        e = _Exit(proc, callback, fd)
        if fd is None:
            self._add(lambda: self._polled.append(e))
        else:
            self._add(lambda: self._sel.register(fd, selectors.EVENT_READ, e))

    def _add(self, todo):
        with self._lock:
            self._todo.append(todo)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="perseusrun-pump",
                                                daemon=True)
                self._thread.start()
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def _run(self):
        while True:
            with self._lock:
                todo, self._todo = self._todo, []
            for t in todo:
                t()
            timeout = POLL_SECONDS if self._polled else None
            for key, _ in self._sel.select(timeout):
                what = key.data
                if what is None:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                elif isinstance(what, _Exit):
                    self._sel.unregister(key.fd)
                    what.ended()
                else:
                    self._read(key.fd, what)
            if self._polled:
                ended = [e for e in self._polled if e.proc.poll() is not None]
                self._polled = [e for e in self._polled if e not in ended]
                for e in ended:
                    e.ended()

    def _read(self, fd, stream):
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            stream.lines(data)
        else:
            self._sel.unregister(fd)
            stream.end()


_PUMP = None
_PUMP_LOCK = threading.Lock()


def pump():
    """The process's pump, started on first use."""
    global _PUMP
    with _PUMP_LOCK:
        if _PUMP is None:
            _PUMP = Pump()
        return _PUMP
