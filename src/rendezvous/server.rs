//! The store server: one thread serves every client, whatever their number. It sleeps
//! in one `poll(2)` over its listener's [`Gate`] (where new connections prove the job
//! secret, each within one deadline for its whole handshake), its clients' sockets and
//! an eventfd that the host's own [`StoreServer::set`] rings. A request for keys not
//! yet published waits as a record, not as a blocked thread, and is answered when the
//! last of them arrives. Once proven, a client may idle between requests, but each
//! request must arrive whole within [`REQUEST_TIME`] of its first byte, and each answer
//! be taken within as long.

use super::kind;
use crate::auth::Session;
use crate::gate::{self, Gate};
use crate::wire::{framed, FrameReader, Reader, Writer};
use std::collections::HashMap;
use std::io::{ErrorKind, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Largest key or value the store keeps.
const MAX_ENTRY: usize = 1 << 20;
/// Most keys one range request may ask for.
const MAX_RANGE: u64 = 1 << 20;

/// What the server thread and the host's calls share.
struct Shared {
    map: Mutex<HashMap<String, Vec<u8>>>,
    /// Keys the host published since the thread last looked.
    changed: Mutex<Vec<String>>,
    /// Rung by the host's `set` and by `stop`.
    bell: OwnedFd,
    stopping: AtomicBool,
    /// Requests answered or parked so far (every kind).
    requests: AtomicU64,
}

impl Shared {
    fn ring(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from `one` to the eventfd.
        unsafe { libc::write(self.bell.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    fn drain_bell(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into `v` from the non-blocking eventfd.
        unsafe { libc::read(self.bell.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }
}

/// A running store server; stopped by [`StoreServer::stop`] or on drop.
pub struct StoreServer {
    port: u16,
    shared: Arc<Shared>,
}

impl StoreServer {
    /// Binds `bind` ("host:port", port 0 for any) and serves until stopped.
    pub fn start(bind: &str, secret: &str) -> crate::error::Result<StoreServer> {
        Self::start_with(bind, secret, gate::MAX_UNPROVEN)
    }

    /// [`StoreServer::start`] with a gate that vets at most `cap` connections at once.
    pub fn start_with(bind: &str, secret: &str, cap: usize) -> crate::error::Result<StoreServer> {
        let listener = TcpListener::bind(bind).map_err(crate::limits::explained)?;
        let port = listener.local_addr()?.port();
        let gate = Gate::new(listener, secret)?.with_cap(cap);
        // SAFETY: eventfd returns a new descriptor (or -1, checked).
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(crate::limits::explained(std::io::Error::last_os_error()));
        }
        let instance: String = crate::auth::nonce()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let mut map = HashMap::new();
        map.insert(super::INSTANCE_KEY.to_string(), instance.into_bytes());
        let shared = Arc::new(Shared {
            map: Mutex::new(map),
            changed: Mutex::new(Vec::new()),
            // SAFETY: `fd` is a new descriptor that nothing else owns.
            bell: unsafe { OwnedFd::from_raw_fd(fd) },
            stopping: AtomicBool::new(false),
            requests: AtomicU64::new(0),
        });
        let mut server = Server {
            gate,
            shared: shared.clone(),
            clients: Vec::new(),
        };
        std::thread::Builder::new()
            .name("perseus-store".into())
            .spawn(move || server.run())?;
        Ok(StoreServer { port, shared })
    }

    /// The keys published so far (a launcher watches ranks check in).
    pub fn keys(&self) -> Vec<String> {
        let mut k: Vec<String> = self.shared.map.lock().unwrap().keys().cloned().collect();
        k.sort();
        k
    }

    /// Publishes `key = value` as a client's SET does (a launcher hands out
    /// an elastic job's rounds this way); waiting requests are answered.
    pub fn set(&self, key: &str, value: &[u8]) {
        let fresh = self
            .shared
            .map
            .lock()
            .unwrap()
            .insert(key.to_string(), value.to_vec())
            .is_none();
        if fresh {
            self.shared.changed.lock().unwrap().push(key.to_string());
            self.shared.ring();
        }
    }

    /// The value of `key`, if published.
    pub fn get(&self, key: &str) -> Option<Vec<u8>> {
        self.shared.map.lock().unwrap().get(key).cloned()
    }

    /// The requests clients made so far (a measure of the rendezvous' cost).
    pub fn requests(&self) -> u64 {
        self.shared.requests.load(Ordering::Relaxed)
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stops serving: the thread closes the listener and every connection.
    pub fn stop(&self) {
        if !self.shared.stopping.swap(true, Ordering::SeqCst) {
            self.shared.ring();
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How long a proven client has to send the rest of a request once its first
/// byte arrived, and to take the answer.
pub const REQUEST_TIME: Duration = Duration::from_secs(5);

/// Longest a GET may wait for its key.
const MAX_WAIT: Duration = Duration::from_secs(86_400);

/// The keys a request waits for.
#[derive(Debug)]
enum Want {
    /// One key.
    One(String),
    /// `prefix{i}suffix` for `i` in `start..start + count`, answered in that order.
    Range {
        prefix: String,
        suffix: String,
        start: u64,
        count: u64,
    },
}

impl Want {
    fn keys(&self) -> Vec<String> {
        match self {
            Want::One(k) => vec![k.clone()],
            Want::Range {
                prefix,
                suffix,
                start,
                count,
            } => (*start..start + count)
                .map(|i| format!("{prefix}{i}{suffix}"))
                .collect(),
        }
    }

    /// True when `key` is one of the keys it waits for.
    fn covers(&self, key: &str) -> bool {
        match self {
            Want::One(k) => k == key,
            Want::Range {
                prefix,
                suffix,
                start,
                count,
            } => key
                .strip_prefix(prefix.as_str())
                .and_then(|rest| rest.strip_suffix(suffix.as_str()))
                .filter(|i| !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()))
                .filter(|i| i.len() == 1 || !i.starts_with('0'))
                .and_then(|i| i.parse::<u64>().ok())
                .is_some_and(|i| i >= *start && i < start + count),
        }
    }

    /// The answer once every key is there: one value, or the values in order.
    fn answer(&self, map: &HashMap<String, Vec<u8>>) -> Option<(u16, Vec<u8>)> {
        let mut w = Writer::new();
        match self {
            Want::One(k) => {
                w.bytes(map.get(k)?);
                Some((kind::VALUE, w.0))
            }
            Want::Range { .. } => {
                let keys = self.keys();
                w.u64(keys.len() as u64);
                for k in &keys {
                    w.bytes(map.get(k)?);
                }
                Some((kind::VALUES, w.0))
            }
        }
    }

    /// How many of its keys are not published yet.
    fn absent(&self, map: &HashMap<String, Vec<u8>>) -> usize {
        match self {
            Want::One(k) => usize::from(!map.contains_key(k)),
            Want::Range { .. } => self.keys().iter().filter(|k| !map.contains_key(*k)).count(),
        }
    }

    /// Why it timed out: the keys still missing (the first few).
    fn missing(&self, map: &HashMap<String, Vec<u8>>, wait: Duration) -> String {
        let keys = self.keys();
        let missing: Vec<&String> = keys.iter().filter(|k| !map.contains_key(*k)).collect();
        let shown: Vec<String> = missing.iter().take(8).map(|k| format!("{k:?}")).collect();
        let more = if missing.len() > shown.len() {
            format!(" and {} more", missing.len() - shown.len())
        } else {
            String::new()
        };
        let plural = if missing.len() == 1 { "key" } else { "keys" };
        format!(
            "{plural} {}{more} not published within {wait:?}",
            shown.join(", ")
        )
    }
}

/// What a request comes to.
enum Answer {
    /// Send this frame.
    Reply(u16, Vec<u8>),
    /// Wait for these keys, at most this long; so many are not published yet.
    Wait(Want, Duration, usize),
    /// Refuse it with this message.
    Refuse(String),
}

/// Answers one request against the store (the map is the caller's, locked); a
/// request for keys not yet published waits at most `max_wait`.
fn answer(
    map: &mut HashMap<String, Vec<u8>>,
    k: u16,
    payload: &[u8],
    max_wait: Duration,
    fresh: &mut Option<String>,
) -> Answer {
    let mut r = Reader::new(payload);
    let parsed = (|| -> crate::error::Result<Answer> {
        Ok(match k {
            kind::SET => {
                let key = r.str()?;
                let value = r.bytes()?.to_vec();
                if key.len() > MAX_ENTRY || value.len() > MAX_ENTRY {
                    return Ok(Answer::Refuse("key or value too large".into()));
                }
                if map.insert(key.clone(), value).is_none() {
                    *fresh = Some(key);
                }
                Answer::Reply(kind::OK, vec![])
            }
            kind::GET => {
                let want = Want::One(r.str()?);
                let wait = Duration::from_millis(r.u64()?).min(max_wait);
                match want.answer(map) {
                    Some((k, body)) => Answer::Reply(k, body),
                    None => Answer::Wait(want, wait, 1),
                }
            }
            kind::GET_RANGE => {
                let (prefix, suffix) = (r.str()?, r.str()?);
                let (start, count) = (r.u64()?, r.u64()?);
                let wait = Duration::from_millis(r.u64()?).min(max_wait);
                if count > MAX_RANGE || start.checked_add(count).is_none() {
                    return Ok(Answer::Refuse(format!(
                        "a range of {count} keys from {start} (at most {MAX_RANGE})"
                    )));
                }
                let want = Want::Range {
                    prefix,
                    suffix,
                    start,
                    count,
                };
                match want.absent(map) {
                    0 => want.answer(map).map_or_else(
                        || Answer::Refuse("keys vanished".into()),
                        |(k, b)| Answer::Reply(k, b),
                    ),
                    absent => Answer::Wait(want, wait, absent),
                }
            }
            other => Answer::Refuse(format!("unknown request kind {other}")),
        })
    })();
    parsed.unwrap_or_else(|e| Answer::Refuse(e.to_string()))
}

/// A request that waits for keys.
struct Waiting {
    want: Want,
    /// Until when, and how long that is.
    until: Instant,
    wait: Duration,
    /// How many of its keys were not published yet, as far as fresh keys told: at 0 it
    /// is answered (or counted again, when the count ran ahead).
    absent: usize,
}

/// One proven client.
struct Client {
    conn: TcpStream,
    peer: String,
    session: Session,
    reader: FrameReader,
    /// When the first byte of a request not yet whole arrived.
    partial_since: Option<Instant>,
    /// Bytes to write, from `written` on, and since when they wait.
    out: Vec<u8>,
    written: usize,
    out_since: Instant,
    /// The request it waits on.
    waiting: Option<Waiting>,
    /// Set when it is to be closed, with why (None: it left).
    closed: Option<Option<String>>,
}

impl Client {
    fn queue(&mut self, k: u16, body: &[u8]) {
        if self.written >= self.out.len() {
            self.out.clear();
            self.written = 0;
            self.out_since = Instant::now();
        }
        self.out.extend_from_slice(&framed(k, body));
        self.flush();
    }

    fn flush(&mut self) {
        while self.written < self.out.len() {
            match self.conn.write(&self.out[self.written..]) {
                Ok(0) => return self.close(None),
                Ok(n) => self.written += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return self.close(None),
            }
        }
    }

    fn close(&mut self, why: Option<String>) {
        self.closed.get_or_insert(why);
    }
}

/// The server thread's state.
struct Server {
    gate: Gate,
    shared: Arc<Shared>,
    clients: Vec<Client>,
}

impl Server {
    fn run(&mut self) {
        while !self.shared.stopping.load(Ordering::SeqCst) {
            let mut fds = vec![gate::pollin(self.shared.bell.as_raw_fd())];
            self.gate.fds(&mut fds);
            let first_client = fds.len();
            for c in &self.clients {
                let mut events = libc::POLLRDHUP;
                if c.waiting.is_none() {
                    events |= libc::POLLIN;
                }
                if c.written < c.out.len() {
                    events |= libc::POLLOUT;
                }
                fds.push(libc::pollfd {
                    fd: c.conn.as_raw_fd(),
                    events,
                    revents: 0,
                });
            }
            gate::wait(&mut fds, self.due());
            self.shared.drain_bell();
            let (admitted, dropped) = self.gate.turn();
            for d in dropped {
                dropped_client(&d.peer, &d.why);
            }
            let revents: Vec<(RawFd, i16)> = fds[first_client..]
                .iter()
                .map(|f| (f.fd, f.revents))
                .collect();
            self.serve(&revents);
            for a in admitted {
                self.admit(a);
            }
            let changed = std::mem::take(&mut *self.shared.changed.lock().unwrap());
            for key in changed {
                self.published(&key);
            }
            self.expire();
            self.clients.retain(|c| match &c.closed {
                None => true,
                Some(None) => false,
                Some(Some(why)) => {
                    dropped_client(&c.peer, why);
                    false
                }
            });
        }
    }

    /// How long until something times out.
    fn due(&self) -> Option<Duration> {
        let now = Instant::now();
        let mut due = self.gate.due();
        for c in &self.clients {
            let mut times = Vec::new();
            if let Some(t) = c.partial_since {
                times.push(t + REQUEST_TIME);
            }
            if c.written < c.out.len() {
                times.push(c.out_since + REQUEST_TIME);
            }
            if let Some(w) = &c.waiting {
                times.push(w.until);
            }
            for t in times {
                let d = t.saturating_duration_since(now);
                due = Some(due.map_or(d, |x| x.min(d)));
            }
        }
        due
    }

    fn admit(&mut self, a: gate::Admitted) {
        let mut c = Client {
            conn: a.conn,
            peer: a.peer,
            session: a.session,
            reader: FrameReader::default(),
            partial_since: None,
            out: Vec::new(),
            written: 0,
            out_since: Instant::now(),
            waiting: None,
            closed: None,
        };
        c.queue(kind::OK, &[]);
        self.clients.push(c);
    }

    /// Reads and answers what the clients sent, writes what they can take.
    fn serve(&mut self, revents: &[(RawFd, i16)]) {
        let mut fresh_keys = Vec::new();
        for (i, &(fd, ev)) in revents.iter().enumerate() {
            let Some(c) = self.clients.get_mut(i) else {
                break;
            };
            debug_assert_eq!(c.conn.as_raw_fd(), fd);
            if ev == 0 {
                continue;
            }
            if ev & libc::POLLOUT != 0 {
                c.flush();
            }
            if c.waiting.is_some() {
                // It sends nothing while it waits: a hang-up is all there is to see.
                if ev & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
                    c.close(None);
                }
                continue;
            }
            if ev & (libc::POLLIN | libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) == 0 {
                continue;
            }
            let frames = match c.reader.read_from(&mut c.conn) {
                Ok(f) => f,
                Err(crate::error::PerseusError::Io(_)) => {
                    c.close(None);
                    continue;
                }
                Err(e) => {
                    c.close(Some(e.to_string()));
                    continue;
                }
            };
            c.partial_since = match (c.reader.partial(), c.partial_since) {
                (false, _) => None,
                (true, Some(t)) if frames.is_empty() => Some(t),
                (true, _) => Some(Instant::now()),
            };
            for (k, payload) in frames {
                if c.closed.is_some() {
                    break;
                }
                let body = match c.session.open(k, &payload) {
                    Ok(b) => b,
                    Err(e) => {
                        c.queue(kind::ERR, e.to_string().as_bytes());
                        c.close(Some(e.to_string()));
                        break;
                    }
                };
                self.shared.requests.fetch_add(1, Ordering::Relaxed);
                let mut fresh = None;
                let a = {
                    let mut map = self.shared.map.lock().unwrap();
                    answer(&mut map, k, body, MAX_WAIT, &mut fresh)
                };
                fresh_keys.extend(fresh);
                match a {
                    Answer::Reply(rk, body) => c.queue(rk, &body),
                    Answer::Refuse(msg) => c.queue(kind::ERR, msg.as_bytes()),
                    Answer::Wait(want, wait, absent) => {
                        c.waiting = Some(Waiting {
                            want,
                            until: Instant::now() + wait,
                            wait,
                            absent,
                        });
                    }
                }
            }
        }
        for key in fresh_keys {
            self.published(&key);
        }
    }

    /// Answers the requests that waited for `key` and now have every key they asked.
    fn published(&mut self, key: &str) {
        let map = self.shared.map.lock().unwrap();
        for c in &mut self.clients {
            let Some(w) = &mut c.waiting else { continue };
            if !w.want.covers(key) {
                continue;
            }
            w.absent = w.absent.saturating_sub(1);
            if w.absent > 0 {
                continue;
            }
            match w.want.answer(&map) {
                Some((k, body)) => {
                    c.waiting = None;
                    c.queue(k, &body);
                }
                None => w.absent = w.want.absent(&map),
            }
        }
    }

    /// Ends waits and transfers past their time.
    fn expire(&mut self) {
        let now = Instant::now();
        let map = self.shared.map.lock().unwrap();
        for c in &mut self.clients {
            if c.partial_since.is_some_and(|t| now >= t + REQUEST_TIME) {
                c.close(Some(format!(
                    "a request did not arrive whole within {REQUEST_TIME:?}"
                )));
            }
            if c.written < c.out.len() && now >= c.out_since + REQUEST_TIME {
                c.close(Some(format!("it took no answer for {REQUEST_TIME:?}")));
            }
            if let Some(w) = &c.waiting {
                if now >= w.until {
                    let msg = w.want.missing(&map, w.wait);
                    c.waiting = None;
                    c.queue(kind::ERR, msg.as_bytes());
                }
            }
        }
    }
}

fn dropped_client(peer: &str, why: &str) {
    crate::log!(
        crate::log::Level::Warning,
        "rendezvous: dropped the connection from {peer}: {why}"
    );
}

/// Fuzzing entry: one request of kind `k` to a fresh store (nothing waits).
#[doc(hidden)]
pub fn fuzz_request(k: u16, payload: &[u8]) {
    let mut map = HashMap::new();
    let mut fresh = None;
    for kind in [k, kind::GET, kind::GET_RANGE] {
        if let Answer::Wait(want, ..) = answer(&mut map, kind, payload, Duration::ZERO, &mut fresh)
        {
            let _ = want.missing(&map, Duration::ZERO);
        }
    }
}
