"""The guard of one local rank: ``python -I guard.py GRACE COMMAND...``, started by the
launcher in the rank's own session (process group), runs COMMAND there and exits as it
does.

The launcher's parent-death signal reaches only its own child. Were that child the rank,
a launcher killed with SIGKILL would leave behind whatever the rank started (a data
loader's workers, the rank itself when COMMAND is ``sh -c '...'``). The guard asks for
``DEATH_SIGNAL`` when the launcher dies, and then stops the whole group: SIGTERM, and
SIGKILL GRACE seconds later (the launcher's own grace, job.GRACE_SECONDS). A rank or
child that leaves the group (``setsid``) is out of its reach.

Signals the launcher sends to the group reach COMMAND directly; the guard itself
ignores them and waits. Its exit status is COMMAND's: the same code, or death by the
same signal. It imports only the standard library (``-I``: no site, no PYTHON*
variables), so it adds a few milliseconds to a rank's start.
"""

import ctypes
import os
import signal
import subprocess
import sys
import time

#: What the guard asks to get when its parent, the launcher, dies.
DEATH_SIGNAL = signal.SIGRTMIN + 1
#: prctl's PR_SET_PDEATHSIG.
_PR_SET_PDEATHSIG = 1
# Signals the launcher sends to the whole group: the command handles them.
_PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


def _stop_group(grace):
    """The launcher died: SIGTERM the group, then SIGKILL it (and this guard) after
    ``grace`` seconds."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.killpg(0, signal.SIGTERM)
    except OSError:
        pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.waitpid(-1, os.WNOHANG)  # reap the command so that it reads as gone
        except ChildProcessError:
            pass
        if not _others_in_group():
            os._exit(128 + signal.SIGTERM)
        time.sleep(0.05)
    os.killpg(0, signal.SIGKILL)


def _others_in_group():
    """Whether a process other than this one is in this process group."""
    me, group = os.getpid(), os.getpgrp()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 2 and fields[1] != b"Z" and int(fields[2]) == group:
            return True
    return False


def main(argv):
    if len(argv) < 2:
        print("usage: guard.py GRACE COMMAND...", file=sys.stderr)
        return 2
    grace, argv = float(argv[0]), argv[1:]
    launcher = os.getppid()
    signal.signal(DEATH_SIGNAL, lambda _signum, _frame: _stop_group(grace))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(DEATH_SIGNAL)) != 0 or os.getppid() != launcher:
        return 1  # the launcher is already gone
    for sig in _PASSED_ON:
        signal.signal(sig, signal.SIG_IGN)
    try:
        # In this process group; restore_signals covers only SIGPIPE and the like.
        command = subprocess.Popen(argv, preexec_fn=_default_signals)  # noqa: PLW1509
    except OSError as e:
        print(f"perseusrun: cannot run {argv[0]!r}: {e.strerror or e}", file=sys.stderr)
        return 127 if isinstance(e, FileNotFoundError) else 126
    code = command.wait()
    if code < 0:  # die by the same signal
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


def _default_signals():
    """In the command's process before exec: the default dispositions back, and SIGKILL
    if the guard itself dies (killed on its own, it could stop nothing)."""
    for sig in (*_PASSED_ON, DEATH_SIGNAL):
        signal.signal(sig, signal.SIG_DFL)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
