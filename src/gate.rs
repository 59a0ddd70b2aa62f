//! The gate of a listening port: every new connection proves the job secret here
//! ([`crate::auth`]) before its owner (the rendezvous server, a rank's acceptor) sees
//! it. One thread vets any number of connections at once: sockets are non-blocking,
//! each handshake is a small state machine woken by the owner's `poll(2)`, and each has
//! one deadline ([`HANDSHAKE_TIME`]) for all of it, however its bytes trickle in.
//!
//! At most [`MAX_UNPROVEN`] connections are vetted at once. Past that the gate stops
//! accepting, and new connections wait in the kernel's queue (whose length it raises
//! to [`BACKLOG`]) until a handshake ends: strangers can delay a job's own ranks by at
//! most the handshake time, and never turn them away.

use crate::auth::{self, Challenged, Session};
use crate::deadline::HANDSHAKE_TIME;
use crate::wire::{framed, parse_header, HEADER, MAX_HANDSHAKE};
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// How many connections one gate vets at once; more wait in the kernel's queue.
pub const MAX_UNPROVEN: usize = 1024;

/// The length of the kernel's queue of connections not yet accepted (the kernel caps
/// it at `net.core.somaxconn`, 4096 by default since Linux 5.4).
pub const BACKLOG: i32 = 4096;

/// A connection that proved the secret.
pub struct Admitted {
    /// The connection, non-blocking.
    pub conn: TcpStream,
    /// Its peer's address, for messages.
    pub peer: String,
    /// The fields of its hello (who it says it is).
    pub fields: Vec<u8>,
    /// The key it shares with this end.
    pub session: Session,
}

/// A connection the gate closed, and why.
pub struct Dropped {
    /// Its peer's address.
    pub peer: String,
    /// Why it was closed.
    pub why: String,
}

/// Where one handshake stands.
enum Stage {
    /// Waiting for the dialer's hello.
    Hello,
    /// Challenged; waiting for the proof.
    Proof(Challenged),
}

/// One connection being vetted.
struct Vetting {
    conn: TcpStream,
    peer: String,
    until: Instant,
    stage: Stage,
    /// The frame being read (header, then payload).
    inbuf: Vec<u8>,
    /// Bytes to write (the challenge), from `written` on.
    out: Vec<u8>,
    written: usize,
}

/// What one look at a handshake found.
enum Turn {
    Waiting,
    Admitted(Vec<u8>, Session),
    Dropped(String),
}

impl Vetting {
    /// Reads what has arrived of the current frame (never past its end, so the bytes
    /// that follow the handshake stay in the socket for the owner). Some((kind,
    /// payload)) once it is whole.
    fn read_frame(&mut self) -> Result<Option<(u16, Vec<u8>)>, String> {
        loop {
            let want = if self.inbuf.len() < HEADER {
                HEADER - self.inbuf.len()
            } else {
                let h: &[u8; HEADER] = self.inbuf[..HEADER].try_into().expect("a header");
                let (_, len) = parse_header(h, MAX_HANDSHAKE).map_err(|e| e.to_string())?;
                HEADER + len - self.inbuf.len()
            };
            if want == 0 {
                let h: &[u8; HEADER] = self.inbuf[..HEADER].try_into().expect("a header");
                let (kind, _) = parse_header(h, MAX_HANDSHAKE).map_err(|e| e.to_string())?;
                let payload = self.inbuf.split_off(HEADER);
                self.inbuf.clear();
                return Ok(Some((kind, payload)));
            }
            let mut chunk = vec![0u8; want.min(16 << 10)];
            match self.conn.read(&mut chunk) {
                Ok(0) if self.inbuf.len() >= HEADER => {
                    let got = self.inbuf.len() - HEADER;
                    return Err(format!(
                        "protocol error: frame cut short: {got} of {} bytes before the stream \
                         ended",
                        got + want
                    ));
                }
                Ok(0) => return Err("the peer closed the connection".into()),
                Ok(n) => self.inbuf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    /// Writes what waits to be written; false once the peer is gone.
    fn flush(&mut self) -> Result<(), String> {
        while self.written < self.out.len() {
            match self.conn.write(&self.out[self.written..]) {
                Ok(0) => return Err("hung up".into()),
                Ok(n) => self.written += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("hung up: {e}")),
            }
        }
        Ok(())
    }

    /// Moves the handshake on as far as the bytes that arrived allow.
    fn turn(&mut self, secret: &str, now: Instant) -> Turn {
        if let Err(why) = self.flush() {
            return Turn::Dropped(why);
        }
        loop {
            let what = match self.stage {
                Stage::Hello => "hello",
                Stage::Proof(_) => "proof",
            };
            let frame = match self.read_frame() {
                Ok(Some(f)) => f,
                Ok(None) if now >= self.until => {
                    return Turn::Dropped(format!("no {what} within the handshake time"))
                }
                Ok(None) => return Turn::Waiting,
                Err(e) => return Turn::Dropped(format!("no {what}: {e}")),
            };
            let (k, payload) = frame;
            match std::mem::replace(&mut self.stage, Stage::Hello) {
                Stage::Hello => match auth::challenge(secret, k, &payload) {
                    Ok((answer, pending)) => {
                        self.out = framed(auth::kind::CHALLENGE, &answer);
                        self.written = 0;
                        self.stage = Stage::Proof(pending);
                        if let Err(why) = self.flush() {
                            return Turn::Dropped(why);
                        }
                    }
                    Err(why) => return Turn::Dropped(why),
                },
                Stage::Proof(pending) => {
                    return match pending.check(secret, k, &payload) {
                        Ok((fields, session)) => Turn::Admitted(fields, session),
                        Err(why) => {
                            // Best effort: the dialer learns why, if its socket takes it.
                            let refusal = framed(auth::kind::REFUSED, why.as_bytes());
                            let _ = self.conn.write(&refusal);
                            Turn::Dropped(why)
                        }
                    };
                }
            }
        }
    }
}

/// A listener and the handshakes under way at it.
pub struct Gate {
    listener: TcpListener,
    secret: String,
    cap: usize,
    vetting: Vec<Vetting>,
    /// Until when the listener is left alone: accept(2) found no descriptor free.
    starved: Option<Instant>,
}

/// How long a gate leaves its listener alone after accept(2) found no descriptor free
/// (the connections wait in the kernel's queue meanwhile).
const STARVED_FOR: Duration = Duration::from_millis(100);

impl Gate {
    /// The gate of `listener` (made non-blocking, its queue lengthened to [`BACKLOG`]),
    /// admitting dialers that know `secret`.
    pub fn new(listener: TcpListener, secret: &str) -> std::io::Result<Gate> {
        listener.set_nonblocking(true)?;
        // SAFETY: listen(2) again on a listening socket only changes its queue length.
        unsafe { libc::listen(listener.as_raw_fd(), BACKLOG) };
        Ok(Gate {
            listener,
            secret: secret.to_string(),
            cap: MAX_UNPROVEN,
            vetting: Vec::new(),
            starved: None,
        })
    }

    /// The same gate vetting at most `cap` connections at once (tests use a few).
    pub fn with_cap(mut self, cap: usize) -> Gate {
        self.cap = cap.max(1);
        self
    }

    /// The listener.
    pub fn listener(&self) -> &TcpListener {
        &self.listener
    }

    /// How many connections are being vetted.
    pub fn vetting(&self) -> usize {
        self.vetting.len()
    }

    /// Appends what to wait for: the listener while there is room to vet, and every
    /// connection being vetted.
    pub fn fds(&self, fds: &mut Vec<libc::pollfd>) {
        if self.vetting.len() < self.cap && self.starved.is_none() {
            fds.push(pollin(self.listener.as_raw_fd()));
        }
        for v in &self.vetting {
            let mut fd = pollin(v.conn.as_raw_fd());
            if v.written < v.out.len() {
                fd.events |= libc::POLLOUT;
            }
            fds.push(fd);
        }
    }

    /// How long until the next handshake runs out of time (None: none under way).
    pub fn due(&self) -> Option<Duration> {
        let now = Instant::now();
        let starved = self.starved.map(|t| t.saturating_duration_since(now));
        self.vetting
            .iter()
            .map(|v| v.until.saturating_duration_since(now))
            .chain(starved)
            .min()
    }

    /// Accepts what waits (while there is room), moves every handshake on, and closes
    /// those past their deadline or that failed. Never blocks.
    pub fn turn(&mut self) -> (Vec<Admitted>, Vec<Dropped>) {
        let now = Instant::now();
        if self.starved.is_some_and(|t| now < t) {
            return self.advance(now);
        }
        self.starved = None;
        while self.vetting.len() < self.cap {
            match self.listener.accept() {
                Ok((conn, addr)) => {
                    if conn.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let _ = conn.set_nodelay(true);
                    self.vetting.push(Vetting {
                        conn,
                        peer: addr.to_string(),
                        until: now + HANDSHAKE_TIME,
                        stage: Stage::Hello,
                        inbuf: Vec::new(),
                        out: Vec::new(),
                        written: 0,
                    });
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                    crate::log!(
                        crate::log::Level::Warning,
                        "no file descriptor left to accept a connection ({}): it waits \
                         in the queue",
                        crate::limits::open_files_text()
                    );
                    self.starved = Some(now + STARVED_FOR);
                    break;
                }
                // WouldBlock, or a connection that ended in the queue.
                Err(_) => break,
            }
        }
        self.advance(now)
    }

    /// Moves every handshake under way on.
    fn advance(&mut self, now: Instant) -> (Vec<Admitted>, Vec<Dropped>) {
        let (mut admitted, mut dropped) = (Vec::new(), Vec::new());
        let mut i = 0;
        while i < self.vetting.len() {
            match self.vetting[i].turn(&self.secret, now) {
                Turn::Waiting => i += 1,
                Turn::Admitted(fields, session) => {
                    let v = self.vetting.swap_remove(i);
                    admitted.push(Admitted {
                        conn: v.conn,
                        peer: v.peer,
                        fields,
                        session,
                    });
                }
                Turn::Dropped(why) => {
                    let v = self.vetting.swap_remove(i);
                    dropped.push(Dropped { peer: v.peer, why });
                }
            }
        }
        (admitted, dropped)
    }
}

/// A pollfd waiting to read `fd`.
pub fn pollin(fd: std::os::fd::RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

/// Waits in poll(2) on `fds` for at most `timeout` (None: no limit).
pub fn wait(fds: &mut [libc::pollfd], timeout: Option<Duration>) {
    let ms = timeout.map_or(-1, |d| {
        d.as_millis()
            .clamp(u128::from(!d.is_zero()), i32::MAX as u128) as libc::c_int
    });
    // SAFETY: `fds` is a valid array of pollfds for the duration of the call.
    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpStream;

    /// Turns the gate until it admitted one connection or `within` passed.
    fn admit_one(g: &mut Gate, within: Duration) -> (Option<Admitted>, Vec<Dropped>) {
        let until = Instant::now() + within;
        let mut dropped = Vec::new();
        while Instant::now() < until {
            let mut fds = Vec::new();
            g.fds(&mut fds);
            wait(&mut fds, Some(Duration::from_millis(20)));
            let (mut a, d) = g.turn();
            dropped.extend(d);
            if let Some(a) = a.pop() {
                return (Some(a), dropped);
            }
        }
        (None, dropped)
    }

    fn gate(secret: &str) -> (Gate, u16) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        (Gate::new(l, secret).unwrap(), port)
    }

    #[test]
    fn a_dialer_with_the_secret_is_admitted_with_its_fields() {
        let (mut g, port) = gate("k");
        let dialer = std::thread::spawn(move || {
            let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
            auth::dial(&mut c, "k", b"rank 7").map(|_| c)
        });
        let (a, dropped) = admit_one(&mut g, Duration::from_secs(5));
        let a = a.expect("admitted");
        assert!(dropped.is_empty());
        assert_eq!(a.fields, b"rank 7");
        dialer.join().unwrap().unwrap();
    }

    #[test]
    fn a_wrong_secret_is_dropped_and_told() {
        let (mut g, port) = gate("right");
        let dialer = std::thread::spawn(move || {
            let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
            auth::dial(&mut c, "wrong", b"x").map(|_| ())
        });
        let (a, dropped) = admit_one(&mut g, Duration::from_secs(2));
        assert!(a.is_none());
        // The dialer stops at the challenge it cannot check: the gate sees no proof.
        let e = dialer.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("does not know this job's secret"), "{e}");
        assert!(
            dropped.iter().any(|d| d.why.starts_with("no proof")),
            "{:?}",
            dropped.iter().map(|d| &d.why).collect::<Vec<_>>()
        );
    }

    #[test]
    fn strangers_past_the_cap_wait_and_a_real_dialer_gets_in_after_them() {
        let (g, port) = gate("k");
        let mut g = g.with_cap(3);
        // Three silent strangers fill the gate; a real dialer waits in the queue behind.
        let silent: Vec<TcpStream> = (0..3)
            .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
            .collect();
        let mut fds = Vec::new();
        g.fds(&mut fds);
        wait(&mut fds, Some(Duration::from_millis(50)));
        g.turn();
        assert_eq!(g.vetting(), 3);
        let start = Instant::now();
        let dialer = std::thread::spawn(move || {
            let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            auth::dial(&mut c, "k", b"late").map(|_| c)
        });
        let (a, dropped) = admit_one(&mut g, HANDSHAKE_TIME + Duration::from_secs(5));
        assert_eq!(a.expect("admitted after the strangers").fields, b"late");
        assert!(start.elapsed() >= HANDSHAKE_TIME - Duration::from_millis(500));
        assert_eq!(dropped.len(), 3, "the strangers ran out of time");
        assert!(dropped
            .iter()
            .all(|d| d.why == "no hello within the handshake time"));
        dialer.join().unwrap().unwrap();
        drop(silent);
    }

    #[test]
    fn garbage_and_a_trickle_are_dropped_on_time() {
        let (mut g, port) = gate("k");
        let mut junk = TcpStream::connect(("127.0.0.1", port)).unwrap();
        junk.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut trickler = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let t = std::thread::spawn(move || {
            let hello = crate::wire::header(auth::kind::HELLO, 40);
            for b in hello.into_iter().chain([7u8; 40]) {
                if trickler.write_all(&[b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(300));
            }
        });
        let start = Instant::now();
        let mut dropped = Vec::new();
        while dropped.len() < 2 && start.elapsed() < HANDSHAKE_TIME + Duration::from_secs(3) {
            let mut fds = Vec::new();
            g.fds(&mut fds);
            wait(&mut fds, Some(Duration::from_millis(50)));
            dropped.extend(g.turn().1);
        }
        assert_eq!(dropped.len(), 2);
        assert!(
            dropped[0].why.contains("bad frame magic"),
            "{}",
            dropped[0].why
        );
        assert_eq!(dropped[1].why, "no hello within the handshake time");
        t.join().unwrap();
    }
}
