//! Every environment variable the core reads, parsed and validated once at
//! `init()`. Each knob is declared in [`PARAMS`] with its default and range;
//! `docs/environment.md` is checked against that table by a test.

mod affinity;
mod autotune;
mod iface;
mod topology;

pub use crate::env::{var, with_vars};
pub use affinity::pin_current_thread;
pub use autotune::AutotuneSettings;

pub use topology::{cross_from_hosts, first_slurm_host, Launcher, Topology};

use crate::error::{PerseusError, Result};
use crate::plan::{Encoding, Mode, Plan};
use std::collections::BTreeMap;
use std::time::Duration;

/// A tunable: the variable, its default as text, and what it does.
pub struct Param {
    /// Environment variable name.
    pub name: &'static str,
    /// Default value, as a user would write it.
    pub default: &'static str,
    /// Allowed values, in words.
    pub allowed: &'static str,
    /// One line on its effect.
    pub doc: &'static str,
}

/// PERSEUS_ALLREDUCE_NANCHECK, and seed 003's spelling of it, read as an alias.
const NANCHECK: &str = "PERSEUS_ALLREDUCE_NANCHECK";
const NANCHECK_ALIAS: &str = "PERSEUS_ALLREDUCE_NANHECK";

/// The tunables the core honours today.
pub const PARAMS: &[Param] = &[
    Param {
        name: "GLOO_TIMEOUT_SECONDS",
        default: "60",
        allowed: "an integer from 1 to 86400",
        doc: "seconds to wait for a peer (connect, rendezvous, each transfer) before failing \
              (HOROVOD_GLOO_TIMEOUT_SECONDS is an alias)",
    },
    Param {
        name: "HOROVOD_FUSION_THRESHOLD",
        default: "67108864",
        allowed: "an integer number of bytes >= 0 (0 disables fusion)",
        doc: "largest fused buffer for small allreduces",
    },
    Param {
        name: "HOROVOD_CYCLE_TIME",
        default: "1",
        allowed: "a number of milliseconds from 0 to 60000",
        doc: "longest a request is held back, while others await their answer, to batch a burst",
    },
    Param {
        name: "HOROVOD_AUTOTUNE",
        default: "0",
        allowed: "0 or 1",
        doc: "1: rank 0 tries fusion thresholds, cycle times and (across hosts) the \
              allreduce mode during the first steps, scores each by the bytes reduced per \
              second, and keeps the best (knobs set by hand are held constant)",
    },
    Param {
        name: "HOROVOD_AUTOTUNE_LOG",
        default: "",
        allowed: "a file path",
        doc: "CSV file rank 0 writes each autotune sample and the chosen settings to",
    },
    Param {
        name: "HOROVOD_AUTOTUNE_WARMUP_SAMPLES",
        default: "3",
        allowed: "an integer from 0 to 1000",
        doc: "samples measured and discarded before autotuning compares settings",
    },
    Param {
        name: "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE",
        default: "10",
        allowed: "an integer from 1 to 100000",
        doc: "training steps (a step ends where a tensor name comes again) in one sample",
    },
    Param {
        name: "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
        default: "20",
        allowed: "an integer from 1 to 1000",
        doc: "samples scored before the best settings are kept for the rest of the job",
    },
    Param {
        name: "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE",
        default: "0.8",
        allowed: "a number from 0.000001 to 100",
        doc: "noise term of the Gaussian process over scores scaled to unit variance; \
              larger trusts single samples less",
    },
    Param {
        name: "HOROVOD_THREAD_AFFINITY",
        default: "",
        allowed: "a comma-separated list of core numbers, one per local rank",
        doc: "the engine thread of local rank i runs on the i-th core of the list",
    },
    Param {
        name: "HOROVOD_CACHE_CAPACITY",
        default: "1024",
        allowed: "an integer >= 0 (0 disables the response cache)",
        doc: "number of tensor signatures remembered so steady-state requests travel as ids",
    },
    Param {
        name: "PERSEUS_SHM",
        default: "1",
        allowed: "0 or 1",
        doc: "1: ranks on one host exchange data through shared memory; 0: loopback TCP",
    },
    Param {
        name: "PERSEUS_MASTER_PORT",
        default: "6666",
        allowed: "a TCP port from 1 to 65535",
        doc: "port rank 0 hosts the rendezvous on when another launcher started the job",
    },
    Param {
        name: "PERSEUS_USE_DDP_LAUNCHER",
        default: "1",
        allowed: "0 or 1",
        doc: "1: read torchrun's RANK/WORLD_SIZE; 0: ignore them",
    },
    Param {
        name: "PERSEUS_CHANGE_HVD_ALLGATHER",
        default: "0",
        allowed: "0 (stack equal shapes, DDP style) or 1 (concatenate along dim 0, Horovod style)",
        doc: "allgather result layout",
    },
    Param {
        name: "PERSEUS_GLOO_NETWORK_INTERFACE",
        default: "",
        allowed: "the name of an interface with an IPv4 address (unset: eth0 when the job \
                  spans hosts and eth0 exists, else the route to the rendezvous)",
        doc: "network interface ranks listen on and connect from",
    },
    Param {
        name: "PERSEUS_ALLREDUCE_FUSION",
        default: "",
        allowed: "an integer from 0 to 128, or unset (automatic: HOROVOD_FUSION_THRESHOLD)",
        doc: "fusion buffer size as a fraction of DistributedOptimizer's gradient bytes \
              (16: 1/16 of them per buffer); 0 disables fusion",
    },
    Param {
        name: "PERSEUS_ACCUMULATE_N_STEPS",
        default: "1",
        allowed: "an integer from 1 to 1024",
        doc: "DistributedOptimizer communicates and steps on every N-th step() with the average \
              of the N local gradients",
    },
    Param {
        name: "PERSEUS_ALLREDUCE_NANCHECK",
        default: "0",
        allowed: "0 or 1",
        doc: "1: a NaN or Inf in a reduced gradient raises an error naming the tensor and the \
              ranks it came from; the step is not applied (PERSEUS_ALLREDUCE_NANHECK, seed \
              003's spelling, is an alias)",
    },
    Param {
        name: "PERSEUS_ALLREDUCE_DTYPE",
        default: "",
        allowed: "0 (float16), 1 (no compression), 2 (float16 between hosts only), or unset \
                  (automatic: as 2)",
        doc: "how float32 gradients travel: 0 float16 on every link; 1 as they are; 2 float32 \
              within a host and float16 between hosts",
    },
    Param {
        name: "PERSEUS_ALLREDUCE_GRADIENT_SCALE",
        default: "10",
        allowed: "a number greater than 0 and at most 65504",
        doc: "gradients are multiplied by it before the cast to float16 and divided after; a \
              sum that overflows float16 is resent uncompressed with a warning",
    },
    Param {
        name: "PERSEUS_ALLREDUCE_MODE",
        default: "",
        allowed: "0 (flat ring), 1 (hierarchical), or unset (automatic)",
        doc: "allreduce shape across hosts; unset: hierarchical when the set spans several \
              hosts with the same number (two or more) of ranks on each",
    },
    Param {
        name: "HOROVOD_HIERARCHICAL_ALLREDUCE",
        default: "",
        allowed: "0 or 1 (PERSEUS_ALLREDUCE_MODE wins when both are set)",
        doc: "Horovod's name for PERSEUS_ALLREDUCE_MODE",
    },
    Param {
        name: "AIAK_HIERARCHICAL_ALLREDUCE",
        default: "",
        allowed: "0 or 1 (PERSEUS_ALLREDUCE_MODE, then HOROVOD_HIERARCHICAL_ALLREDUCE, win)",
        doc: "seed 001's name for PERSEUS_ALLREDUCE_MODE",
    },
    Param {
        name: "AIAK_FP16_COMPRESSION",
        default: "",
        allowed: "0 or 1 (PERSEUS_ALLREDUCE_DTYPE wins when both are set)",
        doc: "seed 001's switch: 1 as PERSEUS_ALLREDUCE_DTYPE=0 (float16 on every link), \
              0 as PERSEUS_ALLREDUCE_DTYPE=1 (no compression)",
    },
    Param {
        name: "PERSEUS_ALLREDUCE_STREAMS",
        default: "4",
        allowed: "an integer from 1 to 12, the same on every rank",
        doc: "TCP connections per pair of ranks on different hosts; a large allreduce between \
              hosts is split across them, each part on its own thread",
    },
    Param {
        name: "PERSEUS_NCCL_ENABLE",
        default: "",
        allowed: "0, 1, or unset (automatic)",
        doc: "CUDA tensors between ranks that each have their own GPU travel over NCCL; \
              0: always through host memory; 1: NCCL or an error naming why it cannot",
    },
    Param {
        name: "PERSEUS_NCCL_NONBLOCKING",
        default: "0",
        allowed: "0 or 1",
        doc: "1: NCCL communicators are non-blocking (NCCL 2.19 and later), so forming them \
              and every collective's launch are waited for under the peer timeout; costs a \
              thread per collective in NCCL",
    },
    Param {
        name: "PERSEUS_NCCL_NETWORK_INTERFACE",
        default: "",
        allowed: "a network interface name, or a list as NCCL_SOCKET_IFNAME takes",
        doc: "the interface NCCL's sockets use between hosts (sets NCCL_SOCKET_IFNAME when \
              that is unset); unset: NCCL's own choice",
    },
    Param {
        name: "PERSEUS_OFFLINE_NEG",
        default: "0",
        allowed: "0 or 1",
        doc: "1: once three steps in a row reduced the same tensors, ranks run that step's \
              schedule without asking the coordinator; any change falls back to negotiation",
    },
    Param {
        name: "PERSEUS_DOWNSAMPLE_N_ELEMENTS",
        default: "1",
        allowed: "an integer from 1 to 1024",
        doc: "DistributedOptimizer sends 1/N of each gradient's elements per step, rotating so \
              every element goes every N steps; the rest is kept and added later",
    },
    Param {
        name: "PERSEUS_GRADIENT_MOMENTUM",
        default: "1",
        allowed: "a number from 0 to 1",
        doc: "with PERSEUS_DOWNSAMPLE_N_ELEMENTS: the factor applied each step to the gradient \
              kept back (0.9 for momentum SGD)",
    },
    Param {
        name: "PERSEUS_PERF_CHECK_N_STEPS",
        default: "0",
        allowed: "an integer from 0 (off) to 1000000",
        doc: "every N optimizer steps, ranks compare their compute time; a rank much slower \
              than the median is reported with its host, local rank and figures",
    },
    Param {
        name: "PERSEUS_FUSED_OPTIMIZER",
        default: "0",
        allowed: "0 or 1",
        doc: "1: DistributedOptimizer takes the step of a wrapped torch.optim SGD, Adam or \
              AdamW as one fused pass per parameter in the core (perseus.torch.optim)",
    },
    Param {
        name: "AIAK_FUSED_OPTIMIZER",
        default: "",
        allowed: "0 or 1 (PERSEUS_FUSED_OPTIMIZER wins when both are set)",
        doc: "seed 001's name for PERSEUS_FUSED_OPTIMIZER",
    },
    Param {
        name: "PERSEUS_STALL_CHECK_TIME_SECONDS",
        default: "60",
        allowed: "an integer number of seconds from 0 (off) to 86400 \
                  (HOROVOD_STALL_CHECK_TIME_SECONDS is an alias)",
        doc: "rank 0 warns about a collective some ranks have waited on this long, naming \
              it and the ranks that have not submitted it",
    },
    Param {
        name: "PERSEUS_STALL_SHUTDOWN_TIME_SECONDS",
        default: "0",
        allowed: "an integer number of seconds from 0 (never) to 86400 \
                  (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS is an alias)",
        doc: "a collective some ranks have waited on this long fails the job on every rank \
              with an error naming it and the missing ranks",
    },
    Param {
        name: "HOROVOD_STALL_CHECK_DISABLE",
        default: "",
        allowed: "0 or 1",
        doc: "Horovod's switch: 1 turns the stall warning off unless \
              PERSEUS_STALL_CHECK_TIME_SECONDS is set",
    },
    Param {
        name: "PERSEUS_TIMELINE",
        default: "",
        allowed: "a file path (HOROVOD_TIMELINE is an alias)",
        doc: "write a Chrome-trace JSON of every operation to this file",
    },
    Param {
        name: "HOROVOD_HIERARCHICAL_ALLGATHER",
        default: "0",
        allowed: "0 or 1",
        doc: "1: allgathers over hosts with the same number (two or more) of ranks gather \
              across hosts first, then within each host",
    },
    Param {
        name: "PERSEUS_LOG_LEVEL",
        default: "INFO",
        allowed: "TRACE, DEBUG, INFO, WARNING, ERROR or FATAL, any case \
                  (HOROVOD_LOG_LEVEL is an alias)",
        doc: "the least level of the core's log lines written to stderr",
    },
    Param {
        name: "HOROVOD_LOG_HIDE_TIME",
        default: "1",
        allowed: "0 or 1",
        doc: "0 starts each of the core's log lines with the UTC time",
    },
    Param {
        name: "HOROVOD_TIMELINE_MARK_CYCLES",
        default: "0",
        allowed: "0 or 1",
        doc: "1 marks each negotiation cycle in the timeline (an instant CYCLE_START)",
    },
];

/// Limits of the stall check (PERSEUS_STALL_CHECK_TIME_SECONDS and
/// PERSEUS_STALL_SHUTDOWN_TIME_SECONDS); `None` is off.
#[derive(Debug, Clone, Copy, Default)]
pub struct StallLimits {
    /// Warn about a name some ranks have waited on for this long.
    pub warn: Option<Duration>,
    /// Abort the job when one has waited this long.
    pub fail: Option<Duration>,
}

/// When CUDA tensors travel over NCCL (PERSEUS_NCCL_ENABLE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NcclUse {
    /// Whenever every rank of the set has its own GPU and NCCL loads (unset).
    Auto,
    /// Never: always the host-staged path (0).
    Off,
    /// Always: device collectives fail, naming why, where NCCL cannot carry them (1).
    Required,
}

/// The parsed configuration of one rank.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where this rank sits in the job.
    pub topology: Topology,
    /// Rendezvous host and port; `None` for a job of one rank.
    pub rendezvous: Option<(String, u16)>,
    /// True on rank 0 of a job another launcher started: it hosts the store.
    pub host_store: bool,
    /// Job secret every connection must present (hex text, may be empty).
    pub secret: String,
    /// Prefix of this rank's rendezvous keys (PERSEUS_RENDEZVOUS_SCOPE, set
    /// by an elastic job for each round of its ranks; empty otherwise).
    pub scope: String,
    /// Address to listen on and publish; `None` picks the route to the rendezvous.
    pub iface_addr: Option<String>,
    /// Peer timeout.
    pub timeout: Duration,
    /// Fusion buffer limit in bytes.
    pub fusion_threshold: u64,
    /// Coordinator batching window.
    pub cycle_time: Duration,
    /// HOROVOD_AUTOTUNE: rank 0 tunes the fusion threshold and cycle time.
    pub autotune: Option<AutotuneSettings>,
    /// HOROVOD_THREAD_AFFINITY: the core the engine thread runs on.
    pub thread_affinity: Option<usize>,
    /// Response cache capacity (entries).
    pub cache_capacity: usize,
    /// 0 = stack, 1 = concatenate.
    pub allgather_mode: u8,
    /// Timeline file to start with, if any.
    pub timeline: Option<String>,
    /// HOROVOD_TIMELINE_MARK_CYCLES: the timeline marks each negotiation cycle.
    pub timeline_mark_cycles: bool,
    /// HOROVOD_HIERARCHICAL_ALLGATHER: allgathers across hosts first, then within them.
    pub hierarchical_allgather: bool,
    /// PERSEUS_LOG_LEVEL / HOROVOD_LOG_LEVEL: the least level of the log lines written.
    pub log_level: crate::log::Level,
    /// HOROVOD_LOG_HIDE_TIME=0: log lines start with the time.
    pub log_time: bool,
    /// Ranks on one host use shared memory.
    pub shm: bool,
    /// PERSEUS_ACCUMULATE_N_STEPS: local gradient accumulation steps (read by front-ends).
    pub accumulate_n_steps: u32,
    /// PERSEUS_ALLREDUCE_NANCHECK: check reduced gradients for NaN/Inf (front-ends).
    pub nancheck: bool,
    /// PERSEUS_OFFLINE_NEG: run stable steps without the coordinator.
    pub offline_neg: bool,
    /// PERSEUS_ALLREDUCE_STREAMS: TCP connections (and threads) per peer pair.
    pub streams: usize,
    /// PERSEUS_NCCL_ENABLE.
    pub nccl: NcclUse,
    /// PERSEUS_NCCL_NONBLOCKING: non-blocking NCCL communicators.
    pub nccl_nonblocking: bool,
    /// NCCL communicators per process set: PERSEUS_ALLREDUCE_STREAMS when it is set,
    /// else 1 (NCCL spreads one communicator over channels of its own).
    pub nccl_channels: usize,
    /// PERSEUS_STALL_CHECK_TIME_SECONDS and _SHUTDOWN_TIME_SECONDS.
    pub stall: StallLimits,
    /// PERSEUS_DOWNSAMPLE_N_ELEMENTS: send 1/N of the gradient per step (front-ends).
    pub downsample_n: u32,
    /// PERSEUS_GRADIENT_MOMENTUM: decay of the kept-back gradient (front-ends).
    pub gradient_momentum: f64,
    /// PERSEUS_PERF_CHECK_N_STEPS: compare compute times every N steps (front-ends).
    pub perf_check_n_steps: u64,
    /// PERSEUS_FUSED_OPTIMIZER: the fused step for wrapped torch optimizers (front-ends).
    pub fused_optimizer: bool,
    /// PERSEUS_ALLREDUCE_FUSION: 1/N of the gradient bytes per fused buffer
    /// (front-ends set the threshold once they know the gradients); None: automatic.
    pub allreduce_fusion: Option<u32>,
    /// Where a PERSEUS_ variable overrides a HOROVOD_ one: said once at init.
    pub notes: Vec<String>,
    /// How gradient allreduces travel (PERSEUS_ALLREDUCE_DTYPE, _GRADIENT_SCALE,
    /// _MODE); other allreduces use its mode with the exact encoding.
    pub plan: Plan,
}

fn invalid(name: &str, value: &str, allowed: &str) -> PerseusError {
    PerseusError::InvalidConfig {
        var: name.into(),
        value: value.into(),
        allowed: allowed.into(),
    }
}

/// PERSEUS_LOG_LEVEL, else HOROVOD_LOG_LEVEL, else the default; a name that is no level
/// is an error naming the variable it came from.
fn log_level() -> Result<crate::log::Level> {
    for name in ["PERSEUS_LOG_LEVEL", "HOROVOD_LOG_LEVEL"] {
        if let Some(v) = var(name) {
            return crate::log::Level::parse(&v)
                .ok_or_else(|| invalid(name, &v, allowed_of("PERSEUS_LOG_LEVEL")));
        }
    }
    Ok(crate::log::DEFAULT_LEVEL)
}

fn allowed_of(name: &str) -> &'static str {
    PARAMS
        .iter()
        .find(|p| p.name == name)
        .map(|p| p.allowed)
        .unwrap_or("see docs/environment.md")
}

/// Parses the first of `names` that is set as an integer within `[min, max]`, as
/// [`int_var`] does; later names are aliases (another spelling of the same setting).
/// A bad value names the variable it came from; the allowed values are the first name's.
fn aliased_int_var(names: &[&str], default: u64, min: u64, max: u64) -> Result<u64> {
    let name = names.iter().copied().find(|n| var(n).is_some());
    match name.zip(name.and_then(var)) {
        None => Ok(default),
        Some((name, v)) => match v.parse::<u64>() {
            Ok(x) if (min..=max).contains(&x) => Ok(x),
            _ => Err(invalid(name, &v, allowed_of(names[0]))),
        },
    }
}

/// The stall check's limits: PERSEUS_STALL_CHECK_TIME_SECONDS and
/// PERSEUS_STALL_SHUTDOWN_TIME_SECONDS, else Horovod's HOROVOD_STALL_CHECK_TIME_SECONDS
/// and HOROVOD_STALL_SHUTDOWN_TIME_SECONDS; Horovod's HOROVOD_STALL_CHECK_DISABLE=1 turns
/// the warning off unless PERSEUS_STALL_CHECK_TIME_SECONDS is set.
fn stall_limits() -> Result<StallLimits> {
    let disabled = var("PERSEUS_STALL_CHECK_TIME_SECONDS").is_none()
        && int_var("HOROVOD_STALL_CHECK_DISABLE", 0, 0, 1)? == 1;
    let warn = aliased_int_var(
        &[
            "PERSEUS_STALL_CHECK_TIME_SECONDS",
            "HOROVOD_STALL_CHECK_TIME_SECONDS",
        ],
        60,
        0,
        86_400,
    )?;
    let fail = aliased_int_var(
        &[
            "PERSEUS_STALL_SHUTDOWN_TIME_SECONDS",
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
        ],
        0,
        0,
        86_400,
    )?;
    Ok(StallLimits {
        warn: if disabled { None } else { seconds(warn) },
        fail: seconds(fail),
    })
}

/// Parses an integer variable within `[min, max]`.
pub fn int_var(name: &str, default: u64, min: u64, max: u64) -> Result<u64> {
    match var(name) {
        None => Ok(default),
        Some(v) => match v.parse::<u64>() {
            Ok(x) if (min..=max).contains(&x) => Ok(x),
            // A launcher's variable (PERSEUS_RENDEZVOUS_PORT) has no PARAMS row: its
            // range is the allowed values.
            _ if PARAMS.iter().all(|p| p.name != name) => Err(invalid(
                name,
                &v,
                &format!("an integer from {min} to {max}"),
            )),
            _ => Err(invalid(name, &v, allowed_of(name))),
        },
    }
}

/// The address this rank listens on: PERSEUS_IFACE_ADDR as given; else the
/// IPv4 address of PERSEUS_GLOO_NETWORK_INTERFACE (the first of a comma-separated
/// list that exists here; none is an error); else,
/// when the job spans several hosts, eth0's if it has one; else None (the
/// source address of the route to the rendezvous).
fn listen_address(t: &Topology) -> Result<Option<String>> {
    if let Some(a) = var("PERSEUS_IFACE_ADDR") {
        return Ok(Some(a));
    }
    if let Some(names) = var("PERSEUS_GLOO_NETWORK_INTERFACE") {
        let first = names
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .find_map(iface::ipv4_of);
        return match first {
            Some(a) => Ok(Some(a.to_string())),
            None => Err(invalid(
                "PERSEUS_GLOO_NETWORK_INTERFACE",
                &names,
                "the name of a network interface of this host that has an IPv4 address, or \
                 several separated by commas (see `ip -br addr`)",
            )),
        };
    }
    let spans_hosts = t.local_size < t.size;
    Ok(spans_hosts
        .then(|| iface::ipv4_of("eth0"))
        .flatten()
        .map(|a| a.to_string()))
}

/// The PERSEUS_ variables set together with a HOROVOD_ one they override.
/// A number of seconds, 0 meaning off.
fn seconds(n: u64) -> Option<Duration> {
    (n > 0).then(|| Duration::from_secs(n))
}

/// Said at init when a job of several ranks has no secret.
const UNAUTHENTICATED: &str = "warning: PERSEUS_SECRET is not set, so this job is \
    unauthenticated: anyone who can reach its rendezvous and ports can join it. perseusrun \
    makes a secret per job; under other launchers give every rank the same random \
    PERSEUS_SECRET (e.g. from `openssl rand -hex 16`).";

fn precedence_notes() -> Vec<String> {
    let pairs = [
        ("PERSEUS_ALLREDUCE_FUSION", "HOROVOD_FUSION_THRESHOLD"),
        (NANCHECK, NANCHECK_ALIAS),
        (
            "PERSEUS_STALL_CHECK_TIME_SECONDS",
            "HOROVOD_STALL_CHECK_TIME_SECONDS",
        ),
        (
            "PERSEUS_STALL_SHUTDOWN_TIME_SECONDS",
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
        ),
        ("PERSEUS_ALLREDUCE_STREAMS", "HOROVOD_NUM_NCCL_STREAMS"),
        ("PERSEUS_TIMELINE", "HOROVOD_TIMELINE"),
        ("PERSEUS_LOG_LEVEL", "HOROVOD_LOG_LEVEL"),
        ("GLOO_TIMEOUT_SECONDS", "HOROVOD_GLOO_TIMEOUT_SECONDS"),
        ("PERSEUS_ALLREDUCE_MODE", "HOROVOD_HIERARCHICAL_ALLREDUCE"),
        ("PERSEUS_ALLREDUCE_MODE", "AIAK_HIERARCHICAL_ALLREDUCE"),
        (
            "HOROVOD_HIERARCHICAL_ALLREDUCE",
            "AIAK_HIERARCHICAL_ALLREDUCE",
        ),
        ("PERSEUS_FUSED_OPTIMIZER", "AIAK_FUSED_OPTIMIZER"),
    ];
    pairs
        .iter()
        .filter_map(|(p, h)| match (var(p), var(h)) {
            (Some(pv), Some(hv)) if pv != hv => {
                Some(format!("{p}={pv} takes precedence over {h}={hv}"))
            }
            _ => None,
        })
        .collect()
}

/// Parses a non-negative number variable.
pub fn float_var(name: &str, default: f64) -> Result<f64> {
    match var(name) {
        None => Ok(default),
        Some(v) => match v.parse::<f64>() {
            Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
            _ => Err(invalid(name, &v, allowed_of(name))),
        },
    }
}

/// The longest cycle time, HOROVOD_CYCLE_TIME's upper bound: a minute (a larger value,
/// 1e300 say, is a mistake, and no `Duration` holds some of them).
const MAX_CYCLE_MS: f64 = 60_000.0;

/// [`float_var`] no larger than `max`.
fn float_var_at_most(name: &str, default: f64, max: f64) -> Result<f64> {
    let x = float_var(name, default)?;
    if x > max {
        return Err(invalid(name, &x.to_string(), allowed_of(name)));
    }
    Ok(x)
}

/// The gradient allreduce plan from PERSEUS_ALLREDUCE_DTYPE, _GRADIENT_SCALE
/// and _MODE (or HOROVOD_HIERARCHICAL_ALLREDUCE).
fn gradient_plan() -> Result<Plan> {
    // Unset: float16 only where it pays (between hosts); see docs/environment.md.
    // Seed 001's AIAK_FP16_COMPRESSION, 1 or 0, reads as dtype 0 or 1.
    let dtype = match (var("PERSEUS_ALLREDUCE_DTYPE"), var("AIAK_FP16_COMPRESSION")) {
        (None, Some(_)) => 1 - int_var("AIAK_FP16_COMPRESSION", 0, 0, 1)?,
        _ => int_var("PERSEUS_ALLREDUCE_DTYPE", 2, 0, 2)?,
    };
    let encoding = match dtype {
        0 => Encoding::Half,
        1 => Encoding::Exact,
        _ => Encoding::HalfBetweenHosts,
    };
    let name = "PERSEUS_ALLREDUCE_GRADIENT_SCALE";
    let scale = match var(name) {
        None => 10.0,
        Some(v) => match v.parse::<f64>() {
            Ok(x) if x > 0.0 && x <= 65504.0 => x,
            _ => return Err(invalid(name, &v, allowed_of(name))),
        },
    };
    let mode = match var("PERSEUS_ALLREDUCE_MODE") {
        Some(_) => int_var("PERSEUS_ALLREDUCE_MODE", 0, 0, 1)?,
        None => match [
            "HOROVOD_HIERARCHICAL_ALLREDUCE",
            "AIAK_HIERARCHICAL_ALLREDUCE",
        ]
        .into_iter()
        .find(|name| var(name).is_some())
        {
            Some(name) => int_var(name, 0, 0, 1)?,
            None => 2,
        },
    };
    let mode = [Mode::Flat, Mode::Hierarchical, Mode::Auto][mode as usize];
    Ok(Plan {
        encoding,
        scale,
        mode,
        device: false,
    })
}

/// Where the rendezvous store is, and whether this rank hosts it.
fn rendezvous(t: &Topology) -> Result<(Option<(String, u16)>, bool)> {
    match (
        var("PERSEUS_RENDEZVOUS_ADDR"),
        var("PERSEUS_RENDEZVOUS_PORT"),
    ) {
        (Some(host), Some(_)) => {
            let port = int_var("PERSEUS_RENDEZVOUS_PORT", 0, 1, 65535)? as u16;
            Ok((Some((host, port)), false))
        }
        (None, None) if t.size == 1 => Ok((None, false)),
        (None, None) => {
            let port = int_var("PERSEUS_MASTER_PORT", 6666, 1, 65535)? as u16;
            let slurm = || {
                (t.launcher == Launcher::Slurm)
                    .then(|| var("SLURM_JOB_NODELIST").or_else(|| var("SLURM_NODELIST")))
                    .flatten()
                    .and_then(|l| first_slurm_host(&l))
            };
            let one_host = || (t.local_size == t.size).then(|| "127.0.0.1".to_string());
            let host = var("PERSEUS_MASTER_ADDR")
                .or_else(|| var("MASTER_ADDR"))
                .or_else(slurm)
                .or_else(one_host)
                .ok_or_else(|| {
                    let mpi = matches!(t.launcher, Launcher::OpenMpi | Launcher::Mpich);
                    PerseusError::Rank0Unknown(format!(
                        "a job of {} ranks on several hosts needs the address of rank 0: set \
                         PERSEUS_MASTER_ADDR (or MASTER_ADDR), or start it with perseusrun{}",
                        t.size,
                        if mpi {
                            ", or install mpi4py (under mpirun rank 0's host is then found \
                             through MPI)"
                        } else {
                            ""
                        }
                    ))
                })?;
            Ok((Some((host, port)), t.rank == 0))
        }
        _ => Err(PerseusError::InvalidArgument(
            "PERSEUS_RENDEZVOUS_ADDR and PERSEUS_RENDEZVOUS_PORT must be set together".into(),
        )),
    }
}

impl Config {
    /// True when this host runs more ranks than this process may use cores:
    /// then a rank that yields while it waits takes time from a neighbour, and
    /// waits should sleep at once instead.
    pub fn oversubscribed(&self) -> bool {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        self.topology.local_size > cores
    }

    /// Reads and validates the whole environment.
    pub fn from_env() -> Result<Config> {
        let topology = Topology::from_env()?;
        let iface_addr = listen_address(&topology)?;
        let (rendezvous, host_store) = rendezvous(&topology)?;
        let timeout = aliased_int_var(
            &["GLOO_TIMEOUT_SECONDS", "HOROVOD_GLOO_TIMEOUT_SECONDS"],
            60,
            1,
            86_400,
        )?;
        let fusion_threshold = int_var("HOROVOD_FUSION_THRESHOLD", 64 << 20, 0, u64::MAX)?;
        let cycle_ms = float_var_at_most("HOROVOD_CYCLE_TIME", 1.0, MAX_CYCLE_MS)?;
        let cache_capacity = int_var("HOROVOD_CACHE_CAPACITY", 1024, 0, 1 << 24)? as usize;
        let allgather_mode = int_var("PERSEUS_CHANGE_HVD_ALLGATHER", 0, 0, 1)? as u8;
        let unauthenticated = rendezvous.is_some() && var("PERSEUS_SECRET").is_none();
        let thread_affinity = affinity::from_env(topology.local_rank, topology.local_size)?;
        let mut autotune_notes = Vec::new();
        let autotune = autotune::from_env(&mut autotune_notes)?;
        Ok(Config {
            topology,
            rendezvous,
            host_store,
            secret: var("PERSEUS_SECRET").unwrap_or_default(),
            scope: var("PERSEUS_RENDEZVOUS_SCOPE").unwrap_or_default(),
            iface_addr,
            timeout: Duration::from_secs(timeout),
            fusion_threshold,
            cycle_time: Duration::from_secs_f64(cycle_ms / 1000.0),
            autotune,
            thread_affinity,
            cache_capacity,
            allgather_mode,
            timeline: var("PERSEUS_TIMELINE").or_else(|| var("HOROVOD_TIMELINE")),
            timeline_mark_cycles: int_var("HOROVOD_TIMELINE_MARK_CYCLES", 0, 0, 1)? == 1,
            hierarchical_allgather: int_var("HOROVOD_HIERARCHICAL_ALLGATHER", 0, 0, 1)? == 1,
            log_level: log_level()?,
            log_time: int_var("HOROVOD_LOG_HIDE_TIME", 1, 0, 1)? == 0,
            shm: int_var("PERSEUS_SHM", 1, 0, 1)? == 1,
            allreduce_fusion: var("PERSEUS_ALLREDUCE_FUSION")
                .map(|_| int_var("PERSEUS_ALLREDUCE_FUSION", 0, 0, 128).map(|n| n as u32))
                .transpose()?,
            notes: precedence_notes()
                .into_iter()
                .chain(unauthenticated.then(|| UNAUTHENTICATED.to_string()))
                .chain(autotune_notes)
                .collect(),
            accumulate_n_steps: int_var("PERSEUS_ACCUMULATE_N_STEPS", 1, 1, 1024)? as u32,
            nancheck: aliased_int_var(&[NANCHECK, NANCHECK_ALIAS], 0, 0, 1)? == 1,
            plan: gradient_plan()?,
            offline_neg: int_var("PERSEUS_OFFLINE_NEG", 0, 0, 1)? == 1,
            streams: int_var("PERSEUS_ALLREDUCE_STREAMS", 4, 1, 12)? as usize,
            nccl: match var("PERSEUS_NCCL_ENABLE") {
                None => NcclUse::Auto,
                Some(_) => [NcclUse::Off, NcclUse::Required]
                    [int_var("PERSEUS_NCCL_ENABLE", 0, 0, 1)? as usize],
            },
            nccl_nonblocking: int_var("PERSEUS_NCCL_NONBLOCKING", 0, 0, 1)? == 1,
            nccl_channels: aliased_int_var(
                &["PERSEUS_ALLREDUCE_STREAMS", "HOROVOD_NUM_NCCL_STREAMS"],
                1,
                1,
                12,
            )? as usize,
            stall: stall_limits()?,
            downsample_n: int_var("PERSEUS_DOWNSAMPLE_N_ELEMENTS", 1, 1, 1024)? as u32,
            gradient_momentum: match float_var("PERSEUS_GRADIENT_MOMENTUM", 1.0)? {
                m if m <= 1.0 => m,
                _ => {
                    let v = var("PERSEUS_GRADIENT_MOMENTUM").unwrap_or_default();
                    let name = "PERSEUS_GRADIENT_MOMENTUM";
                    return Err(invalid(name, &v, allowed_of(name)));
                }
            },
            perf_check_n_steps: int_var("PERSEUS_PERF_CHECK_N_STEPS", 0, 0, 1_000_000)?,
            // Seed 001's AIAK_FUSED_OPTIMIZER is read when PERSEUS_FUSED_OPTIMIZER is unset.
            fused_optimizer: match var("PERSEUS_FUSED_OPTIMIZER") {
                None if var("AIAK_FUSED_OPTIMIZER").is_some() => {
                    int_var("AIAK_FUSED_OPTIMIZER", 0, 0, 1)? == 1
                }
                _ => int_var("PERSEUS_FUSED_OPTIMIZER", 0, 0, 1)? == 1,
            },
        })
    }

    /// The effective values, keyed by variable name (what `_core.config()` returns).
    pub fn to_map(&self) -> BTreeMap<String, String> {
        let mut m = BTreeMap::new();
        m.insert(
            "GLOO_TIMEOUT_SECONDS".into(),
            self.timeout.as_secs().to_string(),
        );
        m.insert(
            "HOROVOD_FUSION_THRESHOLD".into(),
            self.fusion_threshold.to_string(),
        );
        m.insert(
            "HOROVOD_CYCLE_TIME".into(),
            format!("{}", self.cycle_time.as_secs_f64() * 1000.0),
        );
        m.insert(
            "HOROVOD_CACHE_CAPACITY".into(),
            self.cache_capacity.to_string(),
        );
        m.insert(
            "HOROVOD_AUTOTUNE".into(),
            u8::from(self.autotune.is_some()).to_string(),
        );
        m.insert(
            "PERSEUS_CHANGE_HVD_ALLGATHER".into(),
            self.allgather_mode.to_string(),
        );
        m.insert("PERSEUS_SHM".into(), u8::from(self.shm).to_string());
        m.insert(
            "PERSEUS_GLOO_NETWORK_INTERFACE".into(),
            var("PERSEUS_GLOO_NETWORK_INTERFACE").unwrap_or_default(),
        );
        m.insert(
            "PERSEUS_ALLREDUCE_FUSION".into(),
            self.allreduce_fusion
                .map(|n| n.to_string())
                .unwrap_or_default(),
        );
        m.insert(
            "PERSEUS_ACCUMULATE_N_STEPS".into(),
            self.accumulate_n_steps.to_string(),
        );
        m.insert(
            "PERSEUS_ALLREDUCE_NANCHECK".into(),
            u8::from(self.nancheck).to_string(),
        );
        let (enc, mode) = (self.plan.encoding, self.plan.mode);
        let dtype = match enc {
            Encoding::Half => "0",
            Encoding::Exact => "1",
            Encoding::HalfBetweenHosts => "2",
        };
        m.insert("PERSEUS_ALLREDUCE_DTYPE".into(), dtype.into());
        m.insert(
            "PERSEUS_ALLREDUCE_GRADIENT_SCALE".into(),
            self.plan.scale.to_string(),
        );
        let mode = match mode {
            Mode::Flat => "0",
            Mode::Hierarchical => "1",
            Mode::Auto => "",
        };
        m.insert("PERSEUS_ALLREDUCE_MODE".into(), mode.into());
        let flags = [
            (
                "PERSEUS_OFFLINE_NEG",
                u8::from(self.offline_neg).to_string(),
            ),
            ("PERSEUS_ALLREDUCE_STREAMS", self.streams.to_string()),
            (
                "PERSEUS_NCCL_ENABLE",
                match self.nccl {
                    NcclUse::Auto => "",
                    NcclUse::Off => "0",
                    NcclUse::Required => "1",
                }
                .to_string(),
            ),
            (
                "PERSEUS_NCCL_NONBLOCKING",
                u8::from(self.nccl_nonblocking).to_string(),
            ),
            // NCCL communicators per process set (PERSEUS_ALLREDUCE_STREAMS when set).
            ("HOROVOD_NUM_NCCL_STREAMS", self.nccl_channels.to_string()),
            (
                "PERSEUS_STALL_CHECK_TIME_SECONDS",
                self.stall.warn.map_or(0, |d| d.as_secs()).to_string(),
            ),
            (
                "PERSEUS_STALL_SHUTDOWN_TIME_SECONDS",
                self.stall.fail.map_or(0, |d| d.as_secs()).to_string(),
            ),
            (
                "PERSEUS_DOWNSAMPLE_N_ELEMENTS",
                self.downsample_n.to_string(),
            ),
            (
                "PERSEUS_GRADIENT_MOMENTUM",
                self.gradient_momentum.to_string(),
            ),
            (
                "PERSEUS_PERF_CHECK_N_STEPS",
                self.perf_check_n_steps.to_string(),
            ),
            (
                "PERSEUS_FUSED_OPTIMIZER",
                u8::from(self.fused_optimizer).to_string(),
            ),
        ];
        m.extend(flags.into_iter().map(|(k, v)| (k.to_string(), v)));
        m.insert(
            "PERSEUS_TIMELINE".into(),
            self.timeline.clone().unwrap_or_default(),
        );
        m.insert(
            "PERSEUS_LOG_LEVEL".into(),
            crate::log::LEVEL_NAMES[self.log_level as usize].into(),
        );
        m.insert(
            "HOROVOD_LOG_HIDE_TIME".into(),
            u8::from(!self.log_time).to_string(),
        );
        m.insert(
            "HOROVOD_HIERARCHICAL_ALLGATHER".into(),
            u8::from(self.hierarchical_allgather).to_string(),
        );
        m.insert(
            "HOROVOD_TIMELINE_MARK_CYCLES".into(),
            u8::from(self.timeline_mark_cycles).to_string(),
        );
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_param_is_documented_with_its_default() {
        let doc = include_str!("../../docs/environment.md");
        for p in PARAMS {
            let row = doc
                .lines()
                .find(|l| l.starts_with(&format!("| `{}` |", p.name)))
                .unwrap_or_else(|| panic!("{} is missing from docs/environment.md", p.name));
            let default = if p.default.is_empty() {
                "unset"
            } else {
                p.default
            };
            assert!(
                row.contains(default),
                "{}: default {default} not in {row}",
                p.name
            );
        }
    }

    #[test]
    fn a_launchers_variable_out_of_range_names_its_range() {
        std::env::set_var("PERSEUS_TEST_PORT_LIKE", "99999");
        let e = int_var("PERSEUS_TEST_PORT_LIKE", 0, 1, 65535)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("PERSEUS_TEST_PORT_LIKE")
                && e.contains("\"99999\"")
                && e.contains("an integer from 1 to 65535"),
            "{e}"
        );
    }

    #[test]
    fn bad_values_name_the_variable() {
        // Parsing helpers only: the environment is process-global, so use names
        // no other test sets.
        std::env::set_var("PERSEUS_TEST_INT", "abc");
        let e = int_var("PERSEUS_TEST_INT", 1, 0, 5)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("PERSEUS_TEST_INT") && e.contains("\"abc\""),
            "{e}"
        );
        std::env::set_var("PERSEUS_TEST_INT", "9");
        assert!(int_var("PERSEUS_TEST_INT", 1, 0, 5).is_err());
        std::env::set_var("PERSEUS_TEST_INT", "4");
        assert_eq!(int_var("PERSEUS_TEST_INT", 1, 0, 5).unwrap(), 4);
        std::env::set_var("PERSEUS_TEST_FLOAT", "-1");
        assert!(float_var("PERSEUS_TEST_FLOAT", 1.0).is_err());
    }
}
