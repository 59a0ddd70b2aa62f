//! Point-to-point transport between ranks: a full TCP mesh, one data stream
//! per peer pair, plus control streams from every rank to rank 0 (the
//! coordinator). Data moves in frames (the [`crate::wire`] header, then the
//! payload); each side knows the length to expect from negotiation, and a
//! frame of another length is a protocol error naming the peer.
//!
//! Data sockets are non-blocking and a single thread drives any number of
//! sends and receives at once with `poll(2)` (see [`progress`]), so a ring
//! step sends right while it receives left without helper threads.

mod connect;
mod progress;

pub use connect::{connect_mesh, Control, MeshParts};
pub use progress::{Recv, Send};

use crate::error::Result;
use std::net::TcpStream;
use std::time::Duration;

/// The data streams of one rank to all its peers.
pub struct Mesh {
    rank: usize,
    peers: Vec<Option<TcpStream>>,
    timeout: Duration,
}

impl Mesh {
    /// Wraps connected, non-blocking streams (`peers[rank]` is `None`).
    pub fn new(rank: usize, peers: Vec<Option<TcpStream>>, timeout: Duration) -> Mesh {
        Mesh {
            rank,
            peers,
            timeout,
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.peers.len()
    }

    /// Runs sends and receives (peers named by global rank) to completion.
    /// `on_recv(i, bytes)` is called as receive `i` makes progress, with the
    /// prefix of its buffer received so far.
    pub fn transfer(
        &self,
        sends: &mut [Send<'_>],
        recvs: &mut [Recv<'_>],
        on_recv: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        progress::run(&self.peers, self.timeout, sends, recvs, on_recv)
    }
}
