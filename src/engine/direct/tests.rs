//! The device-direct path with host memory standing in for the GPUs and the CPU ring
//! for NCCL: ranks as threads, tensors marked as device tensors, every collective
//! call logged.

use super::*;
use crate::collective::tests::{run, run_on};
use crate::collective::{allgatherv, host_and_peers, hosts_of, SubComm};
use crate::compress::Resent;
use crate::device::tensor::{f32_view, Device, TensorView};
use crate::device::HostRegion;
use crate::kernels::{first_nonfinite, from_half, scale, to_half, AlignedBuf};
use crate::plan::{Encoding, Plan};
use std::sync::Mutex;

/// One rank's "device": host memory, the CPU ring for the collectives.
struct HostGroup<'a> {
    comm: &'a dyn Comm,
    channels: usize,
    fusion: Mutex<AlignedBuf>,
    /// (channel, dtype, elements) of every allreduce.
    calls: Mutex<Vec<(usize, DataType, usize)>>,
    /// Bytes of every download to host memory.
    downloads: Mutex<Vec<usize>>,
    /// Parts asked about in each finiteness check (each one wait on a device).
    checks: Mutex<Vec<usize>>,
    /// Fail the allreduce on this channel (a collective failing midway).
    fail_on: Option<usize>,
    /// Fail every allgather (the last collective of a hierarchical pass).
    fail_gather: std::sync::atomic::AtomicBool,
    /// Fail every scale with this error (a kernel that cannot be had).
    fail_scale: Option<PerseusError>,
    /// (address, bytes) of each host region made.
    regions: Mutex<Vec<(usize, usize)>>,
    /// Why the group was abandoned, once it was.
    abandoned: Mutex<Option<String>>,
}

impl<'a> HostGroup<'a> {
    fn new(comm: &'a dyn Comm, channels: usize) -> Self {
        HostGroup {
            comm,
            channels,
            fusion: Mutex::new(AlignedBuf::zeroed(0)),
            calls: Mutex::new(Vec::new()),
            downloads: Mutex::new(Vec::new()),
            checks: Mutex::new(Vec::new()),
            fail_on: None,
            fail_gather: Default::default(),
            fail_scale: None,
            regions: Mutex::new(Vec::new()),
            abandoned: Mutex::new(None),
        }
    }

    /// An error naming why the group was abandoned, once it was.
    fn usable(&self) -> Result<()> {
        match &*self.abandoned.lock().unwrap() {
            Some(why) => Err(PerseusError::Device(format!("abandoned after: {why}"))),
            None => Ok(()),
        }
    }
}

unsafe fn slice<'s>(p: *const u8, n: usize) -> &'s mut [u8] {
    std::slice::from_raw_parts_mut(p as *mut u8, n)
}

impl DeviceGroup for HostGroup<'_> {
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn size(&self) -> usize {
        self.comm.size()
    }
    fn channels(&self) -> usize {
        self.channels
    }
    fn fusion(&self, bytes: usize) -> Result<*mut u8> {
        let mut f = self.fusion.lock().unwrap();
        if f.len() < bytes {
            // Stale bytes, as a device buffer would hold.
            *f = AlignedBuf::zeroed(bytes);
            f.as_mut_slice().fill(0x7f);
        }
        Ok(f.as_mut_ptr())
    }
    unsafe fn copy(&self, src: *const u8, dst: *mut u8, bytes: usize) -> Result<()> {
        std::ptr::copy(src, dst, bytes);
        Ok(())
    }
    unsafe fn scale(&self, buf: *mut u8, n: usize, dtype: DataType, f: f64) -> Result<()> {
        if let Some(e) = &self.fail_scale {
            return Err(e.clone());
        }
        scale(slice(buf, n * dtype.size()), dtype, f);
        Ok(())
    }
    unsafe fn cast_down(&self, src: *const u8, dst: *mut u8, n: usize, f: f32) -> Result<()> {
        to_half(slice(dst, n * 2), slice(src, n * 4), f as f64);
        Ok(())
    }
    unsafe fn cast_up(&self, src: *const u8, dst: *mut u8, n: usize, f: f32) -> Result<()> {
        from_half(slice(dst, n * 4), slice(src, n * 2), f as f64);
        Ok(())
    }
    unsafe fn nonfinite(
        &self,
        parts: &[(*const u8, usize)],
        dtype: DataType,
        _: &Watch<'_>,
    ) -> Result<Vec<usize>> {
        self.checks.lock().unwrap().push(parts.len());
        Ok((0..parts.len())
            .filter(|&i| {
                let (buf, n) = parts[i];
                first_nonfinite(slice(buf, n * dtype.size()), dtype).is_some()
            })
            .collect())
    }
    unsafe fn allreduce(
        &self,
        channel: usize,
        buf: *mut u8,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        _: &Watch<'_>,
    ) -> Result<()> {
        assert!(
            channel < self.channels,
            "channel {channel} of {}",
            self.channels
        );
        assert!(!matches!(op, ReduceOp::Average | ReduceOp::Adasum));
        self.usable()?;
        if self.fail_on == Some(channel) {
            return Err(PerseusError::Device(format!(
                "ncclAllReduce failed on channel {channel}"
            )));
        }
        self.calls.lock().unwrap().push((channel, dtype, count));
        let mut scratch = AlignedBuf::zeroed(0);
        let b = slice(buf, count * dtype.size());
        crate::collective::allreduce(self.comm, b, dtype, op, 1.0, &mut scratch)
    }
    unsafe fn broadcast(&self, buf: *mut u8, bytes: usize, root: usize, _: &Watch) -> Result<()> {
        crate::collective::broadcast(self.comm, slice(buf, bytes), root)
    }
    unsafe fn reduce_scatter(
        &self,
        buf: *mut u8,
        chunk: usize,
        dtype: DataType,
        op: ReduceOp,
        _: &Watch<'_>,
    ) -> Result<()> {
        let n = self.comm.size();
        let b = slice(buf, n * chunk * dtype.size());
        let mine = crate::collective::reduce_scatter(self.comm, b, &vec![chunk; n], dtype, op)?;
        assert_eq!(mine.start, self.comm.rank() * chunk * dtype.size());
        Ok(())
    }
    unsafe fn allgather(
        &self,
        buf: *mut u8,
        chunk: usize,
        dtype: DataType,
        _: &Watch,
    ) -> Result<()> {
        if self.fail_gather.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(PerseusError::Device("ncclAllGather failed".into()));
        }
        let n = self.comm.size();
        let bytes = chunk * dtype.size();
        allgatherv(self.comm, slice(buf, n * bytes), &vec![bytes; n])
    }
    unsafe fn download(
        &self,
        src: *const u8,
        dst: &mut [u8],
        pinned: bool,
        _: &Watch<'_>,
    ) -> Result<()> {
        self.downloads.lock().unwrap().push(dst.len());
        let base = dst.as_ptr() as usize;
        let ours = self
            .regions
            .lock()
            .unwrap()
            .iter()
            .any(|&(at, n)| at <= base && base + dst.len() <= at + n);
        assert_eq!(
            pinned, ours,
            "pinned exactly when in a region of this group"
        );
        dst.copy_from_slice(slice(src, dst.len()));
        Ok(())
    }
    unsafe fn upload(&self, src: &[u8], dst: *mut u8) -> Result<()> {
        slice(dst, src.len()).copy_from_slice(src);
        Ok(())
    }
    fn finish(&self, _: &Watch<'_>) -> Result<()> {
        self.usable()
    }
    fn abandon(&self, why: &str) {
        self.abandoned
            .lock()
            .unwrap()
            .get_or_insert_with(|| why.to_string());
    }
    fn host_region(&self, bytes: usize) -> Box<dyn HostRegion> {
        // Stale bytes, as a reused region has: nothing may rely on zeros.
        let mut region = Locked(AlignedBuf::from_slice(&vec![0xA5; bytes]));
        let at = region.bytes().as_ptr() as usize;
        self.regions.lock().unwrap().push((at, bytes));
        Box::new(region)
    }
}

/// Host memory that says it is page-locked, as the CUDA group's regions are.
struct Locked(AlignedBuf);

impl HostRegion for Locked {
    fn bytes(&mut self) -> &mut [u8] {
        self.0.as_mut_slice()
    }
    fn size(&self) -> usize {
        self.0.len()
    }
    fn pinned(&self) -> bool {
        true
    }
}

/// The watch of the tests: no peer ends, a generous limit.
const WATCH: Watch<'static> = Watch {
    limit: std::time::Duration::from_secs(60),
    ended: &|| None,
};

const GPU: Device = Device::Cuda(0);

/// Runs one entry's response over `group` alone, in a set of `n`.
fn run_flat(group: &HostGroup<'_>, n: usize, resp: &Response, entry: Entry) -> Outcome {
    let mut bufs = Buffers::default();
    run_direct(
        Route::Flat(group),
        n,
        resp,
        &[Some(entry)],
        &mut bufs,
        &WATCH,
    )
}

fn view(v: &mut [f32]) -> TensorView {
    f32_view(v, GPU)
}

fn device_plan(encoding: Encoding, scale: f64) -> Plan {
    Plan {
        encoding,
        scale,
        device: true,
        ..Plan::default()
    }
}

fn response(
    kind: OpKind,
    lens: &[usize],
    op: ReduceOp,
    pre: f64,
    post: f64,
    plan: Plan,
) -> Response {
    Response::Op {
        kind,
        process_set: 0,
        names: (0..lens.len()).map(|i| format!("t{i}")).collect(),
        shapes: lens.iter().map(|&n| vec![n as i64]).collect(),
        dtype: DataType::F32,
        op,
        root: 1,
        prescale: pre,
        postscale: post,
        sizes: vec![],
        plan,
    }
}

/// Rank `r`'s element `i` of tensor `t`: small integers, so every sum is exact.
fn value(r: usize, t: usize, i: usize) -> f32 {
    ((r * 7 + t * 3 + i) % 13) as f32 - 6.0
}

/// One rank's run of [`allreduce_on`]: outputs, inputs (after), outcome, allreduce
/// calls (channel, dtype, elements), the bytes of each download, and the parts of
/// each finiteness check.
type RankRun = (
    Vec<Vec<f32>>,
    Vec<Vec<f32>>,
    Outcome,
    Vec<(usize, DataType, usize)>,
    Vec<usize>,
    Vec<usize>,
);

/// Ranks on one host.
const ONE_HOST: &[usize] = &[0; 8];

/// Runs an allreduce of tensors of `lens` on ranks on `hosts` (hierarchical when
/// there are several); returns each rank's outputs, inputs (after), collective
/// calls and downloads.
#[allow(clippy::too_many_arguments)]
fn allreduce_on(
    hosts: &'static [usize],
    lens: &'static [usize],
    op: ReduceOp,
    pre: f64,
    post: f64,
    plan: Plan,
    in_place: bool,
    channels: usize,
    big: f32,
) -> Vec<RankRun> {
    let n = hosts.len();
    run_on(hosts, move |comm| {
        let r = comm.rank();
        let several = hosts_of(comm).len() > 1;
        let (mine, peers) = host_and_peers(comm);
        let local = SubComm::new(comm, mine);
        let cross = SubComm::new(comm, peers);
        let group = if several {
            HostGroup::new(&local, channels)
        } else {
            HostGroup::new(comm, channels)
        };
        let route = if several {
            Route::Hierarchical(&group, &cross)
        } else {
            Route::Flat(&group)
        };
        let mut inputs: Vec<Vec<f32>> = lens
            .iter()
            .enumerate()
            .map(|(t, &len)| {
                (0..len)
                    .map(|i| value(r, t, i) * if i == 0 { big } else { 1.0 })
                    .collect()
            })
            .collect();
        let mut outputs: Vec<Vec<f32>> = lens.iter().map(|&len| vec![-99.0; len]).collect();
        let entries: Vec<Option<Entry>> = inputs
            .iter_mut()
            .zip(outputs.iter_mut())
            .map(|(i, o)| {
                let iv = view(i);
                Some(Entry {
                    handle: 0,
                    output: Some(if in_place { iv.clone() } else { view(o) }),
                    input: Some(iv),
                })
            })
            .collect();
        let resp = response(OpKind::Allreduce, lens, op, pre, post, plan);
        assert!(supports(&resp));
        let out = run_direct(route, n, &resp, &entries, &mut Buffers::default(), &WATCH);
        drop(entries);
        let calls = group.calls.into_inner().unwrap();
        let downloads = group.downloads.into_inner().unwrap();
        let checks = group.checks.into_inner().unwrap();
        let results = if in_place { inputs.clone() } else { outputs };
        (results, inputs, out, calls, downloads, checks)
    })
}

/// What every rank should hold: `f(values of all ranks)` per element.
fn expected(n: usize, t: usize, len: usize, big: f32, f: impl Fn(Vec<f64>) -> f64) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let vals = (0..n)
                .map(|r| value(r, t, i) as f64 * if i == 0 { big as f64 } else { 1.0 })
                .collect();
            f(vals) as f32
        })
        .collect()
}

const LENS: &[usize] = &[5, 70_001, 1, 300_000];

/// Exact allreduces (Sum, Average, scaled Sum, Max, Min) of `LENS`, in place and
/// out of place, on ranks on `hosts`: every rank's results, inputs untouched.
fn check_exact(hosts: &'static [usize]) {
    let n = hosts.len();
    for in_place in [true, false] {
        for (op, pre, post) in [
            (ReduceOp::Sum, 1.0, 1.0),
            (ReduceOp::Average, 1.0, 1.0),
            (ReduceOp::Sum, 0.5, 4.0),
            (ReduceOp::Max, 1.0, 1.0),
            (ReduceOp::Min, 1.0, 1.0),
        ] {
            let plan = device_plan(Encoding::Exact, 1.0);
            let got = allreduce_on(hosts, LENS, op, pre, post, plan, in_place, 1, 1.0);
            for (r, (results, inputs, out, _, _, _)) in got.into_iter().enumerate() {
                assert!(out.results.iter().all(|x| x.is_ok()), "rank {r}");
                assert!(out.resent.is_none());
                for (t, &len) in LENS.iter().enumerate() {
                    let want = expected(n, t, len, 1.0, |v| match op {
                        ReduceOp::Max => v.into_iter().fold(f64::MIN, f64::max),
                        ReduceOp::Min => v.into_iter().fold(f64::MAX, f64::min),
                        // The sum, times 1/n in float32, as the scale kernel does.
                        ReduceOp::Average => {
                            (v.iter().sum::<f64>() as f32 * (1.0 / n as f64) as f32) as f64
                        }
                        _ => v.iter().map(|x| x * pre).sum::<f64>() * post,
                    });
                    assert_eq!(results[t], want, "rank {r} tensor {t} {op:?} {hosts:?}");
                    if !in_place {
                        let orig: Vec<f32> = (0..len).map(|i| value(r, t, i)).collect();
                        assert_eq!(inputs[t], orig, "rank {r}: input {t} changed");
                    }
                }
            }
        }
    }
}

#[test]
fn fused_sums_and_averages_are_exact_in_place_and_out_of_place() {
    for n in [2, 3] {
        check_exact(&ONE_HOST[..n]);
    }
}

#[test]
fn hierarchical_allreduces_are_exact_over_hosts_and_uneven_chunks() {
    // 2x2 and 2x3 ranks; the fused span is not a multiple of the local size.
    check_exact(&[0, 0, 1, 1]);
    check_exact(&[0, 1, 0, 1, 0, 1]);
}

#[test]
fn a_large_buffer_is_split_across_the_channels() {
    // 300_000 + 70_001 + 6 floats of fused payload (about 1.5 MB): one channel's worth
    // at 1 MiB each, so 1 part; a single 4 MiB tensor, 4 parts over 3 channels -> 3.
    let plan = device_plan(Encoding::Exact, 1.0);
    let got = allreduce_on(
        &ONE_HOST[..2],
        LENS,
        ReduceOp::Sum,
        1.0,
        1.0,
        plan,
        true,
        3,
        1.0,
    );
    assert_eq!(got[0].3.len(), 1, "{:?}", got[0].3);
    static BIG: &[usize] = &[1 << 20];
    let got = allreduce_on(
        &ONE_HOST[..2],
        BIG,
        ReduceOp::Sum,
        1.0,
        1.0,
        plan,
        false,
        3,
        1.0,
    );
    for (r, (results, _, _, calls, _, _)) in got.into_iter().enumerate() {
        let channels: Vec<usize> = calls.iter().map(|c| c.0).collect();
        assert_eq!(channels, vec![0, 1, 2], "rank {r}");
        assert_eq!(calls.iter().map(|c| c.2).sum::<usize>(), 1 << 20);
        assert_eq!(results[0], expected(2, 0, 1 << 20, 1.0, |v| v.iter().sum()));
    }
}

/// Averages of `LENS` over ranks on `hosts` (see [`allreduce_on`]).
fn averages(hosts: &'static [usize], plan: Plan, in_place: bool, channels: usize) -> Vec<RankRun> {
    let op = ReduceOp::Average;
    allreduce_on(hosts, LENS, op, 1.0, 1.0, plan, in_place, channels, 1.0)
}

/// Asserts `results` are the averages of `LENS` over `n` ranks, to float16's precision.
fn assert_averages(results: &[Vec<f32>], n: usize, what: &str) {
    for (t, &len) in LENS.iter().enumerate() {
        let want = expected(n, t, len, 1.0, |v| v.iter().sum::<f64>() / n as f64);
        let close = results[t]
            .iter()
            .zip(&want)
            .all(|(a, b)| (a - b).abs() <= 1e-3 * b.abs().max(1.0));
        assert!(close, "{what}: tensor {t}");
    }
}

#[test]
fn float16_gradients_are_summed_as_float16_on_the_device() {
    let plan = device_plan(Encoding::Half, 4.0);
    for in_place in [true, false] {
        let got = averages(&ONE_HOST[..3], plan, in_place, 2);
        for (r, (results, _, out, calls, _, checks)) in got.into_iter().enumerate() {
            assert!(out.resent.is_none());
            assert!(
                calls.iter().all(|c| c.1 == DataType::F16),
                "rank {r}: {calls:?}"
            );
            // Small integers times 4, summed: exact in float16.
            assert_averages(&results, 3, &format!("rank {r}"));
            // All finite: one check of the whole float16 image, one wait.
            assert_eq!(checks, vec![1], "rank {r}");
        }
    }
}

#[test]
fn a_float16_overflow_is_resent_exactly_on_every_rank() {
    // Element 0 of each tensor is 30000x: the float16 sums overflow, the exact ones
    // do not.
    let plan = device_plan(Encoding::Half, 1.0);
    static TWO: &[usize] = &[4, 9];
    let got = allreduce_on(
        &ONE_HOST[..2],
        TWO,
        ReduceOp::Sum,
        1.0,
        1.0,
        plan,
        true,
        1,
        30_000.0,
    );
    for (r, (results, _, out, calls, _, checks)) in got.into_iter().enumerate() {
        let Resent { bad, finite } = out.resent.expect("resent");
        assert!(finite, "rank {r}");
        // value(r, t, 0) is nonzero for both tensors on both ranks except where
        // it is 0; whichever overflowed is named.
        assert!(!bad.is_empty(), "rank {r}");
        assert!(
            calls.iter().any(|c| c.1 == DataType::F32),
            "rank {r}: {calls:?}"
        );
        // The whole image, then each of its two tensors, then the exact sums of those
        // resent: three checks, each one wait, whatever the number of tensors.
        assert_eq!(checks, vec![1, 2, bad.len()], "rank {r}");
        for (t, &len) in TWO.iter().enumerate() {
            assert_eq!(
                results[t],
                expected(2, t, len, 30_000.0, |v| v.iter().sum()),
                "rank {r} tensor {t}"
            );
        }
    }
}

#[test]
fn float16_crosses_hosts_as_half_the_bytes_in_the_hierarchy() {
    // 2x2 and 2x3 ranks; LENS leaves gaps between the packed tensors, whose stale
    // bytes overflow when summed: a resend would show they were not cleared.
    for hosts in [&[0, 0, 1, 1][..], &[0, 1, 0, 1, 0, 1][..]] {
        let hosts: &'static [usize] = hosts;
        let n = hosts.len();
        let exact = allreduce_on(
            hosts,
            LENS,
            ReduceOp::Average,
            1.0,
            1.0,
            device_plan(Encoding::Exact, 1.0),
            true,
            1,
            1.0,
        );
        for encoding in [Encoding::Half, Encoding::HalfBetweenHosts] {
            for in_place in [true, false] {
                let plan = device_plan(encoding, 4.0);
                let got = averages(hosts, plan, in_place, 1);
                for (r, (results, _, out, _, downloads, _)) in got.into_iter().enumerate() {
                    assert!(out.results.iter().all(|x| x.is_ok()), "rank {r}");
                    assert!(out.resent.is_none(), "rank {r} {hosts:?}: {:?}", out.resent);
                    let full: usize = exact[r].4.iter().sum();
                    assert_eq!(
                        downloads.iter().sum::<usize>() * 2,
                        full,
                        "rank {r} {hosts:?} {encoding:?}: {downloads:?} against {full}"
                    );
                    assert_averages(&results, n, &format!("rank {r} {hosts:?} {encoding:?}"));
                }
            }
        }
    }
}

#[test]
fn a_float16_overflow_between_hosts_is_resent_exactly_on_every_rank() {
    // Element 0 is 15000x: a host's float32 sum, or the sum of both, no longer
    // fits float16 for some of the tensors, while another stays within it.
    static THREE: &[usize] = &[4, 9, 3];
    const HOSTS: &[usize] = &[0, 0, 1, 1];
    let big = 15_000.0;
    let overflows = |t: usize| {
        let host = |a: usize, b: usize| (value(a, t, 0) + value(b, t, 0)) * big;
        let (one, two) = (host(0, 1), host(2, 3));
        [one, two, one + two].iter().any(|x| x.abs() > 65504.0)
    };
    let want_bad: Vec<usize> = (0..THREE.len()).filter(|&t| overflows(t)).collect();
    assert!(
        !want_bad.is_empty() && want_bad.len() < THREE.len(),
        "{want_bad:?}"
    );
    let plan = device_plan(Encoding::HalfBetweenHosts, 1.0);
    for in_place in [true, false] {
        let got = allreduce_on(
            HOSTS,
            THREE,
            ReduceOp::Sum,
            1.0,
            1.0,
            plan,
            in_place,
            1,
            big,
        );
        for (r, (results, _, out, _, downloads, _)) in got.into_iter().enumerate() {
            let Resent { bad, finite } = out.resent.expect("resent");
            assert_eq!(bad, want_bad, "rank {r}");
            assert!(finite, "rank {r}");
            assert_eq!(downloads.len(), 2, "rank {r}: float16, then exact");
            assert_eq!(downloads[0] * 2, downloads[1], "rank {r}: {downloads:?}");
            for (t, &len) in THREE.iter().enumerate() {
                assert_eq!(
                    results[t],
                    expected(4, t, len, big, |v| v.iter().sum()),
                    "rank {r} tensor {t}"
                );
            }
        }
    }
}

#[test]
fn the_hierarchy_stages_its_chunks_in_reused_page_locked_regions() {
    const HOSTS: &[usize] = &[0, 0, 1, 1];
    // One tensor per allreduce, of these lengths and encodings, one after the other.
    const RUNS: &[(usize, Encoding)] = &[
        (1000, Encoding::Exact),
        (1 << 20, Encoding::Exact),
        (10, Encoding::Exact),
        (1 << 20, Encoding::Half),
        (3000, Encoding::HalfBetweenHosts),
    ];
    let got = run_on(HOSTS, |comm| {
        let r = comm.rank();
        let (mine, peers) = host_and_peers(comm);
        let local = SubComm::new(comm, mine);
        let cross = SubComm::new(comm, peers);
        let group = HostGroup::new(&local, 1);
        let route = Route::Hierarchical(&group, &cross);
        let mut bufs = Buffers::default();
        let mut run = |len: usize, encoding: Encoding| {
            let mut data: Vec<f32> = (0..len).map(|i| value(r, 0, i)).collect();
            let entry = Entry {
                handle: 0,
                output: None,
                input: Some(view(&mut data)),
            };
            let plan = device_plan(encoding, 1.0);
            let resp = response(OpKind::Allreduce, &[len], ReduceOp::Sum, 1.0, 1.0, plan);
            let out = run_direct(route, 4, &resp, &[Some(entry)], &mut bufs, &WATCH);
            let result = out.results[0]
                .as_ref()
                .map(|_| ())
                .map_err(|e| e.to_string());
            (result, data, bufs.staging.free_sizes())
        };
        let runs: Vec<_> = RUNS.iter().map(|&(len, e)| run(len, e)).collect();
        // A pass that fails after its chunk went down and back up.
        group
            .fail_gather
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let failed = run(1000, Encoding::Exact);
        let regions: Vec<usize> = group.regions.lock().unwrap().iter().map(|r| r.1).collect();
        (runs, failed, regions, group.downloads.into_inner().unwrap())
    });
    for (r, (runs, failed, regions, downloads)) in got.into_iter().enumerate() {
        for (i, ((result, data, _), &(len, encoding))) in runs.iter().zip(RUNS).enumerate() {
            assert_eq!(result, &Ok(()), "rank {r} run {i}");
            let want = expected(4, 0, len, 1.0, |v| v.iter().sum());
            assert_eq!(
                data, &want,
                "rank {r} run {i} ({encoding:?}): small sums are exact"
            );
        }
        // Every chunk went through a region of the group (the stand-in checks each
        // download was told it is pinned): 1 MiB for the first chunk, replaced by
        // 2 MiB for the 4 MiB tensor's chunk of 2 MiB, which serves every later one.
        assert_eq!(regions, vec![1 << 20, 2 << 20], "rank {r}");
        let free: Vec<Vec<usize>> = runs.iter().map(|run| run.2.clone()).collect();
        assert_eq!(
            free,
            vec![
                vec![1 << 20],
                vec![2 << 20],
                vec![2 << 20],
                vec![2 << 20],
                vec![2 << 20]
            ],
            "rank {r}"
        );
        // The chunks: a quarter of each tensor's float32 (exact) or float16 bytes.
        let want: Vec<usize> = [1000 * 4, 4 << 20, 10 * 4, 2 << 20, 3000 * 2, 1000 * 4]
            .iter()
            .map(|b| b / 2)
            .collect();
        assert_eq!(downloads, want, "rank {r}");
        // The failed pass's region never returns to the pool: copies queued to it
        // could outlast the error.
        let (result, _, free) = failed;
        assert!(
            result.unwrap_err().contains("ncclAllGather failed"),
            "rank {r}"
        );
        assert!(free.is_empty(), "rank {r}: {free:?}");
    }
}

#[test]
fn a_collective_that_fails_midway_abandons_the_group_on_every_rank() {
    let got = run(3, |comm| {
        let mut group = HostGroup::new(comm, 2);
        group.fail_on = Some(1);
        let plan = device_plan(Encoding::Exact, 1.0);
        // 2 MiB of float32: split across both channels, the second fails.
        static LEN: &[usize] = &[1 << 19];
        let resp = response(OpKind::Allreduce, LEN, ReduceOp::Sum, 1.0, 1.0, plan);
        let attempt = || {
            let mut data = vec![1f32; LEN[0]];
            let entry = Entry {
                handle: 0,
                output: None,
                input: Some(view(&mut data)),
            };
            let out = run_flat(&group, 3, &resp, entry);
            out.results[0]
                .as_ref()
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        let first = attempt();
        let second = attempt();
        let abandoned = group.abandoned.lock().unwrap().clone();
        (first, second, abandoned)
    });
    for (r, (first, second, abandoned)) in got.into_iter().enumerate() {
        let first = first.unwrap_err();
        assert!(
            first.contains("ncclAllReduce failed on channel 1"),
            "rank {r}: {first}"
        );
        assert_eq!(abandoned.as_deref(), Some(first.as_str()), "rank {r}");
        // The group stays abandoned: the next collective fails at once, naming why.
        let second = second.unwrap_err();
        assert!(
            second.contains("abandoned after") && second.contains("channel 1"),
            "rank {r}: {second}"
        );
    }
}

#[test]
fn an_error_after_the_collective_was_queued_abandons_the_group_whatever_its_kind() {
    // Average: the NCCL sum is queued, then the 1/n scale kernel fails (here with an
    // argument error, the kind NVRTC's failures once had): the group must still be
    // abandoned (NCCL aborted, streams drained) before the handle fails.
    let got = run(2, |comm| {
        let mut group = HostGroup::new(comm, 1);
        group.fail_scale = Some(PerseusError::InvalidArgument(
            "kernel source scale does not compile".into(),
        ));
        let plan = device_plan(Encoding::Exact, 1.0);
        let resp = response(
            OpKind::Allreduce,
            &[1000],
            ReduceOp::Average,
            1.0,
            1.0,
            plan,
        );
        let mut data = vec![1f32; 1000];
        let entry = Entry {
            handle: 0,
            output: None,
            input: Some(view(&mut data)),
        };
        let out = run_flat(&group, 2, &resp, entry);
        let err = out.results[0]
            .as_ref()
            .map(|_| ())
            .map_err(|e| e.to_string());
        let calls = group.calls.lock().unwrap().len();
        let abandoned = group.abandoned.lock().unwrap().clone();
        (err, calls, abandoned)
    });
    for (r, (err, calls, abandoned)) in got.into_iter().enumerate() {
        let err = err.unwrap_err();
        assert!(err.contains("scale does not compile"), "rank {r}: {err}");
        assert_eq!(
            calls, 1,
            "rank {r}: the allreduce was queued before the scale"
        );
        assert_eq!(abandoned.as_deref(), Some(err.as_str()), "rank {r}");
    }
}

#[test]
fn a_response_the_route_cannot_run_is_refused_before_anything_is_queued() {
    let got = run_on(&[0, 0, 1, 1], |comm| {
        let (mine, peers) = host_and_peers(comm);
        let local = SubComm::new(comm, mine);
        let cross = SubComm::new(comm, peers);
        let group = HostGroup::new(&local, 1);
        let mut data = vec![1f32; 100];
        let mut attempt = |resp: &Response, route: Route<'_>| {
            let entry = Entry {
                handle: 0,
                output: None,
                input: Some(view(&mut data)),
            };
            let out = run_direct(
                route,
                4,
                resp,
                &[Some(entry)],
                &mut Buffers::default(),
                &WATCH,
            );
            out.results[0]
                .as_ref()
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        let plan = device_plan(Encoding::Exact, 1.0);
        // A broadcast has no hierarchical path; a host response no direct one.
        let bcast = response(OpKind::Broadcast, &[100], ReduceOp::Sum, 1.0, 1.0, plan);
        let host = response(
            OpKind::Allreduce,
            &[100],
            ReduceOp::Sum,
            1.0,
            1.0,
            Plan::default(),
        );
        let refused = [
            attempt(&bcast, Route::Hierarchical(&group, &cross)),
            attempt(&host, Route::Flat(&group)),
        ];
        let queued = group.calls.lock().unwrap().len() + group.downloads.lock().unwrap().len();
        let abandoned = group.abandoned.lock().unwrap().clone();
        (refused, queued, abandoned)
    });
    for (r, (refused, queued, abandoned)) in got.into_iter().enumerate() {
        let [bcast, host] = refused;
        assert!(
            bcast
                .unwrap_err()
                .contains("broadcast has no hierarchical device path"),
            "rank {r}"
        );
        assert!(
            host.unwrap_err().contains("no device-direct path"),
            "rank {r}"
        );
        assert_eq!(queued, 0, "rank {r}");
        assert_eq!(abandoned, None, "rank {r}: the group stays usable");
    }
}

#[test]
fn broadcast_copies_the_roots_tensor_in_place_and_out_of_place() {
    for in_place in [true, false] {
        let got = run(3, move |comm| {
            let r = comm.rank();
            let group = HostGroup::new(comm, 2);
            let mut input: Vec<f32> = (0..1000).map(|i| (r * 1000 + i) as f32).collect();
            let mut output = vec![0f32; 1000];
            let iv = view(&mut input);
            let entry = Entry {
                handle: 0,
                output: Some(if in_place {
                    iv.clone()
                } else {
                    view(&mut output)
                }),
                input: Some(iv),
            };
            let resp = response(
                OpKind::Broadcast,
                &[1000],
                ReduceOp::Sum,
                1.0,
                1.0,
                device_plan(Encoding::Exact, 1.0),
            );
            let out = run_flat(&group, 3, &resp, entry);
            assert!(out.results.iter().all(|x| x.is_ok()));
            if in_place {
                input
            } else {
                output
            }
        });
        let root: Vec<f32> = (0..1000).map(|i| (1000 + i) as f32).collect();
        for (r, got) in got.into_iter().enumerate() {
            assert_eq!(got, root, "rank {r} in place {in_place}");
        }
    }
}

#[test]
fn only_device_responses_of_device_operations_go_direct() {
    let dev = device_plan(Encoding::Exact, 1.0);
    let ar = |op, pre, plan| response(OpKind::Allreduce, &[4], op, pre, 1.0, plan);
    assert!(supports(&ar(ReduceOp::Sum, 1.0, dev)));
    assert!(supports(&ar(ReduceOp::Average, 2.0, dev)));
    assert!(!supports(&ar(ReduceOp::Sum, 1.0, Plan::default())));
    assert!(!supports(&ar(ReduceOp::Adasum, 1.0, dev)));
    let mut int_avg = ar(ReduceOp::Average, 1.0, dev);
    if let Response::Op { dtype, .. } = &mut int_avg {
        *dtype = DataType::I32;
    }
    assert!(
        !supports(&int_avg),
        "integer Average needs a scale kernel it lacks"
    );
    let mut int_sum = ar(ReduceOp::Sum, 1.0, dev);
    if let Response::Op { dtype, .. } = &mut int_sum {
        *dtype = DataType::I64;
    }
    assert!(supports(&int_sum));
    let gather = response(OpKind::Allgather, &[4], ReduceOp::Sum, 1.0, 1.0, dev);
    assert!(!supports(&gather));
    let bcast = response(OpKind::Broadcast, &[4], ReduceOp::Sum, 1.0, 1.0, dev);
    assert!(supports(&bcast));
}

fn uuid(k: u8) -> [u8; 16] {
    [k; 16]
}

#[test]
fn every_rank_agrees_on_the_path_and_on_why() {
    // Each rank on its own device: direct.
    let got = run(3, |c| agree(c, Ok(uuid(c.rank() as u8))).unwrap());
    assert!(got.iter().all(|a| *a == Agreement::Direct), "{got:?}");
    // One rank cannot: staged, with its reason, on every rank.
    let got = run(3, |c| {
        let offer = if c.rank() == 1 {
            Err("NCCL (libnccl.so.2) was not found".to_string())
        } else {
            Ok(uuid(c.rank() as u8))
        };
        agree(c, offer).unwrap()
    });
    let want = Agreement::Staged("rank 1: NCCL (libnccl.so.2) was not found".into());
    assert!(got.iter().all(|a| *a == want), "{got:?}");
    // Two ranks of one host on one device: staged; on two hosts: direct.
    let got = run(3, |c| agree(c, Ok(uuid((c.rank() == 2) as u8))).unwrap());
    let want = Agreement::Staged("ranks 0 and 1 share one GPU (NCCL needs a GPU per rank)".into());
    assert!(got.iter().all(|a| *a == want), "{got:?}");
    let got = run_on(&[0, 1], |c| agree(c, Ok(uuid(0))).unwrap());
    assert!(got.iter().all(|a| *a == Agreement::Direct), "{got:?}");
}

/// A group that is never used: [`Groups`] only hands it out (and may abandon it).
struct Unused(Arc<Mutex<Vec<String>>>);

impl DeviceGroup for Unused {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn channels(&self) -> usize {
        1
    }
    fn fusion(&self, _: usize) -> Result<*mut u8> {
        unreachable!()
    }
    unsafe fn copy(&self, _: *const u8, _: *mut u8, _: usize) -> Result<()> {
        unreachable!()
    }
    unsafe fn scale(&self, _: *mut u8, _: usize, _: DataType, _: f64) -> Result<()> {
        unreachable!()
    }
    unsafe fn cast_down(&self, _: *const u8, _: *mut u8, _: usize, _: f32) -> Result<()> {
        unreachable!()
    }
    unsafe fn cast_up(&self, _: *const u8, _: *mut u8, _: usize, _: f32) -> Result<()> {
        unreachable!()
    }
    unsafe fn nonfinite(
        &self,
        _: &[(*const u8, usize)],
        _: DataType,
        _: &Watch,
    ) -> Result<Vec<usize>> {
        unreachable!()
    }
    unsafe fn allreduce(
        &self,
        _: usize,
        _: *mut u8,
        _: usize,
        _: DataType,
        _: ReduceOp,
        _: &Watch,
    ) -> Result<()> {
        unreachable!()
    }
    unsafe fn broadcast(&self, _: *mut u8, _: usize, _: usize, _: &Watch) -> Result<()> {
        unreachable!()
    }
    unsafe fn reduce_scatter(
        &self,
        _: *mut u8,
        _: usize,
        _: DataType,
        _: ReduceOp,
        _: &Watch,
    ) -> Result<()> {
        unreachable!()
    }
    unsafe fn allgather(&self, _: *mut u8, _: usize, _: DataType, _: &Watch) -> Result<()> {
        unreachable!()
    }
    unsafe fn download(&self, _: *const u8, _: &mut [u8], _: bool, _: &Watch) -> Result<()> {
        unreachable!()
    }
    unsafe fn upload(&self, _: &[u8], _: *mut u8) -> Result<()> {
        unreachable!()
    }
    fn finish(&self, _: &Watch) -> Result<()> {
        unreachable!()
    }
    fn abandon(&self, why: &str) {
        self.0.lock().unwrap().push(why.to_string());
    }
}

/// Offers `uuid(rank)` unless told why not; counts the groups it opens.
struct FakeOpener {
    refuse: Option<String>,
    opened: Arc<std::sync::atomic::AtomicUsize>,
    members: Arc<Mutex<Vec<usize>>>,
    /// Why its groups were abandoned.
    abandoned: Arc<Mutex<Vec<String>>>,
}

impl Opener for FakeOpener {
    fn offer(&self, device: Device) -> std::result::Result<[u8; 16], String> {
        match (&self.refuse, device) {
            (Some(why), _) => Err(why.clone()),
            (None, Device::Cuda(o)) => Ok(uuid(o as u8)),
            (None, Device::Cpu) => Err("host memory".into()),
        }
    }
    fn open(
        &self,
        c: &dyn Comm,
        _: Device,
        channels: usize,
        members: &[usize],
        _: &Watch,
    ) -> Result<Formed> {
        assert_eq!(channels, 2);
        assert!(members.contains(&c.rank()));
        *self.members.lock().unwrap() = members.to_vec();
        self.opened
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(Ok(Arc::new(Unused(self.abandoned.clone()))))
    }
}

/// Asks for set 0's group twice on 2 ranks; rank 1 refuses with `refuse` and runs
/// with `its_use`. Returns (first answer, second answer, groups opened) per rank.
fn ask_twice(
    refuse: Option<&'static str>,
    use_nccl: NcclUse,
    its_use: NcclUse,
) -> Vec<(Result<bool>, Result<bool>, usize)> {
    run(2, move |comm| {
        let r = comm.rank();
        let opened = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let opener = FakeOpener {
            refuse: refuse.filter(|_| r == 1).map(String::from),
            opened: opened.clone(),
            members: Arc::default(),
            abandoned: Arc::default(),
        };
        let mode = if r == 1 { its_use } else { use_nccl };
        let mut groups = Groups::new(
            mode,
            2,
            std::time::Duration::from_secs(60),
            Box::new(opener),
        );
        let device = Device::Cuda(r as i32);
        let first = groups
            .get(0, comm, device, false, &WATCH)
            .map(|g| g.is_some());
        let second = groups
            .get(0, comm, device, false, &WATCH)
            .map(|g| g.is_some());
        (
            first,
            second,
            opened.load(std::sync::atomic::Ordering::SeqCst),
        )
    })
}

#[test]
fn a_set_forms_its_group_once_or_says_why_not_on_every_rank() {
    for (r, (a, b, opened)) in ask_twice(None, NcclUse::Auto, NcclUse::Auto)
        .into_iter()
        .enumerate()
    {
        assert!(a.unwrap() && b.unwrap(), "rank {r}");
        assert_eq!(opened, 1, "rank {r}: formed once");
    }
    // Automatic: a rank without NCCL sends the set through host memory.
    let got = ask_twice(Some("NCCL was not found"), NcclUse::Auto, NcclUse::Auto);
    for (r, (a, b, opened)) in got.into_iter().enumerate() {
        assert!(!a.unwrap() && !b.unwrap(), "rank {r}");
        assert_eq!(opened, 0);
    }
    // Required: the same is an error naming the rank and the cause, on every rank.
    let got = ask_twice(
        Some("NCCL was not found"),
        NcclUse::Required,
        NcclUse::Required,
    );
    for (r, (a, _, _)) in got.into_iter().enumerate() {
        let msg = a.unwrap_err().to_string();
        assert!(
            msg.contains("PERSEUS_NCCL_ENABLE=1") && msg.contains("rank 1: NCCL was not found"),
            "rank {r}: {msg}"
        );
    }
    // Off on one rank: nobody uses NCCL, and nobody hangs.
    let got = ask_twice(None, NcclUse::Auto, NcclUse::Off);
    for (r, (a, _, opened)) in got.into_iter().enumerate() {
        assert!(!a.unwrap(), "rank {r}");
        assert_eq!(opened, 0);
    }
}

#[test]
fn a_group_stays_on_the_device_it_was_formed_on() {
    let got = run(2, |comm| {
        let abandoned: Arc<Mutex<Vec<String>>> = Arc::default();
        let opener = FakeOpener {
            refuse: None,
            opened: Arc::default(),
            members: Arc::default(),
            abandoned: abandoned.clone(),
        };
        let limit = std::time::Duration::from_secs(60);
        let mut groups = Groups::new(NcclUse::Auto, 2, limit, Box::new(opener));
        let r = comm.rank() as i32;
        let first = groups
            .get(0, comm, Device::Cuda(r), false, &WATCH)
            .map(|g| g.is_some());
        let again = groups
            .get(0, comm, Device::Cuda(r), false, &WATCH)
            .map(|g| g.is_some());
        let moved = groups
            .get(0, comm, Device::Cuda(r + 2), false, &WATCH)
            .map(|g| g.is_some());
        let abandoned = abandoned.lock().unwrap().clone();
        (first, again, moved, abandoned)
    });
    for (r, (first, again, moved, abandoned)) in got.into_iter().enumerate() {
        assert!(first.unwrap() && again.unwrap(), "rank {r}");
        let msg = moved.unwrap_err().to_string();
        assert!(
            msg.contains(&format!(
                "process set 0 runs its NCCL collectives on cuda:{r}, but these tensors are \
                 on cuda:{}",
                r + 2
            )),
            "rank {r}: {msg}"
        );
        // Abandoned, so that later collectives cannot pair with a peer's in NCCL.
        assert_eq!(abandoned, vec![msg], "rank {r}");
    }
}

#[test]
fn a_hierarchical_group_is_formed_among_the_ranks_of_each_host() {
    // Two hosts of two ranks; each rank's GPU is its local index, so UUIDs repeat
    // across hosts but not within one.
    let got = run_on(&[0, 1, 0, 1], |comm| {
        let members = Arc::new(Mutex::new(Vec::new()));
        let opener = FakeOpener {
            refuse: None,
            opened: Arc::default(),
            members: members.clone(),
            abandoned: Arc::default(),
        };
        let mut groups = Groups::new(
            NcclUse::Auto,
            2,
            std::time::Duration::from_secs(60),
            Box::new(opener),
        );
        let local_index = comm.rank() / 2;
        let device = Device::Cuda(local_index as i32);
        let local = groups.get(0, comm, device, true, &WATCH).unwrap().is_some();
        let seen = members.lock().unwrap().clone();
        let flat = groups
            .get(0, comm, device, false, &WATCH)
            .unwrap()
            .is_some();
        let all = members.lock().unwrap().clone();
        (local, seen, flat, all)
    });
    for (r, (local, seen, flat, all)) in got.into_iter().enumerate() {
        assert!(local && flat, "rank {r}");
        assert_eq!(seen, vec![r % 2, r % 2 + 2], "rank {r}: its host's ranks");
        assert_eq!(all, vec![0, 1, 2, 3], "rank {r}: the whole set");
    }
}

#[test]
fn only_the_gaps_of_a_chunk_are_cleared() {
    // Tensors at elements 0..5, 64..70 and 128..130; chunks of 8 from various starts.
    let live = [0..5, 64..70, 128..130];
    let image_of = |first: usize, len: usize| {
        let mut img = vec![0xffu8; len * 2];
        clear_gaps(&mut img, first, &live);
        img.chunks(2)
            .map(|v| v == [0xff, 0xff])
            .collect::<Vec<bool>>()
    };
    let kept = |first: usize, len: usize| {
        (first..first + len)
            .map(|e| live.iter().any(|r| r.contains(&e)))
            .collect::<Vec<bool>>()
    };
    for (first, len) in [
        (0, 8),
        (2, 8),
        (60, 8),
        (66, 8),
        (120, 16),
        (129, 8),
        (200, 4),
    ] {
        assert_eq!(
            image_of(first, len),
            kept(first, len),
            "from {first}, {len}"
        );
    }
}
