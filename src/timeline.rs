//! A Chrome-trace JSON (the "array" format Perfetto and chrome://tracing
//! open) of every operation: one row per tensor name, a span per phase; and,
//! when asked (HOROVOD_TIMELINE_MARK_CYCLES, `start_timeline(mark_cycles=True)`),
//! an instant `CYCLE_START` for each batch of requests a rank sends to negotiation.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::sync::Mutex;
use std::time::Instant;

struct Open {
    out: BufWriter<File>,
    origin: Instant,
    first: bool,
    mark_cycles: bool,
}

impl Open {
    /// Writes one event (a JSON object), after a comma unless it is the first.
    fn event(&mut self, body: std::fmt::Arguments) {
        let sep = if self.first { "" } else { ",\n" };
        self.first = false;
        let _ = write!(self.out, "{sep}{{{body}}}");
    }

    /// Microseconds from the start of the timeline to `t`.
    fn micros(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.origin).as_secs_f64() * 1e6
    }
}

/// A timeline that is written while started.
pub struct Timeline {
    rank: usize,
    open: Mutex<Option<Open>>,
}

fn escape(s: &str) -> String {
    s.chars()
        .flat_map(|c| match c {
            '"' => vec!['\\', '"'],
            '\\' => vec!['\\', '\\'],
            c if (c as u32) < 0x20 => format!("\\u{:04x}", c as u32).chars().collect(),
            c => vec![c],
        })
        .collect()
}

impl Timeline {
    /// A stopped timeline for `rank`.
    pub fn new(rank: usize) -> Timeline {
        Timeline {
            rank,
            open: Mutex::new(None),
        }
    }

    /// Starts writing to [`rank_path`]`(path)` (truncating it), closing any
    /// earlier file; `mark_cycles`: with [`Timeline::mark_cycle`]'s marks.
    pub fn start(&self, path: &str, mark_cycles: bool) -> std::io::Result<()> {
        self.stop();
        let mut out = BufWriter::new(File::create(rank_path(path, self.rank))?);
        out.write_all(b"[\n")?;
        *self.open.lock().unwrap() = Some(Open {
            out,
            origin: Instant::now(),
            first: true,
            mark_cycles,
        });
        Ok(())
    }

    /// Finishes the JSON and closes the file.
    pub fn stop(&self) {
        if let Some(mut o) = self.open.lock().unwrap().take() {
            let _ = o.out.write_all(b"\n]\n");
            let _ = o.out.flush();
        }
    }

    /// True while writing.
    pub fn active(&self) -> bool {
        self.open.lock().unwrap().is_some()
    }

    /// Records a span `phase` of tensor `name` from `start` to `end`.
    pub fn span(&self, name: &str, phase: &str, start: Instant, end: Instant, args: &str) {
        let mut g = self.open.lock().unwrap();
        let Some(o) = g.as_mut() else { return };
        let ts = o.micros(start);
        let dur = end.saturating_duration_since(start).as_secs_f64() * 1e6;
        o.event(format_args!(
            "\"name\":\"{phase}\",\"cat\":\"{phase}\",\"ph\":\"X\",\"ts\":{ts:.3},\
             \"dur\":{dur:.3},\"pid\":{},\"tid\":\"{}\",\"args\":{{{args}}}",
            self.rank,
            escape(name)
        ));
    }

    /// Marks the start of a negotiation cycle, a batch of `requests` requests sent to
    /// the coordinator, when the timeline was started with cycle marks: an instant
    /// `CYCLE_START` across the rank's rows.
    pub fn mark_cycle(&self, requests: usize) {
        let mut g = self.open.lock().unwrap();
        let Some(o) = g.as_mut().filter(|o| o.mark_cycles) else {
            return;
        };
        let ts = o.micros(Instant::now());
        o.event(format_args!(
            "\"name\":\"CYCLE_START\",\"cat\":\"CYCLE\",\"ph\":\"i\",\"s\":\"p\",\
             \"ts\":{ts:.3},\"pid\":{},\"tid\":\"cycles\",\"args\":{{\"requests\":{requests}}}",
            self.rank
        ));
    }
}

/// The file rank `rank` writes for the timeline `path`: rank 0 writes `path`
/// itself (as Horovod's coordinator does), rank `r` writes `path.r`, so
/// ranks given the same path (PERSEUS_TIMELINE reaches every rank) do not
/// write one file at once.
pub fn rank_path(path: &str, rank: usize) -> String {
    if rank == 0 {
        path.to_string()
    } else {
        format!("{path}.{rank}")
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_given_one_path_write_files_of_their_own() {
        let path = std::env::temp_dir().join(format!("perseus-tl-{}.json", std::process::id()));
        let path = path.to_str().unwrap();
        let lines: Vec<Timeline> = (0..3).map(Timeline::new).collect();
        let t = Instant::now();
        for (r, tl) in lines.iter().enumerate() {
            tl.start(path, false).unwrap();
            tl.span(&format!("t{r}"), "ALLREDUCE", t, t, "");
            tl.mark_cycle(1); // not asked for
        }
        lines.iter().for_each(Timeline::stop);
        for r in 0..3 {
            let file = rank_path(path, r);
            let text = std::fs::read_to_string(&file).unwrap();
            assert!(text.starts_with("[\n") && text.ends_with("\n]\n"), "{text}");
            assert!(
                text.contains(&format!("\"pid\":{r},\"tid\":\"t{r}\"")),
                "{text}"
            );
            assert_eq!(text.matches("\"name\"").count(), 1, "{text}");
            std::fs::remove_file(file).unwrap();
        }
        assert_eq!(rank_path(path, 2), format!("{path}.2"));
    }

    #[test]
    fn cycle_marks_are_instants_written_only_when_asked_for() {
        let path = std::env::temp_dir().join(format!("perseus-tlc-{}.json", std::process::id()));
        let path = path.to_str().unwrap();
        let tl = Timeline::new(1);
        tl.mark_cycle(3); // stopped: nothing to write to
        tl.start(path, true).unwrap();
        let t = Instant::now();
        tl.mark_cycle(2);
        tl.span("x", "ALLREDUCE", t, t, "");
        tl.mark_cycle(1);
        tl.stop();
        let file = rank_path(path, 1);
        let text = std::fs::read_to_string(&file).unwrap();
        std::fs::remove_file(&file).unwrap();
        assert!(text.starts_with("[\n") && text.ends_with("\n]\n"), "{text}");
        let marks: Vec<&str> = text.lines().filter(|l| l.contains("CYCLE_START")).collect();
        assert_eq!(marks.len(), 2, "{text}");
        assert!(marks[0].contains("\"ph\":\"i\",\"s\":\"p\""), "{text}");
        assert!(marks[0].contains("\"pid\":1,") && marks[0].contains("{\"requests\":2}"));
        assert!(marks[1].contains("{\"requests\":1}"), "{text}");
        assert_eq!(text.matches("\"ph\":\"X\"").count(), 1, "{text}");
    }
}
