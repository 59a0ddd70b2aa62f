//! The store client each rank uses during `init()`.

use super::kind;
use crate::auth::{self, Session};
use crate::error::{PerseusError, Result};
use crate::wire::{read_frame, write_frame, Reader, Writer};
use std::net::TcpStream;
use std::time::{Duration, Instant};

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
        let addr = format!("{host}:{port}");
        let deadline = Instant::now() + timeout;
        let conn = loop {
            match TcpStream::connect((host, port)) {
                Ok(c) => break c,
                Err(e) if Instant::now() >= deadline => {
                    return Err(PerseusError::Peer(format!(
                        "could not reach the rendezvous at {addr} within {timeout:?}: {e}"
                    )))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
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
}
