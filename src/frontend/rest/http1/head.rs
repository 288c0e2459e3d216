//! A request's head read off an HTTP/1.1 connection: parsed by httparse, its header values slices of the head (not
//! copied), its body's framing told by its headers as RFC 9112 §6 asks, and the refusals a head earns (400, 414, 431)
//! made before anything of it goes further.

use bytes::BytesMut;
use http::{Method, StatusCode, Uri, Version};

use crate::codec::http1::{self, BadHeader, Framing, ParsedHeaders};
use crate::frontend::MAX_HEAD_BYTES;
use crate::frontend::rest::MAX_TARGET_BYTES;

/// The most header fields a request head may carry (Apache's `LimitRequestFields`); beyond it the answer is 431.
pub(super) const MAX_HEADERS: usize = 100;

/// A request's head, read.
#[derive(Debug)]
pub(super) struct RequestHead {
    /// Boxed: the head is handed from the connection to the door and kept there while the request is under way, and
    /// each move of it inline would be written into a request's state afresh (a box the thread has just freed is in
    /// cache).
    pub parts: Box<http::request::Parts>,
    pub framing: Framing,
    /// The connection closes after this request (the client said so, or spoke HTTP/1.0 without keep-alive).
    pub close: bool,
    /// An HTTP/1.0 client asked to keep the connection: the answer says it is kept.
    pub keep_alive_10: bool,
    /// The client waits for `100 Continue` before it sends the body.
    pub expects_continue: bool,
}

/// Why a head is refused: the connection answers it and closes.
#[derive(Debug)]
pub(super) struct Refusal {
    pub status: StatusCode,
    pub message: String,
}

impl Refusal {
    fn new(status: StatusCode, message: impl Into<String>) -> Refusal {
        Refusal {
            status,
            message: message.into(),
        }
    }

    fn bad(message: impl Into<String>) -> Refusal {
        Refusal::new(StatusCode::BAD_REQUEST, message)
    }

    pub(super) fn timed_out() -> Refusal {
        Refusal::new(
            StatusCode::REQUEST_TIMEOUT,
            "the request head did not arrive in time (408)",
        )
    }

    fn too_large() -> Refusal {
        Refusal::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            format!("the request head is larger than {MAX_HEAD_BYTES} bytes"),
        )
    }
}

/// A request whose body is framed both by Content-Length and by Transfer-Encoding: RFC 9112 §6.3 lets a server refuse
/// it, and as often as not it is request smuggling.
pub(super) const FRAMED_BOTH_WAYS: &str = "the request has both Content-Length and Transfer-Encoding; send one";

/// Reads a request's head from the start of `read`, taking it off the buffer when whole; `None` while it is partial.
pub(super) fn read_head(read: &mut BytesMut) -> Result<Option<RequestHead>, Refusal> {
    let mut slots = [const { std::mem::MaybeUninit::uninit() }; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut []);
    // Empty lines before a request line are let go (RFC 9112 §2.2): httparse skips them.
    let length =
        match httparse::ParserConfig::default().parse_request_with_uninit_headers(&mut request, read, &mut slots) {
            Ok(httparse::Status::Complete(length)) if length <= MAX_HEAD_BYTES => length,
            Ok(httparse::Status::Partial) if read.len() <= MAX_HEAD_BYTES => {
                if read.len() > MAX_TARGET_BYTES + 32 && memchr::memchr(b'\n', read).is_none() {
                    return Err(target_too_long());
                }
                return Ok(None);
            }
            Ok(_) => return Err(Refusal::too_large()),
            Err(httparse::Error::TooManyHeaders) => {
                return Err(Refusal::new(
                    StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                    format!("the request has more than {MAX_HEADERS} headers"),
                ));
            }
            Err(error) => return Err(Refusal::bad(format!("a malformed request head ({error})"))),
        };
    let method = Method::from_bytes(request.method.unwrap_or_default().as_bytes())
        .map_err(|_| Refusal::bad("a malformed request method"))?;
    let target = request.path.unwrap_or_default();
    if target.len() > MAX_TARGET_BYTES {
        return Err(target_too_long());
    }
    let base = read.as_ptr() as usize;
    let target = {
        let start = target.as_ptr() as usize - base;
        start..start + target.len()
    };
    let version = if request.version == Some(0) {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    let places = http1::places(request.headers, read.as_ptr());
    let head = read.split_to(length).freeze();
    let uri = Uri::from_maybe_shared(head.slice(target)).map_err(|_| Refusal::bad("a malformed request target"))?;
    let mut said = ParsedRequestHeaders {
        version,
        // The Host a client names is the gateway's: never passed on (each hop names its own), and nothing routes on it.
        said: ParsedHeaders::new(places.count(), b"host"),
        hosts: 0,
        host_valid: true,
    };
    places.each(
        &head,
        || Refusal::bad("a malformed request head"),
        |name, value| said.note(name, value),
    )?;
    said.into_head(method, uri)
}

/// Whether a Host value is `uri-host [ ":" port ]` (RFC 9110 §7.2, RFC 3986 §3.2.2), or empty (a target without an
/// authority): an IP literal in brackets or a name of unreserved, sub-delimiter and percent characters, then digits
/// after a colon. Read a byte at a time: each request's Host passes here.
fn is_host(value: &[u8]) -> bool {
    if value.is_empty() {
        return true;
    }
    let (host, rest) = if value[0] == b'[' {
        let Some(close) = value.iter().position(|&byte| byte == b']') else {
            return false;
        };
        let literal = &value[1..close];
        let valid = !literal.is_empty()
            && literal
                .iter()
                .all(|byte| byte.is_ascii_hexdigit() || matches!(byte, b':' | b'.' | b'v' | b'V'));
        if !valid {
            return false;
        }
        (&value[..=close], &value[close + 1..])
    } else {
        let end = value.iter().position(|&byte| byte == b':').unwrap_or(value.len());
        (&value[..end], &value[end..])
    };
    let name_ok = host.first() == Some(&b'[')
        || (!host.is_empty()
            && host.iter().all(|byte| {
                byte.is_ascii_alphanumeric()
                    || matches!(
                        byte,
                        b'-' | b'.'
                            | b'_'
                            | b'~'
                            | b'%'
                            | b'!'
                            | b'$'
                            | b'&'
                            | b'\''
                            | b'('
                            | b')'
                            | b'*'
                            | b'+'
                            | b','
                            | b';'
                            | b'='
                    )
            }));
    let port_ok = match rest.split_first() {
        None => true,
        Some((b':', port)) => port.iter().all(u8::is_ascii_digit),
        Some(_) => false,
    };
    name_ok && port_ok
}

fn target_too_long() -> Refusal {
    Refusal::new(
        StatusCode::URI_TOO_LONG,
        format!("the request target is longer than {MAX_TARGET_BYTES} bytes"),
    )
}

/// A request's headers, read.
struct ParsedRequestHeaders {
    version: Version,
    said: ParsedHeaders,
    /// How many Host fields it has.
    hosts: u32,
    /// Each of them is a host and optional port (or empty).
    host_valid: bool,
}

impl ParsedRequestHeaders {
    fn note(&mut self, name: &[u8], value: http1::FieldValue<'_>) -> Result<(), Refusal> {
        if name.eq_ignore_ascii_case(b"host") {
            self.hosts += 1;
            self.host_valid &= is_host(value.as_bytes());
        }
        self.said.note(name, value).map_err(|bad| {
            Refusal::bad(match bad {
                BadHeader::Name => "a request header with an invalid name".to_owned(),
                BadHeader::Length => "an invalid Content-Length".to_owned(),
                BadHeader::TwoLengths => "two different Content-Length values".to_owned(),
            })
        })
    }

    fn into_head(self, method: Method, uri: Uri) -> Result<Option<RequestHead>, Refusal> {
        let ParsedRequestHeaders {
            version,
            said,
            hosts,
            host_valid,
        } = self;
        // RFC 9112 §3.2: an HTTP/1.1 request without Host, with two, or with one that names no host is refused.
        match hosts {
            0 if version == Version::HTTP_11 => return Err(Refusal::bad("an HTTP/1.1 request without a Host header")),
            0 | 1 => {}
            _ => return Err(Refusal::bad("a request with more than one Host header")),
        }
        if !host_valid {
            return Err(Refusal::bad("a Host header that is not a host and optional port"));
        }
        let codings = said.codings;
        let framing = match (codings.given, said.length) {
            (true, Some(_)) => return Err(Refusal::bad(FRAMED_BOTH_WAYS)),
            (true, None) if version == Version::HTTP_10 => {
                return Err(Refusal::bad("an HTTP/1.0 request with a Transfer-Encoding"));
            }
            // RFC 9112 §6.3: without chunked last, the body's end cannot be told.
            (true, None) if !codings.last_chunked => {
                return Err(Refusal::bad(
                    "a Transfer-Encoding whose last coding is not chunked: the body's end cannot be told",
                ));
            }
            (true, None) if codings.chunked > 1 => {
                return Err(Refusal::bad("a Transfer-Encoding that lists chunked more than once"));
            }
            // RFC 9112 §6.1: a transfer coding the server does not implement is 501.
            (true, None) if codings.other => {
                return Err(Refusal::new(
                    StatusCode::NOT_IMPLEMENTED,
                    "a Transfer-Encoding other than chunked is not implemented; send the body chunked, or compressed \
                     with Content-Encoding",
                ));
            }
            (true, None) => Framing::chunked(),
            (false, length) => Framing::Length(length.unwrap_or(0)),
        };
        let http10 = version == Version::HTTP_10;
        let mut parts = Box::new(http::Request::new(()).into_parts().0);
        parts.method = method;
        parts.uri = uri;
        parts.version = version;
        parts.headers = said.headers;
        Ok(Some(RequestHead {
            parts,
            framing,
            close: said.close || (http10 && !said.keep_alive),
            keep_alive_10: http10 && said.keep_alive && !said.close,
            expects_continue: said.expects_continue && !http10,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(head: &str) -> Result<RequestHead, Refusal> {
        read_head(&mut BytesMut::from(head.as_bytes())).map(|head| head.expect("a whole head"))
    }

    fn refused(head: &str) -> (StatusCode, String) {
        let refusal = read(head).expect_err(head);
        (refusal.status, refusal.message)
    }

    #[test]
    fn host_is_required_once_and_must_name_a_host() {
        for good in [
            "host: x",
            "Host: gateway:8000",
            "host: [::1]:80",
            "host: 127.0.0.1",
            "host:",
        ] {
            assert!(read(&format!("GET / HTTP/1.1\r\n{good}\r\n\r\n")).is_ok(), "{good}");
        }
        assert!(read("GET / HTTP/1.0\r\n\r\n").is_ok(), "HTTP/1.0 needs no Host");
        for (bad, says) in [
            ("", "without a Host"),
            ("host: a\r\nhost: a", "more than one Host"),
            ("host: a\r\nHOST: b", "more than one Host"),
            ("host: user@a", "not a host"),
            ("host: a/b", "not a host"),
            ("host: a b", "not a host"),
            ("host: a:port", "not a host"),
            ("host: :80", "not a host"),
            ("host: [zz]:80", "not a host"),
            ("host: [::1]x", "not a host"),
            ("host: a:1:2", "not a host"),
            ("host: a?b", "not a host"),
        ] {
            let head = format!("GET / HTTP/1.1\r\n{bad}\r\n\r\n").replace("\r\n\r\n\r\n", "\r\n\r\n");
            let (status, message) = refused(&head);
            assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
            assert!(message.contains(says), "{bad}: {message}");
        }
    }

    #[test]
    fn transfer_codings_are_read_as_rfc_9112_says() {
        let post = |fields: &str| format!("POST / HTTP/1.1\r\nhost: x\r\n{fields}\r\n");
        assert!(matches!(
            read(&post("transfer-encoding: chunked\r\n")).unwrap().framing,
            Framing::Chunked(..)
        ));
        assert!(matches!(
            read(&post("transfer-encoding: ,chunked\r\n")).unwrap().framing,
            Framing::Chunked(..)
        ));
        for (fields, status, says) in [
            (
                "transfer-encoding: gzip, chunked\r\n",
                StatusCode::NOT_IMPLEMENTED,
                "not implemented",
            ),
            (
                "transfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n",
                StatusCode::NOT_IMPLEMENTED,
                "not implemented",
            ),
            (
                "transfer-encoding: chunked, chunked\r\n",
                StatusCode::BAD_REQUEST,
                "more than once",
            ),
            (
                "transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n",
                StatusCode::BAD_REQUEST,
                "more than once",
            ),
            (
                "transfer-encoding: chunked, gzip\r\n",
                StatusCode::BAD_REQUEST,
                "last coding",
            ),
            ("transfer-encoding: \r\n", StatusCode::BAD_REQUEST, "last coding"),
            (
                "transfer-encoding: chunked\r\ncontent-length: 3\r\n",
                StatusCode::BAD_REQUEST,
                "both",
            ),
            (
                "content-length: 3\r\ncontent-length: 4\r\n",
                StatusCode::BAD_REQUEST,
                "two different",
            ),
        ] {
            let (got, message) = refused(&post(fields));
            assert_eq!(got, status, "{fields}");
            assert!(message.contains(says), "{fields}: {message}");
        }
        let head = read(&post("content-length: 3, 3\r\ncontent-length: 3\r\n")).unwrap();
        assert!(matches!(head.framing, Framing::Length(3)));
        assert_eq!(head.parts.headers.get_all("content-length").iter().count(), 1);
    }
}
