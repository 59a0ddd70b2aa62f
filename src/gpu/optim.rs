//! The fused optimizer step on a CUDA device: the `optimizers` kernels, one launch per
//! kernel for every parameter of the step (multi-tensor: a table of arguments, one row
//! per parameter, and a map of the blocks to chunks of them), queued in order on
//! Perseus's stream of the device. The front-end makes that stream wait for the
//! framework's before the step and the framework's wait for it after (events: no host or
//! device-wide sync).

use super::runtime::{CudaDevice, DeviceBuffer};
use crate::device::optim::{needs_grad_norm, Group, LambScalars, Rule, Slot};
use crate::error::Result;
use cudarc::driver::sys;
use std::ffi::c_void;

/// Elements per block of a multi-tensor launch (`CHUNK` in the kernel source).
const CHUNK: u64 = 4096;

// The argument rows, field for field the structs of the `optimizers` source (C layout:
// the pointers and counts first, then the 4-byte fields, padded to 8 bytes).

/// A row of the `sgd` kernel's table.
#[repr(C)]
#[derive(Clone, Copy)]
struct SgdArgs {
    w: u64,
    g: u64,
    mom: u64,
    n: u64,
    lr: f32,
    momentum: f32,
    keep: f32,
    weight_decay: f32,
    nesterov: i32,
    maximize: i32,
    first: i32,
    pad: i32,
}

/// A row of the `adam` kernel's table.
#[repr(C)]
#[derive(Clone, Copy)]
struct AdamArgs {
    w: u64,
    g: u64,
    m: u64,
    v: u64,
    n: u64,
    beta1c: f32,
    beta2: f32,
    beta2c: f32,
    eps: f32,
    weight_decay: f32,
    decay: f32,
    step_size: f32,
    bias2_sqrt: f32,
    decoupled: i32,
    maximize: i32,
}

/// A row of the `sum_squares` kernel's table.
#[repr(C)]
#[derive(Clone, Copy)]
struct SumSquaresArgs {
    x: u64,
    n: u64,
}

/// A row of the `lamb_stage1` kernel's table.
#[repr(C)]
#[derive(Clone, Copy)]
struct Lamb1Args {
    w: u64,
    g: u64,
    m: u64,
    v: u64,
    grad_sq: u64,
    n: u64,
    max_grad_norm: f32,
    beta1: f32,
    beta3: f32,
    beta2: f32,
    beta2c: f32,
    eps: f32,
    wd: f32,
    bias1: f32,
    bias2: f32,
    adam_w: i32,
}

/// A row of the `lamb_stage2` kernel's table.
#[repr(C)]
#[derive(Clone, Copy)]
struct Lamb2Args {
    w: u64,
    m: u64,
    v: u64,
    norms: u64,
    n: u64,
    lr: f32,
    eps: f32,
    wd: f32,
    bias1: f32,
    bias2: f32,
    adapt: i32,
    adam_w: i32,
    pad: i32,
}

/// The block map of a multi-tensor launch over parameters of `lens` elements: block `b`
/// takes chunk `map[b] & 0xffff_ffff` of parameter `map[b] >> 32`.
fn block_map(lens: impl Iterator<Item = u64>) -> Vec<u64> {
    lens.enumerate()
        .flat_map(|(i, n)| (0..n.div_ceil(CHUNK)).map(move |c| ((i as u64) << 32) | c))
        .collect()
}

/// Launches `kernel` of the `optimizers` source once over every row of `table` (`lens`:
/// each row's element count): the table and the block map go to device memory (freed,
/// stream-ordered, after the launch), then one block per chunk. `partials`: the device
/// floats the kernel writes its per-block sums to, for the kernels that take them.
///
/// # Safety
/// `T` must be the kernel's argument struct, and the rows must name device memory the
/// step may use; `partials` must hold as many floats per block as the kernel writes.
unsafe fn launch<T: Copy>(
    dev: &CudaDevice,
    kernel: &'static str,
    table: &[T],
    lens: impl Iterator<Item = u64>,
    partials: Option<sys::CUdeviceptr>,
) -> Result<()> {
    let map = block_map(lens);
    if map.is_empty() {
        return Ok(());
    }
    let f = dev.kernel("optimizers", kernel)?;
    let table_bytes = std::mem::size_of_val(table).next_multiple_of(8);
    let mem = DeviceBuffer::new(dev, table_bytes + std::mem::size_of_val(&map[..]))?;
    mem.write(0, table)?;
    mem.write(table_bytes, &map[..])?;
    let (mut t, mut m, mut p) = (mem.ptr, mem.ptr + table_bytes as u64, partials.unwrap_or(0));
    let mut params: Vec<*mut c_void> =
        vec![(&mut t as *mut u64).cast(), (&mut m as *mut u64).cast()];
    if partials.is_some() {
        params.push((&mut p as *mut u64).cast());
    }
    dev.launch_blocks(f, map.len() as u32, &mut params)
}

fn ptr(t: &crate::device::TensorView) -> u64 {
    t.ptr as u64
}

/// Queues one step over `groups` (checked by the optimizer step; every tensor on
/// device `ordinal`) on Perseus's stream of the device.
pub fn step(ordinal: i32, groups: &[Group]) -> Result<()> {
    let dev = CudaDevice::get(ordinal)?;
    // A caller's thread: its own context (the framework's device) is current again
    // once this returns.
    let _current = dev.enter()?;
    // Device floats for LAMB: [0] the global squared gradient norm, then the squared
    // norms of the weight and of the update of each LAMB parameter (freed, stream-ordered,
    // after the kernels reading them).
    let lamb: usize = groups
        .iter()
        .filter(|g| matches!(g.rule, Rule::Lamb(_)))
        .map(|g| g.slots.len())
        .sum();
    let norms = match lamb {
        0 => None,
        _ => Some(DeviceBuffer::zeroed(&dev, 4 * (1 + 2 * lamb))?),
    };
    // SAFETY: the tensors are the caller's (alive, on this device, not shared); `norms`
    // holds `1 + 2 * lamb` floats.
    unsafe { queue(&dev, groups, norms.as_ref().map_or(0, |b| b.ptr)) }
}

/// The rows of one multi-tensor launch and each row's element count.
struct Table<T> {
    rows: Vec<T>,
    lens: Vec<u64>,
}

impl<T: Copy> Table<T> {
    fn new() -> Table<T> {
        Table {
            rows: Vec::new(),
            lens: Vec::new(),
        }
    }

    fn push(&mut self, row: T, s: &Slot) {
        self.rows.push(row);
        self.lens.push(s.len() as u64);
    }

    /// Launches `kernel` over every row.
    ///
    /// # Safety
    /// As for [`launch`].
    unsafe fn launch(
        &self,
        dev: &CudaDevice,
        kernel: &'static str,
        partials: Option<sys::CUdeviceptr>,
    ) -> Result<()> {
        launch(dev, kernel, &self.rows, self.lens.iter().copied(), partials)
    }

    /// The blocks of a launch over these rows, and where each row's begin: row `j`'s
    /// are `seg[j]..seg[j + 1]`.
    fn segments(&self) -> Vec<u32> {
        let mut seg = vec![0u32];
        for n in &self.lens {
            seg.push(seg[seg.len() - 1] + n.div_ceil(CHUNK) as u32);
        }
        seg
    }
}

/// The launches of one step, in order: one for the SGD parameters, one for the Adam ones,
/// then LAMB's: the global gradient norm, the first stage with each parameter's norms,
/// the second stage.
///
/// # Safety
/// As for [`step`]; `norms` holds one float plus two per LAMB parameter.
unsafe fn queue(dev: &CudaDevice, groups: &[Group], norms: sys::CUdeviceptr) -> Result<()> {
    let (mut sgd, mut adam, mut squares) = (Table::new(), Table::new(), Table::new());
    let (mut stage1, mut stage2) = (Table::new(), Table::new());
    // LAMB's pair of norms for its k-th parameter.
    let pair = |k: usize| norms + 4 * (1 + 2 * k as u64);
    for g in groups {
        for s in &g.slots {
            match g.rule {
                Rule::Sgd(h) => sgd.push(sgd_row(&h, s), s),
                Rule::Adam(h) => adam.push(adam_row(&h, s), s),
                Rule::Lamb(h) => {
                    let c = h.scalars(s.step);
                    let k = stage1.rows.len();
                    let n = s.len() as u64;
                    squares.push(SumSquaresArgs { x: ptr(&s.grad), n }, s);
                    stage1.push(lamb1_row(&c, &h, norms, s), s);
                    stage2.push(lamb2_row(&c, h.lr as f32, h.adam_w_mode, pair(k), s), s);
                }
            }
        }
    }
    sgd.launch(dev, "sgd", None)?;
    adam.launch(dev, "adam", None)?;
    if stage1.rows.is_empty() {
        return Ok(());
    }
    // Two floats per block of a LAMB launch, gathered in a fixed order by sum_segments:
    // every rank computes the same norms from the same values, bit for bit. Then the
    // segments: each parameter's blocks, and all of them (for the gradient norm).
    let seg = stage1.segments();
    let blocks = seg[seg.len() - 1];
    let partial_bytes = 8 * (blocks as usize).max(1);
    let scratch = DeviceBuffer::new(dev, partial_bytes + 4 * seg.len() + 8)?;
    let partials = scratch.ptr;
    let (each, all) = (partial_bytes, partial_bytes + 4 * seg.len());
    scratch.write(each, &seg[..])?;
    scratch.write(all, &[0, blocks])?;
    let at = |offset: usize| scratch.ptr + offset as u64;
    if needs_grad_norm(groups) {
        squares.launch(dev, "sum_squares", Some(partials))?;
        sum_segments(dev, partials, at(all), 1, 1, norms)?;
    }
    stage1.launch(dev, "lamb_stage1", Some(partials))?;
    sum_segments(dev, partials, at(each), seg.len() - 1, 2, pair(0))?;
    stage2.launch(dev, "lamb_stage2", None)
}

/// Queues `sum_segments`: `out[j * width + c]`, for each of the `segments` (their block
/// ranges at `seg`, as `segments + 1` boundaries), becomes the sum of the `partials` of
/// its blocks.
///
/// # Safety
/// The pointers must be this device's memory, as many floats as the segments name.
unsafe fn sum_segments(
    dev: &CudaDevice,
    partials: u64,
    seg: u64,
    segments: usize,
    width: i32,
    out: u64,
) -> Result<()> {
    let f = dev.kernel("optimizers", "sum_segments")?;
    let (mut p, mut at, mut w, mut o) = (partials, seg, width, out);
    let mut params: [*mut c_void; 4] = [
        (&mut p as *mut u64).cast(),
        (&mut at as *mut u64).cast(),
        (&mut w as *mut i32).cast(),
        (&mut o as *mut u64).cast(),
    ];
    dev.launch_blocks(f, segments as u32, &mut params)
}

/// LAMB's first-stage row of one parameter (`norms`: the global squared gradient norm,
/// read when it clips).
fn lamb1_row(c: &LambScalars, h: &crate::device::optim::Lamb, norms: u64, s: &Slot) -> Lamb1Args {
    Lamb1Args {
        w: ptr(&s.weight),
        g: ptr(&s.grad),
        m: ptr(&s.state[0]),
        v: ptr(&s.state[1]),
        grad_sq: if h.max_grad_norm > 0.0 { norms } else { 0 },
        n: s.len() as u64,
        max_grad_norm: h.max_grad_norm as f32,
        beta1: c.beta1,
        beta3: c.beta3,
        beta2: c.beta2,
        beta2c: c.beta2c,
        eps: c.eps,
        wd: c.weight_decay,
        bias1: c.bias1,
        bias2: c.bias2,
        adam_w: i32::from(h.adam_w_mode),
    }
}

/// The SGD row of one parameter.
fn sgd_row(h: &crate::device::optim::Sgd, s: &Slot) -> SgdArgs {
    SgdArgs {
        w: ptr(&s.weight),
        g: ptr(&s.grad),
        mom: s.state.first().map_or(0, ptr),
        n: s.len() as u64,
        lr: h.lr as f32,
        momentum: h.momentum as f32,
        keep: (1.0 - h.dampening) as f32,
        weight_decay: h.weight_decay as f32,
        nesterov: i32::from(h.nesterov),
        maximize: i32::from(h.maximize),
        first: i32::from(s.step == 1),
        pad: 0,
    }
}

/// The Adam (or AdamW) row of one parameter.
fn adam_row(h: &crate::device::optim::Adam, s: &Slot) -> AdamArgs {
    let c = h.scalars(s.step);
    AdamArgs {
        w: ptr(&s.weight),
        g: ptr(&s.grad),
        m: ptr(&s.state[0]),
        v: ptr(&s.state[1]),
        n: s.len() as u64,
        beta1c: c.beta1c,
        beta2: c.beta2,
        beta2c: c.beta2c,
        eps: c.eps,
        weight_decay: c.weight_decay,
        decay: c.decay,
        step_size: c.step_size,
        bias2_sqrt: c.bias2_sqrt,
        decoupled: i32::from(h.decoupled),
        maximize: i32::from(h.maximize),
    }
}

/// LAMB's second-stage row of one parameter.
fn lamb2_row(c: &LambScalars, lr: f32, adam_w: bool, norms: u64, s: &Slot) -> Lamb2Args {
    Lamb2Args {
        w: ptr(&s.weight),
        m: ptr(&s.state[0]),
        v: ptr(&s.state[1]),
        norms,
        n: s.len() as u64,
        lr,
        eps: c.eps,
        wd: c.weight_decay,
        bias1: c.bias1,
        bias2: c.bias2,
        adapt: i32::from(c.adapt),
        adam_w: i32::from(adam_w),
        pad: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_block_map_covers_each_parameter_chunk_by_chunk() {
        let map = block_map([1, 0, CHUNK, CHUNK + 1, 3 * CHUNK].into_iter());
        let want: Vec<(u64, u64)> = vec![(0, 0), (2, 0), (3, 0), (3, 1), (4, 0), (4, 1), (4, 2)];
        let got: Vec<(u64, u64)> = map.iter().map(|m| (m >> 32, m & 0xffff_ffff)).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn the_rows_have_the_kernels_c_layout() {
        // Pointers and counts (8 bytes each) first, then 4-byte fields, padded to 8.
        assert_eq!(std::mem::size_of::<SgdArgs>(), 4 * 8 + 8 * 4);
        assert_eq!(std::mem::size_of::<AdamArgs>(), 5 * 8 + 10 * 4);
        assert_eq!(std::mem::size_of::<SumSquaresArgs>(), 2 * 8);
        assert_eq!(std::mem::size_of::<Lamb1Args>(), 6 * 8 + 10 * 4);
        assert_eq!(std::mem::size_of::<Lamb2Args>(), 5 * 8 + 8 * 4);
        assert_eq!(std::mem::offset_of!(AdamArgs, decoupled), 5 * 8 + 8 * 4);
    }
}
