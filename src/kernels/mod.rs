//! Element-wise kernels on byte buffers: reduce one buffer into another, and
//! scale a buffer by a factor. Buffers are raw bytes tagged with a
//! [`DataType`]; each kernel casts them to typed slices once and runs a plain
//! loop the compiler vectorises. Half types go through `f32` in blocks.

pub mod adasum;
mod aligned;
pub mod clock;
mod convert;
pub mod dgc;
pub mod pool;
mod stream;

pub use aligned::AlignedBuf;
pub use convert::{first_nonfinite, from_half, reduce_half_into, round_through_half, to_half};
pub use stream::{copy_result, copy_streaming, STREAM_FROM};

use crate::dtype::{DataType, ReduceOp};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Elements of a half-precision block converted to `f32` at a time.
const HALF_BLOCK: usize = 1024;

/// Views `bytes` as a typed slice; `None` when the address is misaligned.
fn typed<T>(bytes: &[u8]) -> Option<&[T]> {
    // SAFETY: every element type used here is plain data valid for any bits.
    let (pre, mid, post) = unsafe { bytes.align_to::<T>() };
    (pre.is_empty() && post.is_empty()).then_some(mid)
}

/// Mutable counterpart of [`typed`].
fn typed_mut<T>(bytes: &mut [u8]) -> Option<&mut [T]> {
    // SAFETY: as in `typed`.
    let (pre, mid, post) = unsafe { bytes.align_to_mut::<T>() };
    (pre.is_empty() && post.is_empty()).then_some(mid)
}

/// Runs `f` on aligned copies when either buffer is misaligned (rare: framework
/// allocators align), writing `dst` back afterwards.
fn with_aligned(dst: &mut [u8], src: &[u8], f: impl Fn(&mut [u8], &[u8])) {
    let mut d = AlignedBuf::from_slice(dst);
    let s = AlignedBuf::from_slice(src);
    f(d.as_mut_slice(), s.as_slice());
    dst.copy_from_slice(d.as_slice());
}

macro_rules! int_reduce {
    ($t:ty, $dst:expr, $src:expr, $op:expr) => {{
        let d = typed_mut::<$t>($dst).expect("aligned");
        let s = typed::<$t>($src).expect("aligned");
        match $op {
            ReduceOp::Sum | ReduceOp::Average => d
                .iter_mut()
                .zip(s)
                .for_each(|(a, b)| *a = a.wrapping_add(*b)),
            ReduceOp::Product => d
                .iter_mut()
                .zip(s)
                .for_each(|(a, b)| *a = a.wrapping_mul(*b)),
            ReduceOp::Min => d.iter_mut().zip(s).for_each(|(a, b)| *a = (*a).min(*b)),
            ReduceOp::Max => d.iter_mut().zip(s).for_each(|(a, b)| *a = (*a).max(*b)),
            ReduceOp::Adasum => unreachable!("Adasum is combined by kernels::adasum"),
        }
    }};
}

/// Applies `op` element-wise on floats; NaN in either operand propagates.
fn float_reduce<T>(d: &mut [T], s: &[T], op: ReduceOp)
where
    T: Copy + PartialOrd + std::ops::Add<Output = T> + std::ops::Mul<Output = T>,
{
    match op {
        ReduceOp::Sum | ReduceOp::Average => d.iter_mut().zip(s).for_each(|(a, b)| *a = *a + *b),
        ReduceOp::Product => d.iter_mut().zip(s).for_each(|(a, b)| *a = *a * *b),
        ReduceOp::Min => d.iter_mut().zip(s).for_each(|(a, b)| {
            if *b < *a || b.partial_cmp(b).is_none() {
                *a = *b
            }
        }),
        ReduceOp::Max => d.iter_mut().zip(s).for_each(|(a, b)| {
            if *b > *a || b.partial_cmp(b).is_none() {
                *a = *b
            }
        }),
        ReduceOp::Adasum => unreachable!("Adasum is combined by kernels::adasum"),
    }
}

/// Reduces half-precision slices through `f32` blocks.
fn half_reduce<H>(d: &mut [H], s: &[H], op: ReduceOp)
where
    [H]: HalfFloatSliceExt,
{
    let mut fd = [0f32; HALF_BLOCK];
    let mut fs = [0f32; HALF_BLOCK];
    for (dc, sc) in d.chunks_mut(HALF_BLOCK).zip(s.chunks(HALF_BLOCK)) {
        let n = dc.len();
        dc.convert_to_f32_slice(&mut fd[..n]);
        sc.convert_to_f32_slice(&mut fs[..n]);
        float_reduce(&mut fd[..n], &fs[..n], op);
        dc.convert_from_f32_slice(&fd[..n]);
    }
}

/// `dst[i] = op(dst[i], src[i])` for every element. `dst` and `src` hold the
/// same number of bytes, a multiple of the element size. Average sums: the
/// division by the number of ranks is a postscale.
pub fn reduce_into(dst: &mut [u8], src: &[u8], dtype: DataType, op: ReduceOp) {
    clock::timed(|| reduce_untimed(dst, src, dtype, op))
}

fn reduce_untimed(dst: &mut [u8], src: &[u8], dtype: DataType, op: ReduceOp) {
    assert_eq!(dst.len(), src.len(), "reduce_into: buffer lengths differ");
    let align = dtype.size();
    if (dst.as_ptr() as usize) % align != 0 || (src.as_ptr() as usize) % align != 0 {
        return with_aligned(dst, src, |d, s| reduce_untimed(d, s, dtype, op));
    }
    match dtype {
        DataType::U8 => int_reduce!(u8, dst, src, op),
        DataType::I8 => int_reduce!(i8, dst, src, op),
        DataType::I16 => int_reduce!(i16, dst, src, op),
        DataType::U16 => int_reduce!(u16, dst, src, op),
        DataType::I32 => int_reduce!(i32, dst, src, op),
        DataType::I64 => int_reduce!(i64, dst, src, op),
        DataType::F32 => float_reduce(
            typed_mut::<f32>(dst).expect("aligned"),
            typed::<f32>(src).expect("aligned"),
            op,
        ),
        DataType::F64 => float_reduce(
            typed_mut::<f64>(dst).expect("aligned"),
            typed::<f64>(src).expect("aligned"),
            op,
        ),
        DataType::F16 => half_reduce(
            typed_mut::<f16>(dst).expect("aligned"),
            typed::<f16>(src).expect("aligned"),
            op,
        ),
        DataType::BF16 => half_reduce(
            typed_mut::<bf16>(dst).expect("aligned"),
            typed::<bf16>(src).expect("aligned"),
            op,
        ),
        DataType::Bool => {
            let any = matches!(op, ReduceOp::Sum | ReduceOp::Average | ReduceOp::Max);
            dst.iter_mut().zip(src).for_each(|(a, b)| {
                let (x, y) = (*a != 0, *b != 0);
                *a = u8::from(if any { x || y } else { x && y });
            })
        }
    }
}

macro_rules! int_scale {
    ($t:ty, $buf:expr, $factor:expr) => {{
        let b = typed_mut::<$t>($buf).expect("aligned");
        b.iter_mut().for_each(|x| *x = (*x as f64 * $factor) as $t);
    }};
}

/// Multiplies every element by `factor`. Integers are scaled in `f64` and
/// truncated toward zero (saturating), as Horovod does. Booleans are left as
/// they are. A factor of exactly 1 is a no-op.
pub fn scale(buf: &mut [u8], dtype: DataType, factor: f64) {
    if factor == 1.0 || buf.is_empty() {
        return;
    }
    if (buf.as_ptr() as usize) % dtype.size() != 0 {
        let mut a = AlignedBuf::from_slice(buf);
        scale(a.as_mut_slice(), dtype, factor);
        buf.copy_from_slice(a.as_slice());
        return;
    }
    match dtype {
        DataType::U8 => int_scale!(u8, buf, factor),
        DataType::I8 => int_scale!(i8, buf, factor),
        DataType::I16 => int_scale!(i16, buf, factor),
        DataType::U16 => int_scale!(u16, buf, factor),
        DataType::I32 => int_scale!(i32, buf, factor),
        DataType::I64 => int_scale!(i64, buf, factor),
        DataType::F32 => {
            let f = factor as f32;
            typed_mut::<f32>(buf)
                .expect("aligned")
                .iter_mut()
                .for_each(|x| *x *= f)
        }
        DataType::F64 => typed_mut::<f64>(buf)
            .expect("aligned")
            .iter_mut()
            .for_each(|x| *x *= factor),
        DataType::F16 => half_scale(typed_mut::<f16>(buf).expect("aligned"), factor as f32),
        DataType::BF16 => half_scale(typed_mut::<bf16>(buf).expect("aligned"), factor as f32),
        DataType::Bool => {}
    }
}

/// `dst = src * factor` in one pass (a copy when the factor is 1); same
/// lengths and element type. Saves a pass over a copy followed by [`scale`].
pub fn copy_scaled(dst: &mut [u8], src: &[u8], dtype: DataType, factor: f64) {
    assert_eq!(dst.len(), src.len(), "copy_scaled: lengths differ");
    if factor != 1.0 && dtype == DataType::F32 {
        if let (Some(d), Some(s)) = (typed_mut::<f32>(dst), typed::<f32>(src)) {
            let f = factor as f32;
            d.iter_mut().zip(s).for_each(|(d, s)| *d = s * f);
            return;
        }
    }
    dst.copy_from_slice(src);
    scale(dst, dtype, factor);
}

fn half_scale<H>(b: &mut [H], f: f32)
where
    [H]: HalfFloatSliceExt,
{
    let mut tmp = [0f32; HALF_BLOCK];
    for c in b.chunks_mut(HALF_BLOCK) {
        let n = c.len();
        c.convert_to_f32_slice(&mut tmp[..n]);
        tmp[..n].iter_mut().for_each(|x| *x *= f);
        c.convert_from_f32_slice(&tmp[..n]);
    }
}

#[cfg(test)]
mod tests;
