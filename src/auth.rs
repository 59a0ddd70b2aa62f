//! Proof of the job secret without sending it. Every connection (to the
//! rendezvous, between ranks) opens with a challenge-response in
//! HMAC-SHA256:
//!
//! 1. the dialer sends `HELLO`: a fresh 16-byte nonce `a`, then its fields
//!    (rank, channel, ... : whatever the protocol needs);
//! 2. the acceptor answers `CHALLENGE`: its own nonce `b` and
//!    `HMAC(secret, "perseus acceptor" | a | b | fields)`, so a dialer learns
//!    at once that it reached its own job;
//! 3. the dialer checks it and sends `PROOF`:
//!    `HMAC(secret, "perseus dialer" | a | b | fields)`;
//! 4. the acceptor checks the proof and admits or drops the connection.
//!
//! Neither side can replay an old exchange (both nonces are new) and the
//! secret never travels. Both sides then hold a session key,
//! `HMAC(secret, "perseus session" | a | b)`, with which a rendezvous client
//! tags each request ([`Session::seal`]) so the store can check every one.
//! An empty secret (a job started without one) still runs the exchange, but
//! proves nothing: `init()` warns about it.

use crate::error::{PerseusError, Result};
use crate::wire::{read_frame_max, write_frame, MAX_HANDSHAKE};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::{Read, Write};
use std::net::TcpStream;

type HmacSha256 = Hmac<Sha256>;

/// Bytes of a nonce.
pub const NONCE: usize = 16;
/// Bytes of a tag.
pub const TAG: usize = 32;

/// Frame kinds of the exchange.
pub mod kind {
    /// Dialer → acceptor: nonce, fields.
    pub const HELLO: u16 = 0x300;
    /// Acceptor → dialer: nonce, tag.
    pub const CHALLENGE: u16 = 0x301;
    /// Dialer → acceptor: tag.
    pub const PROOF: u16 = 0x302;
    /// Acceptor → dialer: refused, with the reason.
    pub const REFUSED: u16 = 0x303;
}

const ACCEPTOR: &[u8] = b"perseus acceptor";
const DIALER: &[u8] = b"perseus dialer";
const SESSION: &[u8] = b"perseus session";

fn hmac(key: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    let mut m = <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC takes keys of any length");
    for p in parts {
        m.update(&(p.len() as u64).to_le_bytes());
        m.update(p);
    }
    m
}

/// `HMAC(key, parts)`, each part preceded by its length.
pub fn tag(key: &[u8], parts: &[&[u8]]) -> [u8; TAG] {
    hmac(key, parts).finalize().into_bytes().into()
}

/// True when `got` is `HMAC(key, parts)`, compared in constant time.
pub fn verify(key: &[u8], parts: &[&[u8]], got: &[u8]) -> bool {
    hmac(key, parts).verify_slice(got).is_ok()
}

/// A fresh random nonce from the kernel.
pub fn nonce() -> [u8; NONCE] {
    let mut n = [0u8; NONCE];
    let mut at = 0;
    while at < NONCE {
        // SAFETY: getrandom writes at most `NONCE - at` bytes into the buffer.
        let r = unsafe { libc::getrandom(n[at..].as_mut_ptr().cast(), NONCE - at, 0) };
        if r > 0 {
            at += r as usize;
        } else if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            // No getrandom (very old kernels): fall back to the device.
            use std::io::Read;
            let mut f = std::fs::File::open("/dev/urandom").expect("no source of randomness");
            f.read_exact(&mut n).expect("no source of randomness");
            break;
        }
    }
    n
}

/// The key both ends of one authenticated connection share.
pub struct Session {
    key: [u8; TAG],
    seq: u64,
}

impl Session {
    fn new(secret: &str, a: &[u8], b: &[u8]) -> Session {
        Session {
            key: tag(secret.as_bytes(), &[SESSION, a, b]),
            seq: 0,
        }
    }

    /// A session under a fixed key, for the fuzz targets.
    #[doc(hidden)]
    pub fn for_fuzzing() -> Session {
        Session::new("fuzz", b"a", b"b")
    }

    /// Appends to `payload` the tag of the next message of `kind`.
    pub fn seal(&mut self, kind: u16, payload: &mut Vec<u8>) {
        let t = tag(
            &self.key,
            &[&self.seq.to_le_bytes(), &kind.to_le_bytes(), payload],
        );
        self.seq += 1;
        payload.extend_from_slice(&t);
    }

    /// Checks the tag at the end of the next message of `kind` and returns
    /// the message without it.
    pub fn open<'p>(&mut self, kind: u16, payload: &'p [u8]) -> Result<&'p [u8]> {
        let Some(split) = payload.len().checked_sub(TAG) else {
            return Err(PerseusError::Protocol("message without its tag".into()));
        };
        let (body, t) = payload.split_at(split);
        let seq = self.seq.to_le_bytes();
        if !verify(&self.key, &[&seq, &kind.to_le_bytes(), body], t) {
            return Err(PerseusError::Protocol(
                "message tag does not match the job secret".into(),
            ));
        }
        self.seq += 1;
        Ok(body)
    }
}

/// The dialer's side: says hello with `fields`, checks the acceptor's
/// proof, proves itself. The acceptor's verdict follows in the caller's
/// protocol.
pub fn dial(conn: &mut TcpStream, secret: &str, fields: &[u8]) -> Result<Session> {
    let a = nonce();
    let mut hello = a.to_vec();
    hello.extend_from_slice(fields);
    write_frame(conn, kind::HELLO, &hello)?;
    let (k, p) = read_frame_max(conn, MAX_HANDSHAKE)?;
    match k {
        kind::CHALLENGE if p.len() == NONCE + TAG => {}
        kind::REFUSED => {
            return Err(PerseusError::Peer(format!(
                "refused: {}",
                String::from_utf8_lossy(&p)
            )))
        }
        _ => {
            return Err(PerseusError::Protocol(format!(
                "expected a challenge, got a frame of kind {k:#x} and {} bytes",
                p.len()
            )))
        }
    }
    let (b, theirs) = p.split_at(NONCE);
    if !verify(secret.as_bytes(), &[ACCEPTOR, &a, b, fields], theirs) {
        return Err(PerseusError::Peer(
            "the peer does not know this job's secret (another job on the same port?)".into(),
        ));
    }
    let proof = tag(secret.as_bytes(), &[DIALER, &a, b, fields]);
    write_frame(conn, kind::PROOF, &proof)?;
    Ok(Session::new(secret, &a, b))
}

/// Why the `what` frame of a handshake could not be read.
fn unread(what: &str, e: &PerseusError) -> String {
    if crate::deadline::ran_out(e) {
        format!("no {what} within the handshake time")
    } else {
        format!("no {what}: {e}")
    }
}

/// The acceptor's side, one message at a time, for a listener that vets many
/// connections on one thread ([`crate::gate`]): [`challenge`] answers a hello, then
/// [`Challenged::check`] judges the proof.
pub struct Challenged {
    a: Vec<u8>,
    b: [u8; NONCE],
    fields: Vec<u8>,
}

/// Answers the first frame of a dialer (`k`, `hello`): the challenge to send back,
/// and what [`Challenged::check`] needs to judge the proof. Err: why it is no
/// Perseus hello.
pub fn challenge(
    secret: &str,
    k: u16,
    hello: &[u8],
) -> std::result::Result<(Vec<u8>, Challenged), String> {
    if k != kind::HELLO || hello.len() < NONCE {
        return Err(format!(
            "not a Perseus hello (frame kind {k:#x}, {} bytes)",
            hello.len()
        ));
    }
    let (a, fields) = hello.split_at(NONCE);
    let b = nonce();
    let mut payload = b.to_vec();
    payload.extend_from_slice(&tag(secret.as_bytes(), &[ACCEPTOR, a, &b, fields]));
    let pending = Challenged {
        a: a.to_vec(),
        b,
        fields: fields.to_vec(),
    };
    Ok((payload, pending))
}

impl Challenged {
    /// Judges the dialer's second frame (`k`, `proof`): its fields and the session,
    /// or why it is refused (then tell the dialer so with [`kind::REFUSED`]).
    pub fn check(
        self,
        secret: &str,
        k: u16,
        proof: &[u8],
    ) -> std::result::Result<(Vec<u8>, Session), String> {
        let Challenged { a, b, fields } = self;
        if k != kind::PROOF || !verify(secret.as_bytes(), &[DIALER, &a, &b, &fields], proof) {
            return Err(WRONG_SECRET.into());
        }
        let session = Session::new(secret, &a, &b);
        Ok((fields, session))
    }
}

/// Why a proof was refused, as the dialer is told.
pub const WRONG_SECRET: &str = "wrong job secret";

/// The acceptor's side on a blocking stream: reads a hello, challenges, checks the
/// proof. Returns the dialer's fields and the session, or why it was refused (the
/// dialer has been told; the caller logs and drops the connection).
pub fn accept(
    conn: &mut (impl Read + Write),
    secret: &str,
) -> std::result::Result<(Vec<u8>, Session), String> {
    let (k, p) = read_frame_max(conn, MAX_HANDSHAKE).map_err(|e| unread("hello", &e))?;
    let (payload, pending) = challenge(secret, k, &p)?;
    write_frame(conn, kind::CHALLENGE, &payload).map_err(|e| format!("hung up: {e}"))?;
    let (k, proof) = read_frame_max(conn, MAX_HANDSHAKE).map_err(|e| format!("no proof: {e}"))?;
    pending.check(secret, k, &proof).inspect_err(|why| {
        let _ = write_frame(conn, kind::REFUSED, why.as_bytes());
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair(
        dial_secret: &'static str,
        accept_secret: &'static str,
    ) -> (Result<()>, std::result::Result<Vec<u8>, String>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let acceptor = std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            accept(&mut c, accept_secret).map(|(f, _)| f)
        });
        let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let d = dial(&mut c, dial_secret, b"fields").map(|_| ());
        drop(c);
        (d, acceptor.join().unwrap())
    }

    #[test]
    fn same_secret_is_admitted_with_its_fields() {
        let (d, a) = pair("k", "k");
        d.unwrap();
        assert_eq!(a.unwrap(), b"fields");
    }

    #[test]
    fn either_side_with_another_secret_is_caught() {
        let (d, a) = pair("k", "other");
        let e = d.unwrap_err().to_string();
        assert!(e.contains("does not know this job's secret"), "{e}");
        // The dialer stops at the bad challenge: the acceptor sees no proof.
        assert!(a.unwrap_err().contains("no proof"));
    }

    #[test]
    fn sessions_tag_each_message_once() {
        let (mut s, mut r) = (Session::new("k", b"a", b"b"), Session::new("k", b"a", b"b"));
        let mut m = b"set x".to_vec();
        s.seal(2, &mut m);
        assert_eq!(r.open(2, &m).unwrap(), b"set x");
        // Replayed (the sequence moved on), another kind, or altered: refused.
        assert!(r.open(2, &m).is_err());
        let mut m2 = b"get x".to_vec();
        s.seal(3, &mut m2);
        let mut bad = m2.clone();
        bad[0] ^= 1;
        assert!(r.open(3, &bad).is_err());
        assert!(r.open(2, &m2).is_err());
        assert!(r.open(3, &m2[..10]).is_err());
    }

    #[test]
    fn nonces_differ() {
        assert_ne!(nonce(), nonce());
    }
}
