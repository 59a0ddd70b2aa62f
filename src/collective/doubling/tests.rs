//! The log-n collectives against exact references on 1 to 33 thread ranks, at sizes
//! around every switch point; their steps and partners counted on 1,000 and more ranks
//! by a transport that moves no data.

use super::super::tests::{run, run_on};
use super::*;
use crate::collective::{allgatherv, allreduce, broadcast};
use crate::kernels::AlignedBuf;
use std::collections::BTreeSet;
use std::sync::Mutex;

fn i32s(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn to_i32s(b: &[u8]) -> Vec<i32> {
    b.chunks(4)
        .map(|c| i32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

/// Element counts (4-byte elements) around the switch points among `n` ranks: fewer
/// elements than ranks, the end of the small buffers, the halving's range.
fn counts(n: usize) -> Vec<usize> {
    let small = SMALL_MAX / 4;
    vec![
        0,
        1,
        n.saturating_sub(1),
        n,
        n + 1,
        1000,
        small,
        small + 1,
        100_003,
    ]
}

/// A rank's input: element `i` of rank `r`, small integers (exact in any order).
fn input(i: usize, r: usize) -> i32 {
    ((i * 7 + r * 3) % 19) as i32 - 9
}

#[test]
fn allreduce_matches_the_exact_sum_max_and_min_on_1_to_33_ranks() {
    for n in 1..=33 {
        for count in counts(n) {
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                let out = run(n, move |c| {
                    let v: Vec<i32> = (0..count).map(|i| input(i, c.rank())).collect();
                    let mut b = AlignedBuf::from_slice(&i32s(&v));
                    let mut s = AlignedBuf::default();
                    allreduce(c, b.as_mut_slice(), DataType::I32, op, 1.0, &mut s).unwrap();
                    to_i32s(b.as_slice())
                });
                let want: Vec<i32> = (0..count)
                    .map(|i| {
                        let all = (0..n).map(|r| input(i, r));
                        match op {
                            ReduceOp::Sum => all.sum(),
                            ReduceOp::Max => all.max().unwrap(),
                            _ => all.min().unwrap(),
                        }
                    })
                    .collect();
                for (r, got) in out.iter().enumerate() {
                    assert!(got == &want, "n={n} count={count} {op:?} rank={r}");
                }
            }
        }
    }
}

#[test]
fn every_rank_ends_with_the_same_bits_and_the_factor_applied_once() {
    // Floats whose sum depends on the order: every rank must still agree to the bit.
    for n in [9, 12, 16, 17, 31, 33] {
        for count in [5usize, 3000, 40_000, 100_003] {
            let out = run(n, move |c| {
                let v: Vec<f32> = (0..count)
                    .map(|i| ((i * 31 + c.rank() * 17) % 97) as f32 * 0.013_7 + 1e-3)
                    .collect();
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_ne_bytes()).collect();
                let mut a = AlignedBuf::from_slice(&bytes);
                let mut b = AlignedBuf::from_slice(&bytes);
                let mut s = AlignedBuf::default();
                let f = 1.0 / n as f64;
                allreduce(c, a.as_mut_slice(), DataType::F32, ReduceOp::Sum, f, &mut s).unwrap();
                allreduce(
                    c,
                    b.as_mut_slice(),
                    DataType::F32,
                    ReduceOp::Sum,
                    1.0,
                    &mut s,
                )
                .unwrap();
                crate::kernels::scale(b.as_mut_slice(), DataType::F32, f);
                (a.as_slice().to_vec(), b.as_slice().to_vec())
            });
            for (r, (a, b)) in out.iter().enumerate() {
                assert!(
                    a == &out[0].0,
                    "n={n} count={count}: rank {r} differs from rank 0"
                );
                if allreduce_steps(n, count * 4, 4) != Steps::Halving {
                    assert!(a == b, "n={n} count={count}: scaled once, as after the sum");
                }
            }
        }
    }
}

#[test]
fn a_multi_host_group_takes_the_same_steps() {
    // 4 hosts of 5: the group's steps do not depend on where its ranks live.
    let hosts: Vec<usize> = (0..20).map(|r| r / 5).collect();
    let out = run_on(&hosts, |c| {
        let v: Vec<i32> = (0..777).map(|i| input(i, c.rank())).collect();
        let mut b = AlignedBuf::from_slice(&i32s(&v));
        let mut s = AlignedBuf::default();
        allreduce(
            c,
            b.as_mut_slice(),
            DataType::I32,
            ReduceOp::Sum,
            1.0,
            &mut s,
        )
        .unwrap();
        to_i32s(b.as_slice())
    });
    let want: Vec<i32> = (0..777)
        .map(|i| (0..20).map(|r| input(i, r)).sum())
        .collect();
    assert!(out.iter().all(|g| g == &want));
}

#[test]
fn broadcast_from_every_root_on_1_to_33_ranks() {
    for n in 1..=33 {
        for len in [0usize, 1, 4096, 64 << 10, (64 << 10) + 1] {
            for root in [0, n / 2, n - 1] {
                let out = run(n, move |c| {
                    let mut b: Vec<u8> = if c.rank() == root {
                        (0..len).map(|i| (i * 13 + root) as u8).collect()
                    } else {
                        vec![0xEE; len]
                    };
                    broadcast(c, &mut b, root).unwrap();
                    b
                });
                let want: Vec<u8> = (0..len).map(|i| (i * 13 + root) as u8).collect();
                for (r, got) in out.iter().enumerate() {
                    assert!(got == &want, "n={n} len={len} root={root} rank={r}");
                }
            }
        }
    }
}

#[test]
fn allgather_of_ragged_blocks_on_1_to_33_ranks() {
    for n in 1..=33 {
        for scale in [0usize, 1, 700, 40_000] {
            let sizes: Vec<usize> = (0..n).map(|r| (r % 4) * scale + (r % 3)).collect();
            let total: usize = sizes.iter().sum();
            let sz = sizes.clone();
            let out = run(n, move |c| {
                let parts = crate::collective::consecutive(sz.iter().copied());
                let mut b = vec![0u8; total];
                for (i, x) in b[parts[c.rank()].clone()].iter_mut().enumerate() {
                    *x = (i * 5 + c.rank() * 11) as u8;
                }
                allgatherv(c, &mut b, &sz).unwrap();
                b
            });
            let parts = crate::collective::consecutive(sizes.iter().copied());
            let mut want = vec![0u8; total];
            for (r, p) in parts.iter().enumerate() {
                for (i, x) in want[p.clone()].iter_mut().enumerate() {
                    *x = (i * 5 + r * 11) as u8;
                }
            }
            for (r, got) in out.iter().enumerate() {
                assert!(got == &want, "n={n} scale={scale} rank={r}");
            }
        }
    }
}

/// A rank of a group whose transfers move no data (receives get zeros): the steps
/// of an algorithm do not depend on the values, so each rank runs alone and counts its
/// sequential transfers and the peers it uses.
struct Counting {
    rank: usize,
    size: usize,
    steps: Mutex<usize>,
    peers: Mutex<BTreeSet<usize>>,
}

impl Comm for Counting {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn transfer(&self, sends: &mut [Send<'_>], recvs: &mut [Recv<'_>]) -> Result<()> {
        *self.steps.lock().unwrap() += 1;
        let mut peers = self.peers.lock().unwrap();
        peers.extend(sends.iter().map(Send::peer));
        peers.extend(recvs.iter().map(Recv::peer));
        for r in recvs.iter_mut() {
            let zeros = vec![0u8; r.len()];
            r.deliver(&zeros);
        }
        Ok(())
    }
}

/// The most sequential steps and distinct peers any rank of `n` takes for `f`.
fn most(n: usize, f: impl Fn(&dyn Comm)) -> (usize, usize) {
    let (mut steps, mut peers) = (0, 0);
    for rank in 0..n {
        let c = Counting {
            rank,
            size: n,
            steps: Mutex::new(0),
            peers: Mutex::new(BTreeSet::new()),
        };
        f(&c);
        steps = steps.max(*c.steps.lock().unwrap());
        peers = peers.max(c.peers.lock().unwrap().len());
    }
    (steps, peers)
}

#[test]
fn small_collectives_take_log_n_steps_with_log_n_peers_at_a_thousand_ranks_and_more() {
    for n in [1000usize, 1024, 1025, 4096] {
        let log2 = n.next_power_of_two().trailing_zeros() as usize;
        let bound = 2 * log2 + 4;
        // A 4 KiB float32 allreduce.
        let (steps, peers) = most(n, |c| {
            let mut b = vec![0u8; 4096];
            let mut s = AlignedBuf::default();
            allreduce(c, &mut b, DataType::F32, ReduceOp::Sum, 1.0, &mut s).unwrap();
        });
        assert!(
            steps <= bound,
            "n={n}: allreduce took {steps} steps (bound {bound})"
        );
        assert!(peers <= log2 + 1, "n={n}: allreduce used {peers} peers");
        // 1 MiB: the halving's 2 log2(n) steps.
        let (steps, _) = most(n, |c| {
            let mut b = vec![0u8; 1 << 20];
            let mut s = AlignedBuf::default();
            allreduce(c, &mut b, DataType::F32, ReduceOp::Sum, 1.0, &mut s).unwrap();
        });
        assert!(steps <= bound, "n={n}: 1 MiB allreduce took {steps} steps");
        // A broadcast of 4 KiB from any root, a barrier, an allgather of 64 bytes each.
        for root in [0, n / 3] {
            let (steps, peers) = most(n, |c| {
                let mut b = vec![0u8; 4096];
                broadcast(c, &mut b, root).unwrap();
            });
            assert!(steps <= log2 + 1, "n={n}: broadcast took {steps} steps");
            assert!(peers <= log2 + 1, "n={n}: broadcast used {peers} peers");
        }
        let (steps, _) = most(n, |c| crate::collective::barrier(c).unwrap());
        assert!(steps <= log2, "n={n}: barrier took {steps} steps");
        let (steps, peers) = most(n, |c| {
            let mut b = vec![0u8; 64 * c.size()];
            allgatherv(c, &mut b, &vec![64; c.size()]).unwrap();
        });
        assert!(steps <= log2, "n={n}: allgather took {steps} steps");
        assert!(peers <= 2 * log2, "n={n}: allgather used {peers} peers");
    }
}
