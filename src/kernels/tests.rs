use super::*;

fn bytes<T: Copy>(v: &[T]) -> AlignedBuf {
    // SAFETY: plain data viewed as bytes.
    let b =
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) };
    AlignedBuf::from_slice(b)
}

fn back<T: Copy + Default>(b: &AlignedBuf) -> Vec<T> {
    typed::<T>(b.as_slice()).unwrap().to_vec()
}

#[test]
fn every_op_on_f32_and_i32() {
    for (op, want_f, want_i) in [
        (ReduceOp::Sum, [5.0f32, 1.0, -1.0], [5i32, 1, -1]),
        (ReduceOp::Min, [2.0, -1.0, -3.0], [2, -1, -3]),
        (ReduceOp::Max, [3.0, 2.0, 2.0], [3, 2, 2]),
        (ReduceOp::Product, [6.0, -2.0, -6.0], [6, -2, -6]),
    ] {
        let mut d = bytes(&[2.0f32, -1.0, 2.0]);
        reduce_into(
            d.as_mut_slice(),
            bytes(&[3.0f32, 2.0, -3.0]).as_slice(),
            DataType::F32,
            op,
        );
        assert_eq!(back::<f32>(&d), want_f, "{op:?}");
        let mut d = bytes(&[2i32, -1, 2]);
        reduce_into(
            d.as_mut_slice(),
            bytes(&[3i32, 2, -3]).as_slice(),
            DataType::I32,
            op,
        );
        assert_eq!(back::<i32>(&d), want_i, "{op:?}");
    }
}

#[test]
fn half_types_reduce_through_f32() {
    let a: Vec<f16> = (0..3000).map(|i| f16::from_f32((i % 7) as f32)).collect();
    let mut d = bytes(&a);
    reduce_into(
        d.as_mut_slice(),
        bytes(&a).as_slice(),
        DataType::F16,
        ReduceOp::Sum,
    );
    let got = back::<f16>(&d);
    assert!(got
        .iter()
        .enumerate()
        .all(|(i, x)| x.to_f32() == 2.0 * (i % 7) as f32));
    let b: Vec<bf16> = [1.5f32, -2.0].iter().map(|&x| bf16::from_f32(x)).collect();
    let mut d = bytes(&b);
    reduce_into(
        d.as_mut_slice(),
        bytes(&b).as_slice(),
        DataType::BF16,
        ReduceOp::Product,
    );
    assert_eq!(
        back::<bf16>(&d),
        vec![bf16::from_f32(2.25), bf16::from_f32(4.0)]
    );
}

#[test]
fn bool_ops_are_logical() {
    let mut d = AlignedBuf::from_slice(&[0, 1, 1, 0]);
    reduce_into(
        d.as_mut_slice(),
        &[0, 0, 1, 1],
        DataType::Bool,
        ReduceOp::Sum,
    );
    assert_eq!(d.as_slice(), &[0, 1, 1, 1]);
    let mut d = AlignedBuf::from_slice(&[0, 1, 1, 0]);
    reduce_into(
        d.as_mut_slice(),
        &[0, 0, 1, 1],
        DataType::Bool,
        ReduceOp::Min,
    );
    assert_eq!(d.as_slice(), &[0, 0, 1, 0]);
}

#[test]
fn integers_wrap_and_scale_truncates() {
    let mut d = AlignedBuf::from_slice(&[250u8, 3]);
    reduce_into(d.as_mut_slice(), &[10, 4], DataType::U8, ReduceOp::Sum);
    assert_eq!(d.as_slice(), &[4, 7]);
    let mut d = bytes(&[7i64, -7]);
    scale(d.as_mut_slice(), DataType::I64, 0.5);
    assert_eq!(back::<i64>(&d), vec![3, -3]);
}

#[test]
fn float_scale_and_nan_propagation() {
    let mut d = bytes(&[1.0f64, 4.0]);
    scale(d.as_mut_slice(), DataType::F64, 0.25);
    assert_eq!(back::<f64>(&d), vec![0.25, 1.0]);
    let mut d = bytes(&[1.0f32, 4.0]);
    reduce_into(
        d.as_mut_slice(),
        bytes(&[f32::NAN, 1.0]).as_slice(),
        DataType::F32,
        ReduceOp::Max,
    );
    assert!(back::<f32>(&d)[0].is_nan());
}

#[test]
fn misaligned_buffers_are_handled() {
    let mut raw = [0u8; 13];
    raw[1..5].copy_from_slice(&1.5f32.to_ne_bytes());
    raw[5..9].copy_from_slice(&2.5f32.to_ne_bytes());
    let src = [1.0f32.to_ne_bytes(), 1.0f32.to_ne_bytes()].concat();
    reduce_into(&mut raw[1..9], &src, DataType::F32, ReduceOp::Sum);
    assert_eq!(f32::from_ne_bytes(raw[1..5].try_into().unwrap()), 2.5);
    assert_eq!(f32::from_ne_bytes(raw[5..9].try_into().unwrap()), 3.5);
}

#[test]
fn half_casts_scale_round_and_find_nonfinite() {
    // 3000 elements: several conversion blocks and a partial one.
    let v: Vec<f32> = (0..3000).map(|i| (i as f32 - 1500.0) * 0.125).collect();
    let src = bytes(&v);
    let mut h = AlignedBuf::zeroed(v.len() * 2);
    to_half(h.as_mut_slice(), src.as_slice(), 10.0);
    let halves: Vec<half::f16> = back(&h);
    assert_eq!(
        halves[1],
        half::f16::from_f32((1.0 - 1500.0) * 0.125 * 10.0)
    );
    let mut out = AlignedBuf::zeroed(v.len() * 4);
    from_half(out.as_mut_slice(), h.as_slice(), 0.1);
    for (g, w) in back::<f32>(&out).iter().zip(&v) {
        assert!((g - w).abs() <= 1e-3 * w.abs().max(1.0), "{g} vs {w}");
    }
    // float32 += float16, and rounding through float16.
    let mut acc = bytes(&v);
    reduce_half_into(acc.as_mut_slice(), h.as_slice(), ReduceOp::Sum);
    assert!((back::<f32>(&acc)[0] - 11.0 * v[0]).abs() < 0.5);
    let mut r = bytes(&[1.0f32 / 3.0, 65504.0, 1e6]);
    round_through_half(r.as_mut_slice());
    assert_eq!(
        back::<f32>(&r),
        [
            half::f16::from_f32(1.0 / 3.0).to_f32(),
            65504.0,
            f32::INFINITY
        ]
    );
    // Non-finite detection in both widths, on odd offsets too.
    assert_eq!(first_nonfinite(h.as_slice(), DataType::F16), None);
    assert_eq!(first_nonfinite(src.as_slice(), DataType::F32), None);
    let mut big = v.clone();
    big[2999] = 7000.0;
    to_half(h.as_mut_slice(), bytes(&big).as_slice(), 10.0);
    assert_eq!(first_nonfinite(h.as_slice(), DataType::F16), Some(2999));
    big[1234] = f32::NAN;
    assert_eq!(
        first_nonfinite(bytes(&big).as_slice(), DataType::F32),
        Some(1234)
    );
    let whole = bytes(&big);
    assert_eq!(
        first_nonfinite(&whole.as_slice()[4..], DataType::F32),
        Some(1233)
    );
}
