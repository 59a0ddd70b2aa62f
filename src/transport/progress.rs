//! Drives several non-blocking sends and receives to completion with poll(2).

use super::shm::Segment;
use super::Link;
use crate::error::{PerseusError, Result};
use crate::wire::{header, parse_header, HEADER};
use std::io::ErrorKind;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// Frame kind of collective data.
const DATA: u16 = 0x100;

/// One outgoing message: a header, then `data`.
pub struct Send<'a> {
    peer: usize,
    hdr: [u8; HEADER],
    data: &'a [u8],
    pos: usize,
}

impl<'a> Send<'a> {
    /// A message of `data` to global rank `peer`.
    pub fn new(peer: usize, data: &'a [u8]) -> Self {
        Send {
            peer,
            hdr: header(DATA, data.len()),
            data,
            pos: 0,
        }
    }
    fn done(&self) -> bool {
        self.pos == HEADER + self.data.len()
    }
    /// Renames the peer (a process-set rank to a global one).
    pub fn map_peer(&mut self, f: impl Fn(usize) -> usize) {
        self.peer = f(self.peer);
    }
    /// The peer rank.
    pub fn peer(&self) -> usize {
        self.peer
    }
    /// The payload.
    pub fn data(&self) -> &[u8] {
        self.data
    }
}

/// One incoming message of exactly `data.len()` bytes.
pub struct Recv<'a> {
    peer: usize,
    hdr: [u8; HEADER],
    data: &'a mut [u8],
    pos: usize,
}

impl<'a> Recv<'a> {
    /// A message from global rank `peer` into `data`.
    pub fn new(peer: usize, data: &'a mut [u8]) -> Self {
        Recv {
            peer,
            hdr: [0; HEADER],
            data,
            pos: 0,
        }
    }
    fn done(&self) -> bool {
        self.pos == HEADER + self.data.len()
    }
    /// Renames the peer (a process-set rank to a global one).
    pub fn map_peer(&mut self, f: impl Fn(usize) -> usize) {
        self.peer = f(self.peer);
    }
    /// The peer rank.
    pub fn peer(&self) -> usize {
        self.peer
    }
    /// The buffer to fill.
    pub fn data_mut(&mut self) -> &mut [u8] {
        self.data
    }
}

fn link(links: &[Link], peer: usize) -> Result<&Link> {
    match links.get(peer) {
        Some(Link::None) | None => Err(PerseusError::InvalidArgument(format!(
            "no connection to rank {peer}"
        ))),
        Some(l) => Ok(l),
    }
}

fn lost(peer: usize, what: &str) -> PerseusError {
    PerseusError::Peer(format!(
        "rank {peer} {what}; it probably exited or crashed (see its log)"
    ))
}

/// Makes what progress is possible without blocking; true if any byte moved.
fn step_send(links: &[Link], s: &mut Send<'_>) -> Result<bool> {
    let mut moved = false;
    let st = link(links, s.peer)?;
    while !s.done() {
        let chunk = if s.pos < HEADER {
            &s.hdr[s.pos..]
        } else {
            &s.data[s.pos - HEADER..]
        };
        match st.write(chunk) {
            Ok(0) => return Err(lost(s.peer, "closed its connection")),
            Ok(n) => {
                s.pos += n;
                moved = true;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(lost(s.peer, &format!("could not be written to ({e})"))),
        }
    }
    Ok(moved)
}

fn step_recv(links: &[Link], r: &mut Recv<'_>) -> Result<bool> {
    let mut moved = false;
    let st = link(links, r.peer)?;
    while !r.done() {
        let res = if r.pos < HEADER {
            st.read(&mut r.hdr[r.pos..])
        } else {
            st.read(&mut r.data[r.pos - HEADER..])
        };
        match res {
            Ok(0) => return Err(lost(r.peer, "closed its connection")),
            Ok(n) => {
                let before = r.pos;
                r.pos += n;
                moved = true;
                if before < HEADER && r.pos >= HEADER {
                    let (_, len) = parse_header(&r.hdr, usize::MAX).map_err(|e| {
                        PerseusError::Protocol(format!("from rank {}: {e}", r.peer))
                    })?;
                    if len != r.data.len() {
                        return Err(PerseusError::Protocol(format!(
                            "rank {} sent {len} bytes where {} were expected (ranks disagree \
                             about the operation)",
                            r.peer,
                            r.data.len()
                        )));
                    }
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(lost(r.peer, &format!("could not be read from ({e})"))),
        }
    }
    Ok(moved)
}

/// Longest sleep on the doorbell before re-checking TCP and the clock.
const SHM_NAP: Duration = Duration::from_millis(100);

/// Runs all transfers; see [`super::Mesh::transfer`]. `shm` is the host's
/// segment and this rank's member index, when some peers share the host.
pub fn run(
    links: &[Link],
    shm: Option<(&Segment, usize)>,
    timeout: Duration,
    sends: &mut [Send<'_>],
    recvs: &mut [Recv<'_>],
    on_recv: &mut dyn FnMut(usize, &[u8]),
) -> Result<()> {
    let mut last_progress = Instant::now();
    let mut fds: Vec<libc::pollfd> = Vec::with_capacity(sends.len() + recvs.len());
    loop {
        // Read the doorbell before trying, so a ring that fills or drains
        // after the attempt wakes the wait below.
        let bell = shm.map(|(seg, me)| seg.bell(me));
        let mut moved = false;
        for s in sends.iter_mut() {
            moved |= step_send(links, s)?;
        }
        for (i, r) in recvs.iter_mut().enumerate() {
            if step_recv(links, r)? && r.pos > HEADER {
                moved = true;
                on_recv(i, &r.data[..r.pos - HEADER]);
            }
        }
        if sends.iter().all(Send::done) && recvs.iter().all(Recv::done) {
            return Ok(());
        }
        if moved {
            last_progress = Instant::now();
            continue;
        }
        let waited = last_progress.elapsed();
        if waited >= timeout {
            let who: Vec<usize> = recvs
                .iter()
                .filter(|r| !r.done())
                .map(|r| r.peer)
                .chain(sends.iter().filter(|s| !s.done()).map(|s| s.peer))
                .collect();
            return Err(PerseusError::Peer(format!(
                "timed out after {}s waiting for rank(s) {who:?} (GLOO_TIMEOUT_SECONDS)",
                timeout.as_secs()
            )));
        }
        let left = timeout - waited;
        fds.clear();
        let mut shm_pending = false;
        let pending = sends
            .iter()
            .filter(|s| !s.done())
            .map(|s| (s.peer, libc::POLLOUT))
            .chain(
                recvs
                    .iter()
                    .filter(|r| !r.done())
                    .map(|r| (r.peer, libc::POLLIN)),
            );
        for (peer, events) in pending {
            match link(links, peer)? {
                Link::Tcp(t) => fds.push(libc::pollfd {
                    fd: t.as_raw_fd(),
                    events,
                    revents: 0,
                }),
                _ => shm_pending = true,
            }
        }
        match (shm, shm_pending, fds.is_empty()) {
            (Some((seg, me)), true, true) => seg.wait(me, bell.unwrap_or(0), left.min(SHM_NAP)),
            _ => {
                // TCP only: sleep in poll. Both kinds: poll briefly, then
                // look at the rings again.
                let cap = if shm_pending { 1 } else { 1000 };
                let ms = left.as_millis().clamp(1, cap) as libc::c_int;
                // SAFETY: `fds` is a valid array of pollfd for the duration of the call.
                let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
                if rc < 0 {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != ErrorKind::Interrupted {
                        return Err(e.into());
                    }
                }
            }
        }
    }
}
