//! The rendezvous: a small key-value store over TCP where ranks publish their
//! addresses and find each other's. `perseusrun` hosts the server; every rank
//! is a client. Each connection opens with the challenge-response of
//! [`crate::auth`] and every request carries a tag made with its session
//! key; a wrong secret, a bad tag or a malformed frame closes the
//! connection, and the server says why on its standard error.

mod client;
mod server;

pub use client::StoreClient;
#[doc(hidden)]
pub use server::fuzz_request;
pub use server::StoreServer;

/// The key under which every server publishes, as it starts, a random id of its own:
/// a client tells two servers at the same address apart by it (one that stopped,
/// and a new one that got its port).
pub const INSTANCE_KEY: &str = "perseus/instance";

/// Frame kinds of the store protocol.
pub(crate) mod kind {
    /// Client → server: key, value.
    pub const SET: u16 = 2;
    /// Client → server: key, timeout in ms.
    pub const GET: u16 = 3;
    /// Client → server: prefix, suffix, start, count, timeout in ms: the keys
    /// `prefix{i}suffix` for `i` from `start`, all of them, in one answer.
    pub const GET_RANGE: u16 = 4;
    /// Server → client: done.
    pub const OK: u16 = 10;
    /// Server → client: the value.
    pub const VALUE: u16 = 11;
    /// Server → client: the number of values, then each value.
    pub const VALUES: u16 = 13;
    /// Server → client: an error message.
    pub const ERR: u16 = 12;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn set_then_get_across_threads_and_wait() {
        let server = StoreServer::start("127.0.0.1:0", "s3cret").unwrap();
        let addr = ("127.0.0.1".to_string(), server.port());
        let t = Duration::from_secs(5);
        let a = addr.clone();
        let getter = std::thread::spawn(move || {
            let mut c = StoreClient::connect(&a.0, a.1, "s3cret", t).unwrap();
            c.get("k", t).unwrap()
        });
        std::thread::sleep(Duration::from_millis(50));
        let mut c = StoreClient::connect(&addr.0, addr.1, "s3cret", t).unwrap();
        c.set("k", b"value").unwrap();
        assert_eq!(getter.join().unwrap(), b"value");
        let e = c.get("missing", Duration::from_millis(100)).unwrap_err();
        assert!(e.to_string().contains("missing"), "{e}");
        assert_eq!(
            server.keys(),
            vec!["k".to_string(), INSTANCE_KEY.to_string()]
        );
        server.stop();
    }

    #[test]
    fn each_server_publishes_an_id_of_its_own() {
        let t = Duration::from_secs(5);
        let ids: Vec<Vec<u8>> = (0..2)
            .map(|_| {
                let server = StoreServer::start("127.0.0.1:0", "k").unwrap();
                let mut c = StoreClient::connect("127.0.0.1", server.port(), "k", t).unwrap();
                let id = c.get(INSTANCE_KEY, t).unwrap();
                assert_eq!(Some(id.clone()), server.get(INSTANCE_KEY));
                server.stop();
                id
            })
            .collect();
        assert_eq!(ids[0].len(), 32, "{:?}", String::from_utf8_lossy(&ids[0]));
        assert_ne!(ids[0], ids[1]);
    }

    #[test]
    fn the_host_publishes_and_reads_directly_and_waiting_clients_wake() {
        let server = StoreServer::start("127.0.0.1:0", "k").unwrap();
        let port = server.port();
        let t = Duration::from_secs(5);
        let getter = std::thread::spawn(move || {
            let mut c = StoreClient::connect("127.0.0.1", port, "k", t).unwrap();
            c.get("elastic/round/0", t).unwrap()
        });
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(server.get("elastic/round/0"), None);
        server.set("elastic/round/0", b"table");
        assert_eq!(getter.join().unwrap(), b"table");
        let mut c = StoreClient::connect("127.0.0.1", port, "k", t).unwrap();
        c.set("elastic/ready/0/a", b"1").unwrap();
        assert_eq!(server.get("elastic/ready/0/a"), Some(b"1".to_vec()));
    }

    #[test]
    fn wrong_secret_is_refused() {
        let server = StoreServer::start("127.0.0.1:0", "right").unwrap();
        let t = Duration::from_secs(2);
        let e = StoreClient::connect("127.0.0.1", server.port(), "wrong", t)
            .and_then(|mut c| c.set("k", b"v"))
            .unwrap_err();
        assert!(e.to_string().contains("secret"), "{e}");
    }

    #[test]
    fn garbage_does_not_kill_the_server() {
        use std::io::Write;
        let server = StoreServer::start("127.0.0.1:0", "").unwrap();
        let mut s = std::net::TcpStream::connect(("127.0.0.1", server.port())).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let t = Duration::from_secs(2);
        let mut c = StoreClient::connect("127.0.0.1", server.port(), "", t).unwrap();
        c.set("a", b"1").unwrap();
        assert_eq!(c.get("a", t).unwrap(), b"1");
    }

    /// Whether the server closed `s` within `within` (end of file or a reset).
    fn closed_within(s: &mut std::net::TcpStream, within: Duration) -> bool {
        use std::io::Read;
        s.set_read_timeout(Some(within)).unwrap();
        let mut buf = [0u8; 256];
        loop {
            match s.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) => {
                    return !matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    )
                }
            }
        }
    }

    #[test]
    fn strangers_cannot_hold_the_server_nor_turn_a_client_away() {
        use crate::deadline::HANDSHAKE_TIME;
        use std::io::Write;
        use std::net::TcpStream;
        const CAP: usize = 8;
        let server = StoreServer::start_with("127.0.0.1:0", "k", CAP).unwrap();
        let port = server.port();
        // A trickler: one byte of a hello every 300 ms, which no per-read timeout ends.
        let mut trickler = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let trickle = {
            let mut t = trickler.try_clone().unwrap();
            std::thread::spawn(move || {
                let hello = crate::wire::header(0x300, 40).into_iter().chain([7u8; 40]);
                for b in hello {
                    if t.write_all(&[b]).is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(300));
                }
            })
        };
        // Silent strangers fill the rest of the gate; those past it wait in the queue.
        let silent: Vec<TcpStream> = (0..CAP + 3)
            .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        // A real client waits behind them, never turned away, and is served once the
        // strangers' handshake time is up.
        let start = std::time::Instant::now();
        let t = HANDSHAKE_TIME * 3;
        let mut c = StoreClient::connect("127.0.0.1", port, "k", t).unwrap();
        c.set("after", b"strangers").unwrap();
        assert_eq!(c.get("after", t).unwrap(), b"strangers");
        assert!(start.elapsed() < HANDSHAKE_TIME * 2 + Duration::from_secs(3));
        assert!(closed_within(&mut trickler, Duration::from_secs(3)));
        trickle.join().unwrap();
        drop(silent);
    }

    #[test]
    fn a_range_is_one_request_answered_when_its_last_key_arrives() {
        let server = StoreServer::start("127.0.0.1:0", "k").unwrap();
        let port = server.port();
        let t = Duration::from_secs(10);
        let n = 64;
        // Every "rank" publishes its key and reads all of them in one request.
        let ranks: Vec<_> = (0..n)
            .map(|i| {
                std::thread::spawn(move || {
                    let mut c = StoreClient::connect("127.0.0.1", port, "k", t).unwrap();
                    c.set(&format!("mesh/{i}/2"), format!("entry {i}").as_bytes())
                        .unwrap();
                    c.get_range("mesh/", "/2", 0..n, t).unwrap()
                })
            })
            .collect();
        let want: Vec<Vec<u8>> = (0..n).map(|i| format!("entry {i}").into_bytes()).collect();
        for r in ranks {
            assert_eq!(r.join().unwrap(), want);
        }
        // One SET and one range read each.
        assert_eq!(server.requests(), 2 * n as u64);
        // Keys of another round, or with a leading zero, are not in the range.
        let mut c = StoreClient::connect("127.0.0.1", port, "k", t).unwrap();
        c.set("mesh/01/3", b"x").unwrap();
        c.set("mesh/1/3/4", b"x").unwrap();
        let e = c
            .get_range("mesh/", "/3", 0..3, Duration::from_millis(200))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(r#"keys "mesh/0/3", "mesh/1/3", "mesh/2/3" not published"#),
            "{e}"
        );
        // A host's own set answers a waiting range too.
        let waiter = std::thread::spawn(move || {
            let mut c = StoreClient::connect("127.0.0.1", port, "k", t).unwrap();
            c.get_range("r/", "", 5..7, t).unwrap()
        });
        std::thread::sleep(Duration::from_millis(100));
        server.set("r/5", b"five");
        server.set("r/6", b"six");
        assert_eq!(
            waiter.join().unwrap(),
            vec![b"five".to_vec(), b"six".to_vec()]
        );
    }

    #[test]
    fn a_client_that_leaves_while_it_waits_is_forgotten() {
        let server = StoreServer::start("127.0.0.1:0", "k").unwrap();
        let t = Duration::from_secs(5);
        {
            let c = StoreClient::connect("127.0.0.1", server.port(), "k", t).unwrap();
            let mut c = c;
            // Ask with a wait so short that the request is parked and then refused.
            assert!(c.get("never", Duration::from_millis(50)).is_err());
        }
        let mut c = StoreClient::connect("127.0.0.1", server.port(), "k", t).unwrap();
        c.set("k", b"v").unwrap();
        assert_eq!(c.get("k", t).unwrap(), b"v");
    }

    #[test]
    fn a_request_must_arrive_whole_within_the_request_time() {
        use std::io::Write;
        use std::net::TcpStream;
        let server = StoreServer::start("127.0.0.1:0", "k").unwrap();
        let mut s = TcpStream::connect(("127.0.0.1", server.port())).unwrap();
        crate::auth::dial(&mut s, "k", b"rendezvous").unwrap();
        let (k, _) = crate::wire::read_frame(&mut s).unwrap();
        assert_eq!(k, kind::OK);
        // A proven client may idle as long as it likes between requests ...
        std::thread::sleep(Duration::from_millis(300));
        // ... but not trickle one: a header, then a byte every 300 ms.
        s.write_all(&crate::wire::header(kind::SET, 64)).unwrap();
        let start = std::time::Instant::now();
        let mut t = s.try_clone().unwrap();
        let trickle = std::thread::spawn(move || {
            for _ in 0..64 {
                if t.write_all(b"x").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(300));
            }
        });
        assert!(closed_within(
            &mut s,
            server::REQUEST_TIME + Duration::from_secs(3)
        ));
        assert!(start.elapsed() < server::REQUEST_TIME + Duration::from_secs(3));
        drop(s);
        trickle.join().unwrap();
    }
}
