//! A rank's links, made on demand: a rank holds streams only to the peers its
//! collectives have used so far (ring neighbours, tree and recursive-doubling
//! partners: O(log n) of them), never a full mesh. Each rank keeps its listener open
//! for the whole job on an acceptor thread of its own ([`Acceptor`]), whose [`Gate`]
//! vets every connection, so a peer may link to it whatever its engine is doing.
//!
//! Whichever side of a pair needs the link first dials it: a send never waits for the
//! receiver's engine to reach the collective. When both dial at once, the higher
//! rank's dial wins: an acceptor refuses a lower peer's dial while its own to that
//! peer is under way ([`HELLO_CROSSED`]), and the loser takes the winner's connection
//! from its acceptor. A pair of ranks on one host gets a pair of shared-memory rings
//! from the dialer's share of the host's segment, named in the hello, beside one idle
//! TCP stream that shows the peer's death; a pair across hosts gets one TCP stream,
//! and its other `PERSEUS_ALLREDUCE_STREAMS` streams when a striped collective first
//! uses them ([`Table::link_stream`]).

use super::shm::Segment;
use super::Link;
use crate::auth;
use crate::deadline::{Deadlined, HANDSHAKE_TIME};
use crate::error::{PerseusError, Result};
use crate::gate::{self, Gate};
use crate::wire::{read_frame, write_frame, Reader, Writer};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Acceptor → dialer: the connection is admitted.
const HELLO_OK: u16 = 0x201;
/// Acceptor → dialer: refused, with why.
const HELLO_ERR: u16 = 0x202;
/// Acceptor → dialer: refused because this end is dialing the dialer too, and wins
/// (its rank is the higher): the dialer takes the winner's connection instead.
const HELLO_CROSSED: u16 = 0x203;
/// Hello channel of a data stream.
pub(super) const CHANNEL_DATA: u8 = 0;
/// Hello channel of a control stream (a worker's to rank 0).
pub(super) const CHANNEL_CONTROL: u8 = 1;
/// A hello's ring slot when the pair gets no shared-memory rings.
const NO_SLOT: u32 = u32::MAX;

/// The fields of a hello: sender rank, channel, stream, ring slot.
pub(super) fn hello(rank: usize, channel: u8, stream: usize, slot: u32) -> Vec<u8> {
    let mut w = Writer::new();
    w.u32(rank as u32).u8(channel).u8(stream as u8).u32(slot);
    w.0
}

/// Where the pair with one peer stands.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Pair {
    /// Not linked, nobody dialing.
    Idle,
    /// This rank is dialing it.
    Dialing,
    /// This rank's dial crossed the peer's, which wins: its connection is on the way.
    Awaiting,
    /// Linked by the dial of the rank given (all streams once [`Table::linked`]).
    Won(usize),
}

/// This rank's share of its host's segment, and the host's ranks.
pub(super) struct Host {
    /// The segment.
    pub seg: Arc<Segment>,
    /// Each rank's member index in the segment (None: another host).
    pub member: Vec<Option<usize>>,
    /// Ring pairs each member may hand out ([`super::shm::slots_for`]).
    pub slots: usize,
    /// The next of this rank's slots to hand out.
    pub next: Mutex<usize>,
}

impl Host {
    /// A ring pair for a new link dialed by this rank, if any is left.
    fn take_slot(&self, me: usize) -> Option<u32> {
        let mine = self.member[me]?;
        let mut next = self.next.lock().unwrap();
        (*next < self.slots).then(|| {
            *next += 1;
            (mine * self.slots + *next - 1) as u32
        })
    }
}

/// How this rank reaches its peers.
pub(super) struct Reach {
    /// This rank.
    pub me: usize,
    /// The ranks whose control streams come to this one ([`super::tree`]).
    pub children: Vec<usize>,
    /// Every rank's listening address.
    pub addrs: Vec<String>,
    /// Streams per peer: 1 where the pair shares memory, else the job's streams.
    pub streams: Vec<usize>,
    /// The job secret.
    pub secret: String,
    /// How long a dial may take, and a link be waited for.
    pub timeout: Duration,
    /// The host's segment, where the ranks of this host share memory.
    pub host: Option<Host>,
}

/// Every link of a rank, made or being made.
pub(super) struct Table {
    /// `rows[s][peer]`: stream `s` to `peer`.
    pub rows: Vec<Vec<OnceLock<Link>>>,
    pairs: Mutex<Vec<Pair>>,
    changed: Condvar,
    /// Control streams dialed to this rank, by sender.
    pub control: Mutex<Vec<Option<TcpStream>>>,
    /// Peers linked so far.
    linked: std::sync::atomic::AtomicUsize,
    /// Held while this rank dials a pair's stream other than the first.
    extra_dials: Mutex<()>,
    reach: Reach,
}

impl Table {
    /// An empty table for `reach.addrs.len()` ranks and `streams` streams a pair at most.
    pub fn new(reach: Reach, streams: usize) -> Table {
        let n = reach.addrs.len();
        Table {
            rows: (0..streams)
                .map(|_| (0..n).map(|_| OnceLock::new()).collect())
                .collect(),
            pairs: Mutex::new(vec![Pair::Idle; n]),
            changed: Condvar::new(),
            control: Mutex::new((0..n).map(|_| None).collect()),
            linked: std::sync::atomic::AtomicUsize::new(0),
            extra_dials: Mutex::new(()),
            reach,
        }
    }

    /// How many peers this rank has linked to so far.
    pub fn linked_peers(&self) -> usize {
        self.linked.load(Ordering::Relaxed)
    }

    /// Stores stream `s` to `peer`, counting the peer once its stream 0 is in.
    fn store(&self, s: usize, peer: usize, link: Link) {
        if self.rows[s][peer].set(link).is_ok() && s == 0 {
            self.linked.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// This rank.
    pub fn me(&self) -> usize {
        self.reach.me
    }

    /// True when stream 0 to `peer` is there.
    fn linked(&self, peer: usize) -> bool {
        self.rows[0][peer].get().is_some()
    }

    /// Makes sure stream `s` to `peer` exists. Stream 0 first: dialed by whichever rank
    /// needs it first, or taken from the crossing dial of a higher peer that won. The
    /// pair's other streams (between hosts, PERSEUS_ALLREDUCE_STREAMS) only once a
    /// striped collective uses them, each dialed by the rank that dialed stream 0 while
    /// the other waits for it: both run the stripe on that stream at once.
    pub fn link_stream(&self, peer: usize, s: usize) -> Result<()> {
        self.link(peer)?;
        if s == 0 || self.rows[s][peer].get().is_some() {
            return Ok(());
        }
        if s >= self.reach.streams[peer] {
            return Err(PerseusError::InvalidArgument(format!(
                "no stream {s} to rank {peer}"
            )));
        }
        let me = self.reach.me;
        let winner = match self.pairs.lock().unwrap()[peer] {
            Pair::Won(d) => d,
            _ => me,
        };
        if winner == me {
            let _one = self.extra_dials.lock().unwrap();
            if self.rows[s][peer].get().is_none() {
                let r = &self.reach;
                let fields = hello(me, CHANNEL_DATA, s, NO_SLOT);
                match dial(&r.addrs[peer], peer, &r.secret, &fields, r.timeout)? {
                    Dialed::Admitted(c) => {
                        let link = self.make_link(peer, c, None, true)?;
                        self.store(s, peer, link);
                        self.changed.notify_all();
                    }
                    Dialed::Crossed => {
                        return Err(PerseusError::Protocol(format!(
                            "rank {peer} refused stream {s} of a pair this rank dialed"
                        )))
                    }
                }
            }
            return Ok(());
        }
        let deadline = Instant::now() + self.reach.timeout;
        let mut pairs = self.pairs.lock().unwrap();
        while self.rows[s][peer].get().is_none() {
            let now = Instant::now();
            if now >= deadline {
                return Err(PerseusError::Peer(format!(
                    "rank {peer} did not open stream {s} to rank {me} within {:?} \
                     (GLOO_TIMEOUT_SECONDS)",
                    self.reach.timeout
                )));
            }
            let wait = (deadline - now).min(Duration::from_millis(100));
            pairs = self.changed.wait_timeout(pairs, wait).unwrap().0;
        }
        Ok(())
    }

    /// Makes sure stream 0 to `peer` exists: dials it, or waits for the crossing dial
    /// of a higher peer that won.
    pub fn link(&self, peer: usize) -> Result<()> {
        if peer >= self.reach.addrs.len() || peer == self.reach.me {
            return Err(PerseusError::InvalidArgument(format!(
                "no connection to rank {peer}"
            )));
        }
        let deadline = Instant::now() + self.reach.timeout;
        let mut pairs = self.pairs.lock().unwrap();
        loop {
            if self.linked(peer) {
                return Ok(());
            }
            match pairs[peer] {
                Pair::Idle => {
                    pairs[peer] = Pair::Dialing;
                    drop(pairs);
                    let dialed = self.dial_first(peer);
                    pairs = self.pairs.lock().unwrap();
                    match dialed {
                        Ok(true) => pairs[peer] = Pair::Won(self.reach.me),
                        // Crossed: the peer's dial wins (the acceptor may hold it already).
                        Ok(false) => {
                            if pairs[peer] == Pair::Dialing {
                                pairs[peer] = Pair::Awaiting;
                            }
                        }
                        Err(e) => {
                            if pairs[peer] == Pair::Dialing {
                                pairs[peer] = Pair::Idle;
                            }
                            self.changed.notify_all();
                            return Err(e);
                        }
                    }
                    self.changed.notify_all();
                    if self.linked(peer) {
                        return Ok(());
                    }
                }
                // Another thread of this rank dials it, or the peer's dial is arriving.
                Pair::Dialing | Pair::Awaiting | Pair::Won(_) => {}
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(PerseusError::Peer(format!(
                    "rank {peer} did not complete its connection to rank {} within {:?} \
                     (GLOO_TIMEOUT_SECONDS)",
                    self.reach.me, self.reach.timeout
                )));
            }
            let wait = (deadline - now).min(Duration::from_millis(100));
            pairs = self.changed.wait_timeout(pairs, wait).unwrap().0;
        }
    }

    /// Dials stream 0 to `peer` (with a ring slot where it shares this host). Ok(false):
    /// the peer refused because its own dial crossed this one and wins.
    fn dial_first(&self, peer: usize) -> Result<bool> {
        let r = &self.reach;
        let slot = match &r.host {
            Some(h) if h.member[peer].is_some() => h.take_slot(r.me),
            _ => None,
        };
        let fields = hello(r.me, CHANNEL_DATA, 0, slot.unwrap_or(NO_SLOT));
        let conn = match dial(&r.addrs[peer], peer, &r.secret, &fields, r.timeout)? {
            Dialed::Admitted(c) => c,
            Dialed::Crossed => return Ok(false),
        };
        let link = self.make_link(peer, conn, slot, true)?;
        self.store(0, peer, link);
        Ok(true)
    }

    /// The link to `peer` over `conn`, with the rings of `slot` where it has one
    /// (`dialer`: this rank dialed it, and writes the slot's first ring).
    fn make_link(
        &self,
        peer: usize,
        conn: TcpStream,
        slot: Option<u32>,
        dialer: bool,
    ) -> Result<Link> {
        conn.set_nonblocking(true)?;
        conn.set_nodelay(true)?;
        let (Some(host), Some(slot)) = (&self.reach.host, slot) else {
            return Ok(Link::Tcp(conn));
        };
        let (me, them) = (
            host.member[self.reach.me].expect("a member of the host"),
            host.member[peer].expect("a member of the host"),
        );
        let (first, second) = (2 * slot as usize, 2 * slot as usize + 1);
        let (tx, rx) = if dialer {
            (first, second)
        } else {
            (second, first)
        };
        Ok(Link::Shm {
            seg: host.seg.clone(),
            me,
            peer: them,
            tx,
            rx,
            alive: Some(conn),
        })
    }

    /// The acceptor's verdict on a data stream `s` dialed by `from` (with `slot`), and,
    /// when admitted, its storing. Err: the refusal's kind and why.
    fn admit_data(
        &self,
        from: usize,
        s: usize,
        slot: u32,
        conn: TcpStream,
    ) -> std::result::Result<(), (u16, String, TcpStream)> {
        let me = self.reach.me;
        let mut pairs = self.pairs.lock().unwrap();
        if s >= self.reach.streams[from] {
            let why = format!("rank {from} has no stream {s} to rank {me}");
            return Err((HELLO_ERR, why, conn));
        }
        let slot = (slot != NO_SLOT).then_some(slot);
        match (pairs[from], s) {
            (Pair::Idle | Pair::Awaiting, 0) => {}
            (Pair::Dialing, 0) if from > me => {}
            (Pair::Dialing, 0) => {
                let why = format!("rank {me} is dialing rank {from} too, and wins");
                return Err((HELLO_CROSSED, why, conn));
            }
            (Pair::Won(d), s) if s > 0 && d == from => {}
            // Linked already, by a dial that crossed this one: the dialer has the link
            // (or its acceptor is storing it).
            (Pair::Won(_), 0) => {
                let why = format!("rank {from} is linked to rank {me} already");
                return Err((HELLO_CROSSED, why, conn));
            }
            _ => {
                let why = format!("rank {from} is already connected to rank {me} (stream {s})");
                return Err((HELLO_ERR, why, conn));
            }
        }
        if let Some(slot) = slot {
            let fits = match &self.reach.host {
                Some(h) => {
                    h.member[from].is_some_and(|m| (slot as usize) / h.slots == m)
                        && h.member[me].is_some()
                }
                None => false,
            };
            if !fits || s > 0 {
                let why = format!("rank {from} named ring slot {slot}, which is not its own");
                return Err((HELLO_ERR, why, conn));
            }
        }
        if write_frame(&mut Deadlined::new(&conn, HANDSHAKE_TIME), HELLO_OK, &[]).is_err() {
            return Ok(()); // it went away: as if it never came
        }
        let link = match self.make_link(from, conn, slot, false) {
            Ok(l) => l,
            Err(_) => return Ok(()),
        };
        pairs[from] = Pair::Won(from);
        self.store(s, from, link);
        drop(pairs);
        self.changed.notify_all();
        Ok(())
    }

    /// Stores a control stream from `from` (or refuses a second one).
    fn admit_control(
        &self,
        from: usize,
        conn: TcpStream,
    ) -> std::result::Result<(), (u16, String, TcpStream)> {
        let mut control = self.control.lock().unwrap();
        if control[from].is_some() {
            let why = format!(
                "rank {from} already has a control stream to rank {}",
                self.reach.me
            );
            return Err((HELLO_ERR, why, conn));
        }
        if write_frame(&mut Deadlined::new(&conn, HANDSHAKE_TIME), HELLO_OK, &[]).is_ok() {
            control[from] = Some(conn);
            drop(control);
            self.changed.notify_all();
        }
        Ok(())
    }

    /// Waits until a control stream arrived from each of `from` (or the timeout passed)
    /// and takes them; Err names the ranks that did not come.
    pub fn take_control(&self, from: &[usize]) -> Result<Vec<(usize, TcpStream)>> {
        let deadline = Instant::now() + self.reach.timeout;
        let mut control = self.control.lock().unwrap();
        loop {
            let missing: Vec<usize> = from
                .iter()
                .copied()
                .filter(|&r| control[r].is_none())
                .collect();
            if missing.is_empty() {
                return Ok(from
                    .iter()
                    .map(|&r| (r, control[r].take().expect("arrived")))
                    .collect());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(PerseusError::Peer(format!(
                    "rank {}: ranks {missing:?} did not connect within {:?}",
                    self.reach.me, self.reach.timeout
                )));
            }
            // The pairs' lock guards the wake-ups; the control table has its own.
            drop(control);
            let pairs = self.pairs.lock().unwrap();
            let _ = self
                .changed
                .wait_timeout(pairs, (deadline - now).min(Duration::from_millis(50)))
                .unwrap();
            control = self.control.lock().unwrap();
        }
    }

    /// Stores a proven connection whose hello [`impossible`] passed, or tells the
    /// dialer why not.
    fn admit(&self, a: gate::Admitted) {
        let me = self.reach.me;
        let conn = a.conn;
        // Blocking for the verdict's few bytes; a link is made non-blocking again.
        let _ = conn.set_nonblocking(false);
        let verdict = match parse_hello(&a.fields) {
            None => Err((HELLO_ERR, "malformed hello".to_string(), conn)),
            Some((from, CHANNEL_DATA, s, slot)) => self.admit_data(from, s, slot, conn),
            Some((from, CHANNEL_CONTROL, _, _)) if self.reach.children.contains(&from) => {
                self.admit_control(from, conn)
            }
            Some((from, CHANNEL_CONTROL, _, _)) => Err((
                HELLO_ERR,
                format!("unexpected control connection from rank {from}"),
                conn,
            )),
            Some((_, ch, _, _)) => Err((HELLO_ERR, format!("unknown channel {ch}"), conn)),
        };
        if let Err((kind, why, conn)) = verdict {
            refuse(me, &a.peer, conn, kind, &why);
        }
    }
}

/// Logs why rank `me` dropped a connection from `peer`.
fn dropped(me: usize, peer: &str, why: &str) {
    crate::log!(
        crate::log::Level::Warning,
        "rank {me}: dropped a connection from {peer}: {why}"
    );
}

/// What a dial came to.
enum Dialed {
    Admitted(TcpStream),
    /// The peer is dialing this rank too, and its dial wins.
    Crossed,
}

/// Connects to `addr`, proves the secret with the hello `fields`, waits for the answer.
fn dial(addr: &str, peer: usize, secret: &str, fields: &[u8], timeout: Duration) -> Result<Dialed> {
    let what = format!("rank {peer}");
    let mut s = crate::deadline::connect_within(addr, &what, timeout, Duration::from_millis(20))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(timeout))?;
    let refused = |e: PerseusError| PerseusError::Peer(format!("rank {peer} at {addr}: {e}"));
    auth::dial(&mut s, secret, fields).map_err(refused)?;
    let (k, p) = read_frame(&mut s).map_err(refused)?;
    match k {
        HELLO_OK => {
            s.set_read_timeout(None)?;
            Ok(Dialed::Admitted(s))
        }
        HELLO_CROSSED => Ok(Dialed::Crossed),
        _ => Err(PerseusError::Peer(format!(
            "rank {peer} at {addr} refused the connection: {}",
            String::from_utf8_lossy(&p)
        ))),
    }
}

/// Dials the control stream of rank `me` to rank `to` at `addr`.
pub(super) fn dial_control(
    addr: &str,
    me: usize,
    to: usize,
    secret: &str,
    timeout: Duration,
) -> Result<TcpStream> {
    match dial(
        addr,
        to,
        secret,
        &hello(me, CHANNEL_CONTROL, 0, NO_SLOT),
        timeout,
    )? {
        Dialed::Admitted(s) => Ok(s),
        Dialed::Crossed => Err(PerseusError::Protocol(format!(
            "rank {to} answered a control stream as if it crossed a dial"
        ))),
    }
}

/// The thread that keeps a rank's listener open for the whole job: it vets every new
/// connection at the [`Gate`] from the moment the rank publishes its address, and
/// hands the admitted ones to the [`Table`] once the rank has read every entry and
/// installed it ([`Acceptor::install`]; until then they wait). Stopped and joined on
/// drop.
pub(super) struct Acceptor {
    stop: Arc<AtomicBool>,
    bell: Arc<OwnedFd>,
    table: Arc<OnceLock<Arc<Table>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Acceptor {
    /// Starts accepting at `gate` for rank `me` of `size`.
    pub fn start(mut gate: Gate, me: usize, size: usize) -> Result<Acceptor> {
        // SAFETY: eventfd returns a new descriptor (or -1, checked).
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(crate::limits::explained(std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a new descriptor nothing else owns.
        let bell = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        let stop = Arc::new(AtomicBool::new(false));
        let table: Arc<OnceLock<Arc<Table>>> = Arc::new(OnceLock::new());
        let (stop2, bell2, table2) = (stop.clone(), bell.clone(), table.clone());
        let thread = std::thread::Builder::new()
            .name("perseus-accept".into())
            .spawn(move || {
                let mut early: Vec<gate::Admitted> = Vec::new();
                while !stop2.load(Ordering::SeqCst) {
                    let mut fds = vec![gate::pollin(bell2.as_raw_fd())];
                    gate.fds(&mut fds);
                    gate::wait(&mut fds, gate.due());
                    let mut v: u64 = 0;
                    // SAFETY: reads 8 bytes into `v` from the non-blocking eventfd.
                    unsafe { libc::read(bell2.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
                    let (admitted, dropped_ones) = gate.turn();
                    for d in dropped_ones {
                        dropped(me, &d.peer, &d.why);
                    }
                    for a in admitted {
                        match impossible(&a.fields, me, size) {
                            Some(why) => refuse(me, &a.peer, a.conn, HELLO_ERR, &why),
                            None => early.push(a),
                        }
                    }
                    if let Some(t) = table2.get() {
                        for a in early.drain(..) {
                            t.admit(a);
                        }
                    }
                }
            })?;
        Ok(Acceptor {
            stop,
            bell,
            table,
            thread: Some(thread),
        })
    }

    /// Hands every admitted connection, from now on and those waiting, to `table`.
    pub fn install(&self, table: Arc<Table>) {
        let _ = self.table.set(table);
        self.ring();
    }

    fn ring(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from `one` to the eventfd.
        unsafe { libc::write(self.bell.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.ring();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Why a proven connection's hello cannot be from a peer of rank `me` of `size` (its
/// rank is out of range, or its fields malformed), judged before the table is known.
fn impossible(fields: &[u8], me: usize, size: usize) -> Option<String> {
    match parse_hello(fields) {
        None => Some("malformed hello".to_string()),
        Some((from, ..)) if from == me || from >= size => Some(format!(
            "rank {from} must not connect to rank {me} of {size}"
        )),
        Some(_) => None,
    }
}

/// A hello's fields: (rank, channel, stream, slot).
fn parse_hello(fields: &[u8]) -> Option<(usize, u8, usize, u32)> {
    let mut r = Reader::new(fields);
    let parsed = (
        r.u32().ok()? as usize,
        r.u8().ok()?,
        r.u8().ok()? as usize,
        r.u32().ok()?,
    );
    r.finish().ok()?;
    Some(parsed)
}

/// Tells a dialer why rank `me` refuses `conn` (a frame of `kind`), and logs it unless
/// it is a crossing.
fn refuse(me: usize, peer: &str, conn: TcpStream, kind: u16, why: &str) {
    let _ = conn.set_nonblocking(false);
    let _ = write_frame(
        &mut Deadlined::new(&conn, HANDSHAKE_TIME),
        kind,
        why.as_bytes(),
    );
    if kind != HELLO_CROSSED {
        dropped(me, peer, why);
    }
}
