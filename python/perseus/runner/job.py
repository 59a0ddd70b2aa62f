"""Run the ranks of one job: spawn them, relay their output, tear the job down.

Every rank starts in its own session (process group), local ones under a guard
(guard.py) that stops the group if the launcher dies. When one rank exits non-zero
or dies by a signal, a rank does not check in at the rendezvous within the start
timeout, or the launcher gets SIGINT/SIGTERM, every group gets SIGTERM, then SIGKILL
after a grace period, so no process outlives the job.
"""

import contextlib
import errno
import functools
import json
import math
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

from perseus.common import flight_recorder
from perseus.runner import pump as _pump

GRACE_SECONDS = 5.0
#: How long the launcher waits, after SIGKILL, for a rank's group to empty before it
#: exits: a killed process with much memory (or a stopped one) takes a moment to go.
KILL_WAIT_SECONDS = 5.0
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# The launcher's exit status when ranks did not check in within the start timeout.
START_TIMEOUT_STATUS = 1

# Variables of the launcher's environment a remote rank does not get: the secret (sent on
# stdin), and those that describe the launcher's own shell and host, not the job.
_LOCAL_ONLY_NAMES = frozenset(
    ("PERSEUS_SECRET", "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_"))
_LOCAL_ONLY_PREFIXES = ("BASH_FUNC_", "SSH_")


def forwarded_env(environ):
    """The part of the launcher's environment a remote rank gets, as under Horovod: all of
    it (PATH, LD_LIBRARY_PATH, the frameworks' variables...) but the secret and what
    describes the launcher's shell and host (``HOSTNAME``, ``PWD``, ``SSH_*``...)."""
    return {k: v for k, v in environ.items()
            if k not in _LOCAL_ONLY_NAMES and not k.startswith(_LOCAL_ONLY_PREFIXES)
            and k.isprintable() and "=" not in k and k}


def remote_script(command, env, cwd, prelude=""):
    """The shell script a remote host runs for one rank.

    The secret comes as the first line of stdin, so it appears on no command line.
    The rest of stdin stays open for the life of the job: when it closes (the launcher
    or the remote shell connection went away) the rank gets SIGTERM, then SIGKILL. Where
    the host has ``setsid`` (util-linux) the rank runs in its own process group and the
    signals go to the whole group: the children it started, a shell it runs under.
    ``prelude``: shell run first on the remote host (variables computed there).
    """
    assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items()))
    run = f"env {assignments} {shlex.join(command)}" if assignments else shlex.join(command)
    return (
        "IFS= read -r PERSEUS_SECRET; export PERSEUS_SECRET; "
        f"{prelude}cd {shlex.quote(cwd)} || exit 127; exec 3<&0; "
        # A background job is no group leader, so setsid runs the rank in place: $p is
        # the rank and the leader of its own group, -$p the group.
        "if command -v setsid >/dev/null 2>&1; then s=setsid g=-; else s= g=; fi; "
        f"$s {run} & p=$!; "
        # The watchdog outlives the signals a local rsh (ip netns exec) passes on to
        # this shell's group, which no longer reach the rank's: stdin's end stops it.
        "{ trap '' TERM INT HUP; cat <&3 >/dev/null 2>&1; kill -TERM $g$p; "
        f"sleep {GRACE_SECONDS:g}; kill -KILL $g$p; }} >/dev/null 2>&1 & w=$!; "
        "wait $p; rc=$?; kill -KILL $w 2>/dev/null; exit $rc"
    )


def rsh_argv(prefix, host, script):
    """The local command that runs ``script`` on ``host`` through the rsh prefix.

    ``{host}`` in the prefix is replaced by the host; without it the host is appended.
    An ``ssh`` prefix gets the script as one argument (ssh hands it to the remote
    shell); any other prefix (``ip netns exec {host}``, ``docker exec {host}``) is
    followed by ``sh -c SCRIPT``.
    """
    words = shlex.split(prefix)
    if not words:
        raise ValueError("the rsh prefix is empty")
    if any("{host}" in w for w in words):
        words = [w.replace("{host}", host) for w in words]
    else:
        words.append(host)
    if os.path.basename(words[0]) == "ssh":
        return words + [script]
    return words + ["sh", "-c", script]


def _parent_death_signal(sig=signal.SIGKILL):
    """A ``preexec_fn`` (Linux): the child gets ``sig`` if the launcher dies abruptly."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    launcher = os.getpid()

    def set_signal():
        prctl(1, sig)  # PR_SET_PDEATHSIG
        if os.getppid() != launcher:  # the launcher died before prctl
            os._exit(1)

    return set_signal


def guarded(argv):
    """A local rank's command under its guard (guard.py): if the launcher dies, the guard
    stops the rank's whole process group, children and shells included."""
    guard = os.path.join(os.path.dirname(os.path.abspath(__file__)), "guard.py")
    return [sys.executable, "-I", guard, str(GRACE_SECONDS), *argv]


def raise_open_files():
    """Raises the soft limit on open files to the hard one, as MPI launchers do: the
    launcher holds a few pipes for each rank it starts."""
    try:
        import resource
    except ImportError:  # not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def open_files_text():
    """``the open-file limit is N (hard limit M; ulimit -n)``, for messages."""
    import resource

    def text(v):
        return "unlimited" if v == resource.RLIM_INFINITY else str(v)

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return f"the open-file limit is {text(soft)} (hard limit {text(hard)}; ulimit -n)"


def start_error(err):
    """Why a rank could not be started (an OSError of Popen), naming the open-file limit
    when that is what ran out (by its errno)."""
    why = err.strerror or str(err)
    if err.errno == errno.EMFILE or err.errno == errno.ENFILE:
        why = f"{why}: {open_files_text()}"
    return why


def describe_status(code):
    """``exit code N`` or ``signal NAME`` for a Popen return code."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def exit_status(code):
    """The launcher's exit status for a rank's Popen return code."""
    return 128 - code if code < 0 else code


def mesh_rank(key, scope=""):
    """The rank whose check-in ``key`` is under ``scope`` (``<scope>mesh/<rank>``, or
    ``<scope>mesh/<rank>/<generation>`` after a re-init), else None."""
    head = f"{scope}mesh/"
    if not key.startswith(head):
        return None
    rank = key[len(head):].split("/", 1)[0]
    return int(rank) if rank.isdigit() else None


#: The key under which a rank of perseus.run checks in when its task starts
#: (``<TASK_CHECKIN><rank>``): its function may take its time to reach hvd.init(), if ever.
TASK_CHECKIN = "perseus.run/started/"


def checked_in_ranks(keys):
    """The ranks that published ``mesh/<rank>`` at the rendezvous (their init() began) or
    started a perseus.run task (``TASK_CHECKIN``)."""
    ranks = {r for r in map(mesh_rank, keys) if r is not None}
    tasks = (k[len(TASK_CHECKIN):] for k in keys if k.startswith(TASK_CHECKIN))
    return ranks | {int(r) for r in tasks if r.isdigit()}


def describe_ranks(slots):
    """``rank 1 (host a)``, ``ranks 2, 3 (host b)``: ranks grouped by host, in rank order."""
    by_host = {}
    for s in sorted(slots, key=lambda s: s.rank):
        by_host.setdefault(s.hostname, []).append(s.rank)
    return ", ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} (host {host})"
        for host, ranks in by_host.items())


class StartWatch:
    """Whether every rank checked in at the rendezvous within the start timeout.

    ``checked_in()`` returns the ranks seen so far (from the rendezvous server's keys).
    A rank that already ended without error counts as started, unless another rank
    checked in meanwhile: that one waits in ``hvd.init()`` for a rank that will never
    come, and the job fails at once naming the rank that left. ``check()`` returns None
    while all is well (or once every rank checked in) and the failure message once the
    timeout passed with ranks missing.
    """

    def __init__(self, slots, checked_in, timeout, clock=time.monotonic):
        self.slots, self.checked_in, self.timeout = list(slots), checked_in, timeout
        self.clock = clock
        self.deadline = clock() + timeout
        self.done = False

    def check(self, finished=()):
        if self.done:
            return None
        seen, finished = set(self.checked_in()), set(finished)
        left = [s for s in self.slots if s.rank in finished and s.rank not in seen]
        waiting = [s for s in self.slots if s.rank in seen and s.rank not in finished]
        if left and waiting:
            # hvd.init() waits for every rank: these never come.
            return (f"{describe_ranks(left)} exited without error before reaching "
                    f"hvd.init(), while {describe_ranks(waiting)} wait"
                    f"{'s' if len(waiting) == 1 else ''} there for "
                    f"{'it' if len(left) == 1 else 'them'}; stopping the job")
        missing = [s for s in self.slots if s.rank not in seen | finished]
        if not missing:
            self.done = True
            return None
        if self.clock() < self.deadline:
            return None
        return (f"{describe_ranks(missing)} did not check in at the rendezvous within "
                f"{self.timeout:g} s (--start-timeout): the host may be unreachable, the "
                "remote shell stuck, or the program slow to reach hvd.init() (then raise "
                "--start-timeout); stopping the job")


def output_dir_name(rank, size):
    """The directory of a rank's output files under ``--output-filename`` (horovodrun's):
    ``rank.<R>``, R zero-padded to the width of ``size - 1`` (``rank.0`` for one rank)."""
    return f"rank.{str(rank).zfill(len(str(max(size - 1, 0))))}"


class Rank:
    """One rank's process, its output relay and its process group. ``timestamps``: each
    relayed line starts with the time it was relayed, as ``time.asctime()`` writes it
    (horovodrun's ``--prefix-output-with-timestamp``)."""

    def __init__(self, slot, argv, env, secret=None, remote=False, timestamps=False):
        self.slot, self.argv, self.env = slot, argv, env
        self.secret, self.remote, self.timestamps = secret, remote, timestamps
        self.proc = None
        self._relayed = []  # one event per output pipe, set once it is all relayed

    def _open_files(self, output_dir, size):
        """``{"stdout": file, "stderr": file}`` in ``output_dir``/rank.<R>/ (made if
        needed), as horovodrun writes them."""
        where = os.path.join(output_dir, output_dir_name(self.slot.rank, size))
        os.makedirs(where, exist_ok=True)
        files = {}
        try:
            for tag in ("stdout", "stderr"):
                files[tag] = open(os.path.join(where, tag), "wb")  # noqa: SIM115
        except OSError:
            for f in files.values():
                f.close()
            raise
        return files

    def start(self, out, err, lock, output_dir=None, size=None):
        """Start the rank; its lines go to ``out`` and ``err`` prefixed with
        ``[R]<stdout>:``/``[R]<stderr>:``, and, with ``output_dir``, the same lines to
        ``output_dir``/rank.<R>/stdout and stderr too (R padded to the width of
        ``size - 1``; ``size``: the slot's, else 1). The launcher's one relay thread
        (:func:`perseus.runner.pump.pump`) closes the files."""
        size = size or getattr(self.slot, "size", None) or 1
        if not self.remote and shutil.which(self.argv[0], path=self.env.get("PATH")) is None:
            # What Popen would say without the guard in between.
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), self.argv[0])
        files = self._open_files(output_dir, size) if output_dir else {}
        try:
            # The preexec_fn only calls prctl, getppid and _exit: no lock another thread
            # holds.
            self.proc = subprocess.Popen(
                self.argv if self.remote else guarded(self.argv), env=self.env,
                start_new_session=True,
                preexec_fn=_parent_death_signal(),  # noqa: PLW1509
                stdin=subprocess.PIPE if self.remote else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except BaseException:
            for f in files.values():
                f.close()
            raise
        if self.remote:
            self.proc.stdin.write(self.secret.encode() + b"\n")
            self.proc.stdin.flush()
        for stream, sink, tag in ((self.proc.stdout, out, "stdout"),
                                  (self.proc.stderr, err, "stderr")):
            prefix = f"[{self.slot.rank}]<{tag}>:".encode()
            self._relayed.append(_pump.pump().relay(stream, sink, prefix, lock,
                                                    self.timestamps, files.get(tag)))

    def signal_group(self, sig):
        """Send ``sig`` to the rank's process group; False when the group is gone."""
        if self.proc is None:
            return False
        try:
            os.killpg(self.proc.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def hang_up(self):
        """Close the rank's stdin (a remote rank's script stops the rank then)."""
        if self.proc is not None and self.proc.stdin:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def close(self, timeout=2.0):
        """Hangs up, then waits at most ``timeout`` seconds for the output to be relayed."""
        self.hang_up()
        deadline = time.monotonic() + timeout
        for done in self._relayed:
            done.wait(max(0.0, deadline - time.monotonic()))


class _TextSink:
    """Bytes written to a text stream that has no byte buffer under it (a notebook's
    output, an io.StringIO)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, data):
        self._stream.write(data.decode(errors="replace"))

    def flush(self):
        self._stream.flush()


def byte_sink(stream):
    """Where the rank's output bytes go for text stream ``stream``: its byte buffer,
    or, where it has none (Jupyter's output), the stream itself, the bytes decoded."""
    return getattr(stream, "buffer", None) or _TextSink(stream)


class FlightWatch:
    """perseusrun's side of the flight recorder (perseus.common.flight_recorder): asks
    the ranks for their records (``flight/dump/<k>`` at the rendezvous ``server``), then,
    once every rank of ``ranks()`` answered (``flight/record/<k>/<rank>``) or
    :attr:`WAIT` seconds passed, prints the diagnosis through ``say``. The ranks also
    write their whole records as files under ``directory`` on their own hosts."""

    WAIT = 5.0
    #: How long a job that failed waits for the other ranks' records before it stops them.
    WAIT_AFTER_FAILURE = 3.0

    def __init__(self, server, directory, ranks, say):
        self.server, self.directory, self.ranks, self.say = server, directory, ranks, say
        self.asked = 0  # requests made
        # (k, reason, ranks expected, gone, monotonic deadline, wall time asked)
        self.pending = None
        self.stalls = 0  # stall reports of rank 0 seen
        self.looked = 0.0  # when the rendezvous was last searched for them

    def request(self, reason, expect=None, gone=None, wait=None):
        """Ask every rank (``expect``: those that can answer) for its record; ``gone``:
        ``{rank: how it ended}`` of ranks that cannot."""
        k = self.asked
        self.server.set(f"{flight_recorder.TRIGGER}{k}", reason.encode())
        self.asked += 1
        expect = sorted(self.ranks() if expect is None else expect)
        self.pending = (k, reason, expect, gone or {},
                        time.monotonic() + (self.WAIT if wait is None else wait), time.time())

    def after_failure(self, rank, how, alive, finished=()):
        """Rank ``rank`` failed (``how``): ask the ranks not seen to end (``alive``) for
        their records and print the diagnosis, waiting at most
        :attr:`WAIT_AFTER_FAILURE` seconds. A rank whose collective failed published its
        record then, so that one counts even if it ended meanwhile. ``finished``: ranks
        that had ended without error before; the diagnosis names them where the others
        wait (a script that finished while the others still ran collectives: uneven data,
        say)."""
        prefix = flight_recorder.WATCHING
        published = self.server.keys()  # the store's sorted keys (not a dict)
        watching = {int(k[len(prefix):]) for k in published
                    if k.startswith(prefix) and k[len(prefix):].isdigit()}
        alive = sorted(set(alive) & watching)  # a rank not yet in init() cannot answer
        gone = {r: "finished its script (exit code 0)" for r in finished}
        if alive:
            gone[rank] = f"ended with {how}"
        elif gone and f"{flight_recorder.FAILED}{rank}" in published:
            # No rank is left to ask, but the failed one published what it waited in as
            # its collective failed: the diagnosis then names the ranks that had finished.
            alive = [rank]
        else:
            return
        self.request(f"rank {rank} failed with {how}", expect=alive, gone=gone,
                     wait=self.WAIT_AFTER_FAILURE)
        while self.pending is not None:
            self.tick()
            time.sleep(0.02)

    def tick(self):
        if self.pending is None and time.monotonic() - self.looked >= 1.0:
            self.looked = time.monotonic()
            published = self.server.keys()  # the store's sorted keys (not a dict)
            stalls = [k for k in published if k.startswith(flight_recorder.STALLED)]
            if len(stalls) > self.stalls:
                self.stalls = len(stalls)
                self.request("a stall warning on rank 0")
        if self.pending is None:
            return
        k, reason, expect, gone, deadline, asked = self.pending
        records = {}
        for r in expect:
            # The answer to this request; after a failure, else what the rank published
            # when its collective failed since shortly before (it may have ended since).
            # (The failure's record is taken if written at most RECENT_FAILURE seconds
            # before the request, by that rank's clock.)
            keys = [(f"{flight_recorder.RECORDS}{k}/{r}", -math.inf)]
            if gone:
                keys.append((f"{flight_recorder.FAILED}{r}",
                             asked - flight_recorder.RECENT_FAILURE))
            for key, since in keys:
                try:
                    record = json.loads(self.server.get(key) or b"null")
                except ValueError:
                    record = None
                if isinstance(record, dict) and record.get("time", 0) >= since:
                    records[r] = record
                    break
        if len(records) < len(expect) and time.monotonic() < deadline:
            return
        self.pending = None
        late = sorted(set(expect) - set(records))
        none_from = f" (none from {flight_recorder.ranks_text(late)})" if late else ""
        self.say(f"flight recorder ({reason}): records of {len(records)} of {len(expect)} "
                 f"ranks{none_from}; each rank's whole record is in {self.directory} on its "
                 "host")
        lines = flight_recorder.diagnose(records, gone=gone, silent=late) if records else []
        for line in lines:
            self.say(f"flight recorder: {line}")


class Launcher:
    """What a job runner shares: ``run()`` calls ``_run()`` with the signals caught and
    ``_teardown()`` after; ``_say()`` writes a line to the launcher's stderr (``err``,
    under ``_lock``). SIGUSR1 asks the ranks for their flight records (``flight``, a
    :class:`FlightWatch`, where the runner has one)."""

    _signal = None  # set by the signal handler, which takes no lock
    _flight_asked = False  # SIGUSR1 came: set by its handler
    flight = None
    who = "perseusrun"  # the prefix of the lines it writes

    def _say(self, message):
        with self._lock:
            try:
                self.err.write(f"{self.who}: {message}\n".encode())
                self.err.flush()
            except (OSError, ValueError):
                pass

    def run(self):
        """Run the job; returns the launcher's exit status."""
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in HANDLED_SIGNALS:
                handlers[sig] = signal.signal(sig, self._on_signal)
            if self.flight is not None:
                handlers[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._on_usr1)
        try:
            return self._run()
        finally:
            self._teardown()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum, _frame):
        self._signal = signum

    def _on_usr1(self, _signum, _frame):
        self._flight_asked = True

    def _watch_flight(self):
        """Each turn of a runner's loop: ask for the records after SIGUSR1, and print
        the diagnosis once they are in."""
        if self.flight is None:
            return
        if self._flight_asked:
            self._flight_asked = False
            self.flight.request("SIGUSR1 to perseusrun")
        self.flight.tick()


class Job(Launcher):
    """Runs ranks to completion; ``run()`` returns the launcher's exit status."""

    def __init__(self, ranks, output_dir=None, out=None, err=None, grace=GRACE_SECONDS,
                 checked_in=None, start_timeout=None, flight=None):
        self.ranks = ranks
        self.flight = flight  # a FlightWatch, made with self._say
        # ``checked_in()``: the ranks seen at the rendezvous; with ``start_timeout``
        # (seconds) every rank must be seen, or end without error, within that time.
        self.checked_in, self.start_timeout = checked_in, start_timeout
        self.output_dir = output_dir
        self.out = out or byte_sink(sys.stdout)
        self.err = err or byte_sink(sys.stderr)
        self.grace = grace
        self._lock = threading.Lock()
        self._events = queue.Queue()
        #: (rank, how it ended) of the rank whose failure stopped the job, else None.
        self.failed = None

    def _run(self):
        raise_open_files()
        if self.output_dir:
            os.makedirs(self.output_dir, exist_ok=True)
        for r in self.ranks:
            try:
                r.start(self.out, self.err, self._lock, self.output_dir,
                        size=len(self.ranks))
            except OSError as e:
                self._say(f"cannot start rank {r.slot.rank} ({shlex.join(r.argv)}): "
                          f"{start_error(e)}; stopping the job")
                return 127
            _pump.pump().watch(r.proc, functools.partial(self._ended, r))
        watch = None
        if self.checked_in is not None and self.start_timeout:
            watch = StartWatch([r.slot for r in self.ranks], self.checked_in,
                               self.start_timeout)
        running, finished, succeeded = len(self.ranks), set(), []
        while running:
            if self._signal is not None:
                self._say(f"received {signal.Signals(self._signal).name}; stopping all ranks")
                return 128 + self._signal
            self._watch_flight()
            failure = watch.check(finished) if watch else None
            if failure:
                self._say(failure)
                return START_TIMEOUT_STATUS
            try:
                rank, code = self._events.get(timeout=0.1)
            except queue.Empty:
                continue
            running -= 1
            finished.add(rank.slot.rank)
            if code == 0:
                succeeded.append(rank.slot.rank)
            else:
                self.failed = (rank.slot.rank, describe_status(code))
                self._say(f"rank {rank.slot.rank} (host {rank.slot.hostname}) failed with "
                          f"{describe_status(code)}; stopping the other ranks")
                if self.flight is not None:
                    self.flight.after_failure(
                        rank.slot.rank, describe_status(code),
                        [r.slot.rank for r in self.ranks if r.slot.rank not in finished],
                        succeeded)
                return exit_status(code)
        return 0

    def _ended(self, rank, code):
        self._events.put((rank, code))

    def _teardown(self):
        teardown(self.ranks, self.grace)


def still_running(ranks, seconds):
    """The ranks whose process groups are not empty yet, after waiting at most
    ``seconds`` for them to empty."""
    deadline = time.monotonic() + seconds
    while ranks:
        for r in ranks:
            r.proc.poll()  # reap the leader so an empty group reads as gone
        ranks = [r for r in ranks if r.signal_group(0)]
        if not ranks or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    return ranks


def teardown(ranks, grace):
    """SIGTERM every rank's process group, SIGKILL what is left after ``grace`` seconds
    and wait (at most :data:`KILL_WAIT_SECONDS`) until it is gone.
    A remote rank's stdin is closed first: its script on the host then stops the rank's
    group there (remote_script), which the signals to the local rsh's group may not
    reach."""
    for r in ranks:
        r.hang_up()
    alive = [r for r in ranks if r.signal_group(signal.SIGTERM)]
    alive = still_running(alive, grace)
    for r in alive:
        r.signal_group(signal.SIGKILL)
    # Nothing of the job may outlive the launcher: wait until the groups are empty.
    still_running(alive, KILL_WAIT_SECONDS)
    for r in ranks:
        if r.proc is not None:
            r.proc.wait()
        r.close()


def spawn_launcher(argv, env):
    """Start another launcher (mpirun) in its own session; it gets SIGTERM, so that it
    can stop its own ranks, if this launcher dies abruptly."""
    return subprocess.Popen(argv, env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                            preexec_fn=_parent_death_signal(signal.SIGTERM))  # noqa: PLW1509


def supervise(proc, watch=None, grace=GRACE_SECONDS, err=None):
    """Wait for ``proc``, a launcher that runs the ranks itself (mpirun), and return this
    launcher's exit status: ``proc``'s own, or ``START_TIMEOUT_STATUS`` when ``watch``
    (a ``StartWatch``) fails, or 128 + N on signal N. In the last two cases ``proc`` gets
    SIGTERM (it stops its ranks), and its process group SIGKILL after ``grace`` seconds.
    """
    err = err or byte_sink(sys.stderr)
    received = []
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in HANDLED_SIGNALS:
            handlers[sig] = signal.signal(sig, lambda signum, _f: received.append(signum))

    def say(message):
        try:
            err.write(f"perseusrun: {message}\n".encode())
            err.flush()
        except (OSError, ValueError):
            pass

    try:
        while True:
            try:
                return exit_status(proc.wait(timeout=0.1))
            except subprocess.TimeoutExpired:
                pass
            if received:
                say(f"received {signal.Signals(received[0]).name}; stopping the job")
                status = 128 + received[0]
                break
            failure = watch.check() if watch else None
            if failure:
                say(failure)
                status = START_TIMEOUT_STATUS
                break
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        return status
    finally:
        try:  # whatever is left in its session (mpirun's ranks, if it died first)
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
