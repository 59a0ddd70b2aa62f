//! Point-to-point transport between ranks: links made on demand to the peers a
//! rank's collectives use ([`links`]), plus control streams from every rank to
//! rank 0 (the coordinator); ranks on the same host talk through a shared-memory
//! ring pair ([`shm`]) beside one idle TCP stream. Pairs joined by TCP have
//! `PERSEUS_ALLREDUCE_STREAMS` data streams: stream 0 carries everything
//! by default, and a large collective between hosts runs one part on each
//! stream, on its own thread (see [`Mesh::channel`]). Data moves in frames (the
//! [`crate::wire`] header, then the payload); each side knows the length to
//! expect from negotiation, and a frame of another length is a protocol
//! error naming the peer.
//!
//! A single thread drives any number of sends and receives at once (see
//! [`progress`]): sockets are non-blocking and waited on with `poll(2)`,
//! rings with the host's futex doorbell, so a ring step sends right while it
//! receives left without helper threads.

pub mod cma;
mod connect;
pub mod lane;
mod links;
mod progress;
pub mod shm;
pub mod tree;

pub use connect::{connect_mesh, Control, MeshParts};
pub use progress::{message_bytes, Recv, Send};

use crate::error::{PerseusError, Result};
use shm::Segment;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// How this rank reaches one peer.
pub enum Link {
    /// Itself, or not connected.
    None,
    /// A non-blocking TCP stream.
    Tcp(TcpStream),
    /// Rings in the host's shared segment (`me` and `peer` index its members).
    Shm {
        /// The segment.
        seg: Arc<Segment>,
        /// This rank's member index.
        me: usize,
        /// The peer's member index.
        peer: usize,
        /// The ring this rank writes.
        tx: usize,
        /// The ring this rank reads.
        rx: usize,
        /// The pair's TCP stream, kept open and idle: the kernel closes it
        /// when the peer dies, however it dies, which a ring cannot show.
        alive: Option<TcpStream>,
    },
}

impl Link {
    /// Writes what it can without blocking.
    pub fn write(&self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Link::Tcp(s) => (&*s).write(buf),
            Link::Shm {
                seg, me, peer, tx, ..
            } => seg.ring(*tx, *me, *peer).write(buf),
            Link::None => Err(std::io::ErrorKind::NotConnected.into()),
        }
    }

    /// Reads what is there without blocking.
    pub fn read(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Link::Tcp(s) => (&*s).read(buf),
            Link::Shm {
                seg, me, peer, rx, ..
            } => seg.ring(*rx, *peer, *me).read(buf),
            Link::None => Err(std::io::ErrorKind::NotConnected.into()),
        }
    }

    /// [`Link::read`] with stores that bypass the cache where the link is
    /// shared memory (a socket's bytes arrive through the kernel's copy).
    pub fn read_streaming(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Link::Shm {
                seg, me, peer, rx, ..
            } => seg.ring(*rx, *peer, *me).read_streaming(buf),
            _ => self.read(buf),
        }
    }

    /// True when the peer's process has ended: its TCP stream (for a
    /// shared-memory peer, the idle one kept beside the rings) was closed
    /// by the peer or failed. Asks `poll(2)` for hang-up rather than reading,
    /// so nothing is consumed and unread data still in the socket (the last
    /// frames a dying peer sent) does not hide the close behind it.
    pub fn peer_gone(&self) -> bool {
        let s = match self {
            Link::Tcp(s) | Link::Shm { alive: Some(s), .. } => s,
            _ => return false,
        };
        let mut pfd = libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(s),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout: returns at once.
        let n = unsafe { libc::poll(&mut pfd, 1, 0) };
        n > 0
            && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
    }

    /// True when [`Link::peer_gone`] can ever say yes for this link.
    fn watched(&self) -> bool {
        matches!(self, Link::Tcp(_) | Link::Shm { alive: Some(_), .. })
    }

    /// True for shared memory.
    pub fn is_shm(&self) -> bool {
        matches!(self, Link::Shm { .. })
    }
}

/// How long a rank that lost a peer watches the others before it reports.
/// A dead process's sockets are closed one after another, some a few
/// milliseconds late (the kernel defers part of the work), while a survivor
/// that saw the death first and left may close its own before them.
pub const SETTLE: Duration = Duration::from_millis(100);

/// The ranks a message names ("rank N ").
pub fn named_in(msg: &str, size: usize) -> Vec<usize> {
    (0..size)
        .filter(|p| msg.contains(&format!("rank {p} ")))
        .collect()
}

/// A rank's links to every peer on one stream, each made once, when first needed
/// (`row[peer]`; empty for itself and for peers not linked yet).
pub type Row = [OnceLock<Link>];

/// The link to `peer` in `row`, if made.
pub fn at(row: &Row, peer: usize) -> Option<&Link> {
    row.get(peer).and_then(OnceLock::get)
}

/// A row of links made already (tests; the single rank of a job of one).
pub fn row_of(links: Vec<Link>) -> Vec<OnceLock<Link>> {
    links.into_iter().map(OnceLock::from).collect()
}

/// The peers, besides those `named`, whose connections have ended, watched
/// for up to `settle` (less once every watched peer has ended).
pub fn ended_besides(links: &Row, named: &[usize], settle: Duration) -> Vec<usize> {
    let start = Instant::now();
    let watched: Vec<usize> = (0..links.len())
        .filter(|&p| at(links, p).is_some_and(Link::watched) && !named.contains(&p))
        .collect();
    let mut ended = vec![false; links.len()];
    loop {
        for &p in &watched {
            ended[p] = ended[p] || at(links, p).is_some_and(Link::peer_gone);
        }
        if watched.iter().all(|&p| ended[p]) || start.elapsed() >= settle {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    watched.into_iter().filter(|&p| ended[p]).collect()
}

/// `msg`, followed by the other peers whose connections have ended, each
/// named by `name` (which ends in a space).
pub fn with_ended(msg: String, ended: &[usize], name: impl Fn(usize) -> String) -> String {
    if ended.is_empty() {
        return msg;
    }
    let ranks: Vec<String> = ended.iter().map(|&p| name(p)).collect();
    format!(
        "{msg}; the connections of {}have ended too",
        ranks.join("and ")
    )
}

/// How often a patient transfer asks whether to keep waiting.
pub const PATIENT_CHECK: Duration = Duration::from_millis(100);

/// How long a rank waiting only on shared memory yields before it sleeps.
const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// The data links of one rank to its peers, made as its collectives first need them.
pub struct Mesh {
    rank: usize,
    /// Every link, made or being made (stream `s` to `peer`: `table.rows[s][peer]`).
    table: Arc<links::Table>,
    /// Keeps this rank's listener open, for peers that link to it later.
    _acceptor: Option<links::Acceptor>,
    /// Data streams per pair of ranks on different hosts.
    streams: usize,
    /// Ranks that share a host talk through shared memory (PERSEUS_SHM).
    shm_on: bool,
    shm: Option<(Arc<Segment>, usize)>,
    timeout: Duration,
    spin: Duration,
    host_ids: Vec<usize>,
    /// Each rank's host name, for error messages.
    host_names: Vec<String>,
    sent_intra: AtomicU64,
    sent_inter: AtomicU64,
    sent_extra: AtomicU64,
    /// Transfers run so far ([`Mesh::rounds`]).
    rounds: AtomicU64,
    /// Each rank's published [`cma::Token`]: None where its memory cannot be read.
    tokens: Vec<Option<cma::Token>>,
    /// Per peer: a direct read between this rank and it failed once.
    refused: Vec<AtomicBool>,
}

impl Mesh {
    /// The mesh over `table` (whose acceptor, if any, it keeps running) with
    /// `streams` data streams per pair of hosts, and, when some peers share this host,
    /// the segment and this rank's member index.
    fn over(
        table: Arc<links::Table>,
        acceptor: Option<links::Acceptor>,
        streams: usize,
        shm: Option<(Arc<Segment>, usize)>,
        timeout: Duration,
    ) -> Mesh {
        let n = table.rows[0].len();
        Mesh {
            rank: table.me(),
            table,
            _acceptor: acceptor,
            streams,
            shm_on: false,
            shm,
            timeout,
            spin: DEFAULT_SPIN,
            host_ids: vec![0; n],
            host_names: Vec::new(),
            sent_intra: AtomicU64::new(0),
            sent_inter: AtomicU64::new(0),
            sent_extra: AtomicU64::new(0),
            rounds: AtomicU64::new(0),
            tokens: vec![None; n],
            refused: (0..n).map(|_| AtomicBool::new(false)).collect(),
        }
    }

    /// Stream 0's links.
    fn row(&self) -> &Row {
        &self.table.rows[0]
    }

    /// Links this rank to every peer of `peers` not linked yet on `stream` (see
    /// [`links`]).
    fn link_all(&self, stream: usize, peers: &[usize]) -> Result<()> {
        for &p in peers {
            if at(&self.table.rows[stream], p).is_none() {
                self.table
                    .link_stream(p, stream)
                    .map_err(|e| self.name_hosts(e, &[p]))?;
            }
        }
        Ok(())
    }

    /// How many peers this rank holds links to so far.
    pub fn linked_peers(&self) -> usize {
        self.table.linked_peers()
    }

    /// How many transfers (rounds of sends and receives, each waiting for the last)
    /// this rank has run: its sequential message steps.
    pub fn rounds(&self) -> u64 {
        self.rounds.load(Ordering::Relaxed)
    }

    /// Records each rank's published [`cma::Token`] (None where it has none).
    pub fn with_tokens(mut self, tokens: Vec<Option<cma::Token>>) -> Mesh {
        assert_eq!(tokens.len(), self.size(), "one token per rank");
        self.tokens = tokens;
        self
    }

    /// True when `rank`'s memory can be read by the ranks sharing its host and
    /// memory, and it can read theirs: it published a token, and this mesh uses
    /// shared memory. Every rank gives the same answer.
    pub fn readable(&self, rank: usize) -> bool {
        self.shm_on && self.tokens.get(rank).is_some_and(Option::is_some)
    }

    /// Reads `buf.len()` bytes at `addr` of peer `from`, which shares this host's
    /// memory; false when that failed or cannot be tried. An empty `buf` checks
    /// only that `from` can be read (its canary).
    pub fn read_direct(&self, from: usize, addr: u64, buf: &mut [u8]) -> bool {
        if !self.is_local(from) || self.direct_refused(from) || !self.readable(self.rank) {
            return false;
        }
        self.tokens[from].is_some_and(|t| t.read(addr, buf))
    }

    /// The error for a read of `peer`'s memory that failed although `peer` could be
    /// read before: waits (up to the timeout) for its connection to end, then names it
    /// as any loss is named (its host, and every other rank gone too).
    pub fn lost(&self, peer: usize) -> PerseusError {
        let start = Instant::now();
        let gone = loop {
            if at(self.row(), peer).is_some_and(Link::peer_gone) {
                break true;
            }
            if start.elapsed() >= self.timeout {
                break false;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        let msg = if gone {
            let msg = format!(
                "rank {peer} ended (its connection closed) while its memory was being read; \
                 it probably exited or crashed (see its log)"
            );
            let ended = ended_besides(self.row(), &[peer], SETTLE);
            with_ended(msg, &ended, |p| format!("rank {p} "))
        } else {
            format!(
                "rank {peer} could not be read for {}s though it could before, and its \
                 connection is open (GLOO_TIMEOUT_SECONDS)",
                self.timeout.as_secs()
            )
        };
        self.name_hosts(PerseusError::Peer(msg), &[peer])
    }

    /// True once a direct read between this rank and `peer` failed.
    pub fn direct_refused(&self, peer: usize) -> bool {
        self.refused
            .get(peer)
            .is_some_and(|f| f.load(Ordering::Relaxed))
    }

    /// Records that a direct read between this rank and `peer` failed: from now
    /// on their broadcasts send the bytes. Logged once per peer.
    pub fn refuse_direct(&self, peer: usize) {
        if let Some(f) = self.refused.get(peer) {
            if !f.swap(true, Ordering::Relaxed) {
                crate::log!(
                    crate::log::Level::Warning,
                    "rank {}: a direct read of memory between it and rank {peer} failed; \
                     their large broadcasts now send the bytes through shared memory",
                    self.rank
                );
            }
        }
    }

    /// Says whether ranks sharing a host use shared memory.
    pub fn with_shm(mut self, shm_on: bool) -> Mesh {
        self.shm_on = shm_on;
        self
    }

    /// Data streams per pair of ranks joined by TCP.
    pub fn streams(&self) -> usize {
        self.streams
    }

    /// True when ranks that share a host talk through shared memory (those
    /// pairs have one stream only).
    pub fn shares_memory(&self) -> bool {
        self.shm_on
    }

    /// This rank's end of its host's [`lane::Lane`], where its host's segment has one.
    pub fn lane(&self) -> Option<lane::Lane> {
        let (seg, me) = self.shm.as_ref()?;
        lane::Lane::new(seg.clone(), *me)
    }

    /// Stream `s` of this mesh as a group of its own (`s < streams()`).
    pub fn channel(&self, s: usize) -> Channel<'_> {
        assert!(s < self.streams(), "stream {s} of {}", self.streams());
        Channel { mesh: self, s }
    }

    /// Waits on shared memory sleep at once (for hosts with more ranks than cores).
    pub fn without_spin(mut self) -> Mesh {
        self.spin = Duration::ZERO;
        self
    }

    /// Records each rank's host (one key per rank; equal keys share a host).
    pub fn with_hosts(mut self, hosts: &[String]) -> Mesh {
        self.host_ids = hosts
            .iter()
            .map(|h| hosts.iter().position(|x| x == h).unwrap_or(0))
            .collect();
        // Host keys are "name@boot-id".
        self.host_names = hosts
            .iter()
            .map(|h| h.split('@').next().unwrap_or_default().to_string())
            .collect();
        self
    }

    /// The name of `rank`'s host, when known.
    pub fn host_name(&self, rank: usize) -> Option<&str> {
        self.host_names
            .get(rank)
            .map(String::as_str)
            .filter(|h| !h.is_empty())
    }

    /// Adds the host of every rank a peer error names ("rank N ") and, for
    /// a timeout, of the ranks waited for.
    fn name_hosts(&self, e: PerseusError, peers: &[usize]) -> PerseusError {
        let PerseusError::Peer(mut m) = e else {
            return e;
        };
        for p in 0..self.size() {
            let Some(h) = self.host_name(p) else { continue };
            let named = format!("rank {p} ");
            if m.contains(&named) {
                m = m.replace(&named, &format!("rank {p} (host {h}) "));
            }
        }
        if m.contains("waiting for rank(s)") {
            let mut listed: Vec<String> = Vec::new();
            for &p in peers {
                if let Some(h) = self.host_name(p) {
                    let s = format!("rank {p} on {h}");
                    if !listed.contains(&s) {
                        listed.push(s);
                    }
                }
            }
            if !listed.is_empty() {
                m = format!("{m} [{}]", listed.join(", "));
            }
        }
        PerseusError::Peer(m)
    }

    /// `msg` about lost peer `lost` (if known), followed by every other peer
    /// whose connection has ended (watched for [`SETTLE`]), with their hosts:
    /// the rank a survivor names first may have left after its own error.
    pub fn also_ended(&self, msg: String, lost: Option<usize>) -> String {
        let mut named = named_in(&msg, self.size());
        named.extend(lost);
        let ended = ended_besides(self.row(), &named, SETTLE);
        with_ended(msg, &ended, |p| match self.host_name(p) {
            Some(h) => format!("rank {p} (host {h}) "),
            None => format!("rank {p} "),
        })
    }

    /// An index naming `rank`'s host (ranks on one host share it).
    pub fn host_of(&self, rank: usize) -> usize {
        self.host_ids.get(rank).copied().unwrap_or(0)
    }

    /// Payload bytes sent so far to peers on this host and on other hosts.
    pub fn bytes_sent(&self) -> (u64, u64) {
        (
            self.sent_intra.load(Ordering::Relaxed),
            self.sent_inter.load(Ordering::Relaxed),
        )
    }

    /// Payload bytes sent so far on streams other than stream 0.
    pub fn bytes_sent_extra(&self) -> u64 {
        self.sent_extra.load(Ordering::Relaxed)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.row().len()
    }

    /// The peers whose processes have ended, as their connections tell (asks the
    /// kernel, reads nothing, never blocks; peers not linked yet cannot tell).
    pub fn ended(&self) -> Vec<usize> {
        (0..self.size())
            .filter(|&p| p != self.rank && at(self.row(), p).is_some_and(Link::peer_gone))
            .collect()
    }

    /// True when `peer` shares this rank's host and memory.
    pub fn is_local(&self, peer: usize) -> bool {
        self.shm_on
            && peer != self.rank
            && peer < self.size()
            && self.host_of(peer) == self.host_of(self.rank)
    }

    /// Runs sends and receives (peers named by global rank) to completion.
    pub fn transfer(&self, sends: &mut [Send<'_>], recvs: &mut [Recv<'_>]) -> Result<()> {
        self.transfer_with(0, sends, recvs, None)
    }

    /// Like [`Mesh::transfer`], but waits as long as it takes for peers
    /// that are busy elsewhere: instead of failing when nothing moved for the
    /// timeout, it asks `alive` every [`PATIENT_CHECK`] whether to go on
    /// (an error from it ends the wait with that error).
    pub fn transfer_patient(
        &self,
        sends: &mut [Send<'_>],
        recvs: &mut [Recv<'_>],
        alive: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        self.transfer_with(0, sends, recvs, Some(alive))
    }

    fn transfer_with(
        &self,
        stream: usize,
        sends: &mut [Send<'_>],
        recvs: &mut [Recv<'_>],
        alive: Option<&mut dyn FnMut() -> Result<()>>,
    ) -> Result<()> {
        let limit = match alive {
            Some(f) => progress::Limit::Ask(PATIENT_CHECK.min(self.timeout), f),
            None => progress::Limit::Fail(self.timeout),
        };
        let peers = |s: &[Send<'_>], r: &[Recv<'_>]| -> Vec<usize> {
            s.iter()
                .map(Send::peer)
                .chain(r.iter().map(Recv::peer))
                .collect()
        };
        self.link_all(stream, &peers(sends, recvs))?;
        self.rounds.fetch_add(1, Ordering::Relaxed);
        if stream == 0 {
            let shm = self.shm.as_ref().map(|(s, me)| (&**s, *me));
            progress::run(self.row(), shm, limit, self.spin, sends, recvs)
                .map_err(|e| self.name_hosts(e, &peers(sends, recvs)))?;
        } else {
            let links = &self.table.rows[stream];
            progress::run(links, None, limit, self.spin, sends, recvs)
                .map_err(|e| self.name_hosts(e, &peers(sends, recvs)))?;
            let bytes: usize = sends.iter().map(|s| s.data().len()).sum();
            self.sent_extra.fetch_add(bytes as u64, Ordering::Relaxed);
        }
        for s in sends.iter() {
            let same = self.host_of(s.peer()) == self.host_of(self.rank);
            let counter = if same {
                &self.sent_intra
            } else {
                &self.sent_inter
            };
            counter.fetch_add(s.data().len() as u64, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// One data stream of a [`Mesh`]: the same ranks, its own connections.
pub struct Channel<'a> {
    mesh: &'a Mesh,
    s: usize,
}

impl Channel<'_> {
    /// The mesh it belongs to.
    pub fn mesh(&self) -> &Mesh {
        self.mesh
    }

    /// Runs sends and receives on this stream (peers must be joined by TCP
    /// unless this is stream 0).
    pub fn transfer(&self, sends: &mut [Send<'_>], recvs: &mut [Recv<'_>]) -> Result<()> {
        self.mesh.transfer_with(self.s, sends, recvs, None)
    }
}

#[cfg(test)]
mod tests {
    use super::{ended_besides, named_in, with_ended, Link};
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    #[test]
    fn peer_gone_sees_a_close_behind_unread_data() {
        let (mine, mut theirs) = pair();
        let link = Link::Tcp(mine);
        assert!(!link.peer_gone(), "an open, quiet peer is not gone");
        theirs.write_all(b"last frame").unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            !link.peer_gone(),
            "data waiting from a live peer is not a close"
        );
        drop(theirs);
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            link.peer_gone(),
            "the close must show with data still unread"
        );
        assert!(!Link::None.peer_gone());
    }

    #[test]
    fn a_loss_lists_the_peers_that_end_a_little_later() {
        // Ranks 1..=3 are peers; rank 1 is the one the error names.
        let pairs: Vec<_> = (0..3).map(|_| pair()).collect();
        let (mine, theirs): (Vec<_>, Vec<_>) = pairs.into_iter().unzip();
        let mut links = vec![Link::None];
        links.extend(mine.into_iter().map(Link::Tcp));
        let links = super::row_of(links);
        let mut theirs: Vec<Option<_>> = theirs.into_iter().map(Some).collect();
        drop(theirs[0].take());
        // Rank 3 closes 30 ms after the loss was seen; rank 2 stays.
        let late = theirs[2].take().unwrap();
        let closer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            drop(late);
        });
        let msg = "rank 1 closed its connection".to_string();
        let named = named_in(&msg, links.len());
        assert_eq!(named, vec![1]);
        let ended = ended_besides(&links, &named, Duration::from_millis(500));
        closer.join().unwrap();
        assert_eq!(
            ended,
            vec![3],
            "the late close is seen, the live peer is not"
        );
        assert_eq!(
            with_ended(msg.clone(), &ended, |p| format!("rank {p} (host h) ")),
            "rank 1 closed its connection; the connections of rank 3 (host h) have ended too"
        );
        assert_eq!(with_ended(msg.clone(), &[], |p| format!("rank {p} ")), msg);
        drop(theirs[1].take());
        let both = ended_besides(&links, &[], Duration::from_secs(2));
        assert_eq!(both, vec![1, 2, 3]);
    }
}
