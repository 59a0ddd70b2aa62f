//! A copy whose stores bypass the cache. A plain copy into memory that is
//! not in cache first reads every destination line (write-allocate), then
//! writes it back: three bytes of memory traffic for each byte copied. With
//! non-temporal stores the destination is only written: two. Worth it only
//! for results too large to stay in cache anyway; the caller decides that.

/// Results of at least this many bytes are written past the cache: a result
/// this large leaves the cache before anyone reads it, and not fetching its
/// lines first saves a third of the copy's memory traffic (1.1-1.25x faster
/// allreduce from 16 MiB on 2 and 3 ranks here, 1.3-1.5x broadcast). Below
/// it, the result stays in cache for its reader, which gains more: streaming
/// made an 8 MiB allreduce followed by a read 1.4x slower.
pub const STREAM_FROM: usize = 16 << 20;

/// Copies `src` into `dst` (equal lengths), written past the cache when the
/// result is at least [`STREAM_FROM`] bytes.
pub fn copy_result(dst: &mut [u8], src: &[u8]) {
    if dst.len() >= STREAM_FROM {
        copy_streaming(dst, src);
    } else {
        dst.copy_from_slice(src);
    }
}

/// Pieces shorter than this are copied plainly: the fence and the alignment
/// head cost more than the traffic saved.
const STREAM_MIN: usize = 4 << 10;

/// Copies `src` into `dst` (equal lengths) with non-temporal stores where
/// the target has them, then fences, so the bytes are visible to any thread
/// that synchronises with this one afterwards.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: lengths differ");
    if dst.len() < STREAM_MIN {
        dst.copy_from_slice(src);
        return;
    }
    stream(dst, src);
}

#[cfg(target_arch = "x86_64")]
fn stream(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    const LANE: usize = 16;
    // A head up to the first 16-byte boundary of `dst`, copied plainly.
    let head = dst.as_ptr().align_offset(LANE).min(dst.len());
    dst[..head].copy_from_slice(&src[..head]);
    let body = (dst.len() - head) / (4 * LANE) * (4 * LANE);
    // SAFETY: SSE2 is part of x86_64. Every pointer stays inside `dst` or
    // `src` (`head + body <= len`), and every store address is 16-byte
    // aligned (`dst + head` is, and steps are multiples of 16).
    unsafe {
        let mut s = src.as_ptr().add(head);
        let mut d = dst.as_mut_ptr().add(head);
        let end = d.add(body);
        while d < end {
            for k in 0..4 {
                let v = _mm_loadu_si128(s.add(k * LANE) as *const __m128i);
                _mm_stream_si128(d.add(k * LANE) as *mut __m128i, v);
            }
            s = s.add(4 * LANE);
            d = d.add(4 * LANE);
        }
        _mm_sfence();
    }
    dst[head + body..].copy_from_slice(&src[head + body..]);
}

#[cfg(not(target_arch = "x86_64"))]
fn stream(dst: &mut [u8], src: &[u8]) {
    dst.copy_from_slice(src);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_byte_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..70_000u32).map(|i| (i * 7 % 251) as u8).collect();
        for len in [0, 1, 4095, 4096, 4097, 4160, 65_537] {
            for d_off in [0, 1, 8, 15] {
                for s_off in [0, 3, 16] {
                    let mut dst = vec![0xAAu8; len + 32];
                    copy_streaming(&mut dst[d_off..d_off + len], &src[s_off..s_off + len]);
                    assert_eq!(&dst[d_off..d_off + len], &src[s_off..s_off + len]);
                    assert!(
                        dst[..d_off].iter().all(|&b| b == 0xAA),
                        "before {len} {d_off}"
                    );
                    assert!(
                        dst[d_off + len..].iter().all(|&b| b == 0xAA),
                        "after {len} {d_off}"
                    );
                }
            }
        }
    }
}
