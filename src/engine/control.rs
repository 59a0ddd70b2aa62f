//! The control streams, read and written by the engine thread itself: a
//! worker's stream to rank 0, or rank 0's coordinator with a stream from
//! every worker. No reader threads sit between a frame and the engine, so a
//! negotiation round costs one socket hop each way and no thread wake-ups
//! beyond the engines' own.

use super::coordinator::{Coordinator, Outgoing};
use super::inbox::Inbox;
use super::message::{decode_requests, decode_responses, encode_responses, Response, WireRequest};
use crate::error::{PerseusError, Result};
use crate::transport::Control;
use crate::wire::{write_frame_nb, FrameReader};
use std::collections::BTreeMap;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::Duration;

/// Frame kind of a batch of requests (worker to rank 0).
pub const FRAME_REQUESTS: u16 = 0x300;
/// Frame kind of a batch of responses (rank 0 to a worker).
pub const FRAME_RESPONSES: u16 = 0x301;

/// One non-blocking control stream and the frame it is in the middle of.
pub struct Stream {
    sock: TcpStream,
    reader: FrameReader,
}

impl Stream {
    fn new(sock: TcpStream) -> std::io::Result<Stream> {
        sock.set_nonblocking(true)?;
        Ok(Stream {
            sock,
            reader: FrameReader::default(),
        })
    }

    /// Payloads of the whole frames of `kind` that arrived.
    fn receive(&mut self, kind: u16) -> Result<Vec<Vec<u8>>> {
        self.reader
            .read_from(&mut self.sock)?
            .into_iter()
            .map(|(k, p)| {
                if k == kind {
                    Ok(p)
                } else {
                    Err(PerseusError::Protocol(format!(
                        "unexpected control frame kind {k:#x}"
                    )))
                }
            })
            .collect()
    }

    /// Sends one frame, waiting while the socket buffer is full.
    pub fn send(&mut self, kind: u16, payload: &[u8], timeout: Duration) -> std::io::Result<()> {
        write_frame_nb(&mut self.sock, kind, payload, timeout)
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
    pub fn new(control: Control, coord: Coordinator) -> std::io::Result<Uplink> {
        Ok(match control {
            Control::Coordinator(streams) => Uplink::Coordinator {
                coord,
                workers: streams
                    .into_iter()
                    .map(|s| s.map(Stream::new).transpose())
                    .collect::<std::io::Result<_>>()?,
            },
            Control::Worker(s) => Uplink::Worker(Some(Stream::new(s)?)),
        })
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
                            got.push(Incoming::Lost(rank, e.to_string()));
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
                        got.push(Incoming::Lost(0, e.to_string()));
                    }
                }
            }
        }
        got
    }

    /// Sends the coordinator's answers: to each worker's stream, and rank 0's
    /// own into `local`. A failed write shows up as a lost stream on the next
    /// [`Uplink::receive`].
    pub fn dispatch(&mut self, out: Outgoing, local: &mut Vec<Response>, timeout: Duration) {
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
                let _ = s.send(FRAME_RESPONSES, &encode_responses(&resps), timeout);
            }
        }
    }

    /// Sleeps until a control stream is readable, `timeout` passes (`None`:
    /// no limit) or, given an `inbox`, something is pushed to it (returning
    /// at once when it already holds something). Without an inbox, callers'
    /// pushes cost them no wake-up system call.
    pub fn sleep<T>(&self, inbox: Option<&Inbox<T>>, timeout: Option<Duration>) {
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
        let socks: Vec<&Stream> = match self {
            Uplink::Coordinator { workers, .. } => workers.iter().flatten().collect(),
            Uplink::Worker(s) => s.iter().collect(),
        };
        fds.extend(socks.iter().map(|s| libc::pollfd {
            fd: s.sock.as_raw_fd(),
            events: libc::POLLIN,
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
