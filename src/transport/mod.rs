//! Point-to-point transport between ranks: a full TCP mesh, one data stream
//! per peer pair, plus control streams from every rank to rank 0 (the
//! coordinator); ranks on the same host replace their TCP data stream with
//! a shared-memory ring pair ([`shm`]). Data moves in frames (the
//! [`crate::wire`] header, then the payload); each side knows the length to
//! expect from negotiation, and a frame of another length is a protocol
//! error naming the peer.
//!
//! A single thread drives any number of sends and receives at once (see
//! [`progress`]): sockets are non-blocking and waited on with `poll(2)`,
//! rings with the host's futex doorbell, so a ring step sends right while it
//! receives left without helper threads.

mod connect;
mod progress;
pub mod shm;

pub use connect::{connect_mesh, Control, MeshParts};
pub use progress::{Recv, Send};

use crate::error::Result;
use shm::Segment;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

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
    },
}

impl Link {
    /// Writes what it can without blocking.
    pub fn write(&self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Link::Tcp(s) => (&*s).write(buf),
            Link::Shm { seg, me, peer } => seg.ring(*me, *peer).write(buf),
            Link::None => Err(std::io::ErrorKind::NotConnected.into()),
        }
    }

    /// Reads what is there without blocking.
    pub fn read(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Link::Tcp(s) => (&*s).read(buf),
            Link::Shm { seg, me, peer } => seg.ring(*peer, *me).read(buf),
            Link::None => Err(std::io::ErrorKind::NotConnected.into()),
        }
    }

    /// True for shared memory.
    pub fn is_shm(&self) -> bool {
        matches!(self, Link::Shm { .. })
    }
}

/// How often a patient transfer asks whether to keep waiting.
pub const PATIENT_CHECK: Duration = Duration::from_millis(100);

/// How long a rank waiting only on shared memory yields before it sleeps.
const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// The data links of one rank to all its peers.
pub struct Mesh {
    rank: usize,
    links: Vec<Link>,
    shm: Option<(Arc<Segment>, usize)>,
    timeout: Duration,
    spin: Duration,
    host_ids: Vec<usize>,
    sent_intra: AtomicU64,
    sent_inter: AtomicU64,
}

impl Mesh {
    /// Wraps connected links (`links[rank]` is `Link::None`) and, when some
    /// peers share this host, the segment and this rank's member index.
    pub fn new(
        rank: usize,
        links: Vec<Link>,
        shm: Option<(Arc<Segment>, usize)>,
        timeout: Duration,
    ) -> Mesh {
        let host_ids = vec![0; links.len()];
        Mesh {
            rank,
            links,
            shm,
            timeout,
            spin: DEFAULT_SPIN,
            host_ids,
            sent_intra: AtomicU64::new(0),
            sent_inter: AtomicU64::new(0),
        }
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
        self
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

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.links.len()
    }

    /// True when `peer` is reached through shared memory.
    pub fn is_local(&self, peer: usize) -> bool {
        self.links.get(peer).is_some_and(Link::is_shm)
    }

    /// Runs sends and receives (peers named by global rank) to completion.
    pub fn transfer(&self, sends: &mut [Send<'_>], recvs: &mut [Recv<'_>]) -> Result<()> {
        self.transfer_with(sends, recvs, None)
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
        self.transfer_with(sends, recvs, Some(alive))
    }

    fn transfer_with(
        &self,
        sends: &mut [Send<'_>],
        recvs: &mut [Recv<'_>],
        alive: Option<&mut dyn FnMut() -> Result<()>>,
    ) -> Result<()> {
        let shm = self.shm.as_ref().map(|(s, me)| (&**s, *me));
        let limit = match alive {
            Some(f) => progress::Limit::Ask(PATIENT_CHECK.min(self.timeout), f),
            None => progress::Limit::Fail(self.timeout),
        };
        progress::run(&self.links, shm, limit, self.spin, sends, recvs)?;
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
