//! Running one response on this rank: gather the local tensors (or zeros for
//! a joined rank), fuse, scale, call the collective, scatter the results and
//! complete the handles.

use super::handles::Output;
use super::message::{OpKind, Response};
use crate::collective::{self, Comm};
use crate::compress::{self, HalfReduce, Resent, Wire};
use crate::device::{OwnedTensor, TensorView};
use crate::dtype::{DataType, ReduceOp};
use crate::error::{PerseusError, Result};
use crate::kernels::{
    adasum, clock, copy_scaled, first_nonfinite, from_half, pool, scale, to_half, AlignedBuf,
};
use crate::plan::{Mode, Plan};
use std::ops::Range;
use std::time::Instant;

/// A local operation waiting for its response.
pub struct Entry {
    /// Handle to complete.
    pub handle: u64,
    /// Input tensor (absent for negotiation-only kinds).
    pub input: Option<TensorView>,
    /// Output tensor written in place (allreduce, broadcast; allgather, alltoall and
    /// reducescatter when the caller gave one of the result's size).
    pub output: Option<TensorView>,
}

/// Reusable buffers of the engine thread.
#[derive(Default)]
pub struct Buffers {
    /// Fusion buffer.
    pub fusion: AlignedBuf,
    /// float16 image of the fusion buffer (compressed allreduces).
    pub half: AlignedBuf,
    /// Scratch for the algorithms.
    pub scratch: AlignedBuf,
    /// While the timeline runs: the phases of the allreduce being run.
    pub phases: Option<Vec<Phase>>,
    /// Host copies of device tensors (the host-staged path).
    pub staging: crate::device::StagingPool,
}

/// Timeline phase: inputs copied into the fusion buffer (Horovod's name).
const MEMCPY_IN: &str = "MEMCPY_IN_FUSION_BUFFER";
/// Timeline phase: results copied out of the fusion buffer (Horovod's name).
const MEMCPY_OUT: &str = "MEMCPY_OUT_FUSION_BUFFER";
/// Timeline phase: the transport's allreduce (as Horovod's MPI_ALLREDUCE).
const TRANSPORT_ALLREDUCE: &str = "PERSEUS_ALLREDUCE";
/// Timeline phase: the transport's allgather (Adasum's).
const TRANSPORT_ALLGATHER: &str = "PERSEUS_ALLGATHER";

/// One phase of an allreduce, for the timeline, named as Horovod's activities
/// where Horovod has one: MEMCPY_IN_FUSION_BUFFER (inputs copied and prescaled
/// into the fusion buffer), COMPRESS (cast to float16), PERSEUS_ALLREDUCE (the
/// transport's collective, as Horovod's MPI_ALLREDUCE or GLOO_ALLREDUCE;
/// PERSEUS_ALLGATHER for Adasum's gather), REDUCE (the part of it the
/// reduction kernels ran, in total, drawn from its start),
/// MEMCPY_OUT_FUSION_BUFFER (results checked, scaled and copied out of the
/// fusion buffer) or, where there was none, COMPLETE (results checked, cast
/// back from float16 or combined by Adasum, and scaled; empty for a tensor
/// reduced in its own memory).
pub struct Phase {
    /// Its name.
    pub name: &'static str,
    /// When it began.
    pub start: Instant,
    /// When it ended.
    pub end: Instant,
}

impl Buffers {
    fn mark(&mut self, name: &'static str, start: Instant) {
        if let Some(p) = &mut self.phases {
            p.push(Phase {
                name,
                start,
                end: Instant::now(),
            });
        }
    }

    /// Runs a collective as the phase `name` (the transport's collective), with
    /// its REDUCE share.
    fn transfer(
        &mut self,
        name: &'static str,
        f: impl FnOnce(&mut Buffers) -> Result<()>,
    ) -> Result<()> {
        if self.phases.is_none() {
            return f(self);
        }
        let start = Instant::now();
        clock::start();
        let r = f(self);
        let reduced = clock::stop();
        self.mark(name, start);
        if let Some(p) = &mut self.phases {
            p.push(Phase {
                name: "REDUCE",
                start,
                end: start + reduced,
            });
        }
        r
    }
}

/// What a data-moving response did on this rank.
pub struct Outcome {
    /// One result per name.
    pub results: Vec<Result<Output>>,
    /// A compressed allreduce overflowed float16 and was resent exactly: the
    /// positions of the tensors whose float16 sums were not finite, and
    /// whether the exact sums were finite (then the scale was to blame).
    pub resent: Option<Resent>,
}

fn elems(shape: &[i64]) -> usize {
    shape.iter().product::<i64>().max(0) as usize
}

/// Executes a data-moving `Op` response. `entries[i]` belongs to `names[i]`
/// (`None` where this rank has joined).
pub fn run_op(
    comm: &dyn Comm,
    resp: &Response,
    entries: &[Option<Entry>],
    bufs: &mut Buffers,
) -> Outcome {
    let Response::Op {
        kind,
        shapes,
        dtype,
        op,
        root,
        prescale,
        postscale,
        sizes,
        plan,
        ..
    } = resp
    else {
        unreachable!("run_op takes Op responses");
    };
    let n = comm.size();
    let post = post_factor(*op, *postscale, n);
    let one = |r: Result<Output>| Outcome {
        results: vec![r],
        resent: None,
    };
    match kind {
        OpKind::Allreduce => {
            let ar = Allreduce {
                comm,
                sizes: shapes.iter().map(|s| elems(s) * dtype.size()).collect(),
                dtype: *dtype,
                op: *op,
                pre: *prescale,
                post,
                entries,
            };
            let (result, resent) = match ar.run(plan, bufs) {
                Ok(resent) => (Ok(()), resent),
                Err(e) => (Err(e), None),
            };
            Outcome {
                results: entries
                    .iter()
                    .map(|_| result.clone().map(|_| Output::default()))
                    .collect(),
                resent,
            }
        }
        OpKind::Broadcast => one((|| {
            let e = entries[0].as_ref().expect("broadcast entry");
            // SAFETY: the front-end keeps the tensor alive until completion.
            let buf = unsafe { e.output.as_ref().expect("broadcast buffer").bytes_mut() };
            collective::broadcast(comm, buf, *root as usize)?;
            Ok(Output::default())
        })()),
        OpKind::Allgather => one(allgather(
            comm,
            &shapes[0],
            *dtype,
            sizes,
            plan.mode == Mode::Hierarchical,
            entries,
        )),
        OpKind::Alltoall => one(alltoall(comm, &shapes[0], *dtype, sizes, entries)),
        OpKind::Reducescatter => one(reducescatter(
            comm,
            &shapes[0],
            *dtype,
            *op,
            (*prescale, post),
            entries,
            bufs,
        )),
        _ => unreachable!("not a data-moving kind"),
    }
}

/// Float32 bytes up to which a float16 allreduce reduces a float16 image of
/// the buffer (one direct exchange) rather than running the float32 ring
/// with float16 links.
const IMAGE_MAX: usize = 128 << 10;

/// Bytes from which a tensor of a fused allreduce is reduced in its own
/// memory rather than copied into the fusion buffer and back: beyond this,
/// the two copies cost more than the ring's extra steps.
const IN_PLACE_MIN: usize = 1 << 20;

/// One (possibly fused) allreduce on this rank.
struct Allreduce<'a> {
    comm: &'a dyn Comm,
    /// Bytes of each tensor.
    sizes: Vec<usize>,
    dtype: DataType,
    op: ReduceOp,
    pre: f64,
    post: f64,
    entries: &'a [Option<Entry>],
}

impl Allreduce<'_> {
    /// Runs the plan; a compressed run whose float16 sum is not finite is
    /// redone exactly from the inputs, which nothing has written yet.
    fn run(&self, plan: &Plan, bufs: &mut Buffers) -> Result<Option<Resent>> {
        if self.op == ReduceOp::Adasum {
            return self.adasum(bufs).map(|_| None);
        }
        let hosts = collective::hosts_of(self.comm);
        // An automatic mode takes the hierarchy only where the buffer is large enough
        // for the ring within each host to pay; smaller ones take the log-n steps.
        let len: usize = self.sizes.iter().sum();
        let hier = match plan.mode {
            Mode::Flat => false,
            Mode::Auto if collective::latency_bound(self.comm.size(), len) => false,
            _ => collective::fits(&hosts),
        };
        let wire = compress::wire(
            self.dtype,
            self.op,
            plan.encoding,
            plan.scale,
            self.comm.size(),
            || hosts.len(),
        );
        compress::allreduce(
            &mut OnHost {
                ar: self,
                bufs,
                hier,
            },
            wire,
        )
    }

    fn input(&self, i: usize) -> Option<&[u8]> {
        let e = self.entries[i].as_ref()?;
        // SAFETY: the front-end keeps the tensor alive until completion.
        e.input.as_ref().map(|v| unsafe { v.bytes() })
    }

    fn output(&self, i: usize) -> Option<&TensorView> {
        self.entries[i].as_ref()?.output.as_ref()
    }

    fn output_finite(&self, i: usize) -> bool {
        // SAFETY: the front-end keeps the tensor alive until completion.
        self.output(i).map_or(true, |o| {
            first_nonfinite(unsafe { o.bytes() }, self.dtype).is_none()
        })
    }

    /// Tensors with a non-finite element in `fused` (a `dtype` image whose
    /// element `k` is byte `k * dtype.size()` of the original layout).
    fn nonfinite(&self, fused: &[u8], dtype: DataType) -> Vec<usize> {
        let ratio = self.dtype.size() / dtype.size();
        let parts = self.layout(&self.all()).into_iter();
        compress::nonfinite_parts(
            fused,
            dtype,
            parts.map(|(_, b)| b.start / ratio..b.end / ratio),
        )
    }

    /// Reduces `buf` and multiplies the result by `factor`: within the
    /// ring's last step when the ring runs, after the hierarchy otherwise.
    fn reduce(
        &self,
        buf: &mut [u8],
        dtype: DataType,
        hier: bool,
        factor: f64,
        bufs: &mut Buffers,
    ) -> Result<()> {
        bufs.transfer(TRANSPORT_ALLREDUCE, |bufs| {
            if hier {
                let mut half = AlignedBuf::default();
                collective::allreduce_hierarchical(
                    self.comm,
                    buf,
                    dtype,
                    self.op,
                    false,
                    &mut half,
                    &mut bufs.scratch,
                )?;
                scale(buf, dtype, factor);
                Ok(())
            } else {
                collective::allreduce(self.comm, buf, dtype, self.op, factor, &mut bufs.scratch)
            }
        })
    }

    /// The tensors `which`, laid end to end: (tensor, its byte range in the
    /// fused buffer).
    fn layout(&self, which: &[usize]) -> Vec<(usize, Range<usize>)> {
        let mut off = 0;
        which
            .iter()
            .map(|&i| {
                off += self.sizes[i];
                (i, off - self.sizes[i]..off)
            })
            .collect()
    }

    /// Copies the inputs `which` times `factor` (zeros for a joined rank)
    /// into `fused`, end to end.
    fn fuse_into(&self, fused: &mut [u8], factor: f64, which: &[usize]) {
        for (i, range) in self.layout(which) {
            let dst = &mut fused[range];
            match self.input(i) {
                Some(src) => copy_scaled(dst, src, self.dtype, factor),
                None => dst.fill(0),
            }
        }
    }

    /// Copies `fused` times `factor` out to the outputs `which`.
    fn scatter_from(&self, fused: &[u8], factor: f64, which: &[usize]) {
        for (i, range) in self.layout(which) {
            if let Some(out) = self.output(i) {
                // SAFETY: the front-end keeps the tensor alive until completion,
                // and only the engine thread writes it until then.
                let out = unsafe { out.bytes_mut() };
                copy_scaled(out, &fused[range], self.dtype, factor);
            }
        }
    }

    /// Every tensor's index.
    fn all(&self) -> Vec<usize> {
        (0..self.sizes.len()).collect()
    }

    /// The exact reduction. A lone tensor, and every tensor of at least
    /// [`IN_PLACE_MIN`] bytes, is reduced in its output's own memory, one
    /// ring each; the rest are fused. Every rank splits them alike, since the
    /// split depends on the sizes alone.
    fn exact(&self, hier: bool, bufs: &mut Buffers) -> Result<()> {
        let lone = self.sizes.len() == 1;
        let (alone, fused): (Vec<usize>, Vec<usize>) =
            (0..self.sizes.len()).partition(|&i| lone || self.sizes[i] >= IN_PLACE_MIN);
        for i in alone {
            self.in_place(i, hier, bufs)?;
        }
        if fused.is_empty() {
            return Ok(());
        }
        let mut fusion = std::mem::take(&mut bufs.fusion);
        fusion.resize(fused.iter().map(|&i| self.sizes[i]).sum());
        let buf = fusion.as_mut_slice();
        let t = Instant::now();
        self.fuse_into(buf, self.pre, &fused);
        bufs.mark(MEMCPY_IN, t);
        let r = self.reduce(buf, self.dtype, hier, 1.0, bufs);
        if r.is_ok() {
            let t = Instant::now();
            self.scatter_from(buf, self.post, &fused);
            bufs.mark(MEMCPY_OUT, t);
        }
        bufs.fusion = fusion;
        r
    }

    /// Tensor `i` reduced in its output (zeros in the fusion buffer where
    /// this rank has none): the input copied there first when it is
    /// elsewhere, the postscale folded into the ring.
    fn in_place(&self, i: usize, hier: bool, bufs: &mut Buffers) -> Result<()> {
        let mut borrowed = self.output(i).is_none().then(|| {
            let mut b = std::mem::take(&mut bufs.fusion);
            b.resize(self.sizes[i]);
            b
        });
        let out: &mut [u8] = match (self.output(i), borrowed.as_mut()) {
            // SAFETY: the front-end keeps the tensor alive until completion,
            // and only the engine thread writes it until then.
            (Some(o), _) => unsafe { o.bytes_mut() },
            (None, b) => b.expect("borrowed when there is no output").as_mut_slice(),
        };
        let r = match self.input(i) {
            // Out of place on the flat ring: the input is read where it lies.
            Some(src) if src.as_ptr() != out.as_ptr() && self.pre == 1.0 && !hier => {
                bufs.transfer(TRANSPORT_ALLREDUCE, |bufs| {
                    collective::allreduce_from(
                        self.comm,
                        src,
                        out,
                        self.dtype,
                        self.op,
                        self.post,
                        &mut bufs.scratch,
                    )
                })
            }
            src => {
                match src {
                    Some(src) if src.as_ptr() != out.as_ptr() => {
                        copy_scaled(out, src, self.dtype, self.pre)
                    }
                    Some(_) => scale(out, self.dtype, self.pre),
                    None => out.fill(0),
                }
                self.reduce(out, self.dtype, hier, self.post, bufs)
            }
        };
        // Nothing is left to copy or scale: an empty COMPLETE keeps every
        // allreduce's rows alike on the timeline.
        bufs.mark("COMPLETE", Instant::now());
        if let Some(b) = borrowed {
            bufs.fusion = b;
        }
        r
    }

    /// Adasum (kernels/adasum.rs), tensor by tensor: every rank's prescaled
    /// tensors (zeros where it has joined) are gathered, then each rank combines
    /// them by the same tree, so all get identical results. Exact: no float16
    /// and no hierarchy (the combination needs every rank's whole tensor).
    fn adasum(&self, bufs: &mut Buffers) -> Result<()> {
        let (n, me) = (self.comm.size(), self.comm.rank());
        let total: usize = self.sizes.iter().sum();
        let mut fusion = std::mem::take(&mut bufs.fusion);
        fusion.resize(total * n);
        let buf = fusion.as_mut_slice();
        let t = Instant::now();
        self.fuse_into(
            &mut buf[me * total..(me + 1) * total],
            self.pre,
            &self.all(),
        );
        bufs.mark(MEMCPY_IN, t);
        let r = bufs.transfer(TRANSPORT_ALLGATHER, |_| {
            collective::allgatherv(self.comm, buf, &vec![total; n])
        });
        if r.is_ok() {
            let t = Instant::now();
            for (i, range) in self.layout(&self.all()) {
                let parts = (0..n)
                    .map(|k| {
                        let part = &buf[k * total + range.start..k * total + range.end];
                        adasum::to_f64(part, self.dtype).expect("checked floating at submission")
                    })
                    .collect();
                let combined = adasum::tree(parts);
                if let Some(out) = self.output(i) {
                    // SAFETY: the front-end keeps the tensor alive until completion,
                    // and only the engine thread writes it until then.
                    adasum::write_f64(unsafe { out.bytes_mut() }, &combined, self.dtype, self.post);
                }
            }
            bufs.mark("COMPLETE", t);
        }
        bufs.fusion = fusion;
        r
    }

    /// float16 on every link: cast (scaled) into the float16 buffer, reduce
    /// it, check it, cast back (unscaled) into the outputs.
    fn half(&self, hier: bool, wire: Wire, bufs: &mut Buffers) -> Result<Vec<usize>> {
        let mut half = std::mem::take(&mut bufs.half);
        half.resize(self.sizes.iter().sum::<usize>() / 2);
        let h = half.as_mut_slice();
        let t = Instant::now();
        for (i, b) in self.layout(&self.all()) {
            let dst = &mut h[b.start / 2..b.end / 2];
            match self.input(i) {
                Some(src) => to_half(dst, src, wire.down(self.pre)),
                None => dst.fill(0),
            }
        }
        bufs.mark("COMPRESS", t);
        let r = self.reduce(h, DataType::F16, hier, 1.0, bufs);
        let t = Instant::now();
        let r = r.map(|_| {
            let bad = self.nonfinite(h, DataType::F16);
            if bad.is_empty() {
                for (i, b) in self.layout(&self.all()) {
                    if let Some(out) = self.output(i) {
                        // SAFETY: as in `scatter_from`.
                        let out = unsafe { out.bytes_mut() };
                        from_half(out, &h[b.start / 2..b.end / 2], wire.up(self.post));
                    }
                }
            }
            bad
        });
        bufs.mark("COMPLETE", t);
        bufs.half = half;
        r
    }

    /// Float32 partial sums with float16 on the links between hosts, or on
    /// every link (`everywhere`); every rank ends with the same
    /// float16-rounded sums.
    fn half_links(
        &self,
        hier: bool,
        everywhere: bool,
        wire: Wire,
        bufs: &mut Buffers,
    ) -> Result<Vec<usize>> {
        let mut fusion = std::mem::take(&mut bufs.fusion);
        fusion.resize(self.sizes.iter().sum());
        let fused = fusion.as_mut_slice();
        let t = Instant::now();
        self.fuse_into(fused, wire.down(self.pre), &self.all());
        bufs.mark(MEMCPY_IN, t);
        let r = bufs.transfer(TRANSPORT_ALLREDUCE, |bufs| {
            if hier {
                collective::allreduce_hierarchical(
                    self.comm,
                    fused,
                    self.dtype,
                    self.op,
                    true,
                    &mut bufs.half,
                    &mut bufs.scratch,
                )
            } else {
                collective::allreduce_half_links(
                    self.comm,
                    fused,
                    self.op,
                    everywhere,
                    &mut bufs.scratch,
                )
            }
        });
        let t = Instant::now();
        let r = r.map(|_| {
            let bad = self.nonfinite(fused, self.dtype);
            if bad.is_empty() {
                self.scatter_from(fused, wire.up(self.post), &self.all());
            }
            bad
        });
        bufs.mark(MEMCPY_OUT, t);
        bufs.fusion = fusion;
        r
    }
}

/// The host executor's float16 passes: a float16 image of small buffers (and under the
/// hierarchy), else float32 partial sums with float16 links.
struct OnHost<'a, 'b> {
    ar: &'a Allreduce<'a>,
    bufs: &'b mut Buffers,
    hier: bool,
}

impl HalfReduce for OnHost<'_, '_> {
    fn half(&mut self, wire: Wire) -> Result<Vec<usize>> {
        let (ar, hier) = (self.ar, self.hier);
        let total: usize = ar.sizes.iter().sum();
        match wire {
            // Small buffers and the hierarchy: reduce a float16 image.
            Wire::Half { .. } if hier || total <= IMAGE_MAX => ar.half(hier, wire, self.bufs),
            // Float32 partial sums, float16 on every link.
            Wire::Half { .. } => ar.half_links(false, true, wire, self.bufs),
            _ => ar.half_links(hier, false, wire, self.bufs),
        }
    }
    fn exact(&mut self, check: &[usize]) -> Result<bool> {
        self.ar.exact(self.hier, self.bufs)?;
        Ok(check.iter().all(|&i| self.ar.output_finite(i)))
    }
}

fn input_of(entries: &[Option<Entry>]) -> Result<&TensorView> {
    entries[0]
        .as_ref()
        .and_then(|e| e.input.as_ref())
        .ok_or_else(|| PerseusError::Protocol("response names a tensor this rank lacks".into()))
}

/// Allgather along dim 0; `hierarchical` (HOROVOD_HIERARCHICAL_ALLGATHER): across hosts
/// first, then within each, where the set's hosts each hold the same number (two or
/// more) of its ranks.
fn allgather(
    comm: &dyn Comm,
    shape: &[i64],
    dtype: DataType,
    dims: &[i64],
    hierarchical: bool,
    entries: &[Option<Entry>],
) -> Result<Output> {
    let input = input_of(entries)?;
    let row = elems(&shape[1..]) * dtype.size();
    let block: Vec<usize> = dims.iter().map(|&d| d as usize * row).collect();
    let mut own = None;
    let out = result_buffer(given_output(entries), block.iter().sum(), &mut own);
    let off: usize = block[..comm.rank()].iter().sum();
    // SAFETY: the front-end keeps the input alive until completion.
    out[off..off + block[comm.rank()]].copy_from_slice(unsafe { input.bytes() });
    if hierarchical && collective::fits(&collective::hosts_of(comm)) {
        collective::allgatherv_hierarchical(comm, out, &block)?;
    } else {
        collective::allgatherv(comm, out, &block)?;
    }
    let mut oshape = shape.to_vec();
    oshape[0] = dims.iter().sum();
    Ok(Output {
        tensor: own.map(|buf| OwnedTensor {
            buf,
            dtype,
            shape: oshape,
        }),
        splits: dims.to_vec(),
        value: 0,
    })
}

/// The output tensor the caller gave for a one-tensor operation, if any.
fn given_output(entries: &[Option<Entry>]) -> Option<&TensorView> {
    entries[0].as_ref().and_then(|e| e.output.as_ref())
}

/// Where a gather, an exchange or a reduce-scatter writes its result of `nbytes`: the
/// caller's output (`given`) when it is of that size (host memory, written in place),
/// else a buffer of the core's own from [`pool::take`] (every byte of it is written),
/// left in `own` for the caller to receive.
pub(super) fn result_buffer<'a>(
    given: Option<&'a TensorView>,
    nbytes: usize,
    own: &'a mut Option<AlignedBuf>,
) -> &'a mut [u8] {
    match given {
        // SAFETY: the front-end keeps the output alive and untouched until completion.
        Some(out) if out.nbytes == nbytes => unsafe { out.bytes_mut() },
        _ => own.insert(pool::take(nbytes)).as_mut_slice(),
    }
}

fn alltoall(
    comm: &dyn Comm,
    shape: &[i64],
    dtype: DataType,
    matrix: &[i64],
    entries: &[Option<Entry>],
) -> Result<Output> {
    let input = input_of(entries)?;
    let (n, r) = (comm.size(), comm.rank());
    let row = elems(&shape[1..]) * dtype.size();
    // SAFETY: the front-end keeps the input alive until completion.
    let inp = unsafe { input.bytes() };
    let send = collective::consecutive((0..n).map(|d| matrix[r * n + d] as usize * row));
    let got: Vec<i64> = (0..n).map(|s| matrix[s * n + r]).collect();
    let recv = collective::consecutive(got.iter().map(|&g| g as usize * row));
    let mut own = None;
    let out = result_buffer(
        given_output(entries),
        recv.last().map_or(0, |x| x.end),
        &mut own,
    );
    collective::alltoallv(comm, inp, &send, out, &recv)?;
    let mut oshape = shape.to_vec();
    oshape[0] = got.iter().sum();
    Ok(Output {
        tensor: own.map(|buf| OwnedTensor {
            buf,
            dtype,
            shape: oshape,
        }),
        splits: got,
        value: 0,
    })
}

/// The factor a reduction's result is scaled by last, on a set of `n`: Average's
/// division by the set's size is folded into the postscale factor.
pub(super) fn post_factor(op: ReduceOp, postscale: f64, n: usize) -> f64 {
    match op {
        ReduceOp::Average => postscale / n as f64,
        _ => postscale,
    }
}

/// A reduce-scatter of `shape` on a set of `n`: the rows of dimension 0 each member
/// gets (Horovod's split: the first `d0 % n` members one more), and the elements of
/// one row.
pub(super) fn scatter_rows(shape: &[i64], n: usize) -> (Vec<usize>, usize) {
    let d0 = shape.first().copied().unwrap_or(1).max(0) as usize;
    let rows = collective::partition(d0, n)
        .iter()
        .map(|p| p.len())
        .collect();
    (rows, elems(shape.get(1..).unwrap_or(&[])))
}

/// The output of a reduce-scatter of `shape` whose member got `rows` rows: the core's
/// own tensor where `own` holds it (else the caller's output was written).
pub(super) fn scattered(
    own: Option<AlignedBuf>,
    dtype: DataType,
    shape: &[i64],
    rows: usize,
) -> Output {
    let mut oshape = if shape.is_empty() {
        vec![1]
    } else {
        shape.to_vec()
    };
    oshape[0] = rows as i64;
    Output {
        tensor: own.map(|buf| OwnedTensor {
            buf,
            dtype,
            shape: oshape,
        }),
        splits: vec![],
        value: 0,
    }
}

fn reducescatter(
    comm: &dyn Comm,
    shape: &[i64],
    dtype: DataType,
    op: ReduceOp,
    (pre, post): (f64, f64),
    entries: &[Option<Entry>],
    bufs: &mut Buffers,
) -> Result<Output> {
    let input = input_of(entries)?;
    let (rows, row_elems) = scatter_rows(shape, comm.size());
    let counts: Vec<usize> = rows.iter().map(|r| r * row_elems).collect();
    // The input stays as it is: the reduction runs on a copy in the fusion buffer, which
    // the engine keeps (a fresh one each call faults every page in again, which costs
    // more than the reduction on a virtual machine).
    // SAFETY: the front-end keeps the input alive until completion.
    let bytes = unsafe { input.bytes() };
    let mut work = std::mem::take(&mut bufs.fusion);
    work.resize(bytes.len());
    work.as_mut_slice().copy_from_slice(bytes);
    scale(work.as_mut_slice(), dtype, pre);
    let reduced = collective::reduce_scatter(comm, work.as_mut_slice(), &counts, dtype, op);
    let mine = match reduced {
        Ok(mine) => mine,
        Err(e) => {
            bufs.fusion = work;
            return Err(e);
        }
    };
    let mut own = None;
    let out = result_buffer(given_output(entries), mine.len(), &mut own);
    out.copy_from_slice(&work.as_slice()[mine]);
    bufs.fusion = work;
    scale(out, dtype, post);
    Ok(scattered(own, dtype, shape, rows[comm.rank()]))
}

#[cfg(test)]
mod tests;
