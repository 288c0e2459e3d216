//! A request's head read off an HTTP/1.1 connection: parsed by httparse, its header values slices of the head (not
//! copied), its body's framing told by its headers as RFC 9112 §6 asks, and the refusals a head earns (400, 414, 431)
//! made before anything of it goes further.

use bytes::BytesMut;
use http::{Method, StatusCode, Uri, Version};

use crate::codec::http1::{self, BadHeader, Framing, Said};
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
    let mut said = RequestSaid {
        version,
        // The Host a client names is the gateway's: never passed on (each hop names its own), and nothing routes on it.
        said: Said::new(places.count(), b"host"),
    };
    places.each(
        &head,
        || Refusal::bad("a malformed request head"),
        |name, value| said.note(name, value),
    )?;
    said.into_head(method, uri)
}

fn target_too_long() -> Refusal {
    Refusal::new(
        StatusCode::URI_TOO_LONG,
        format!("the request target is longer than {MAX_TARGET_BYTES} bytes"),
    )
}

/// A request's headers, read.
struct RequestSaid {
    version: Version,
    said: Said,
}

impl RequestSaid {
    fn note(&mut self, name: &[u8], value: http::HeaderValue) -> Result<(), Refusal> {
        self.said.note(name, value).map_err(|bad| {
            Refusal::bad(match bad {
                BadHeader::Name => "a request header with an invalid name".to_owned(),
                BadHeader::Length => "an invalid Content-Length".to_owned(),
                BadHeader::TwoLengths => "two different Content-Length values".to_owned(),
            })
        })
    }

    fn into_head(self, method: Method, uri: Uri) -> Result<Option<RequestHead>, Refusal> {
        let RequestSaid { version, said } = self;
        let framing = match (said.coded, said.length) {
            (true, Some(_)) => return Err(Refusal::bad(FRAMED_BOTH_WAYS)),
            (true, None) if version == Version::HTTP_10 => {
                return Err(Refusal::bad("an HTTP/1.0 request with a Transfer-Encoding"));
            }
            (true, None) if !said.chunked => {
                return Err(Refusal::bad(
                    "a Transfer-Encoding whose last coding is not chunked: the body's end cannot be told",
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
