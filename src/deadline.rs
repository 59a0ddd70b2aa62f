//! One deadline for a whole exchange on a blocking socket, and the cap on how
//! many unproven connections a listener vets at once.
//!
//! A per-read timeout lets a peer that sends one byte just before each timeout
//! keep a handshake open for ever; [`Deadlined`] gives every read and write only
//! what is left of one deadline, so the whole exchange ends on time.

use std::io::{Error, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a new connection has, in all, to prove it knows the job's secret
/// (and, at a mesh port, to say who it is).
pub const HANDSHAKE_TIME: Duration = Duration::from_secs(5);

/// How many connections a listener vets at once (rank 0's mesh port, the
/// rendezvous): more are closed at once, unread, and counted.
pub const MAX_UNPROVEN: usize = 64;

/// A blocking socket whose reads and writes share one deadline.
pub struct Deadlined<'a> {
    conn: &'a TcpStream,
    until: Instant,
}

impl<'a> Deadlined<'a> {
    /// `conn`, to be done with within `within` from now.
    pub fn new(conn: &'a TcpStream, within: Duration) -> Deadlined<'a> {
        Deadlined {
            conn,
            until: Instant::now() + within,
        }
    }

    /// What is left of the deadline, or a `TimedOut` error once it passed.
    fn left(&self) -> std::io::Result<Duration> {
        let now = Instant::now();
        if now >= self.until {
            return Err(Error::new(ErrorKind::TimedOut, "timed out"));
        }
        Ok(self.until - now)
    }
}

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.conn.set_read_timeout(Some(self.left()?))?;
        let mut conn = self.conn;
        conn.read(buf)
    }
}

impl Write for Deadlined<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.conn.set_write_timeout(Some(self.left()?))?;
        let mut conn = self.conn;
        conn.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Connects to `addr` (of `what`, for messages: "rank 3", "the rendezvous"), trying
/// again every `pause` until `timeout` passes (its listener may not be up yet). A
/// failure for want of file descriptors ends at once, naming the open-file limit.
pub fn connect_within(
    addr: &str,
    what: &str,
    timeout: Duration,
    pause: Duration,
) -> crate::error::Result<TcpStream> {
    let deadline = Instant::now() + timeout;
    loop {
        match TcpStream::connect(addr) {
            Ok(s) => return Ok(s),
            Err(e) if crate::limits::out_of_files(&e) => {
                return Err(crate::error::PerseusError::Peer(format!(
                    "could not connect to {what} at {addr}: {e}: {}",
                    crate::limits::open_files_text()
                )))
            }
            Err(e) if Instant::now() >= deadline => {
                return Err(crate::error::PerseusError::Peer(format!(
                    "could not connect to {what} at {addr} within {timeout:?}: {e}"
                )))
            }
            Err(_) => std::thread::sleep(pause),
        }
    }
}

/// Whether `e` is a read or write that ran out of time: a [`Deadlined`] past
/// its deadline, or a socket timeout (which Linux reports as `EAGAIN`). The core's
/// I/O errors keep only the text, so this is the one place that reads it.
pub fn ran_out(e: &crate::error::PerseusError) -> bool {
    matches!(e, crate::error::PerseusError::Io(m)
        if m.contains("timed out") || m.contains("temporarily unavailable"))
}

/// Counts the connections a listener is vetting, up to [`MAX_UNPROVEN`], and
/// those it turned away for want of room.
#[derive(Clone, Default)]
pub struct Vetting {
    now: Arc<AtomicUsize>,
    turned_away: Arc<AtomicUsize>,
}

/// One connection being vetted; its slot frees when this drops.
pub struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Vetting {
    /// A slot for one more connection, or `None` (counted as turned away) when
    /// [`MAX_UNPROVEN`] are being vetted already.
    pub fn admit(&self) -> Option<Slot> {
        let mut n = self.now.load(Ordering::SeqCst);
        loop {
            if n >= MAX_UNPROVEN {
                self.turned_away.fetch_add(1, Ordering::SeqCst);
                return None;
            }
            match self
                .now
                .compare_exchange(n, n + 1, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return Some(Slot(self.now.clone())),
                Err(m) => n = m,
            }
        }
    }

    /// How many connections were closed unread so far for want of a slot.
    pub fn turned_away(&self) -> usize {
        self.turned_away.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn a_trickle_cannot_stretch_the_deadline() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let writer = std::thread::spawn(move || {
            // One byte every 100 ms: each read alone would be well within 300 ms.
            for _ in 0..20 {
                if c.write_all(b"x").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let start = Instant::now();
        let mut d = Deadlined::new(&s, Duration::from_millis(300));
        let mut buf = [0u8; 64];
        let err = d.read_exact(&mut buf).unwrap_err();
        assert!(start.elapsed() < Duration::from_millis(1500));
        assert!(
            matches!(err.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock),
            "{err}"
        );
        drop(s);
        writer.join().unwrap();
    }

    #[test]
    fn slots_are_capped_and_freed() {
        let v = Vetting::default();
        let slots: Vec<Slot> = (0..MAX_UNPROVEN).map(|_| v.admit().unwrap()).collect();
        assert!(v.admit().is_none());
        assert!(v.admit().is_none());
        assert_eq!(v.turned_away(), 2);
        drop(slots);
        assert!(v.admit().is_some());
    }
}
