//! The fused step in host memory. Each parameter's elements are cut into parts, and the
//! parts are shared among threads when the step is large enough to repay starting them.
//! Each part is one pass: gradient, state and weight are read once and written once.

use super::{clip_factor, needs_grad_norm, AdamScalars, Group, LambScalars, Rule, Sgd};
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Elements per part (128 KiB of each float32 array).
const PART: usize = 1 << 15;
/// Elements of a step per thread it runs on: below this a thread costs more to start
/// than it saves.
const PER_THREAD: usize = 1 << 18;
/// Most threads one step uses.
const MAX_THREADS: usize = 8;

/// One parameter's memory, as raw pointers the worker threads share.
struct Memory {
    rule: Rule,
    w: *mut f32,
    g: *const f32,
    s: [*mut f32; 2],
    len: usize,
    step: u64,
}

// SAFETY: the threads touch disjoint element ranges of these arrays (one part each), and
// the caller of `step` keeps the tensors alive and unused by anyone else meanwhile.
unsafe impl Sync for Memory {}
unsafe impl Send for Memory {}

impl Memory {
    /// The weight, gradient and two state arrays over `r` (state arrays the rule does not
    /// keep are empty).
    ///
    /// # Safety
    /// No other live slice may overlap `r` of these arrays.
    #[allow(clippy::type_complexity, clippy::mut_from_ref)]
    unsafe fn range(&self, r: Range<usize>) -> (&mut [f32], &[f32], &mut [f32], &mut [f32]) {
        let n = r.len();
        let state = |p: *mut f32| -> &mut [f32] {
            if p.is_null() {
                &mut []
            } else {
                std::slice::from_raw_parts_mut(p.add(r.start), n)
            }
        };
        (
            std::slice::from_raw_parts_mut(self.w.add(r.start), n),
            std::slice::from_raw_parts(self.g.add(r.start), n),
            state(self.s[0]),
            state(self.s[1]),
        )
    }
}

/// Runs one step over `groups` (already checked by [`super::step`]).
pub(crate) fn step(groups: &[Group]) {
    let params: Vec<Memory> = groups
        .iter()
        .flat_map(|g| {
            g.slots.iter().filter(|s| !s.is_empty()).map(|s| {
                let state = |i: usize| s.state.get(i).map_or(std::ptr::null_mut(), |t| t.ptr);
                Memory {
                    rule: g.rule,
                    w: s.weight.ptr.cast(),
                    g: s.grad.ptr.cast(),
                    s: [state(0).cast(), state(1).cast()],
                    len: s.len(),
                    step: s.step,
                }
            })
        })
        .collect();
    let is_lamb = |p: &Memory| matches!(p.rule, Rule::Lamb(_));
    let wide = wide_vectors();
    let run = |pass: Pass<'_>| for_parts(&params, |i, p, r| part(wide, pass, i, p, r));
    let grad_sq = if needs_grad_norm(groups) {
        run(Pass::Norm).iter().map(|s| s[0]).sum()
    } else {
        0.0
    };
    // Pass 1: SGD and Adam finish; LAMB updates its moments and measures the norms of
    // each weight and update.
    let norms = run(Pass::First { grad_sq });
    if params.iter().any(is_lamb) {
        // Pass 2: LAMB applies its update, scaled by each parameter's trust ratio.
        run(Pass::Second { norms: &norms });
    }
}

/// One pass of a step over the parameters.
#[derive(Clone, Copy)]
enum Pass<'a> {
    /// LAMB's global gradient norm: the sum of squares of every LAMB gradient.
    Norm,
    /// The update (LAMB: its moments and norms), given the global squared norm.
    First { grad_sq: f64 },
    /// LAMB's update, applied with the trust ratio from each parameter's norms.
    Second { norms: &'a [[f64; 2]] },
}

/// Whether this CPU has AVX2: the passes are compiled twice, and the wider version runs
/// where it can (the arithmetic is the same, element by element: no fused multiply-add).
fn wide_vectors() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Runs `pass` over range `r` of parameter `i`.
fn part(wide: bool, pass: Pass<'_>, i: usize, p: &Memory, r: Range<usize>) -> [f64; 2] {
    #[cfg(target_arch = "x86_64")]
    if wide {
        // SAFETY: the CPU has AVX2 (`wide_vectors`).
        return unsafe { part_avx2(pass, i, p, r) };
    }
    let _ = wide;
    part_inline(pass, i, p, r)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn part_avx2(pass: Pass<'_>, i: usize, p: &Memory, r: Range<usize>) -> [f64; 2] {
    part_inline(pass, i, p, r)
}

#[inline(always)]
fn part_inline(pass: Pass<'_>, i: usize, p: &Memory, r: Range<usize>) -> [f64; 2] {
    // SAFETY: parts are disjoint ranges of distinct tensors (checked in `super::check`).
    let (w, g, s0, s1) = unsafe { p.range(r) };
    match (pass, p.rule) {
        (Pass::Norm, Rule::Lamb(_)) => [sum_squares(g), 0.0],
        (Pass::First { .. }, Rule::Sgd(h)) => {
            sgd(&h, p.step == 1, w, g, s0);
            [0.0; 2]
        }
        (Pass::First { .. }, Rule::Adam(h)) => {
            adam(&h.scalars(p.step), h.decoupled, h.maximize, w, g, s0, s1);
            [0.0; 2]
        }
        (Pass::First { grad_sq }, Rule::Lamb(h)) => {
            let clip = clip_factor(grad_sq, h.max_grad_norm);
            lamb_stage1(&h.scalars(p.step), h.adam_w_mode, clip, w, g, s0, s1)
        }
        (Pass::Second { norms }, Rule::Lamb(h)) => {
            let s = h.scalars(p.step);
            let ratio = trust_ratio(h.lr, s.adapt, norms[i]);
            lamb_stage2(&s, h.adam_w_mode, ratio, w, s0, s1);
            [0.0; 2]
        }
        _ => [0.0; 2],
    }
}

/// Runs `f` over every part of every parameter, on as many threads as the step's size
/// repays; returns, per parameter, the sum of what `f` returned for its parts.
fn for_parts<F>(params: &[Memory], f: F) -> Vec<[f64; 2]>
where
    F: Fn(usize, &Memory, Range<usize>) -> [f64; 2] + Sync,
{
    let parts: Vec<(usize, Range<usize>)> = params
        .iter()
        .enumerate()
        .flat_map(|(i, p)| {
            (0..p.len)
                .step_by(PART)
                .map(move |s| (i, s..(s + PART).min(p.len)))
        })
        .collect();
    let total: usize = params.iter().map(|p| p.len).sum();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (total / PER_THREAD).clamp(1, cores.min(MAX_THREADS));
    let sums = Mutex::new(vec![[0.0f64; 2]; params.len()]);
    let next = AtomicUsize::new(0);
    let run = || {
        let mut mine: Vec<(usize, [f64; 2])> = Vec::new();
        loop {
            let k = next.fetch_add(1, Ordering::Relaxed);
            let Some((i, r)) = parts.get(k) else { break };
            let s = f(*i, &params[*i], r.clone());
            if s != [0.0; 2] {
                mine.push((*i, s));
            }
        }
        let mut all = sums.lock().unwrap_or_else(|e| e.into_inner());
        for (i, s) in mine {
            all[i][0] += s[0];
            all[i][1] += s[1];
        }
    };
    if threads == 1 {
        run();
    } else {
        std::thread::scope(|scope| {
            for _ in 1..threads {
                scope.spawn(run);
            }
            run();
        });
    }
    sums.into_inner().unwrap_or_else(|e| e.into_inner())
}

/// LAMB's trust ratio times the learning rate, from the squared norms of the weight and
/// of the update.
fn trust_ratio(lr: f64, adapt: bool, norms: [f64; 2]) -> f32 {
    let (w, u) = (norms[0].sqrt(), norms[1].sqrt());
    if adapt && w > 0.0 && u > 0.0 {
        (lr * (w / u)) as f32
    } else {
        lr as f32
    }
}

/// The sum of squares of `x`, in eight float lanes per block of eight (so it
/// vectorises), added up in double.
#[inline(always)]
fn sum_squares(x: &[f32]) -> f64 {
    let mut lanes = [0.0f32; 8];
    let blocks = x.chunks_exact(8);
    let rest: f64 = blocks.remainder().iter().map(|&v| f64::from(v * v)).sum();
    for b in blocks {
        for (l, v) in lanes.iter_mut().zip(b) {
            *l += v * v;
        }
    }
    lanes.iter().map(|&l| f64::from(l)).sum::<f64>() + rest
}

/// SGD over one range; `mom` is empty without momentum. Each combination of the
/// switches gets its own loop (const parameters), so every loop is branch-free and
/// vectorises.
#[inline(always)]
fn sgd(h: &Sgd, first: bool, w: &mut [f32], g: &[f32], mom: &mut [f32]) {
    let c = SgdScalars {
        lr: h.lr as f32,
        wd: h.weight_decay as f32,
        momentum: h.momentum as f32,
        keep: (1.0 - h.dampening) as f32,
        sign: if h.maximize { -1.0 } else { 1.0 },
    };
    let wd = h.weight_decay != 0.0;
    match (mom.is_empty(), first, h.nesterov, wd) {
        (true, _, _, false) => sgd_loop::<false, false, false, false>(&c, w, g, mom),
        (true, _, _, true) => sgd_loop::<false, false, false, true>(&c, w, g, mom),
        (false, true, false, false) => sgd_loop::<true, true, false, false>(&c, w, g, mom),
        (false, true, false, true) => sgd_loop::<true, true, false, true>(&c, w, g, mom),
        (false, true, true, false) => sgd_loop::<true, true, true, false>(&c, w, g, mom),
        (false, true, true, true) => sgd_loop::<true, true, true, true>(&c, w, g, mom),
        (false, false, false, false) => sgd_loop::<true, false, false, false>(&c, w, g, mom),
        (false, false, false, true) => sgd_loop::<true, false, false, true>(&c, w, g, mom),
        (false, false, true, false) => sgd_loop::<true, false, true, false>(&c, w, g, mom),
        (false, false, true, true) => sgd_loop::<true, false, true, true>(&c, w, g, mom),
    }
}

/// SGD's scalars as float.
struct SgdScalars {
    lr: f32,
    wd: f32,
    momentum: f32,
    /// `1 - dampening`.
    keep: f32,
    /// -1 to maximise.
    sign: f32,
}

#[inline(always)]
fn sgd_loop<const MOM: bool, const FIRST: bool, const NESTEROV: bool, const WD: bool>(
    c: &SgdScalars,
    w: &mut [f32],
    g: &[f32],
    mom: &mut [f32],
) {
    let grad = |w: f32, g: f32| {
        if WD {
            c.sign * g + c.wd * w
        } else {
            c.sign * g
        }
    };
    if !MOM {
        for (w, &g) in w.iter_mut().zip(g) {
            *w -= c.lr * grad(*w, g);
        }
        return;
    }
    for ((w, &g), m) in w.iter_mut().zip(g).zip(mom.iter_mut()) {
        let d = grad(*w, g);
        let b = if FIRST {
            d
        } else {
            c.momentum * *m + c.keep * d
        };
        *m = b;
        let step = if NESTEROV { d + c.momentum * b } else { b };
        *w -= c.lr * step;
    }
}

/// Adam or AdamW over one range, one branch-free loop per case (see [`sgd`]).
#[inline(always)]
fn adam(
    s: &AdamScalars,
    decoupled: bool,
    maximize: bool,
    w: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) {
    let sign = if maximize { -1.0f32 } else { 1.0 };
    // torch's lerp computes from the nearer end: which one depends on the weight only.
    let low = s.beta1c < 0.5;
    match (s.weight_decay != 0.0, decoupled, low) {
        (false, _, true) => adam_loop::<0, true>(s, sign, w, g, m, v),
        (false, _, false) => adam_loop::<0, false>(s, sign, w, g, m, v),
        (true, false, true) => adam_loop::<1, true>(s, sign, w, g, m, v),
        (true, false, false) => adam_loop::<1, false>(s, sign, w, g, m, v),
        (true, true, true) => adam_loop::<2, true>(s, sign, w, g, m, v),
        (true, true, false) => adam_loop::<2, false>(s, sign, w, g, m, v),
    }
}

/// `DECAY`: 0 none, 1 L2 in the gradient (Adam), 2 decoupled (AdamW). `LOW`: the
/// first moment's weight is below one half (torch's lerp then starts from the moment).
#[inline(always)]
fn adam_loop<const DECAY: u8, const LOW: bool>(
    s: &AdamScalars,
    sign: f32,
    w: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) {
    let t = s.beta1c;
    for (((w, &g), m), v) in w.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let mut gi = sign * g;
        let mut wi = *w;
        if DECAY == 2 {
            wi *= s.decay;
        } else if DECAY == 1 {
            gi += s.weight_decay * wi;
        }
        let mi = if LOW {
            *m + t * (gi - *m)
        } else {
            gi - (gi - *m) * (1.0 - t)
        };
        let vi = *v * s.beta2 + s.beta2c * gi * gi;
        *m = mi;
        *v = vi;
        *w = wi - s.step_size * (mi / (vi.sqrt() / s.bias2_sqrt + s.eps));
    }
}

/// LAMB's update for one element from its updated moments.
#[inline(always)]
fn lamb_update(s: &LambScalars, adam_w: bool, w: f32, m: f32, v: f32) -> f32 {
    let u = (m / s.bias1) / ((v / s.bias2).sqrt() + s.eps);
    if adam_w {
        u + s.weight_decay * w
    } else {
        u
    }
}

/// LAMB's first pass over one range: the moments, and the squared norms of the weight
/// and of the update. Blocks of the update go through a small buffer, so that both the
/// update and the sums of squares are plain loops the compiler vectorises.
#[inline(always)]
fn lamb_stage1(
    s: &LambScalars,
    adam_w: bool,
    clip: f32,
    w: &[f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) -> [f64; 2] {
    const BLOCK: usize = 1024;
    let mut u = [0.0f32; BLOCK];
    let mut sums = [0.0f64; 2];
    for (((w, g), m), v) in w
        .chunks(BLOCK)
        .zip(g.chunks(BLOCK))
        .zip(m.chunks_mut(BLOCK))
        .zip(v.chunks_mut(BLOCK))
    {
        let u = &mut u[..w.len()];
        for ((((u, &wi), &g), m), v) in u.iter_mut().zip(w).zip(g).zip(m).zip(v) {
            let mut gi = g / clip;
            if !adam_w {
                gi += s.weight_decay * wi;
            }
            let mi = *m * s.beta1 + s.beta3 * gi;
            let vi = *v * s.beta2 + s.beta2c * gi * gi;
            *m = mi;
            *v = vi;
            *u = lamb_update(s, adam_w, wi, mi, vi);
        }
        sums[0] += sum_squares(w);
        sums[1] += sum_squares(u);
    }
    sums
}

/// LAMB's second pass over one range: the update, recomputed, applied at `ratio`.
#[inline(always)]
fn lamb_stage2(s: &LambScalars, adam_w: bool, ratio: f32, w: &mut [f32], m: &[f32], v: &[f32]) {
    for ((w, &m), &v) in w.iter_mut().zip(m).zip(v) {
        *w -= ratio * lamb_update(s, adam_w, *w, m, v);
    }
}
