//! The process's limit on open files (`ulimit -n`). A rank holds a socket for each
//! peer it talks to, and a launcher a few pipes for each rank it starts, so a job may
//! need more than the soft limit most Linux systems start a shell with (1,024). As MPI
//! runtimes do, the soft limit is raised to the hard one at `init()`, and an error
//! for want of descriptors names both.

use std::sync::Once;

/// The soft and hard limits on open files of this process.
pub fn open_files() -> (u64, u64) {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `l`.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } != 0 {
        return (0, 0);
    }
    (l.rlim_cur, l.rlim_max)
}

/// Raises the soft limit on open files to the hard one (once per process; a failure
/// leaves the limit as it was).
pub fn raise_open_files() {
    static RAISED: Once = Once::new();
    RAISED.call_once(|| {
        let (soft, hard) = open_files();
        if soft < hard {
            let l = libc::rlimit {
                rlim_cur: hard,
                rlim_max: hard,
            };
            // SAFETY: setrlimit reads one rlimit.
            unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &l) };
        }
    });
}

/// "the open-file limit is N (hard limit M; ulimit -n)", for messages.
pub fn open_files_text() -> String {
    let (soft, hard) = open_files();
    let text = |v: u64| {
        if v == libc::RLIM_INFINITY {
            "unlimited".to_string()
        } else {
            v.to_string()
        }
    };
    format!(
        "the open-file limit is {} (hard limit {}; ulimit -n)",
        text(soft),
        text(hard)
    )
}

/// True when `e` says the process (or the system) ran out of file descriptors.
pub fn out_of_files(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// `e`, with the open-file limits named when it is for want of descriptors.
pub fn explained(e: std::io::Error) -> crate::error::PerseusError {
    if out_of_files(&e) {
        crate::error::PerseusError::Io(format!("{e}: {}", open_files_text()))
    } else {
        e.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_rises_to_the_hard_one_and_is_named() {
        raise_open_files();
        let (soft, hard) = open_files();
        assert_eq!(soft, hard);
        let text = open_files_text();
        assert!(
            text.contains("open-file limit") && text.contains("ulimit -n"),
            "{text}"
        );
        let e = explained(std::io::Error::from_raw_os_error(libc::EMFILE));
        assert!(e.to_string().contains("open-file limit"), "{e}");
        let other = explained(std::io::Error::from_raw_os_error(libc::ECONNREFUSED));
        assert!(!other.to_string().contains("open-file limit"), "{other}");
    }
}
