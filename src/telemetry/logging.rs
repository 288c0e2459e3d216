//! Logs: `tracing` with `RUST_LOG`-style filtering, as text for people or JSON lines for collectors, and the one
//! access-log line each request gets, formatted here on the request's thread and written in batches by
//! [`log_writer`](super::log_writer).

use std::cell::RefCell;
use std::io::Write;

use super::{Finished, RouteNames};
use crate::telemetry::log_writer;

/// The `tracing` target of access-log lines, so they can be filtered on their own (`RUST_LOG=oipgate::access=off`).
pub const ACCESS: &str = "oipgate::access";

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line per event.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Where and how the process logs: its command-line options.
#[derive(Debug, Clone, clap::Args)]
pub struct LogOptions {
    /// Log lines as text or JSON; `RUST_LOG` filters them (default `info`). One access-log line per request, target
    /// `oipgate::access`.
    #[arg(long = "log-format", value_enum, default_value_t = LogFormat::Text)]
    pub format: LogFormat,
    /// Append log lines to this file instead of stderr; SIGHUP and SIGUSR1 reopen it (log rotation).
    #[arg(long = "log-file")]
    pub file: Option<std::path::PathBuf>,
    /// The most bytes of access-log lines waiting for the log's writer; past it lines are dropped, counted in
    /// `oipgate_access_log_dropped_total`, and no request waits.
    #[arg(long = "log-buffer-bytes", default_value_t = log_writer::DEFAULT_BOUND)]
    pub buffer_bytes: usize,
}

impl Default for LogOptions {
    fn default() -> LogOptions {
        LogOptions {
            format: LogFormat::Text,
            file: None,
            buffer_bytes: log_writer::DEFAULT_BOUND,
        }
    }
}

static FORMAT: std::sync::OnceLock<LogFormat> = std::sync::OnceLock::new();

/// Installs the process's log writer, filtered by `RUST_LOG` (default `info`). Calling it again does nothing.
pub fn init(options: &LogOptions) -> std::io::Result<()> {
    log_writer::install(options.file.clone(), options.buffer_bytes)?;
    let _ = FORMAT.set(options.format);
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(log_writer::ImmediateLines)
        .with_target(true);
    let _ = match options.format {
        LogFormat::Text => builder.with_ansi(false).try_init(),
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(false).try_init(),
    };
    Ok(())
}

/// What one finished inference stream carried and how it ended, for its access-log line.
#[derive(Debug, Clone, Copy)]
pub struct FinishedStream<'a> {
    pub request_id: Option<&'a str>,
    /// The gRPC method.
    pub path: &'a str,
    /// How the stream ended.
    pub result: &'a str,
    pub requests: u64,
    pub responses: u64,
    /// Responses that carried a request's error.
    pub failed: u64,
    /// The error that ended the stream, if one did.
    pub error: Option<&'a str>,
    pub duration: std::time::Duration,
}

/// Writes the access-log line of one finished inference stream.
pub fn stream(stream: &FinishedStream<'_>) {
    if !tracing::enabled!(target: ACCESS, tracing::Level::INFO) {
        return;
    }
    AccessLine::write("stream", |line| {
        line.plain("request_id", field(stream.request_id));
        line.quoted("protocol", "grpc");
        line.quoted("path", stream.path);
        line.quoted("result", stream.result);
        line.number("requests", stream.requests);
        line.number("responses", stream.responses);
        line.number("failed_requests", stream.failed);
        line.quoted("error", stream.error.unwrap_or("-"));
        line.millis("duration_ms", stream.duration);
    });
}

/// Writes the access-log line of one finished request.
pub fn access(route: Option<RouteNames<'_>>, request: &Finished<'_>) {
    if !tracing::enabled!(target: ACCESS, tracing::Level::INFO) {
        return;
    }
    AccessLine::write_at("request", wall_time(request.ended), |line| {
        line.plain("request_id", field(request.request_id));
        line.quoted("protocol", request.protocol.label());
        line.quoted("path", request.target);
        line.plain("model", field(route.map(|r| r.model)));
        line.plain("version", field(route.map(|r| r.version)));
        line.plain("backend", field(route.map(|r| r.backend)));
        line.plain("endpoint", field(request.endpoint));
        line.number("status", u64::from(request.status));
        line.number("bytes_in", request.request_bytes);
        line.number("bytes_out", request.response_bytes);
        line.millis("duration_ms", request.duration);
        line.boolean("translated", request.translated);
        line.plain("principal", field(request.principal.map(|caller| caller.name())));
    });
}

/// One call the endpoint picker picked for (or refused), as it ended.
#[derive(Debug)]
pub struct FinishedPick<'a> {
    pub request_id: Option<&'a str>,
    /// `rest` or `grpc`: how the client called.
    pub protocol: &'a str,
    /// The REST path or gRPC method.
    pub target: &'a str,
    pub model: Option<&'a str>,
    pub version: Option<&'a str>,
    /// The endpoints picked, in order (the first picked, the rest fallbacks).
    pub endpoints: Option<&'a str>,
    /// The endpoint the proxy reported serving the call.
    pub served: Option<&'a str>,
    /// picked, shed, unavailable or refused.
    pub result: &'a str,
    /// The status the client was answered: the backend's, or the picker's refusal; 0 when none was seen.
    pub status: u16,
    pub pick: std::time::Duration,
    pub duration: std::time::Duration,
}

/// Writes the access-log line of one call the endpoint picker picked for.
pub fn pick(call: &FinishedPick<'_>) {
    if !tracing::enabled!(target: ACCESS, tracing::Level::INFO) {
        return;
    }
    AccessLine::write("pick", |line| {
        line.plain("request_id", field(call.request_id));
        line.quoted("protocol", call.protocol);
        line.quoted("path", call.target);
        line.plain("model", field(call.model));
        line.plain("version", field(call.version));
        line.quoted("endpoints", field(call.endpoints));
        line.plain("served", field(call.served));
        line.quoted("result", call.result);
        line.number("status", u64::from(call.status));
        line.millis("pick_ms", call.pick);
        line.millis("duration_ms", call.duration);
    });
}

fn field(value: Option<&str>) -> &str {
    value.filter(|v| !v.is_empty()).unwrap_or("-")
}

/// One access-log line being formatted, in the process's format, into its thread's buffer: the same fields and
/// layout `tracing`'s own formatters give every other line, without their per-field dispatch and write calls.
struct AccessLine {
    bytes: Vec<u8>,
    json: bool,
}

/// The bytes a usual access-log line takes, with room to spare.
const LINE_ROOM: usize = 512;

thread_local! {
    static LINE: RefCell<AccessLine> = const { RefCell::new(AccessLine { bytes: Vec::new(), json: false }) };
    /// A monotonic reading and the wall clock's at that moment, read together at most a second ago.
    static ANCHOR: std::cell::Cell<Option<(std::time::Instant, std::time::SystemTime)>> =
        const { std::cell::Cell::new(None) };
    /// The second last formatted, and its text up to the fraction.
    static SECOND: RefCell<(u64, [u8; 19])> = const { RefCell::new((u64::MAX, [0; 19])) };
}

impl AccessLine {
    fn write(message: &str, fields: impl FnOnce(&mut AccessLine)) {
        AccessLine::write_at(message, std::time::SystemTime::now(), fields);
    }

    /// A line of time `at`.
    fn write_at(message: &str, at: std::time::SystemTime, fields: impl FnOnce(&mut AccessLine)) {
        LINE.with_borrow_mut(|line| {
            line.bytes.clear();
            // Room for a usual line at once: each field's append then finds it there.
            line.bytes.reserve(LINE_ROOM);
            line.json = FORMAT.get().copied().unwrap_or_default() == LogFormat::Json;
            if line.json {
                line.bytes.extend_from_slice(b"{\"timestamp\":\"");
                timestamp(&mut line.bytes, at);
                line.bytes.extend_from_slice(b"\",\"level\":\"INFO\"");
                line.quoted("message", message);
                fields(line);
                line.quoted("target", ACCESS);
                line.bytes.extend_from_slice(b"}\n");
            } else {
                timestamp(&mut line.bytes, at);
                line.bytes.extend_from_slice(b"  INFO ");
                line.bytes.extend_from_slice(ACCESS.as_bytes());
                line.bytes.extend_from_slice(b": ");
                line.bytes.extend_from_slice(message.as_bytes());
                fields(line);
                line.bytes.push(b'\n');
            }
            log_writer::access_line(&line.bytes);
            // A rare long line does not keep its buffer's size for the thread's life.
            if line.bytes.capacity() > 16 << 10 {
                line.bytes = Vec::new();
            }
        });
    }

    #[inline(always)]
    fn name(&mut self, name: &str) {
        if self.json {
            self.bytes.extend_from_slice(b",\"");
            self.bytes.extend_from_slice(name.as_bytes());
            self.bytes.extend_from_slice(b"\":");
        } else {
            self.bytes.push(b' ');
            self.bytes.extend_from_slice(name.as_bytes());
            self.bytes.push(b'=');
        }
    }

    /// A string shown as it is in text (an identifier) and as a JSON string.
    #[inline(always)]
    fn plain(&mut self, name: &str, value: &str) {
        if self.json {
            return self.quoted(name, value);
        }
        self.name(name);
        self.bytes.extend_from_slice(value.as_bytes());
    }

    /// A string quoted and escaped in both formats.
    #[inline(always)]
    fn quoted(&mut self, name: &str, value: &str) {
        self.name(name);
        // Most values (paths, labels) need no escape in either format: quoted as they are, which is what both
        // escapers would write, without their per-character dispatch.
        if value
            .bytes()
            .all(|byte| (b' '..=b'~').contains(&byte) && byte != b'"' && byte != b'\\')
        {
            self.bytes.push(b'"');
            self.bytes.extend_from_slice(value.as_bytes());
            self.bytes.push(b'"');
        } else if self.json {
            let _ = serde_json::to_writer(&mut self.bytes, value);
        } else {
            let _ = write!(self.bytes, "{value:?}");
        }
    }

    #[inline(always)]
    fn number(&mut self, name: &str, value: u64) {
        self.name(name);
        self.bytes
            .extend_from_slice(itoa::Buffer::new().format(value).as_bytes());
    }

    /// A duration in milliseconds to the microsecond (`2.071`), a number in both formats: written from integers, as
    /// a float's shortest decimal costs several hundred instructions and shows digits no clock here measures.
    #[inline(always)]
    fn millis(&mut self, name: &str, duration: std::time::Duration) {
        self.name(name);
        let micros = u64::try_from(duration.as_micros()).unwrap_or(u64::MAX);
        self.bytes
            .extend_from_slice(itoa::Buffer::new().format(micros / 1000).as_bytes());
        let fraction = micros % 1000;
        self.bytes.extend_from_slice(&[
            b'.',
            b'0' + (fraction / 100) as u8,
            b'0' + (fraction / 10 % 10) as u8,
            b'0' + (fraction % 10) as u8,
        ]);
    }

    #[inline(always)]
    fn boolean(&mut self, name: &str, value: bool) {
        self.name(name);
        self.bytes.extend_from_slice(if value { b"true" } else { b"false" });
    }
}

/// The wall-clock time of `at`, a monotonic reading the caller took anyway: each thread reads the wall clock once
/// a second and adds the monotonic time since, where a line would otherwise read a second clock for each request.
/// A step of the wall clock shows within the second.
fn wall_time(at: std::time::Instant) -> std::time::SystemTime {
    ANCHOR.with(|anchor| match anchor.get() {
        Some((instant, wall))
            if let Some(since) = at.checked_duration_since(instant)
                && since < std::time::Duration::from_secs(1) =>
        {
            wall + since
        }
        _ => {
            let (instant, wall) = (std::time::Instant::now(), std::time::SystemTime::now());
            anchor.set(Some((instant, wall)));
            wall.checked_sub(instant.saturating_duration_since(at)).unwrap_or(wall)
        }
    })
}

/// `time` as RFC 3339 in UTC with microseconds (`2026-11-26T18:58:22.832041Z`), as `tracing`'s formatters write it.
fn timestamp(out: &mut Vec<u8>, time: std::time::SystemTime) {
    let since = time.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let second = since.as_secs();
    SECOND.with_borrow_mut(|(cached, text)| {
        if *cached != second {
            *cached = second;
            *text = civil(second);
        }
        out.extend_from_slice(text);
    });
    let micros = since.subsec_micros();
    let mut fraction = *b".000000Z";
    for (place, digit) in fraction[1..7]
        .iter_mut()
        .rev()
        .zip(std::iter::successors(Some(micros), |m| Some(m / 10)))
    {
        *place = b'0' + (digit % 10) as u8;
    }
    out.extend_from_slice(&fraction);
}

/// `YYYY-MM-DDTHH:MM:SS` of a Unix second (the days-to-civil conversion of Howard Hinnant's `chrono`-compatible
/// algorithms).
fn civil(second: u64) -> [u8; 19] {
    let days = i64::try_from(second / 86_400).unwrap_or(0);
    let of_day = second % 86_400;
    let shifted = days + 719_468;
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    let mut text = [0u8; 19];
    let written = format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}",
        of_day / 3600,
        of_day / 60 % 60,
        of_day % 60
    );
    let length = written.len().min(19);
    text[..length].copy_from_slice(&written.as_bytes()[..length]);
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_read_as_rfc_3339_in_utc() {
        let at = |seconds: u64, micros: u32| {
            let mut out = Vec::new();
            timestamp(
                &mut out,
                std::time::UNIX_EPOCH + std::time::Duration::new(seconds, micros * 1000),
            );
            String::from_utf8(out).expect("ASCII")
        };
        assert_eq!(at(0, 0), "1970-01-01T00:00:00.000000Z");
        assert_eq!(at(1_795_719_502, 832_041), "2026-11-26T18:58:22.832041Z");
        // A leap day, and the last second of a century year that is not a leap year.
        assert_eq!(at(951_782_400, 1), "2000-02-29T00:00:00.000001Z");
        assert_eq!(at(4_107_542_399, 999_999), "2100-02-28T23:59:59.999999Z");
        assert_eq!(at(4_107_542_400, 0), "2100-03-01T00:00:00.000000Z");
    }

    /// Readings within a second of the thread's anchor are placed from it exactly; one past the second, or before
    /// the anchor, reads the wall clock again.
    #[test]
    fn monotonic_readings_are_placed_on_the_wall_clock_from_the_threads_anchor() {
        let second = std::time::Duration::from_secs(1);
        let at = std::time::Instant::now();
        let first = wall_time(at);
        let (anchor, _) = ANCHOR.get().expect("anchored");
        let later = at + std::time::Duration::from_millis(300);
        assert_eq!(wall_time(later), first + std::time::Duration::from_millis(300));
        assert_eq!(ANCHOR.get().expect("anchored").0, anchor, "the same anchor");
        // A reading a second past the anchor, or before it, reads the wall clock again.
        wall_time(anchor + second);
        let (again, _) = ANCHOR.get().expect("anchored");
        assert!(again > anchor, "re-anchored a second on");
        wall_time(again.checked_sub(second).expect("a second of uptime"));
        assert!(
            ANCHOR.get().expect("anchored").0 >= again,
            "re-anchored for a reading before the anchor"
        );
    }

    #[test]
    fn values_are_quoted_as_the_formats_escapers_quote_them() {
        for value in [
            "/v2/models/add_sub/infer",
            "",
            "a b~",
            "say \"hi\"",
            "back\\slash",
            "tab\there",
            "é",
            "\u{7f}",
        ] {
            for json in [false, true] {
                let mut line = AccessLine {
                    bytes: Vec::new(),
                    json,
                };
                line.quoted("k", value);
                let expected = if json {
                    format!(",\"k\":{}", serde_json::to_string(value).unwrap())
                } else {
                    format!(" k={value:?}")
                };
                assert_eq!(
                    String::from_utf8(line.bytes).unwrap(),
                    expected,
                    "{value:?}, json {json}"
                );
            }
        }
        let mut line = AccessLine {
            bytes: Vec::new(),
            json: false,
        };
        line.number("n", u64::MAX);
        line.number("z", 0);
        assert_eq!(String::from_utf8(line.bytes).unwrap(), format!(" n={} z=0", u64::MAX));
    }

    #[test]
    fn durations_are_milliseconds_to_the_microsecond_and_json_numbers() {
        let millis = |duration: std::time::Duration| {
            let mut line = AccessLine {
                bytes: Vec::new(),
                json: true,
            };
            line.millis("d", duration);
            let text = String::from_utf8(line.bytes).unwrap();
            let value: serde_json::Value = serde_json::from_str(&format!("{{{}}}", &text[1..])).expect("JSON");
            (text[5..].to_owned(), value["d"].as_f64().expect("a number"))
        };
        let us = std::time::Duration::from_micros;
        assert_eq!(millis(us(184)), ("0.184".to_owned(), 0.184));
        assert_eq!(millis(us(2_200)), ("2.200".to_owned(), 2.2));
        assert_eq!(millis(std::time::Duration::from_nanos(999)), ("0.000".to_owned(), 0.0));
        assert_eq!(millis(us(1_234_567_089)), ("1234567.089".to_owned(), 1_234_567.089));
        assert_eq!(millis(us(7)), ("0.007".to_owned(), 0.007));
    }
}
