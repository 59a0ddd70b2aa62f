//! Waiting for a device without the risk of waiting forever.
//!
//! A collective queued on a GPU completes only when every peer takes part. A peer
//! whose process died, or one that gave up after an error of its own, never does, and
//! a plain `cuStreamSynchronize` would then hold this rank for good. So the device
//! path polls instead: between polls it asks the device for errors it met (NCCL's
//! asynchronous error), asks the CPU transport whether a peer's process has ended,
//! and gives up after the peer timeout. Its caller then aborts the communicators, so
//! that the device stops touching the tensors, and reports why on this rank. The
//! peers, waiting the same way, do the same once they see NCCL's error (reported
//! across hosts, where NCCL's network transport sees the connection drop; within a
//! host it sees nothing), this rank's process end, or the timeout.

use std::time::{Duration, Instant};

use crate::error::Result;

/// What a wait for the device watches while it waits.
pub struct Watch<'a> {
    /// The longest one wait may take: the peer timeout (`GLOO_TIMEOUT_SECONDS`).
    pub limit: Duration,
    /// Why to give up at once: the peers of the set whose processes have ended, in
    /// words, or `None` while all are alive.
    pub ended: &'a dyn Fn() -> Option<String>,
}

impl Watch<'_> {
    /// A watch with no peers to ask about, giving up after `limit`.
    pub fn alone(limit: Duration) -> Watch<'static> {
        Watch {
            limit,
            ended: &|| None,
        }
    }
}

/// How a wait ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Waited {
    /// The work is done.
    Done,
    /// The wait gave up, and why; the work may still be queued.
    Stopped(String),
}

/// How often a wait asks the device and the peers whether to go on.
pub const CHECK: Duration = Duration::from_millis(10);

/// Polls without sleeping for this long first: most waits end within it.
const EAGER: Duration = Duration::from_micros(200);

/// The longest sleep between two polls, which bounds the latency a wait adds.
const MAX_PAUSE: Duration = Duration::from_micros(250);

/// Waits until `done` says the work is done. Every [`CHECK`] it asks `trouble` (the
/// device's own errors) and then the watch's `ended`, and it stops when either has an
/// answer or when the watch's limit has passed. An error from `done` (the device
/// failed to answer) is returned as it is.
pub fn wait_for(
    watch: &Watch<'_>,
    mut done: impl FnMut() -> Result<bool>,
    mut trouble: impl FnMut() -> Option<String>,
) -> Result<Waited> {
    let start = Instant::now();
    let mut checked = start;
    let mut pause = Duration::from_micros(10);
    loop {
        if done()? {
            return Ok(Waited::Done);
        }
        let now = Instant::now();
        if now.duration_since(checked) >= CHECK {
            checked = now;
            let why = trouble().or_else(|| (watch.ended)()).or_else(|| {
                (now.duration_since(start) >= watch.limit).then(|| {
                    format!(
                        "the device collective did not complete within {} s (the peer \
                         timeout); a peer may be stuck or gone",
                        watch.limit.as_secs_f64()
                    )
                })
            });
            if let Some(why) = why {
                // Work that ended meanwhile (a peer may leave once its part is done)
                // is not given up on.
                if done()? {
                    return Ok(Waited::Done);
                }
                return Ok(Waited::Stopped(why));
            }
        }
        if now.duration_since(start) < EAGER {
            std::thread::yield_now();
        } else {
            std::thread::sleep(pause);
            pause = (pause * 2).min(MAX_PAUSE);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::PerseusError;
    use std::cell::Cell;

    #[test]
    fn work_that_ends_is_waited_for() {
        let polls = Cell::new(0);
        let w = Watch::alone(Duration::from_secs(5));
        let got = wait_for(
            &w,
            || {
                polls.set(polls.get() + 1);
                Ok(polls.get() == 50)
            },
            || None,
        );
        assert_eq!(got.unwrap(), Waited::Done);
        assert_eq!(polls.get(), 50);
    }

    #[test]
    fn the_device_error_stops_the_wait() {
        let start = Instant::now();
        let w = Watch::alone(Duration::from_secs(30));
        let got = wait_for(&w, || Ok(false), || Some("NCCL error 6: remote".into()));
        assert_eq!(got.unwrap(), Waited::Stopped("NCCL error 6: remote".into()));
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn a_peer_that_ended_stops_the_wait() {
        let asked = Cell::new(0);
        let ended = || {
            asked.set(asked.get() + 1);
            (asked.get() > 2).then(|| "the process of rank 3 has ended".to_string())
        };
        let w = Watch {
            limit: Duration::from_secs(30),
            ended: &ended,
        };
        let got = wait_for(&w, || Ok(false), || None).unwrap();
        assert_eq!(
            got,
            Waited::Stopped("the process of rank 3 has ended".into())
        );
        assert_eq!(asked.get(), 3);
    }

    #[test]
    fn work_done_by_the_time_a_peer_left_is_done() {
        // The work ends between the last poll and the question about the peers.
        let peer_left = Cell::new(false);
        let done = || Ok(peer_left.get());
        let ended = || {
            peer_left.set(true);
            Some("the process of rank 1 has ended".to_string())
        };
        let w = Watch {
            limit: Duration::from_secs(30),
            ended: &ended,
        };
        assert_eq!(wait_for(&w, done, || None).unwrap(), Waited::Done);
    }

    #[test]
    fn the_limit_stops_the_wait_and_says_so() {
        let start = Instant::now();
        let w = Watch::alone(Duration::from_millis(50));
        let Waited::Stopped(why) = wait_for(&w, || Ok(false), || None).unwrap() else {
            panic!("the wait never ends");
        };
        assert!(start.elapsed() >= Duration::from_millis(50));
        assert!(why.contains("did not complete within 0.05 s"), "{why}");
    }

    #[test]
    fn a_failing_poll_is_the_error() {
        let w = Watch::alone(Duration::from_secs(5));
        let got = wait_for(
            &w,
            || Err(PerseusError::Device("cuEventQuery failed".into())),
            || None,
        );
        assert!(matches!(got, Err(PerseusError::Device(m)) if m == "cuEventQuery failed"));
    }
}
