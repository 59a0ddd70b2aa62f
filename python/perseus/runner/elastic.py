"""perseusrun's elastic mode (seed 004; horovodrun's ``--min-np``, ``--max-np``,
``--host-discovery-script``): a job that goes on when workers fail and grows when hosts
appear.

The launcher starts workers without ranks and hands out *rounds* at its rendezvous
store (perseus.common.elastic has the worker's side): round ``k``'s table gives each
worker of the round its ranks. A worker that fails (exits non-zero) has its slot
blacklisted (for good, or for a while with ``--blacklist-cooldown-range``, after which
a new worker starts there at the next round); the other workers of its host go on.
Horovod blacklists the whole host: here that happens only to a host of one slot, and
to the host of a worker that does not reach the rendezvous within ``--start-timeout``
(the host, not the program, is then in doubt). A worker that fails in a reset
callback (``elastic/fatal/<id>``) stops the job at once: every round would fail so. The workers left re-form once each has
asked for the next round (after its collectives failed) or ended. Hosts that the
discovery script adds get workers, up to ``--max-np``, at the next round; the running workers
learn of them at their next ``state.commit()``. The job ends when its workers have
ended: with success when they did, or fails when fewer than ``--min-np`` workers are
left for ``--elastic-timeout`` seconds, or after ``--reset-limit`` rounds.
"""

import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from perseus.common.elastic import FATAL_KEY, silent_in
from perseus.runner import hosts as _hosts
from perseus.runner import job as _job
from perseus.runner import pump as _pump

#: How often a driver short of workers says what it waits for (at once, then this often).
WAIT_REPORT_SECONDS = 30.0


class DiscoveryError(RuntimeError):
    """The discovery script failed or printed something else than hosts."""


def discover(script, default_slots, timeout=30.0):
    """Run the discovery script: one host per line, ``host`` or ``host:slots``
    (``default_slots`` for the first form). Returns ``{host: slots}`` in its order."""
    try:
        out = subprocess.run(script, shell=True, capture_output=True, text=True,
                             timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise DiscoveryError(f"{script!r} did not finish within {timeout:g} s") from None
    if out.returncode != 0:
        raise DiscoveryError(f"{script!r} failed with exit code {out.returncode}: "
                             f"{out.stderr.strip()[-500:]}")
    found = {}
    for n, line in enumerate(out.stdout.splitlines(), start=1):
        line = line.strip()
        if not line:
            continue
        name, _, slots = line.partition(":")
        where = f"{script!r}, line {n}"
        host = _hosts._host(name.strip(), slots.strip() if slots else None, where)
        found[host.name] = host.slots if slots else default_slots
    return found


@dataclass
class WorkerSlot:
    """Where a worker runs; ``env()`` gives what it starts with (no ranks: it takes
    them from each round's table)."""

    hostname: str
    index: int
    rank: int  # the worker's number in launch order: its output's prefix
    round: int
    local_size: int = 1  # the workers on its host in the round it starts in

    @property
    def id(self):
        return f"{self.hostname}[{self.index}]"

    def env(self):
        return {"PERSEUS_ELASTIC": "1", "PERSEUS_ELASTIC_ID": self.id,
                "PERSEUS_ELASTIC_ROUND": str(self.round),
                "PERSEUS_HOSTNAME": self.hostname, "HOROVOD_HOSTNAME": self.hostname}


def places(members):
    """Each worker's ranks in a round of ``members`` (``(id, host)``, in rank order):
    ``{id: (rank, size, local_rank, local_size, cross_rank, cross_size)}``, where a
    host's ranks count locally in rank order and cross ranks count the hosts that
    have a worker of the same local rank (Horovod's definitions)."""
    size = len(members)
    on_host = {}
    local = []
    for wid, host in members:
        on_host.setdefault(host, []).append(wid)
        local.append(len(on_host[host]) - 1)
    order = list(on_host)  # hosts by their first rank
    table = {}
    for rank, ((wid, host), lr) in enumerate(zip(members, local)):
        peers = [h for h in order if len(on_host[h]) > lr]
        table[wid] = (rank, size, lr, len(on_host[host]), peers.index(host), len(peers))
    return table


class Blacklist:
    """Hosts, and slots (``host[i]``), whose workers failed. Without ``cooldown`` one
    stays blacklisted for the rest of the job; with ``cooldown=(low, high)`` seconds
    (``--blacklist-cooldown-range``) its n-th failure keeps it out for
    ``low * 2**(n-1)`` seconds, ``high`` at most, and then it is usable again."""

    def __init__(self, cooldown=None, clock=time.monotonic):
        self.cooldown, self.clock = cooldown, clock
        self.until = {}  # host -> when it comes back
        self.failures = {}  # host -> how many times it was blacklisted

    def add(self, host):
        """Blacklist ``host`` (or a slot); returns for how many seconds (``math.inf``:
        for good)."""
        n = self.failures[host] = self.failures.get(host, 0) + 1
        wait = math.inf
        if self.cooldown:
            low, high = self.cooldown
            wait = min(high, low * 2 ** min(n - 1, 62))
        self.until[host] = self.clock() + wait
        return wait

    def __contains__(self, host):
        return self.until.get(host, -math.inf) > self.clock()

    def hosts(self):
        """The hosts blacklisted now, sorted."""
        return sorted(h for h in self.until if h in self)


def table_text(table, hosts_version):
    lines = [f"hosts {hosts_version}"]
    lines += [" ".join([wid, *map(str, p)]) for wid, p in
              sorted(table.items(), key=lambda item: item[1][0])]
    return "\n".join(lines) + "\n"


class ElasticJob(_job.Launcher):
    """Runs an elastic job to its end; ``run()`` returns the launcher's exit status.

    ``find_hosts()`` returns ``{host: slots}`` (the discovery script, or the ``fixed``
    host list); ``launch(slot)`` returns a started-able ``job.Rank`` for a
    :class:`WorkerSlot`; ``server`` is the rendezvous store the workers use.
    """

    def __init__(self, find_hosts, launch, server, min_np, max_np, num_proc,
                 elastic_timeout=600.0, reset_limit=None, interval=1.0, output_dir=None,
                 out=None, err=None, grace=_job.GRACE_SECONDS, fixed=False,
                 start_timeout=None, cooldown=None):
        self.find_hosts, self.launch, self.server = find_hosts, launch, server
        self.fixed = fixed  # no discovery script: hosts never come back
        self.min_np, self.max_np, self.num_proc = min_np, max_np, num_proc
        self.elastic_timeout, self.reset_limit = elastic_timeout, reset_limit
        self.interval, self.output_dir, self.grace = interval, output_dir, grace
        self.start_timeout = start_timeout  # seconds a new worker has to check in
        self.out = out or _job.byte_sink(sys.stdout)
        self.err = err or _job.byte_sink(sys.stderr)
        self._lock = threading.Lock()
        self._events = queue.Queue()
        self.hosts = {}  # the latest discovery
        self.blacklist = Blacklist(cooldown)
        self.seen = set()  # the usable slots the workers were last told of
        self.workers = {}  # id -> job.Rank, while it runs
        self.stopping = set()  # ids the launcher stopped
        self.members = []  # the current round's worker ids, in rank order
        self.round = -1
        self.tables = {}  # round -> {worker id: its ranks}
        self.starting = {}  # worker id -> (its first round, when it started)
        self.hosts_version = 0
        self.launched = 0
        self.finished = None  # the first worker that ended with success
        self.status = 0
        self.stopped_because = None  # why the launcher stopped the job, if it did
        self.heard = set()  # the elastic/ready keys already read for silent members

    # ------------------------------------------------------------------ hosts

    def _usable(self):
        """Slots the job may use now: ``[(host, index)]`` in discovery order."""
        return [(h, i) for h, n in self.hosts.items() if h not in self.blacklist
                for i in range(n) if f"{h}[{i}]" not in self.blacklist]

    def _discover(self):
        """Look for hosts, and tell the workers (``elastic/hosts``) when the usable
        slots changed: hosts the script added or removed, or that came back from the
        blacklist."""
        try:
            self.hosts = self.find_hosts()
        except DiscoveryError as e:
            self._say(f"host discovery: {e}; keeping the hosts found before")
        now = set(self._usable())
        back = sorted({h for h, _ in now - self.seen if h in self.blacklist.failures})
        back += sorted(f"{h}[{i}]" for h, i in now - self.seen
                       if f"{h}[{i}]" in self.blacklist.failures and h not in back)
        for what in back:
            self._say(f"{'slot' if what.endswith(']') else 'host'} {what} is back from the "
                      "blacklist")
        gone = {f"{h}[{i}]" for h, i in self.seen - now}
        for wid in gone & set(self.workers):
            self._stop(wid, "its host left the job")
        added = bool(now - self.seen)
        self.seen = now
        if added or gone:
            self.hosts_version += 1
            kind = "added" if added else "removed"
            self.server.set("elastic/hosts", f"{self.hosts_version} {kind}".encode())

    def _blacklist(self, host, why, slot=None):
        """Leave ``host`` out (its workers are stopped), or only its slot ``slot`` (a
        worker id, ``host[i]``); the failure that led here re-forms the job, so the
        workers need no news of it."""
        if host in self.blacklist:
            self._say(f"{why}; host {host} is blacklisted already")
            return
        key, what = (slot, f"slot {slot}") if slot else (host, f"host {host}")
        wait = self.blacklist.add(key)
        span = ("" if wait == math.inf else
                f" for {wait:g} s (--blacklist-cooldown-range)")
        self._say(f"{why}; {what} is blacklisted{span}, and the job goes on without it")
        self.seen = {(h, i) for h, i in self.seen
                     if (f"{h}[{i}]" if slot else h) != key}
        for other in [w for w in self.workers
                      if (w if slot else self.workers[w].slot.hostname) == key]:
            self._stop(other, f"{what} is blacklisted")

    # ------------------------------------------------------------------ workers

    def _stop(self, wid, why, sig=signal.SIGTERM):
        rank = self.workers.get(wid)
        if rank is not None and wid not in self.stopping:
            self._say(f"stopping worker {wid}: {why}")
            self.stopping.add(wid)
            rank.signal_group(sig)

    def _start(self, host, index):
        local_size = self.tables[self.round][f"{host}[{index}]"][3]
        slot = WorkerSlot(host, index, self.launched, self.round, local_size)
        self.launched += 1
        rank = self.launch(slot)
        try:
            # Files under rank.<launch number>, padded as horovodrun pads them for -np.
            rank.start(self.out, self.err, self._lock, self.output_dir, size=self.num_proc)
        except OSError as e:
            raise _Stop(f"cannot start worker {slot.id} ({' '.join(rank.argv)}): "
                        f"{_job.start_error(e)}; stopping the job", 127) from None
        self.workers[slot.id] = rank
        self.starting[slot.id] = (self.round, time.monotonic())
        _pump.pump().watch(rank.proc, lambda code: self._events.put((slot.id, code)))
        return slot.id

    def _ended(self, wid, code):
        rank = self.workers.pop(wid)
        if self.starting.pop(wid, None) is not None:
            self._abandon(wid, f"worker {wid} ended ({_job.describe_status(code)}) before "
                          "it checked in")
        rank.close()
        stopped = wid in self.stopping
        self.stopping.discard(wid)
        if code == 0:
            if self.finished is None:
                self.finished = wid
            return
        if stopped:
            return
        if self.finished is not None and not self.status:
            self.status = _job.exit_status(code)
        why = f"worker {wid} failed with {_job.describe_status(code)}"
        fatal = self.server.get(f"{FATAL_KEY}{wid}")
        if fatal is not None:
            raise _Stop(f"{why} in a reset callback, which every round would repeat; "
                        "stopping the job. Its traceback:\n"
                        + fatal.decode(errors="replace").rstrip(),
                        _job.exit_status(code) or 1)
        host = rank.slot.hostname
        # Only this slot, where the host has others (their workers go on), and only
        # while discovery lists more than one slot there.
        self._blacklist(host, why, slot=wid if self.hosts.get(host, 1) > 1 else None)

    def _check_starts(self):
        """Blacklist the host of a worker that has not checked in at the rendezvous
        (``mesh/<rank>`` under a round's scope) within ``--start-timeout``: it would
        hold the others' round, and every round after, forever."""
        if not self.starting or not self.start_timeout:
            return
        keys = self.server.keys()
        for wid, (first, since) in list(self.starting.items()):
            rounds = [r for r in range(first, self.round + 1) if wid in self.tables[r]]
            ranks = {(r, self.tables[r][wid][0]) for r in rounds}
            if any((r, _job.mesh_rank(k, f"elastic/{r}/")) in ranks for r in rounds
                   for k in keys):
                del self.starting[wid]
            elif time.monotonic() - since > self.start_timeout:
                del self.starting[wid]
                why = (f"worker {wid} did not check in at the rendezvous within "
                       f"{self.start_timeout:g} s (--start-timeout)")
                self._abandon(wid, why)
                self._blacklist(self.workers[wid].slot.hostname, why)

    def _abandon(self, wid, why):
        """Publish ``gone <why>`` as the check-in of ``wid``, a member of the current
        round that never checked in and never will: the others, waiting for it, then
        fail to connect at once, naming it, and move on to the next round."""
        table = self.tables.get(self.round, {})
        if wid not in table:
            return
        key = f"elastic/{self.round}/mesh/{table[wid][0]}"
        published = self.server.keys()  # the store's sorted keys (not a dict)
        if key not in published:
            self.server.set(key, f"gone {why}".encode())

    def _silenced(self):
        """Members of the current round that a worker leaving it found silent (its
        engine's pings unanswered for GLOO_TIMEOUT_SECONDS: stopped or frozen, or their
        host unreachable). Such a member never leaves the round itself, which would
        then never end: each is killed (a stopped process takes no SIGTERM) and its slot
        or host blacklisted, as for a failure."""
        prefix = f"elastic/ready/{self.round}/"
        published = self.server.keys()  # the store's sorted keys (not a dict)
        new = [k for k in published if k.startswith(prefix) and k not in self.heard]
        place_of = {place[0]: wid for wid, place in self.tables.get(self.round, {}).items()}
        for key in new:
            self.heard.add(key)
            for r in silent_in(self.server.get(key) or b""):
                wid = place_of.get(r)
                if wid is None or wid not in self.workers or wid in self.stopping:
                    continue
                why = (f"worker {wid} (rank {r}) answered nothing for GLOO_TIMEOUT_SECONDS, "
                       f"said worker {key[len(prefix):]}: it is stopped or frozen, or its "
                       "host cannot be reached")
                host = self.workers[wid].slot.hostname
                self._stop(wid, why, signal.SIGKILL)
                self._blacklist(host, f"worker {wid} answers nothing",
                                slot=wid if self.hosts.get(host, 1) > 1 else None)

    # ------------------------------------------------------------------ rounds

    def _ready(self):
        """Members of the current round that asked for the next one."""
        prefix = f"elastic/ready/{self.round}/"
        published = self.server.keys()  # the store's sorted keys (not a dict)
        return {k[len(prefix):] for k in published if k.startswith(prefix)}

    def _round_over(self):
        """True once every live member asked for the next round, and one did or a
        member is gone."""
        live = [w for w in self.members if w in self.workers]
        ready = self._ready()
        broken = bool(ready) or len(live) < len(self.members)
        return broken and all(w in ready for w in live)

    def _next_round(self, count):
        """Publish the next round: the members still here, in their rank order, then new
        workers on free slots, ``count`` in all at most. False when fewer than
        ``--min-np`` are possible."""
        keep = [w for w in self.members if w in self.workers and w not in self.stopping]
        taken = set(self.workers)
        free = [(h, i) for h, i in self._usable() if f"{h}[{i}]" not in taken]
        new = free[:max(0, count - len(keep))]
        if len(keep) + len(new) < self.min_np:
            return False
        self.round += 1
        if self.reset_limit is not None and self.round > self.reset_limit:
            raise _Stop(f"the job re-formed {self.round} times, more than --reset-limit "
                        f"{self.reset_limit}; stopping it", 1)
        host_of = {w: self.workers[w].slot.hostname for w in keep}
        self.members = keep + [f"{h}[{i}]" for h, i in new]
        host_of.update({f"{h}[{i}]": h for h, i in new})
        table = self.tables[self.round] = places([(w, host_of[w]) for w in self.members])
        self.server.set(f"elastic/round/{self.round}",
                        table_text(table, self.hosts_version).encode())
        self.server.set("elastic/latest", str(self.round).encode())
        for h, i in new:
            self._start(h, i)
        self._say(f"round {self.round}: {len(self.members)} workers "
                  f"({', '.join(self.members)})")
        return True

    def _run(self):
        _job.raise_open_files()
        if self.output_dir:
            os.makedirs(self.output_dir, exist_ok=True)
        self.server.set("elastic/hosts", b"0 none")
        self._discover()
        short_since = time.monotonic()
        last_discovery = time.monotonic()
        next_report = 0.0  # seconds into a wait for workers when it is next described
        try:
            while True:
                if self._signal is not None:
                    self.stopped_because = (f"received {signal.Signals(self._signal).name}; "
                                            "stopping all workers")
                    self._say(self.stopped_because)
                    return 128 + self._signal
                self._watch_flight()
                try:
                    wid, code = self._events.get(timeout=0.1)
                    self._ended(wid, code)
                except queue.Empty:
                    pass
                if time.monotonic() - last_discovery >= self.interval:
                    self._discover()
                    self._check_starts()
                    last_discovery = time.monotonic()
                if self.finished is not None:
                    for wid in self._ready() & set(self.workers):
                        self._stop(wid, f"the job is ending ({self.finished} ended with "
                                   "success)")
                    if not self.workers:
                        return self.status
                    continue
                if self.round >= 0:
                    self._silenced()
                if self.round < 0 or self._round_over():
                    target = self.num_proc if self.round < 0 else self.max_np
                    if self._next_round(target):
                        short_since, next_report = time.monotonic(), 0.0
                        continue
                    left = len([w for w in self.members if w in self.workers])
                    waited = time.monotonic() - short_since
                    hopeless = self.fixed and not left and not self.blacklist.cooldown
                    give_up = waited > self.elastic_timeout or hopeless
                    if not give_up and waited < next_report:
                        continue
                    short = (f"{len(self._usable())} slots usable and {left} workers left, "
                             f"fewer than --min-np {self.min_np}")
                    blacklisted = f"blacklisted hosts: {self.blacklist.hosts() or 'none'}"
                    if give_up:
                        raise _Stop(
                            f"{short} "
                            + (f"for {self.elastic_timeout:g} s (--elastic-timeout); "
                               if waited > self.elastic_timeout else
                               "and no workers left on a fixed host list; ")
                            + f"{blacklisted}; stopping the job", 1)
                    self._say(f"waiting for workers: {short}; {blacklisted}; the job stops "
                              f"in {self.elastic_timeout - waited:.0f} s (--elastic-timeout) "
                              "unless hosts come")
                    next_report = waited + WAIT_REPORT_SECONDS
                else:
                    short_since, next_report = time.monotonic(), 0.0
        except _Stop as e:
            self._say(e.message)
            self.stopped_because = e.message
            return e.status

    def _teardown(self):
        _job.teardown(list(self.workers.values()), self.grace)


class ManagedWorker:
    """A worker that a cluster manager runs for ElasticJob (a Ray actor, a process of a
    Spark task), with the part of :class:`perseus.runner.job.Rank`'s interface that does
    not depend on the manager. A subclass sets ``slot`` and ``argv`` and, in
    ``start()``, ``proc``: an object with ``wait()``, ``poll()``, ``kill()``,
    ``returncode``, ``error`` (what went wrong) and ``result`` (``(rank, value)`` once
    the function returned)."""

    proc = None

    def signal_group(self, sig):
        """Any signal but 0 stops the worker; returns whether it was still running."""
        running = self.proc is not None and self.proc.returncode is None
        if running and sig != 0:
            self.proc.kill()
        return running

    def hang_up(self):
        pass

    def close(self, timeout=2.0):
        pass


def results(job, status, workers, who):
    """What an elastic job run from Python (perseus.ray, perseus.spark) returns: the value
    of each of ``workers`` that finished, by its last rank. Raises RuntimeError with the
    job's reason and the last failed workers' errors when ``status`` is not 0."""
    started = [w for w in workers if w.proc is not None]
    if status != 0:
        why = job.stopped_because or "a worker failed after another had finished"
        failures = [f"worker {w.slot.id}: {w.proc.error.strip()}" for w in started
                    if w.proc.error]
        raise RuntimeError("\n".join([f"{who}: the elastic job failed: {why}"]
                                     + failures[-4:]))
    done = sorted((w.proc.result for w in started if w.proc.returncode == 0),
                  key=lambda r: r[0])
    return [value for _, value in done]


class _Stop(Exception):
    def __init__(self, message, status):
        super().__init__(message)
        self.message, self.status = message, status

