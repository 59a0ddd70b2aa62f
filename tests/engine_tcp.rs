//! The whole engine over real loopback TCP: ranks as threads, each with its
//! own rendezvous client, mesh and engine thread.

use perseus::config::{Config, Launcher, Topology};
use perseus::engine::{Device, Engine, OpKind, Request, TensorView};
use perseus::rendezvous::StoreServer;
use perseus::{DataType, PerseusError, ReduceOp};
use std::time::Duration;

fn config(rank: usize, size: usize, port: u16, shm: bool) -> Config {
    Config {
        topology: Topology {
            rank,
            size,
            local_rank: rank,
            local_size: size,
            cross_rank: 0,
            cross_size: 1,
            hostname: "localhost".into(),
            launcher: Launcher::Perseus,
            cross_given: true,
        },
        rendezvous: Some(("127.0.0.1".into(), port)),
        host_store: false,
        secret: "t".into(),
        scope: String::new(),
        iface_addr: Some("127.0.0.1".into()),
        timeout: Duration::from_secs(20),
        fusion_threshold: 64 << 20,
        cycle_time: Duration::from_millis(1),
        autotune: None,
        thread_affinity: None,
        bind_cores: false,
        cache_capacity: 1024,
        allgather_mode: 0,
        timeline: None,
        timeline_mark_cycles: false,
        hierarchical_allgather: false,
        log_level: perseus::log::default_level(),
        log_time: false,
        shm,
        shm_direct: perseus::config::Reading::Always,
        lane_bytes: 65_536,
        lane_patience: Duration::from_micros(100),
        accumulate_n_steps: 1,
        allreduce_fusion: None,
        notes: vec![],
        nancheck: false,
        offline_neg: false,
        streams: 1,
        nccl: perseus::config::NcclUse::Auto,
        nccl_nonblocking: false,
        nccl_channels: 1,
        stall: Default::default(),
        downsample_n: 1,
        gradient_momentum: 1.0,
        perf_check_n_steps: 0,
        fused_optimizer: false,
        plan: perseus::plan::Plan::default(),
    }
}

fn view(v: &mut [f32]) -> TensorView {
    TensorView {
        ptr: v.as_mut_ptr().cast(),
        nbytes: std::mem::size_of_val(v),
        dtype: DataType::F32,
        shape: vec![v.len() as i64],
        device: Device::Cpu,
    }
}

/// Runs a `kind` of float32 `v` in place, `set` filling in what else it needs.
fn in_place(
    e: &Engine,
    kind: OpKind,
    name: &str,
    v: &mut [f32],
    set: impl FnOnce(&mut Request),
) -> Result<(), PerseusError> {
    let mut r = Request::new(kind, name, 0);
    r.dtype = DataType::F32;
    r.shape = vec![v.len() as i64];
    set(&mut r);
    let h = e.enqueue(r, Some(view(v)), Some(view(v)))?;
    e.wait(h, || None).map(|_| ())
}

fn allreduce(e: &Engine, name: &str, v: &mut [f32], op: ReduceOp) -> Result<(), PerseusError> {
    in_place(e, OpKind::Allreduce, name, v, |r| r.op = op)
}

fn broadcast(e: &Engine, name: &str, v: &mut [f32], root: i64) -> Result<(), PerseusError> {
    in_place(e, OpKind::Broadcast, name, v, |r| r.root = root)
}

fn job<F>(n: usize, f: F)
where
    F: Fn(usize, &Engine) + Send + Sync + 'static,
{
    job_over(n, false, f)
}

/// Runs `f` on `n` ranks as threads, over shared memory or loopback TCP.
fn job_over<F>(n: usize, shm: bool, f: F)
where
    F: Fn(usize, &Engine) + Send + Sync + 'static,
{
    job_with(n, shm, |_| {}, f)
}

/// [`job_over`] with each rank's configuration changed by `tweak`.
fn job_with<F>(n: usize, shm: bool, tweak: fn(&mut Config), f: F)
where
    F: Fn(usize, &Engine) + Send + Sync + 'static,
{
    let server = StoreServer::start("127.0.0.1:0", "t").unwrap();
    let port = server.port();
    let f = std::sync::Arc::new(f);
    let threads: Vec<_> = (0..n)
        .map(|r| {
            let f = f.clone();
            std::thread::spawn(move || {
                let mut cfg = config(r, n, port, shm);
                tweak(&mut cfg);
                let e = Engine::start(cfg).unwrap();
                f(r, &e);
                e.shutdown().unwrap();
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
}

#[test]
fn allreduce_fused_and_ring_over_tcp_and_shm() {
    for (n, shm) in [(2, false), (3, false), (2, true), (3, true)] {
        job_over(n, shm, move |r, e| {
            let mut big: Vec<f32> = (0..300_001).map(|i| (i % 10) as f32 + r as f32).collect();
            allreduce(e, "big", &mut big, ReduceOp::Sum).unwrap();
            let off = (n * (n - 1) / 2) as f32;
            assert!(big
                .iter()
                .enumerate()
                .all(|(i, x)| *x == n as f32 * (i % 10) as f32 + off));
            // An Average: the ring divides the chunk each rank owns as it
            // lands, on sockets (in pieces) and in shared memory alike.
            let mut avg: Vec<f32> = (0..300_001).map(|i| (i % 10) as f32 + r as f32).collect();
            allreduce(e, "avg", &mut avg, ReduceOp::Average).unwrap();
            let f = (1.0 / n as f64) as f32;
            assert!(avg
                .iter()
                .enumerate()
                .all(|(i, x)| *x == (n as f32 * (i % 10) as f32 + off) * f));
            // Many small tensors in flight at once: fused by the coordinator.
            let mut small: Vec<Vec<f32>> = (0..40).map(|i| vec![(i + r) as f32; 3]).collect();
            let hs: Vec<u64> = small
                .iter_mut()
                .enumerate()
                .map(|(i, v)| {
                    let mut q = Request::new(OpKind::Allreduce, format!("s{i}"), 0);
                    q.dtype = DataType::F32;
                    q.shape = vec![3];
                    q.op = ReduceOp::Average;
                    e.enqueue(q, Some(view(v)), Some(view(v))).unwrap()
                })
                .collect();
            hs.into_iter().for_each(|h| {
                e.wait(h, || None).unwrap();
            });
            for (i, v) in small.iter().enumerate() {
                let want = i as f32 + (n - 1) as f32 / 2.0;
                assert!(v.iter().all(|x| (x - want).abs() < 1e-6), "{v:?} != {want}");
            }
        });
    }
}

#[test]
fn mismatch_fails_everywhere_and_the_job_goes_on() {
    job(3, |r, e| {
        let mut v = vec![1.0f32; 2 + r];
        let err = allreduce(e, "bad", &mut v, ReduceOp::Sum).unwrap_err();
        assert!(matches!(err, PerseusError::Mismatch(_)), "{err:?}");
        assert!(err.to_string().contains("'bad'"), "{err}");
        let mut v = vec![1.0f32; 4];
        allreduce(e, "good", &mut v, ReduceOp::Max).unwrap();
        assert_eq!(v, vec![1.0; 4]);
    });
}

#[test]
fn duplicate_in_flight_name_is_refused() {
    job(2, |r, e| {
        let mut a = vec![1.0f32; 4];
        let mut b = vec![1.0f32; 4];
        let mut q = Request::new(OpKind::Allreduce, "dup", 0);
        q.dtype = DataType::F32;
        q.shape = vec![4];
        if r == 0 {
            let h = e
                .enqueue(q.clone(), Some(view(&mut a)), Some(view(&mut a)))
                .unwrap();
            let err = e
                .enqueue(q, Some(view(&mut b)), Some(view(&mut b)))
                .unwrap_err();
            assert!(err.to_string().contains("already in flight"), "{err}");
            e.wait(h, || None).unwrap();
        } else {
            let h = e
                .enqueue(q, Some(view(&mut a)), Some(view(&mut a)))
                .unwrap();
            e.wait(h, || None).unwrap();
        }
        assert_eq!(a, vec![2.0; 4]);
    });
}

#[test]
fn steady_state_requests_travel_as_cache_ids() {
    job(3, |r, e| {
        for step in 0..6 {
            let mut v = vec![step as f32; 5];
            allreduce(e, "grad", &mut v, ReduceOp::Sum).unwrap();
            assert_eq!(v, vec![3.0 * step as f32; 5]);
        }
        // Rank 0 talks to its own coordinator in memory; the others send ids
        // for every step after the first.
        if r > 0 {
            assert_eq!(e.cache_hits(), 5);
        }
    });
}

/// Beyond the star of the control plane (20 ranks > 16), requests climb a tree to
/// rank 0: rank 0 hears from its 8 children, ranks 1 and 2 relay for 9-16 and 17-19.
/// A relay holds a cached name until every rank below it asked, so a steady step
/// costs rank 0 one frame a child, however the ranks straggle.
#[test]
fn a_relay_passes_a_cached_name_up_once_for_all_the_ranks_below_it() {
    const N: usize = 20;
    const STEPS: u64 = 30;
    let step = |e: &Engine, r: usize, s: usize| {
        let mut v = vec![(r + s) as f32; 64];
        allreduce(e, "grad", &mut v, ReduceOp::Sum).unwrap();
        let want = (N * s + N * (N - 1) / 2) as f32;
        assert!(v.iter().all(|&x| x == want), "rank {r} step {s}: {}", v[0]);
    };
    job(N, move |r, e| {
        for s in 0..3 {
            step(e, r, s);
        }
        let received = |e: &Engine| e.counters()["control_frames_received"];
        let before = received(e);
        for s in 3..3 + STEPS as usize {
            step(e, r, s);
        }
        if r == 0 {
            let frames = received(e) - before;
            // A step's frames are 8; the window may catch one step more at each end.
            assert!(
                frames <= 8 * (STEPS + 2),
                "{frames} frames in {STEPS} steps"
            );
        }
    });
}

/// A rank below a relay that joins (hvd.join) is not waited for: the others' steps go
/// on without it, it contributes zeros, and once everyone joined it is waited for again.
#[test]
fn a_rank_below_a_relay_joins_and_the_others_go_on() {
    const N: usize = 20;
    const JOINER: usize = 12; // below relay 1
    job(N, |r, e| {
        let steps = if r == JOINER { 1 } else { 6 };
        for s in 0..steps {
            let mut v = vec![1.0f32; 8];
            allreduce(e, "grad", &mut v, ReduceOp::Sum).unwrap();
            let want = if s == 0 { N } else { N - 1 } as f32;
            assert_eq!(v, vec![want; 8], "rank {r} step {s}");
        }
        let h = e
            .enqueue(Request::new(OpKind::Join, "join", 0), None, None)
            .unwrap();
        e.wait(h, || None).unwrap();
        // After the join every rank takes part again.
        let mut v = vec![2.0f32; 8];
        allreduce(e, "grad", &mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v, vec![2.0 * N as f32; 8], "rank {r} after the join");
    });
}

/// A relay holds a cached name for the ranks below it that have not asked, but not for
/// long: rank 0's stall check names the one rank that never asked, not its relay's
/// whole subtree.
#[test]
fn the_stall_check_names_the_rank_below_a_relay_that_never_asked() {
    const N: usize = 20;
    const SILENT: usize = 13; // below relay 1, with 9-12 and 14-16
    let tweak = |c: &mut Config| c.stall.fail = Some(Duration::from_secs(3));
    job_with(N, false, tweak, |r, e| {
        for _ in 0..3 {
            let mut v = vec![1.0f32; 8];
            allreduce(e, "grad", &mut v, ReduceOp::Sum).unwrap();
        }
        if r == SILENT {
            std::thread::sleep(Duration::from_secs(5));
        }
        let mut v = vec![1.0f32; 8];
        let err = allreduce(e, "grad", &mut v, ReduceOp::Sum).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("'grad' has waited")
                && text.contains("for ranks [13] (ranks [0-12, 14-19]"),
            "rank {r}: {text}"
        );
    });
}

#[test]
fn shared_memory_and_tcp_give_identical_bits() {
    let results = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    for shm in [false, true] {
        let out = results.clone();
        job_over(3, shm, move |r, e| {
            // Odd sizes around the direct/ring switch and the ring capacity,
            // and one just past the size whose result is written past the
            // cache (misaligned chunks, pieces of every length).
            let sizes = [1usize, 16_385, 131_071, 700_001, (16 << 18) + 3];
            for (k, count) in sizes.into_iter().enumerate() {
                let mut v: Vec<f32> = (0..count)
                    .map(|i| ((i * 2_654_435_761 + r * 97) % 1000) as f32 / 7.0)
                    .collect();
                allreduce(e, &format!("t{k}"), &mut v, ReduceOp::Sum).unwrap();
                let bits: u64 = v
                    .iter()
                    .fold(0u64, |h, x| h.rotate_left(5) ^ x.to_bits() as u64);
                out.lock().unwrap().push((shm, r, k, bits));
            }
            // A broadcast of a result large enough to be written past the cache:
            // over TCP forwarded along the chain through rank 2, in shared memory
            // read from rank 1's memory where the kernel allows (PERSEUS_SHM_DIRECT).
            let len = (16 << 18) + 3;
            let mut b: Vec<f32> = if r == 1 {
                (0..len).map(|i| (i % 1009) as f32).collect()
            } else {
                vec![0.0; len]
            };
            broadcast(e, "b", &mut b, 1).unwrap();
            let wrong = b
                .iter()
                .enumerate()
                .position(|(i, x)| *x != (i % 1009) as f32);
            assert_eq!(wrong, None, "rank {r} shm {shm}: first wrong element");
        });
    }
    let all = results.lock().unwrap();
    for &(_, r, k, bits) in all.iter().filter(|t| t.0) {
        let tcp = all.iter().find(|t| !t.0 && t.1 == r && t.2 == k).unwrap().3;
        assert_eq!(bits, tcp, "rank {r} tensor {k}");
    }
    assert_eq!(all.len(), 2 * 3 * 5);
}

#[test]
fn streams_split_a_large_allreduce_over_tcp() {
    let server = StoreServer::start("127.0.0.1:0", "t").unwrap();
    let port = server.port();
    let n = 3;
    let threads: Vec<_> = (0..n)
        .map(|r| {
            std::thread::spawn(move || {
                let mut cfg = config(r, n, port, false);
                cfg.streams = 3;
                let e = Engine::start(cfg).unwrap();
                // 6 MB: three slices, each on its own connections and thread.
                let count = 1_500_001;
                let mut v: Vec<f32> = (0..count).map(|i| ((i + r) % 9) as f32).collect();
                allreduce(&e, "big", &mut v, ReduceOp::Sum).unwrap();
                assert!(v
                    .iter()
                    .enumerate()
                    .all(|(i, x)| *x == (0..n).map(|q| ((i + q) % 9) as f32).sum::<f32>()));
                let extra = e.counters()["bytes_extra_streams"];
                // Two of three slices went on streams 1 and 2: 2/3 of the ring's 4 MB out.
                assert!(extra > 2 << 20, "rank {r}: {extra} bytes on extra streams");
                // A small one stays on stream 0.
                let mut s = vec![1.0f32; 1000];
                allreduce(&e, "small", &mut s, ReduceOp::Sum).unwrap();
                assert_eq!(s, vec![3.0; 1000]);
                assert_eq!(e.counters()["bytes_extra_streams"], extra);
                e.shutdown().unwrap();
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
}

#[test]
fn streams_must_agree_on_every_rank() {
    let server = StoreServer::start("127.0.0.1:0", "t").unwrap();
    let port = server.port();
    let threads: Vec<_> = (0..2)
        .map(|r| {
            std::thread::spawn(move || {
                let mut cfg = config(r, 2, port, false);
                cfg.streams = 2 + r;
                let err = Engine::start(cfg)
                    .err()
                    .expect("mismatched streams must fail");
                let msg = err.to_string();
                assert!(msg.contains("PERSEUS_ALLREDUCE_STREAMS"), "{msg}");
                assert!(
                    msg.contains(&format!("rank {} has {}", 1 - r, 3 - r)),
                    "{msg}"
                );
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
}

#[test]
fn shared_memory_must_agree_on_every_rank() {
    // PERSEUS_SHM=1 on rank 0 and 0 on rank 1: each names the variable and the other
    // rank's value, before any connection is tried.
    let server = StoreServer::start("127.0.0.1:0", "t").unwrap();
    let port = server.port();
    let threads: Vec<_> = (0..2)
        .map(|r| {
            std::thread::spawn(move || {
                let err = Engine::start(config(r, 2, port, r == 0))
                    .err()
                    .expect("mismatched PERSEUS_SHM must fail");
                let msg = err.to_string();
                assert!(msg.contains("PERSEUS_SHM"), "{msg}");
                let theirs = u8::from(r == 1);
                assert!(
                    msg.contains(&format!("rank {} has {theirs}", 1 - r)),
                    "{msg}"
                );
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
}

/// Starts rank `r` of 2 on a thread: init, an allreduce of 1000 floats checked, shutdown.
fn rank_of_two(port: u16, r: usize) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let e = Engine::start(config(r, 2, port, false)).unwrap();
        let mut v = vec![1.0f32 + r as f32; 1000];
        allreduce(&e, "after.strangers", &mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v, vec![3.0; 1000]);
        e.shutdown().unwrap();
    })
}

/// Rank 0's mesh address once it listens (and vets: from the moment it publishes its
/// entry, while it waits for rank 1's). Rank 0's entry is `mesh/0`, or
/// `mesh/0/<round>` where an earlier test of this process had a rendezvous at the same
/// port (its rounds are counted per address).
fn mesh_address_of_rank_0(server: &StoreServer) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let key = loop {
        let found = server
            .keys()
            .into_iter()
            .find(|k| k == "mesh/0" || k.starts_with("mesh/0/"));
        match found {
            Some(k) => break k,
            None if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10))
            }
            None => panic!("rank 0 published no mesh entry within 20 s"),
        }
    };
    let entry = String::from_utf8(server.get(&key).unwrap()).unwrap();
    entry.split(' ').next().unwrap().to_string()
}

#[test]
fn strangers_at_a_mesh_port_are_dropped_and_the_job_connects() {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    let server = StoreServer::start("127.0.0.1:0", "t").unwrap();
    let port = server.port();
    // Rank 0 waits in init for rank 1 to connect; strangers come first.
    let r0 = rank_of_two(port, 0);
    let addr = mesh_address_of_rank_0(&server);
    let hung_up = |mut s: TcpStream| {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = [0u8; 64];
        assert!(matches!(s.read(&mut buf), Ok(0) | Err(_)), "not closed");
    };
    let mut s = TcpStream::connect(&addr).unwrap();
    s.write_all(b"\x00\x01garbage that is no frame at all")
        .unwrap();
    hung_up(s);
    let mut s = TcpStream::connect(&addr).unwrap();
    s.write_all(&perseus::wire::header(0x300, 1 << 30)).unwrap();
    hung_up(s);
    let mut s = TcpStream::connect(&addr).unwrap();
    // A hello's fields: rank u32, channel u8, stream u8, ring slot u32 (none: all ones).
    let err = perseus::auth::dial(
        &mut s,
        "not the secret",
        &[1, 0, 0, 0, 0, 0, 255, 255, 255, 255],
    )
    .err()
    .expect("a wrong secret must be caught");
    assert!(err.to_string().contains("secret"), "{err}");
    drop(s);
    // The right secret, but a rank that does not exist: refused by the acceptor.
    let mut s = TcpStream::connect(&addr).unwrap();
    perseus::auth::dial(&mut s, "t", &[9, 0, 0, 0, 0, 0, 255, 255, 255, 255]).unwrap();
    let (k, why) = perseus::wire::read_frame(&mut s).unwrap();
    assert_eq!(k, 0x202, "refused");
    assert!(String::from_utf8_lossy(&why).contains("rank 9"), "{why:?}");
    let r1 = rank_of_two(port, 1);
    r0.join().unwrap();
    r1.join().unwrap();
}

#[test]
fn strangers_at_a_mesh_port_cannot_hold_up_init() {
    use std::io::Write;
    use std::net::TcpStream;
    use std::time::Instant;
    let server = StoreServer::start("127.0.0.1:0", "t").unwrap();
    let port = server.port();
    let r0 = rank_of_two(port, 0);
    let addr = mesh_address_of_rank_0(&server);
    // Twenty silent strangers (5 s each, vetted one after another, would be 100 s), and
    // one that trickles a hello a byte a second (never timed out by a per-read timeout).
    let silent: Vec<TcpStream> = (0..20)
        .map(|_| TcpStream::connect(&addr).unwrap())
        .collect();
    let mut trickler = TcpStream::connect(&addr).unwrap();
    let trickle = std::thread::spawn(move || {
        let hello = perseus::wire::header(0x100, 40)
            .into_iter()
            .chain([7u8; 40]);
        for b in hello {
            if trickler.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    });
    std::thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    let r1 = rank_of_two(port, 1);
    r1.join().unwrap();
    r0.join().unwrap();
    // Both ranks connected and reduced long before any stranger's handshake time ran out.
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "{:?}",
        start.elapsed()
    );
    drop(silent);
    trickle.join().unwrap();
}

/// Runs a blocking in-place allreduce of `v` (the lane's way in).
fn allreduce_blocking(e: &Engine, name: &str, v: &mut [f32]) -> Result<(), PerseusError> {
    let mut r = Request::new(OpKind::Allreduce, name, 0);
    r.op = ReduceOp::Sum;
    let h = e.enqueue_blocking(r, Some(view(v)), Some(view(v)))?;
    e.wait(h, || None).map(|_| ())
}

/// Runs a blocking broadcast of `v` from `root` (the lane's way in).
fn broadcast_blocking(e: &Engine, name: &str, root: i64, v: &mut [f32]) {
    let mut r = Request::new(OpKind::Broadcast, name, 0);
    r.root = root;
    let h = e.enqueue_blocking(r, None, Some(view(v))).unwrap();
    e.wait(h, || None).unwrap();
}

/// Runs a blocking reduce-scatter (Sum) of `v` into `out` (this rank's block).
fn reducescatter_blocking(e: &Engine, name: &str, v: &mut [f32], out: &mut [f32]) {
    let mut r = Request::new(OpKind::Reducescatter, name, 0);
    r.op = ReduceOp::Sum;
    let h = e
        .enqueue_blocking(r, Some(view(v)), Some(view(out)))
        .unwrap();
    e.wait(h, || None).unwrap();
}

#[test]
fn blocking_small_allreduces_run_in_the_lane_and_the_rest_on_the_engine() {
    for n in [2, 3] {
        // A patience long enough that every rank meets every call, however loaded the host.
        let patient = |c: &mut Config| c.lane_patience = Duration::from_secs(5);
        job_with(n, true, patient, move |r, e| {
            let lane = |e: &Engine| e.counters()["lane_operations"];
            for i in 0..50 {
                let mut v = vec![r as f32 + i as f32; 33];
                allreduce_blocking(e, "small", &mut v).unwrap();
                let want = (n * (n - 1) / 2) as f32 + (n * i) as f32;
                assert!(v.iter().all(|x| *x == want), "rank {r} call {i}: {v:?}");
            }
            for root in 0..n {
                let mut v = vec![r as f32; 9];
                broadcast_blocking(e, "bcast", root as i64, &mut v);
                assert!(v.iter().all(|x| *x == root as f32), "rank {r}: {v:?}");
            }
            // Rows 2r and 2r + 1 of the sum are this rank's.
            let mut rows: Vec<f32> = (0..2 * n).map(|i| (i * 10 + r) as f32).collect();
            let mut block = [0.0f32; 2];
            reducescatter_blocking(e, "scatter", &mut rows, &mut block);
            let sum = |i: usize| (n * i * 10 + n * (n - 1) / 2) as f32;
            assert_eq!(block, [sum(2 * r), sum(2 * r + 1)], "rank {r}");
            let before = lane(e);
            assert_eq!(before, 51 + n as u64, "rank {r}: {:?}", e.counters());
            // Larger than the lane carries: the engine, with the same result.
            let mut big = vec![1.0f32; 20_000];
            allreduce_blocking(e, "big", &mut big).unwrap();
            assert!(big.iter().all(|x| *x == n as f32));
            assert_eq!(lane(e), before, "80 KB went through the lane");
            // Shapes that differ between ranks: given up by all, and the engine names it.
            let mut odd = vec![1.0f32; 4 + r];
            let err = allreduce_blocking(e, "odd", &mut odd).unwrap_err();
            assert!(
                matches!(err, PerseusError::Mismatch(_)),
                "rank {r}: {err:?}"
            );
            assert!(err.to_string().contains("odd"), "{err}");
            assert_eq!(lane(e), before);
        });
    }
}
