//! The store server: one thread accepting, one thread per client. At most
//! [`MAX_UNPROVEN`] connections are being vetted at once, each within one
//! deadline for its whole handshake; once proven, a client may idle between
//! requests, but each request must arrive whole within [`REQUEST_TIME`].

use super::kind;
use crate::auth;
use crate::deadline::{Deadlined, Vetting, HANDSHAKE_TIME, MAX_UNPROVEN};
use crate::error::{PerseusError, Result};
use crate::wire::{read_frame, write_frame, Reader, Writer};
use std::collections::HashMap;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Largest key or value the store keeps.
const MAX_ENTRY: usize = 1 << 20;

#[derive(Default)]
struct Store {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

/// A running store server; stopped by [`StoreServer::stop`] or on drop.
pub struct StoreServer {
    port: u16,
    stopping: Arc<AtomicBool>,
    store: Arc<Store>,
}

impl StoreServer {
    /// Binds `bind` ("host:port", port 0 for any) and serves until stopped.
    pub fn start(bind: &str, secret: &str) -> Result<StoreServer> {
        let listener = TcpListener::bind(bind)?;
        let port = listener.local_addr()?.port();
        let stopping = Arc::new(AtomicBool::new(false));
        let store = Arc::new(Store::default());
        let instance: String = crate::auth::nonce()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        store
            .map
            .lock()
            .unwrap()
            .insert(super::INSTANCE_KEY.to_string(), instance.into_bytes());
        let (stop, secret, shared) = (stopping.clone(), secret.to_string(), store.clone());
        std::thread::Builder::new()
            .name("perseus-store".into())
            .spawn(move || {
                let vetting = Vetting::default();
                for conn in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let Some(slot) = vetting.admit() else {
                        let n = vetting.turned_away();
                        if n.is_power_of_two() {
                            crate::log!(
                                crate::log::Level::Warning,
                                "rendezvous: closed {n} connection(s) unread so far: \
                                 {MAX_UNPROVEN} unproven ones were being vetted at the time \
                                 (strangers at this port?)"
                            );
                        }
                        continue;
                    };
                    let (store, secret) = (shared.clone(), secret.clone());
                    let _ = std::thread::Builder::new()
                        .name("perseus-store-conn".into())
                        .spawn(move || serve(conn, &store, &secret, slot));
                }
            })?;
        Ok(StoreServer {
            port,
            stopping,
            store,
        })
    }

    /// The keys published so far (a launcher watches ranks check in).
    pub fn keys(&self) -> Vec<String> {
        let mut k: Vec<String> = self.store.map.lock().unwrap().keys().cloned().collect();
        k.sort();
        k
    }

    /// Publishes `key = value` as a client's SET does (a launcher hands out
    /// an elastic job's rounds this way); waiting GETs wake.
    pub fn set(&self, key: &str, value: &[u8]) {
        let mut map = self.store.map.lock().unwrap();
        map.insert(key.to_string(), value.to_vec());
        self.store.changed.notify_all();
    }

    /// The value of `key`, if published.
    pub fn get(&self, key: &str) -> Option<Vec<u8>> {
        self.store.map.lock().unwrap().get(key).cloned()
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stops accepting; open connections end when their clients leave.
    pub fn stop(&self) {
        if !self.stopping.swap(true, Ordering::SeqCst) {
            let _ = TcpStream::connect(("127.0.0.1", self.port));
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

/// Serves one connection: vets it while it holds `slot`, then answers its
/// requests until it leaves.
fn serve(conn: TcpStream, store: &Store, secret: &str, slot: crate::deadline::Slot) {
    let peer = conn
        .peer_addr()
        .map_or_else(|_| "?".into(), |a| a.to_string());
    let drop_it = |why: &str| {
        crate::log!(
            crate::log::Level::Warning,
            "rendezvous: dropped the connection from {peer}: {why}"
        )
    };
    let _ = conn.set_nodelay(true);
    let mut session = {
        let mut vetted = Deadlined::new(&conn, HANDSHAKE_TIME);
        let session = match auth::accept(&mut vetted, secret) {
            Ok((_, session)) => session,
            Err(why) => return drop_it(&why),
        };
        if write_frame(&mut vetted, kind::OK, &[]).is_err() {
            return;
        }
        session
    };
    drop(slot);
    loop {
        // Idle for as long as the client likes; then the whole request on time.
        if conn.set_read_timeout(None).is_err() || conn.peek(&mut [0u8]).is_err() {
            return;
        }
        let mut request = Deadlined::new(&conn, REQUEST_TIME);
        let (k, payload) = match read_frame(&mut request) {
            Ok(f) => f,
            Err(e) if crate::deadline::ran_out(&e) => {
                return drop_it(&format!(
                    "a request did not arrive whole within {REQUEST_TIME:?}"
                ));
            }
            Err(PerseusError::Io(_)) => return,
            Err(e) => return drop_it(&e.to_string()),
        };
        let payload = match session.open(k, &payload) {
            Ok(p) => p,
            Err(e) => {
                let _ = write_frame(&mut request, kind::ERR, e.to_string().as_bytes());
                return drop_it(&e.to_string());
            }
        };
        let reply = handle(store, k, payload, MAX_WAIT);
        let mut answer = Deadlined::new(&conn, REQUEST_TIME);
        let sent = match reply {
            Ok((rk, body)) => write_frame(&mut answer, rk, &body),
            Err(msg) => write_frame(&mut answer, kind::ERR, msg.as_bytes()),
        };
        if sent.is_err() {
            return;
        }
    }
}

/// Longest a GET may wait for its key.
const MAX_WAIT: Duration = Duration::from_secs(86_400);

/// Answers one request; a GET waits at most `max_wait` for its key.
fn handle(
    store: &Store,
    k: u16,
    payload: &[u8],
    max_wait: Duration,
) -> std::result::Result<(u16, Vec<u8>), String> {
    let mut r = Reader::new(payload);
    match k {
        kind::SET => {
            let key = r.str().map_err(|e| e.to_string())?;
            let value = r.bytes().map_err(|e| e.to_string())?.to_vec();
            if key.len() > MAX_ENTRY || value.len() > MAX_ENTRY {
                return Err("key or value too large".into());
            }
            store.map.lock().unwrap().insert(key, value);
            store.changed.notify_all();
            Ok((kind::OK, vec![]))
        }
        kind::GET => {
            let key = r.str().map_err(|e| e.to_string())?;
            let wait = Duration::from_millis(r.u64().map_err(|e| e.to_string())?).min(max_wait);
            let deadline = Instant::now() + wait;
            let mut map = store.map.lock().unwrap();
            loop {
                if let Some(v) = map.get(&key) {
                    let mut w = Writer::new();
                    w.bytes(v);
                    return Ok((kind::VALUE, w.0));
                }
                let now = Instant::now();
                if now >= deadline {
                    return Err(format!("key {key:?} not published within {wait:?}"));
                }
                map = store.changed.wait_timeout(map, deadline - now).unwrap().0;
            }
        }
        other => Err(format!("unknown request kind {other}")),
    }
}

/// Fuzzing entry: one request of kind `k` to a fresh store (GETs do not wait).
#[doc(hidden)]
pub fn fuzz_request(k: u16, payload: &[u8]) {
    let store = Store::default();
    let _ = handle(&store, k, payload, Duration::ZERO);
    let _ = handle(&store, kind::GET, payload, Duration::ZERO);
}
