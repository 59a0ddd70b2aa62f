//! The control streams, read and written by the engine thread itself: a
//! worker's stream to rank 0, or rank 0's coordinator with a stream from
//! every worker. No reader threads sit between a frame and the engine, so a
//! negotiation round costs one socket hop each way and no thread wake-ups
//! beyond the engines' own.

use super::coordinator::Coordinator;
use super::gather::Gather;
use super::inbox::Inbox;
use super::message::{
    decode_requests, decode_responses, encode_requests, encode_responses, in_parts, Response,
    WireRequest,
};
use super::outgoing::Outgoing;
use crate::error::{PerseusError, Result};
use crate::transport::Control;
use crate::wire::{framed, FrameReader, Reader, Writer, HEADER};
use std::collections::{BTreeMap, HashMap};
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

    /// The whole batches of the kinds in `kinds` that arrived: (kind, payload), a
    /// payload a frame, the parts of a batch together once its last has come.
    fn receive(&mut self, kinds: &[u16]) -> Result<Vec<(u16, Vec<u8>)>> {
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
            let base = k & !MORE;
            if !kinds.contains(&base) {
                return Err(PerseusError::Protocol(format!(
                    "unexpected control frame kind {k:#x}"
                )));
            }
            if k & MORE != 0 {
                self.partial.push(p);
            } else {
                whole.extend(self.partial.drain(..).map(|q| (base, q)));
                whole.push((base, p));
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
    /// Requests from rank `.0` (rank 0 only).
    Requests(usize, Vec<WireRequest>),
    /// Responses from the coordinator, for this rank.
    Responses(Vec<Response>),
    /// The stream from or to rank `.0` failed or closed; `.1` says how.
    Lost(usize, String),
    /// Rank 0: a relay reported rank `.0` gone, for the reason `.1` (with its host).
    Reported(usize, String),
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

/// The shortest time a relay holds requests of names not in the response cache for
/// its other children's ([`Uplink::hold`]): the first step's, and those of kinds never
/// cached.
const RELAY_HOLD: Duration = Duration::from_millis(5);

/// Frame kind of requests a relay passes up for the ranks below it: (origin rank,
/// that rank's batch as it sent it), each.
const FRAME_RELAYED: u16 = 0x304;
/// Frame kind of responses a rank passes down to a child with ranks below it: each
/// response with the ranks it is for.
const FRAME_ROUTED: u16 = 0x305;
/// Frame kind of "rank R is gone, because ...", which a relay passes up when the
/// stream from one of its children broke or went silent.
const FRAME_GONE: u16 = 0x306;

/// One rank this rank hears from in the control plane, and the ranks below it.
struct Child {
    rank: usize,
    /// Its stream (None once lost).
    stream: Option<Stream>,
    /// No rank below it: it gets plain batches of its own responses.
    leaf: bool,
    /// It sent requests since the relay last passed its children's up.
    heard: bool,
}

/// How this rank's engine reaches the coordinator: rank 0 runs it, any other rank
/// sends its requests to its parent; a rank with children relays theirs up and the
/// answers down ([`crate::transport::tree`]).
pub struct Uplink {
    me: usize,
    /// Ranks in the job.
    size: usize,
    /// Rank 0: the negotiation state machine.
    coord: Option<Coordinator>,
    /// The rank this one sends to, and the stream (None for rank 0, or once lost).
    parent: Option<(usize, Option<Stream>)>,
    children: Vec<Child>,
    /// Each rank below this one: the index of the child whose subtree holds it.
    route: HashMap<usize, usize>,
    /// A relay's requests for cached names, each until every rank below that takes
    /// part in it asked.
    gather: Gather,
    /// A relay's other requests not passed up yet, and since when the oldest waits.
    held: Vec<Relayed>,
    held_since: Option<Instant>,
    /// How long a relay holds its own and its children's requests that are not in
    /// the response cache for the rest of them to come ([`RELAY_HOLD`], or
    /// HOROVOD_CYCLE_TIME if longer): it passes them up in one frame once every child
    /// has sent since the last, or once this passed. (Cached names wait in
    /// [`Uplink::gather`] for every rank below instead.)
    hold: Duration,
}

/// A batch of requests as a relay passes it up: the ranks that sent this same batch
/// (ascending), and its payload as they sent it.
type Relayed = super::gather::Gathered;

/// Writes ascending ranks as runs: a count, then (start, length) each.
fn write_runs(w: &mut Writer, ranks: &[usize]) {
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for &r in ranks {
        match runs.last_mut() {
            Some((s, l)) if (*s + *l) as usize == r => *l += 1,
            _ => runs.push((r as u32, 1)),
        }
    }
    w.u32(runs.len() as u32);
    for (s, l) in runs {
        w.u32(s).u32(l);
    }
}

/// Reads what [`write_runs`] wrote, each rank below `size`.
fn read_runs(r: &mut Reader<'_>, size: usize) -> Result<Vec<usize>> {
    let runs = r.u32()? as usize;
    let mut ranks = Vec::new();
    for _ in 0..runs {
        let (s, l) = (r.u32()? as usize, r.u32()? as usize);
        if s.checked_add(l).map_or(true, |e| e > size) {
            return Err(PerseusError::Protocol(format!(
                "ranks {s}..{} of a job of {size}",
                s.saturating_add(l)
            )));
        }
        ranks.extend(s..s + l);
    }
    Ok(ranks)
}

/// Encodes requests a relay passes up: each distinct batch once, with its ranks.
fn encode_relayed(items: &[Relayed]) -> Vec<u8> {
    let mut w = Writer::new();
    w.u32(items.len() as u32);
    for (origins, payload) in items {
        write_runs(&mut w, origins);
        w.bytes(payload);
    }
    w.0
}

fn decode_relayed(buf: &[u8], size: usize) -> Result<Vec<Relayed>> {
    let mut r = Reader::new(buf);
    let n = r.u32()? as usize;
    let mut out = Vec::with_capacity(n.min(4096));
    for _ in 0..n {
        let origins = read_runs(&mut r, size)?;
        out.push((origins, r.bytes()?.to_vec()));
    }
    r.finish()?;
    Ok(out)
}

/// Merges batches that are the same bytes into one item with all their ranks, in the
/// order each first came: in a steady step every rank below a relay sends the same
/// cached ids, which then go up once.
fn merge_relayed(items: Vec<Relayed>) -> Vec<Relayed> {
    let mut out: Vec<Relayed> = Vec::new();
    let mut at: HashMap<Vec<u8>, usize> = HashMap::new();
    for (origins, payload) in items {
        match at.get(&payload) {
            Some(&i) => out[i].0.extend(origins),
            None => {
                at.insert(payload.clone(), out.len());
                out.push((origins, payload));
            }
        }
    }
    for (origins, _) in &mut out {
        origins.sort_unstable();
        origins.dedup();
    }
    out
}

/// A response and the ranks it is for.
type Routed = (Response, Vec<usize>);

/// Encodes routed responses: each response with its ranks as runs (start, length).
fn encode_routed(items: &[Routed]) -> Vec<u8> {
    let mut w = Writer::new();
    w.u32(items.len() as u32);
    for (resp, ranks) in items {
        write_runs(&mut w, ranks);
        w.bytes(&encode_responses(std::slice::from_ref(resp)));
    }
    w.0
}

fn decode_routed(buf: &[u8], size: usize) -> Result<Vec<Routed>> {
    let mut r = Reader::new(buf);
    let n = r.u32()? as usize;
    let mut out = Vec::with_capacity(n.min(4096));
    for _ in 0..n {
        let ranks = read_runs(&mut r, size)?;
        let mut resps = decode_responses(r.bytes()?)?;
        match (resps.pop(), resps.is_empty()) {
            (Some(resp), true) => out.push((resp, ranks)),
            _ => {
                return Err(PerseusError::Protocol(
                    "a routed item holds other than one response".into(),
                ))
            }
        }
    }
    r.finish()?;
    Ok(out)
}

fn encode_gone(items: &[(u32, String)]) -> Vec<u8> {
    let mut w = Writer::new();
    w.u32(items.len() as u32);
    for (rank, why) in items {
        w.u32(*rank).str(why);
    }
    w.0
}

fn decode_gone(buf: &[u8]) -> Result<Vec<(u32, String)>> {
    let mut r = Reader::new(buf);
    let n = r.u32()? as usize;
    let mut out = Vec::with_capacity(n.min(4096));
    for _ in 0..n {
        out.push((r.u32()?, r.str()?));
    }
    r.finish()?;
    Ok(out)
}

impl Uplink {
    /// Takes over the control streams of [`crate::transport::connect_mesh`]; `coord`
    /// serves on rank 0 only. `timeout`: how long a write may find no room before the
    /// peer counts as gone.
    pub fn new(
        control: Control,
        coord: Coordinator,
        timeout: Duration,
        hold: Duration,
    ) -> std::io::Result<Uplink> {
        let mut route = HashMap::new();
        let mut children = Vec::with_capacity(control.children.len());
        for (i, (rank, below, sock)) in control.children.into_iter().enumerate() {
            for &r in &below {
                route.insert(r, i);
            }
            children.push(Child {
                rank,
                stream: Some(Stream::new(sock, timeout)?),
                leaf: below.len() == 1,
                heard: false,
            });
        }
        let parent = match control.parent {
            Some((rank, sock)) => Some((rank, Some(Stream::new(sock, timeout)?))),
            None => None,
        };
        Ok(Uplink {
            me: control.me,
            size: control.size,
            coord: parent.is_none().then_some(coord),
            parent,
            children,
            route,
            gather: Gather::default(),
            held: Vec::new(),
            held_since: None,
            hold: hold.max(RELAY_HOLD),
        })
    }

    /// Rank 0's coordinator.
    pub fn coordinator(&mut self) -> Option<&mut Coordinator> {
        self.coord.as_mut()
    }

    /// Rank 0's coordinator, to look at.
    pub fn coordinator_ref(&self) -> Option<&Coordinator> {
        self.coord.as_ref()
    }

    /// The rank this one sends its requests to (None on rank 0).
    pub fn parent(&self) -> Option<usize> {
        self.parent.as_ref().map(|(r, _)| *r)
    }

    fn streams(&self) -> impl Iterator<Item = &Stream> {
        let up = self.parent.iter().filter_map(|(_, s)| s.as_ref());
        up.chain(self.children.iter().filter_map(|c| c.stream.as_ref()))
    }

    /// What this rank's control streams sent and received so far (a
    /// coordinator's own requests and answers cross no stream).
    pub fn traffic(&self) -> (Traffic, Traffic) {
        let (mut sent, mut received) = (Traffic::default(), Traffic::default());
        for s in self.streams() {
            sent.add(s.sent);
            received.add(s.received);
        }
        (sent, received)
    }

    /// Reads, without blocking, every whole frame the streams hold. A relay passes its
    /// children's requests up at once, and its parent's answers for the ranks below it
    /// down (whole, before this rank acts on any of them).
    pub fn receive(&mut self) -> Vec<Incoming> {
        let mut got = Vec::new();
        let mut up: Vec<Relayed> = Vec::new();
        let mut gone: Vec<(u32, String)> = Vec::new();
        let relay = self.coord.is_none();
        let size = self.size;
        for i in 0..self.children.len() {
            let child = &mut self.children[i];
            let Some(s) = &mut child.stream else { continue };
            let rank = child.rank;
            let frames = s.receive(&[FRAME_REQUESTS, FRAME_RELAYED, FRAME_GONE]);
            let parsed = frames.and_then(|fs| {
                let mut items = Vec::new();
                for (k, p) in fs {
                    match k {
                        FRAME_REQUESTS => items.push((vec![rank], p)),
                        FRAME_RELAYED => items.extend(decode_relayed(&p, size)?),
                        _ => {
                            for (r, why) in decode_gone(&p)? {
                                gone.push((r, why));
                            }
                        }
                    }
                }
                Ok(items)
            });
            match parsed {
                Ok(items) if relay => {
                    child.heard |= !items.is_empty();
                    up.extend(items);
                }
                Ok(items) => {
                    for (origins, p) in items {
                        match decode_requests(&p) {
                            Ok(reqs) => got.extend(
                                origins
                                    .into_iter()
                                    .map(|o| Incoming::Requests(o, reqs.clone())),
                            ),
                            Err(e) => got.extend(
                                origins
                                    .into_iter()
                                    .map(|o| Incoming::Lost(o, e.to_string())),
                            ),
                        }
                    }
                }
                Err(e) => {
                    child.stream = None;
                    got.push(Incoming::Lost(rank, broken(&e)));
                }
            }
        }
        if relay {
            let mut urgent = false;
            for (origins, payload) in up {
                urgent |= self.hold_up(origins, payload);
            }
            self.pass_held(urgent);
            self.pass_up(FRAME_GONE, &gone, encode_gone);
        } else {
            got.extend(
                gone.into_iter()
                    .map(|(r, why)| Incoming::Reported(r as usize, why)),
            );
        }
        if let Some((rank, Some(s))) = &mut self.parent {
            let rank = *rank;
            let frames = s.receive(&[FRAME_RESPONSES, FRAME_ROUTED]);
            let mut mine = Vec::new();
            let mut routed = Vec::new();
            let parsed = frames.and_then(|fs| {
                for (k, p) in fs {
                    if k == FRAME_RESPONSES {
                        mine.push(decode_responses(&p)?);
                    } else {
                        routed.extend(decode_routed(&p, size)?);
                    }
                }
                Ok(())
            });
            match parsed {
                Ok(()) => {
                    if !routed.is_empty() {
                        let own = self.pass_down(routed);
                        mine.push(own);
                    }
                    got.extend(mine.into_iter().map(Incoming::Responses));
                }
                Err(e) => {
                    self.parent = Some((rank, None));
                    got.push(Incoming::Lost(rank, broken(&e)));
                }
            }
        }
        got
    }

    /// Queues `items` for the parent as a batch of `kind` (nothing when empty).
    fn pass_up<T>(&mut self, kind: u16, items: &[T], encode: fn(&[T]) -> Vec<u8>) {
        if items.is_empty() {
            return;
        }
        if let Some((_, Some(s))) = &mut self.parent {
            if let Err(e) = s.post_batch(kind, items, encode) {
                s.broke.get_or_insert(e.into());
            }
        }
    }

    /// A relay: holds a batch that `origins` sent alike, its requests for cached names
    /// in [`Uplink::gather`], the rest in [`Uplink::held`]. True when it holds a join
    /// or shutdown, which goes up at once behind what was held before it.
    fn hold_up(&mut self, origins: Vec<usize>, payload: Vec<u8>) -> bool {
        match decode_requests(&payload) {
            Ok(reqs) => self.hold(origins, reqs),
            // Rank 0 names the rank that sent what cannot be read.
            Err(_) => {
                self.hold_parts(origins, vec![payload]);
                false
            }
        }
    }

    /// [`Uplink::hold_up`] of requests already read.
    fn hold(&mut self, origins: Vec<usize>, reqs: Vec<WireRequest>) -> bool {
        let rest = self.gather.offer(&origins, reqs, Instant::now());
        if !rest.requests.is_empty() {
            let parts = in_parts(&rest.requests, FRAME_BYTES, encode_requests);
            self.hold_parts(origins, parts);
        }
        rest.urgent
    }

    /// Holds encoded batches that `origins` sent, with the other requests.
    fn hold_parts(&mut self, origins: Vec<usize>, parts: Vec<Vec<u8>>) {
        if self.held.is_empty() {
            self.held_since = Some(Instant::now());
        }
        self.held
            .extend(parts.into_iter().map(|part| (origins.clone(), part)));
    }

    /// A relay: passes up what it holds, in one frame: the cached names whose rounds
    /// are whole or late ([`Gather::take`]), and the other requests once every child
    /// still there has sent since the last pass, or the oldest has waited
    /// [`Uplink::hold`] (`now`: all of it, whatever the wait).
    fn pass_held(&mut self, now: bool) {
        let mut items = self.gather.take(Instant::now(), now);
        if !self.held.is_empty() {
            let all = self.children.iter().all(|c| c.heard || c.stream.is_none());
            let due = self.held_since.is_some_and(|t| t.elapsed() >= self.hold);
            if now || all || due {
                items.extend(merge_relayed(std::mem::take(&mut self.held)));
                self.held_since = None;
                self.children.iter_mut().for_each(|c| c.heard = false);
            }
        }
        self.pass_up(FRAME_RELAYED, &items, encode_relayed);
    }

    /// How long until held requests must go up (None: none held).
    pub fn hold_due(&self) -> Option<Duration> {
        let held = self
            .held_since
            .map(|t| self.hold.saturating_sub(t.elapsed()));
        let gathered = self.gather.due(Instant::now());
        held.into_iter().chain(gathered).min()
    }

    /// Reports child `rank` gone (`why`) to the parent (a relay's loss of a child).
    pub fn report_gone(&mut self, rank: usize, why: &str) {
        self.pass_up(FRAME_GONE, &[(rank as u32, why.to_string())], encode_gone);
    }

    /// Writes each child its share of `items` (whole), and returns this rank's own.
    fn pass_down(&mut self, items: Vec<Routed>) -> Vec<Response> {
        if self.coord.is_none() {
            for (resp, ranks) in &items {
                self.gather.learn(resp, ranks);
            }
        }
        let mut own = Vec::new();
        let mut per_child: Vec<Vec<Routed>> = vec![Vec::new(); self.children.len()];
        for (resp, ranks) in items {
            let mut split: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
            for r in ranks {
                if r == self.me {
                    own.push(resp.clone());
                } else if let Some(&c) = self.route.get(&r) {
                    split.entry(c).or_default().push(r);
                }
            }
            for (c, ranks) in split {
                per_child[c].push((resp.clone(), ranks));
            }
        }
        for (child, items) in self.children.iter_mut().zip(per_child) {
            if items.is_empty() {
                continue;
            }
            let Some(s) = child.stream.as_mut() else {
                continue;
            };
            if child.leaf {
                let resps: Vec<Response> = items.into_iter().map(|(r, _)| r).collect();
                s.queue(FRAME_RESPONSES, &resps, encode_responses);
            } else {
                s.queue(FRAME_ROUTED, &items, encode_routed);
            }
            if let Err(e) = s.flush(true) {
                s.broke.get_or_insert(e.into());
            }
        }
        own
    }

    /// Queues this rank's own requests for its parent; an error when the stream is
    /// gone or failed at once (rank 0 may be in a collective with this rank, so it is
    /// never waited for).
    ///
    /// A relay holds them with its children's, to go up in the same frame.
    pub fn post_requests(&mut self, wire: &[WireRequest]) -> std::result::Result<(), String> {
        if !self.children.is_empty() && matches!(self.parent, Some((_, Some(_)))) {
            let urgent = self.hold(vec![self.me], wire.to_vec());
            self.pass_held(urgent);
            return Ok(());
        }
        match &mut self.parent {
            Some((_, Some(s))) => s
                .post_batch(FRAME_REQUESTS, wire, encode_requests)
                .map_err(|e| e.to_string()),
            _ => Err("the connection is closed".to_string()),
        }
    }

    /// Whether the peers this rank waits for are there: its parent while it has
    /// operations pending (`waiting`); its children then too, and on rank 0 every child
    /// while its coordinator has names some ranks have not asked for (but ranks that
    /// announced their shutdown). A stream quiet for [`QUIET_BEFORE_PING`] gets a
    /// ping; one that then stays silent for its timeout is reported
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
        let coord_waits = self.coord.as_ref().is_some_and(Coordinator::waiting);
        for c in &mut self.children {
            let shut = self.coord.as_ref().is_some_and(|k| k.has_shut(c.rank));
            look(c.rank, &mut c.stream, (waiting || coord_waits) && !shut);
        }
        if let Some((rank, slot)) = &mut self.parent {
            look(*rank, slot, waiting);
        }
        (lost, next)
    }

    /// Rank 0: sends the coordinator's answers, down each child's stream (each child
    /// with ranks below it gets theirs too), and rank 0's own into `local`. A failed
    /// write shows up as a lost stream on the next [`Uplink::receive`].
    pub fn dispatch(&mut self, out: Outgoing, local: &mut Vec<Response>) {
        if self.coord.is_none() {
            return;
        }
        let routed: Vec<Routed> = out.into_iter().map(|(to, resp)| (resp, to)).collect();
        local.extend(self.pass_down(routed));
    }

    /// Sleeps until a control stream is readable, `timeout` passes (`None`:
    /// no limit) or, given an `inbox`, something is pushed to it (returning
    /// at once when it already holds something). Without an inbox, callers'
    /// pushes cost them no wake-up system call.
    pub fn sleep<T>(&self, inbox: Option<&Inbox<T>>, timeout: Option<Duration>) {
        // Held requests go up on time whatever the caller waits for.
        let timeout = match (timeout, self.hold_due()) {
            (Some(t), Some(h)) => Some(t.min(h)),
            (t, h) => t.or(h),
        };
        let streams: Vec<&Stream> = self.streams().collect();
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
            s.receive(&[FRAME_REQUESTS]).unwrap();
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
        assert!(a.receive(&[FRAME_REQUESTS]).unwrap().is_empty());
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

    #[test]
    fn a_relay_sends_the_same_batch_of_many_ranks_once_with_their_ranks() {
        let same = encode_requests(&[WireRequest::Cached(3), WireRequest::Cached(4)]);
        let other = encode_requests(&[WireRequest::Cached(9)]);
        let items = vec![
            (vec![7], same.clone()),
            (vec![9, 10], other.clone()),
            (vec![3, 4, 5], same.clone()),
            (vec![8], same.clone()),
        ];
        let merged = merge_relayed(items);
        assert_eq!(
            merged,
            vec![
                (vec![3, 4, 5, 7, 8], same.clone()),
                (vec![9, 10], other.clone())
            ]
        );
        // On the wire: each distinct batch once, its ranks as runs.
        let wire = encode_relayed(&merged);
        assert!(
            wire.len() < 2 * (same.len() + other.len()) + 64,
            "{}",
            wire.len()
        );
        assert_eq!(decode_relayed(&wire, 11).unwrap(), merged);
        assert!(decode_relayed(&wire, 10).is_err(), "rank 10 of a job of 10");
        // Routed responses keep their ranks the same way.
        let resp = Response::Abort {
            message: "x".into(),
        };
        let routed = vec![(resp, vec![0, 1, 2, 5])];
        assert_eq!(decode_routed(&encode_routed(&routed), 6).unwrap(), routed);
    }
}
