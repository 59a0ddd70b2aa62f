//! Negotiation without sockets: readiness, agreement checks, fusion, join,
//! process sets and shutdown.

use super::Coordinator;
use crate::config::StallLimits;
use crate::dtype::{DataType, ReduceOp};
use crate::engine::message::{OpKind, Request, Response};
use std::time::{Duration, Instant};

fn ar(name: &str, shape: &[i64]) -> Request {
    let mut r = Request::new(OpKind::Allreduce, name, 0);
    r.dtype = DataType::F32;
    r.shape = shape.to_vec();
    r
}

fn names(resp: &Response) -> Vec<String> {
    match resp {
        Response::Op { names, .. } | Response::Error { names, .. } => names.clone(),
        Response::Done { name, .. } | Response::Cached { name, .. } => vec![name.clone()],
        Response::Abort { .. }
        | Response::Offline { .. }
        | Response::Switch { .. }
        | Response::Params { .. } => vec![],
    }
}

#[test]
fn ready_only_when_every_rank_asked_and_same_order_for_all() {
    let mut c = Coordinator::new(3, 1 << 20);
    assert!(c.submit(0, vec![ar("a", &[2]), ar("b", &[2])]).is_empty());
    assert!(c.submit(1, vec![ar("b", &[2]), ar("a", &[2])]).is_empty());
    let out = c.submit(2, vec![ar("a", &[2]), ar("b", &[2])]);
    assert_eq!(out.len(), 1, "a and b are fused into one response");
    assert_eq!(out[0].0, vec![0, 1, 2]);
    assert_eq!(names(&out[0].1), vec!["a", "b"], "first-submitted order");
}

#[test]
fn fusion_respects_threshold_and_compatibility() {
    let mut c = Coordinator::new(2, 16);
    let mut reqs = vec![ar("a", &[2]), ar("b", &[2]), ar("c", &[2])];
    let mut sum = ar("d", &[1]);
    sum.op = ReduceOp::Max;
    reqs.push(sum);
    c.submit(0, reqs.clone());
    let out = c.submit(1, reqs);
    let got: Vec<Vec<String>> = out.iter().map(|(_, r)| names(r)).collect();
    assert_eq!(got, vec![vec!["a", "b"], vec!["c"], vec!["d"]]);
}

#[test]
fn mismatches_fail_on_every_rank_naming_tensor_and_ranks() {
    let mut c = Coordinator::new(2, 1 << 20);
    c.submit(0, vec![ar("w", &[2, 3])]);
    let out = c.submit(1, vec![ar("w", &[4])]);
    let Response::Error { message, .. } = &out[0].1 else {
        panic!("{out:?}")
    };
    assert_eq!(out[0].0, vec![0, 1]);
    assert!(message.contains("'w'") && message.contains("rank 0") && message.contains("rank 1"));
    assert!(
        message.contains("[2, 3]") && message.contains("[4]"),
        "{message}"
    );

    let mut d = ar("x", &[2]);
    d.dtype = DataType::I32;
    c.submit(0, vec![ar("x", &[2])]);
    let out = c.submit(1, vec![d]);
    assert!(matches!(&out[0].1, Response::Error { message, .. } if message.contains("int32")));

    let mut b0 = Request::new(OpKind::Broadcast, "p", 0);
    b0.shape = vec![1];
    let mut b1 = b0.clone();
    b1.root = 1;
    c.submit(0, vec![b0]);
    let out = c.submit(1, vec![b1]);
    assert!(matches!(&out[0].1, Response::Error { message, .. } if message.contains("root")));
}

#[test]
fn stacked_allgather_of_unequal_shapes_points_at_the_variable() {
    let mut c = Coordinator::new(2, 1 << 20);
    let mut a = Request::new(OpKind::Allgather, "g", 0);
    a.shape = vec![1, 2];
    a.stack = true;
    let mut b = a.clone();
    b.shape = vec![2, 2];
    c.submit(0, vec![a.clone()]);
    let out = c.submit(1, vec![b.clone()]);
    assert!(
        matches!(&out[0].1, Response::Error { message, .. } if message.contains("PERSEUS_CHANGE_HVD_ALLGATHER=1"))
    );
    a.stack = false;
    b.stack = false;
    c.submit(0, vec![a]);
    let out = c.submit(1, vec![b]);
    assert!(matches!(&out[0].1, Response::Op { sizes, .. } if sizes == &vec![1, 2]));
}

#[test]
fn joined_ranks_count_as_ready_for_allreduce_only() {
    let mut c = Coordinator::new(3, 1 << 20);
    assert!(c
        .submit(2, vec![Request::new(OpKind::Join, "join", 0)])
        .is_empty());
    c.submit(0, vec![ar("a", &[2])]);
    let out = c.submit(1, vec![ar("a", &[2])]);
    assert!(matches!(&out[0].1, Response::Op { .. }));
    assert_eq!(
        out[0].0,
        vec![0, 1, 2],
        "the joined rank takes part with zeros"
    );
    let mut g = Request::new(OpKind::Allgather, "g", 0);
    g.shape = vec![1];
    c.submit(0, vec![g.clone()]);
    let out = c.submit(1, vec![g]);
    assert!(matches!(&out[0].1, Response::Error { message, .. } if message.contains("joined")));
    c.submit(0, vec![Request::new(OpKind::Join, "join", 0)]);
    let out = c.submit(1, vec![Request::new(OpKind::Join, "join", 0)]);
    assert!(matches!(
        out.last().unwrap().1,
        Response::Done {
            kind: OpKind::Join,
            value: 1,
            ..
        }
    ));
}

#[test]
fn process_sets_get_ids_and_negotiate_alone() {
    let mut c = Coordinator::new(3, 1 << 20);
    let mut add = Request::new(OpKind::AddProcessSet, "add_process_set.1", 0);
    add.ints = vec![0, 2];
    for r in 0..2 {
        assert!(c.submit(r, vec![add.clone()]).is_empty());
    }
    let out = c.submit(2, vec![add]);
    assert!(matches!(
        out[0].1,
        Response::Done {
            kind: OpKind::AddProcessSet,
            value: 1,
            ..
        }
    ));
    let mut a = ar("s", &[1]);
    a.process_set = 1;
    c.submit(0, vec![a.clone()]);
    let out = c.submit(2, vec![a.clone()]);
    assert_eq!(out[0].0, vec![0, 2]);
    let out = c.submit(1, vec![a]);
    assert!(
        matches!(&out[0].1, Response::Error { message, .. } if message.contains("not in process set"))
    );
    let mut bad = Request::new(OpKind::AddProcessSet, "add_process_set.2", 0);
    bad.ints = vec![2, 0];
    for r in 0..2 {
        c.submit(r, vec![bad.clone()]);
    }
    let out = c.submit(2, vec![bad]);
    assert!(matches!(&out[0].1, Response::Error { message, .. } if message.contains("increasing")));
}

#[test]
fn shutdown_of_one_rank_fails_what_it_never_sent_and_disconnect_aborts() {
    let mut c = Coordinator::new(2, 1 << 20);
    c.submit(0, vec![ar("late", &[1])]);
    let out = c.submit(1, vec![Request::new(OpKind::Shutdown, "shutdown.1", 0)]);
    assert!(matches!(&out[0].1, Response::Error { message, .. } if message.contains("shut down")));
    let out = c.submit(0, vec![Request::new(OpKind::Shutdown, "shutdown.1", 0)]);
    assert!(matches!(
        out[0].1,
        Response::Done {
            kind: OpKind::Shutdown,
            ..
        }
    ));
    assert!(
        c.disconnect(1, "eof").is_empty(),
        "leaving after shutdown is fine"
    );
    let mut c = Coordinator::new(3, 1 << 20);
    let out = c.disconnect(2, "connection reset");
    assert_eq!(out[0].0, vec![0, 1]);
    assert!(matches!(&out[0].1, Response::Abort { message } if message.contains("rank 2")));
}

#[test]
fn messages_round_trip_on_the_wire() {
    use crate::engine::message::*;
    let mut r = ar("layer.weight", &[3, 4]);
    r.ints = vec![1, 2];
    r.prescale = 0.5;
    r.plan = crate::plan::Plan {
        encoding: crate::plan::Encoding::HalfBetweenHosts,
        scale: 4.0,
        mode: crate::plan::Mode::Hierarchical,
        device: true,
    };
    let wire = vec![WireRequest::Full(r), WireRequest::Cached(7)];
    assert_eq!(decode_requests(&encode_requests(&wire)).unwrap(), wire);
    let resps = vec![
        Response::Op {
            kind: OpKind::Alltoall,
            process_set: 3,
            names: vec!["a".into()],
            shapes: vec![vec![2, 2]],
            dtype: DataType::BF16,
            op: ReduceOp::Min,
            root: 1,
            prescale: 2.0,
            postscale: 0.25,
            sizes: vec![1, 1, 0, 2],
            plan: crate::plan::Plan::default(),
        },
        Response::Error {
            process_set: 0,
            names: vec!["x".into()],
            message: "m".into(),
        },
        Response::Done {
            kind: OpKind::Join,
            process_set: 0,
            name: "join".into(),
            value: 2,
        },
        Response::Abort {
            message: "gone".into(),
        },
        Response::Cached {
            process_set: 1,
            name: "w".into(),
            id: 3,
        },
        Response::Params {
            fusion: 8 << 20,
            cycle_us: 2500,
            flat: true,
        },
    ];
    assert_eq!(decode_responses(&encode_responses(&resps)).unwrap(), resps);
    assert!(decode_responses(&[1, 0, 0, 0, 9]).is_err());
}

#[test]
fn differing_plans_are_a_mismatch_and_do_not_fuse() {
    use crate::plan::{Encoding, Plan};
    let half = Plan {
        encoding: Encoding::Half,
        scale: 10.0,
        ..Plan::default()
    };
    let mut c = Coordinator::new(2, 1 << 20);
    let mut a = ar("g", &[4]);
    a.plan = half;
    c.submit(0, vec![a]);
    let out = c.submit(1, vec![ar("g", &[4])]);
    let Response::Error { message, .. } = &out[0].1 else {
        panic!("expected an error, got {out:?}");
    };
    assert!(
        message.contains("plans") && message.contains("float16 (scale 10)"),
        "{message}"
    );
    // Same plan on both ranks, but two different plans in one burst: two buffers.
    let mut x = ar("x", &[4]);
    x.plan = half;
    let reqs = vec![x, ar("y", &[4])];
    c.submit(0, reqs.clone());
    let out = c.submit(1, reqs);
    let got: Vec<Vec<String>> = out.iter().map(|(_, r)| names(r)).collect();
    assert_eq!(got, vec![vec!["x"], vec!["y"]]);
}

#[test]
fn device_is_answered_only_when_every_rank_sent_a_device_tensor() {
    let dev = |name: &str| {
        let mut r = ar(name, &[4]);
        r.plan.device = true;
        r
    };
    let device_of = |out: &[(Vec<usize>, Response)]| -> Vec<bool> {
        out.iter()
            .map(|(_, r)| match r {
                Response::Op { plan, .. } => plan.device,
                other => panic!("expected an op, got {other:?}"),
            })
            .collect()
    };
    let mut c = Coordinator::new(2, 1 << 20);
    c.submit(0, vec![dev("a")]);
    assert_eq!(device_of(&c.submit(1, vec![dev("a")])), vec![true]);
    // A CPU tensor on one rank is no mismatch: the response runs staged.
    c.submit(0, vec![dev("b")]);
    assert_eq!(device_of(&c.submit(1, vec![ar("b", &[4])])), vec![false]);
    // Device and host tensors are not fused together.
    c.submit(0, vec![dev("c"), ar("d", &[4])]);
    let out = c.submit(1, vec![dev("c"), ar("d", &[4])]);
    assert_eq!(device_of(&out), vec![true, false]);
}

/// A coordinator of `n` ranks that warns of a stall at 60 s and aborts at 120 s.
fn watched(n: usize) -> Coordinator {
    let limits = StallLimits {
        warn: Some(Duration::from_secs(60)),
        fail: Some(Duration::from_secs(120)),
    };
    Coordinator::new(n, 1 << 20).with_stall_limits(limits)
}

#[test]
fn stalls_are_warned_once_then_abort_the_job() {
    let mut c = watched(3);
    assert!(!c.stall_watch(), "nothing waits yet");
    let t0 = Instant::now();
    assert!(c.submit(0, vec![ar("stuck", &[2])]).is_empty());
    assert!(c.submit(1, vec![ar("stuck", &[2])]).is_empty());
    assert!(c.stall_watch());
    let early = c.check_stalls(t0 + Duration::from_secs(30));
    assert!(early.warnings.is_empty() && early.abort.is_empty());
    let late = c.check_stalls(t0 + Duration::from_secs(61));
    assert_eq!(late.warnings.len(), 1, "{:?}", late.warnings);
    let w = &late.warnings[0];
    assert!(
        w.contains("allreduce 'stuck'") && w.contains("ranks [2]"),
        "{w}"
    );
    assert!(w.contains("ranks [0, 1] submitted"), "{w}");
    assert!(late.abort.is_empty());
    let again = c.check_stalls(t0 + Duration::from_secs(90));
    assert!(again.warnings.is_empty(), "warned once per tensor");
    let fail = c.check_stalls(t0 + Duration::from_secs(121));
    assert_eq!(fail.abort.len(), 1);
    let (to, resp) = &fail.abort[0];
    assert_eq!(to, &vec![0, 1, 2]);
    let Response::Abort { message } = resp else {
        panic!("{resp:?}")
    };
    assert!(
        message.contains("'stuck'") && message.contains("STALL_SHUTDOWN"),
        "{message}"
    );
    // Rank 2 comes after all: nothing waits any more.
    assert_eq!(c.submit(2, vec![ar("stuck", &[2])]).len(), 1);
    assert!(!c.stall_watch());
}

#[test]
fn stall_check_off_finds_nothing() {
    let mut c = Coordinator::new(2, 1 << 20);
    assert!(c.submit(0, vec![ar("x", &[2])]).is_empty());
    assert!(!c.stall_watch());
    let t = Instant::now() + Duration::from_secs(1_000_000);
    let found = c.check_stalls(t);
    assert!(found.warnings.is_empty() && found.abort.is_empty());
}

fn form(ranks: &[i64]) -> Request {
    let mut r = Request::new(OpKind::FormProcessSet, format!("form{ranks:?}"), 0);
    r.ints = ranks.to_vec();
    r
}

#[test]
fn a_set_formed_by_its_members_alone_gets_an_id_only_they_hear_of() {
    let mut c = Coordinator::new(4, 1 << 20);
    // Rank 3 never takes part; ranks 1 and 2 form theirs in the meantime.
    assert!(c.submit(0, vec![form(&[0, 2])]).is_empty());
    assert!(c.submit(1, vec![form(&[1, 2])]).is_empty());
    let out = c.submit(2, vec![form(&[1, 2]), form(&[0, 2])]);
    let got: Vec<(Vec<usize>, i64)> = out
        .iter()
        .map(|(to, r)| match r {
            Response::Done {
                kind: OpKind::FormProcessSet,
                process_set: 0,
                value,
                ..
            } => (to.clone(), *value),
            other => panic!("{other:?}"),
        })
        .collect();
    // Both became whole in one flush; the sets are taken in rank order.
    assert_eq!(
        got,
        vec![(vec![0], 1), (vec![2], 1), (vec![1], 2), (vec![2], 2)]
    );
    // A set of every rank added afterwards takes the next id.
    let mut add = Request::new(OpKind::AddProcessSet, "add_process_set.1", 0);
    add.ints = vec![0, 1, 3];
    for r in 0..3 {
        assert!(c.submit(r, vec![add.clone()]).is_empty());
    }
    let out = c.submit(3, vec![add]);
    assert!(
        matches!(out[0].1, Response::Done { value: 3, .. }),
        "{out:?}"
    );
    // The formed set negotiates among its members like any other.
    let mut a = ar("s", &[1]);
    a.process_set = 2;
    assert!(c.submit(1, vec![a.clone()]).is_empty());
    let out = c.submit(2, vec![a]);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, vec![1, 2]);
    assert!(matches!(out[0].1, Response::Op { process_set: 2, .. }));
}

#[test]
fn forming_a_set_fails_for_outsiders_bad_ranks_and_members_that_shut_down() {
    let mut c = Coordinator::new(3, 1 << 20);
    let out = c.submit(0, vec![form(&[1, 2])]);
    assert_eq!(out[0].0, vec![0]);
    assert!(
        matches!(&out[0].1, Response::Error { message, .. } if message.contains("only its members")),
        "{out:?}"
    );
    let out = c.submit(0, vec![form(&[0, 7])]);
    assert!(
        matches!(&out[0].1, Response::Error { message, .. } if message.contains("from 0 to 2")),
        "{out:?}"
    );
    assert!(c.submit(0, vec![form(&[0, 1])]).is_empty());
    let out = c.submit(1, vec![Request::new(OpKind::Shutdown, "shutdown.1", 0)]);
    let errors: Vec<_> = out
        .iter()
        .filter_map(|(to, r)| match r {
            Response::Error { names, message, .. } => Some((to.clone(), names.clone(), message)),
            _ => None,
        })
        .collect();
    assert_eq!(errors.len(), 1, "{out:?}");
    let (to, names, message) = &errors[0];
    assert_eq!((to, names), (&vec![0], &vec!["form[0, 1]".to_string()]));
    assert!(
        message.contains("ranks [0, 1]") && message.contains("rank(s) [1] shut down"),
        "{message}"
    );
}

#[test]
fn a_set_formed_halfway_is_a_stall_naming_who_is_missing() {
    let mut c = watched(3);
    let t0 = Instant::now();
    assert!(c.submit(2, vec![form(&[0, 2])]).is_empty());
    assert!(c.stall_watch(), "a set being formed waits for ranks");
    let late = c.check_stalls(t0 + Duration::from_secs(61));
    assert_eq!(late.warnings.len(), 1, "{:?}", late.warnings);
    let w = &late.warnings[0];
    assert!(
        w.contains("form_process_set of ranks [0, 2]")
            && w.contains("for ranks [0]")
            && w.contains("ranks [2] asked"),
        "{w}"
    );
    let fail = c.check_stalls(t0 + Duration::from_secs(121));
    assert_eq!(fail.abort.len(), 1);
    assert_eq!(c.submit(0, vec![form(&[0, 2])]).len(), 2);
    assert!(!c.stall_watch());
}

#[test]
fn autotune_changes_fusion_at_once_tells_every_rank_the_cycle_and_then_lets_offline_in() {
    use crate::engine::autotune::{Knobs, Tuner};
    let settings = crate::config::AutotuneSettings {
        log: None,
        warmup_samples: 0,
        steps_per_sample: 1,
        max_samples: 3,
        noise: 0.8,
        fusion: true,
        cycle: true,
        mode: true,
    };
    let start = Knobs {
        fusion: 64 << 20,
        cycle: Duration::from_millis(1),
        flat: false,
    };
    let tuner = Tuner::new(settings, start).unwrap();
    let mut c = Coordinator::new(2, 64 << 20)
        .with_offline(true)
        .with_autotune(Some(tuner));
    let mut params = Vec::new();
    let mut fused = Vec::new();
    for _ in 0..40 {
        let step = || vec![ar("a", &[4]), ar("b", &[4])];
        // This step is fused under the threshold in force before its answers.
        let zero = params.last().is_some_and(|p: &(u64, u64)| p.0 == 0);
        c.submit(0, step());
        let out = c.submit(1, step());
        for (to, resp) in &out {
            match resp {
                Response::Params {
                    fusion, cycle_us, ..
                } => {
                    assert_eq!(to, &vec![0, 1]);
                    params.push((*fusion, *cycle_us));
                }
                Response::Op { names, .. } => fused.push(names.len()),
                // Two new settings were sampled; the best is a third change unless
                // it was the last one sampled (the scores are real times here).
                Response::Offline { .. } => {
                    return assert!((2..=3).contains(&params.len()), "{params:?}")
                }
                _ => {}
            }
        }
        // Each step's two tensors fuse unless that threshold is 0.
        assert_eq!(fused.pop(), Some(if zero { 1 } else { 2 }), "{params:?}");
        fused.clear();
    }
    panic!("no offline schedule was offered after tuning: {params:?}");
}

#[test]
fn fusion_bounds_the_names_of_one_response_and_batches_go_in_bounded_frames() {
    use crate::engine::message::{decode_responses, encode_responses, in_parts};
    // 1,000 one-element tensors with 3,000-character names: far below the data threshold,
    // but fused names stop at a MiB, so every response frame stays small.
    let name = |i: usize| format!("{i:08}").repeat(375);
    let reqs: Vec<Request> = (0..1000).map(|i| ar(&name(i), &[1])).collect();
    let mut c = Coordinator::new(2, 64 << 20);
    c.submit(0, reqs.clone());
    let out: Vec<Response> = c.submit(1, reqs).into_iter().map(|(_, r)| r).collect();
    assert!(out.len() > 1, "fused into one response of 3 MB of names");
    let all: Vec<String> = out.iter().flat_map(names).collect();
    assert_eq!(
        all,
        (0..1000).map(name).collect::<Vec<_>>(),
        "every name, in order"
    );
    for r in &out {
        assert!(names(r).iter().map(String::len).sum::<usize>() <= 1 << 20);
    }
    // A batch larger than the frame size goes as several parts, in order.
    let parts = in_parts(&out, 1 << 20, encode_responses);
    assert!(parts.len() >= 3, "{} parts", parts.len());
    assert!(parts.iter().all(|p| p.len() <= (1 << 20) + (64 << 10)));
    let back: Vec<Response> = parts
        .iter()
        .flat_map(|p| decode_responses(p).unwrap())
        .collect();
    assert_eq!(back, out);
}

#[test]
fn ranks_text_turns_runs_into_ranges() {
    use super::ranks_text;
    assert_eq!(ranks_text(&[]), "[]");
    assert_eq!(ranks_text(&[2]), "[2]");
    assert_eq!(ranks_text(&[0, 1]), "[0, 1]");
    assert_eq!(ranks_text(&[0, 1, 2, 5, 7, 8, 9, 10]), "[0-2, 5, 7-10]");
}

#[test]
fn a_mismatch_among_a_thousand_ranks_is_named_on_every_rank() {
    let n = 1000;
    let mut c = Coordinator::new(n, 1 << 20).with_cache(64);
    for r in 0..n {
        let shape: &[i64] = if r == 777 { &[5] } else { &[4] };
        let out = c.submit(r, vec![ar("w", shape)]);
        if r < n - 1 {
            assert!(out.is_empty(), "answered before rank {} asked", n - 1);
            continue;
        }
        assert_eq!(out.len(), 1, "{out:?}");
        let (to, resp) = &out[0];
        assert_eq!(to, &(0..n).collect::<Vec<_>>(), "every rank hears of it");
        let Response::Error { message, .. } = resp else {
            panic!("{resp:?}")
        };
        assert!(
            message.contains("rank 0 sent [4]") && message.contains("rank 777 sent [5]"),
            "{message}"
        );
    }
    // The job goes on: the next name is answered once the last rank asks.
    for r in 0..n {
        let out = c.submit(r, vec![ar("next", &[4])]);
        assert_eq!(out.is_empty(), r < n - 1, "rank {r}");
    }
}

#[test]
fn a_silent_rank_among_a_thousand_is_named_by_the_stall_check() {
    let n = 1000;
    let mut c = watched(n);
    let t0 = Instant::now();
    for r in (0..n).filter(|&r| r != 123) {
        assert!(c.submit(r, vec![ar("grad", &[8])]).is_empty());
    }
    let late = c.check_stalls(t0 + Duration::from_secs(61));
    assert_eq!(late.warnings.len(), 1, "{:?}", late.warnings);
    let w = &late.warnings[0];
    assert!(
        w.contains("'grad' has waited") && w.contains("for ranks [123]"),
        "{w}"
    );
    assert!(w.contains("(ranks [0-122, 124-999] submitted it)"), "{w}");
    // Joined and shut-down ranks are not waited for; the silent one still is.
    let mut j = Request::new(OpKind::Join, "join", 0);
    j.shape = vec![];
    c.submit(5, vec![j]);
    assert!(c.stall_watch());
    assert_eq!(
        c.submit(123, vec![ar("grad", &[8])]).len(),
        1,
        "answered at last"
    );
}
