use super::*;
use crate::dtype::{DataType, ReduceOp};
use crate::engine::message::OpKind;
use crate::plan::Plan;

fn settings(log: Option<String>) -> AutotuneSettings {
    AutotuneSettings {
        log,
        warmup_samples: 2,
        steps_per_sample: 3,
        max_samples: 20,
        noise: 0.01,
        fusion: true,
        cycle: true,
        mode: true,
    }
}

fn start() -> Knobs {
    Knobs {
        fusion: 64 * MIB,
        cycle: Duration::from_millis(1),
        flat: false,
    }
}

/// One step's answers: two tensors of 1 Mi float32.
fn step() -> Outgoing {
    ["grad.a", "grad.b"]
        .iter()
        .map(|n| {
            let op = Response::Op {
                kind: OpKind::Allreduce,
                process_set: 0,
                names: vec![n.to_string()],
                shapes: vec![vec![1 << 20]],
                dtype: DataType::F32,
                op: ReduceOp::Average,
                root: 0,
                prescale: 1.0,
                postscale: 1.0,
                sizes: vec![],
                plan: Plan::default(),
            };
            (vec![0, 1], op)
        })
        .collect()
}

/// A made-up job whose step takes longer the farther the settings are from
/// 8 MiB and 2 ms; runs `t` until it is done, returning what it kept and the
/// settings of every step.
fn tune(t: &mut Tuner) -> (Knobs, Vec<Knobs>) {
    let mut now = Instant::now();
    let mut knobs = start();
    let mut history = Vec::new();
    for _ in 0..10_000 {
        if t.done() {
            return (knobs, history);
        }
        history.push(knobs);
        if let Some(k) = t.observe(&step(), now) {
            knobs = k;
        }
        now += step_time(knobs);
    }
    panic!("the tuner never finished");
}

fn step_time(k: Knobs) -> Duration {
    let f = (1.0 + k.fusion as f64 / MIB as f64).log2() - 9f64.log2();
    let c = (1.0 + k.cycle.as_secs_f64() * 1e3).log2() - 3f64.log2();
    Duration::from_secs_f64(0.010 * (1.0 + 0.3 * f * f + 0.2 * c * c))
}

#[test]
fn it_finds_the_fastest_settings_of_a_smooth_job_and_keeps_them() {
    let mut t = Tuner::new(settings(None), start()).unwrap();
    let (kept, _) = tune(&mut t);
    let mut all: Vec<Duration> = t.candidates.iter().map(|&c| step_time(c)).collect();
    all.sort();
    // Among the 3 fastest of the 63 settings (found in 20 samples).
    assert!(
        step_time(kept) <= all[2],
        "{kept:?}: {:?} vs {:?}",
        step_time(kept),
        all[0]
    );
    assert_eq!(t.scored.len(), 20);
    assert!(t.observe(&step(), Instant::now()).is_none());
}

#[test]
fn warmup_samples_run_the_start_and_every_sample_is_logged_with_its_steps() {
    let dir = std::env::temp_dir().join(format!("perseus-autotune-{}", std::process::id()));
    let path = dir.to_string_lossy().to_string() + ".csv";
    let mut s = settings(Some(path.clone()));
    s.max_samples = 5;
    let mut t = Tuner::new(s, start()).unwrap();
    let (kept, history) = tune(&mut t);
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let rows: Vec<Vec<&str>> = text
        .lines()
        .skip(1)
        .map(|l| l.split(',').collect())
        .collect();
    let phases: Vec<&str> = rows.iter().map(|r| r[1]).collect();
    assert_eq!(
        phases,
        ["warmup", "warmup", "sample", "sample", "sample", "sample", "sample", "best"]
    );
    for r in &rows[..7] {
        // Not given the mode as a knob.
        assert_eq!(r[4], "-", "{r:?}");
        assert_eq!(r[5], "3", "{r:?}");
        // Two tensors of 4 MiB a step.
        assert_eq!(r[7], (3 * 2 * 4 * MIB).to_string());
    }
    // Warmup and the first sample run the starting settings; then each sample another.
    for r in &rows[..3] {
        assert_eq!((r[2], r[3]), ("67108864", "1"));
    }
    let tried: HashSet<(&str, &str)> = rows[2..7].iter().map(|r| (r[2], r[3])).collect();
    assert_eq!(tried.len(), 5);
    let best = &rows[7];
    assert_eq!(best[2], kept.fusion.to_string());
    assert!(tried.contains(&(best[2], best[3])));
    // The first 1 + 3 * 3 steps (one to start, three samples) ran the start.
    assert!(history[..10].iter().all(|k| *k == start()));
}

#[test]
fn a_knob_set_by_hand_is_held_constant() {
    let mut s = settings(None);
    s.fusion = false;
    s.max_samples = 6;
    let mut t = Tuner::new(s, start()).unwrap();
    let (kept, history) = tune(&mut t);
    // The start (1 ms) is one of the cycle times tried.
    assert_eq!(t.candidates.len(), CYCLE_MS.len());
    assert!(history.iter().all(|k| k.fusion == 64 * MIB));
    assert_eq!(kept.fusion, 64 * MIB);
    let cycles: HashSet<u128> = history.iter().map(|k| k.cycle.as_micros()).collect();
    assert!(cycles.len() >= 5, "{cycles:?}");
}

#[test]
fn an_unwritable_log_is_an_error_naming_the_file() {
    let e = Tuner::new(
        settings(Some("/nonexistent-dir/autotune.csv".into())),
        start(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("HOROVOD_AUTOTUNE_LOG=/nonexistent-dir/autotune.csv"),
        "{e}"
    );
}

#[test]
fn answers_that_never_repeat_a_name_never_change_the_settings() {
    let mut t = Tuner::new(settings(None), start()).unwrap();
    for i in 0..100 {
        let mut out = step();
        if let Response::Op { names, .. } = &mut out[0].1 {
            names[0] = format!("once.{i}");
        }
        out.truncate(1);
        assert!(t.observe(&out, Instant::now()).is_none());
    }
    assert_eq!(t.samples, 0);
}

#[test]
fn where_the_hosts_allow_a_hierarchy_the_mode_is_a_knob_too() {
    // Not where they do not, nor where the mode was set by hand.
    let t = Tuner::new(settings(None), start()).unwrap();
    assert_eq!(t.with_mode_choice(false).candidates.len(), 63);
    let mut s = settings(None);
    s.mode = false;
    let t = Tuner::new(s, start()).unwrap();
    assert_eq!(t.with_mode_choice(true).candidates.len(), 63);

    // A job on which the flat ring is faster: the tuner finds it.
    let mut t = Tuner::new(settings(None), start())
        .unwrap()
        .with_mode_choice(true);
    assert_eq!(t.candidates.len(), 126);
    let flat_pays = |k: Knobs| step_time(k) + Duration::from_millis(if k.flat { 0 } else { 4 });
    let mut now = Instant::now();
    let mut knobs = start();
    let mut seen_modes = HashSet::new();
    while !t.done() {
        seen_modes.insert(knobs.flat);
        if let Some(k) = t.observe(&step(), now) {
            knobs = k;
        }
        now += flat_pays(knobs);
    }
    assert!(knobs.flat, "{knobs:?}");
    assert_eq!(seen_modes.len(), 2);
    let mut all: Vec<Duration> = t.candidates.iter().map(|&c| flat_pays(c)).collect();
    all.sort();
    assert!(flat_pays(knobs) <= all[4], "{knobs:?}");
}
