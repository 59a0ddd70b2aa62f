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

/// Pins the calling thread to `core`; a refusal is said on stderr, not fatal.
pub fn pin_current_thread(core: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET stays within it
    // (core < CPU_SETSIZE, checked by from_env against the allowed cores).
    let ok = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(core, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    };
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
    fn this_process_may_run_on_some_core() {
        assert!(!allowed_cores().is_empty());
    }
}
