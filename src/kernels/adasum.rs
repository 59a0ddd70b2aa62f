//! Adasum, Horovod's adaptive summation of gradients (Maleki et al., "Scaling
//! Distributed Training with Adaptive Summation", MLSys 2021): two gradients
//! `a` and `b` combine as
//!
//! ```text
//! (1 - a·b / (2 |a|²)) a + (1 - a·b / (2 |b|²)) b
//! ```
//!
//! so orthogonal gradients add up and parallel ones average. The ranks'
//! tensors combine pairwise in rank order, level by level: (0, 1), (2, 3), ...,
//! then those results in pairs, and so on (with a number of ranks that is not a
//! power of two, the last of an odd level goes up alone). For a power of two
//! this is the order of Horovod's recursive halving. Every rank computes the
//! same tree from the same inputs, so all get identical bits. Dot products,
//! norms and the sums run in `f64`.

use crate::dtype::DataType;
use half::{bf16, f16};

/// The values of a floating-point `dtype` buffer as `f64`; `None` for other
/// element types.
pub fn to_f64(bytes: &[u8], dtype: DataType) -> Option<Vec<f64>> {
    let values = match dtype {
        DataType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes(c.try_into().expect("4 bytes")) as f64)
            .collect(),
        DataType::F64 => bytes
            .chunks_exact(8)
            .map(|c| f64::from_ne_bytes(c.try_into().expect("8 bytes")))
            .collect(),
        DataType::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_ne_bytes([c[0], c[1]])).to_f64())
            .collect(),
        DataType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_ne_bytes([c[0], c[1]])).to_f64())
            .collect(),
        _ => return None,
    };
    Some(values)
}

/// Writes `values` times `factor` into `dst` as `dtype` (floating types only).
pub fn write_f64(dst: &mut [u8], values: &[f64], dtype: DataType, factor: f64) {
    let size = dtype.size();
    assert_eq!(dst.len(), values.len() * size, "write_f64: lengths differ");
    for (d, &v) in dst.chunks_exact_mut(size).zip(values) {
        let v = v * factor;
        match dtype {
            DataType::F32 => d.copy_from_slice(&(v as f32).to_ne_bytes()),
            DataType::F64 => d.copy_from_slice(&v.to_ne_bytes()),
            DataType::F16 => d.copy_from_slice(&f16::from_f64(v).to_bits().to_ne_bytes()),
            DataType::BF16 => d.copy_from_slice(&bf16::from_f64(v).to_bits().to_ne_bytes()),
            _ => unreachable!("write_f64 takes floating types"),
        }
    }
}

/// `a = adasum(a, b)`. A zero vector leaves the other as it is.
pub fn combine(a: &mut [f64], b: &[f64]) {
    let (mut dot, mut aa, mut bb) = (0.0, 0.0, 0.0);
    for (x, y) in a.iter().zip(b) {
        dot += x * y;
        aa += x * x;
        bb += y * y;
    }
    let ca = if aa > 0.0 {
        1.0 - dot / (2.0 * aa)
    } else {
        1.0
    };
    let cb = if bb > 0.0 {
        1.0 - dot / (2.0 * bb)
    } else {
        1.0
    };
    for (x, y) in a.iter_mut().zip(b) {
        *x = ca * *x + cb * y;
    }
}

/// The ranks' vectors (in rank order) combined by the tree of the module
/// documentation.
pub fn tree(mut level: Vec<Vec<f64>>) -> Vec<f64> {
    assert!(!level.is_empty(), "adasum of no vectors");
    while level.len() > 1 {
        let mut next = Vec::with_capacity(level.len().div_ceil(2));
        let mut it = level.into_iter();
        while let Some(mut a) = it.next() {
            if let Some(b) = it.next() {
                combine(&mut a, &b);
            }
            next.push(a);
        }
        level = next;
    }
    level.pop().expect("one vector left")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orthogonal_vectors_add_and_parallel_ones_average() {
        let mut a = vec![1.0, 0.0];
        combine(&mut a, &[0.0, 2.0]);
        assert_eq!(a, vec![1.0, 2.0]);
        let mut a = vec![2.0, 4.0];
        combine(&mut a, &[2.0, 4.0]);
        assert_eq!(a, vec![2.0, 4.0]);
        let mut a = vec![0.0, 0.0];
        combine(&mut a, &[3.0, -1.0]);
        assert_eq!(a, vec![3.0, -1.0]);
    }

    #[test]
    fn the_pair_rule() {
        // a·b = 2, |a|² = 2, |b|² = 4: (1 - 2/4) a + (1 - 2/8) b.
        let mut a = vec![1.0, 1.0];
        combine(&mut a, &[2.0, 0.0]);
        assert_eq!(a, vec![0.5 + 1.5, 0.5]);
    }

    #[test]
    fn the_tree_pairs_in_rank_order() {
        let v = |x: f64, y: f64| vec![x, y];
        let parts = vec![
            v(1.0, 0.0),
            v(0.0, 1.0),
            v(1.0, 1.0),
            v(2.0, 0.0),
            v(0.5, -1.0),
        ];
        let mut left = v(1.0, 0.0);
        combine(&mut left, &v(0.0, 1.0));
        let mut right = v(1.0, 1.0);
        combine(&mut right, &v(2.0, 0.0));
        combine(&mut left, &right);
        combine(&mut left, &v(0.5, -1.0));
        assert_eq!(tree(parts), left);
        assert_eq!(tree(vec![v(3.0, 4.0)]), v(3.0, 4.0));
    }

    #[test]
    fn floating_types_round_trip_and_others_are_refused() {
        let values = [1.5, -2.25, 0.0, 1024.0];
        for dtype in [DataType::F32, DataType::F64, DataType::F16, DataType::BF16] {
            let mut bytes = vec![0u8; values.len() * dtype.size()];
            write_f64(&mut bytes, &values, dtype, 2.0);
            let doubled: Vec<f64> = values.iter().map(|v| v * 2.0).collect();
            assert_eq!(to_f64(&bytes, dtype).unwrap(), doubled, "{dtype:?}");
        }
        assert!(to_f64(&[0; 4], DataType::I32).is_none());
    }
}
