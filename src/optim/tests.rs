//! The fused host step against plain double-precision references written the way the
//! papers state the rules, and against values worked by hand.

use super::*;
use crate::device::tensor::f32_view;

/// One parameter's arrays, owned by the test.
#[derive(Clone, Debug, PartialEq)]
struct Param {
    w: Vec<f32>,
    g: Vec<f32>,
    s: Vec<Vec<f32>>,
}

impl Param {
    fn new(n: usize, seed: u32, states: usize) -> Param {
        let val = |i: usize, k: u32| {
            let x = (i as u32)
                .wrapping_mul(2654435761)
                .wrapping_add(seed * 97 + k)
                % 2001;
            (x as f32 - 1000.0) / 700.0
        };
        Param {
            w: (0..n).map(|i| val(i, 1)).collect(),
            g: (0..n).map(|i| val(i, 2) * 0.1).collect(),
            s: vec![vec![0.0; n]; states],
        }
    }

    fn slot(&mut self, step: u64) -> Slot {
        Slot {
            weight: f32_view(&mut self.w, Device::Cpu),
            grad: f32_view(&mut self.g, Device::Cpu),
            state: self
                .s
                .iter_mut()
                .map(|s| f32_view(s, Device::Cpu))
                .collect(),
            step,
        }
    }
}

/// Runs `steps` fused steps of `rule` over `params` (the gradient changes every step).
fn fused(rule: Rule, params: &mut [Param], steps: u64) {
    for t in 1..=steps {
        let slots = params.iter_mut().map(|p| p.slot(t)).collect();
        step(&[Group { rule, slots }]).unwrap();
        for p in params.iter_mut() {
            p.g.iter_mut().for_each(|g| *g = -0.7 * *g + 0.01);
        }
    }
}

/// The same in double precision, element by element, the way the rules are written.
fn reference(rule: Rule, params: &[Param], steps: u64) -> Vec<Vec<f64>> {
    let mut w: Vec<Vec<f64>> = params
        .iter()
        .map(|p| p.w.iter().map(|&x| x as f64).collect())
        .collect();
    let mut g: Vec<Vec<f64>> = params
        .iter()
        .map(|p| p.g.iter().map(|&x| x as f64).collect())
        .collect();
    let zeros = |p: &Param| vec![0.0f64; p.w.len()];
    let mut m: Vec<Vec<f64>> = params.iter().map(zeros).collect();
    let mut v: Vec<Vec<f64>> = params.iter().map(zeros).collect();
    for t in 1..=steps {
        let tf = t as f64;
        let gnorm = g.iter().flatten().map(|x| x * x).sum::<f64>().sqrt();
        for k in 0..w.len() {
            let (w, g, m, v) = (&mut w[k], &g[k], &mut m[k], &mut v[k]);
            match rule {
                Rule::Sgd(h) => {
                    for i in 0..w.len() {
                        let s = if h.maximize { -1.0 } else { 1.0 };
                        let d = s * g[i] + h.weight_decay * w[i];
                        let mut step = d;
                        if h.momentum != 0.0 {
                            m[i] = if t == 1 {
                                d
                            } else {
                                h.momentum * m[i] + (1.0 - h.dampening) * d
                            };
                            step = if h.nesterov {
                                d + h.momentum * m[i]
                            } else {
                                m[i]
                            };
                        }
                        w[i] -= h.lr * step;
                    }
                }
                Rule::Adam(h) => {
                    for i in 0..w.len() {
                        let mut gi = if h.maximize { -g[i] } else { g[i] };
                        if h.decoupled {
                            w[i] *= 1.0 - h.lr * h.weight_decay;
                        } else {
                            gi += h.weight_decay * w[i];
                        }
                        m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * gi;
                        v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * gi * gi;
                        let mh = m[i] / (1.0 - h.beta1.powf(tf));
                        let vh = v[i] / (1.0 - h.beta2.powf(tf));
                        w[i] -= h.lr * mh / (vh.sqrt() + h.eps);
                    }
                }
                Rule::Lamb(h) => {
                    let clip = if h.max_grad_norm > 0.0 && gnorm > h.max_grad_norm {
                        gnorm / h.max_grad_norm
                    } else {
                        1.0
                    };
                    let beta3 = if h.grad_averaging { 1.0 - h.beta1 } else { 1.0 };
                    let mut u = vec![0.0; w.len()];
                    for i in 0..w.len() {
                        let mut gi = g[i] / clip;
                        if !h.adam_w_mode {
                            gi += h.weight_decay * w[i];
                        }
                        m[i] = h.beta1 * m[i] + beta3 * gi;
                        v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * gi * gi;
                        let mh = m[i] / (1.0 - h.beta1.powf(tf));
                        let vh = v[i] / (1.0 - h.beta2.powf(tf));
                        u[i] = mh / (vh.sqrt() + h.eps);
                        if h.adam_w_mode {
                            u[i] += h.weight_decay * w[i];
                        }
                    }
                    let wn = w.iter().map(|x| x * x).sum::<f64>().sqrt();
                    let un = u.iter().map(|x| x * x).sum::<f64>().sqrt();
                    let adapt = h.always_adapt || h.weight_decay != 0.0;
                    let ratio = if adapt && wn > 0.0 && un > 0.0 {
                        wn / un
                    } else {
                        1.0
                    };
                    for i in 0..w.len() {
                        w[i] -= h.lr * ratio * u[i];
                    }
                }
            }
        }
        for gk in g.iter_mut() {
            gk.iter_mut()
                .for_each(|x| *x = -0.7f32 as f64 * *x + 0.01f32 as f64);
        }
    }
    w
}

fn assert_close(got: &[Param], want: &[Vec<f64>], rtol: f64) {
    for (k, (p, w)) in got.iter().zip(want).enumerate() {
        for (i, (&a, &b)) in p.w.iter().zip(w).enumerate() {
            let tol = rtol * (1.0 + b.abs());
            assert!(
                (a as f64 - b).abs() <= tol,
                "param {k} element {i}: fused {a}, reference {b}"
            );
        }
    }
}

fn sgd(momentum: f64, dampening: f64, nesterov: bool, maximize: bool) -> Rule {
    Rule::Sgd(Sgd {
        lr: 0.1,
        momentum,
        dampening,
        weight_decay: 0.01,
        nesterov,
        maximize,
    })
}

fn adam(decoupled: bool) -> Rule {
    Rule::Adam(Adam {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.05,
        decoupled,
        maximize: false,
    })
}

fn lamb(adam_w_mode: bool, weight_decay: f64, max_grad_norm: f64) -> Rule {
    Rule::Lamb(Lamb {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-6,
        weight_decay,
        adam_w_mode,
        grad_averaging: true,
        bias_correction: true,
        max_grad_norm,
        always_adapt: false,
    })
}

/// Small parameters (one part each) and one large enough to be split across threads.
fn params(states: usize) -> Vec<Param> {
    vec![
        Param::new(1, 1, states),
        Param::new(37, 2, states),
        Param::new(0, 3, states),
        Param::new(BIG, 4, states),
    ]
}

/// Enough elements for the host step to use two threads (and several parts each).
const BIG: usize = (1 << 19) + 5;

#[test]
fn sgd_matches_the_reference_in_every_variant() {
    for (momentum, dampening, nesterov, maximize) in [
        (0.0, 0.0, false, false),
        (0.9, 0.0, false, false),
        (0.9, 0.3, false, false),
        (0.9, 0.0, true, false),
        (0.5, 0.0, false, true),
    ] {
        let rule = sgd(momentum, dampening, nesterov, maximize);
        let mut p = params(rule.state_names().len());
        let want = reference(rule, &p, 4);
        fused(rule, &mut p, 4);
        assert_close(&p, &want, 1e-5);
    }
}

#[test]
fn sgd_first_steps_by_hand() {
    // w = 1, g = 0.5, lr 0.1, momentum 0.9, weight decay 0.01.
    let rule = sgd(0.9, 0.0, false, false);
    let mut p = Param {
        w: vec![1.0],
        g: vec![0.5],
        s: vec![vec![123.0]],
    };
    step(&[Group {
        rule,
        slots: vec![p.slot(1)],
    }])
    .unwrap();
    // Step 1: the buffer starts as d = 0.5 + 0.01 = 0.51 (whatever it held); w = 0.949.
    assert!((p.s[0][0] - 0.51).abs() < 1e-6, "{:?}", p.s);
    assert!((p.w[0] - 0.949).abs() < 1e-6, "{:?}", p.w);
    step(&[Group {
        rule,
        slots: vec![p.slot(2)],
    }])
    .unwrap();
    // Step 2: d = 0.5 + 0.00949; buffer = 0.9 * 0.51 + d = 0.96849; w = 0.949 - 0.096849.
    assert!((p.s[0][0] - 0.96849).abs() < 1e-6, "{:?}", p.s);
    assert!((p.w[0] - 0.852151).abs() < 1e-6, "{:?}", p.w);
}

#[test]
fn adam_and_adamw_match_the_reference() {
    for decoupled in [false, true] {
        let rule = adam(decoupled);
        let mut p = params(2);
        let want = reference(rule, &p, 5);
        fused(rule, &mut p, 5);
        assert_close(&p, &want, 1e-5);
    }
}

#[test]
fn adam_first_step_moves_each_weight_by_the_learning_rate() {
    // On step 1 Adam's bias-corrected step is lr * g / (|g| + eps): lr toward -sign(g).
    let rule = Rule::Adam(Adam {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        decoupled: false,
        maximize: false,
    });
    let mut p = Param {
        w: vec![1.0, 1.0, 1.0],
        g: vec![3.0, -0.002, 0.0],
        s: vec![vec![0.0; 3]; 2],
    };
    step(&[Group {
        rule,
        slots: vec![p.slot(1)],
    }])
    .unwrap();
    assert!((p.w[0] - 0.99).abs() < 1e-6, "{:?}", p.w);
    assert!((p.w[1] - 1.01).abs() < 1e-6, "{:?}", p.w);
    assert_eq!(p.w[2], 1.0);
    assert!((p.s[0][0] - 0.3).abs() < 1e-6 && (p.s[1][0] - 0.009).abs() < 1e-7);
}

#[test]
fn lamb_matches_the_reference_with_and_without_clipping_and_decay() {
    for (adam_w_mode, weight_decay, max_grad_norm) in [
        (true, 0.01, 1.0),
        (true, 0.01, 0.0),
        (false, 0.01, 1.0),
        (true, 0.0, 1000.0),
    ] {
        let rule = lamb(adam_w_mode, weight_decay, max_grad_norm);
        let mut p = params(2);
        let want = reference(rule, &p, 3);
        fused(rule, &mut p, 3);
        assert_close(&p, &want, 2e-5);
    }
}

#[test]
fn lamb_clips_by_the_global_norm_and_scales_by_the_trust_ratio_by_hand() {
    // |g| = 1 > max_grad_norm 0.5: g becomes [0.3, 0.4]. Step 1: m^ = g, v^ = g^2, so the
    // Adam part is ~[1, 1]; plus 0.1 * w = [0.3, 0.4]: u = [1.3, 1.4] (|u| = 1.910497).
    // |w| = 5: the step is 0.01 * 5 / 1.910497 = 0.0261712 times u.
    let rule = Rule::Lamb(Lamb {
        weight_decay: 0.1,
        max_grad_norm: 0.5,
        ..match lamb(true, 0.0, 0.0) {
            Rule::Lamb(l) => l,
            _ => unreachable!(),
        }
    });
    let mut p = Param {
        w: vec![3.0, 4.0],
        g: vec![0.6, 0.8],
        s: vec![vec![0.0; 2]; 2],
    };
    step(&[Group {
        rule,
        slots: vec![p.slot(1)],
    }])
    .unwrap();
    assert!((p.w[0] - 2.965977).abs() < 2e-5, "{:?}", p.w);
    assert!((p.w[1] - 3.963_36).abs() < 2e-5, "{:?}", p.w);
    assert!((p.s[0][0] - 0.03).abs() < 1e-6, "{:?}", p.s);
}

#[test]
fn groups_with_different_rules_run_in_one_step() {
    let rules = [
        sgd(0.9, 0.0, true, false),
        adam(true),
        lamb(true, 0.01, 1.0),
    ];
    let mut ps: Vec<Vec<Param>> = rules
        .iter()
        .map(|r| vec![Param::new(50, 7, r.state_names().len())])
        .collect();
    let want: Vec<Vec<Vec<f64>>> = rules
        .iter()
        .zip(&ps)
        .map(|(r, p)| reference(*r, p, 1))
        .collect();
    let groups: Vec<Group> = rules
        .iter()
        .zip(ps.iter_mut())
        .map(|(r, p)| Group {
            rule: *r,
            slots: p.iter_mut().map(|p| p.slot(1)).collect(),
        })
        .collect();
    step(&groups).unwrap();
    for (p, w) in ps.iter().zip(&want) {
        assert_close(p, w, 1e-5);
    }
}

fn bad(groups: &[Group]) -> String {
    step(groups).unwrap_err().to_string()
}

#[test]
fn bad_tensors_are_refused_before_anything_is_written() {
    let rule = adam(false);
    let mut ok = Param::new(4, 1, 2);
    let before = ok.clone();
    let mut short = Param::new(4, 2, 2);
    short.s[1].pop();
    let err = bad(&[Group {
        rule,
        slots: vec![ok.slot(1), short.slot(1)],
    }]);
    assert!(
        err.contains("Adam parameter 1 of group 0: exp_avg_sq has 3 elements, the weight 4"),
        "{err}"
    );
    assert_eq!(ok, before, "nothing is written when one tensor is bad");

    let mut one_state = Param::new(4, 3, 1);
    let err = bad(&[Group {
        rule,
        slots: vec![one_state.slot(1)],
    }]);
    assert!(
        err.contains("expected 2 state tensors (exp_avg, exp_avg_sq), got 1"),
        "{err}"
    );

    let mut half = Param::new(4, 4, 2);
    let mut s = half.slot(1);
    s.grad.dtype = crate::dtype::DataType::F16;
    s.grad.nbytes = 16;
    let err = step(&[Group {
        rule,
        slots: vec![s],
    }])
    .unwrap_err();
    assert!(matches!(err, PerseusError::UnsupportedType(_)), "{err:?}");
    assert!(err.to_string().contains("grad is float16"), "{err}");

    let mut gpu = Param::new(4, 5, 2);
    let mut s = gpu.slot(1);
    s.state[0].device = Device::Cuda(0);
    let err = bad(&[Group {
        rule,
        slots: vec![ok.slot(1), s],
    }]);
    assert!(
        err.contains("exp_avg is on cuda:0, other tensors on cpu"),
        "{err}"
    );

    let err = bad(&[Group {
        rule,
        slots: vec![ok.slot(0)],
    }]);
    assert!(err.contains("step count starts at 1"), "{err}");
}

#[test]
fn shared_memory_between_written_tensors_is_refused() {
    let rule = adam(true);
    let mut p = Param::new(8, 1, 2);
    let mut s = p.slot(1);
    s.state[1] = s.state[0].clone();
    let err = bad(&[Group {
        rule,
        slots: vec![s],
    }]);
    assert!(
        err.contains("exp_avg") && err.contains("share memory"),
        "{err}"
    );
    let mut q = Param::new(8, 2, 0);
    let mut s = q.slot(1);
    s.grad = s.weight.clone();
    let err = bad(&[Group {
        rule: sgd(0.0, 0.0, false, false),
        slots: vec![s],
    }]);
    assert!(
        err.contains("weight and SGD parameter 0 of group 0: grad share memory"),
        "{err}"
    );
}

#[test]
fn cuda_tensors_without_the_gpu_build_are_a_clear_error() {
    let mut p = Param::new(4, 1, 0);
    let mut s = p.slot(1);
    s.weight.device = Device::Cuda(0);
    s.grad.device = Device::Cuda(0);
    if cfg!(feature = "cuda") {
        return; // the GPU build reaches the device (tested where a GPU is lent).
    }
    let err = step(&[Group {
        rule: sgd(0.0, 0.0, false, false),
        slots: vec![s],
    }])
    .unwrap_err();
    assert!(matches!(err, PerseusError::GpuUnavailable(_)), "{err:?}");
    assert!(err.to_string().contains("no GPU support"), "{err}");
}
