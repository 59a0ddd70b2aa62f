//! Where a rank sits (global, local on its host, cross across hosts), read
//! from whichever launcher started it: perseusrun (PERSEUS_*), Horovod
//! (HOROVOD_*), OpenMPI (OMPI_COMM_WORLD_*), MPICH/Intel MPI (PMI_*),
//! torchrun (RANK, WORLD_SIZE, ...) or Slurm (SLURM_*).

use crate::error::{PerseusError, Result};

/// The launcher whose variables described this rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// No launcher: a job of one process.
    Single,
    /// perseusrun.
    Perseus,
    /// horovodrun (or anything exporting HOROVOD_*).
    Horovod,
    /// OpenMPI's mpirun.
    OpenMpi,
    /// An MPICH-style launcher (mpiexec.hydra, Intel MPI).
    Mpich,
    /// torchrun / torch.distributed.launch --use_env.
    Torchrun,
    /// Slurm's srun.
    Slurm,
}

/// Variable names one launcher uses: size, rank, then the optional ones.
struct Names {
    launcher: Launcher,
    size: &'static str,
    rank: &'static str,
    local_rank: &'static str,
    local_size: &'static str,
    cross_rank: &'static str,
    cross_size: &'static str,
}

const LAUNCHERS: &[Names] = &[
    Names {
        launcher: Launcher::Perseus,
        size: "PERSEUS_SIZE",
        rank: "PERSEUS_RANK",
        local_rank: "PERSEUS_LOCAL_RANK",
        local_size: "PERSEUS_LOCAL_SIZE",
        cross_rank: "PERSEUS_CROSS_RANK",
        cross_size: "PERSEUS_CROSS_SIZE",
    },
    Names {
        launcher: Launcher::Horovod,
        size: "HOROVOD_SIZE",
        rank: "HOROVOD_RANK",
        local_rank: "HOROVOD_LOCAL_RANK",
        local_size: "HOROVOD_LOCAL_SIZE",
        cross_rank: "HOROVOD_CROSS_RANK",
        cross_size: "HOROVOD_CROSS_SIZE",
    },
    Names {
        launcher: Launcher::OpenMpi,
        size: "OMPI_COMM_WORLD_SIZE",
        rank: "OMPI_COMM_WORLD_RANK",
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
        local_size: "OMPI_COMM_WORLD_LOCAL_SIZE",
        cross_rank: "",
        cross_size: "",
    },
    Names {
        launcher: Launcher::Mpich,
        size: "PMI_SIZE",
        rank: "PMI_RANK",
        local_rank: "MPI_LOCALRANKID",
        local_size: "MPI_LOCALNRANKS",
        cross_rank: "",
        cross_size: "",
    },
    Names {
        launcher: Launcher::Torchrun,
        size: "WORLD_SIZE",
        rank: "RANK",
        local_rank: "LOCAL_RANK",
        local_size: "LOCAL_WORLD_SIZE",
        cross_rank: "GROUP_RANK",
        cross_size: "",
    },
    Names {
        launcher: Launcher::Slurm,
        size: "SLURM_NTASKS",
        rank: "SLURM_PROCID",
        local_rank: "SLURM_LOCALID",
        local_size: "SLURM_NTASKS_PER_NODE",
        cross_rank: "SLURM_NODEID",
        cross_size: "SLURM_NNODES",
    },
];

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
    /// Which launcher described it.
    pub launcher: Launcher,
    /// True when the launcher gave the cross rank and size (else they are
    /// worked out from the hosts the ranks report at init).
    pub cross_given: bool,
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
            launcher: Launcher::Single,
            cross_given: true,
        }
    }

    /// Reads the process environment.
    pub fn from_env() -> Result<Topology> {
        Self::from_lookup(&|n| super::var(n))
    }

    /// Reads variables through `get` (tests pass a map).
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Topology> {
        let use_ddp = get("PERSEUS_USE_DDP_LAUNCHER");
        if let Some(v) = &use_ddp {
            if v != "0" && v != "1" {
                return Err(PerseusError::InvalidConfig {
                    var: "PERSEUS_USE_DDP_LAUNCHER".into(),
                    value: v.clone(),
                    allowed: "0 or 1".into(),
                });
            }
        }
        let skip_torchrun = use_ddp.as_deref() == Some("0");
        let Some(names) = LAUNCHERS.iter().find(|n| {
            get(n.size).is_some() && !(skip_torchrun && n.launcher == Launcher::Torchrun)
        }) else {
            return Ok(Topology::single());
        };
        // Reads `var` as an integer in [min, max]; absent gives None. Slurm
        // writes counts like "2(x3)": the leading number is what counts.
        let num = |var: &str, min: usize, max: usize| -> Result<Option<usize>> {
            if var.is_empty() {
                return Ok(None);
            }
            let Some(v) = get(var) else { return Ok(None) };
            let digits: String = if names.launcher == Launcher::Slurm {
                v.chars().take_while(char::is_ascii_digit).collect()
            } else {
                v.clone()
            };
            match digits.parse::<usize>() {
                Ok(x) if (min..=max).contains(&x) => Ok(Some(x)),
                _ => Err(PerseusError::InvalidConfig {
                    var: var.into(),
                    value: v,
                    allowed: format!("an integer from {min} to {max}"),
                }),
            }
        };
        let size = num(names.size, 1, 1 << 20)?.unwrap_or(1);
        let rank = num(names.rank, 0, size - 1)?.ok_or_else(|| {
            PerseusError::InvalidArgument(format!(
                "{} is set but {} is not: the launcher gave no rank",
                names.size, names.rank
            ))
        })?;
        let mut local_size = num(names.local_size, 1, size)?;
        if names.launcher == Launcher::Slurm {
            // srun sets SLURM_NTASKS_PER_NODE only with --ntasks-per-node.
            for v in ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"] {
                local_size = local_size.or(num(v, 1, size)?);
            }
        }
        let local_size = local_size.unwrap_or(size);
        let local_rank = num(names.local_rank, 0, local_size - 1)?.unwrap_or(rank % local_size);
        let cross_size = num(names.cross_size, 1, size)?.unwrap_or(size.div_ceil(local_size));
        let cross_rank = num(names.cross_rank, 0, cross_size - 1)?.unwrap_or(rank / local_size);
        let hostname = get("PERSEUS_HOSTNAME")
            .or_else(|| get("HOROVOD_HOSTNAME"))
            .or_else(|| get("HOSTNAME"))
            .unwrap_or_else(|| "localhost".into());
        Ok(Topology {
            rank,
            size,
            local_rank,
            local_size,
            cross_rank,
            cross_size,
            hostname,
            launcher: names.launcher,
            cross_given: !names.cross_rank.is_empty() && get(names.cross_rank).is_some(),
        })
    }
}

/// Cross rank and size from every rank's host (Horovod's definition: among the
/// hosts that have a rank with this rank's local rank, this host's index and
/// their number). Local ranks count ranks of one host in global order.
pub fn cross_from_hosts(hosts: &[String], rank: usize) -> (usize, usize) {
    let local_rank = |r: usize| hosts[..r].iter().filter(|h| **h == hosts[r]).count();
    let mine = local_rank(rank);
    let mut seen: Vec<&String> = Vec::new();
    for (r, h) in hosts.iter().enumerate() {
        if local_rank(r) == mine && !seen.contains(&h) {
            seen.push(h);
        }
    }
    let idx = seen.iter().position(|h| **h == hosts[rank]).unwrap_or(0);
    (idx, seen.len().max(1))
}

/// The first host of a Slurm node list: `node[07-09,12],gpu1` gives `node07`.
pub fn first_slurm_host(list: &str) -> Option<String> {
    let list = list.trim();
    let end = list.find(',').unwrap_or(list.len());
    let bracket = list.find('[');
    match bracket {
        Some(b) if b < end => {
            let prefix = &list[..b];
            let first: String = list[b + 1..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric())
                .collect();
            (!first.is_empty()).then(|| format!("{prefix}{first}"))
        }
        _ => (end > 0).then(|| list[..end].to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn topo(vars: &[(&str, &str)]) -> Result<Topology> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Topology::from_lookup(&|n| m.get(n).cloned())
    }

    #[test]
    fn each_launcher_is_understood() {
        let t = topo(&[
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap();
        assert_eq!(
            (t.rank, t.local_rank, t.cross_rank, t.cross_size),
            (3, 1, 1, 2)
        );
        assert_eq!(t.launcher, Launcher::OpenMpi);
        let t = topo(&[
            ("WORLD_SIZE", "2"),
            ("RANK", "1"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
        ])
        .unwrap();
        assert_eq!((t.rank, t.size, t.local_size, t.cross_size), (1, 2, 2, 1));
        assert_eq!(t.launcher, Launcher::Torchrun);
        let t = topo(&[
            ("SLURM_NTASKS", "6"),
            ("SLURM_PROCID", "5"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_NTASKS_PER_NODE", "3(x2)"),
            ("SLURM_NODEID", "1"),
            ("SLURM_NNODES", "2"),
        ])
        .unwrap();
        assert_eq!(
            (t.rank, t.local_rank, t.local_size, t.cross_rank),
            (5, 2, 3, 1)
        );
        let t = topo(&[
            ("SLURM_NTASKS", "4"),
            ("SLURM_PROCID", "3"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_TASKS_PER_NODE", "2(x2)"),
            ("SLURM_NODEID", "1"),
            ("SLURM_NNODES", "2"),
        ])
        .unwrap();
        assert_eq!((t.local_size, t.cross_rank), (2, 1));
        let t = topo(&[("PMI_SIZE", "3"), ("PMI_RANK", "2")]).unwrap();
        assert_eq!(
            (t.local_size, t.local_rank, t.launcher),
            (3, 2, Launcher::Mpich)
        );
        assert_eq!(topo(&[]).unwrap(), Topology::single());
    }

    #[test]
    fn perseus_wins_and_ddp_launcher_can_be_ignored() {
        let t = topo(&[
            ("PERSEUS_SIZE", "2"),
            ("PERSEUS_RANK", "0"),
            ("WORLD_SIZE", "8"),
            ("RANK", "5"),
        ])
        .unwrap();
        assert_eq!((t.size, t.launcher), (2, Launcher::Perseus));
        let t = topo(&[
            ("WORLD_SIZE", "8"),
            ("RANK", "5"),
            ("PERSEUS_USE_DDP_LAUNCHER", "0"),
        ])
        .unwrap();
        assert_eq!(t.launcher, Launcher::Single);
        let e = topo(&[("PERSEUS_USE_DDP_LAUNCHER", "2")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("PERSEUS_USE_DDP_LAUNCHER"), "{e}");
    }

    #[test]
    fn bad_ranks_are_named() {
        let e = topo(&[("PERSEUS_SIZE", "2"), ("PERSEUS_RANK", "2")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("PERSEUS_RANK") && e.contains("0 to 1"), "{e}");
        let e = topo(&[("WORLD_SIZE", "2")]).unwrap_err().to_string();
        assert!(e.contains("RANK"), "{e}");
    }

    #[test]
    fn cross_ranks_follow_the_hosts() {
        let h: Vec<String> = ["a", "b", "a", "b", "a"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        // Ranks 0,2,4 on a (local 0,1,2); 1,3 on b (local 0,1).
        assert_eq!(cross_from_hosts(&h, 0), (0, 2));
        assert_eq!(cross_from_hosts(&h, 1), (1, 2));
        assert_eq!(cross_from_hosts(&h, 3), (1, 2));
        assert_eq!(cross_from_hosts(&h, 4), (0, 1));
    }

    #[test]
    fn slurm_node_lists() {
        assert_eq!(
            first_slurm_host("node[07-09,12],gpu1").as_deref(),
            Some("node07")
        );
        assert_eq!(first_slurm_host("gpu1,gpu2").as_deref(), Some("gpu1"));
        assert_eq!(first_slurm_host("solo").as_deref(), Some("solo"));
        assert_eq!(first_slurm_host(""), None);
    }
}
