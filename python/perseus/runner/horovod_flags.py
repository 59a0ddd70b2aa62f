"""horovodrun's own flags, taken by ``perseusrun`` too (Horovod 0.28's names).

Each tuning flag becomes the variable the ranks' core reads (Horovod's name where the
core reads it, else Perseus's); the mpirun flags shape ``--mpi``'s command line; a flag
that changes nothing in Perseus (``--mpi-threads-disable``: its traffic never goes
through MPI) is accepted, so Horovod command lines run unchanged, and named in one
warning.
``--config-file`` reads the same settings from Horovod's YAML file, flags given on the
command line winning. See docs/launching.md, "horovodrun's flags".
"""

import argparse

from perseus.common import knobs

_MIB = 1 << 20
# The core's log levels (--log-level).
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")

# Flags whose value becomes one variable: (flag, argparse type, variable, the variable's
# text of the value, the variable's units in one of the flag's (None: no range), help).
# A flag's range is its variable's, from the table of settings (perseus.common.knobs).
_VALUED = [
    ("--fusion-threshold-mb", int, "HOROVOD_FUSION_THRESHOLD", lambda v: str(v * _MIB), _MIB,
     "largest fused buffer in MiB (set in bytes); 0 disables fusion"),
    ("--cycle-time-ms", float, "HOROVOD_CYCLE_TIME", lambda v: f"{v:g}", 1,
     "how long new requests wait while others are in flight"),
    ("--cache-capacity", int, "HOROVOD_CACHE_CAPACITY", str, 1,
     "tensor signatures the response cache holds"),
    ("--timeline-filename", str, "HOROVOD_TIMELINE", str, None,
     "write a Chrome-trace timeline to this file"),
    ("--stall-check-warning-time-seconds", int, "PERSEUS_STALL_CHECK_TIME_SECONDS", str, 1,
     "warn about a collective some ranks have waited on this long"),
    ("--stall-check-shutdown-time-seconds", int, "PERSEUS_STALL_SHUTDOWN_TIME_SECONDS", str, 1,
     "fail the job when a collective has waited this long"),
    ("--num-nccl-streams", int, "HOROVOD_NUM_NCCL_STREAMS", str, 1,
     "NCCL communicators per process set for CUDA tensors"),
    ("--gloo-timeout-seconds", int, "GLOO_TIMEOUT_SECONDS", str, 1,
     "seconds to wait for a peer"),
    ("--thread-affinity", str, "HOROVOD_THREAD_AFFINITY", str, None,
     "cores of the engine threads, comma-separated, one per local rank in order"),
    ("--autotune-log-file", str, "HOROVOD_AUTOTUNE_LOG", str, None,
     "CSV file rank 0 writes each autotune sample and the settings kept to"),
    ("--autotune-warmup-samples", int, "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", str, 1,
     "autotune samples measured and discarded first"),
    ("--autotune-steps-per-sample", int, "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", str, 1,
     "training steps in one autotune sample"),
    ("--autotune-bayes-opt-max-samples", int, "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", str, 1,
     "autotune samples scored before the best settings are kept"),
    ("--autotune-gaussian-process-noise", float, "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
     lambda v: f"{v:g}", 1, "noise term of autotune's Gaussian process"),
]


def _number(x):
    return str(x) if isinstance(x, int) else f"{x:g}"


def flag_range(var, per):
    """The range of a flag whose value, times ``per``, is variable ``var``: the
    variable's range in the table of settings, in the flag's units."""
    knob = knobs.knob(var)
    if isinstance(knob.low, int) and isinstance(knob.high, int):
        return -(-knob.low // per), knob.high // per
    return knob.low / per, knob.high / per


def _dest(flag):
    return flag.lstrip("-").replace("-", "_")


# Settings of Horovod features Perseus does not have: dest -> why they change nothing.
_NO_EFFECT = {
    "mpi_threads_disable": "Perseus's traffic does not go through MPI",
}
# The --autotune-* options, which act only with --autotune.
_AUTOTUNE_OPTIONS = [flag for flag, *_ in _VALUED if flag.startswith("--autotune-")]

# Horovod's YAML file (--config-file): section -> key -> dest.
_CONFIG_KEYS = {
    "params": {"fusion_threshold_mb": "fusion_threshold_mb",
               "cycle_time_ms": "cycle_time_ms", "cache_capacity": "cache_capacity",
               "hierarchical_allreduce": "hierarchical_allreduce",
               "hierarchical_allgather": "hierarchical_allgather"},
    "autotune": {"enabled": "autotune", "log_file": "autotune_log_file",
                 "warmup_samples": "autotune_warmup_samples",
                 "steps_per_sample": "autotune_steps_per_sample",
                 "bayes_opt_max_samples": "autotune_bayes_opt_max_samples",
                 "gaussian_process_noise": "autotune_gaussian_process_noise"},
    "timeline": {"filename": "timeline_filename", "mark_cycles": "timeline_mark_cycles"},
    "stall_check": {"enabled": "stall_check",
                    "warning_time_seconds": "stall_check_warning_time_seconds",
                    "shutdown_time_seconds": "stall_check_shutdown_time_seconds"},
    "library_options": {"mpi_threads_disable": "mpi_threads_disable",
                        "num_nccl_streams": "num_nccl_streams",
                        "thread_affinity": "thread_affinity",
                        "gloo_timeout_seconds": "gloo_timeout_seconds"},
    "logging": {"level": "log_level"},
}


def add_horovod_flags(p):
    """horovodrun's tuning, stall check, timeline, library and autotune flags."""
    g = p.add_argument_group("horovodrun's flags (Horovod 0.28; docs/launching.md)")
    g.add_argument("--config-file", metavar="FILE",
                   help="Horovod's YAML file of these settings; flags given win")
    for flag, kind, var, _, _, text in _VALUED:
        metavar = "CORES" if flag == "--thread-affinity" else "N" if kind is not str else "FILE"
        g.add_argument(flag, type=kind, metavar=metavar,
                       help=f"{text} ({var})")
    hier = g.add_mutually_exclusive_group()
    hier.add_argument("--hierarchical-allreduce", action="store_true", default=None,
                      help="hierarchical allreduce (HOROVOD_HIERARCHICAL_ALLREDUCE=1)")
    hier.add_argument("--no-hierarchical-allreduce", dest="hierarchical_allreduce",
                      action="store_false", help="flat allreduce (=0)")
    allgather = g.add_mutually_exclusive_group()
    allgather.add_argument("--hierarchical-allgather", action="store_true", default=None,
                           help="allgather across hosts first, then within each "
                                "(HOROVOD_HIERARCHICAL_ALLGATHER=1)")
    allgather.add_argument("--no-hierarchical-allgather", dest="hierarchical_allgather",
                           action="store_false", help="one ring over all ranks (=0)")
    stall = g.add_mutually_exclusive_group()
    stall.add_argument("--no-stall-check", dest="stall_check", action="store_false",
                       default=None, help="no stall warning (HOROVOD_STALL_CHECK_DISABLE=1)")
    stall.add_argument("--stall-check", dest="stall_check", action="store_true",
                       help=argparse.SUPPRESS)
    stamps = g.add_mutually_exclusive_group()
    stamps.add_argument("--log-with-timestamp", action="store_true", default=None,
                        help="start each of the Perseus core's log lines with the UTC time "
                             "(HOROVOD_LOG_HIDE_TIME=0)")
    stamps.add_argument("--log-without-timestamp", "--log-hide-timestamp",
                        dest="log_with_timestamp", action="store_false",
                        help="without it (HOROVOD_LOG_HIDE_TIME=1, the default)")
    g.add_argument("--timeline-mark-cycles", action="store_true", default=None,
                   help="mark each negotiation cycle in the timeline of --timeline-filename "
                        "(HOROVOD_TIMELINE_MARK_CYCLES=1)")
    g.add_argument("--autotune", action="store_true", default=None,
                   help="tune the fusion threshold, cycle time and allreduce mode during the "
                        "first steps (HOROVOD_AUTOTUNE=1); those set by flag or variable stay "
                        "as given")
    g.add_argument("-prefix-timestamp", "--prefix-output-with-timestamp",
                   dest="prefix_output_with_timestamp", action="store_true", default=None,
                   help="start each line of the ranks' output with the time it was relayed "
                        "(with --mpi: mpirun's --timestamp-output)")
    g.add_argument("--mpi-args", metavar="ARGS", help="more arguments for mpirun (--mpi)")
    g.add_argument("--binding-args", metavar="ARGS",
                   help="mpirun's binding arguments instead of '--bind-to none' (--mpi)")
    g.add_argument("--tcp", action="store_true",
                   help="accepted: Perseus's traffic between hosts is TCP anyway")
    g.add_argument("--disable-cache", action="store_true",
                   help="accepted: perseusrun keeps no cache of host checks")
    g.add_argument("--jsrun", action="store_true", help=argparse.SUPPRESS)
    no = p.add_argument_group("horovodrun's flags of features Perseus does not have: "
                              "accepted, named in a warning, no effect")
    no.add_argument("--mpi-threads-disable", action="store_true", default=None)



def apply_config_file(args):
    """Fills the settings of ``args.config_file`` that no flag gave; ``ValueError`` names
    a file that cannot be read, or a section or key Horovod's file does not have."""
    if not args.config_file:
        return
    try:
        with open(args.config_file) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--config-file {args.config_file}: {e.strerror}") from None
    config = _read_yaml(text, args.config_file)
    for section, values in config.items():
        keys = _CONFIG_KEYS.get(section)
        if keys is None or not isinstance(values, dict):
            raise ValueError(f"--config-file {args.config_file}: unknown section "
                             f"{section!r} (known: {', '.join(_CONFIG_KEYS)})")
        for key, value in values.items():
            if key not in keys:
                raise ValueError(f"--config-file {args.config_file}: unknown key "
                                 f"{section}.{key} (known: {', '.join(keys)})")
            dest = keys[key]
            if getattr(args, dest, None) is None:
                if dest == "log_level":
                    value = str(value).upper()
                    if value not in LOG_LEVELS:
                        raise ValueError(f"--config-file {args.config_file}: logging.level "
                                         f"{value!r} is none of {', '.join(LOG_LEVELS)}")
                setattr(args, dest, value)


def _read_yaml(text, path):
    """Horovod's configuration file: the two-level mapping of scalars it is (``section:``
    then indented ``key: value`` lines, ``#`` comments), read the same way whether or not
    PyYAML is installed, so that a file's errors are named alike everywhere."""
    config, section = {}, None
    for number, line in enumerate(text.splitlines(), 1):
        body = line.split("#", 1)[0].rstrip()
        if not body:
            continue
        key, colon, value = body.strip().partition(":")
        if not colon or not key:
            raise ValueError(f"--config-file {path}, line {number}: expected 'key: value'")
        if body[0] not in " \t":
            if value.strip():
                raise ValueError(f"--config-file {path}, line {number}: a section "
                                 f"({key}:) has its keys on the lines below")
            section = config.setdefault(key, {})
        elif section is None:
            raise ValueError(f"--config-file {path}, line {number}: a key outside a section")
        else:
            section[key.strip()] = _scalar(value.strip())
    return config


def _scalar(text):
    """A YAML scalar of Horovod's file: a number, a boolean, null or a string."""
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("", "null", "~"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip("'\"")


def horovod_env(args):
    """The variables of the horovodrun flags given; ``ValueError`` names a flag whose
    value the ranks would refuse, or flags that contradict each other."""
    env = {}
    for flag, _, var, text, per, _ in _VALUED:
        value = getattr(args, _dest(flag))
        if value is None:
            continue
        low, high = flag_range(var, per) if per else (value, value)
        if not low <= value <= high:
            raise ValueError(f"{flag} {value}: must be from {_number(low)} to {_number(high)}")
        env[var] = text(value)
    if args.hierarchical_allreduce is not None:
        if args.nccl_hierarchical_allreduce and not args.hierarchical_allreduce:
            raise ValueError("--no-hierarchical-allreduce contradicts "
                             "--nccl-hierarchical-allreduce")
        env["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1" if args.hierarchical_allreduce else "0"
    if args.hierarchical_allgather is not None:
        env["HOROVOD_HIERARCHICAL_ALLGATHER"] = "1" if args.hierarchical_allgather else "0"
    if args.timeline_mark_cycles:
        env["HOROVOD_TIMELINE_MARK_CYCLES"] = "1"
    if args.log_with_timestamp is not None:
        env["HOROVOD_LOG_HIDE_TIME"] = "0" if args.log_with_timestamp else "1"
    if args.autotune:
        env["HOROVOD_AUTOTUNE"] = "1"
    if args.stall_check is False:
        if args.stall_check_warning_time_seconds is not None:
            raise ValueError("--no-stall-check contradicts --stall-check-warning-time-seconds")
        env["HOROVOD_STALL_CHECK_DISABLE"] = "1"
    if not args.mpi:
        given = [f for f, v in (("--mpi-args", args.mpi_args),
                                ("--binding-args", args.binding_args)) if v]
        if given:
            raise ValueError(f"{', '.join(given)} act only with --mpi, which is not given")
    if args.jsrun:
        raise ValueError("--jsrun: Perseus does not start jobs through IBM's jsrun; use "
                         "perseusrun (default) or --mpi")
    return env


def without_effect(args):
    """The settings given that change nothing here, each with why (for one warning)."""
    said = []
    for dest, why in _NO_EFFECT.items():
        # False asks for what Perseus does anyway (no hierarchical allgather...).
        if getattr(args, dest) not in (None, False):
            said.append(f"--{dest.replace('_', '-')} ({why})")
    if not args.autotune:
        given = [f for f in _AUTOTUNE_OPTIONS if getattr(args, _dest(f)) is not None]
        if given:
            said.append(f"{', '.join(given)} (read only with --autotune)")
    return said
