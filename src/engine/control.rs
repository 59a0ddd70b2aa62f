//! The control streams, read and written by the engine thread itself: a
//! worker's stream to rank 0, or rank 0's coordinator with a stream from
//! every worker. No reader threads sit between a frame and the engine, so a
//! negotiation round costs one socket hop each way and no thread wake-ups
//! beyond the engines' own.

use super::coordinator::Coordinator;
use super::inbox::Inbox;
use super::message::{
    decode_requests, decode_responses, encode_responses, in_parts, Response, WireRequest,
};
use super::outgoing::Outgoing;
use crate::error::{PerseusError, Result};
use crate::transport::Control;
use crate::wire::{framed, FrameReader, HEADER};
use std::collections::BTreeMap;
use std::io::Write;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// Frame kind of a batch of requests (worker to rank 0).
pub const FRAME_REQUESTS: u16 = 0x300;
/// Frame kind of a batch of responses (rank 0 to a worker).
pub const FRAME_RESPONSES: u16 = 0x301;
/// Frame kind of "are you there?", sent on a control stream that has been quiet for
/// [`QUIET_BEFORE_PING`] while this end waits for its peer; the peer's engine answers
/// [`FRAME_PONG`] as it reads it. Neither carries a payload.
const FRAME_PING: u16 = 0x302;
/// Frame kind of the answer to [`FRAME_PING`].
const FRAME_PONG: u16 = 0x303;
/// How long a control stream may be quiet, while this end waits for its peer, before
/// it asks whether the peer is there. A peer that then answers nothing (no frame at
/// all) within the stream's timeout (GLOO_TIMEOUT_SECONDS) counts as gone: its
/// process is stopped or frozen, or its host cannot be reached. A peer that is only
/// busy (computing, in another collective of its own, in Python) answers at once,
/// since its engine thread reads the stream.
const QUIET_BEFORE_PING: Duration = Duration::from_secs(2);
/// Set in the kind of every frame of a batch but its last: the receiver acts on
/// none of a batch until all of it arrived, as if it had come as one frame (a
/// worker that ran the first part's collectives would stop reading the rest,
/// which rank 0 must write before it joins them).
const MORE: u16 = 0x10;

/// A batch of requests or responses goes as frames of at most about this many
/// bytes ([`in_parts`]), far below the frame limit whatever the batch.
const FRAME_BYTES: usize = 1 << 20;

/// Frames and bytes (headers included) that crossed control streams one way.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Traffic {
    /// Frames.
    pub frames: u64,
    /// Bytes, frame headers included.
    pub bytes: u64,
}

impl Traffic {
    fn add(&mut self, other: Traffic) {
        self.frames += other.frames;
        self.bytes += other.bytes;
    }

    fn frame(&mut self, payload: usize) {
        self.frames += 1;
        self.bytes += (HEADER + payload) as u64;
    }
}

/// One non-blocking control stream, the frame it is in the middle of reading,
/// and what waits to be written.
///
/// A send never waits on a peer that may itself be waiting to write to us or
/// to run a collective with us. A worker's requests are queued and written as
/// the socket takes them ([`Stream::post_batch`], flushed on every
/// [`Uplink::receive`] and woken for by [`Uplink::sleep`]). Rank 0's responses
/// must be whole at the worker before rank 0 runs them, so
/// [`Uplink::dispatch`] writes them all, reading what the worker sends
/// meanwhile into `early`. Two engines that send large batches at the same
/// moment thus both go on.
pub struct Stream {
    sock: TcpStream,
    reader: FrameReader,
    /// Frames read while a send waited, not yet received.
    early: Vec<(u16, Vec<u8>)>,
    /// How the stream broke while a send waited or flushed; reported after `early`.
    broke: Option<PerseusError>,
    /// The parts of a batch whose last frame has not arrived yet.
    partial: Vec<Vec<u8>>,
    /// Bytes queued to write, from `written` on.
    out: Vec<u8>,
    written: usize,
    /// When the queue last moved (or filled).
    moved: Instant,
    /// How long the queue may stand still, or a ping go unanswered, before the peer
    /// counts as gone.
    timeout: Duration,
    /// When a frame last arrived (or the stream began).
    heard: Instant,
    /// When a ping went out that no frame has followed yet.
    pinged: Option<Instant>,
    /// What this end queued to send, and what it received, so far.
    sent: Traffic,
    received: Traffic,
}

impl Stream {
    fn new(sock: TcpStream, timeout: Duration) -> std::io::Result<Stream> {
        sock.set_nonblocking(true)?;
        Ok(Stream {
            sock,
            reader: FrameReader::default(),
            early: Vec::new(),
            broke: None,
            partial: Vec::new(),
            out: Vec::new(),
            written: 0,
            moved: Instant::now(),
            timeout,
            heard: Instant::now(),
            pinged: None,
            sent: Traffic::default(),
            received: Traffic::default(),
        })
    }

    /// Whether frames (or the end of the stream) wait, already read.
    fn pending(&self) -> bool {
        !self.early.is_empty() || self.broke.is_some()
    }

    /// Whether bytes wait to be written.
    fn unwritten(&self) -> bool {
        self.written < self.out.len()
    }

    /// Payloads of the whole batches of `kind` that arrived, a payload a frame.
    fn receive(&mut self, kind: u16) -> Result<Vec<Vec<u8>>> {
        if self.broke.is_none() {
            if let Err(e) = self.flush(false) {
                self.broke = Some(e.into());
            }
        }
        let mut frames = std::mem::take(&mut self.early);
        match &self.broke {
            Some(e) if frames.is_empty() => return Err(e.clone()),
            Some(_) => {}
            None => match self.reader.read_from(&mut self.sock) {
                Ok(more) => frames.extend(more),
                Err(e) if frames.is_empty() => return Err(e),
                Err(e) => self.broke = Some(e),
            },
        }
        self.heard_from(&frames);
        let mut whole = Vec::new();
        let mut asked = false;
        for (k, p) in frames {
            // Pings and their answers are not negotiation: they count in no Traffic.
            if k == FRAME_PING {
                asked = true;
                continue;
            }
            if k == FRAME_PONG {
                continue; // its arrival is its message (`heard`, above)
            }
            self.received.frame(p.len());
            if k == kind | MORE {
                self.partial.push(p);
            } else if k == kind {
                whole.append(&mut self.partial);
                whole.push(p);
            } else {
                return Err(PerseusError::Protocol(format!(
                    "unexpected control frame kind {k:#x}"
                )));
            }
        }
        if asked && self.broke.is_none() {
            self.queue_frame(FRAME_PONG);
            if let Err(e) = self.flush(false) {
                self.broke = Some(e.into());
            }
        }
        Ok(whole)
    }

    /// Frames arrived (if any): the peer is there, and any ping is answered.
    fn heard_from(&mut self, frames: &[(u16, Vec<u8>)]) {
        if !frames.is_empty() {
            self.heard = Instant::now();
            self.pinged = None;
        }
    }

    /// Before queueing: a queue written out starts anew (and moves from now).
    fn drained(&mut self) {
        if !self.unwritten() {
            self.out.clear();
            self.written = 0;
            self.moved = Instant::now();
        }
    }

    /// Queues one frame of `kind` without a payload (a ping or its answer, which
    /// count in no Traffic).
    fn queue_frame(&mut self, kind: u16) {
        self.drained();
        self.out.extend_from_slice(&framed(kind, &[]));
    }

    /// While this end waits for the peer (`waiting`), at `now`: asks the peer whether
    /// it is there once the stream has been quiet for [`QUIET_BEFORE_PING`], and
    /// returns why it counts as gone once a ping went unanswered for the timeout.
    /// Also returns how long until the next look is due (None: not waiting).
    fn watch(&mut self, waiting: bool, now: Instant) -> (Option<String>, Option<Duration>) {
        if !waiting || self.broke.is_some() {
            return (None, None);
        }
        if let Some(at) = self.pinged {
            let silent = now.saturating_duration_since(at);
            if silent >= self.timeout {
                let quiet = now.saturating_duration_since(self.heard);
                return (
                    Some(format!(
                        "it has answered nothing for {:.0} s: its process is stopped or \
                         frozen, or its host cannot be reached (GLOO_TIMEOUT_SECONDS)",
                        quiet.as_secs_f64()
                    )),
                    None,
                );
            }
            return (None, Some(self.timeout - silent));
        }
        let quiet = now.saturating_duration_since(self.heard);
        if quiet < QUIET_BEFORE_PING {
            return (None, Some(QUIET_BEFORE_PING - quiet));
        }
        self.queue_frame(FRAME_PING);
        if let Err(e) = self.flush(false) {
            self.broke = Some(e.into());
            return (None, Some(Duration::ZERO));
        }
        self.pinged = Some(now);
        (None, Some(self.timeout))
    }

    /// Queues `items` encoded by `encode`, as frames of about [`FRAME_BYTES`].
    fn queue<T>(&mut self, kind: u16, items: &[T], encode: fn(&[T]) -> Vec<u8>) {
        self.drained();
        let parts = in_parts(items, FRAME_BYTES, encode);
        let last = parts.len() - 1;
        for (i, part) in parts.iter().enumerate() {
            let k = if i == last { kind } else { kind | MORE };
            self.sent.frame(part.len());
            self.out.extend_from_slice(&framed(k, part));
        }
    }

    /// Queues a batch and writes what the socket takes now.
    pub fn post_batch<T>(
        &mut self,
        kind: u16,
        items: &[T],
        encode: fn(&[T]) -> Vec<u8>,
    ) -> std::io::Result<()> {
        self.queue(kind, items, encode);
        self.flush(false)
    }

    /// Writes what is queued: what the socket takes now, or (`all`) everything,
    /// reading what the peer sends while the socket buffer is full. Fails once
    /// the queue stood still for the timeout.
    fn flush(&mut self, all: bool) -> std::io::Result<()> {
        while self.unwritten() {
            match self.sock.write(&self.out[self.written..]) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.written += n;
                    self.moved = Instant::now();
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let left = self.timeout.saturating_sub(self.moved.elapsed());
                    if left.is_zero() {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!("the peer read nothing for {:?}", self.timeout),
                        ));
                    }
                    if !all {
                        return Ok(());
                    }
                    self.wait_writable(left);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Waits up to `left` for room to write, reading whole frames into `early`.
    fn wait_writable(&mut self, left: Duration) {
        let reading = self.broke.is_none();
        let mut fd = libc::pollfd {
            fd: self.sock.as_raw_fd(),
            events: libc::POLLOUT | if reading { libc::POLLIN } else { 0 },
            revents: 0,
        };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut fd, 1, ms) };
        if reading && fd.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
            match self.reader.read_from(&mut self.sock) {
                Ok(frames) => {
                    self.heard_from(&frames);
                    self.early.extend(frames)
                }
                Err(e) => self.broke = Some(e),
            }
        }
    }
}

/// What arrived on the control streams.
pub enum Incoming {
    /// Requests from worker `.0` (rank 0 only).
    Requests(usize, Vec<WireRequest>),
    /// Responses from the coordinator (workers only).
    Responses(Vec<Response>),
    /// The stream from rank `.0` failed or closed; `.1` says how.
    Lost(usize, String),
    /// Rank `.0` answered nothing for the timeout while this rank waited for it
    /// (`.1` says so); its stream is closed, and it counts as gone.
    Silent(usize, String),
}

/// Why a control stream broke, as every rank is told: a connection that closed or was
/// reset says that the peer's process ended without `shutdown()` (its script finished
/// while others still ran collectives, it crashed, or it was killed), or that its host
/// dropped off; a frame the protocol does not allow says only that.
fn broken(e: &PerseusError) -> String {
    match e {
        PerseusError::Io(_) => format!(
            "{e}: its process ended without shutting Perseus down (its script finished, \
             crashed or was killed) or its host dropped off"
        ),
        _ => e.to_string(),
    }
}

/// How this rank's engine reaches the coordinator.
pub enum Uplink {
    /// Rank 0: the coordinator and a stream from every worker.
    Coordinator {
        /// The negotiation state machine.
        coord: Coordinator,
        /// `workers[r]`: the stream from rank r, `None` for rank 0 and lost ranks.
        workers: Vec<Option<Stream>>,
    },
    /// Any other rank: the stream to rank 0 (`None` once lost).
    Worker(Option<Stream>),
}

impl Uplink {
    /// Takes over the control streams of [`crate::transport::connect_mesh`].
    /// `timeout`: how long a write may find no room before the peer counts as gone.
    pub fn new(control: Control, coord: Coordinator, timeout: Duration) -> std::io::Result<Uplink> {
        Ok(match control {
            Control::Coordinator(streams) => Uplink::Coordinator {
                coord,
                workers: streams
                    .into_iter()
                    .map(|s| s.map(|s| Stream::new(s, timeout)).transpose())
                    .collect::<std::io::Result<_>>()?,
            },
            Control::Worker(s) => Uplink::Worker(Some(Stream::new(s, timeout)?)),
        })
    }

    /// What this rank's control streams sent and received so far (a
    /// coordinator's own requests and answers cross no stream).
    pub fn traffic(&self) -> (Traffic, Traffic) {
        let (mut sent, mut received) = (Traffic::default(), Traffic::default());
        let streams: Vec<&Stream> = match self {
            Uplink::Coordinator { workers, .. } => workers.iter().flatten().collect(),
            Uplink::Worker(s) => s.iter().collect(),
        };
        for s in streams {
            sent.add(s.sent);
            received.add(s.received);
        }
        (sent, received)
    }

    /// Reads, without blocking, every whole frame the streams hold.
    pub fn receive(&mut self) -> Vec<Incoming> {
        let mut got = Vec::new();
        match self {
            Uplink::Coordinator { workers, .. } => {
                for (rank, slot) in workers.iter_mut().enumerate() {
                    let Some(s) = slot else { continue };
                    let frames = s.receive(FRAME_REQUESTS).and_then(|ps| {
                        ps.iter()
                            .map(|p| decode_requests(p))
                            .collect::<Result<Vec<_>>>()
                    });
                    match frames {
                        Ok(batches) => got.extend(
                            batches
                                .into_iter()
                                .map(|reqs| Incoming::Requests(rank, reqs)),
                        ),
                        Err(e) => {
                            *slot = None;
                            got.push(Incoming::Lost(rank, broken(&e)));
                        }
                    }
                }
            }
            Uplink::Worker(slot) => {
                let Some(s) = slot else { return got };
                let frames = s.receive(FRAME_RESPONSES).and_then(|ps| {
                    ps.iter()
                        .map(|p| decode_responses(p))
                        .collect::<Result<Vec<_>>>()
                });
                match frames {
                    Ok(batches) => got.extend(batches.into_iter().map(Incoming::Responses)),
                    Err(e) => {
                        *slot = None;
                        got.push(Incoming::Lost(0, broken(&e)));
                    }
                }
            }
        }
        got
    }

    /// Whether the peers this rank waits for are there: a worker waits for rank 0 while
    /// it has operations pending (`waiting`); rank 0 for every worker that has not
    /// announced its shutdown while it has operations pending or its coordinator has
    /// names some ranks have not asked for. A stream quiet for [`QUIET_BEFORE_PING`]
    /// gets a ping; one that then stays silent for its timeout is reported
    /// ([`Incoming::Silent`]) and closed, so that the peer, should it wake, fails too.
    /// Also returns how long until the next look is due (None: nothing waits).
    pub fn watch(&mut self, waiting: bool) -> (Vec<Incoming>, Option<Duration>) {
        let now = Instant::now();
        let mut lost = Vec::new();
        let mut next: Option<Duration> = None;
        let mut look = |rank: usize, slot: &mut Option<Stream>, waiting: bool| {
            let Some(s) = slot else { return };
            let (gone, due) = s.watch(waiting, now);
            if let Some(why) = gone {
                *slot = None;
                lost.push(Incoming::Silent(rank, why));
            }
            next = [next, due].into_iter().flatten().min();
        };
        match self {
            Uplink::Coordinator { coord, workers } => {
                let waiting = waiting || coord.waiting();
                for (rank, slot) in workers.iter_mut().enumerate() {
                    look(rank, slot, waiting && !coord.has_shut(rank));
                }
            }
            Uplink::Worker(slot) => look(0, slot, waiting),
        }
        (lost, next)
    }

    /// Sends the coordinator's answers: to each worker's stream, and rank 0's
    /// own into `local`. A failed write shows up as a lost stream on the next
    /// [`Uplink::receive`].
    pub fn dispatch(&mut self, out: Outgoing, local: &mut Vec<Response>) {
        let Uplink::Coordinator { workers, .. } = self else {
            return;
        };
        let mut per_rank: BTreeMap<usize, Vec<Response>> = BTreeMap::new();
        for (to, resp) in out {
            for r in to {
                per_rank.entry(r).or_default().push(resp.clone());
            }
        }
        for (r, resps) in per_rank {
            if r == 0 {
                local.extend(resps);
            } else if let Some(s) = workers.get_mut(r).and_then(Option::as_mut) {
                s.queue(FRAME_RESPONSES, &resps, encode_responses);
                if let Err(e) = s.flush(true) {
                    s.broke.get_or_insert(e.into());
                }
            }
        }
    }

    /// Sleeps until a control stream is readable, `timeout` passes (`None`:
    /// no limit) or, given an `inbox`, something is pushed to it (returning
    /// at once when it already holds something). Without an inbox, callers'
    /// pushes cost them no wake-up system call.
    pub fn sleep<T>(&self, inbox: Option<&Inbox<T>>, timeout: Option<Duration>) {
        let streams: Vec<&Stream> = match self {
            Uplink::Coordinator { workers, .. } => workers.iter().flatten().collect(),
            Uplink::Worker(s) => s.iter().collect(),
        };
        // Frames a send read early are not on the socket any more: no waiting for them.
        if streams.iter().any(|s| s.pending()) {
            return;
        }
        if inbox.is_some_and(|i| !i.park()) {
            return;
        }
        let mut fds: Vec<libc::pollfd> = inbox
            .iter()
            .map(|i| libc::pollfd {
                fd: i.fd(),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        fds.extend(streams.iter().map(|s| libc::pollfd {
            fd: s.sock.as_raw_fd(),
            events: libc::POLLIN | if s.unwritten() { libc::POLLOUT } else { 0 },
            revents: 0,
        }));
        let ts = timeout.map(|d| libc::timespec {
            tv_sec: d.as_secs() as libc::time_t,
            tv_nsec: d.subsec_nanos() as libc::c_long,
        });
        let tp = ts.as_ref().map_or(std::ptr::null(), |t| t as *const _);
        // SAFETY: `fds` and `ts` outlive the call; a null sigmask keeps the current one.
        unsafe {
            libc::ppoll(
                fds.as_mut_ptr(),
                fds.len() as libc::nfds_t,
                tp,
                std::ptr::null(),
            )
        };
        if let Some(i) = inbox {
            i.unpark();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// Two ends of one loopback connection as control streams.
    fn pair(timeout: Duration) -> (Stream, Stream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (
            Stream::new(a, timeout).unwrap(),
            Stream::new(b, timeout).unwrap(),
        )
    }

    /// Receives on `s` until a frame came (loopback delivery is quick, not instant).
    fn receive_some(s: &mut Stream) {
        let before = s.heard;
        for _ in 0..500 {
            s.receive(FRAME_REQUESTS).unwrap();
            if s.heard > before {
                return;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        panic!("no frame arrived");
    }

    #[test]
    fn a_quiet_peer_is_pinged_and_one_that_answers_is_there() {
        let timeout = Duration::from_millis(300);
        let (mut a, mut b) = pair(timeout);
        let t = a.heard;
        // Not waiting: nothing to look at, whatever the time.
        assert_eq!(a.watch(false, t + Duration::from_secs(99)), (None, None));
        // Waiting, quiet for less than QUIET_BEFORE_PING: no ping yet.
        let (gone, due) = a.watch(true, t + Duration::from_millis(500));
        assert!(gone.is_none() && due == Some(QUIET_BEFORE_PING - Duration::from_millis(500)));
        assert_eq!(a.written, 0);
        // Quiet for longer: a ping, and the next look at the timeout.
        let later = t + QUIET_BEFORE_PING + Duration::from_millis(100);
        assert_eq!(a.watch(true, later), (None, Some(timeout)));
        assert_eq!(a.written, HEADER, "one frame without a payload");
        // The peer's engine reads it and answers; the answer clears the ping.
        receive_some(&mut b);
        assert_eq!(b.written, HEADER, "b answered the ping");
        receive_some(&mut a);
        assert!(a.pinged.is_none());
        // Neither counts as negotiation traffic.
        for s in [&a, &b] {
            assert_eq!(
                (s.sent, s.received),
                (Traffic::default(), Traffic::default())
            );
        }
        let (gone, _) = a.watch(true, later + timeout * 2);
        assert!(gone.is_none(), "{gone:?}");
    }

    #[test]
    fn a_ping_unanswered_for_the_timeout_names_the_peer_gone() {
        let timeout = Duration::from_millis(300);
        let (mut a, _b) = pair(timeout); // b is frozen: it never reads
        let t = a.heard + QUIET_BEFORE_PING;
        assert_eq!(a.watch(true, t), (None, Some(timeout)));
        assert!(a.receive(FRAME_REQUESTS).unwrap().is_empty());
        let (gone, due) = a.watch(true, t + Duration::from_millis(100));
        assert!(gone.is_none() && due == Some(Duration::from_millis(200)));
        let (gone, _) = a.watch(true, t + timeout);
        let why = gone.expect("the peer counts as gone");
        assert!(
            why.contains("stopped or frozen") && why.contains("GLOO_TIMEOUT_SECONDS"),
            "{why}"
        );
        assert_eq!(a.written, HEADER, "one ping, not one a look");
    }
}
