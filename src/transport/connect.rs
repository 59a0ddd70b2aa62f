//! Joining the job at `init()`: listen, publish this rank's entry in the
//! rendezvous, read every rank's entry in one request, open the host's shared
//! segment, and start the acceptor that keeps the listener open for links made
//! later ([`super::links`]). Control streams go up at once: every worker dials rank 0.

use super::links::{dial_control, Acceptor, Host, Reach, Table};
use super::shm::Segment;
use super::{cma, tree, Mesh};
use crate::config::{Config, Reading};
use crate::error::{PerseusError, Result};
use crate::gate::Gate;
use crate::hash;
use crate::rendezvous::{StoreClient, INSTANCE_KEY};
use std::collections::BTreeMap;
use std::net::{IpAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::{Arc, Mutex, PoisonError};

/// The control streams of one rank ([`super::tree`]): to its parent (none on rank 0)
/// and from each of its children.
pub struct Control {
    /// This rank.
    pub me: usize,
    /// Ranks in the job.
    pub size: usize,
    /// The parent's rank and the stream to it.
    pub parent: Option<(usize, TcpStream)>,
    /// Each child's rank, the ranks of its subtree (itself first), and its stream.
    pub children: Vec<(usize, Vec<usize>, TcpStream)>,
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

/// Joins the job: blocks until this rank knows every rank's entry and, on rank 0,
/// every worker's control stream arrived, or the timeout passes. Data links are made
/// later, as collectives need them.
pub fn connect_mesh(cfg: &Config) -> Result<MeshParts> {
    crate::limits::raise_open_files();
    let t = &cfg.topology;
    let (rank, size, timeout) = (t.rank, t.size, cfg.timeout);
    let Some((host, port)) = &cfg.rendezvous else {
        let reach = Reach {
            me: 0,
            children: Vec::new(),
            addrs: vec![String::new()],
            streams: vec![1],
            secret: cfg.secret.clone(),
            timeout,
            host: None,
        };
        let table = Arc::new(Table::new(reach, 1));
        return Ok(MeshParts {
            mesh: Mesh::over(table, None, 1, None, timeout),
            control: Control {
                me: 0,
                size: 1,
                parent: None,
                children: Vec::new(),
            },
            hosts: vec![String::new()],
        });
    };
    let mut store = StoreClient::connect(host, *port, &cfg.secret, timeout)?;
    let instance = store.get(INSTANCE_KEY, timeout)?;
    let gen = generation(&instance, &cfg.scope, rank);
    let ip = local_addr(cfg, host)?;
    let listener = TcpListener::bind((ip, 0)).map_err(crate::limits::explained)?;
    let addr = listener.local_addr()?;
    // Vetting starts now: a peer that read the table first may dial at once.
    let acceptor = Acceptor::start(Gate::new(listener, &cfg.secret)?, rank, size)?;
    let host = host_key(cfg);
    let (token, unreadable) = match (cfg.shm, cfg.shm_direct) {
        (false, _) | (_, Reading::Off) => (None, None),
        _ if t.local_size > cma::READ_MAX_RANKS => (
            None,
            Some(format!(
                "{} ranks share this host; reading serves at most {}",
                t.local_size,
                cma::READ_MAX_RANKS
            )),
        ),
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
    // Every rank's entry in one request, whatever the job's size.
    let (prefix, suffix) = mesh_key_parts(&cfg.scope, gen);
    let entries = store.get_range(&prefix, &suffix, 0..size, timeout)?;
    let peers = entries
        .iter()
        .enumerate()
        .map(|(p, v)| published(p, v))
        .collect::<Result<Vec<Published>>>()?;
    // Every rank must agree on these, or one would wait for streams or shared-memory rings
    // the other never opens: named here, before any connection.
    must_agree("PERSEUS_ALLREDUCE_STREAMS", &peers, rank, |e| e.streams)?;
    must_agree("PERSEUS_SHM", &peers, rank, |e| u8::from(e.shm))?;
    let hosts: Vec<String> = peers.iter().map(|e| e.host.clone()).collect();
    let tokens: Vec<Option<cma::Token>> = peers.iter().map(|e| e.token).collect();
    let group: Vec<usize> = (0..size).filter(|&p| hosts[p] == host).collect();
    // A host with too many ranks to read one another is not worth a note.
    let crowded = t.local_size > cma::READ_MAX_RANKS;
    if let (Some(why), true) = (unreadable, group.len() > 1 && group[0] == rank && !crowded) {
        crate::log!(
            crate::log::Level::Info,
            "rank {rank}: ranks of host {} do not read one another's memory ({why}): \
             large blocks between them go through the shared-memory rings",
            host.split('@').next().unwrap_or_default()
        );
    }
    let mut shm = None;
    let mut host_part = None;
    if cfg.shm && group.len() > 1 {
        let seg = Arc::new(open_segment(cfg, &mut store, &group, &host, gen)?);
        let me = group.iter().position(|&p| p == rank).unwrap();
        let mut member = vec![None; size];
        for (i, &p) in group.iter().enumerate() {
            member[p] = Some(i);
        }
        host_part = Some(Host {
            seg: seg.clone(),
            member,
            slots: super::shm::slots_for(group.len()),
            next: Mutex::new(0),
        });
        shm = Some((seg, me));
    }
    // Pairs in shared memory keep one TCP stream (idle once the rings are up).
    let streams = (0..size)
        .map(|p| {
            if cfg.shm && hosts[p] == host {
                1
            } else {
                cfg.streams
            }
        })
        .collect();
    let parents = tree::parents(&hosts);
    let reach = Reach {
        me: rank,
        children: (0..size).filter(|&r| parents[r] == Some(rank)).collect(),
        addrs: peers.iter().map(|e| e.addr.clone()).collect(),
        streams,
        secret: cfg.secret.clone(),
        timeout,
        host: host_part,
    };
    let table = Arc::new(Table::new(reach, cfg.streams));
    acceptor.install(table.clone());
    // Control streams up the tree: each rank dials its parent and takes one stream
    // from each child.
    let place = tree::place(&parents, rank);
    let parent = match place.parent {
        Some(p) => Some((
            p,
            dial_control(&peers[p].addr, rank, p, &cfg.secret, timeout)?,
        )),
        None => None,
    };
    let kids: Vec<usize> = place.children.iter().map(|(c, _)| *c).collect();
    let mut arrived: BTreeMap<usize, TcpStream> = table.take_control(&kids)?.into_iter().collect();
    let children = place
        .children
        .into_iter()
        .map(|(c, below)| {
            let s = arrived.remove(&c).expect("taken");
            (c, below, s)
        })
        .collect();
    let control = Control {
        me: rank,
        size,
        parent,
        children,
    };
    Ok(MeshParts {
        mesh: Mesh::over(table, Some(acceptor), cfg.streams, shm, timeout)
            .with_hosts(&hosts)
            .with_tokens(tokens)
            .with_shm(cfg.shm),
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

/// The keys of round `gen`'s entries as a prefix and a suffix around the rank.
fn mesh_key_parts(scope: &str, gen: u64) -> (String, String) {
    let suffix = match gen {
        0 => String::new(),
        g => format!("/{g}"),
    };
    (format!("{scope}mesh/"), suffix)
}

/// What a launcher publishes in place of a rank's entry when that rank will
/// never publish one (an elastic job's worker that did not start): `gone <why>`.
const GONE: &str = "gone ";

/// Parses `peer`'s published entry `v` ("address host-key streams shm token", the
/// token `-` or left out for none).
fn published(peer: usize, v: &[u8]) -> Result<Published> {
    let v = String::from_utf8_lossy(v).to_string();
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
    let layout = super::lane::layout(group.len());
    let mapped = format!("shm/{id:016x}/mapped/");
    if rank != leader {
        let path = String::from_utf8_lossy(&store.get(&ready, t)?).to_string();
        let seg = Segment::open(&path, layout)?;
        let member = group.iter().position(|&p| p == rank).expect("a member");
        store.set(&format!("{mapped}{member}"), b"1")?;
        return Ok(seg);
    }
    remove_stale_segments();
    let path = format!("{SHM_DIR}/{SHM_PREFIX}{id:016x}-{}", std::process::id());
    let seg = Segment::open(&path, layout)?;
    let mapped = (|| {
        store.set(&ready, path.as_bytes())?;
        // Every other member's word in one request.
        store.get_range(&mapped, "", 1..group.len(), t)?;
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
