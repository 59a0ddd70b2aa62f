//! HOROVOD_AUTOTUNE: rank 0's coordinator tries fusion thresholds and cycle
//! times during the first steps of training and keeps the best.
//!
//! The tuner watches the answers the coordinator sends. A step ends where a
//! tensor name comes again (as each step's gradients do); a sample is
//! HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE steps, scored by the bytes its answers
//! carried per second of wall time, which with the same tensors every step is
//! the inverse of the step time. The first HOROVOD_AUTOTUNE_WARMUP_SAMPLES
//! samples run the starting settings and are discarded; then each sample's
//! settings are chosen from a grid by the expected improvement of a Gaussian
//! process fitted to the scores so far ([`gp`]). After
//! HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES samples (or the whole grid), the
//! settings with the best fitted score are kept for the rest of the job.
//!
//! On a job whose hosts each run the same number (two or more) of ranks, with
//! no allreduce mode set, the tuner also chooses between the hierarchical
//! allreduce (what an automatic mode runs there) and the flat ring.
//!
//! A new fusion threshold takes effect in the coordinator at once; a new cycle
//! time and mode travel to every rank as [`Response::Params`], behind the
//! answers formed before. The step in progress when settings change ran under
//! both, so it is left out of every sample.

mod gp;

use super::message::Response;
use super::outgoing::Outgoing;
use crate::config::AutotuneSettings;
use crate::error::{PerseusError, Result};
use gp::{Gp, Point};
use std::collections::HashSet;
use std::fs::File;
use std::io::Write;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
/// Fusion thresholds tried, in MiB (0 turns fusion off).
const FUSION_MIB: [u64; 9] = [0, 1, 2, 4, 8, 16, 32, 64, 128];
/// Cycle times tried, in milliseconds.
const CYCLE_MS: [f64; 7] = [0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0];

/// The settings autotuning moves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Knobs {
    /// Largest fused buffer, bytes.
    pub fusion: u64,
    /// How long new requests are held while others await their answer.
    pub cycle: Duration,
    /// Allreduces of an automatic mode run the flat ring, not the hierarchy.
    pub flat: bool,
}

impl Knobs {
    /// The cycle time in milliseconds, as the variable is written.
    pub fn cycle_ms(&self) -> f64 {
        self.cycle.as_micros() as f64 / 1e3
    }

    /// Each knob scaled to [0, 1] on a log scale, as the Gaussian process sees it.
    fn point(&self) -> Point {
        let mib = self.fusion as f64 / MIB as f64;
        let ms = self.cycle_ms();
        let top_mib = FUSION_MIB[FUSION_MIB.len() - 1] as f64;
        let top_ms = CYCLE_MS[CYCLE_MS.len() - 1];
        [
            ((1.0 + mib).ln() / (1.0 + top_mib).ln()).min(1.0),
            ((1.0 + ms).ln() / (1.0 + top_ms).ln()).min(1.0),
            f64::from(u8::from(self.flat)),
        ]
    }
}

/// A sample being measured.
struct Sample {
    start: Instant,
    steps: u32,
    bytes: u64,
}

/// The tuner: fed the coordinator's answers, it says when settings change.
pub struct Tuner {
    settings: AutotuneSettings,
    current: Knobs,
    candidates: Vec<Knobs>,
    scored: Vec<(Knobs, f64)>,
    warmups_left: u32,
    seen: HashSet<(u32, String)>,
    sample: Option<Sample>,
    samples: u32,
    log: Option<File>,
    /// The allreduce mode is one of the knobs.
    modes: bool,
    done: bool,
}

impl Tuner {
    /// A tuner starting from `start`; opens (truncating) the log file if one
    /// is asked for, naming it in the error when it cannot.
    pub fn new(settings: AutotuneSettings, start: Knobs) -> Result<Tuner> {
        let fusions: Vec<u64> = if settings.fusion {
            FUSION_MIB.iter().map(|m| m * MIB).collect()
        } else {
            vec![start.fusion]
        };
        let cycles: Vec<Duration> = if settings.cycle {
            CYCLE_MS
                .iter()
                .map(|ms| Duration::from_secs_f64(ms / 1e3))
                .collect()
        } else {
            vec![start.cycle]
        };
        let mut candidates = vec![start];
        for &fusion in &fusions {
            for &cycle in &cycles {
                let k = Knobs {
                    fusion,
                    cycle,
                    flat: start.flat,
                };
                if k != start {
                    candidates.push(k);
                }
            }
        }
        let log = match &settings.log {
            None => None,
            Some(path) => {
                let mut f = File::create(path).map_err(|e| {
                    PerseusError::InvalidArgument(format!(
                        "HOROVOD_AUTOTUNE_LOG={path}: cannot write the autotune log: {e}"
                    ))
                })?;
                writeln!(
                    f,
                    "sample,phase,fusion_threshold_bytes,cycle_time_ms,hierarchical_allreduce,\
                     steps,seconds,bytes,score_bytes_per_second"
                )
                .map_err(|e| PerseusError::Io(format!("autotune log {path}: {e}")))?;
                Some(f)
            }
        };
        Ok(Tuner {
            warmups_left: settings.warmup_samples,
            settings,
            current: start,
            candidates,
            scored: Vec::new(),
            seen: HashSet::new(),
            sample: None,
            samples: 0,
            log,
            modes: false,
            done: false,
        })
    }

    /// Adds the allreduce mode to the knobs (flat ring against the hierarchy),
    /// where the settings allow it (no mode set by hand) and `fits`: the job's
    /// hosts each run the same number (two or more) of ranks.
    pub fn with_mode_choice(mut self, fits: bool) -> Tuner {
        if self.settings.mode && fits && !self.modes {
            self.modes = true;
            let flipped: Vec<Knobs> = self
                .candidates
                .iter()
                .map(|k| Knobs {
                    flat: !k.flat,
                    ..*k
                })
                .collect();
            self.candidates.extend(flipped);
        }
        self
    }

    /// True once the best settings are chosen: nothing more to watch.
    pub fn done(&self) -> bool {
        self.done
    }

    /// Watches answers sent at `now`; returns the new settings when they change.
    pub fn observe(&mut self, out: &Outgoing, now: Instant) -> Option<Knobs> {
        let mut changed = None;
        for (_, resp) in out {
            let Response::Op {
                process_set,
                names,
                shapes,
                dtype,
                ..
            } = resp
            else {
                continue;
            };
            for (name, shape) in names.iter().zip(shapes) {
                if self.done {
                    return changed;
                }
                let key = (*process_set, name.clone());
                if self.seen.contains(&key) {
                    self.seen.clear();
                    if let Some(k) = self.step_ended(now) {
                        changed = Some(k);
                    }
                }
                self.seen.insert(key);
                if let Some(s) = &mut self.sample {
                    let n: i64 = shape.iter().product();
                    s.bytes += n.max(0) as u64 * dtype.size() as u64;
                }
            }
        }
        changed
    }

    /// A step ended: counts it, and closes the sample when it is full.
    fn step_ended(&mut self, now: Instant) -> Option<Knobs> {
        let Some(s) = &mut self.sample else {
            self.sample = Some(Sample {
                start: now,
                steps: 0,
                bytes: 0,
            });
            return None;
        };
        s.steps += 1;
        if s.steps < self.settings.steps_per_sample {
            return None;
        }
        let (steps, bytes) = (s.steps, s.bytes);
        let secs = now.saturating_duration_since(s.start).as_secs_f64();
        let score = bytes as f64 / secs.max(1e-9);
        let next = self.conclude(steps, secs, bytes, score);
        if next == self.current {
            self.sample = Some(Sample {
                start: now,
                steps: 0,
                bytes: 0,
            });
            return None;
        }
        // The step now starting may run partly under the old settings.
        self.sample = None;
        self.current = next;
        Some(next)
    }

    /// Records a finished sample and picks the settings of the next.
    fn conclude(&mut self, steps: u32, secs: f64, bytes: u64, score: f64) -> Knobs {
        self.samples += 1;
        let row = (steps, secs, bytes, score);
        if self.warmups_left > 0 {
            self.warmups_left -= 1;
            self.write("warmup", self.current, Some(row));
            return self.current;
        }
        self.write("sample", self.current, Some(row));
        self.scored.push((self.current, score));
        let untried: Vec<Knobs> = self
            .candidates
            .iter()
            .copied()
            .filter(|c| self.scored.iter().all(|(k, _)| k != c))
            .collect();
        let gp = self.fit();
        if self.scored.len() >= self.settings.max_samples as usize || untried.is_empty() {
            self.done = true;
            let best = self
                .scored
                .iter()
                .map(|(k, _)| (*k, gp.predict(&k.point()).0))
                .fold(None, |b: Option<(Knobs, f64)>, (k, s)| match b {
                    Some((_, bs)) if bs >= s => b,
                    _ => Some((k, s)),
                })
                .map_or(self.current, |(k, _)| k);
            self.write("best", best, None);
            let mode = if self.modes {
                format!(" PERSEUS_ALLREDUCE_MODE={}", u8::from(!best.flat))
            } else {
                String::new()
            };
            crate::log!(
                crate::log::Level::Info,
                "autotune: after {} samples, keeping HOROVOD_FUSION_THRESHOLD={} \
                 HOROVOD_CYCLE_TIME={}{mode}",
                self.scored.len(),
                best.fusion,
                best.cycle_ms()
            );
            return best;
        }
        let top = self.scored.iter().map(|(_, s)| *s).fold(f64::MIN, f64::max);
        untried
            .into_iter()
            .map(|k| (k, gp.expected_improvement(&k.point(), top)))
            .fold(None, |b: Option<(Knobs, f64)>, (k, ei)| match b {
                Some((_, be)) if be >= ei => b,
                _ => Some((k, ei)),
            })
            .map_or(self.current, |(k, _)| k)
    }

    fn fit(&self) -> Gp {
        let xs: Vec<Point> = self.scored.iter().map(|(k, _)| k.point()).collect();
        let ys: Vec<f64> = self.scored.iter().map(|(_, s)| *s).collect();
        Gp::fit(&xs, &ys, self.settings.noise)
    }

    /// One CSV row: a sample's measurement, or (`None`) the settings kept.
    fn write(&mut self, phase: &str, k: Knobs, row: Option<(u32, f64, u64, f64)>) {
        let Some(f) = &mut self.log else { return };
        let ms = k.cycle_ms();
        // 1: the hierarchy where it fits; "-": the mode is not a knob here.
        let hier = if self.modes {
            u8::from(!k.flat).to_string()
        } else {
            "-".into()
        };
        let line = match row {
            Some((steps, secs, bytes, score)) => format!(
                "{},{phase},{},{ms},{hier},{steps},{secs:.6},{bytes},{score:.0}",
                self.samples, k.fusion
            ),
            None => format!("{},{phase},{},{ms},{hier},,,,", self.samples, k.fusion),
        };
        // A log that stops being writable must not stop training.
        let _ = writeln!(f, "{line}").and_then(|_| f.flush());
    }
}

#[cfg(test)]
mod tests;
