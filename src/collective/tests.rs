//! Every collective, every group size 1-7, sizes that exercise the direct,
//! ring and segmented paths, ranks as threads over in-memory channels.

use super::*;
use crate::dtype::{DataType, ReduceOp};
use crate::error::PerseusError;
use crate::kernels::AlignedBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Mutex;
use std::time::Duration;

/// A rank of an in-memory group: on each stream, a channel to and from
/// every other rank.
pub(crate) struct ThreadComm {
    rank: usize,
    streams: Vec<Links>,
    /// Host of every rank.
    hosts: Vec<usize>,
    /// Ranks on one host share memory (one stream between them).
    shm: bool,
    /// Payload bytes this rank sent to ranks on other hosts.
    inter: AtomicUsize,
    /// Payload bytes this rank sent.
    sent: AtomicUsize,
    /// Payload bytes this rank sent on each stream.
    per_stream: Vec<AtomicUsize>,
    /// Ranks may read each other's memory (all threads of this process).
    direct: bool,
    /// Peers whose memory this rank fails to read.
    failing: Vec<usize>,
    /// Per peer: a direct read between this rank and it failed.
    refused: Vec<std::sync::atomic::AtomicBool>,
    /// Direct reads this rank made.
    direct_reads: AtomicUsize,
}

/// One stream's channels of a rank.
struct Links {
    tx: Vec<Sender<Vec<u8>>>,
    rx: Vec<Mutex<Receiver<Vec<u8>>>>,
}

fn group_streams(n: usize, streams: usize) -> Vec<ThreadComm> {
    let mut comms: Vec<ThreadComm> = (0..n)
        .map(|rank| ThreadComm {
            rank,
            streams: Vec::new(),
            hosts: vec![0; n],
            shm: false,
            inter: AtomicUsize::new(0),
            sent: AtomicUsize::new(0),
            per_stream: (0..streams).map(|_| AtomicUsize::new(0)).collect(),
            direct: false,
            failing: Vec::new(),
            refused: (0..n).map(|_| Default::default()).collect(),
            direct_reads: AtomicUsize::new(0),
        })
        .collect();
    for _ in 0..streams {
        let mut txs: Vec<Vec<Option<Sender<Vec<u8>>>>> = (0..n).map(|_| vec![None; n]).collect();
        let mut rxs: Vec<Vec<Option<Receiver<Vec<u8>>>>> =
            (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        for (a, row) in txs.iter_mut().enumerate() {
            for (b, slot) in row.iter_mut().enumerate() {
                let (t, r) = channel();
                *slot = Some(t);
                rxs[b][a] = Some(r);
            }
        }
        for ((c, tx), rx) in comms.iter_mut().zip(txs).zip(rxs) {
            c.streams.push(Links {
                tx: tx.into_iter().map(Option::unwrap).collect(),
                rx: rx.into_iter().map(|r| Mutex::new(r.unwrap())).collect(),
            });
        }
    }
    comms
}

impl ThreadComm {
    fn transfer_on(
        &self,
        stream: usize,
        sends: &mut [Send<'_>],
        recvs: &mut [Recv<'_>],
    ) -> crate::error::Result<()> {
        let links = &self.streams[stream];
        for s in sends.iter() {
            let len = s.data().len();
            if self.hosts[s.peer()] != self.hosts[self.rank] {
                self.inter.fetch_add(len, Ordering::Relaxed);
            }
            self.sent.fetch_add(len, Ordering::Relaxed);
            self.per_stream[stream].fetch_add(len, Ordering::Relaxed);
            links.tx[s.peer()].send(s.data().to_vec()).unwrap();
        }
        for r in recvs.iter_mut() {
            let got = links.rx[r.peer()]
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(10))
                .map_err(|_| PerseusError::Peer(format!("rank {} is silent", r.peer())))?;
            r.deliver(&got);
        }
        Ok(())
    }
}

impl Comm for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.hosts.len()
    }
    fn transfer(&self, sends: &mut [Send<'_>], recvs: &mut [Recv<'_>]) -> crate::error::Result<()> {
        self.transfer_on(0, sends, recvs)
    }
    fn host(&self, rank: usize) -> usize {
        self.hosts[rank]
    }
    fn streams(&self) -> usize {
        self.streams.len()
    }
    fn shares_memory(&self) -> bool {
        self.shm
    }
    fn channel(&self, s: usize) -> Option<Box<dyn Comm + '_>> {
        (s < self.streams.len()).then(|| Box::new(Stream { comm: self, s }) as Box<dyn Comm>)
    }
    fn readable(&self, _rank: usize) -> bool {
        self.direct
    }
    fn read_direct(&self, from: usize, addr: u64, buf: &mut [u8]) -> bool {
        if self.failing.contains(&from) {
            return false;
        }
        self.direct_reads.fetch_add(1, Ordering::Relaxed);
        // Every rank is a thread of this process: the real call, on ourselves.
        crate::transport::cma::Token::own().is_ok_and(|t| t.read(addr, buf))
    }
    fn direct_refused(&self, peer: usize) -> bool {
        self.refused[peer].load(Ordering::Relaxed)
    }
    fn refuse_direct(&self, peer: usize) {
        self.refused[peer].store(true, Ordering::Relaxed);
    }
}

/// Stream `s` of a [`ThreadComm`].
struct Stream<'a> {
    comm: &'a ThreadComm,
    s: usize,
}

impl Comm for Stream<'_> {
    fn rank(&self) -> usize {
        self.comm.rank
    }
    fn size(&self) -> usize {
        self.comm.size()
    }
    fn transfer(&self, sends: &mut [Send<'_>], recvs: &mut [Recv<'_>]) -> crate::error::Result<()> {
        self.comm.transfer_on(self.s, sends, recvs)
    }
    fn host(&self, rank: usize) -> usize {
        self.comm.hosts[rank]
    }
}

/// Runs `f(comm)` on `n` threads and returns their results in rank order.
pub(crate) fn run<T: std::marker::Send + 'static>(
    n: usize,
    f: impl Fn(&ThreadComm) -> T + std::marker::Send + Sync + 'static,
) -> Vec<T> {
    run_on(&vec![0; n], f)
}

/// Like [`run`], with rank `r` on host `hosts[r]`.
pub(crate) fn run_on<T: std::marker::Send + 'static>(
    hosts: &[usize],
    f: impl Fn(&ThreadComm) -> T + std::marker::Send + Sync + 'static,
) -> Vec<T> {
    run_streams(hosts, 1, false, f)
}

/// Like [`run_on`], with `streams` streams per pair and (`shm`) ranks on
/// one host sharing memory.
fn run_streams<T: std::marker::Send + 'static>(
    hosts: &[usize],
    streams: usize,
    shm: bool,
    f: impl Fn(&ThreadComm) -> T + std::marker::Send + Sync + 'static,
) -> Vec<T> {
    let mut comms = group_streams(hosts.len(), streams);
    comms.iter_mut().for_each(|c| {
        c.hosts = hosts.to_vec();
        c.shm = shm;
    });
    run_comms(comms, f)
}

/// Runs `f(comm)` for each of `comms` on a thread of its own; the results in rank order.
fn run_comms<T: std::marker::Send + 'static>(
    comms: Vec<ThreadComm>,
    f: impl Fn(&ThreadComm) -> T + std::marker::Send + Sync + 'static,
) -> Vec<T> {
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let f = f.clone();
            std::thread::spawn(move || f(&c))
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// A float32 Sum allreduce of `buf`, unscaled.
fn sum_f32(c: &dyn Comm, buf: &mut [u8]) -> crate::error::Result<()> {
    let mut scratch = AlignedBuf::default();
    allreduce(c, buf, DataType::F32, ReduceOp::Sum, 1.0, &mut scratch)
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn to_f32s(b: &[u8]) -> Vec<f32> {
    b.chunks(4)
        .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

const SIZES: [usize; 7] = [0, 1, 3, 17, 5000, 70_001, 300_000];

#[test]
fn allreduce_sum_matches_reference() {
    for n in [1, 2, 3, 4, 5, 7] {
        for count in SIZES {
            let out = run(n, move |c| {
                let v: Vec<f32> = (0..count)
                    .map(|i| ((i * 7 + c.rank()) % 13) as f32)
                    .collect();
                let mut b = AlignedBuf::from_slice(&f32s(&v));
                sum_f32(c, b.as_mut_slice()).unwrap();
                to_f32s(b.as_slice())
            });
            let want: Vec<f32> = (0..count)
                .map(|i| (0..n).map(|r| ((i * 7 + r) % 13) as f32).sum())
                .collect();
            for (r, got) in out.iter().enumerate() {
                assert_eq!(got, &want, "n={n} count={count} rank={r}");
            }
        }
    }
}

#[test]
fn scaled_allreduce_gives_the_bytes_of_reducing_then_scaling() {
    // Direct exchange, ring, odd element counts; floats and truncated ints.
    for n in [1, 2, 3, 4] {
        for count in [5usize, 17_000, 70_001] {
            for dtype in [DataType::F32, DataType::F64, DataType::I32] {
                let out = run(n, move |c| {
                    let bytes: Vec<u8> = (0..count)
                        .flat_map(|i| {
                            let x = ((i * 13 + c.rank() * 5) % 101) as f64 * 0.37 - 17.0;
                            match dtype {
                                DataType::F32 => (x as f32).to_ne_bytes().to_vec(),
                                DataType::F64 => x.to_ne_bytes().to_vec(),
                                _ => (x as i32).to_ne_bytes().to_vec(),
                            }
                        })
                        .collect();
                    let factor = 1.0 / 3.0;
                    let mut a = AlignedBuf::from_slice(&bytes);
                    let mut b = AlignedBuf::from_slice(&bytes);
                    let mut s = AlignedBuf::default();
                    allreduce(c, a.as_mut_slice(), dtype, ReduceOp::Sum, 1.0, &mut s).unwrap();
                    crate::kernels::scale(a.as_mut_slice(), dtype, factor);
                    allreduce(c, b.as_mut_slice(), dtype, ReduceOp::Sum, factor, &mut s).unwrap();
                    (a.as_slice().to_vec(), b.as_slice().to_vec())
                });
                for (r, (a, b)) in out.iter().enumerate() {
                    assert!(a == b, "n={n} count={count} {dtype:?} rank {r}");
                    assert!(
                        a == &out[0].0,
                        "n={n} count={count} {dtype:?} rank {r} differs"
                    );
                }
            }
        }
    }
}

#[test]
fn allreduce_from_a_separate_input_gives_the_in_place_bytes_and_leaves_the_input() {
    // Direct exchange, ring (its first step reads the input), odd counts; a factor.
    for n in [1, 2, 3, 4, 5] {
        for count in [17usize, 70_001, 300_000] {
            for (dtype, op) in [
                (DataType::F32, ReduceOp::Sum),
                (DataType::I32, ReduceOp::Max),
                (DataType::F64, ReduceOp::Product),
            ] {
                let out = run(n, move |c| {
                    let bytes: Vec<u8> = (0..count)
                        .flat_map(|i| {
                            let x = ((i * 11 + c.rank() * 3) % 7) as f64 * 0.5 + 0.5;
                            match dtype {
                                DataType::F32 => (x as f32).to_ne_bytes().to_vec(),
                                DataType::F64 => x.to_ne_bytes().to_vec(),
                                _ => ((x * 4.0) as i32 - 9).to_ne_bytes().to_vec(),
                            }
                        })
                        .collect();
                    let factor = if op == ReduceOp::Sum { 0.25 } else { 1.0 };
                    let src = AlignedBuf::from_slice(&bytes);
                    let mut want = AlignedBuf::from_slice(&bytes);
                    let mut got = AlignedBuf::zeroed(bytes.len());
                    let mut s = AlignedBuf::default();
                    allreduce(c, want.as_mut_slice(), dtype, op, factor, &mut s).unwrap();
                    allreduce_from(
                        c,
                        src.as_slice(),
                        got.as_mut_slice(),
                        dtype,
                        op,
                        factor,
                        &mut s,
                    )
                    .unwrap();
                    (
                        want.as_slice().to_vec(),
                        got.as_slice().to_vec(),
                        src.as_slice() == &bytes[..],
                    )
                });
                for (r, (want, got, kept)) in out.iter().enumerate() {
                    assert!(want == got, "n={n} count={count} {dtype:?} {op:?} rank {r}");
                    assert!(kept, "n={n} count={count} rank {r}: the input changed");
                }
            }
        }
    }
}

#[test]
fn allreduce_min_max_product_on_ints() {
    for n in [2, 3, 5] {
        for op in [ReduceOp::Min, ReduceOp::Max, ReduceOp::Product] {
            for count in [4usize, 40_000] {
                let out = run(n, move |c| {
                    let v: Vec<i32> = (0..count)
                        .map(|i| (i % 5) as i32 - c.rank() as i32)
                        .collect();
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_ne_bytes()).collect();
                    let mut b = AlignedBuf::from_slice(&bytes);
                    let mut s = AlignedBuf::default();
                    allreduce(c, b.as_mut_slice(), DataType::I32, op, 1.0, &mut s).unwrap();
                    b.as_slice().to_vec()
                });
                let want: Vec<u8> = (0..count)
                    .map(|i| {
                        let vals = (0..n).map(|r| (i % 5) as i32 - r as i32);
                        match op {
                            ReduceOp::Min => vals.min().unwrap(),
                            ReduceOp::Max => vals.max().unwrap(),
                            _ => vals.product(),
                        }
                    })
                    .flat_map(|x| x.to_ne_bytes())
                    .collect();
                assert!(
                    out.iter().all(|o| o == &want),
                    "n={n} op={op:?} count={count}"
                );
            }
        }
    }
}

#[test]
fn reduce_scatter_gives_each_rank_its_rows() {
    for n in [1, 2, 3, 4] {
        let out = run(n, move |c| {
            let counts: Vec<usize> = (0..n).map(|i| i * 1000 + 1).collect();
            let total: usize = counts.iter().sum();
            let v: Vec<f32> = (0..total).map(|i| (i + c.rank()) as f32).collect();
            let mut b = AlignedBuf::from_slice(&f32s(&v));
            let own =
                reduce_scatter(c, b.as_mut_slice(), &counts, DataType::F32, ReduceOp::Sum).unwrap();
            (own.start / 4, to_f32s(&b.as_slice()[own]))
        });
        for (start, vals) in out {
            for (k, x) in vals.iter().enumerate() {
                let i = start + k;
                let want: f32 = (0..n).map(|r| (i + r) as f32).sum();
                assert_eq!(*x, want);
            }
        }
    }
}

#[test]
fn allgatherv_with_uneven_blocks() {
    for n in [1, 2, 3, 5] {
        let sizes: Vec<usize> = (0..n).map(|i| (i * 37_003) % 90_000).collect();
        let s2 = sizes.clone();
        let out = run(n, move |c| {
            let total: usize = s2.iter().sum();
            let mut b = vec![0u8; total];
            let off: usize = s2[..c.rank()].iter().sum();
            b[off..off + s2[c.rank()]].fill(c.rank() as u8 + 1);
            allgatherv(c, &mut b, &s2).unwrap();
            b
        });
        let want: Vec<u8> = sizes
            .iter()
            .enumerate()
            .flat_map(|(r, &s)| vec![r as u8 + 1; s])
            .collect();
        assert!(out.iter().all(|o| o == &want), "n={n}");
    }
}

#[test]
fn broadcast_from_every_root_small_and_chained() {
    for n in [1, 2, 3, 4] {
        for len in [0usize, 10, 3 * (1 << 20) + 5] {
            for root in 0..n {
                let out = run(n, move |c| {
                    let mut b = if c.rank() == root {
                        (0..len).map(|i| (i % 251) as u8).collect()
                    } else {
                        vec![0u8; len]
                    };
                    broadcast(c, &mut b, root).unwrap();
                    b
                });
                let want: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
                assert!(
                    out.iter().all(|o| o == &want),
                    "n={n} len={len} root={root}"
                );
            }
        }
    }
}

/// Runs `f(comm)` on `n` threads of one host whose memory each can read, except
/// that rank `r` fails to read the ranks `failing(r)`.
fn run_direct<T: std::marker::Send + 'static>(
    n: usize,
    failing: impl Fn(usize) -> Vec<usize>,
    f: impl Fn(&ThreadComm) -> T + std::marker::Send + Sync + 'static,
) -> Vec<T> {
    let mut comms = group_streams(n, 1);
    comms.iter_mut().for_each(|c| {
        c.shm = true;
        c.direct = true;
        c.failing = failing(c.rank);
    });
    run_comms(comms, f)
}

#[test]
fn a_direct_broadcast_is_read_from_the_roots_memory() {
    if crate::transport::cma::Token::own().is_err() {
        eprintln!("this host forbids process_vm_readv: the direct broadcast is not tried");
        return;
    }
    for n in [2, 3, 4] {
        for len in [10usize, 64 * 1024 + 1, 3 * (1 << 20) + 5] {
            for root in 0..n {
                let out = run_direct(
                    n,
                    |_| Vec::new(),
                    move |c| {
                        let mut b = if c.rank() == root {
                            (0..len).map(|i| (i % 251) as u8).collect()
                        } else {
                            vec![0u8; len]
                        };
                        broadcast(c, &mut b, root).unwrap();
                        (
                            b,
                            c.sent.load(Ordering::Relaxed),
                            c.direct_reads.load(Ordering::Relaxed),
                        )
                    },
                );
                let want: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
                // Three ranks or more read; two take the ring.
                let big = len > 64 * 1024 && n >= 3;
                let chained = len > 64 * 1024 && !big;
                for (r, (b, sent, reads)) in out.iter().enumerate() {
                    assert!(b == &want, "n={n} len={len} root={root} rank {r}");
                    let (want_sent, want_reads) = match (big, r == root) {
                        // The root sends each reader an offer; each reader answers.
                        (true, true) => (16 * (n - 1), 0),
                        (true, false) => (1, 1),
                        _ if chained => (if r == root { len } else { 0 }, 0),
                        // Small buffers go from the root to each rank.
                        (false, true) => (len * (n - 1), 0),
                        (false, false) => (0, 0),
                    };
                    assert_eq!(
                        (*sent, *reads),
                        (want_sent, want_reads),
                        "n={n} len={len} root={root} rank {r}: bytes sent, direct reads"
                    );
                }
            }
        }
    }
}

#[test]
fn a_rank_that_cannot_read_the_root_gets_the_bytes_then_and_after() {
    // Rank 2 cannot read rank 0's memory: it says so and is sent the buffer; the
    // second broadcast sends it at once (both sides remember); the others read.
    let len = 1 << 20;
    const { assert!(4 >= super::broadcast::DIRECT_RANKS, "four ranks read") };
    let out = run_direct(
        4,
        |r| if r == 2 { vec![0] } else { Vec::new() },
        move |c| {
            let mut sent = Vec::new();
            for round in 0..2u8 {
                let mut b = if c.rank() == 0 {
                    vec![round + 7; len]
                } else {
                    vec![0u8; len]
                };
                let before = c.sent.load(Ordering::Relaxed);
                broadcast(c, &mut b, 0).unwrap();
                assert!(
                    b.iter().all(|&x| x == round + 7),
                    "rank {} round {round}",
                    c.rank()
                );
                sent.push(c.sent.load(Ordering::Relaxed) - before);
            }
            (sent, c.direct_refused(0), c.direct_refused(2))
        },
    );
    // The root: offers to 1, 2 and 3, then the bytes to 2; next time offers to 1
    // and 3 and the bytes to 2 at once.
    assert_eq!(out[0], (vec![3 * 16 + len, 2 * 16 + len], false, true));
    assert_eq!(out[1], (vec![1, 1], false, false));
    assert_eq!(out[2], (vec![1, 0], true, false));
    assert_eq!(out[3], (vec![1, 1], false, false));
}

#[test]
fn direct_allgather_and_alltoall_read_large_blocks_and_send_small_ones() {
    if crate::transport::cma::Token::own().is_err() {
        eprintln!("this host forbids process_vm_readv: the direct exchange is not tried");
        return;
    }
    let big = offer::DIRECT_FROM;
    for n in [2, 3, 4] {
        // Rank 1 cannot read rank 0: that pair's blocks travel as bytes, both ways.
        let failing = |r: usize| if r == 1 { vec![0] } else { Vec::new() };
        // Allgather: rank p's block has sizes[p] bytes of value p + 1; rank 0's is small.
        let sizes: Vec<usize> = (0..n).map(|p| if p == 0 { 100 } else { big + p }).collect();
        let sz = sizes.clone();
        let out = run_direct(n, failing, move |c| {
            let total: usize = sz.iter().sum();
            let parts = consecutive(sz.iter().copied());
            let mut buf = vec![0u8; total];
            buf[parts[c.rank()].clone()].fill(c.rank() as u8 + 1);
            allgatherv(c, &mut buf, &sz).unwrap();
            // Alltoall: rank r sends (r + d) * 1000 + 70_000 bytes of value r * 16 + d to d.
            let len = |r: usize, d: usize| (r + d) * 1000 + 70_000;
            let r = c.rank();
            let mut input = Vec::new();
            let mut send = Vec::new();
            for d in 0..n {
                let s = input.len();
                input.extend(std::iter::repeat_n((r * 16 + d) as u8, len(r, d)));
                send.push(s..input.len());
            }
            let recv = consecutive((0..n).map(|p| len(p, r)));
            let mut output = vec![0u8; recv.last().unwrap().end];
            alltoallv(c, &input, &send, &mut output, &recv).unwrap();
            let want: Vec<u8> = (0..n)
                .flat_map(|p| std::iter::repeat_n((p * 16 + r) as u8, len(p, r)))
                .collect();
            assert!(output == want, "n={n} rank {r}: alltoall");
            (
                buf,
                c.direct_reads.load(Ordering::Relaxed),
                c.direct_refused(0),
                c.direct_refused(1),
            )
        });
        let want: Vec<u8> = sizes
            .iter()
            .enumerate()
            .flat_map(|(p, &s)| vec![p as u8 + 1; s])
            .collect();
        for (r, (buf, reads, refused0, refused1)) in out.iter().enumerate() {
            assert!(buf == &want, "n={n} rank {r}: allgather");
            // Allgather: the large blocks of the others (all but rank 0's small one),
            // between two ranks none (the ring); alltoall: every other rank's block.
            // Rank 1 reads nothing of rank 0's.
            let others_big = match n >= super::ring::GATHER_READ_RANKS {
                true => (1..n).filter(|&p| p != r).count(),
                false => 0,
            };
            let want_reads = others_big + if r == 1 { n - 2 } else { n - 1 };
            assert_eq!(*reads, want_reads, "n={n} rank {r}: direct reads");
            assert_eq!((*refused0, *refused1), (r == 1, r == 0), "n={n} rank {r}");
        }
    }
}

#[test]
fn a_large_allreduce_on_one_host_reads_the_chunks_it_reduces_and_gathers() {
    if crate::transport::cma::Token::own().is_err() {
        eprintln!("this host forbids process_vm_readv: the direct exchange is not tried");
        return;
    }
    for n in [2, 3, 4] {
        // Buffers of 2 MiB and more read; the smaller take the ring. Under `failing`,
        // rank 1 cannot read rank 0.
        for (count, failing) in [(300_001usize, false), (600_001, false), (600_001, true)] {
            for from in [false, true] {
                let fail = move |r: usize| {
                    if failing && r == 1 {
                        vec![0]
                    } else {
                        Vec::new()
                    }
                };
                let out = run_direct(n, fail, move |c| {
                    let v: Vec<f32> = (0..count)
                        .map(|i| ((i * 7 + c.rank()) % 13) as f32 * 0.1)
                        .collect();
                    let mut b = AlignedBuf::from_slice(&f32s(&v));
                    let mut scratch = AlignedBuf::default();
                    if from {
                        let src = b.as_slice().to_vec();
                        let dst = b.as_mut_slice();
                        allreduce_from(
                            c,
                            &src,
                            dst,
                            DataType::F32,
                            ReduceOp::Sum,
                            0.5,
                            &mut scratch,
                        )
                        .unwrap();
                    } else {
                        let dst = b.as_mut_slice();
                        allreduce(c, dst, DataType::F32, ReduceOp::Sum, 0.5, &mut scratch).unwrap();
                    }
                    (b.as_slice().to_vec(), c.sent.load(Ordering::Relaxed))
                });
                // The same bytes as the ring's.
                let ring = run(n, move |c| {
                    let v: Vec<f32> = (0..count)
                        .map(|i| ((i * 7 + c.rank()) % 13) as f32 * 0.1)
                        .collect();
                    let mut b = AlignedBuf::from_slice(&f32s(&v));
                    let mut scratch = AlignedBuf::default();
                    let dst = b.as_mut_slice();
                    allreduce(c, dst, DataType::F32, ReduceOp::Sum, 0.5, &mut scratch).unwrap();
                    b.as_slice().to_vec()
                });
                let chunk = count * 4 / n;
                for (r, (got, sent)) in out.iter().enumerate() {
                    let what =
                        format!("n={n} count={count} failing={failing} from={from} rank {r}");
                    assert!(got == &ring[0], "{what}: bytes differ from the ring's");
                    if count * 4 < super::reading::FROM {
                        assert!(*sent >= chunk, "{what}: the ring sends chunks, sent {sent}");
                    } else if !failing {
                        // Offers of the reduction (17 bytes) and of the gather (16), and
                        // the gather's answers.
                        assert_eq!(*sent, 34 * (n - 1), "{what}: bytes sent");
                    } else if r == 0 {
                        // Rank 0 sends rank 1 its chunk and, after, its reduced chunk.
                        assert!(*sent >= 2 * chunk, "{what}: sent {sent}");
                    }
                }
            }
        }
    }
}

#[test]
fn alltoallv_uneven_splits() {
    for n in [1, 2, 3, 4] {
        // Rank r sends (r + d + 1) bytes of value r*16+d to rank d.
        let out = run(n, move |c| {
            let r = c.rank();
            let mut input = Vec::new();
            let mut send = Vec::new();
            for d in 0..n {
                let s = input.len();
                input.extend(std::iter::repeat_n((r * 16 + d) as u8, r + d + 1));
                send.push(s..input.len());
            }
            let mut recv = Vec::new();
            let mut off = 0;
            for s in 0..n {
                recv.push(off..off + s + r + 1);
                off += s + r + 1;
            }
            let mut output = vec![0u8; off];
            alltoallv(c, &input, &send, &mut output, &recv).unwrap();
            output
        });
        for (r, got) in out.iter().enumerate() {
            let want: Vec<u8> = (0..n)
                .flat_map(|s| std::iter::repeat_n((s * 16 + r) as u8, s + r + 1))
                .collect();
            assert_eq!(got, &want, "n={n} rank={r}");
        }
    }
}

#[test]
fn barrier_returns_on_every_rank() {
    for n in [1, 2, 3, 6] {
        assert_eq!(run(n, |c| barrier(c).is_ok()), vec![true; n]);
    }
}

#[test]
fn partition_is_even_and_complete() {
    let p = partition(10, 3);
    assert_eq!(p, vec![0..4, 4..7, 7..10]);
    assert_eq!(partition(2, 4), vec![0..1, 1..2, 2..2, 2..2]);
}

#[test]
fn split_mut_borrows_ranges_in_any_order_with_gaps() {
    let mut buf: Vec<u8> = (0..10).collect();
    let parts = split_mut(&mut buf, &[6..9, 0..2, 3..3, 3..5]);
    let seen: Vec<Vec<u8>> = parts.iter().map(|p| p.to_vec()).collect();
    assert_eq!(seen, vec![vec![6, 7, 8], vec![0, 1], vec![], vec![3, 4]]);
    for p in parts {
        p.fill(0);
    }
    assert_eq!(buf, vec![0, 0, 2, 0, 0, 5, 0, 0, 0, 9]);
}

#[test]
#[should_panic(expected = "ranges overlap")]
fn split_mut_refuses_overlapping_ranges() {
    let mut buf = [0u8; 8];
    split_mut(&mut buf, &[0..4, 3..6]);
}

/// Values that sum exactly in float32 and survive float16 (small integers
/// times a power of two), so exact paths can be compared bit for bit.
fn grad(count: usize, rank: usize) -> Vec<f32> {
    (0..count)
        .map(|i| (((i * 5 + rank * 3) % 17) as f32 - 8.0) * 0.25)
        .collect()
}

fn want_sum(count: usize, n: usize) -> Vec<f32> {
    let all: Vec<Vec<f32>> = (0..n).map(|r| grad(count, r)).collect();
    (0..count).map(|i| all.iter().map(|g| g[i]).sum()).collect()
}

#[test]
fn hierarchical_allreduce_is_exact_and_identical_everywhere() {
    for hosts in [
        vec![0, 0, 1, 1],
        vec![0, 0, 0, 1, 1, 1],
        vec![0, 0, 1, 1, 2, 2],
    ] {
        for count in [1usize, 7, 5000, 70_001] {
            let n = hosts.len();
            let out = run_on(&hosts, move |c| {
                let mut b = AlignedBuf::from_slice(&f32s(&grad(count, c.rank())));
                let (mut h, mut s) = (AlignedBuf::default(), AlignedBuf::default());
                let groups = hosts_of(c);
                assert!(fits(&groups));
                allreduce_hierarchical(
                    c,
                    b.as_mut_slice(),
                    DataType::F32,
                    ReduceOp::Sum,
                    false,
                    &mut h,
                    &mut s,
                )
                .unwrap();
                to_f32s(b.as_slice())
            });
            let want = want_sum(count, n);
            for got in &out {
                assert_eq!(got, &want, "hosts={hosts:?} count={count}");
            }
        }
    }
}

/// The hierarchical allgather gives every rank the flat ring's bytes, on hosts of
/// consecutive or interleaved ranks, and each block crosses to each other host once.
#[test]
fn hierarchical_allgather_matches_the_ring_and_crosses_each_host_once() {
    for hosts in [
        vec![0, 0, 1, 1],
        vec![0, 1, 0, 1],
        vec![0, 0, 0, 1, 1, 1],
        vec![0, 0, 1, 1, 2, 2],
        vec![2, 0, 1, 0, 1, 2],
    ] {
        let n = hosts.len();
        let h = *hosts.iter().max().unwrap() + 1;
        // Uneven blocks, rank 0's empty.
        let sizes: Vec<usize> = (0..n).map(|i| (i * 37_003) % 90_000).collect();
        let want: Vec<u8> = sizes
            .iter()
            .enumerate()
            .flat_map(|(r, &s)| (0..s).map(move |k| (r * 31 + k) as u8))
            .collect();
        let on = hosts.clone();
        let sz = sizes.clone();
        let gather = move |hier: bool| {
            let sz = sz.clone();
            run_on(&on, move |c| {
                let mut b = vec![0u8; sz.iter().sum()];
                let off: usize = sz[..c.rank()].iter().sum();
                for k in 0..sz[c.rank()] {
                    b[off + k] = (c.rank() * 31 + k) as u8;
                }
                if hier {
                    assert!(fits(&hosts_of(c)));
                    allgatherv_hierarchical(c, &mut b, &sz).unwrap();
                } else {
                    allgatherv(c, &mut b, &sz).unwrap();
                }
                (b, c.inter.load(Ordering::Relaxed))
            })
        };
        let (flat, hier) = (gather(false), gather(true));
        for (r, ((fb, _), (hb, _))) in flat.iter().zip(&hier).enumerate() {
            assert!(
                fb == &want && hb == &want,
                "hosts={hosts:?}: rank {r} differs"
            );
        }
        let inter = |x: &[(Vec<u8>, usize)]| x.iter().map(|y| y.1).sum::<usize>();
        let total: usize = sizes.iter().sum();
        assert_eq!(inter(&hier), total * (h - 1), "hosts={hosts:?}");
        assert!(
            inter(&flat) > inter(&hier),
            "hosts={hosts:?}: {} vs {}",
            inter(&flat),
            inter(&hier)
        );
    }
}

#[test]
fn hierarchy_needs_several_hosts_with_equal_ranks() {
    let shapes = |hosts: Vec<usize>| {
        let n = hosts.len();
        run_on(&hosts, move |c| fits(&hosts_of(c)))
            .into_iter()
            .all(|f| f)
            .then_some(n)
    };
    assert_eq!(shapes(vec![0, 0, 1, 1]), Some(4));
    assert_eq!(shapes(vec![0, 0, 0, 1]), None, "uneven hosts");
    assert_eq!(shapes(vec![0, 1, 2]), None, "one rank per host");
    assert_eq!(shapes(vec![0, 0, 0]), None, "one host");
}

/// float16 between hosts, on the flat ring and in the hierarchy: identical
/// bytes on every rank, values within float16 rounding of the exact sum,
/// and half the bytes between hosts of an exact run.
#[test]
fn half_between_hosts_is_identical_everywhere_and_halves_inter_host_bytes() {
    for hosts in [
        vec![0, 0, 1, 1],
        vec![0, 1, 0, 1],
        vec![0, 0, 0, 1],
        vec![0, 1],
    ] {
        for hier in [false, true] {
            if hier && hosts != [0, 0, 1, 1] {
                continue;
            }
            let count = 40_001usize;
            let n = hosts.len();
            let on = hosts.clone();
            let run_mode = move |half: bool| {
                run_on(&on, move |c| {
                    let v: Vec<f32> = grad(count, c.rank()).iter().map(|x| x * 1.001).collect();
                    let mut b = AlignedBuf::from_slice(&f32s(&v));
                    let (mut h, mut s) = (AlignedBuf::default(), AlignedBuf::default());
                    let buf = b.as_mut_slice();
                    match (hier, half) {
                        (true, _) => allreduce_hierarchical(
                            c,
                            buf,
                            DataType::F32,
                            ReduceOp::Sum,
                            half,
                            &mut h,
                            &mut s,
                        ),
                        (false, true) => allreduce_half_links(c, buf, ReduceOp::Sum, false, &mut s),
                        (false, false) => sum_f32(c, buf),
                    }
                    .unwrap();
                    (b.as_slice().to_vec(), c.inter.load(Ordering::Relaxed))
                })
            };
            let exact = run_mode(false);
            let mixed = run_mode(true);
            let want: Vec<f32> = want_sum(count, n).iter().map(|x| x * 1.001).collect();
            for (bytes, _) in &mixed {
                assert_eq!(
                    bytes, &mixed[0].0,
                    "hosts={hosts:?} hier={hier}: ranks differ"
                );
                for (g, w) in to_f32s(bytes).iter().zip(&want) {
                    assert!((g - w).abs() <= 2e-3 * w.abs().max(1.0), "{g} vs {w}");
                }
            }
            let inter = |r: &[(Vec<u8>, usize)]| r.iter().map(|x| x.1).sum::<usize>();
            assert!(inter(&exact) > 0);
            assert_eq!(
                inter(&mixed) * 2,
                inter(&exact),
                "hosts={hosts:?} hier={hier}: float16 halves the bytes between hosts"
            );
        }
    }
}

#[test]
fn half_links_everywhere_halve_every_byte_and_agree() {
    for n in [2usize, 3, 5] {
        let count = 30_011usize;
        let run_mode = move |half: bool| {
            run(n, move |c| {
                let v: Vec<f32> = grad(count, c.rank()).iter().map(|x| x / 3.0).collect();
                let mut b = AlignedBuf::from_slice(&f32s(&v));
                let mut s = AlignedBuf::default();
                if half {
                    allreduce_half_links(c, b.as_mut_slice(), ReduceOp::Sum, true, &mut s)
                } else {
                    sum_f32(c, b.as_mut_slice())
                }
                .unwrap();
                (to_f32s(b.as_slice()), c.sent.load(Ordering::Relaxed))
            })
        };
        let (exact, half) = (run_mode(false), run_mode(true));
        for ((got, bytes), (_, exact_bytes)) in half.iter().zip(&exact) {
            assert_eq!(got, &half[0].0, "n={n}: ranks differ");
            for (g, w) in got.iter().zip(&exact[0].0) {
                assert!(
                    (g - w).abs() <= 1e-3 * w.abs().max(1.0),
                    "n={n}: {g} vs {w}"
                );
            }
            assert_eq!(
                bytes * 2,
                *exact_bytes,
                "n={n}: float16 halves what is sent"
            );
        }
    }
}

#[test]
fn half_between_hosts_on_one_host_is_exact() {
    let out = run_on(&[0, 0, 0], |c| {
        let mut b = AlignedBuf::from_slice(&f32s(&grad(1000, c.rank())));
        let mut s = AlignedBuf::default();
        allreduce_half_links(c, b.as_mut_slice(), ReduceOp::Sum, false, &mut s).unwrap();
        to_f32s(b.as_slice())
    });
    assert!(out.iter().all(|o| o == &want_sum(1000, 3)));
}

#[test]
fn stripes_only_where_every_link_has_the_streams() {
    let mib = MIN_STRIPE;
    let check = |hosts: &[usize], streams: usize, shm: bool, len: usize, want: usize| {
        let got = run_streams(hosts, streams, shm, move |c| stripes(c, len));
        assert!(
            got.iter().all(|&k| k == want),
            "hosts {hosts:?} streams {streams} shm {shm} len {len}: {got:?}, want {want}"
        );
    };
    check(&[0, 1], 4, true, 8 * mib, 4);
    check(&[0, 1], 4, true, 3 * mib, 3);
    check(&[0, 1], 4, true, 2 * mib - 1, 1);
    check(&[0, 1], 1, true, 64 * mib, 1);
    // Two ranks of one host share memory: one stream between them.
    check(&[0, 0, 1], 4, true, 64 * mib, 1);
    // Without shared memory every pair has every stream.
    check(&[0, 0, 1], 4, false, 64 * mib, 4);
    check(&[0], 4, false, 64 * mib, 1);
}

#[test]
fn striped_allreduce_uses_every_stream_and_is_exact() {
    // 3 ranks on 3 hosts, 3 streams, ~4.2 MB: three slices of whole elements.
    let count = 1_050_001;
    let out = run_streams(&[0, 1, 2], 3, true, move |c| {
        let mut b = AlignedBuf::from_slice(&f32s(&grad(count, c.rank())));
        sum_f32(c, b.as_mut_slice()).unwrap();
        let per: Vec<usize> = c
            .per_stream
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .collect();
        (to_f32s(b.as_slice()), per)
    });
    let want = want_sum(count, 3);
    for (r, (got, per)) in out.iter().enumerate() {
        assert!(got == &want, "rank {r}: striped sum differs");
        assert!(per.iter().all(|&b| b > 1 << 20), "rank {r}: {per:?}");
    }
}

#[test]
fn striped_half_links_and_hierarchy_agree_everywhere() {
    // 2 hosts of 2 ranks in shared memory: the hierarchy's stage between
    // hosts is striped; the flat float16 ring is not (shared memory in it).
    let count = 3_000_000;
    for (hier, half) in [(true, false), (true, true), (false, true)] {
        let out = run_streams(&[0, 0, 1, 1], 2, true, move |c| {
            let mut b = AlignedBuf::from_slice(&f32s(&grad(count, c.rank())));
            let (mut h, mut s) = (AlignedBuf::default(), AlignedBuf::default());
            let buf = b.as_mut_slice();
            if hier {
                allreduce_hierarchical(c, buf, DataType::F32, ReduceOp::Sum, half, &mut h, &mut s)
            } else {
                allreduce_half_links(c, buf, ReduceOp::Sum, false, &mut s)
            }
            .unwrap();
            (
                to_f32s(b.as_slice()),
                c.per_stream[1].load(Ordering::Relaxed),
            )
        });
        let want = want_sum(count, 4);
        for (r, (got, extra)) in out.iter().enumerate() {
            assert_eq!(got, &out[0].0, "hier {hier} half {half}: rank {r} differs");
            assert_eq!(
                *extra > 0,
                hier,
                "hier {hier} half {half}: rank {r} stream 1"
            );
            if !half {
                assert!(got == &want, "rank {r}: exact hierarchy differs");
            }
        }
    }
    // Ranks on four hosts: the float16 ring itself is striped.
    let out = run_streams(&[0, 1, 2, 3], 2, true, move |c| {
        let mut b = AlignedBuf::from_slice(&f32s(&grad(count, c.rank())));
        let mut s = AlignedBuf::default();
        allreduce_half_links(c, b.as_mut_slice(), ReduceOp::Sum, false, &mut s).unwrap();
        (
            to_f32s(b.as_slice()),
            c.per_stream[1].load(Ordering::Relaxed),
        )
    });
    for (r, (got, extra)) in out.iter().enumerate() {
        assert_eq!(got, &out[0].0, "rank {r} differs");
        assert!(*extra > 0, "rank {r}: stream 1 unused");
    }
}
