//! A Chrome-trace JSON (the "array" format Perfetto and chrome://tracing
//! open) of every operation, laid out as Horovod's timeline is, so tools made
//! for Horovod's read it: each tensor is a "process" (a `pid` of its own,
//! named by a `process_name` metadata event whose `args.name` is the tensor's
//! row name, `<op>.<name>`: engine::timeline_names), with a span per phase; pid 0 holds the file's
//! header (`args.start_time_since_epoch_in_micros`, and the rank) and,
//! when asked (HOROVOD_TIMELINE_MARK_CYCLES, `start_timeline(mark_cycles=True)`),
//! an instant `CYCLE_START` for each batch of requests a rank sends to
//! negotiation. The phase names are Horovod's where Horovod has one
//! (`NEGOTIATE_ALLREDUCE`, `ALLREDUCE`, `MEMCPY_IN_FUSION_BUFFER`, ...; see
//! docs/environment.md, PERSEUS_TIMELINE).
//!
//! The file is streamed: it is valid JSON on disk while the job runs. Events
//! gather in memory and are written in batches, each batch followed by the
//! array's closing `]`, which the next batch overwrites (Horovod writes each
//! record followed by `]` and seeks back over it). The engine calls
//! [`Timeline::tick`] every cycle, which writes what gathered once
//! [`FLUSH_EVERY`] has passed since the last write; so events reach the file
//! at most that long after they happen, idle or busy, and never one write
//! per event.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::dtype::DataType;

/// The longest events wait in memory before they are written to the file.
pub const FLUSH_EVERY: Duration = Duration::from_millis(100);

/// Bytes of events written at once, however little time has passed.
const HOLD_MAX: usize = 1 << 20;

/// What ends the file after the events written so far; the next batch
/// starts where it starts.
const END: &str = "\n]\n";

struct Open {
    file: File,
    /// Events not written yet, each after `,\n`.
    pending: String,
    origin: Instant,
    mark_cycles: bool,
    /// Row name to pid, in order of first use (from 1; pid 0 is the header).
    rows: HashMap<String, u64>,
    /// When `pending` was last written.
    written: Instant,
}

impl Open {
    /// Adds one event (a JSON object's members).
    fn event(&mut self, body: std::fmt::Arguments) {
        let _ = write!(self.pending, ",\n{{{body}}}");
    }

    /// The pid of row `name`, announced (`process_name`, `process_sort_index`)
    /// the first time it is used.
    fn row(&mut self, name: &str) -> u64 {
        if let Some(&pid) = self.rows.get(name) {
            return pid;
        }
        let pid = self.rows.len() as u64 + 1;
        self.rows.insert(name.to_string(), pid);
        let escaped = escape(name);
        self.event(format_args!(
            "\"name\": \"process_name\", \"ph\": \"M\", \"pid\": {pid}, \
             \"args\": {{\"name\": \"{escaped}\"}}"
        ));
        self.event(format_args!(
            "\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": {pid}, \
             \"args\": {{\"sort_index\": {pid}}}"
        ));
        pid
    }

    /// Writes the pending events and the closing `]`, then moves back before
    /// the `]` so that the next write replaces it.
    fn write(&mut self) {
        self.written = Instant::now();
        if self.pending.is_empty() {
            return;
        }
        self.pending.push_str(END);
        let _ = self
            .file
            .write_all(self.pending.as_bytes())
            .and_then(|()| self.file.seek(SeekFrom::Current(-(END.len() as i64))));
        self.pending.clear();
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
    /// Events wait in memory (read without the lock by [`Timeline::tick`]).
    pending: AtomicBool,
}

fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

/// The `args` of an operation's top-level span: Horovod's `dtype` and `shape`
/// (as Horovod spells them: `HOROVOD_FLOAT32`, `[2, 3]`), and Perseus's `fused`,
/// the number of tensors that ran together.
pub fn op_args(dtype: DataType, shape: Option<&[i64]>, fused: usize) -> String {
    let mut args = format!("\"dtype\": \"HOROVOD_{}\"", dtype.name().to_uppercase());
    if let Some(shape) = shape {
        let dims: Vec<String> = shape.iter().map(i64::to_string).collect();
        let _ = write!(args, ", \"shape\": \"[{}]\"", dims.join(", "));
    }
    let _ = write!(args, ", \"fused\": {fused}");
    args
}

impl Timeline {
    /// A stopped timeline for `rank`.
    pub fn new(rank: usize) -> Timeline {
        Timeline {
            rank,
            open: Mutex::new(None),
            pending: AtomicBool::new(false),
        }
    }

    /// Starts writing to [`rank_path`]`(path)` (truncating it), closing any
    /// earlier file; `mark_cycles`: with [`Timeline::mark_cycle`]'s marks. The
    /// file holds its header (pid 0) at once, as a whole JSON array.
    pub fn start(&self, path: &str, mark_cycles: bool) -> std::io::Result<()> {
        self.stop();
        let file = File::create(rank_path(path, self.rank))?;
        let origin = Instant::now();
        let epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros());
        let mut o = Open {
            file,
            pending: String::new(),
            origin,
            mark_cycles,
            rows: HashMap::new(),
            written: origin,
        };
        let _ = write!(
            o.pending,
            "[\n{{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": 0, \
             \"args\": {{\"start_time_since_epoch_in_micros\": {epoch}, \"rank\": {}}}}},\n\
             {{\"name\": \"process_sort_index\", \"ph\": \"M\", \"pid\": 0, \
             \"args\": {{\"sort_index\": 0}}}}",
            self.rank
        );
        o.write();
        let mut g = self.open.lock().unwrap();
        if let Some(mut earlier) = g.replace(o) {
            earlier.write(); // started on another thread meanwhile
        }
        Ok(())
    }

    /// Writes what is pending, which finishes the JSON, and closes the file.
    pub fn stop(&self) {
        if let Some(mut o) = self.open.lock().unwrap().take() {
            o.write();
        }
        self.pending.store(false, Ordering::Relaxed);
    }

    /// True while writing.
    pub fn active(&self) -> bool {
        self.open.lock().unwrap().is_some()
    }

    /// Writes the pending events when [`FLUSH_EVERY`] has passed since the last
    /// write. Cheap when nothing is pending (no lock): the engine calls it
    /// every cycle.
    pub fn tick(&self) {
        if !self.pending.load(Ordering::Relaxed) {
            return;
        }
        let mut g = self.open.lock().unwrap();
        if let Some(o) = g.as_mut() {
            if o.written.elapsed() < FLUSH_EVERY {
                return;
            }
            o.write();
        }
        self.pending.store(false, Ordering::Relaxed);
    }

    /// How long until [`Timeline::tick`] has events to write, when some are
    /// pending: the longest an idle engine may sleep.
    pub fn due(&self) -> Option<Duration> {
        if !self.pending.load(Ordering::Relaxed) {
            return None;
        }
        let g = self.open.lock().unwrap();
        let o = g.as_ref()?;
        Some(FLUSH_EVERY.saturating_sub(o.written.elapsed()))
    }

    /// Writes the pending events now.
    pub fn flush(&self) {
        if let Some(o) = self.open.lock().unwrap().as_mut() {
            o.write();
        }
        self.pending.store(false, Ordering::Relaxed);
    }

    /// Runs `f` on the open file, if any, and notes that events wait.
    fn record(&self, f: impl FnOnce(&mut Open)) {
        let mut g = self.open.lock().unwrap();
        let Some(o) = g.as_mut() else { return };
        f(o);
        if o.pending.len() >= HOLD_MAX {
            o.write();
        }
        self.pending.store(!o.pending.is_empty(), Ordering::Relaxed);
    }

    /// Records a span `phase` on row `row` (`<op>.<name>`) from `start` to
    /// `end`; `args`: the members of its `args` object, if any.
    pub fn span(&self, row: &str, phase: &str, start: Instant, end: Instant, args: &str) {
        self.record(|o| {
            let pid = o.row(row);
            let ts = o.micros(start);
            let dur = end.saturating_duration_since(start).as_secs_f64() * 1e6;
            let sep = if args.is_empty() { "" } else { ", \"args\": {" };
            let close = if args.is_empty() { "" } else { "}" };
            o.event(format_args!(
                "\"ph\": \"X\", \"name\": \"{phase}\", \"ts\": {ts:.3}, \"pid\": {pid}, \
                 \"dur\": {dur:.3}{sep}{args}{close}"
            ));
        });
    }

    /// Marks the start of a negotiation cycle, a batch of `requests` requests sent to
    /// the coordinator, when the timeline was started with cycle marks: an instant
    /// `CYCLE_START` across every row (global scope, as Horovod's).
    pub fn mark_cycle(&self, requests: usize) {
        self.record(|o| {
            if !o.mark_cycles {
                return;
            }
            let ts = o.micros(Instant::now());
            o.event(format_args!(
                "\"ph\": \"i\", \"name\": \"CYCLE_START\", \"ts\": {ts:.3}, \"s\": \"g\", \
                 \"pid\": 0, \"args\": {{\"requests\": {requests}}}"
            ));
        });
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

    /// A JSON value, from [`parse`].
    #[derive(Debug, Clone, PartialEq)]
    enum Json {
        Null,
        Bool(bool),
        Num(f64),
        Str(String),
        Arr(Vec<Json>),
        Obj(Vec<(String, Json)>),
    }

    impl Json {
        fn get(&self, key: &str) -> Option<&Json> {
            match self {
                Json::Obj(m) => m.iter().find(|(k, _)| k == key).map(|(_, v)| v),
                _ => None,
            }
        }
        fn str(&self, key: &str) -> Option<&str> {
            match self.get(key)? {
                Json::Str(s) => Some(s),
                _ => None,
            }
        }
        fn num(&self, key: &str) -> Option<f64> {
            match self.get(key)? {
                Json::Num(n) => Some(*n),
                _ => None,
            }
        }
    }

    /// A strict parse of a whole JSON text (whitespace around the value allowed),
    /// or what is wrong and where.
    fn parse(text: &str) -> Result<Json, String> {
        struct P<'a>(&'a [u8], usize);
        impl P<'_> {
            fn ws(&mut self) {
                while self.1 < self.0.len() && b" \t\r\n".contains(&self.0[self.1]) {
                    self.1 += 1;
                }
            }
            fn err<T>(&self, what: &str) -> Result<T, String> {
                Err(format!("{what} at byte {}", self.1))
            }
            fn eat(&mut self, c: u8) -> Result<(), String> {
                self.ws();
                if self.0.get(self.1) == Some(&c) {
                    self.1 += 1;
                    Ok(())
                } else {
                    self.err(&format!("expected '{}'", c as char))
                }
            }
            fn string(&mut self) -> Result<String, String> {
                self.eat(b'"')?;
                let mut out = Vec::new();
                loop {
                    let Some(&c) = self.0.get(self.1) else {
                        return self.err("unterminated string");
                    };
                    self.1 += 1;
                    match c {
                        b'"' => return String::from_utf8(out).map_err(|e| e.to_string()),
                        b'\\' => {
                            let e = self.0.get(self.1).copied();
                            self.1 += 1;
                            match e {
                                Some(b'u') => {
                                    let hex = std::str::from_utf8(&self.0[self.1..self.1 + 4])
                                        .map_err(|e| e.to_string())?;
                                    let code =
                                        u32::from_str_radix(hex, 16).map_err(|e| e.to_string())?;
                                    self.1 += 4;
                                    let ch = char::from_u32(code).unwrap_or('?');
                                    out.extend_from_slice(ch.to_string().as_bytes());
                                }
                                Some(b'n') => out.push(b'\n'),
                                Some(b't') => out.push(b'\t'),
                                Some(e @ (b'"' | b'\\' | b'/')) => out.push(e),
                                _ => return self.err("bad escape"),
                            }
                        }
                        c if c < 0x20 => return self.err("control character in string"),
                        c => out.push(c),
                    }
                }
            }
            fn value(&mut self) -> Result<Json, String> {
                self.ws();
                match self.0.get(self.1) {
                    None => self.err("unexpected end"),
                    Some(b'{') => {
                        self.1 += 1;
                        let mut m = Vec::new();
                        self.ws();
                        if self.0.get(self.1) == Some(&b'}') {
                            self.1 += 1;
                            return Ok(Json::Obj(m));
                        }
                        loop {
                            self.ws();
                            let k = self.string()?;
                            self.eat(b':')?;
                            m.push((k, self.value()?));
                            self.ws();
                            match self.0.get(self.1) {
                                Some(b',') => self.1 += 1,
                                Some(b'}') => {
                                    self.1 += 1;
                                    return Ok(Json::Obj(m));
                                }
                                _ => return self.err("expected ',' or '}'"),
                            }
                        }
                    }
                    Some(b'[') => {
                        self.1 += 1;
                        let mut a = Vec::new();
                        self.ws();
                        if self.0.get(self.1) == Some(&b']') {
                            self.1 += 1;
                            return Ok(Json::Arr(a));
                        }
                        loop {
                            a.push(self.value()?);
                            self.ws();
                            match self.0.get(self.1) {
                                Some(b',') => self.1 += 1,
                                Some(b']') => {
                                    self.1 += 1;
                                    return Ok(Json::Arr(a));
                                }
                                _ => return self.err("expected ',' or ']'"),
                            }
                        }
                    }
                    Some(b'"') => self.string().map(Json::Str),
                    Some(_) => {
                        for (word, v) in [
                            ("true", Json::Bool(true)),
                            ("false", Json::Bool(false)),
                            ("null", Json::Null),
                        ] {
                            if self.0[self.1..].starts_with(word.as_bytes()) {
                                self.1 += word.len();
                                return Ok(v);
                            }
                        }
                        let start = self.1;
                        while self.1 < self.0.len() && b"+-.eE0123456789".contains(&self.0[self.1])
                        {
                            self.1 += 1;
                        }
                        let s = std::str::from_utf8(&self.0[start..self.1]).unwrap();
                        s.parse().map(Json::Num).or_else(|_| self.err("bad value"))
                    }
                }
            }
        }
        let mut p = P(text.as_bytes(), 0);
        let v = p.value()?;
        p.ws();
        if p.1 != text.len() {
            return p.err("trailing text");
        }
        Ok(v)
    }

    /// The events of the timeline file `file`, which must parse as it is.
    fn events(file: &str) -> Vec<Json> {
        let text = std::fs::read_to_string(file).unwrap();
        match parse(&text) {
            Ok(Json::Arr(events)) => events,
            other => panic!("{other:?} from {text}"),
        }
    }

    /// Row name to pid, from the `process_name` metadata of `events`.
    fn rows(events: &[Json]) -> HashMap<String, u64> {
        events
            .iter()
            .filter(|e| e.str("name") == Some("process_name") && e.num("pid") != Some(0.0))
            .map(|e| {
                let name = e.get("args").and_then(|a| a.str("name")).unwrap();
                (name.to_string(), e.num("pid").unwrap() as u64)
            })
            .collect()
    }

    fn temp(tag: &str) -> String {
        let path = std::env::temp_dir().join(format!("perseus-{tag}-{}.json", std::process::id()));
        path.to_str().unwrap().to_string()
    }

    #[test]
    fn the_json_parser_of_these_tests_is_strict() {
        assert!(parse("[\n{\"a\": [1, -2.5e3, \"x\\\"\\u0001\"], \"b\": {}}\n]\n").is_ok());
        for bad in ["[", "[1,]", "[1]]", "{\"a\" 1}", "[1] 2", "[\"\n\"]", "[}"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ranks_given_one_path_write_files_of_their_own() {
        let path = temp("tl");
        let lines: Vec<Timeline> = (0..3).map(Timeline::new).collect();
        let t = Instant::now();
        for (r, tl) in lines.iter().enumerate() {
            tl.start(&path, false).unwrap();
            tl.span(&format!("allreduce.t{r}"), "ALLREDUCE", t, t, "");
            tl.mark_cycle(1); // not asked for
        }
        lines.iter().for_each(Timeline::stop);
        for r in 0..3 {
            let file = rank_path(&path, r);
            let text = std::fs::read_to_string(&file).unwrap();
            assert!(text.starts_with("[\n") && text.ends_with("\n]\n"), "{text}");
            let events = events(&file);
            // The header names the rank; the tensor's row is pid 1.
            let header = &events[0];
            assert_eq!(header.num("pid"), Some(0.0), "{text}");
            let args = header.get("args").unwrap();
            assert_eq!(args.num("rank"), Some(r as f64), "{text}");
            assert!(
                args.num("start_time_since_epoch_in_micros").unwrap() > 1e15,
                "{text}"
            );
            assert_eq!(
                rows(&events),
                HashMap::from([(format!("allreduce.t{r}"), 1)])
            );
            let spans: Vec<&Json> = events.iter().filter(|e| e.str("ph") == Some("X")).collect();
            assert_eq!(spans.len(), 1, "{text}");
            assert_eq!(spans[0].str("name"), Some("ALLREDUCE"), "{text}");
            assert_eq!(spans[0].num("pid"), Some(1.0), "{text}");
            assert!(!text.contains("CYCLE_START"), "{text}");
            std::fs::remove_file(file).unwrap();
        }
        assert_eq!(rank_path(&path, 2), format!("{path}.2"));
    }

    #[test]
    fn cycle_marks_are_instants_written_only_when_asked_for() {
        let path = temp("tlc");
        let tl = Timeline::new(1);
        tl.mark_cycle(3); // stopped: nothing to write to
        tl.start(&path, true).unwrap();
        let t = Instant::now();
        tl.mark_cycle(2);
        tl.span("allreduce.x", "ALLREDUCE", t, t, "\"fused\": 1");
        tl.mark_cycle(1);
        tl.stop();
        let file = rank_path(&path, 1);
        let events = events(&file);
        std::fs::remove_file(&file).unwrap();
        let marks: Vec<&Json> = events
            .iter()
            .filter(|e| e.str("name") == Some("CYCLE_START"))
            .collect();
        assert_eq!(marks.len(), 2, "{events:?}");
        for (m, requests) in marks.iter().zip([2.0, 1.0]) {
            assert_eq!((m.str("ph"), m.str("s")), (Some("i"), Some("g")), "{m:?}");
            assert_eq!(m.get("args").unwrap().num("requests"), Some(requests));
        }
        let spans: Vec<&Json> = events.iter().filter(|e| e.str("ph") == Some("X")).collect();
        assert_eq!(spans.len(), 1, "{events:?}");
        assert_eq!(spans[0].get("args").unwrap().num("fused"), Some(1.0));
    }

    #[test]
    fn the_file_is_whole_json_while_written_and_batches_wait_for_the_tick() {
        let path = temp("tls");
        let tl = Timeline::new(0);
        tl.start(&path, true).unwrap();
        // At once: the header alone, a whole array.
        assert_eq!(events(&path).len(), 2);
        assert_eq!(tl.due(), None);
        let t = Instant::now();
        tl.mark_cycle(1);
        tl.span("allreduce.a", "NEGOTIATE_ALLREDUCE", t, t, "");
        tl.span(
            "allreduce.a",
            "ALLREDUCE",
            t,
            t + Duration::from_micros(5),
            "",
        );
        // Pending, not written per event; due within FLUSH_EVERY.
        assert_eq!(events(&path).len(), 2);
        assert!(tl.due().is_some_and(|d| d <= FLUSH_EVERY));
        tl.flush();
        let first = events(&path);
        assert_eq!(first.len(), 2 + 1 + 2 + 2, "{first:?}");
        assert_eq!(
            rows(&first),
            HashMap::from([("allreduce.a".to_string(), 1)])
        );
        // The next batch replaces the closing bracket: still whole, and it grows.
        tl.span("allreduce.a", "ALLREDUCE", t, t, "");
        tl.span("broadcast.b", "BROADCAST", t, t, "");
        tl.tick(); // just written: the batch waits
        assert_eq!(events(&path).len(), first.len());
        std::thread::sleep(FLUSH_EVERY);
        assert_eq!(tl.due(), Some(Duration::ZERO));
        tl.tick();
        assert_eq!(tl.due(), None);
        let second = events(&path);
        assert_eq!(second.len(), first.len() + 1 + 3, "{second:?}");
        assert_eq!(second[..first.len()], first[..]);
        assert_eq!(rows(&second)["broadcast.b"], 2);
        // Stopping leaves the same whole file, ending as before.
        tl.span("broadcast.b", "BROADCAST", t, t, "");
        tl.stop();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.ends_with("}\n]\n") && text.matches(']').count() == 1,
            "{text}"
        );
        assert_eq!(events(&path).len(), second.len() + 1);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_large_batch_is_written_without_waiting() {
        let path = temp("tlb");
        let tl = Timeline::new(0);
        tl.start(&path, false).unwrap();
        let t = Instant::now();
        let mut n = 0;
        while events(&path).len() == 2 {
            tl.span("allreduce.a", "ALLREDUCE", t, t, "");
            n += 1;
            assert!(n < HOLD_MAX / 50, "{n} events still pending");
        }
        tl.stop();
        assert_eq!(events(&path).len(), 2 + 2 + n);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn op_args_are_horovods_dtype_and_shape() {
        let args = op_args(DataType::F32, Some(&[2, 3]), 4);
        let parsed = parse(&format!("{{{args}}}")).unwrap();
        assert_eq!(parsed.str("dtype"), Some("HOROVOD_FLOAT32"));
        assert_eq!(parsed.str("shape"), Some("[2, 3]"));
        assert_eq!(parsed.num("fused"), Some(4.0));
    }

    #[test]
    fn names_are_escaped() {
        let path = temp("tle");
        let tl = Timeline::new(0);
        tl.start(&path, false).unwrap();
        let t = Instant::now();
        tl.span("allreduce.a\"b\\c\nd", "ALLREDUCE", t, t, "");
        tl.stop();
        let events = events(&path);
        std::fs::remove_file(&path).unwrap();
        assert!(
            rows(&events).contains_key("allreduce.a\"b\\c\nd"),
            "{events:?}"
        );
    }
}
