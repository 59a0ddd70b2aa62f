//! The core's log lines on stderr, `[perseus] warning: ...`, one level each.
//! `HOROVOD_LOG_LEVEL` (or `PERSEUS_LOG_LEVEL`; perseusrun's `--log-level`) drops the
//! lines below it, and `HOROVOD_LOG_HIDE_TIME=0` (perseusrun's `--log-with-timestamp`)
//! starts each with the UTC time. Both are read from the environment at the first line,
//! and set again from the checked configuration at `init()`.

use std::io::Write;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// How much a line matters, least first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Each operation the engine runs.
    Trace,
    /// The engine's start and end on each rank.
    Debug,
    /// Notes: settings chosen, paths taken, leftovers cleaned.
    Info,
    /// Something the user should look at: a stall, an overflow, a dropped connection.
    Warning,
    /// A failure the job does not survive.
    Error,
    /// The same, for the level names Horovod takes.
    Fatal,
}

/// The level names, as `HOROVOD_LOG_LEVEL` takes them (any case).
pub const LEVEL_NAMES: [&str; 6] = ["TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"];

const LEVELS: [Level; 6] = [
    Level::Trace,
    Level::Debug,
    Level::Info,
    Level::Warning,
    Level::Error,
    Level::Fatal,
];

impl Level {
    /// The level named `name` (one of [`LEVEL_NAMES`], any case), if any.
    pub fn parse(name: &str) -> Option<Level> {
        let upper = name.trim().to_ascii_uppercase();
        LEVEL_NAMES
            .iter()
            .position(|n| *n == upper)
            .map(|i| LEVELS[i])
    }

    /// The word a line of this level carries after `[perseus]`.
    fn word(self) -> &'static str {
        match self {
            Level::Trace => "trace",
            Level::Debug => "debug",
            Level::Info => "note",
            Level::Warning => "warning",
            Level::Error => "error",
            Level::Fatal => "fatal",
        }
    }
}

/// The level a job logs at unless told otherwise: PERSEUS_LOG_LEVEL's default in
/// [`crate::params`] (notes and above: Perseus prints few notes, and they say which
/// path or setting a job took).
pub fn default_level() -> Level {
    let default = crate::params::param("PERSEUS_LOG_LEVEL").default_text();
    Level::parse(&default).expect("PERSEUS_LOG_LEVEL's default is a level")
}

const UNSET: u8 = u8::MAX;
static LEVEL: AtomicU8 = AtomicU8::new(UNSET);
static SHOW_TIME: AtomicU8 = AtomicU8::new(UNSET);

/// The level set, or the environment's (a bad value counts as unset here: `init()`
/// names it as an error).
fn level() -> Level {
    let v = LEVEL.load(Ordering::Relaxed);
    if v != UNSET {
        return LEVELS[v as usize];
    }
    // A bad value counts as the default here: `init()` names it as an error.
    let l = crate::params::text("PERSEUS_LOG_LEVEL")
        .unwrap_or(None)
        .and_then(|s| Level::parse(&s))
        .unwrap_or_else(default_level);
    LEVEL.store(l as u8, Ordering::Relaxed);
    l
}

fn show_time() -> bool {
    let v = SHOW_TIME.load(Ordering::Relaxed);
    if v != UNSET {
        return v == 1;
    }
    let show = matches!(crate::params::flag("HOROVOD_LOG_HIDE_TIME"), Ok(false));
    SHOW_TIME.store(u8::from(show), Ordering::Relaxed);
    show
}

/// Sets the level and whether lines start with the time (from the checked
/// configuration, at `init()`).
pub fn configure(level: Level, show_time: bool) {
    LEVEL.store(level as u8, Ordering::Relaxed);
    SHOW_TIME.store(u8::from(show_time), Ordering::Relaxed);
}

/// True when lines of `level` are written.
pub fn enabled(level: Level) -> bool {
    level >= self::level()
}

/// Writes one line of `level` to stderr when that level is enabled (the [`crate::log!`]
/// macro checks first, so that a dropped line is never formatted).
pub fn write(level: Level, message: std::fmt::Arguments) {
    if !enabled(level) {
        return;
    }
    let now = show_time()
        .then(|| SystemTime::now().duration_since(UNIX_EPOCH).ok())
        .flatten();
    let line = format_line(
        level,
        now.map(|d| (d.as_secs(), d.subsec_micros())),
        message,
    );
    // One write of the whole line, so that threads' lines do not interleave.
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// `[perseus] <level>: message\n`, after `YYYY-MM-DDTHH:MM:SS.ffffffZ ` when `time`
/// (seconds since the epoch, microseconds) is given.
pub fn format_line(level: Level, time: Option<(u64, u32)>, message: std::fmt::Arguments) -> String {
    let stamp = time.map_or(String::new(), |(secs, micros)| {
        let (y, mo, d) = civil_date(secs / 86_400);
        let s = secs % 86_400;
        format!(
            "{y:04}-{mo:02}-{d:02}T{:02}:{:02}:{:02}.{micros:06}Z ",
            s / 3600,
            s / 60 % 60,
            s % 60
        )
    });
    format!("{stamp}[perseus] {}: {message}\n", level.word())
}

/// The (year, month, day) of the day `days` after 1970-01-01, in the proleptic
/// Gregorian calendar: counted in 400-year eras of 146,097 days, each year starting on
/// March 1 so that the leap day ends it.
fn civil_date(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468; // days since 0000-03-01
    let era = z / 146_097;
    let doe = z % 146_097; // day of the era
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // year of the era
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of the year, from March 1
    let mp = (5 * doy + 2) / 153; // month, from March = 0
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// Writes a log line: `log!(Level::Warning, "stall: {what}")`; the message is formatted
/// only when the level is enabled.
#[macro_export]
macro_rules! log {
    ($level:expr, $($arg:tt)*) => {
        if $crate::log::enabled($level) {
            $crate::log::write($level, format_args!($($arg)*));
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_in_any_case_and_order_least_first() {
        assert_eq!(Level::parse("warning"), Some(Level::Warning));
        assert_eq!(Level::parse(" Debug "), Some(Level::Debug));
        assert_eq!(Level::parse("loud"), None);
        assert!(Level::Trace < Level::Debug && Level::Info < Level::Warning);
        for (name, level) in LEVEL_NAMES.iter().zip(LEVELS) {
            assert_eq!(Level::parse(name), Some(level));
        }
    }

    #[test]
    fn a_line_has_its_level_and_the_utc_time_when_asked() {
        let plain = format_line(Level::Warning, None, format_args!("stall: {}", "x"));
        assert_eq!(plain, "[perseus] warning: stall: x\n");
        assert_eq!(
            format_line(Level::Info, Some((0, 7)), format_args!("m")),
            "1970-01-01T00:00:00.000007Z [perseus] note: m\n"
        );
        // 2026-11-26 07:38:25 UTC, and the last second of a leap year's February.
        assert_eq!(
            format_line(
                Level::Debug,
                Some((1_795_678_705, 123_456)),
                format_args!("m")
            ),
            "2026-11-26T07:38:25.123456Z [perseus] debug: m\n"
        );
        assert_eq!(
            format_line(Level::Error, Some((1_709_251_199, 0)), format_args!("m")),
            "2024-02-29T23:59:59.000000Z [perseus] error: m\n"
        );
    }

    #[test]
    fn the_calendar_agrees_with_known_dates() {
        assert_eq!(civil_date(0), (1970, 1, 1));
        assert_eq!(civil_date(59), (1970, 3, 1));
        assert_eq!(civil_date(10_957), (2000, 1, 1));
        assert_eq!(civil_date(11_016), (2000, 2, 29));
        assert_eq!(civil_date(19_782), (2024, 2, 29));
        assert_eq!(civil_date(20_453), (2025, 12, 31));
    }
}
