//! Fused allreduces on thread ranks: tensors of at least `IN_PLACE_MIN`
//! bytes reduced in their own memory, the rest through the fusion buffer,
//! the postscale folded into the ring; the same bytes on every rank.

use super::*;
use crate::collective::tests::{run, run_on};
use crate::device::tensor::f32_view;
use crate::device::Device;

fn view(v: &mut [f32]) -> TensorView {
    f32_view(v, Device::Cpu)
}

fn response(lens: &[usize], op: ReduceOp, prescale: f64, mode: Mode) -> Response {
    Response::Op {
        kind: OpKind::Allreduce,
        process_set: 0,
        names: (0..lens.len()).map(|i| format!("t{i}")).collect(),
        shapes: lens.iter().map(|&l| vec![l as i64]).collect(),
        dtype: DataType::F32,
        op,
        root: 0,
        prescale,
        postscale: 1.0,
        sizes: vec![],
        plan: Plan {
            mode,
            ..Plan::default()
        },
    }
}

/// Tensor lengths: small ones fused, two at or above `IN_PLACE_MIN` bytes
/// (one exactly there, one odd), in between and around them.
const LENS: [usize; 5] = [3, 300_001, 17, IN_PLACE_MIN / 4, 70_001];

fn value(rank: usize, t: usize, i: usize) -> f32 {
    ((i * 7 + t * 3 + rank) % 23) as f32 - 11.0
}

/// Runs one fused Average of [`LENS`] on this rank: odd tensors out of
/// place, even ones in place; `joined` ranks pass no tensors. Returns the
/// outputs, and whether the out-of-place inputs were left as they were.
fn average(c: &dyn Comm, joined: bool, prescale: f64, mode: Mode) -> (Vec<Vec<f32>>, bool) {
    let r = c.rank();
    let mut inputs: Vec<Vec<f32>> = LENS
        .iter()
        .enumerate()
        .map(|(t, &l)| (0..l).map(|i| value(r, t, i)).collect())
        .collect();
    let original = inputs.clone();
    let mut outputs: Vec<Vec<f32>> = LENS.iter().map(|&l| vec![f32::NAN; l]).collect();
    let entries: Vec<Option<Entry>> = inputs
        .iter_mut()
        .zip(outputs.iter_mut())
        .enumerate()
        .map(|(t, (i, o))| {
            (!joined).then(|| Entry {
                handle: t as u64,
                input: Some(view(i)),
                output: Some(if t % 2 == 1 { view(o) } else { view(i) }),
            })
        })
        .collect();
    let resp = response(&LENS, ReduceOp::Average, prescale, mode);
    let out = run_op(c, &resp, &entries, &mut Buffers::default());
    assert!(out.results.iter().all(|r| r.is_ok()), "rank {r}");
    drop(entries);
    let untouched = (1..LENS.len()).step_by(2).all(|t| inputs[t] == original[t]);
    let results = (0..LENS.len())
        .map(|t| {
            if t % 2 == 1 {
                outputs[t].clone()
            } else {
                inputs[t].clone()
            }
        })
        .collect();
    (results, untouched)
}

/// What every rank should hold: the sum of the contributing ranks' values
/// times the prescale, times 1/n as the kernels round it.
fn expected(n: usize, contributing: usize, prescale: f64) -> Vec<Vec<f32>> {
    let f = (1.0 / n as f64) as f32;
    LENS.iter()
        .enumerate()
        .map(|(t, &l)| {
            (0..l)
                .map(|i| {
                    let sum: f32 = (0..contributing)
                        .map(|r| value(r, t, i) * prescale as f32)
                        .sum();
                    sum * f
                })
                .collect()
        })
        .collect()
}

#[test]
fn fused_average_of_large_and_small_tensors_on_two_and_three_ranks() {
    for n in [2, 3] {
        for prescale in [1.0, 2.0] {
            let out = run(n, move |c| average(c, false, prescale, Mode::Flat));
            let want = expected(n, n, prescale);
            for (r, (got, untouched)) in out.iter().enumerate() {
                assert!(untouched, "n={n} rank {r}: an input was written");
                for (t, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(g == w, "n={n} prescale={prescale} rank {r} tensor {t}");
                }
            }
        }
    }
}

#[test]
fn a_joined_rank_contributes_zeros_to_the_in_place_tensors() {
    // Rank 2 has joined: it reduces zeros of each size and gets nothing back.
    let out = run(3, |c| average(c, c.rank() == 2, 1.0, Mode::Flat));
    let want = expected(3, 2, 1.0);
    for (r, (got, _)) in out.iter().take(2).enumerate() {
        assert_eq!(got, &want, "rank {r}");
    }
}

#[test]
fn hierarchical_average_scales_after_the_hierarchy() {
    let out = run_on(&[0, 0, 1, 1], |c| {
        average(c, false, 1.0, Mode::Hierarchical)
    });
    let want = expected(4, 4, 1.0);
    for (r, (got, _)) in out.iter().enumerate() {
        assert_eq!(got, &want, "rank {r}");
    }
}

/// Runs one allgather of `rank + 1` floats per rank into an output of `out_len`
/// floats; returns the output, and the tensor the core made instead (if any).
fn gather_into(c: &dyn Comm, out_len: usize) -> (Vec<f32>, Option<Vec<f32>>) {
    let n = c.size();
    let mut input: Vec<f32> = (0..=c.rank()).map(|i| (10 * c.rank() + i) as f32).collect();
    let mut output = vec![f32::NAN; out_len];
    let entries = vec![Some(Entry {
        handle: 0,
        input: Some(view(&mut input)),
        output: Some(view(&mut output)),
    })];
    let resp = Response::Op {
        kind: OpKind::Allgather,
        process_set: 0,
        names: vec!["g".into()],
        shapes: vec![vec![c.rank() as i64 + 1]],
        dtype: DataType::F32,
        op: ReduceOp::Sum,
        root: 0,
        prescale: 1.0,
        postscale: 1.0,
        sizes: (1..=n as i64).collect(),
        plan: Plan::default(),
    };
    let mut out = run_op(c, &resp, &entries, &mut Buffers::default());
    let result = out.results.remove(0).expect("allgather");
    drop(entries);
    let made = result.tensor.map(|t| {
        t.buf
            .as_slice()
            .chunks(4)
            .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
            .collect()
    });
    (output, made)
}

#[test]
fn an_allgather_writes_into_an_output_of_the_results_size_and_makes_its_own_otherwise() {
    for n in [2, 3] {
        let want: Vec<f32> = (0..n)
            .flat_map(|r| (0..=r).map(move |i| (10 * r + i) as f32))
            .collect();
        let total = want.len();
        for (r, (output, made)) in run(n, move |c| gather_into(c, total))
            .into_iter()
            .enumerate()
        {
            assert_eq!(output, want, "n={n} rank {r}: the output holds the result");
            assert!(
                made.is_none(),
                "n={n} rank {r}: no tensor of the core's own"
            );
        }
        for (r, (output, made)) in run(n, move |c| gather_into(c, total + 1))
            .into_iter()
            .enumerate()
        {
            assert!(
                output.iter().all(|x| x.is_nan()),
                "n={n} rank {r}: a wrong size is left"
            );
            assert_eq!(made.as_deref(), Some(&want[..]), "n={n} rank {r}");
        }
    }
}
