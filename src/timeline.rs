//! A Chrome-trace JSON (the "array" format Perfetto and chrome://tracing
//! open) of every operation: one row per tensor name, a span per phase.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::sync::Mutex;
use std::time::Instant;

struct Open {
    out: BufWriter<File>,
    origin: Instant,
    first: bool,
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

    /// Starts writing to `path` (truncating it), closing any earlier file.
    pub fn start(&self, path: &str) -> std::io::Result<()> {
        self.stop();
        let mut out = BufWriter::new(File::create(path)?);
        out.write_all(b"[\n")?;
        *self.open.lock().unwrap() = Some(Open {
            out,
            origin: Instant::now(),
            first: true,
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
        let ts = start.saturating_duration_since(o.origin).as_secs_f64() * 1e6;
        let dur = end.saturating_duration_since(start).as_secs_f64() * 1e6;
        let sep = if o.first { "" } else { ",\n" };
        o.first = false;
        let _ = write!(
            o.out,
            "{sep}{{\"name\":\"{}\",\"cat\":\"{}\",\"ph\":\"X\",\"ts\":{ts:.3},\"dur\":{dur:.3},\
             \"pid\":{},\"tid\":\"{}\",\"args\":{{{args}}}}}",
            phase,
            phase,
            self.rank,
            escape(name)
        );
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        self.stop();
    }
}
