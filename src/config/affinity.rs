//! HOROVOD_THREAD_AFFINITY: the core each local rank's engine thread runs on.

use super::invalid;
use crate::error::{PerseusError, Result};
use crate::params;

const NAME: &str = "HOROVOD_THREAD_AFFINITY";

/// The core this rank's engine thread is pinned to, from HOROVOD_THREAD_AFFINITY
/// (a comma-separated list of cores, one per local rank, in local rank order), or
/// `None` when it is unset. A list that is not numbers, too short for the host's
/// ranks, or that names a core this process may not run on, is an error naming it.
pub fn from_env(local_rank: usize, local_size: usize) -> Result<Option<usize>> {
    let Some(text) = params::text(NAME)? else {
        return Ok(None);
    };
    let cores: Vec<usize> = text
        .split(',')
        .map(|c| c.trim().parse::<usize>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| invalid(NAME, &text, &params::param(NAME).allowed()))?;
    if cores.len() < local_size {
        return Err(PerseusError::InvalidConfig {
            var: NAME.into(),
            value: text.clone(),
            allowed: format!(
                "one core per local rank: this host runs {local_size} ranks, the list names {}",
                cores.len()
            ),
        });
    }
    let core = cores[local_rank];
    if core >= libc::CPU_SETSIZE as usize {
        return Err(invalid(NAME, &text, &params::param(NAME).allowed()));
    }
    let allowed = allowed_cores();
    if !allowed.is_empty() && !allowed.contains(&core) {
        return Err(PerseusError::InvalidConfig {
            var: NAME.into(),
            value: text,
            allowed: format!(
                "cores this process may run on ({}); local rank {local_rank} was given core \
                 {core}",
                ranges(&allowed)
            ),
        });
    }
    Ok(Some(core))
}

/// The cores this process may run on (empty when the kernel does not say).
fn allowed_cores() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; sched_getaffinity fills it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// "0-3,6" for [0, 1, 2, 3, 6].
fn ranges(cores: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cores.len() {
        let mut j = i;
        while j + 1 < cores.len() && cores[j + 1] == cores[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            cores[i].to_string()
        } else {
            format!("{}-{}", cores[i], cores[j])
        });
        i = j + 1;
    }
    out.join(",")
}

/// Local rank `local_rank`'s share of `cores` (sorted, the same on every local rank):
/// an equal run of them, the last rank's with the remainder; None where the host has
/// fewer cores than ranks (no share to give) or one rank only (nothing to divide).
pub fn share(cores: &[usize], local_rank: usize, local_size: usize) -> Option<&[usize]> {
    let each = cores.len() / local_size.max(1);
    if local_size < 2 || each == 0 || local_rank >= local_size {
        return None;
    }
    let start = local_rank * each;
    let end = if local_rank + 1 == local_size {
        cores.len()
    } else {
        start + each
    };
    Some(&cores[start..end])
}

/// PERSEUS_BIND_CORES: runs the calling thread, and every thread and process it starts
/// from now on (thread pools made later, data-loader workers), on this local rank's
/// share of the cores this process may use. Returns the share where it applied one; a
/// refusal is said, not fatal.
pub fn bind_to_share(local_rank: usize, local_size: usize) -> Option<Vec<usize>> {
    let cores = allowed_cores();
    let mine = share(&cores, local_rank, local_size)?.to_vec();
    let ok = run_calling_thread_on(&mine);
    if !ok {
        crate::log!(
            crate::log::Level::Warning,
            "could not bind local rank {local_rank} to cores {} (PERSEUS_BIND_CORES): {}",
            ranges(&mine),
            std::io::Error::last_os_error()
        );
        return None;
    }
    crate::log!(
        crate::log::Level::Debug,
        "local rank {local_rank} runs on cores {} of {} (PERSEUS_BIND_CORES)",
        ranges(&mine),
        ranges(&cores)
    );
    Some(mine)
}

/// Lets the calling thread run on `cores` only (each below CPU_SETSIZE: from
/// sched_getaffinity, or checked against it); false when the kernel refused.
fn run_calling_thread_on(cores: &[usize]) -> bool {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET stays within it (every
    // core is below CPU_SETSIZE, as the callers make sure).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cores {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// Pins the calling thread to `core`; a refusal is said on stderr, not fatal.
pub fn pin_current_thread(core: usize) {
    let ok = run_calling_thread_on(&[core]);
    if !ok {
        crate::log!(
            crate::log::Level::Warning,
            "could not pin the engine thread to core {core} ({NAME}): {}",
            std::io::Error::last_os_error()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn core_lists_read_as_ranges() {
        assert_eq!(ranges(&[0, 1, 2, 3, 6]), "0-3,6");
        assert_eq!(ranges(&[5]), "5");
        assert_eq!(ranges(&[]), "");
    }

    #[test]
    fn each_local_rank_gets_its_own_run_of_the_cores() {
        let cores = [0, 1, 2, 3, 8, 9, 10];
        let shares: Vec<_> = (0..3).map(|r| share(&cores, r, 3).unwrap()).collect();
        assert_eq!(shares, [&[0, 1][..], &[2, 3][..], &[8, 9, 10][..]]);
        assert_eq!(share(&[4, 5], 1, 2), Some(&[5][..]));
        // More ranks than cores, one rank, or a rank past the host's: no share.
        assert_eq!(share(&[0, 1], 0, 3), None);
        assert_eq!(share(&[0, 1], 0, 1), None);
        assert_eq!(share(&[0, 1], 2, 2), None);
    }

    #[test]
    fn this_process_may_run_on_some_core() {
        assert!(!allowed_cores().is_empty());
    }
}
