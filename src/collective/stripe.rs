//! Striping (PERSEUS_ALLREDUCE_STREAMS): one collective over a large buffer
//! becomes `k` independent collectives over `k` slices, slice `i` on
//! stream `i` (its own TCP connections) and its own thread, so several
//! cores feed the sockets and reduce what arrives. A buffer is striped only
//! where every link of the group has those streams: ranks on different
//! hosts, or any ranks when shared memory is off. Every rank reaches the
//! same decision from the same inputs (size, streams, hosts).

use super::{hosts_of, partition, split_mut, Comm};
use crate::error::{PerseusError, Result};
use crate::kernels::AlignedBuf;
use std::ops::Range;

/// Smallest slice worth a stream of its own (bytes).
pub const MIN_STRIPE: usize = 1 << 20;

/// How many slices a collective over `len` bytes in `comm` is cut into:
/// one per [`MIN_STRIPE`] bytes, at most the streams the group's links have.
pub fn stripes(comm: &dyn Comm, len: usize) -> usize {
    let streams = comm.streams();
    if streams <= 1 || comm.size() <= 1 || len < 2 * MIN_STRIPE {
        return 1;
    }
    if comm.shares_memory() && hosts_of(comm).iter().any(|g| g.len() > 1) {
        return 1;
    }
    streams.min(len / MIN_STRIPE)
}

/// Runs `f(comm, slice, scratch)` on [`stripes`] slices of `buf` (whole
/// elements of `elem` bytes) at once: slice 0 on this thread with
/// `scratch`, slice `i` on stream `i` on a thread of its own. Returns the
/// first error; every slice runs to its end either way.
pub fn striped<F>(
    comm: &dyn Comm,
    buf: &mut [u8],
    elem: usize,
    scratch: &mut AlignedBuf,
    f: F,
) -> Result<()>
where
    F: Fn(&dyn Comm, &mut [u8], &mut AlignedBuf) -> Result<()> + Sync,
{
    let k = stripes(comm, buf.len());
    if k == 1 {
        return f(comm, buf, scratch);
    }
    let bytes: Vec<Range<usize>> = partition(buf.len() / elem, k)
        .into_iter()
        .map(|p| p.start * elem..p.end * elem)
        .collect();
    let mut slices = split_mut(buf, &bytes).into_iter();
    let first = slices.next().expect("one slice at least");
    let f = &f;
    std::thread::scope(|scope| {
        let threads: Vec<_> = slices
            .enumerate()
            .map(|(i, slice)| {
                std::thread::Builder::new()
                    .name(format!("perseus-stream{}", i + 1))
                    .spawn_scoped(scope, move || {
                        let channel = comm.channel(i + 1).ok_or_else(|| {
                            PerseusError::Protocol(format!("no stream {} to stripe on", i + 1))
                        })?;
                        f(&*channel, slice, &mut AlignedBuf::default())
                    })
            })
            .collect();
        let mut result = f(comm, first, scratch);
        for t in threads {
            let r = match t {
                Ok(t) => t.join().unwrap_or_else(|_| {
                    Err(PerseusError::Protocol("a stream thread panicked".into()))
                }),
                Err(e) => Err(e.into()),
            };
            if result.is_ok() {
                result = r;
            }
        }
        result
    })
}
