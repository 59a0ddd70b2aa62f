use super::*;
use crate::kernels::to_half;

/// Records the calls an executor gets; its float16 pass finds `bad`.
struct Script {
    bad: Vec<usize>,
    finite: bool,
    calls: Vec<String>,
}

impl HalfReduce for Script {
    fn half(&mut self, wire: Wire) -> Result<Vec<usize>> {
        self.calls.push(format!("half {wire:?}"));
        Ok(self.bad.clone())
    }
    fn exact(&mut self, check: &[usize]) -> Result<bool> {
        self.calls.push(format!("exact {check:?}"));
        Ok(self.finite)
    }
}

fn script(bad: Vec<usize>, finite: bool) -> Script {
    Script {
        bad,
        finite,
        calls: Vec::new(),
    }
}

#[test]
fn float16_travels_only_for_float32_sums_where_a_link_carries_it() {
    let w = |dtype, op, enc, ranks, hosts| wire(dtype, op, enc, 8.0, ranks, || hosts);
    let (f32, sum, avg) = (DataType::F32, ReduceOp::Sum, ReduceOp::Average);
    assert_eq!(w(f32, sum, Encoding::Half, 2, 1), Wire::Half { scale: 8.0 });
    assert_eq!(w(f32, avg, Encoding::Half, 2, 1), Wire::Half { scale: 8.0 });
    assert_eq!(w(f32, sum, Encoding::Half, 1, 1), Wire::Exact);
    assert_eq!(w(f32, sum, Encoding::Exact, 4, 2), Wire::Exact);
    assert_eq!(
        w(f32, sum, Encoding::HalfBetweenHosts, 4, 2),
        Wire::HalfBetweenHosts { scale: 8.0 }
    );
    assert_eq!(w(f32, sum, Encoding::HalfBetweenHosts, 4, 1), Wire::Exact);
    assert_eq!(w(DataType::F64, sum, Encoding::Half, 2, 1), Wire::Exact);
    assert_eq!(w(DataType::F16, sum, Encoding::Half, 2, 1), Wire::Exact);
    assert_eq!(w(f32, ReduceOp::Max, Encoding::Half, 2, 1), Wire::Exact);
    assert_eq!(w(f32, ReduceOp::Adasum, Encoding::Half, 2, 1), Wire::Exact);
}

#[test]
fn the_hosts_are_counted_only_for_the_mixed_mode() {
    let never = || -> usize { panic!("hosts asked for") };
    assert_eq!(
        wire(DataType::F32, ReduceOp::Sum, Encoding::Half, 1.0, 2, never),
        Wire::Half { scale: 1.0 }
    );
}

#[test]
fn the_gradient_scale_multiplies_on_the_way_in_and_divides_on_the_way_out() {
    let w = Wire::Half { scale: 4.0 };
    assert_eq!(w.down(0.5), 2.0);
    assert_eq!(w.up(0.5), 0.125);
    assert_eq!(Wire::Exact.down(0.5), 0.5);
}

#[test]
fn an_exact_wire_runs_only_the_exact_allreduce() {
    let mut s = script(vec![0], false);
    assert_eq!(allreduce(&mut s, Wire::Exact).unwrap(), None);
    assert_eq!(s.calls, ["exact []"]);
}

#[test]
fn finite_float16_sums_are_not_resent() {
    let mut s = script(vec![], false);
    assert_eq!(allreduce(&mut s, Wire::Half { scale: 2.0 }).unwrap(), None);
    assert_eq!(s.calls, ["half Half { scale: 2.0 }"]);
}

#[test]
fn an_overflow_is_resent_exactly_and_reported_with_the_exact_sums_finiteness() {
    for finite in [true, false] {
        let mut s = script(vec![1, 3], finite);
        let got = allreduce(&mut s, Wire::HalfBetweenHosts { scale: 1.0 }).unwrap();
        assert_eq!(
            got,
            Some(Resent {
                bad: vec![1, 3],
                finite
            })
        );
        assert_eq!(
            s.calls,
            ["half HalfBetweenHosts { scale: 1.0 }", "exact [1, 3]"]
        );
    }
}

#[test]
fn an_error_of_the_float16_pass_is_not_resent() {
    struct Fails;
    impl HalfReduce for Fails {
        fn half(&mut self, _: Wire) -> Result<Vec<usize>> {
            Err(crate::PerseusError::Peer("peer gone".into()))
        }
        fn exact(&mut self, _: &[usize]) -> Result<bool> {
            panic!("resent after an error")
        }
    }
    let err = allreduce(&mut Fails, Wire::Half { scale: 1.0 }).unwrap_err();
    assert!(matches!(err, crate::PerseusError::Peer(_)), "{err}");
}

#[test]
fn the_parts_holding_a_value_not_finite_are_named_by_position() {
    let values = [1.0f32, 2.0, 70000.0, 3.0, f32::NAN, 4.0];
    let mut image = vec![0u8; values.len() * 2];
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    to_half(&mut image, &bytes, 1.0);
    let parts = [0..4, 4..8, 8..10, 10..12];
    assert_eq!(
        nonfinite_parts(&image, DataType::F16, parts.clone()),
        [1, 2]
    );
    let finite: Vec<u8> = image[..4].to_vec();
    assert!(nonfinite_parts(&finite, DataType::F16, [0..2, 2..4]).is_empty());
}
