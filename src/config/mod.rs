//! Every environment variable the core reads, parsed and validated once at
//! `init()`. Each setting is declared in [`crate::params`] with its kind, range and
//! default, and read through it; this module holds the rules between settings (which
//! wins, what an unset one means) and the variables launchers hand their ranks.

mod affinity;
mod autotune;
mod iface;
mod topology;

pub use crate::env::{var, with_vars};
pub use affinity::{bind_to_share, pin_current_thread};
pub use autotune::AutotuneSettings;

pub use topology::{cross_from_hosts, first_slurm_host, Launcher, Topology};

use crate::error::{PerseusError, Result};
use crate::params;
use crate::plan::{Encoding, Mode, Plan};
use std::collections::BTreeMap;
use std::time::Duration;

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

/// Whether ranks of one host read one another's memory (PERSEUS_SHM_DIRECT).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reading {
    /// Where the kernel allows it and the pace check at init says it beats the
    /// rings on this host (unset).
    Paced,
    /// Never: always through the shared-memory rings (0).
    Off,
    /// Wherever the kernel allows it (1).
    Always,
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
    /// PERSEUS_BIND_CORES: this rank's share of the cores it may use, from init on.
    pub bind_cores: bool,
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
    /// PERSEUS_SHM_DIRECT: whether large blocks between ranks of one host are read
    /// straight from the other's memory.
    pub shm_direct: Reading,
    /// PERSEUS_LANE_BYTES: the largest blocking allreduce, allgather (a rank's part),
    /// broadcast, reduce-scatter or alltoall (a rank's input) the callers of a one-host job exchange themselves (`transport::lane`);
    /// 0: none.
    pub lane_bytes: usize,
    /// PERSEUS_LANE_PATIENCE_US: how long a rank waits in the lane for the others.
    pub lane_patience: Duration,
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

/// PERSEUS_LOG_LEVEL (or its alias HOROVOD_LOG_LEVEL), else its default.
fn log_level() -> Result<crate::log::Level> {
    let name = params::text("PERSEUS_LOG_LEVEL")?.unwrap_or_default();
    Ok(crate::log::Level::parse(&name).unwrap_or_else(crate::log::default_level))
}

/// The stall check's limits: PERSEUS_STALL_CHECK_TIME_SECONDS and
/// PERSEUS_STALL_SHUTDOWN_TIME_SECONDS, else Horovod's HOROVOD_STALL_CHECK_TIME_SECONDS
/// and HOROVOD_STALL_SHUTDOWN_TIME_SECONDS; Horovod's HOROVOD_STALL_CHECK_DISABLE=1 turns
/// the warning off unless PERSEUS_STALL_CHECK_TIME_SECONDS is set.
fn stall_limits() -> Result<StallLimits> {
    let disabled = !params::is_set("PERSEUS_STALL_CHECK_TIME_SECONDS")
        && params::flag_opt("HOROVOD_STALL_CHECK_DISABLE")? == Some(true);
    let warn = params::int("PERSEUS_STALL_CHECK_TIME_SECONDS")?;
    let fail = params::int("PERSEUS_STALL_SHUTDOWN_TIME_SECONDS")?;
    Ok(StallLimits {
        warn: if disabled { None } else { seconds(warn) },
        fail: seconds(fail),
    })
}

/// A variable a launcher hands its ranks (no setting: see [`crate::params`]) as an
/// integer within `[min, max]`.
pub fn launcher_int(name: &str, min: u64, max: u64) -> Result<Option<u64>> {
    match var(name) {
        None => Ok(None),
        Some(v) => match v.parse::<u64>() {
            Ok(x) if (min..=max).contains(&x) => Ok(Some(x)),
            _ => Err(invalid(
                name,
                &v,
                &format!("an integer from {min} to {max}"),
            )),
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
    // A setting over its aliases, and the settings that win over others.
    let aliases = params::PARAMS
        .iter()
        .filter(|p| p.scope == params::Scope::Core)
        .flat_map(|p| p.aliases.iter().map(move |a| (p.name, *a)));
    let rules = [
        ("PERSEUS_ALLREDUCE_FUSION", "HOROVOD_FUSION_THRESHOLD"),
        ("PERSEUS_ALLREDUCE_STREAMS", "HOROVOD_NUM_NCCL_STREAMS"),
        ("PERSEUS_ALLREDUCE_MODE", "HOROVOD_HIERARCHICAL_ALLREDUCE"),
        ("PERSEUS_ALLREDUCE_MODE", "AIAK_HIERARCHICAL_ALLREDUCE"),
        (
            "HOROVOD_HIERARCHICAL_ALLREDUCE",
            "AIAK_HIERARCHICAL_ALLREDUCE",
        ),
        ("PERSEUS_ALLREDUCE_DTYPE", "AIAK_FP16_COMPRESSION"),
    ];
    aliases
        .chain(rules)
        .filter_map(|(p, h)| match (var(p), var(h)) {
            (Some(pv), Some(hv)) if pv != hv => {
                Some(format!("{p}={pv} takes precedence over {h}={hv}"))
            }
            _ => None,
        })
        .collect()
}

/// The gradient allreduce plan from PERSEUS_ALLREDUCE_DTYPE, _GRADIENT_SCALE
/// and _MODE (or HOROVOD_HIERARCHICAL_ALLREDUCE).
fn gradient_plan() -> Result<Plan> {
    // Unset: float16 only where it pays (between hosts); see docs/environment.md.
    // Seed 001's AIAK_FP16_COMPRESSION, 1 or 0, reads as dtype 0 or 1.
    let dtype = match params::int_opt("PERSEUS_ALLREDUCE_DTYPE")? {
        Some(d) => d,
        None => match params::flag_opt("AIAK_FP16_COMPRESSION")? {
            Some(fp16) => u64::from(!fp16),
            None => 2,
        },
    };
    let encoding = match dtype {
        0 => Encoding::Half,
        1 => Encoding::Exact,
        _ => Encoding::HalfBetweenHosts,
    };
    // PERSEUS_ALLREDUCE_MODE, else Horovod's name, else seed 001's; else automatic.
    let hierarchical = [
        "PERSEUS_ALLREDUCE_MODE",
        "HOROVOD_HIERARCHICAL_ALLREDUCE",
        "AIAK_HIERARCHICAL_ALLREDUCE",
    ]
    .into_iter()
    .map(params::flag_opt)
    .find(|f| !matches!(f, Ok(None)))
    .transpose()?
    .flatten();
    Ok(Plan {
        encoding,
        scale: params::float("PERSEUS_ALLREDUCE_GRADIENT_SCALE")?,
        mode: match hierarchical {
            Some(false) => Mode::Flat,
            Some(true) => Mode::Hierarchical,
            None => Mode::Auto,
        },
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
            let port = launcher_int("PERSEUS_RENDEZVOUS_PORT", 1, 65535)?.unwrap_or(0) as u16;
            Ok((Some((host, port)), false))
        }
        (None, None) if t.size == 1 => Ok((None, false)),
        (None, None) => {
            let port = params::int("PERSEUS_MASTER_PORT")? as u16;
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

/// The cores this process may use (at least 1).
/// The cores this process could use when first asked: before PERSEUS_BIND_CORES
/// narrows them to this rank's share, so the host's count, not the share's.
fn host_cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

impl Config {
    /// True when this host runs more ranks than this process may use cores:
    /// then a rank that yields while it waits takes time from a neighbour, and
    /// waits should sleep at once instead.
    pub fn oversubscribed(&self) -> bool {
        self.topology.local_size > host_cores()
    }

    /// True when this host has two cores or more for each of its ranks: a core for
    /// a rank's engine thread to stay awake on, beside the rank's own work.
    pub fn spare_cores(&self) -> bool {
        host_cores() >= 2 * self.topology.local_size
    }

    /// Reads and validates the whole environment.
    pub fn from_env() -> Result<Config> {
        let topology = Topology::from_env()?;
        let iface_addr = listen_address(&topology)?;
        let (rendezvous, host_store) = rendezvous(&topology)?;
        let timeout = params::int("GLOO_TIMEOUT_SECONDS")?;
        let cycle_ms = params::float("HOROVOD_CYCLE_TIME")?;
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
            fusion_threshold: params::int("HOROVOD_FUSION_THRESHOLD")?,
            cycle_time: Duration::from_secs_f64(cycle_ms / 1000.0),
            autotune,
            thread_affinity,
            bind_cores: params::flag("PERSEUS_BIND_CORES")?,
            cache_capacity: params::int("HOROVOD_CACHE_CAPACITY")? as usize,
            allgather_mode: u8::from(params::flag("PERSEUS_CHANGE_HVD_ALLGATHER")?),
            timeline: params::text("PERSEUS_TIMELINE")?,
            timeline_mark_cycles: params::flag("HOROVOD_TIMELINE_MARK_CYCLES")?,
            hierarchical_allgather: params::flag("HOROVOD_HIERARCHICAL_ALLGATHER")?,
            log_level: log_level()?,
            log_time: !params::flag("HOROVOD_LOG_HIDE_TIME")?,
            shm: params::flag("PERSEUS_SHM")?,
            shm_direct: match params::flag_opt("PERSEUS_SHM_DIRECT")? {
                None => Reading::Paced,
                Some(false) => Reading::Off,
                Some(true) => Reading::Always,
            },
            lane_bytes: params::int("PERSEUS_LANE_BYTES")? as usize,
            lane_patience: Duration::from_micros(params::int("PERSEUS_LANE_PATIENCE_US")?),
            allreduce_fusion: params::int_opt("PERSEUS_ALLREDUCE_FUSION")?.map(|n| n as u32),
            notes: precedence_notes()
                .into_iter()
                .chain(unauthenticated.then(|| UNAUTHENTICATED.to_string()))
                .chain(autotune_notes)
                .collect(),
            accumulate_n_steps: params::int("PERSEUS_ACCUMULATE_N_STEPS")? as u32,
            nancheck: params::flag("PERSEUS_ALLREDUCE_NANCHECK")?,
            plan: gradient_plan()?,
            offline_neg: params::flag("PERSEUS_OFFLINE_NEG")?,
            streams: params::int("PERSEUS_ALLREDUCE_STREAMS")? as usize,
            nccl: match params::flag_opt("PERSEUS_NCCL_ENABLE")? {
                None => NcclUse::Auto,
                Some(false) => NcclUse::Off,
                Some(true) => NcclUse::Required,
            },
            nccl_nonblocking: params::flag("PERSEUS_NCCL_NONBLOCKING")?,
            // PERSEUS_ALLREDUCE_STREAMS, when set, is also the NCCL communicators' count.
            nccl_channels: match params::is_set("PERSEUS_ALLREDUCE_STREAMS") {
                true => params::int("PERSEUS_ALLREDUCE_STREAMS")?,
                false => params::int("HOROVOD_NUM_NCCL_STREAMS")?,
            } as usize,
            stall: stall_limits()?,
            downsample_n: params::int("PERSEUS_DOWNSAMPLE_N_ELEMENTS")? as u32,
            gradient_momentum: params::float("PERSEUS_GRADIENT_MOMENTUM")?,
            perf_check_n_steps: params::int("PERSEUS_PERF_CHECK_N_STEPS")?,
            fused_optimizer: params::flag("PERSEUS_FUSED_OPTIMIZER")?,
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
            "PERSEUS_SHM_DIRECT".into(),
            match self.shm_direct {
                Reading::Paced => "",
                Reading::Off => "0",
                Reading::Always => "1",
            }
            .into(),
        );
        m.insert("PERSEUS_LANE_BYTES".into(), self.lane_bytes.to_string());
        m.insert(
            "PERSEUS_LANE_PATIENCE_US".into(),
            self.lane_patience.as_micros().to_string(),
        );
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
    fn a_launchers_variable_out_of_range_names_its_range() {
        let env = [("PERSEUS_TEST_PORT_LIKE".to_string(), "99999".to_string())];
        let (got, _) = with_vars(env.into(), || {
            launcher_int("PERSEUS_TEST_PORT_LIKE", 1, 65535)
        });
        let e = got.unwrap_err().to_string();
        assert!(
            e.contains("PERSEUS_TEST_PORT_LIKE")
                && e.contains("\"99999\"")
                && e.contains("an integer from 1 to 65535"),
            "{e}"
        );
        let (unset, _) = with_vars(Default::default(), || launcher_int("X", 1, 2));
        assert_eq!(unset.unwrap(), None);
    }
}
