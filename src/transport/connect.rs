//! Building the mesh at `init()`: listen, publish the address in the
//! rendezvous, connect to every lower rank, accept every higher one. Each new
//! stream opens with the challenge-response of [`crate::auth`], whose
//! fields (sender rank, channel, stream index) the acceptor then checks and
//! answers.

use super::shm::Segment;
use super::{cma, Link, Mesh};
use crate::auth;
use crate::config::{Config, Reading};
use crate::deadline::{Deadlined, Vetting, HANDSHAKE_TIME, MAX_UNPROVEN};
use crate::error::{PerseusError, Result};
use crate::hash;
use crate::rendezvous::{StoreClient, INSTANCE_KEY};
use crate::wire::{read_frame, write_frame, Reader, Writer};
use std::collections::BTreeMap;
use std::net::{IpAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

const HELLO_OK: u16 = 0x201;
const HELLO_ERR: u16 = 0x202;
const CHANNEL_DATA: u8 = 0;
const CHANNEL_CONTROL: u8 = 1;
/// Bytes of each shared-memory ring (one per ordered pair of local ranks).
const SHM_RING_BYTES: usize = 512 << 10;

/// The control streams of one rank (blocking sockets).
pub enum Control {
    /// Rank 0: a stream from every other rank (`None` at index 0).
    Coordinator(Vec<Option<TcpStream>>),
    /// Any other rank: its stream to rank 0.
    Worker(TcpStream),
}

/// What `connect_mesh` builds.
pub struct MeshParts {
    /// Data streams.
    pub mesh: Mesh,
    /// Control streams.
    pub control: Control,
    /// Every rank's host key: equal keys mean the same host.
    pub hosts: Vec<String>,
}

/// The address peers should use to reach this rank.
fn local_addr(cfg: &Config, rdv_host: &str) -> Result<IpAddr> {
    if let Some(a) = &cfg.iface_addr {
        return a.parse().map_err(|_| PerseusError::InvalidConfig {
            var: "PERSEUS_IFACE_ADDR".into(),
            value: a.clone(),
            allowed: "an IP address of this host".into(),
        });
    }
    let probe = UdpSocket::bind("0.0.0.0:0")?;
    probe.connect((rdv_host, 9))?;
    Ok(probe.local_addr()?.ip())
}

/// The fields of a mesh hello: sender rank, channel, stream.
fn hello(rank: usize, channel: u8, stream: usize) -> Vec<u8> {
    let mut w = Writer::new();
    w.u32(rank as u32).u8(channel).u8(stream as u8);
    w.0
}

/// Connects the whole job. Blocks until every peer is connected or the
/// timeout passes.
pub fn connect_mesh(cfg: &Config) -> Result<MeshParts> {
    let t = &cfg.topology;
    let (rank, size, timeout) = (t.rank, t.size, cfg.timeout);
    let Some((host, port)) = &cfg.rendezvous else {
        return Ok(MeshParts {
            mesh: Mesh::new(0, vec![Link::None], None, timeout),
            control: Control::Coordinator(vec![None]),
            hosts: vec![String::new()],
        });
    };
    let mut store = StoreClient::connect(host, *port, &cfg.secret, timeout)?;
    let instance = store.get(INSTANCE_KEY, timeout)?;
    let gen = generation(&instance, &cfg.scope, rank);
    let ip = local_addr(cfg, host)?;
    let listener = TcpListener::bind((ip, 0))?;
    let addr = listener.local_addr()?;
    let host = host_key(cfg);
    let (token, unreadable) = match (cfg.shm, cfg.shm_direct) {
        (false, _) | (_, Reading::Off) => (None, None),
        (true, how) => match cma::worth_reading(how == Reading::Paced) {
            Ok(t) => (Some(t), None),
            Err(why) => (None, Some(why)),
        },
    };
    if let Some(why) = &unreadable {
        crate::log!(
            crate::log::Level::Debug,
            "rank {rank}: no rank reads this rank's memory ({why})"
        );
    }
    let token_text = token.map_or_else(|| "-".to_string(), |t| t.encode());
    let entry = format!(
        "{addr} {host} {} {} {token_text}",
        cfg.streams,
        u8::from(cfg.shm)
    );
    store.set(&mesh_key(&cfg.scope, rank, gen), entry.as_bytes())?;
    let mut peers = Vec::with_capacity(size);
    for p in 0..size {
        peers.push(if p == rank {
            Published {
                addr: addr.to_string(),
                host: host.clone(),
                streams: cfg.streams,
                shm: cfg.shm,
                token,
            }
        } else {
            published(&mut store, &cfg.scope, p, gen, timeout)?
        });
    }
    // Every rank must agree on these, or one would wait for streams or shared-memory rings
    // the other never opens: named here, before any connection.
    must_agree("PERSEUS_ALLREDUCE_STREAMS", &peers, rank, |e| e.streams)?;
    must_agree("PERSEUS_SHM", &peers, rank, |e| u8::from(e.shm))?;
    let hosts: Vec<String> = peers.iter().map(|e| e.host.clone()).collect();
    let tokens: Vec<Option<cma::Token>> = peers.iter().map(|e| e.token).collect();
    // Pairs in shared memory keep one TCP data stream (unused once the rings are up).
    let streams_to = |p: usize| {
        if cfg.shm && hosts[p] == host {
            1
        } else {
            cfg.streams
        }
    };

    let mut data: Vec<Vec<Option<TcpStream>>> = (0..cfg.streams)
        .map(|_| (0..size).map(|_| None).collect())
        .collect();
    let mut control: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    let mut worker_control = None;
    for (peer, entry) in peers.iter().enumerate().take(rank) {
        for (s, row) in data.iter_mut().enumerate().take(streams_to(peer)) {
            let h = hello(rank, CHANNEL_DATA, s);
            row[peer] = Some(dial(&entry.addr, peer, &cfg.secret, &h, timeout)?);
        }
        if peer == 0 {
            let h = hello(rank, CHANNEL_CONTROL, 0);
            worker_control = Some(dial(&entry.addr, 0, &cfg.secret, &h, timeout)?);
        }
    }
    let mut expect: usize = (rank + 1..size).map(streams_to).sum();
    if rank == 0 {
        expect += size - 1;
    }
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + timeout;
    // Each connection is vetted on a thread of its own, within one deadline for its
    // whole handshake, so no stranger (silent, or trickling a byte at a time) delays
    // a real peer; at most MAX_UNPROVEN at once, the rest closed unread.
    let vetting = Vetting::default();
    let (vetted, arrivals) = mpsc::channel::<Vetted>();
    while expect > 0 {
        for (from, channel, s, conn) in arrivals.try_iter() {
            let open = match channel {
                CHANNEL_DATA => s < streams_to(from) && data[s][from].is_none(),
                _ => control[from].is_none(),
            };
            if !open {
                refuse(
                    rank,
                    &conn,
                    &format!(
                        "rank {from} is already connected (channel {channel}, stream {s}) or has \
                     no such stream"
                    ),
                );
                continue;
            }
            if write_frame(&mut Deadlined::new(&conn, HANDSHAKE_TIME), HELLO_OK, &[]).is_err()
                || conn.set_read_timeout(None).is_err()
                || conn.set_write_timeout(None).is_err()
            {
                continue;
            }
            if channel == CHANNEL_DATA {
                data[s][from] = Some(conn);
            } else {
                control[from] = Some(conn);
            }
            expect -= 1;
        }
        if expect == 0 {
            break;
        }
        // Checked every turn: a flood of connections never lets accept() say WouldBlock.
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (rank + 1..size)
                .filter(|&r| (0..streams_to(r)).any(|s| data[s][r].is_none()))
                .collect();
            return Err(PerseusError::Peer(format!(
                "rank {rank}: ranks {missing:?} did not connect within {timeout:?}{}",
                turned_away(&vetting)
            )));
        }
        match listener.accept() {
            Ok((conn, _)) => {
                if let Some(slot) = vetting.admit() {
                    let (secret, tx) = (cfg.secret.clone(), vetted.clone());
                    let within = timeout.min(HANDSHAKE_TIME);
                    let spawned = std::thread::Builder::new()
                        .name("perseus-vet".into())
                        .spawn(move || {
                            let _slot = slot;
                            match vet(&conn, rank, size, &secret, within) {
                                Ok((from, ch, s)) => {
                                    let _ = tx.send((from, ch, s, conn));
                                }
                                Err(Refused::Unproven(why)) => dropped(rank, &conn, &why),
                                Err(Refused::Told(why)) => refuse(rank, &conn, &why),
                            }
                        });
                    spawned?;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(e.into()),
        }
    }
    if vetting.turned_away() > 0 {
        crate::log!(
            crate::log::Level::Warning,
            "rank {rank}: connected{}",
            turned_away(&vetting)
        );
    }
    for s in data.iter().flatten().flatten() {
        s.set_nonblocking(true)?;
        s.set_nodelay(true)?;
    }
    let control = match worker_control {
        Some(c) => Control::Worker(c),
        None => Control::Coordinator(control),
    };
    let mut rows = data
        .into_iter()
        .map(|row| row.into_iter().map(|s| s.map_or(Link::None, Link::Tcp)));
    let mut links: Vec<Link> = rows.next().expect("stream 0").collect();
    let extra: Vec<Vec<Link>> = rows.map(Iterator::collect).collect();
    let mut shm = None;
    let group: Vec<usize> = (0..size).filter(|&p| hosts[p] == host).collect();
    if let (Some(why), true) = (unreadable, group.len() > 1 && group[0] == rank) {
        crate::log!(
            crate::log::Level::Info,
            "rank {rank}: ranks of host {} do not read one another's memory ({why}): \
             large blocks between them go through the shared-memory rings",
            host.split('@').next().unwrap_or_default()
        );
    }
    if cfg.shm && group.len() > 1 {
        let seg = Arc::new(open_segment(cfg, &mut store, &group, &host, gen)?);
        let me = group.iter().position(|&p| p == rank).unwrap();
        for (i, &p) in group.iter().enumerate() {
            if p != rank {
                let alive = match std::mem::replace(&mut links[p], Link::None) {
                    Link::Tcp(s) => Some(s),
                    _ => None,
                };
                links[p] = Link::Shm {
                    seg: seg.clone(),
                    me,
                    peer: i,
                    alive,
                };
            }
        }
        shm = Some((seg, me));
    }
    Ok(MeshParts {
        mesh: Mesh::new(rank, links, shm, timeout)
            .with_hosts(&hosts)
            .with_tokens(tokens)
            .with_streams(extra, cfg.shm),
        control,
        hosts,
    })
}

/// What a rank publishes in the rendezvous for its peers.
struct Published {
    /// Where it listens.
    addr: String,
    /// Its host key.
    host: String,
    /// Its PERSEUS_ALLREDUCE_STREAMS.
    streams: usize,
    /// Its PERSEUS_SHM.
    shm: bool,
    /// What its peers on its host need to read its memory, where they can.
    token: Option<cma::Token>,
}

/// Fails, naming `var` and the first rank that differs, unless `of` reads from every
/// rank's entry the value it reads from `rank`'s (this one's, also in `peers`).
fn must_agree<T: PartialEq + std::fmt::Display>(
    var: &str,
    peers: &[Published],
    rank: usize,
    of: impl Fn(&Published) -> T,
) -> Result<()> {
    let mine = of(&peers[rank]);
    match peers.iter().enumerate().find(|(_, e)| of(e) != mine) {
        None => Ok(()),
        Some((p, e)) => Err(PerseusError::InvalidConfig {
            var: var.into(),
            value: mine.to_string(),
            allowed: format!("the same value on every rank, but rank {p} has {}", of(e)),
        }),
    }
}

/// How many times this process connected as `rank` of the job at the
/// rendezvous server `instance` (the id it publishes, so a new server at a
/// reused port starts a new count) before: every rank of a job calls init() and
/// shutdown() together, so the counts agree, and each new connection reads
/// only entries of its own round (never the addresses of closed listeners).
fn generation(instance: &[u8], scope: &str, rank: usize) -> u64 {
    type Key = (Vec<u8>, String, usize);
    static ROUNDS: Mutex<BTreeMap<Key, u64>> = Mutex::new(BTreeMap::new());
    let mut rounds = ROUNDS.lock().unwrap_or_else(PoisonError::into_inner);
    let key = (instance.to_vec(), scope.to_string(), rank);
    let n = rounds.entry(key).or_insert(0);
    *n += 1;
    *n - 1
}

/// The key of `rank`'s entry in round `gen` (`mesh/<rank>` in the first,
/// which the launcher watches to see ranks check in), under `scope`
/// (PERSEUS_RENDEZVOUS_SCOPE: an elastic job's round, where ranks change).
fn mesh_key(scope: &str, rank: usize, gen: u64) -> String {
    match gen {
        0 => format!("{scope}mesh/{rank}"),
        g => format!("{scope}mesh/{rank}/{g}"),
    }
}

/// What a launcher publishes in place of a rank's entry when that rank will
/// never publish one (an elastic job's worker that did not start): `gone <why>`.
const GONE: &str = "gone ";

/// Reads `peer`'s published entry ("address host-key streams shm token", the token
/// `-` or left out for none) of round `gen`.
fn published(
    store: &mut StoreClient,
    scope: &str,
    peer: usize,
    gen: u64,
    timeout: Duration,
) -> Result<Published> {
    let v = String::from_utf8_lossy(&store.get(&mesh_key(scope, peer, gen), timeout)?).to_string();
    if let Some(why) = v.strip_prefix(GONE) {
        return Err(PerseusError::Peer(format!(
            "rank {peer} will not join: {why}"
        )));
    }
    let mut f = v.split(' ');
    let (addr, host, streams) = (f.next(), f.next(), f.next().and_then(|s| s.parse().ok()));
    let shm = f.next().and_then(|s| match s {
        "0" => Some(false),
        "1" => Some(true),
        _ => None,
    });
    let token = match f.next() {
        Some("-") | None => Some(None),
        Some(t) => cma::Token::decode(t).map(Some),
    };
    match (addr, host, streams, shm, token) {
        (Some(addr), Some(host), Some(streams), Some(shm), Some(token)) => Ok(Published {
            addr: addr.to_string(),
            host: host.to_string(),
            streams,
            shm,
            token,
        }),
        _ => Err(PerseusError::Protocol(format!(
            "rank {peer} published a malformed mesh entry {v:?}"
        ))),
    }
}

/// Names this host: ranks with equal keys share memory. The launcher's host
/// name (distinct for network-namespace "hosts") or the kernel's, plus the
/// boot id, so two machines that call themselves the same never match.
fn host_key(cfg: &Config) -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let name = crate::config::var("PERSEUS_HOSTNAME").unwrap_or_else(|| {
        let mut buf = [0u8; 256];
        // SAFETY: gethostname writes at most `buf.len()` bytes into `buf`.
        let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        if rc == 0 {
            String::from_utf8_lossy(&buf[..end]).to_string()
        } else {
            String::new()
        }
    });
    let _ = cfg;
    format!("{}@{}", name.replace(' ', "_"), boot.trim())
}

/// Creates (the lowest rank of the host) or opens (the others) the host's
/// segment, and unlinks its file once every local rank has mapped it, so
/// nothing is left behind even if the job crashes later. The file's name
/// carries its creator's pid: a creator that died before the unlink (a
/// local rank never came) leaves a file that the next job's leaders on the
/// host remove.
fn open_segment(
    cfg: &Config,
    store: &mut StoreClient,
    group: &[usize],
    host: &str,
    gen: u64,
) -> Result<Segment> {
    let (rdv_host, rdv_port) = cfg.rendezvous.clone().unwrap_or_default();
    // A short file name from the job and the host.
    let id = hash::fnv1a(
        hash::OFFSET,
        format!(
            "{}|{rdv_host}|{rdv_port}|{}|{host}|{group:?}|{gen}",
            cfg.secret, cfg.scope
        )
        .as_bytes(),
    );
    let rank = cfg.topology.rank;
    let leader = group[0];
    let t = cfg.timeout;
    let ready = format!("shm/{id:016x}/ready");
    if rank != leader {
        let path = String::from_utf8_lossy(&store.get(&ready, t)?).to_string();
        let seg = Segment::open(&path, super::lane::layout(group.len(), SHM_RING_BYTES))?;
        store.set(&format!("shm/{id:016x}/mapped/{rank}"), b"1")?;
        return Ok(seg);
    }
    remove_stale_segments();
    let path = format!("{SHM_DIR}/{SHM_PREFIX}{id:016x}-{}", std::process::id());
    let seg = Segment::open(&path, super::lane::layout(group.len(), SHM_RING_BYTES))?;
    let mapped = (|| {
        store.set(&ready, path.as_bytes())?;
        for p in &group[1..] {
            store.get(&format!("shm/{id:016x}/mapped/{p}"), t)?;
        }
        Ok(())
    })();
    let _ = std::fs::remove_file(&path);
    mapped.map(|()| seg)
}

const SHM_DIR: &str = "/dev/shm";
const SHM_PREFIX: &str = "perseus-";

/// Removes segment files whose creator process no longer exists.
fn remove_stale_segments() {
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return;
    };
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(pid) = name
            .strip_prefix(SHM_PREFIX)
            .and_then(|rest| rest.rsplit_once('-'))
            .and_then(|(_, pid)| pid.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        // SAFETY: signal 0 only asks whether the process exists.
        let gone = unsafe { libc::kill(pid, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone && std::fs::remove_file(e.path()).is_ok() {
            crate::log!(
                crate::log::Level::Info,
                "removed {name}, left in {SHM_DIR} by a job that crashed"
            );
        }
    }
}

/// Connects to `addr`, proves the secret with `hello`'s fields, waits for
/// the answer.
fn dial(
    addr: &str,
    peer: usize,
    secret: &str,
    hello: &[u8],
    timeout: Duration,
) -> Result<TcpStream> {
    let deadline = Instant::now() + timeout;
    let mut s = loop {
        match TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(e) if Instant::now() >= deadline => {
                return Err(PerseusError::Peer(format!(
                    "could not connect to rank {peer} at {addr}: {e}"
                )))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(timeout))?;
    let refused = |e: PerseusError| PerseusError::Peer(format!("rank {peer} at {addr}: {e}"));
    auth::dial(&mut s, secret, hello).map_err(refused)?;
    let (k, p) = read_frame(&mut s).map_err(refused)?;
    if k != HELLO_OK {
        return Err(PerseusError::Peer(format!(
            "rank {peer} at {addr} refused the connection: {}",
            String::from_utf8_lossy(&p)
        )));
    }
    s.set_read_timeout(None)?;
    Ok(s)
}

/// A connection that proved the secret, with the rank, channel and stream it
/// says it is.
type Vetted = (usize, u8, usize, TcpStream);

/// Logs why rank `me` dropped `conn` (once per connection).
fn dropped(me: usize, conn: &TcpStream, why: &str) {
    let peer = conn
        .peer_addr()
        .map_or_else(|_| "?".into(), |a| a.to_string());
    crate::log!(
        crate::log::Level::Warning,
        "rank {me}: dropped a connection from {peer}: {why}"
    );
}

/// Tells a peer of this job why rank `me` refuses `conn` (HELLO_ERR), and logs it.
fn refuse(me: usize, conn: &TcpStream, why: &str) {
    let _ = write_frame(
        &mut Deadlined::new(conn, HANDSHAKE_TIME),
        HELLO_ERR,
        why.as_bytes(),
    );
    dropped(me, conn, why);
}

/// ", after closing N connections unread ..." when the vetting cap was reached.
fn turned_away(v: &Vetting) -> String {
    match v.turned_away() {
        0 => String::new(),
        n => format!(
            " (and closed {n} connection(s) unread: {MAX_UNPROVEN} unproven ones were being \
             vetted at the time; strangers at this port?)"
        ),
    }
}

/// Why [`vet`] refused a connection.
enum Refused {
    /// It did not prove the secret: closed without a word.
    Unproven(String),
    /// A peer of this job that must not connect so: told why.
    Told(String),
}

/// Checks an incoming connection to rank `me` of `size`: the secret, then the
/// hello's fields, all `within` (at most [`HANDSHAKE_TIME`]). Returns (rank,
/// channel, stream) or why it is refused.
fn vet(
    conn: &TcpStream,
    me: usize,
    size: usize,
    secret: &str,
    within: Duration,
) -> std::result::Result<(usize, u8, usize), Refused> {
    let setup = conn.set_nonblocking(false).and(conn.set_nodelay(true));
    setup.map_err(|e| Refused::Unproven(e.to_string()))?;
    let (fields, _) =
        auth::accept(&mut Deadlined::new(conn, within), secret).map_err(Refused::Unproven)?;
    let mut r = Reader::new(&fields);
    let parsed = (|| Some((r.u32().ok()? as usize, r.u8().ok()?, r.u8().ok()? as usize)))();
    let told = |why: String| Err(Refused::Told(why));
    match parsed {
        None => told("malformed hello".to_string()),
        Some((from, ..)) if from <= me || from >= size => {
            told(format!("rank {from} must not connect to rank {me}"))
        }
        Some((from, CHANNEL_CONTROL, _)) if me != 0 => {
            told(format!("unexpected control connection from rank {from}"))
        }
        Some((from, ch, s)) if ch == CHANNEL_DATA || ch == CHANNEL_CONTROL => Ok((from, ch, s)),
        Some((_, ch, _)) => told(format!("unknown channel {ch}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_count_per_server_instance_scope_and_rank() {
        // Ids no real server draws (those are 32 hex digits).
        let (a, b) = (b"test-instance-a".as_slice(), b"test-instance-b".as_slice());
        assert_eq!(generation(a, "", 0), 0);
        assert_eq!(generation(a, "", 0), 1);
        assert_eq!(generation(a, "", 1), 0);
        assert_eq!(generation(a, "elastic/1/", 0), 0);
        // a new server at the same address: a new count
        assert_eq!(generation(b, "", 0), 0);
        assert_eq!(mesh_key("", 3, 0), "mesh/3");
        assert_eq!(mesh_key("elastic/1/", 3, 2), "elastic/1/mesh/3/2");
    }
}
