//! float32 ↔ float16 conversion for compressed allreduces: scaled casts,
//! reducing float16 into float32, rounding through float16, and finding
//! non-finite values. Buffers are raw bytes; float16 ones hold half as many
//! bytes as the float32 ones they mirror. Blocks go through `half`'s slice
//! conversions, which use the CPU's F16C instructions where present.

use super::{typed, typed_mut, AlignedBuf, HALF_BLOCK};
use crate::dtype::{DataType, ReduceOp};
use half::f16;
use half::slice::HalfFloatSliceExt;

fn f32s(b: &[u8]) -> std::borrow::Cow<'_, [f32]> {
    match typed::<f32>(b) {
        Some(s) => s.into(),
        None => b
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
            .collect::<Vec<_>>()
            .into(),
    }
}

fn with_aligned_out(dst: &mut [u8], f: impl FnOnce(&mut [u8])) {
    if (dst.as_ptr() as usize) % 4 == 0 {
        return f(dst);
    }
    let mut a = AlignedBuf::from_slice(dst);
    f(a.as_mut_slice());
    dst.copy_from_slice(a.as_slice());
}

/// `dst[i] = f16(src[i] * factor)`: `src` float32, `dst` float16 of half its length.
pub fn to_half(dst: &mut [u8], src: &[u8], factor: f64) {
    assert_eq!(dst.len() * 2, src.len(), "to_half: lengths do not match");
    let src = f32s(src);
    let f = factor as f32;
    with_aligned_out(dst, |dst| {
        let d = typed_mut::<f16>(dst).expect("aligned");
        let mut tmp = [0f32; HALF_BLOCK];
        for (dc, sc) in d.chunks_mut(HALF_BLOCK).zip(src.chunks(HALF_BLOCK)) {
            let n = dc.len();
            if f == 1.0 {
                dc.convert_from_f32_slice(sc);
            } else {
                tmp[..n].iter_mut().zip(sc).for_each(|(t, s)| *t = s * f);
                dc.convert_from_f32_slice(&tmp[..n]);
            }
        }
    });
}

/// Runs `f` on each float32 block of `dst` with the matching float16 block of
/// `src` already converted into `tmp`.
fn half_blocks(dst: &mut [u8], src: &[u8], f: impl Fn(&mut [f32], &[f32])) {
    assert_eq!(
        dst.len(),
        src.len() * 2,
        "float16 and float32 lengths differ"
    );
    let s16: Vec<f16>;
    let src = match typed::<f16>(src) {
        Some(s) => s,
        None => {
            s16 = src
                .chunks_exact(2)
                .map(|c| f16::from_ne_bytes([c[0], c[1]]))
                .collect();
            &s16
        }
    };
    with_aligned_out(dst, |dst| {
        let d = typed_mut::<f32>(dst).expect("aligned");
        let mut tmp = [0f32; HALF_BLOCK];
        for (dc, sc) in d.chunks_mut(HALF_BLOCK).zip(src.chunks(HALF_BLOCK)) {
            let n = dc.len();
            sc.convert_to_f32_slice(&mut tmp[..n]);
            f(dc, &tmp[..n]);
        }
    });
}

/// `dst[i] = f32(src[i]) * factor`: `src` float16, `dst` float32 of twice its length.
pub fn from_half(dst: &mut [u8], src: &[u8], factor: f64) {
    let f = factor as f32;
    half_blocks(dst, src, |d, s| {
        if f == 1.0 {
            d.copy_from_slice(s)
        } else {
            d.iter_mut().zip(s).for_each(|(d, s)| *d = s * f)
        }
    });
}

/// `dst[i] = op(dst[i], f32(src[i]))`: `dst` float32, `src` float16.
pub fn reduce_half_into(dst: &mut [u8], src: &[u8], op: ReduceOp) {
    half_blocks(dst, src, |d, s| {
        let bytes_d = bytes_of_mut(d);
        super::reduce_into(bytes_d, bytes_of(s), DataType::F32, op)
    });
}

fn bytes_of(s: &[f32]) -> &[u8] {
    // SAFETY: f32 is plain data; the byte view covers exactly the slice.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast(), std::mem::size_of_val(s)) }
}

fn bytes_of_mut(s: &mut [f32]) -> &mut [u8] {
    // SAFETY: as above; every bit pattern is a valid f32.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast(), std::mem::size_of_val(s)) }
}

/// Rounds every float32 element of `buf` to the nearest float16 value (kept as float32).
pub fn round_through_half(buf: &mut [u8]) {
    with_aligned_out(buf, |buf| {
        let d = typed_mut::<f32>(buf).expect("aligned");
        let mut tmp = [f16::ZERO; HALF_BLOCK];
        for c in d.chunks_mut(HALF_BLOCK) {
            let n = c.len();
            tmp[..n].convert_from_f32_slice(c);
            tmp[..n].convert_to_f32_slice(c);
        }
    });
}

/// Index of the first NaN or infinite element of a float16 or float32 buffer.
pub fn first_nonfinite(buf: &[u8], dtype: DataType) -> Option<usize> {
    match dtype {
        DataType::F16 => {
            let copy: Vec<u16>;
            let bits = match typed::<u16>(buf) {
                Some(b) => b,
                None => {
                    copy = buf
                        .chunks_exact(2)
                        .map(|c| u16::from_ne_bytes([c[0], c[1]]))
                        .collect();
                    &copy
                }
            };
            // Exponent bits all ones: infinity or NaN.
            first_block(bits, |b| b & 0x7c00 == 0x7c00)
        }
        DataType::F32 => first_block(&f32s(buf), |x| !x.is_finite()),
        _ => None,
    }
}

/// Scans blocks with a branch-free test first, so the common all-finite case vectorises.
fn first_block<T: Copy>(v: &[T], bad: impl Fn(T) -> bool + Copy) -> Option<usize> {
    for (b, chunk) in v.chunks(HALF_BLOCK).enumerate() {
        if chunk.iter().fold(false, |acc, &x| acc | bad(x)) {
            let i = chunk.iter().position(|&x| bad(x)).unwrap_or(0);
            return Some(b * HALF_BLOCK + i);
        }
    }
    None
}
