"""``perseusrun``: the command line that starts a Perseus job.

    perseusrun -np 4 -H host1:2,host2:2 python train.py --epochs 3
"""

import argparse
import os
import secrets
import shlex
import shutil
import socket
import sys
import time

from perseus import _netif
from perseus.common import flight_recorder, knobs
from perseus.runner import elastic as _elastic
from perseus.runner import horovod_flags as _hvd_flags
from perseus.runner import hosts as _hosts
from perseus.runner import job as _job
from perseus.runner import threads as _threads

DEFAULT_SSH = "ssh -o BatchMode=yes -o StrictHostKeyChecking=no"
BIND_VAR = "PERSEUS_BIND_CORES"  # perseusrun's ranks: 1 unless the user set it


class UsageError(ValueError):
    """Arguments perseusrun refuses, raised (for perseus.run) where the command line
    prints its usage and exits with status 2."""


class LaunchError(ValueError):
    """What keeps the job from starting (no mpirun, no Perseus core): perseus.run gets
    it; the command line prints ``perseusrun: <message>`` and exits with status 1."""


class _Parser(argparse.ArgumentParser):
    """perseusrun's parser: with ``raise_errors`` set, a refused argument raises
    :class:`UsageError` instead of exiting (a library call never raises SystemExit)."""

    raise_errors = False

    def error(self, message):
        if self.raise_errors:
            raise UsageError(message)
        super().error(message)

    def exit(self, status=0, message=None):
        if self.raise_errors:
            raise UsageError((message or "").strip()
                             or f"perseusrun would exit with status {status}")
        super().exit(status, message)


def build_parser():
    p = _Parser(
        prog="perseusrun",
        usage="perseusrun -np NP [-H HOSTS | --hostfile FILE] [--gloo | --mpi] [--] "
              "COMMAND [ARG ...]",
        description="Start a Perseus (Horovod-compatible) training job: NP copies of "
                    "COMMAND, one per rank, placed host by host.")
    p.add_argument("-v", "--version", action="version", version=_version(),
                   help="print Perseus's version and exit")
    p.add_argument("-np", "--num-proc", type=int, dest="num_proc", metavar="NP",
                   help="number of ranks to start")
    where = p.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", metavar="HOSTS",
                       help="hosts and their slots: host1:2,host2:4 (default localhost:NP)")
    where.add_argument("-hostfile", "--hostfile", metavar="FILE",
                       help="file of 'host slots=N' or 'host:N' lines; # starts a comment")
    backend = p.add_mutually_exclusive_group()
    backend.add_argument("--gloo", action="store_true",
                         help="start ranks with perseusrun itself (the default)")
    backend.add_argument("--mpi", action="store_true", help="start ranks with mpirun")
    p.add_argument("--network-interface", "--network-interfaces", metavar="IFACE",
                   help="interfaces (comma-separated; on each host the first that exists "
                        "is used) that ranks listen on and this machine's rendezvous is "
                        "reached at (PERSEUS_GLOO_NETWORK_INTERFACE; default: the address "
                        "on the route to the first remote host, which must then resolve)")
    p.add_argument("--start-timeout", type=int, default=30, metavar="SECONDS",
                   help="seconds every rank has to check in at the rendezvous (reach "
                        "hvd.init()); ranks that do not, e.g. on an unreachable host, are "
                        "named and the job is stopped (default 30)")
    p.add_argument("-p", "--ssh-port", type=int, metavar="PORT",
                   help="ssh port of remote hosts")
    p.add_argument("-i", "--ssh-identity-file", metavar="FILE", help="ssh private key")
    p.add_argument("--rsh", default=knobs.get("PERSEUS_RSH"), metavar="PREFIX",
                   help="command prefix that runs a command on a remote host, {host} "
                        "standing for the host, e.g. 'ip netns exec {host}' "
                        "(default: ssh; env PERSEUS_RSH)")
    p.add_argument("--output-filename", metavar="DIR",
                   help="also write each rank's lines, prefixed as on the terminal, to "
                        "DIR/rank.R/stdout and DIR/rank.R/stderr (horovodrun's layout; R "
                        "zero-padded to the width of NP-1); with --mpi, mpirun's own "
                        "--output-filename DIR")
    p.add_argument("--verbose", action="store_true", help="print placement and commands")
    p.add_argument("--log-level", choices=_hvd_flags.LOG_LEVELS, type=str.upper, help="log level of the ranks' Perseus core")
    p.add_argument("-cb", "--check-build", action="store_true",
                   help="print what this Perseus installation supports and exit")
    add_acceleration_flags(p)
    _hvd_flags.add_horovod_flags(p)
    el = p.add_argument_group("elastic training (docs/elastic.md)")
    el.add_argument("--min-np", type=int, metavar="N",
                    help="fewest workers the job goes on with (turns elastic mode on)")
    el.add_argument("--max-np", type=int, metavar="N",
                    help="most workers the job grows to as hosts appear")
    el.add_argument("--host-discovery-script", metavar="SCRIPT",
                    help="prints the usable hosts, one 'host' or 'host:slots' per line; "
                         "run every second")
    el.add_argument("--slots", "--slots-per-host", type=int, default=1, metavar="N",
                    help="slots of a host the discovery script prints without any")
    el.add_argument("--elastic-timeout", type=float, default=600, metavar="SECONDS",
                    help="how long the job waits for --min-np workers before failing")
    el.add_argument("--reset-limit", type=int, metavar="N",
                    help="most times the workers may re-form")
    el.add_argument("--blacklist-cooldown-range", type=float, nargs=2,
                    metavar=("MIN", "MAX"), dest="cooldown",
                    help="a failed host comes back after MIN seconds, twice as many at "
                    "each new failure, MAX at most (default: never)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program each rank runs")
    return p


def _version():
    from perseus._version import __version__

    return f"Perseus {__version__}"


def _is_number(text):
    try:
        float(text)
    except ValueError:
        return False
    return True


def _flag_bool(text):
    low = text.strip().lower()
    if low in ("1", "true", "yes"):
        return "1"
    if low in ("0", "false", "no"):
        return "0"
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


# Seed 000's horovodrun options of DGC: (flag, variable, argparse type, help).
_DGC_OPTIONS = [
    ("--compress-ratio", "PERSEUS_DGC_COMPRESS_RATIO", str,
     "share of each weight gradient's entries sent per step (default 0.001)"),
    ("--sample-ratio", "PERSEUS_DGC_SAMPLE_RATIO", str,
     "share of the entries sampled to estimate the threshold (default 0.01)"),
    ("--strided-sample", "PERSEUS_DGC_STRIDED_SAMPLE", _flag_bool,
     "sample with a stride, else at random (default true)"),
    ("--compress-upper-bound", "PERSEUS_DGC_COMPRESS_UPPER_BOUND", str,
     "more than this times k entries past the threshold: adapt it (default 1.3)"),
    ("--compress-lower-bound", "PERSEUS_DGC_COMPRESS_LOWER_BOUND", str,
     "fewer than this times k: adapt it (default 0.8)"),
    ("--max-adaptation-iters", "PERSEUS_DGC_MAX_ADAPTATION_ITERS", str,
     "most adaptations of the threshold (default 10)"),
    ("--resample", "PERSEUS_DGC_RESAMPLE", _flag_bool,
     "too many past the threshold: take the exact top k of them (default true)"),
    ("--fp16-values", "PERSEUS_DGC_FP16_VALUES", _flag_bool,
     "send the values as float16 (default false)"),
    ("--int32-indices", "PERSEUS_DGC_INT32_INDICES", _flag_bool,
     "send the indices as int32, not int64 (default false)"),
    ("--warmup-epochs", "PERSEUS_DGC_WARMUP_EPOCHS", str,
     "epochs of warm-up with larger ratios (default 0)"),
    ("--warmup-coeff", "PERSEUS_DGC_WARMUP_COEFF", str,
     "the ratio of each warm-up epoch (default: rising exponentially)"),
    ("--momentum-masking", "PERSEUS_DGC_MOMENTUM_MASKING", _flag_bool,
     "clear the momentum of the entries sent (default true)"),
]
# Gradient clipping, for DGC or the overlapped step: (flag, variable, type, help).
_CLIP_OPTIONS = [
    ("--clip-grad-func", "PERSEUS_CLIP_GRAD_FUNC", str,
     ("clip gradients within DGC (each rank's own, before it accumulates them) or within "
      "the overlapped step (each averaged gradient before its update): norm or value")),
    ("--clip-grad-func-params", "PERSEUS_CLIP_GRAD_FUNC_PARAMS", str,
     "the norm (per tensor; divided by sqrt(NP) within DGC) or the value to clip at"),
]


def add_acceleration_flags(p):
    """Seed 000's horovodrun switches of AIAK-Training, each a PERSEUS_* variable."""
    g = p.add_argument_group(
        "accelerations (seed 000's horovodrun switches; each sets a PERSEUS_* variable, "
        "docs/environment.md)")
    g.add_argument("--nccl-hierarchical-allreduce", action="store_true",
                   help="hierarchical allreduce (PERSEUS_ALLREDUCE_MODE=1)")
    g.add_argument("--fuse-optimizer", action="store_true",
                   help="the fused optimizer step (PERSEUS_FUSED_OPTIMIZER=1)")
    g.add_argument("--dgc", action="store_true",
                   help="deep gradient compression of torch SGD's weight gradients "
                        "(PERSEUS_DGC=1, docs/dgc.md)")
    g.add_argument("--overlap-backward-and-step", action="store_true",
                   help="each parameter steps as soon as its averaged gradient is there, "
                        "during backward (PERSEUS_OVERLAP_BACKWARD_AND_STEP=1)")
    for flag, var, kind, text in _DGC_OPTIONS + _CLIP_OPTIONS:
        if kind is _flag_bool:
            g.add_argument(flag, type=kind, metavar="BOOL", help=f"{text} ({var})")
        elif flag == "--warmup-coeff":
            g.add_argument(flag, metavar="RATIO", help=f"{text}, separated by spaces or "
                           f"commas ({var})")
        elif flag == "--clip-grad-func":
            g.add_argument(flag, choices=["norm", "value"], help=f"{text} ({var})")
        else:
            g.add_argument(flag, type=kind, metavar="VALUE", help=f"{text} ({var})")


def acceleration_env(args):
    """The PERSEUS_* variables of the acceleration flags given; ``ValueError`` names a
    DGC option given without --dgc, or a value the ranks would refuse."""
    env = {}
    if args.nccl_hierarchical_allreduce:
        env["PERSEUS_ALLREDUCE_MODE"] = "1"
    if args.fuse_optimizer:
        env["PERSEUS_FUSED_OPTIMIZER"] = "1"
    if args.overlap_backward_and_step:
        env["PERSEUS_OVERLAP_BACKWARD_AND_STEP"] = "1"
    for options, wanted, needs in ((_DGC_OPTIONS, args.dgc, "--dgc"),
                                   (_CLIP_OPTIONS, args.dgc or args.overlap_backward_and_step,
                                    "--dgc or --overlap-backward-and-step")):
        given = []
        for flag, var, _, _ in options:
            value = getattr(args, flag[2:].replace("-", "_"))
            if value is not None:
                env[var] = value
                given.append(flag)
        if given and not wanted:
            raise ValueError(f"{', '.join(given)} act only with {needs}, which is not given")
    if args.dgc:
        env["PERSEUS_DGC"] = "1"
    if args.dgc or args.overlap_backward_and_step:
        from perseus.common.dgc import Settings

        Settings.from_env(env)
    return env


def _join_ratios(argv):
    """Seed 000 writes the warm-up ratios apart (``--warmup-coeff 0.5 0.6 0.7``): they
    become one argument. Only numbers right after perseusrun's own flag are joined (the
    first ``--warmup-coeff``, before the command, which never starts with a number)."""
    if "--warmup-coeff" not in argv:
        return argv
    at = argv.index("--warmup-coeff") + 1
    end = at
    while end < len(argv) and _is_number(argv[end]):
        end += 1
    if end - at < 2:
        return argv
    return argv[:at] + [" ".join(argv[at:end])] + argv[end:]


def parse_args(argv=None, raise_errors=False):
    """perseusrun's arguments; a refused one prints the usage and exits with status 2, or
    with ``raise_errors`` (perseus.run) raises :class:`UsageError` naming it."""
    parser = build_parser()
    parser.raise_errors = raise_errors
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.warmup_coeff is not None and args.command and _is_number(args.command[0]):
        args = parser.parse_args(_join_ratios(argv))
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if args.check_build:
        return args
    args.elastic = (args.min_np, args.max_np, args.host_discovery_script) != (None,) * 3
    if args.elastic:
        elastic_args(parser, args)
    elif args.num_proc is None:
        parser.error("-np NP is required")
    elif args.cooldown:
        parser.error("--blacklist-cooldown-range is for elastic jobs (--min-np, --max-np "
                     "or --host-discovery-script)")
    if not args.command:
        parser.error("no command given: perseusrun -np NP COMMAND [ARG ...]")
    if args.start_timeout <= 0:
        parser.error("--start-timeout must be positive")
    try:
        _hvd_flags.apply_config_file(args)
        acceleration_env(args)
        _hvd_flags.horovod_env(args)
    except ValueError as e:
        parser.error(str(e))
    return args


def elastic_args(parser, args):
    """Fill in and check -np, --min-np and --max-np of an elastic job."""
    if args.mpi:
        parser.error("elastic mode runs with Perseus's own launcher, not --mpi")
    args.min_np = args.min_np or args.num_proc or 1
    args.num_proc = args.num_proc or args.min_np
    args.max_np = args.max_np or max(args.num_proc, args.min_np)
    if not 1 <= args.min_np <= args.num_proc <= args.max_np:
        parser.error(f"elastic mode needs 1 <= --min-np ({args.min_np}) <= -np "
                     f"({args.num_proc}) <= --max-np ({args.max_np})")
    if args.slots < 1:
        parser.error("--slots must be positive")
    if args.elastic_timeout <= 0:
        parser.error("--elastic-timeout must be positive")
    if args.cooldown and not 0 < args.cooldown[0] <= args.cooldown[1]:
        low, high = args.cooldown
        parser.error(f"--blacklist-cooldown-range {low:g} {high:g}: "
                     "needs 0 < MIN <= MAX seconds")


def run_elastic(args, local_names, exchange=None):
    """An elastic job (runner/elastic.py): hosts from --host-discovery-script, or the
    fixed -H/--hostfile list (then only failures change the workers). ``exchange``: as
    :func:`run_gloo`'s, the failure being why the launcher stopped the job (None when it
    did not)."""
    if args.host_discovery_script:
        script, slots = args.host_discovery_script, args.slots
        find = lambda: _elastic.discover(script, slots)
    else:  # -H/--hostfile, or up to --max-np workers on this machine
        listed = (host_list(args) if args.hosts or args.hostfile
                  else [_hosts.Host("localhost", args.max_np)])
        fixed = {h.name: h.slots for h in listed}
        find = lambda: dict(fixed)
    secret = secrets.token_hex(16)
    first = find()
    addr = rendezvous_address(args, sorted(first), local_names)
    server = start_rendezvous(secret)
    try:
        collect = exchange(server) if exchange else None
        env = job_env(args, addr, server.port)
        env["PERSEUS_ELASTIC_TIMEOUT"] = f"{args.elastic_timeout:g}"

        def launch(slot):
            return make_ranks(args, [slot], env, secret, local_names)[0]

        if args.verbose:
            print(f"perseusrun: elastic, {args.min_np} to {args.max_np} workers; "
                  f"rendezvous at {addr}:{server.port}", file=sys.stderr)
        job = _elastic.ElasticJob(
            find, launch, server, args.min_np, args.max_np, args.num_proc,
            elastic_timeout=args.elastic_timeout, reset_limit=args.reset_limit,
            output_dir=args.output_filename, fixed=not args.host_discovery_script,
            start_timeout=args.start_timeout, cooldown=args.cooldown)
        # The ranks of the round that runs now answer (workers that fail are the
        # elastic job's business: no diagnosis after a failure).
        job.flight = _job.FlightWatch(server, env[flight_recorder.DIR_VAR],
                                      lambda: range(len(job.members)), job._say)
        status = job.run()
        if collect:
            collect(status, job.stopped_because)
        return status
    finally:
        server.stop()


def host_list(args):
    if args.hostfile:
        return _hosts.parse_hostfile(args.hostfile)
    if args.hosts:
        return _hosts.parse_hosts(args.hosts)
    return [_hosts.Host("localhost", max(args.num_proc, 1))]


def interface_address(names):
    """The IPv4 address of the first of the comma-separated interfaces that has one."""
    address, why = _netif.first_ipv4(names)
    if address is None:
        raise _hosts.HostError(
            f"--network-interface {names}: no IPv4 address on this machine ({why})")
    return address


def route_source_address(host):
    """This machine's IPv4 address on the route to ``host`` (a name or an address)."""
    try:
        _, _, _, _, addr = socket.getaddrinfo(host, 1, socket.AF_INET, socket.SOCK_DGRAM)[0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except OSError as e:
        raise _hosts.HostError(
            f"cannot find this machine's address as seen from host {host!r} ({e}); "
            "pass --network-interface") from None


def rendezvous_address(args, used_hosts, local_names):
    """The IPv4 address every rank reaches the rendezvous server (on this machine) at.

    127.0.0.1 when every host is this machine; else the address of
    ``--network-interface``, or this machine's address on the route to the first
    remote host (which must then resolve, or be an address). Ranks listen on their own
    address on the route back to it (``PERSEUS_IFACE_ADDR`` overrides that).
    """
    remote = [h for h in used_hosts if not _hosts.is_local(h, local_names)]
    if not remote:
        return "127.0.0.1"
    if args.network_interface:
        return interface_address(args.network_interface)
    return route_source_address(remote[0])


def rsh_prefix(args):
    if args.rsh:
        return args.rsh
    prefix = DEFAULT_SSH
    if args.ssh_port:
        prefix += f" -p {args.ssh_port}"
    if args.ssh_identity_file:
        prefix += f" -i {shlex.quote(args.ssh_identity_file)}"
    return prefix


def job_env(args, addr, port):
    """Variables every rank gets besides its topology (the secret travels apart)."""
    env = {
        "PERSEUS_RENDEZVOUS_ADDR": addr,
        "PERSEUS_RENDEZVOUS_PORT": str(port),
        "PERSEUS_START_TIMEOUT": str(args.start_timeout),
        # Where the ranks write their flight records (made only when they do).
        flight_recorder.DIR_VAR: knobs.text(flight_recorder.DIR_VAR) or os.path.join(
            os.path.abspath(args.output_filename or os.getcwd()), "perseus-flight-recorder",
            f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"),
    }
    if knobs.text(BIND_VAR) is None:
        # Each rank on its own share of its host's cores, as MPI launchers bind ranks:
        # two ranks the scheduler puts on one core, beside busy processes, take a time
        # slice to meet in every operation.
        env[BIND_VAR] = "1"
    if args.log_level:
        env["PERSEUS_LOG_LEVEL"] = env["HOROVOD_LOG_LEVEL"] = args.log_level
    if args.network_interface:
        env["PERSEUS_GLOO_NETWORK_INTERFACE"] = args.network_interface
    env.update(_hvd_flags.horovod_env(args))
    env.update(acceleration_env(args))
    return env


def make_ranks(args, slots, common_env, secret, local_names):
    ranks, cwd, prefix = [], os.getcwd(), rsh_prefix(args)
    stamped = bool(getattr(args, "prefix_output_with_timestamp", False))
    unset = _threads.wanted(knobs.environment())
    for slot in slots:
        env = dict(common_env, **slot.env())
        local = _hosts.is_local(slot.hostname, local_names)
        # One rank on a host takes its cores with the variable unset as with it set.
        threads = unset and slot.local_size > 1
        if threads:
            _threads.announce(slot.local_size, remote=not local)
        if local:
            if threads:
                env[_threads.VAR] = str(_threads.per_rank(_threads.host_cores(),
                                                          slot.local_size))
            full = dict(os.environ, **env, PERSEUS_SECRET=secret)
            ranks.append(_job.Rank(slot, list(args.command), full, timestamps=stamped))
        else:
            env = dict(_job.forwarded_env(knobs.environment()), **env)
            if threads:  # a blank value forwarded would undo the prelude's
                env.pop(_threads.VAR, None)
            prelude = _threads.remote_prelude(slot.local_size) if threads else ""
            script = _job.remote_script(args.command, env, cwd, prelude)
            argv = _job.rsh_argv(prefix, slot.hostname, script)
            ranks.append(_job.Rank(slot, argv, dict(os.environ), secret=secret, remote=True,
                                   timestamps=stamped))
    return ranks


def start_rendezvous(secret):
    try:
        from perseus import _core
    except ImportError as e:
        raise LaunchError(f"the Perseus core (perseus._core) is not built: {e}; "
                          "run scripts/setup-venv.sh") from None
    return _core.RendezvousServer("0.0.0.0:0", secret)


def checkin_source(server):
    """``() -> set of ranks`` that checked in at ``server``, or None (a core too old to
    tell: --start-timeout is then left to the ranks' own GLOO_TIMEOUT_SECONDS)."""
    keys = getattr(server, "keys", None)
    if keys is None:
        print("perseusrun: warning: this Perseus core cannot list check-ins; "
              "--start-timeout is not enforced (rebuild the core)", file=sys.stderr)
        return None
    return lambda: _job.checked_in_ranks(keys())


def run_gloo(args, slots, local_names, exchange=None):
    """Runs the job with perseusrun's own launcher; returns its exit status.

    ``exchange`` (perseus.run): called with the rendezvous server before any rank
    starts; what it returns is called with the exit status and the job's first failure
    (``Job.failed``) once every rank is done, while the server still holds what the
    ranks published."""
    secret = secrets.token_hex(16)
    addr = rendezvous_address(args, sorted({s.hostname for s in slots}), local_names)
    server = start_rendezvous(secret)
    try:
        collect = exchange(server) if exchange else None
        env = job_env(args, addr, server.port)
        ranks = make_ranks(args, slots, env, secret, local_names)
        if args.verbose:
            for r in ranks:
                s = r.slot
                print(f"perseusrun: rank {s.rank} on {s.hostname} (local {s.local_rank}/"
                      f"{s.local_size}, cross {s.cross_rank}/{s.cross_size}): "
                      f"{shlex.join(r.argv)}", file=sys.stderr)
            print(f"perseusrun: rendezvous at {addr}:{server.port}", file=sys.stderr)
        job = _job.Job(ranks, output_dir=args.output_filename,
                       checked_in=checkin_source(server), start_timeout=args.start_timeout)
        job.flight = _job.FlightWatch(server, env[flight_recorder.DIR_VAR],
                                      lambda: range(len(ranks)), job._say)
        status = job.run()
        if collect:
            collect(status, job.failed)
        return status
    finally:
        server.stop()


def run_mpi(args, hosts, slots, exchange=None):
    """Runs the job through mpirun; returns its exit status. ``exchange``: as
    :func:`run_gloo`'s (mpirun does not say which rank failed: None)."""
    mpirun = shutil.which("mpirun")
    if not mpirun:
        raise LaunchError("--mpi needs mpirun, which is not on PATH; install Open MPI or "
                          "use the default launcher (--gloo)")
    used = {s.hostname for s in slots}
    placement = ",".join(f"{h.name}:{h.slots}" for h in hosts if h.name in used)
    secret = secrets.token_hex(16)
    local_names = _hosts.local_names()
    addr = rendezvous_address(args, sorted(used), local_names)
    server = start_rendezvous(secret)
    try:
        collect = exchange(server) if exchange else None
        env = dict(job_env(args, addr, server.port), PERSEUS_SECRET=secret,
                   PERSEUS_MPI_PLACEMENT=placement)
        binding = (shlex.split(args.binding_args) if args.binding_args
                   else ["--map-by", "slot", "--bind-to", "none"])
        cmd = [mpirun, "-np", str(args.num_proc), "-H", placement, *binding]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        cmd += ["--output-filename", args.output_filename] if args.output_filename \
            else ["--tag-output"]
        if args.prefix_output_with_timestamp:
            cmd.append("--timestamp-output")
        if args.network_interface:
            cmd += ["--mca", "oob_tcp_if_include", args.network_interface,
                    "--mca", "btl_tcp_if_include", args.network_interface]
        for name in sorted(set(env) | set(_job.forwarded_env(knobs.environment()))):
            cmd += ["-x", name]
        cmd += shlex.split(args.mpi_args or "")
        cmd += [sys.executable, "-m", "perseus.runner.mpi_rank", *args.command]
        if args.verbose:
            print(f"perseusrun: {shlex.join(cmd)}", file=sys.stderr)
        checked_in = checkin_source(server)
        try:
            proc = _job.spawn_launcher(cmd, dict(os.environ, **env))
        except OSError as e:
            raise LaunchError(f"cannot start {mpirun}: {e.strerror or e}") from None
        watch = _job.StartWatch(slots, checked_in, args.start_timeout) if checked_in else None
        status = _job.supervise(proc, watch)
        if collect:
            collect(status, None)
        return status
    finally:
        server.stop()


def check_build(out=sys.stdout):
    import importlib

    from perseus._version import __version__

    def mark(ok):
        return "[X]" if ok else "[ ]"

    from perseus import support

    frameworks, versions = {}, []
    for name, module in (("PyTorch", "torch"), ("TensorFlow", "tensorflow"),
                         ("MXNet", "mxnet")):
        try:
            version = importlib.import_module(module).__version__
            frameworks[name] = True
        except Exception:  # noqa: BLE001 - a broken install counts as absent
            frameworks[name], version = False, "not installed"
        versions.append(f"    {module} {version} (supported: {support.span(module)})")
    try:
        from perseus import _core  # noqa: F401

        core = True
    except ImportError:
        core = False
    lines = [f"Perseus v{__version__}:", "", "Available Frameworks:"]
    lines += [f"    {mark(ok)} {name}" for name, ok in frameworks.items()]
    lines += ["", "Available Backends:",
              f"    {mark(core)} Gloo (Perseus core over TCP and shared memory)",
              f"    {mark(shutil.which('mpirun') is not None)} MPI (mpirun)",
              "", "GPU libraries (loaded at run time, docs/gpu.md):"]
    if core:
        from perseus.common import gpu

        lines += gpu.report_lines()
    else:
        lines.append("    [ ] (the Perseus core did not import)")
    python = ".".join(map(str, sys.version_info[:3]))
    lines += ["", "Versions (docs/compatibility.md):",
              f"    Python {python} (supported: {support.PYTHONS[0]} to {support.PYTHONS[1]})"]
    lines += versions
    print("\n".join(lines), file=out)
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.check_build:
        return check_build()
    unused = _hvd_flags.without_effect(args)
    if unused:
        print(f"perseusrun: warning: no effect in Perseus: {'; '.join(unused)}",
              file=sys.stderr)
    try:
        if args.elastic:
            return run_elastic(args, _hosts.local_names())
        hosts = host_list(args)
        slots = _hosts.place(hosts, args.num_proc)
        if args.mpi:
            return run_mpi(args, hosts, slots)
        return run_gloo(args, slots, _hosts.local_names())
    except LaunchError as e:
        raise SystemExit(f"perseusrun: {e}") from None
    except (_hosts.HostError, ValueError) as e:
        print(f"perseusrun: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
