//! Rank 0's negotiation work per training step, without I/O: the coordinator (pure,
//! `src/engine/coordinator.rs`) fed the requests of N simulated ranks for a step of
//! ResNet-50's 161 gradient tensors, as they arrive in steady state (response-cache
//! ids), then timed. Prints one JSON line per rank count given on the command line.
//!
//! Built by `cargo build --release --example control_plane`; run by
//! `python benchmarks/scale.py --control-plane`.

use perseus::engine::coordinator::Coordinator;
use perseus::engine::message::WireRequest;
use perseus::engine::{OpKind, Request};
use perseus::{DataType, ReduceOp};
use std::time::Instant;

/// Tensors in a step (ResNet-50's parameters).
const TENSORS: usize = 161;
/// Steps timed after the warm-up.
const STEPS: usize = 5;

fn request(i: usize) -> Request {
    let mut r = Request::new(OpKind::Allreduce, format!("allreduce.layer.{i}.weight"), 0);
    r.dtype = DataType::F32;
    r.shape = vec![64, 64, 3, 3];
    r.op = ReduceOp::Average;
    r
}

fn main() {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    for n in sizes {
        let mut c = Coordinator::new(n, 64 << 20).with_cache(1024);
        // Warm-up: every rank sends every request whole; the cache fills.
        for rank in 0..n {
            let reqs: Vec<WireRequest> = (0..TENSORS)
                .map(|i| WireRequest::Full(request(i)))
                .collect();
            c.submit_wire(rank, reqs);
        }
        let mut per_step = Vec::new();
        let mut answers = 0usize;
        let mut addressed = 0usize;
        for _ in 0..STEPS {
            let t = Instant::now();
            for rank in 0..n {
                let reqs: Vec<WireRequest> =
                    (1..=TENSORS as u32).map(WireRequest::Cached).collect();
                let out = c.submit_wire(rank, reqs);
                answers += out.len();
                addressed += out.iter().map(|(to, _)| to.len()).sum::<usize>();
            }
            per_step.push(t.elapsed().as_secs_f64());
        }
        per_step.sort_by(f64::total_cmp);
        let median = per_step[STEPS / 2];
        println!(
            "{{\"ranks\": {n}, \"tensors\": {TENSORS}, \"rank0_ms_per_step\": {:.3}, \
             \"us_per_rank\": {:.3}, \"responses_per_step\": {}, \"recipients_per_step\": {}}}",
            median * 1e3,
            median * 1e6 / n as f64,
            answers / STEPS,
            addressed / STEPS
        );
    }
}
