//! Drives several non-blocking sends and receives to completion: sockets are
//! waited on with poll(2), shared-memory rings with the host's doorbell.
//!
//! On every link a message is a frame header, the payload, and zero padding
//! to a multiple of 8 bytes, so every payload starts 8-byte aligned in a
//! shared-memory ring and a receiver can reduce straight out of the ring.

use super::shm::Segment;
use super::{Link, Row};
use crate::dtype::{DataType, ReduceOp};
use crate::error::{PerseusError, Result};
use crate::kernels::{from_half, reduce_half_into, reduce_into, scale, AlignedBuf, STREAM_FROM};
use crate::wire::{header, parse_header, HEADER};
use std::io::ErrorKind;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// Frame kind of collective data.
const DATA: u16 = 0x100;
/// Zero bytes appended to payloads.
const PAD: [u8; 8] = [0; 8];
/// Bytes a reducing receive reads from a socket at a time.
const STAGING: usize = 256 << 10;

fn pad(len: usize) -> usize {
    (8 - len % 8) % 8
}

/// Bytes a message of `len` payload bytes takes on a link: header, payload, padding.
pub fn message_bytes(len: usize) -> usize {
    HEADER + len + pad(len)
}

/// One outgoing message: a header, then `data`, then padding.
pub struct Send<'a> {
    peer: usize,
    hdr: [u8; HEADER],
    data: &'a [u8],
    pos: usize,
}

impl<'a> Send<'a> {
    /// A message of `data` to rank `peer`.
    pub fn new(peer: usize, data: &'a [u8]) -> Self {
        Send {
            peer,
            hdr: header(DATA, data.len()),
            data,
            pos: 0,
        }
    }
    fn total(&self) -> usize {
        message_bytes(self.data.len())
    }
    fn done(&self) -> bool {
        self.pos == self.total()
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

/// What a receive does with the payload as it arrives.
#[derive(Clone, Copy)]
enum Landing {
    /// Copies it into `data`.
    Copy,
    /// Reduces it into `data` (same element type), then scales what it
    /// reduced by the factor (1: left as is) while it is still in cache.
    Reduce(DataType, ReduceOp, f64),
    /// The payload is float16 for the float32 `data` (half as many bytes):
    /// widened and reduced into it, or (`None`) widened and stored.
    Widen(Option<ReduceOp>),
}

/// One incoming message for `data`, copied into it, reduced into it, or
/// widened from float16 into it.
pub struct Recv<'a> {
    peer: usize,
    hdr: [u8; HEADER],
    data: &'a mut [u8],
    /// A reducing receive's other operand when it is not `data` itself:
    /// `data[i] = op(base[i], msg[i])` (same length as `data`).
    base: Option<&'a [u8]>,
    pos: usize,
    landing: Landing,
    staging: Option<(AlignedBuf, usize)>,
    /// Whether a copied payload lands with stores that bypass the cache.
    stream: bool,
}

impl<'a> Recv<'a> {
    /// A message from rank `peer` copied into `data`.
    pub fn new(peer: usize, data: &'a mut [u8]) -> Self {
        Recv {
            peer,
            hdr: [0; HEADER],
            data,
            base: None,
            pos: 0,
            landing: Landing::Copy,
            staging: None,
            stream: false,
        }
    }
    /// Marks a copied message as one piece of a result of `len` bytes, so
    /// that a large result is written past the cache ([`STREAM_FROM`]).
    pub fn of_result(mut self, len: usize) -> Self {
        self.stream = len >= STREAM_FROM;
        self
    }
    /// A message from rank `peer` reduced into `data` (`data[i] = op(data[i], msg[i])`).
    pub fn reducing(peer: usize, data: &'a mut [u8], dtype: DataType, op: ReduceOp) -> Self {
        Self::reducing_scaled(peer, data, dtype, op, 1.0)
    }
    /// [`Recv::reducing`], then every reduced element multiplied by `factor`
    /// (the last step of a reduce-scatter folds an Average's division in).
    pub fn reducing_scaled(
        peer: usize,
        data: &'a mut [u8],
        dtype: DataType,
        op: ReduceOp,
        factor: f64,
    ) -> Self {
        Recv {
            landing: Landing::Reduce(dtype, op, factor),
            ..Recv::new(peer, data)
        }
    }
    /// [`Recv::reducing_scaled`] with the other operand elsewhere: `data[i] =
    /// op(base[i], msg[i]) * factor`, so an out-of-place reduction writes its
    /// output once instead of copying its input there first.
    pub fn reducing_onto(
        peer: usize,
        data: &'a mut [u8],
        base: &'a [u8],
        dtype: DataType,
        op: ReduceOp,
        factor: f64,
    ) -> Self {
        assert_eq!(data.len(), base.len(), "reducing_onto: lengths differ");
        Recv {
            base: Some(base),
            ..Recv::reducing_scaled(peer, data, dtype, op, factor)
        }
    }
    /// A float16 message from rank `peer` for the float32 buffer `data`:
    /// each element widened, then reduced into `data` with `op`, or stored
    /// (`None`). The message is half as long as `data`.
    pub fn widening(peer: usize, data: &'a mut [u8], op: Option<ReduceOp>) -> Self {
        Recv {
            landing: Landing::Widen(op),
            ..Recv::new(peer, data)
        }
    }
    /// Payload bytes on the link.
    fn wire_len(&self) -> usize {
        match self.landing {
            Landing::Widen(_) => self.data.len() / 2,
            _ => self.data.len(),
        }
    }
    fn total(&self) -> usize {
        message_bytes(self.wire_len())
    }
    fn done(&self) -> bool {
        self.pos == self.total()
    }
    /// Renames the peer (a process-set rank to a global one).
    pub fn map_peer(&mut self, f: impl Fn(usize) -> usize) {
        self.peer = f(self.peer);
    }
    /// The peer rank.
    pub fn peer(&self) -> usize {
        self.peer
    }
    /// Length of the expected payload.
    pub fn len(&self) -> usize {
        self.wire_len()
    }
    /// True for an empty payload.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
    /// Delivers a whole payload at once (in-memory transports in tests).
    pub fn deliver(&mut self, msg: &[u8]) {
        assert_eq!(msg.len(), self.wire_len(), "message length");
        land(self.landing, self.data, self.base, msg);
        self.pos = self.total();
    }
}

/// Bytes of a reduction onto a separate base done at a time: the base's block
/// is copied to the destination, then reduced there while still in cache.
const BASE_BLOCK: usize = 8 << 10;

/// Lands payload bytes `src` on `dst` (the matching part of the data), with
/// `base` the matching part of a reducing receive's other operand, if apart.
fn land(landing: Landing, dst: &mut [u8], base: Option<&[u8]>, src: &[u8]) {
    match landing {
        Landing::Copy => dst.copy_from_slice(src),
        Landing::Reduce(dtype, op, factor) => {
            let Some(base) = base else {
                reduce_into(dst, src, dtype, op);
                scale(dst, dtype, factor);
                return;
            };
            let block = BASE_BLOCK - BASE_BLOCK % dtype.size();
            for ((d, b), s) in dst
                .chunks_mut(block)
                .zip(base.chunks(block))
                .zip(src.chunks(block))
            {
                d.copy_from_slice(b);
                reduce_into(d, s, dtype, op);
                scale(d, dtype, factor);
            }
        }
        Landing::Widen(Some(op)) => reduce_half_into(dst, src, op),
        Landing::Widen(None) => from_half(dst, src, 1.0),
    }
}

fn link(links: &Row, peer: usize) -> Result<&Link> {
    match super::at(links, peer) {
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

/// Maps an I/O result: `Ok(None)` when the link would block.
fn io(peer: usize, r: std::io::Result<usize>) -> Result<Option<usize>> {
    match r {
        Ok(0) => Err(lost(peer, "closed its connection")),
        Ok(n) => Ok(Some(n)),
        Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
            Ok(None)
        }
        Err(e) => Err(lost(peer, &format!("failed ({e})"))),
    }
}

/// Makes what progress is possible without blocking; true if any byte moved.
fn step_send(links: &Row, s: &mut Send<'_>) -> Result<bool> {
    let mut moved = false;
    let l = link(links, s.peer)?;
    let len = s.data.len();
    while !s.done() {
        let chunk = if s.pos < HEADER {
            &s.hdr[s.pos..]
        } else if s.pos < HEADER + len {
            &s.data[s.pos - HEADER..]
        } else {
            &PAD[s.pos - HEADER - len..pad(len)]
        };
        match io(s.peer, l.write(chunk))? {
            Some(n) => {
                s.pos += n;
                moved = true;
            }
            None => break,
        }
    }
    Ok(moved)
}

fn step_recv(links: &Row, r: &mut Recv<'_>) -> Result<bool> {
    let mut moved = false;
    let l = link(links, r.peer)?;
    let len = r.wire_len();
    while !r.done() {
        let got = if r.pos < HEADER {
            let got = io(r.peer, l.read(&mut r.hdr[r.pos..]))?;
            if let Some(n) = got {
                if r.pos + n == HEADER {
                    check_header(r)?;
                }
            }
            got
        } else if r.pos < HEADER + len {
            let off = r.pos - HEADER;
            match r.landing {
                Landing::Copy if r.stream => io(r.peer, l.read_streaming(&mut r.data[off..]))?,
                Landing::Copy => io(r.peer, l.read(&mut r.data[off..]))?,
                landing => recv_landing(l, r, off, landing)?,
            }
        } else {
            let mut sink = [0u8; 8];
            io(r.peer, l.read(&mut sink[..r.total() - r.pos]))?
        };
        match got {
            Some(n) => {
                r.pos += n;
                moved = true;
            }
            None => break,
        }
    }
    Ok(moved)
}

fn check_header(r: &Recv<'_>) -> Result<()> {
    let (_, len) = parse_header(&r.hdr, usize::MAX)
        .map_err(|e| PerseusError::Protocol(format!("from rank {}: {e}", r.peer)))?;
    if len != r.wire_len() {
        return Err(PerseusError::Protocol(format!(
            "rank {} sent {len} bytes where {} were expected (ranks disagree about the \
             operation)",
            r.peer,
            r.wire_len()
        )));
    }
    Ok(())
}

/// Lands incoming payload bytes on `r.data` (reduced or widened), `off`
/// payload bytes having been taken from the link so far: straight out of the
/// ring for shared memory, through a staging buffer for sockets (where a
/// partial element is kept for the next read). Returns the payload bytes
/// taken from the link.
fn recv_landing(l: &Link, r: &mut Recv<'_>, off: usize, landing: Landing) -> Result<Option<usize>> {
    // Payload bytes per element, and data bytes per payload byte.
    let (es, widen) = match landing {
        Landing::Reduce(dtype, ..) => (dtype.size(), 1),
        _ => (2, 2),
    };
    if let Link::Shm {
        seg, me, peer, rx, ..
    } = l
    {
        let dst = &mut r.data[off * widen..];
        let base = r.base.map(|b| &b[off * widen..]);
        let ring = seg.ring(*rx, *peer, *me);
        return io(
            r.peer,
            ring.consume(dst.len() / widen, es, |at, src| {
                let part = at * widen..(at + src.len()) * widen;
                land(landing, &mut dst[part.clone()], base.map(|b| &b[part]), src)
            }),
        );
    }
    let len = r.wire_len();
    let (buf, carry) = r
        .staging
        .get_or_insert_with(|| (AlignedBuf::zeroed(STAGING), 0));
    let landed = off - *carry;
    let want = (STAGING - *carry).min(len - off);
    let Some(n) = io(
        r.peer,
        l.read(&mut buf.as_mut_slice()[*carry..*carry + want]),
    )?
    else {
        return Ok(None);
    };
    let have = *carry + n;
    let whole = have - have % es;
    let part = landed * widen..(landed + whole) * widen;
    land(
        landing,
        &mut r.data[part.clone()],
        r.base.map(|b| &b[part]),
        &buf.as_slice()[..whole],
    );
    buf.as_mut_slice().copy_within(whole..have, 0);
    *carry = have - whole;
    Ok(Some(n))
}

/// Longest sleep on the doorbell before re-checking TCP and the clock.
const SHM_NAP: Duration = Duration::from_millis(100);
/// How often a waiting transfer checks that every peer still lives.
const SCAN_EVERY: Duration = Duration::from_millis(20);

/// When a transfer that makes no progress gives up.
pub enum Limit<'f> {
    /// Fail after this long.
    Fail(Duration),
    /// Call the function after each such period; go on while it says Ok.
    Ask(Duration, &'f mut dyn FnMut() -> Result<()>),
}

/// Runs all transfers; see [`super::Mesh::transfer`]. `shm` is the host's
/// segment and this rank's member index, when some peers share the host;
/// a rank waiting only on shared memory yields the core for `spin` before
/// it sleeps on the doorbell.
pub fn run(
    links: &Row,
    shm: Option<(&Segment, usize)>,
    limit: Limit<'_>,
    spin: Duration,
    sends: &mut [Send<'_>],
    recvs: &mut [Recv<'_>],
) -> Result<()> {
    run_until_done(links, shm, limit, spin, sends, recvs).map_err(|e| also_gone(links, e))
}

/// A peer error lists every other peer whose connection has ended too: the
/// first loss a rank sees may be a survivor that left after its own error,
/// while the rank that died first is among the others.
fn also_gone(links: &Row, e: PerseusError) -> PerseusError {
    match e {
        PerseusError::Peer(msg) => {
            let named = super::named_in(&msg, links.len());
            let ended = super::ended_besides(links, &named, super::SETTLE);
            // The mesh adds their hosts.
            PerseusError::Peer(super::with_ended(msg, &ended, |p| format!("rank {p} ")))
        }
        other => other,
    }
}

fn run_until_done(
    links: &Row,
    shm: Option<(&Segment, usize)>,
    mut limit: Limit<'_>,
    spin: Duration,
    sends: &mut [Send<'_>],
    recvs: &mut [Recv<'_>],
) -> Result<()> {
    let mut last_progress = Instant::now();
    let mut last_scan = Instant::now();
    let mut fds: Vec<libc::pollfd> = Vec::with_capacity(sends.len() + recvs.len());
    loop {
        // Read the doorbell before trying, so a ring that fills or drains
        // after the attempt wakes the wait below.
        let bell = shm.map(|(seg, me)| seg.bell(me));
        let mut moved = false;
        for s in sends.iter_mut() {
            moved |= step_send(links, s)?;
        }
        for r in recvs.iter_mut() {
            moved |= step_recv(links, r)?;
        }
        if sends.iter().all(Send::done) && recvs.iter().all(Recv::done) {
            return Ok(());
        }
        if moved {
            last_progress = Instant::now();
            continue;
        }
        let mut waited = last_progress.elapsed();
        let timeout = match &mut limit {
            Limit::Ask(every, alive) if waited >= *every => {
                alive()?;
                last_progress = Instant::now();
                waited = Duration::ZERO;
                *every
            }
            Limit::Ask(every, _) => *every,
            Limit::Fail(t) => *t,
        };
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
        if waited >= spin && last_scan.elapsed() >= SCAN_EVERY {
            // Waiting: make sure every peer still lives, not only those of
            // this transfer, so a rank learns of a death from the dead
            // rank itself rather than from a survivor that left after it.
            last_scan = Instant::now();
            if let Some(p) =
                (0..links.len()).find(|&p| super::at(links, p).is_some_and(Link::peer_gone))
            {
                return Err(lost(p, "ended (its connection closed)"));
            }
        }
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
            // Peers on this host usually answer within microseconds: yield
            // the core for a while before sleeping in the kernel.
            (Some(_), true, true) if waited < spin => std::thread::yield_now(),
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
