//! The store client each rank uses during `init()`.

use super::kind;
use crate::auth::{self, Session};
use crate::error::{PerseusError, Result};
use crate::wire::{read_frame, write_frame, Reader, Writer};
use std::net::TcpStream;
use std::time::Duration;

/// A connection to the store.
pub struct StoreClient {
    conn: TcpStream,
    addr: String,
    session: Session,
}

impl StoreClient {
    /// Connects (retrying until `timeout`, the server may start later) and
    /// proves it knows the job secret.
    pub fn connect(host: &str, port: u16, secret: &str, timeout: Duration) -> Result<StoreClient> {
        // An IPv6 literal goes in brackets.
        let addr = match host.contains(':') {
            true => format!("[{host}]:{port}"),
            false => format!("{host}:{port}"),
        };
        let conn = crate::deadline::connect_within(
            &addr,
            "the rendezvous",
            timeout,
            Duration::from_millis(50),
        )?;
        conn.set_nodelay(true)?;
        let mut conn = conn;
        let session = auth::dial(&mut conn, secret, b"rendezvous")
            .map_err(|e| PerseusError::Peer(format!("rendezvous at {addr}: {e}")))?;
        let mut c = StoreClient {
            conn,
            addr,
            session,
        };
        c.reply(kind::OK)?;
        Ok(c)
    }

    fn request(&mut self, k: u16, mut payload: Vec<u8>) -> Result<()> {
        self.session.seal(k, &mut payload);
        Ok(write_frame(&mut self.conn, k, &payload)?)
    }

    fn reply(&mut self, want: u16) -> Result<Vec<u8>> {
        let (k, p) = read_frame(&mut self.conn).map_err(|e| {
            PerseusError::Peer(format!(
                "rendezvous at {} closed the connection: {e}",
                self.addr
            ))
        })?;
        match k {
            k if k == want => Ok(p),
            kind::ERR | auth::kind::REFUSED => Err(PerseusError::Peer(format!(
                "rendezvous at {}: {}",
                self.addr,
                String::from_utf8_lossy(&p)
            ))),
            other => Err(PerseusError::Protocol(format!(
                "unexpected store reply kind {other}"
            ))),
        }
    }

    /// Publishes `key = value`.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        let mut w = Writer::new();
        w.str(key).bytes(value);
        self.request(kind::SET, w.0)?;
        self.reply(kind::OK).map(|_| ())
    }

    /// Waits up to `timeout` for `key` and returns its value.
    pub fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let mut w = Writer::new();
        w.str(key).u64(timeout.as_millis() as u64);
        self.request(kind::GET, w.0)?;
        let p = self.reply(kind::VALUE)?;
        let mut r = Reader::new(&p);
        Ok(r.bytes()?.to_vec())
    }

    /// Waits up to `timeout` for every key `prefix{i}suffix`, `i` in `range`, and
    /// returns their values in that order: one request, whatever the number of keys.
    pub fn get_range(
        &mut self,
        prefix: &str,
        suffix: &str,
        range: std::ops::Range<usize>,
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>> {
        let mut w = Writer::new();
        w.str(prefix)
            .str(suffix)
            .u64(range.start as u64)
            .u64(range.len() as u64)
            .u64(timeout.as_millis() as u64);
        self.request(kind::GET_RANGE, w.0)?;
        let p = self.reply(kind::VALUES)?;
        let mut r = Reader::new(&p);
        let n = r.u64()? as usize;
        if n != range.len() {
            return Err(PerseusError::Protocol(format!(
                "asked the rendezvous for {} keys, got {n}",
                range.len()
            )));
        }
        (0..n).map(|_| Ok(r.bytes()?.to_vec())).collect()
    }
}
