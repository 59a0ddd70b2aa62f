//! The host-staged path with host memory standing in for a GPU's: ranks as threads,
//! tensors marked as device tensors, every copy counted.

use super::*;
use crate::collective::tests::run;
use crate::collective::Comm;
use crate::compress::Resent;
use crate::device::StagingPool;
use crate::kernels::AlignedBuf;
use crate::plan::{Encoding, Mode, Plan};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Host memory posing as device memory; `fail` makes every download fail.
#[derive(Default)]
struct HostMemory {
    down: AtomicUsize,
    up: AtomicUsize,
    fail: bool,
    /// Makes every wait for the copies fail.
    fail_finish: bool,
    /// Waits for the copies so far.
    finished: AtomicUsize,
    /// Host regions made, and their bytes.
    regions: std::sync::Mutex<Vec<usize>>,
}

impl DeviceMemory for HostMemory {
    unsafe fn download(&self, src: *const u8, dst: &mut [u8], cast: Cast) -> Result<()> {
        if self.fail {
            return Err(PerseusError::Device("simulated copy failure".into()));
        }
        self.down.fetch_add(dst.len(), Ordering::Relaxed);
        match cast {
            Cast::Exact => dst.copy_from_slice(std::slice::from_raw_parts(src, dst.len())),
            Cast::Half(f) => to_half(
                dst,
                std::slice::from_raw_parts(src, dst.len() * 2),
                f as f64,
            ),
        }
        Ok(())
    }

    unsafe fn upload(&self, src: &[u8], dst: *mut u8, cast: Cast) -> Result<()> {
        self.up.fetch_add(src.len(), Ordering::Relaxed);
        match cast {
            Cast::Exact => std::slice::from_raw_parts_mut(dst, src.len()).copy_from_slice(src),
            Cast::Half(f) => from_half(
                std::slice::from_raw_parts_mut(dst, src.len() * 2),
                src,
                f as f64,
            ),
        }
        Ok(())
    }

    fn finish(&self) -> Result<()> {
        self.finished.fetch_add(1, Ordering::Relaxed);
        if self.fail_finish {
            return Err(PerseusError::Device("simulated stream failure".into()));
        }
        Ok(())
    }

    fn host_region(&self, bytes: usize) -> Box<dyn HostRegion> {
        self.regions.lock().unwrap().push(bytes);
        // Stale bytes, as a reused region has: nothing may rely on zeros.
        Box::new(AlignedBuf::from_slice(&vec![0xA5; bytes]))
    }
}

use crate::device::tensor::f32_view as view;

const GPU: Device = Device::Cuda(0);

fn response(kind: OpKind, shapes: Vec<Vec<i64>>, op: ReduceOp, plan: Plan) -> Response {
    Response::Op {
        kind,
        process_set: 0,
        names: (0..shapes.len()).map(|i| format!("t{i}")).collect(),
        shapes,
        dtype: DataType::F32,
        op,
        root: 0,
        prescale: 1.0,
        postscale: 1.0,
        sizes: vec![],
        plan,
    }
}

fn half_plan(scale: f64) -> Plan {
    Plan {
        encoding: Encoding::Half,
        scale,
        mode: Mode::Flat,
        device: false,
    }
}

/// Runs `resp` with `entries` through the staged path over `mem`.
fn staged(
    comm: &dyn crate::collective::Comm,
    resp: &Response,
    entries: &[Option<Entry>],
    mem: &Arc<HostMemory>,
) -> Outcome {
    let m = mem.clone();
    let resolve = move |_d: Device| Ok(m.clone() as Arc<dyn DeviceMemory>);
    run_staged(comm, resp, entries, &mut Buffers::default(), &resolve)
}

#[test]
fn exact_allreduce_of_device_and_host_tensors_fused_on_three_ranks() {
    let out = run(3, |c| {
        let r = c.rank() as f32;
        // In place on the device, out of place on the device, in place on the host.
        let mut a: Vec<f32> = (0..5).map(|i| r * 10.0 + i as f32).collect();
        let mut b_in: Vec<f32> = (0..3).map(|i| r - i as f32).collect();
        let mut b_out = vec![0f32; 3];
        let mut h: Vec<f32> = (0..4).map(|i| r * i as f32).collect();
        let entries = vec![
            Some(Entry {
                handle: 1,
                input: Some(view(&mut a, GPU)),
                output: Some(view(&mut a, GPU)),
            }),
            Some(Entry {
                handle: 2,
                input: Some(view(&mut b_in, GPU)),
                output: Some(view(&mut b_out, GPU)),
            }),
            Some(Entry {
                handle: 3,
                input: Some(view(&mut h, Device::Cpu)),
                output: Some(view(&mut h, Device::Cpu)),
            }),
        ];
        assert!(needs_staging(&entries));
        let mem = Arc::new(HostMemory::default());
        let resp = response(
            OpKind::Allreduce,
            vec![vec![5], vec![3], vec![4]],
            ReduceOp::Sum,
            Plan::default(),
        );
        let o = staged(c, &resp, &entries, &mem);
        assert!(o.results.iter().all(|r| r.is_ok()));
        assert!(o.resent.is_none());
        drop(entries);
        let moved = (
            mem.down.load(Ordering::Relaxed),
            mem.up.load(Ordering::Relaxed),
        );
        (a, b_out, h, moved)
    });
    for (a, b, h, moved) in out {
        let want_a: Vec<f32> = (0..5).map(|i| 30.0 + 3.0 * i as f32).collect();
        let want_b: Vec<f32> = (0..3).map(|i| 3.0 - 3.0 * i as f32).collect();
        let want_h: Vec<f32> = (0..4).map(|i| 3.0 * i as f32).collect();
        assert_eq!((a, b, h), (want_a, want_b, want_h));
        // Only the device tensors crossed, each once each way (b's output is not read).
        assert_eq!(moved, ((5 + 3) * 4, (5 + 3) * 4));
    }
}

#[test]
fn float16_wire_moves_only_the_float16_bytes_and_averages_with_the_scale() {
    for n in [2usize, 3] {
        let out = run(n, |c| {
            let r = c.rank() as f32;
            let mut g: Vec<f32> = (0..1001).map(|i| 0.5 * (i % 7) as f32 + r).collect();
            let entries = vec![Some(Entry {
                handle: 1,
                input: Some(view(&mut g, GPU)),
                output: Some(view(&mut g, GPU)),
            })];
            let mem = Arc::new(HostMemory::default());
            let resp = response(
                OpKind::Allreduce,
                vec![vec![1001]],
                ReduceOp::Average,
                half_plan(4.0),
            );
            let o = staged(c, &resp, &entries, &mem);
            assert!(o.results.iter().all(|r| r.is_ok()));
            assert!(o.resent.is_none());
            drop(entries);
            (
                g,
                mem.down.load(Ordering::Relaxed),
                mem.up.load(Ordering::Relaxed),
            )
        });
        let mean_rank = (n - 1) as f32 / 2.0;
        for (g, down, up) in out {
            let want: Vec<f32> = (0..1001)
                .map(|i| 0.5 * (i % 7) as f32 + mean_rank)
                .collect();
            assert_eq!(g, want, "{n} ranks");
            assert_eq!((down, up), (1001 * 2, 1001 * 2), "float16 bytes only");
        }
    }
}

#[test]
fn a_float16_overflow_is_resent_exactly_from_the_device_inputs() {
    let out = run(2, |c| {
        let mut big = vec![40_000f32; 9];
        let mut small = vec![1.5f32; 4];
        let entries = vec![
            Some(Entry {
                handle: 1,
                input: Some(view(&mut small, GPU)),
                output: Some(view(&mut small, GPU)),
            }),
            Some(Entry {
                handle: 2,
                input: Some(view(&mut big, GPU)),
                output: Some(view(&mut big, GPU)),
            }),
        ];
        let mem = Arc::new(HostMemory::default());
        let resp = response(
            OpKind::Allreduce,
            vec![vec![4], vec![9]],
            ReduceOp::Sum,
            half_plan(1.0),
        );
        let o = staged(c, &resp, &entries, &mem);
        assert!(o.results.iter().all(|r| r.is_ok()));
        drop(entries);
        (big, small, o.resent)
    });
    for (big, small, resent) in out {
        assert_eq!(big, vec![80_000f32; 9]);
        assert_eq!(small, vec![3f32; 4]);
        // Tensor 1 overflowed; its exact sum is finite, so the scale was to blame.
        assert_eq!(
            resent,
            Some(Resent {
                bad: vec![1],
                finite: true
            })
        );
    }
}

#[test]
fn a_joined_rank_contributes_zeros_to_a_float16_allreduce() {
    let out = run(2, |c| {
        let mut g = vec![2.5f32; 6];
        let entries = if c.rank() == 0 {
            vec![Some(Entry {
                handle: 1,
                input: Some(view(&mut g, GPU)),
                output: Some(view(&mut g, GPU)),
            })]
        } else {
            vec![None]
        };
        let mem = Arc::new(HostMemory::default());
        let resp = response(
            OpKind::Allreduce,
            vec![vec![6]],
            ReduceOp::Sum,
            half_plan(8.0),
        );
        let o = staged(c, &resp, &entries, &mem);
        assert!(o.results.iter().all(|r| r.is_ok()));
        drop(entries);
        g
    });
    assert_eq!(out[0], vec![2.5f32; 6]);
    assert_eq!(out[1], vec![2.5f32; 6], "untouched on the joined rank");
}

#[test]
fn broadcast_copies_down_only_on_the_root() {
    let out = run(3, |c| {
        let mut t: Vec<f32> = (0..7).map(|i| (c.rank() * 100 + i) as f32).collect();
        let entries = vec![Some(Entry {
            handle: 1,
            input: None,
            output: Some(view(&mut t, GPU)),
        })];
        let mem = Arc::new(HostMemory::default());
        let mut resp = response(
            OpKind::Broadcast,
            vec![vec![7]],
            ReduceOp::Sum,
            Plan::default(),
        );
        if let Response::Op { root, .. } = &mut resp {
            *root = 1;
        }
        let o = staged(c, &resp, &entries, &mem);
        assert!(o.results[0].is_ok());
        drop(entries);
        (t, mem.down.load(Ordering::Relaxed))
    });
    let want: Vec<f32> = (0..7).map(|i| (100 + i) as f32).collect();
    for (rank, (t, down)) in out.into_iter().enumerate() {
        assert_eq!(t, want);
        assert_eq!(down, if rank == 1 { 28 } else { 0 });
    }
}

#[test]
fn allgather_of_device_tensors_of_different_lengths() {
    let out = run(3, |c| {
        let r = c.rank();
        let mut t: Vec<f32> = (0..2 * (r + 1)).map(|i| (r * 10 + i) as f32).collect();
        let entries = vec![Some(Entry {
            handle: 1,
            input: Some(TensorView {
                shape: vec![r as i64 + 1, 2],
                ..view(&mut t, GPU)
            }),
            output: None,
        })];
        let mem = Arc::new(HostMemory::default());
        let mut resp = response(
            OpKind::Allgather,
            vec![vec![r as i64 + 1, 2]],
            ReduceOp::Sum,
            Plan::default(),
        );
        if let Response::Op { sizes, .. } = &mut resp {
            *sizes = vec![1, 2, 3];
        }
        let mut o = staged(c, &resp, &entries, &mem);
        let got = o.results.remove(0).expect("allgather");
        let t = got.tensor.expect("output tensor");
        assert_eq!(t.shape, vec![6, 2]);
        t.buf
            .as_slice()
            .chunks(4)
            .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
            .collect::<Vec<f32>>()
    });
    let want: Vec<f32> = [0., 1., 10., 11., 12., 13., 20., 21., 22., 23., 24., 25.].to_vec();
    for got in out {
        assert_eq!(got, want);
    }
}

#[test]
fn a_failed_device_copy_fails_that_rank_and_does_not_stall_its_peers() {
    for plan in [Plan::default(), half_plan(1.0)] {
        let out = run(2, move |c| {
            let mut g = vec![1.0f32 + c.rank() as f32; 5];
            let entries = vec![Some(Entry {
                handle: 1,
                input: Some(view(&mut g, GPU)),
                output: Some(view(&mut g, GPU)),
            })];
            let mem = Arc::new(HostMemory {
                fail: c.rank() == 1,
                ..Default::default()
            });
            let resp = response(OpKind::Allreduce, vec![vec![5]], ReduceOp::Sum, plan);
            let o = staged(c, &resp, &entries, &mem);
            drop(entries);
            (o.results[0].as_ref().err().map(|e| e.to_string()), g)
        });
        // Rank 0 completed with rank 1's zeros; rank 1 says why it failed.
        assert_eq!(out[0], (None, vec![1.0; 5]));
        assert_eq!(
            out[1].0.as_deref(),
            Some("CUDA error: simulated copy failure")
        );
    }
}

#[test]
fn the_pool_reuses_the_smallest_region_that_fits_and_grows_by_replacing() {
    let mem = HostMemory::default();
    let mut pool = StagingPool::default();
    let a = pool.take(10, |n| mem.host_region(n));
    let b = pool.take(3 << 20, |n| mem.host_region(n));
    assert_eq!(
        (a.size(), b.size()),
        (1 << 20, 4 << 20),
        "powers of two, 1 MiB at least"
    );
    pool.give(b);
    pool.give(a);
    // The smallest that fits, whichever was given back first.
    let small = pool.take(100, |n| mem.host_region(n));
    assert_eq!(small.size(), 1 << 20);
    pool.give(small);
    // None fits: the largest free one is replaced, the other kept.
    let big = pool.take(5 << 20, |n| mem.host_region(n));
    assert_eq!(big.size(), 8 << 20);
    assert_eq!(pool.free_sizes(), vec![1 << 20]);
    pool.give(big);
    assert_eq!(
        *mem.regions.lock().unwrap(),
        vec![1 << 20, 4 << 20, 8 << 20]
    );
    // Without a device: ordinary memory, from the pool all the same.
    let plain = pool.take(9 << 20, pageable);
    assert_eq!(plain.size(), 16 << 20);
    assert_eq!(pool.free_sizes(), vec![1 << 20]);
}

#[test]
fn host_copies_reuse_one_region_across_responses() {
    let out = run(2, |c| {
        let r = c.rank() as f32;
        let mem = Arc::new(HostMemory::default());
        let m = mem.clone();
        let resolve = move |_d: Device| Ok(m.clone() as Arc<dyn DeviceMemory>);
        let mut bufs = Buffers::default();
        let mut results = Vec::new();
        for step in 0..3usize {
            // Sizes change from step to step, over the stale bytes of the last.
            let n = 5 + 7 * step;
            let mut a: Vec<f32> = (0..n).map(|i| r + i as f32).collect();
            let mut b_in: Vec<f32> = (0..n + 2).map(|i| r * 2.0 - i as f32).collect();
            let mut b_out = vec![0f32; n + 2];
            let entries = vec![
                Some(Entry {
                    handle: 1,
                    input: Some(view(&mut a, GPU)),
                    output: Some(view(&mut a, GPU)),
                }),
                Some(Entry {
                    handle: 2,
                    input: Some(view(&mut b_in, GPU)),
                    output: Some(view(&mut b_out, GPU)),
                }),
            ];
            let plan = if step == 1 {
                half_plan(2.0)
            } else {
                Plan::default()
            };
            let resp = response(
                OpKind::Allreduce,
                vec![vec![n as i64], vec![n as i64 + 2]],
                ReduceOp::Sum,
                plan,
            );
            let o = run_staged(c, &resp, &entries, &mut bufs, &resolve);
            assert!(o.results.iter().all(|r| r.is_ok()));
            drop(entries);
            results.push((a, b_out));
        }
        // A float16 overflow: its images, then the exact resend's copies.
        let mut big = vec![40_000f32; 9];
        let entries = vec![Some(Entry {
            handle: 3,
            input: Some(view(&mut big, GPU)),
            output: Some(view(&mut big, GPU)),
        })];
        let resp = response(
            OpKind::Allreduce,
            vec![vec![9]],
            ReduceOp::Sum,
            half_plan(1.0),
        );
        let o = run_staged(c, &resp, &entries, &mut bufs, &resolve);
        assert_eq!(
            o.resent,
            Some(Resent {
                bad: vec![0],
                finite: true
            })
        );
        drop(entries);
        // Rank 1 has joined: its images come from a reused region, yet are zeros.
        let mut g = vec![2.5f32; 6];
        let entries = if c.rank() == 0 {
            vec![Some(Entry {
                handle: 4,
                input: Some(view(&mut g, GPU)),
                output: Some(view(&mut g, GPU)),
            })]
        } else {
            vec![None]
        };
        let resp = response(
            OpKind::Allreduce,
            vec![vec![6]],
            ReduceOp::Sum,
            half_plan(8.0),
        );
        let o = run_staged(c, &resp, &entries, &mut bufs, &resolve);
        assert!(o.results.iter().all(|r| r.is_ok()) && o.resent.is_none());
        drop(entries);
        if c.rank() == 0 {
            assert_eq!(g, vec![2.5f32; 6]);
        }
        let made = mem.regions.lock().unwrap().clone();
        (results, big, made, bufs.staging.free_sizes())
    });
    for (results, big, made, free) in out {
        for (step, (a, b)) in results.into_iter().enumerate() {
            let n = 5 + 7 * step;
            let want_a: Vec<f32> = (0..n).map(|i| 1.0 + 2.0 * i as f32).collect();
            let want_b: Vec<f32> = (0..n + 2).map(|i| 2.0 - 2.0 * i as f32).collect();
            assert_eq!((a, b), (want_a, want_b), "step {step}");
        }
        assert_eq!(big, vec![80_000f32; 9]);
        // One region served every response, the resend too: the images' region is
        // given back before the exact copies take one. It is kept for the next ones.
        assert_eq!(made, vec![1 << 20]);
        assert_eq!(free, vec![1 << 20]);
    }
}

#[test]
fn a_failing_device_does_not_cut_short_the_wait_for_another() {
    let out = run(2, |c| {
        let mut a = vec![1.0f32 + c.rank() as f32; 4];
        let mut b = vec![10.0f32; 3];
        let entries = vec![
            Some(Entry {
                handle: 1,
                input: Some(view(&mut a, Device::Cuda(0))),
                output: Some(view(&mut a, Device::Cuda(0))),
            }),
            Some(Entry {
                handle: 2,
                input: Some(view(&mut b, Device::Cuda(1))),
                output: Some(view(&mut b, Device::Cuda(1))),
            }),
        ];
        let first = Arc::new(HostMemory {
            fail_finish: c.rank() == 1,
            ..Default::default()
        });
        let second = Arc::new(HostMemory::default());
        let (f, s) = (first.clone(), second.clone());
        let resolve = move |d: Device| {
            Ok(if d == Device::Cuda(0) {
                f.clone()
            } else {
                s.clone()
            } as Arc<dyn DeviceMemory>)
        };
        let resp = response(
            OpKind::Allreduce,
            vec![vec![4], vec![3]],
            ReduceOp::Sum,
            Plan::default(),
        );
        let o = run_staged(c, &resp, &entries, &mut Buffers::default(), &resolve);
        drop(entries);
        let errors: Vec<Option<String>> = o
            .results
            .iter()
            .map(|r| r.as_ref().err().map(|e| e.to_string()))
            .collect();
        (errors, second.finished.load(Ordering::Relaxed))
    });
    assert_eq!(out[0].0, vec![None, None]);
    // Rank 1's first device failed its wait after the downloads; its second was still
    // waited for (and nothing was uploaded after the failure, so no second wait).
    let failed = Some("CUDA error: simulated stream failure".to_string());
    assert_eq!(out[1].0, vec![failed.clone(), failed]);
    assert_eq!((out[0].1, out[1].1), (2, 1));
}
