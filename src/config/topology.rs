//! Where a rank sits: global, local (on its host) and cross (across hosts).

use super::{int_var, var};
use crate::error::{PerseusError, Result};

/// The ranks and sizes of one process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks in the job.
    pub size: usize,
    /// Rank among the processes on this host.
    pub local_rank: usize,
    /// Number of processes on this host.
    pub local_size: usize,
    /// Index of this host among the hosts.
    pub cross_rank: usize,
    /// Number of hosts.
    pub cross_size: usize,
    /// This host's name as the launcher knows it.
    pub hostname: String,
}

impl Topology {
    /// A job of one process.
    pub fn single() -> Topology {
        Topology {
            rank: 0,
            size: 1,
            local_rank: 0,
            local_size: 1,
            cross_rank: 0,
            cross_size: 1,
            hostname: "localhost".into(),
        }
    }

    /// Reads the PERSEUS_* (or HOROVOD_*) variables a launcher sets.
    pub fn from_env() -> Result<Topology> {
        let pick = |p: &str| -> Option<String> {
            [format!("PERSEUS_{p}"), format!("HOROVOD_{p}")]
                .into_iter()
                .find(|n| var(n).is_some())
        };
        let Some(size_var) = pick("SIZE") else {
            return Ok(Topology::single());
        };
        let size = int_var(&size_var, 1, 1, 1 << 20)? as usize;
        let get = |p: &str, default: u64, max: u64| -> Result<usize> {
            match pick(p) {
                Some(v) => Ok(int_var(&v, default, 0, max)? as usize),
                None => Ok(default as usize),
            }
        };
        let rank = get("RANK", 0, size as u64 - 1)?;
        let local_size = get("LOCAL_SIZE", size as u64, size as u64)?.max(1);
        let local_rank = get(
            "LOCAL_RANK",
            rank as u64 % local_size as u64,
            local_size as u64 - 1,
        )?;
        let cross_size = get("CROSS_SIZE", 1, size as u64)?.max(1);
        let cross_rank = get("CROSS_RANK", 0, cross_size as u64 - 1)?;
        if pick("RANK").is_none() {
            return Err(PerseusError::InvalidArgument(format!(
                "{size_var} is set but PERSEUS_RANK is not; start the job with perseusrun"
            )));
        }
        let hostname = pick("HOSTNAME")
            .and_then(|n| var(&n))
            .unwrap_or_else(|| "localhost".into());
        Ok(Topology {
            rank,
            size,
            local_rank,
            local_size,
            cross_rank,
            cross_size,
            hostname,
        })
    }
}
