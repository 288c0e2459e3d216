//! Which HTTP headers and gRPC metadata cross the gateway, in both directions and across protocols: everything
//! end to end passes, nothing that belongs to one connection or to one protocol's framing does.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use http::header;
use http::{HeaderMap, HeaderName, HeaderValue};

/// The header that identifies a request end to end.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// The binary extension's header giving the JSON part's length.
pub const INFERENCE_HEADER_CONTENT_LENGTH: HeaderName = HeaderName::from_static("inference-header-content-length");

/// gRPC's own headers and trailers, named once: a name given as text is parsed again at every use.
pub const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
pub const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
pub const GRPC_ENCODING: HeaderName = HeaderName::from_static("grpc-encoding");
pub const GRPC_ACCEPT_ENCODING: HeaderName = HeaderName::from_static("grpc-accept-encoding");
pub const GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");

/// Response header (gRPC metadata) naming the public version that served an inference.
pub const OIP_MODEL_VERSION: HeaderName = HeaderName::from_static("oip-model-version");
/// How the gateway names itself in the `user-agent` of a call it makes for itself (a client's own passes on).
pub const GATEWAY_AGENT: HeaderValue = HeaderValue::from_static(concat!("oipgate/", env!("CARGO_PKG_VERSION")));

/// Whether a header named `text` (lower-case, as header names are held) is one that describes one connection or one
/// message's framing, never passed on (RFC 9110 §7.6.1 and the framing of HTTP/1.1, HTTP/2, gRPC and the binary
/// tensor extension); the gateway sets its own where needed. Every header of every request and answer is checked: a
/// match on the text is a jump on its length and a compare or two, where a list of names is a compare for each.
fn is_not_passed_on(text: &str) -> bool {
    matches!(
        text,
        // Hop by hop.
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "http2-settings"
            // Reserved (RFC 9110 §16.3.2.2): it would read as the `close` connection option.
            | "close"
            // Framing and content negotiation of the message as this hop encodes it.
            | "host"
            | "content-length"
            | "content-type"
            | "content-encoding"
            | "accept"
            | "accept-encoding"
            | "expect"
            | "inference-header-content-length"
            // Each hop's own, on answers. A client's `user-agent` passes on, as it does through every proxy: it is the
            // backend's one word on who called.
            | "server"
            | "date"
    )
}

/// Whether a header named `name` may be passed on to the next hop.
pub fn is_end_to_end(name: &HeaderName) -> bool {
    // gRPC reserves `grpc-*` (timeout, encodings, status): the gateway speaks those itself on each hop.
    let text = name.as_str();
    !is_not_passed_on(text) && !text.starts_with("grpc-") && !text.starts_with(':')
}

/// The end-to-end headers of `incoming`: hop-by-hop ones, those `Connection` names, and framing ones left out.
pub fn end_to_end(incoming: &HeaderMap) -> HeaderMap {
    end_to_end_of(incoming, incoming.contains_key(header::CONNECTION))
}

/// [`end_to_end`], told whether `incoming` has a `Connection`.
fn end_to_end_of(incoming: &HeaderMap, connection: bool) -> HeaderMap {
    // Sized as it fills: most of a request's headers are not passed on, and a map that stays empty allocates nothing.
    let mut passed = HeaderMap::new();
    each_end_to_end(incoming, connection, |name, value| {
        passed.append(name.clone(), value.clone());
    });
    passed
}

/// Shows `pass` each header of `incoming` that goes on to the next hop: end to end, and not named by its
/// `Connection` (`connection`: it has one). The one rule for a map made anew and for a passthrough's lines.
fn each_end_to_end(incoming: &HeaderMap, connection: bool, mut pass: impl FnMut(&HeaderName, &HeaderValue)) {
    let nominated = if connection { nominated(incoming) } else { Vec::new() };
    for (name, value) in incoming {
        if is_end_to_end(name) && !nominated.iter().any(|nominee| nominee == name.as_str()) {
            pass(name, value);
        }
    }
}

/// The headers about a backend answer's body that go back with it as the backend sent them: the body is passed on as
/// it came.
pub static ANSWER_AS_SENT: [HeaderName; 4] = [
    header::CONTENT_TYPE,
    header::CONTENT_ENCODING,
    header::CONTENT_LENGTH,
    INFERENCE_HEADER_CONTENT_LENGTH,
];

/// Whether a backend answer's header named `name` goes back to the client as the backend sent it, in an answer
/// passed back as it came: those end to end, and those [`ANSWER_AS_SENT`].
pub fn passes_back(name: &HeaderName) -> bool {
    is_end_to_end(name) || ANSWER_AS_SENT.contains(name)
}

/// Leaves in `headers` what [`end_to_end`] would pass on, and the headers named in `kept`; in place, for a message
/// that goes on with most of its headers (an answer passed back as it came). Each header is shown to `seen` first.
pub fn keep_end_to_end(headers: &mut HeaderMap, kept: &[HeaderName], mut seen: impl FnMut(&HeaderName, &HeaderValue)) {
    // On the stack: an answer drops a header or two (the backend's `Date`, as a rule), and this runs for each.
    let mut dropped: smallvec::SmallVec<[HeaderName; 4]> = smallvec::SmallVec::new();
    let mut connection = false;
    for (name, value) in &*headers {
        seen(name, value);
        if !kept.contains(name) && !is_end_to_end(name) && !dropped.contains(name) {
            connection |= name == header::CONNECTION;
            dropped.push(name.clone());
        }
    }
    if connection {
        dropped.extend(
            nominated(headers)
                .iter()
                .filter_map(|name| HeaderName::from_bytes(name.as_bytes()).ok())
                .filter(|name| !kept.contains(name)),
        );
    }
    for name in dropped {
        headers.remove(name);
    }
}

/// The headers a message's `Connection` names (lower-cased), which are this hop's alone.
fn nominated(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(|token| token.trim().to_ascii_lowercase())
        .filter(|token| !token.is_empty())
        .collect()
}

/// What a request carries to its backend: its end-to-end headers, with a request id generated when it has none.
pub fn for_backend(incoming: &HeaderMap) -> HeaderMap {
    RequestHeaders::read(incoming).forward()
}

/// A request's headers as the door reads them, in one pass: the request id (the client's, or one made), and those
/// about the body and the answer that it looks at, which are not carried as they are (each hop frames its own
/// message). What goes on to the backend is read from the client's headers where they stand: as a map of their own
/// ([`RequestHeaders::forward`]) for a call made anew, or written straight from them ([`PassedOn`]) by a passthrough.
#[derive(Debug)]
pub struct RequestHeaders<'a> {
    /// The client's headers.
    incoming: &'a HeaderMap,
    pub request_id: HeaderValue,
    /// The request id was made here: the client sent none.
    made_id: bool,
    /// The client's headers include a `Connection`, whose nominees stay behind.
    connection: bool,
    pub content_length: Option<&'a HeaderValue>,
    pub content_type: Option<&'a HeaderValue>,
    /// The first of the request's Content-Encoding headers.
    pub content_encoding: Option<&'a HeaderValue>,
    pub accept: Option<&'a HeaderValue>,
    pub accept_encoding: Option<&'a HeaderValue>,
    pub inference_header_length: Option<&'a HeaderValue>,
}

impl<'a> RequestHeaders<'a> {
    pub fn read(incoming: &'a HeaderMap) -> RequestHeaders<'a> {
        let mut read = RequestHeaders {
            incoming,
            request_id: HeaderValue::from_static(""),
            made_id: false,
            connection: false,
            content_length: None,
            content_type: None,
            content_encoding: None,
            accept: None,
            accept_encoding: None,
            inference_header_length: None,
        };
        let mut client_id = None;
        for (name, value) in incoming {
            let slot = if *name == header::CONTENT_LENGTH {
                &mut read.content_length
            } else if *name == header::CONTENT_TYPE {
                &mut read.content_type
            } else if *name == header::CONTENT_ENCODING {
                &mut read.content_encoding
            } else if *name == header::ACCEPT {
                &mut read.accept
            } else if *name == header::ACCEPT_ENCODING {
                &mut read.accept_encoding
            } else if *name == INFERENCE_HEADER_CONTENT_LENGTH {
                &mut read.inference_header_length
            } else if *name == REQUEST_ID {
                &mut client_id
            } else {
                read.connection |= name == header::CONNECTION;
                continue;
            };
            slot.get_or_insert(value);
        }
        // An id the client's `Connection` names is this hop's alone: one is made in its place.
        if read.connection && client_id.is_some() && nominated(incoming).iter().any(|name| name == REQUEST_ID.as_str())
        {
            client_id = None;
        }
        read.request_id = match client_id {
            Some(id) => {
                let mut id = id.clone();
                id.set_sensitive(true);
                id
            }
            None => {
                read.made_id = true;
                new_request_id()
            }
        };
        read
    }

    /// The end-to-end headers, with the request id, as a map of their own: for a call made anew from the request (a
    /// translation, a mirror, a stream).
    pub fn forward(&self) -> HeaderMap {
        let mut forward = end_to_end_of(self.incoming, self.connection);
        if self.made_id {
            forward.insert(REQUEST_ID, self.request_id.clone());
        } else if let Some(id) = forward.get_mut(REQUEST_ID) {
            id.set_sensitive(true);
        }
        forward
    }

    /// The headers as a passthrough sends them on: the client's end-to-end ones where they stand, and the request
    /// id when it was made here (those about the body are set with [`PassedOn::about_body`]).
    pub fn passed_on(&self) -> PassedOn<'_> {
        let mut set = [None; SET_NAMES.len()];
        set[0] = self.made_id.then_some(&self.request_id);
        PassedOn {
            client: self.incoming,
            connection: self.connection,
            set,
            answer_as_lines: false,
        }
    }
}

/// The names of the headers a passthrough sets, in the order of [`PassedOn`]'s slots: the request id it made, then
/// those about the body. None is end to end, and the request id is set only when the client sent none: none is also
/// among the client's headers written.
static SET_NAMES: [HeaderName; 6] = [
    REQUEST_ID,
    header::CONTENT_TYPE,
    header::CONTENT_ENCODING,
    header::ACCEPT,
    header::ACCEPT_ENCODING,
    INFERENCE_HEADER_CONTENT_LENGTH,
];

/// A request's headers as a passthrough sends them to its backend, written from where they stand rather than
/// gathered into a map of their own (a map built and dropped for each request is most of what its headers cost):
/// the client's end-to-end headers, and those the gateway sets (the request id it made, those about the body), as
/// references into the request's own headers: this is made and moved for every request.
#[derive(Debug)]
pub struct PassedOn<'a> {
    client: &'a HeaderMap,
    connection: bool,
    /// A value for each of [`SET_NAMES`], or none.
    set: [Option<&'a HeaderValue>; SET_NAMES.len()],
    /// The answer is passed back as it came: its headers are wanted as lines in its head, not read into a map.
    answer_as_lines: bool,
}

impl<'a> PassedOn<'a> {
    /// With the headers about the body: Content-Type, Content-Encoding, Accept, Accept-Encoding and
    /// Inference-Header-Content-Length, each when given.
    pub fn about_body(mut self, about: [Option<&'a HeaderValue>; SET_NAMES.len() - 1]) -> PassedOn<'a> {
        self.set[1..].copy_from_slice(&about);
        self
    }

    /// With the answer's headers wanted as lines in its head (see [`passes_back`]), when `wanted`.
    pub fn answer_as_lines(mut self, wanted: bool) -> PassedOn<'a> {
        self.answer_as_lines = wanted;
        self
    }

    /// Whether the answer's headers are wanted as lines in its head.
    pub fn answers_as_lines(&self) -> bool {
        self.answer_as_lines
    }

    /// Shows each header to `write`, but those `overridden` says another source gives in its place.
    pub fn each(&self, overridden: impl Fn(&HeaderName) -> bool, mut write: impl FnMut(&HeaderName, &HeaderValue)) {
        each_end_to_end(self.client, self.connection, |name, value| {
            if !overridden(name) {
                write(name, value);
            }
        });
        for (name, value) in SET_NAMES.iter().zip(self.set) {
            if let Some(value) = value
                && !overridden(name)
            {
                write(name, value);
            }
        }
    }
}

/// A request id unique within this process and unlikely to repeat across processes: start time and a counter. A
/// request's id, generated or the client's, is sent over HTTP/2 as never indexed (see [`HeaderValue::set_sensitive`]).
pub fn new_request_id() -> HeaderValue {
    /// The process's next id not yet taken by a thread.
    static NEXT: AtomicU64 = AtomicU64::new(0);
    /// How many ids a thread takes from [`NEXT`] at a time: each door thread makes one a request, and an atomic
    /// counter shared by them would move its cache line between their cores on nearly every one.
    const TAKEN_AT_ONCE: u64 = 1024;
    thread_local! {
        /// This thread's next id, and the end of those it has taken.
        static TAKEN: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
    }
    // The start time, in hex and followed by the dash, is written once.
    static START: OnceLock<[u8; 17]> = OnceLock::new();
    let start = START.get_or_init(|| {
        let start = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos() & u128::from(u64::MAX)).unwrap_or(0));
        let mut prefix = [b'-'; 17];
        hex_into(&mut prefix[..16], start);
        prefix
    });
    let count = TAKEN.with(|taken| {
        let (mut next, mut end) = taken.get();
        if next == end {
            next = NEXT.fetch_add(TAKEN_AT_ONCE, Ordering::Relaxed);
            end = next + TAKEN_AT_ONCE;
        }
        taken.set((next + 1, end));
        next
    });
    // Written in place: this runs for every request, and formatting machinery costs more than the rest of it.
    let mut id = [0u8; 25];
    id[..17].copy_from_slice(start);
    hex_into(&mut id[17..], count);
    // Owned as it is: one allocation, shared by the copies the request makes (one from a copied slice would take a
    // second at its first copy).
    let mut id =
        HeaderValue::from_maybe_shared(bytes::Bytes::from_owner(id)).unwrap_or(HeaderValue::from_static("oipgate"));
    // Each request's id is new: HPACK is told never to index it, so HTTP/2 peers neither fill their header tables
    // with ids nor search them for one.
    id.set_sensitive(true);
    id
}

/// Writes the low `4 * out.len()` bits of `value` into `out` as lower-case hex digits, most significant first.
fn hex_into(out: &mut [u8], mut value: u64) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for byte in out.iter_mut().rev() {
        *byte = DIGITS[(value & 0xf) as usize];
        value >>= 4;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(*name, HeaderValue::from_static(value));
        }
        headers
    }

    #[test]
    fn only_end_to_end_headers_pass() {
        let incoming = map(&[
            ("connection", "keep-alive, X-Private"),
            ("x-private", "secret"),
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
            ("proxy-authorization", "Basic eA=="),
            ("content-type", "application/grpc"),
            ("grpc-timeout", "5S"),
            ("grpc-accept-encoding", "gzip"),
            ("user-agent", "grpc-python"),
            ("authorization", "Bearer t"),
            ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
            ("x-tenant", "a"),
            ("x-tenant", "b"),
            ("x-payload-bin", "AAEC"),
        ]);
        let passed = end_to_end(&incoming);
        let mut names: Vec<&str> = passed.keys().map(HeaderName::as_str).collect();
        names.sort_unstable();
        assert_eq!(
            names,
            [
                "authorization",
                "traceparent",
                "user-agent",
                "x-payload-bin",
                "x-tenant"
            ]
        );
        assert_eq!(passed.get_all("x-tenant").iter().count(), 2);

        // Filtered in place, the same pass on, with the headers asked to be kept.
        let mut in_place = incoming.clone();
        let mut seen = 0;
        keep_end_to_end(&mut in_place, &[header::CONTENT_TYPE, header::USER_AGENT], |_, _| {
            seen += 1
        });
        assert_eq!(seen, incoming.len());
        let mut names: Vec<&str> = in_place.keys().map(HeaderName::as_str).collect();
        names.sort_unstable();
        assert_eq!(
            names,
            [
                "authorization",
                "content-type",
                "traceparent",
                "user-agent",
                "x-payload-bin",
                "x-tenant"
            ]
        );
        assert_eq!(in_place.get_all("x-tenant").iter().count(), 2);
    }

    #[test]
    fn a_request_head_is_read_in_one_pass() {
        let incoming = map(&[
            ("content-type", "application/json"),
            ("content-length", "12"),
            ("content-encoding", "gzip"),
            ("content-encoding", "identity"),
            ("accept", "application/json"),
            ("accept-encoding", "deflate"),
            ("inference-header-content-length", "7"),
            ("connection", "x-hop"),
            ("x-hop", "1"),
            ("x-tenant", "a"),
        ]);
        let read = RequestHeaders::read(&incoming);
        let text = |value: Option<&HeaderValue>| value.map(|v| v.to_str().unwrap().to_owned());
        assert_eq!(text(read.content_type).as_deref(), Some("application/json"));
        assert_eq!(text(read.content_length).as_deref(), Some("12"));
        assert_eq!(text(read.content_encoding).as_deref(), Some("gzip"));
        assert_eq!(text(read.accept).as_deref(), Some("application/json"));
        assert_eq!(text(read.accept_encoding).as_deref(), Some("deflate"));
        assert_eq!(text(read.inference_header_length).as_deref(), Some("7"));
        let forward = read.forward();
        let mut names: Vec<&str> = forward.keys().map(HeaderName::as_str).collect();
        names.sort_unstable();
        assert_eq!(names, ["x-request-id", "x-tenant"]);
        assert_eq!(forward[REQUEST_ID], read.request_id);

        let with_id = map(&[("x-request-id", "abc")]);
        let read = RequestHeaders::read(&with_id);
        assert_eq!(read.request_id, "abc");
        assert!(read.request_id.is_sensitive());
        let forward = read.forward();
        assert!(forward[REQUEST_ID].is_sensitive());
        assert_eq!(forward.len(), 1);

        // An id the client's Connection names is not the request's: one is made.
        let nominated = map(&[("x-request-id", "abc"), ("connection", "X-Request-Id")]);
        let read = RequestHeaders::read(&nominated);
        assert_ne!(read.request_id, "abc");
        assert_eq!(read.forward()[REQUEST_ID], read.request_id);
    }

    /// What a passthrough writes: the pairs of the map [`RequestHeaders::forward`] builds, in any order, but those
    /// another source overrides.
    #[test]
    fn a_passthrough_sends_what_the_forwarded_map_holds() {
        let cases = [
            map(&[]),
            map(&[("x-request-id", "abc"), ("x-tenant", "a"), ("x-tenant", "b")]),
            map(&[
                ("connection", "keep-alive, X-Private, x-request-id"),
                ("x-private", "secret"),
                ("x-request-id", "abc"),
                ("keep-alive", "timeout=5"),
                ("content-type", "application/json"),
                ("grpc-timeout", "5S"),
                ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
                ("authorization", "Bearer t"),
                ("host", "example"),
            ]),
        ];
        let sorted = |mut pairs: Vec<(String, HeaderValue)>| {
            pairs.sort_by(|a, b| (&a.0, a.1.as_bytes()).cmp(&(&b.0, b.1.as_bytes())));
            pairs
        };
        for incoming in &cases {
            let read = RequestHeaders::read(incoming);
            let forward = read.forward();
            let passed = read.passed_on();
            let built = sorted(
                forward
                    .iter()
                    .map(|(name, value)| (name.to_string(), value.clone()))
                    .collect(),
            );
            let mut sent = Vec::new();
            passed.each(|_| false, |name, value| sent.push((name.to_string(), value.clone())));
            assert_eq!(built, sorted(sent), "{incoming:?}");
            let mut traced = Vec::new();
            passed.each(
                |name| name.as_str() == "traceparent",
                |name, _| traced.push(name.to_string()),
            );
            assert!(traced.iter().all(|name| name != "traceparent"));
        }
    }

    #[test]
    fn a_header_kept_by_name_stays_when_connection_names_it() {
        let mut answer = map(&[
            ("connection", "content-type, x-hop"),
            ("content-type", "application/json"),
            ("x-hop", "1"),
            ("date", "today"),
        ]);
        keep_end_to_end(&mut answer, &[header::CONTENT_TYPE], |_, _| {});
        let names: Vec<&str> = answer.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["content-type"]);
    }

    #[test]
    fn a_request_id_is_kept_or_made() {
        let kept = for_backend(&map(&[("x-request-id", "abc")]));
        assert_eq!(kept[REQUEST_ID], "abc");
        let made = for_backend(&HeaderMap::new());
        let other = for_backend(&HeaderMap::new());
        assert_ne!(made[REQUEST_ID], other[REQUEST_ID]);
    }

    #[test]
    fn a_made_request_id_is_the_start_time_and_a_counter_in_hex() {
        let first = new_request_id();
        let second = new_request_id();
        let parts = |id: &HeaderValue| {
            let (start, count) = id.to_str().unwrap().split_once('-').unwrap();
            assert_eq!((start.len(), count.len()), (16, 8), "{id:?}");
            (
                u64::from_str_radix(start, 16).unwrap(),
                u64::from_str_radix(count, 16).unwrap(),
            )
        };
        let (start, count) = parts(&first);
        let (start_again, next) = parts(&second);
        assert_eq!(start, start_again);
        assert!(next > count);
        let mut digits = [0u8; 8];
        hex_into(&mut digits, 0x1234_abcd);
        assert_eq!(&digits, b"1234abcd");
    }

    #[test]
    fn made_request_ids_are_unique_across_threads() {
        // More than a thread takes at once, on each of several threads at the same time.
        let made: Vec<Vec<HeaderValue>> = std::thread::scope(|scope| {
            let threads: Vec<_> = (0..4)
                .map(|_| scope.spawn(|| (0..3000).map(|_| new_request_id()).collect()))
                .collect();
            threads.into_iter().map(|thread| thread.join().unwrap()).collect()
        });
        let mut seen = std::collections::HashSet::new();
        for id in made.iter().flatten() {
            // Sensitive values print as `Sensitive`: the id's own bytes name it.
            let text = String::from_utf8_lossy(id.as_bytes()).into_owned();
            assert!(seen.insert(text.clone()), "{text} made twice");
        }
        assert_eq!(seen.len(), 12_000);
    }
}
