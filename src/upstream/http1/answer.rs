//! A backend's answer read off its connection: the head with httparse (header values are the head's own bytes), the
//! body by its length, its chunks or the connection's end; and the connection given back once the body is read.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Instant;

use bytes::{Buf, Bytes, BytesMut};
use http::header::CONTENT_LENGTH;
use http::{HeaderMap, StatusCode, Version};
use hyper::body::{Body, Frame, SizeHint};

use super::{MOST_IDLE, PooledConnection, READ_FIRST, broken, closed, this_thread};
use crate::codec::http1::{self, BadHeader, Framing, HeaderLines, KeptLines, ParsedHeaders, Places};
use crate::headers::{ANSWER_AS_SENT, INFERENCE_HEADER_CONTENT_LENGTH, keep_end_to_end, passes_back};
use crate::runtime::ThreadArc;

/// The most bytes an answer's head (status line and headers) may take; a longer one is a broken answer.
pub(super) const MOST_HEAD: usize = 128 * 1024;

/// The most headers an answer may have (hyper's limit for a client).
pub(super) const MOST_HEADERS: usize = 100;

/// An answer's head, read.
pub(super) struct AnswerHead {
    pub(super) status: StatusCode,
    version: Version,
    pub(super) headers: HeaderMap,
    /// The headers as lines in the head, when asked for (the map is then empty).
    pub(super) passed: Option<Box<PassedAnswer>>,
    pub(super) framing: Framing,
    /// The connection may carry another request once the body is read.
    pub(super) reusable: bool,
}

/// An answer passed back as it came: the lines it goes back with, left in its head, and what the passthrough checks
/// of its headers.
#[derive(Debug)]
pub struct PassedAnswer {
    /// Those [`passes_back`] names, but Content-Length: the body's framing says its length again.
    pub lines: HeaderLines,
    /// Content-Length, when given and neither a transfer coding nor the connection's end frames the body (an answer
    /// with no body keeps the length it said).
    pub length: Option<u64>,
    /// The first Inference-Header-Content-Length, read as a length.
    pub header_length: Option<u64>,
    /// A Content-Encoding is given.
    pub coded: bool,
}

/// What a backend answer's head says of its body: its lengths (each header's first value, read as a length) and
/// whether it names a coding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodySaid {
    pub length: Option<u64>,
    pub header_length: Option<u64>,
    pub coded: bool,
}

/// Leaves in an answer's map the headers that go back with it as it came ([`passes_back`]), and reads what they say
/// of its body: the one reading of an answer passed back in a map (one passed back as lines is read as it is parsed).
pub fn keep_passed_back(headers: &mut HeaderMap) -> BodySaid {
    let (mut header_length, mut length, mut coded) = (None, None, false);
    keep_end_to_end(headers, &ANSWER_AS_SENT, |name, value| {
        let slot = if *name == INFERENCE_HEADER_CONTENT_LENGTH {
            &mut header_length
        } else if *name == CONTENT_LENGTH {
            &mut length
        } else {
            coded |= *name == http::header::CONTENT_ENCODING;
            return;
        };
        slot.get_or_insert_with(|| crate::codec::rest::length_value(value.as_bytes()));
    });
    BodySaid {
        length: length.flatten(),
        header_length: header_length.flatten(),
        coded,
    }
}

impl AnswerHead {
    /// Its status, its body's framing and whether its connection may be kept.
    #[cfg(feature = "fuzzing")]
    pub(super) fn described(&self) -> (StatusCode, Framing, bool) {
        (self.status, self.framing, self.reusable)
    }

    /// The answer, its body read from `kept` (which goes back to the endpoint of `token` once the body is read).
    pub(super) fn into_response(
        self,
        kept: Box<PooledConnection>,
        token: ThreadArc<()>,
    ) -> http::Response<BackendBody> {
        let mut response = http::Response::new(BackendBody {
            framing: self.framing,
            passed: self.passed,
            kept: Some(kept),
            token,
        });
        *response.status_mut() = self.status;
        *response.version_mut() = self.version;
        *response.headers_mut() = self.headers;
        response
    }
}

/// What the bytes at hand hold of an answer's head.
pub(super) enum Parsed {
    Answer(AnswerHead),
    /// An interim answer (100 Continue and the like), now dropped: the answer follows.
    Interim,
    Partial,
}

/// Reads an answer's head from the start of `read`, taking it off the buffer when whole. The header values are the
/// head's own bytes, shared, not copied. Asked `as_lines`, the headers are left as lines in the head where they can
/// be: an answer to anything but HEAD, whose `Connection` names no header (no token but `close` and `keep-alive`),
/// with no more headers than are placed, nor lines to pass back than are kept.
pub(super) fn read_head(read: &mut BytesMut, asked_head: bool, as_lines: bool) -> io::Result<Parsed> {
    let mut slots = [const { std::mem::MaybeUninit::uninit() }; MOST_HEADERS];
    let mut answer = httparse::Response::new(&mut []);
    let length =
        match httparse::ParserConfig::default().parse_response_with_uninit_headers(&mut answer, read, &mut slots) {
            Ok(httparse::Status::Complete(length)) if length <= MOST_HEAD => length,
            Ok(httparse::Status::Partial) if read.len() <= MOST_HEAD => return Ok(Parsed::Partial),
            Ok(_) => return Err(broken(format!("an answer head over {MOST_HEAD} bytes"))),
            Err(httparse::Error::TooManyHeaders) => {
                return Err(broken(format!("an answer with more than {MOST_HEADERS} headers")));
            }
            Err(error) => return Err(broken(format!("a malformed answer head ({error})"))),
        };
    let code = answer.code.unwrap_or_default();
    let status = StatusCode::from_u16(code).map_err(|_| broken(format!("an answer with status {code}")))?;
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Err(broken("an answer switching protocols, which no request asked for"));
    }
    if status.is_informational() {
        read.advance(length);
        return Ok(Parsed::Interim);
    }
    let version = if answer.version == Some(0) {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    // Where each header lies in the head, noted while the parse borrows the buffer, so that the values can be
    // slices of the head once it is split off.
    let places = http1::places(answer.headers, read.as_ptr());
    let head = read.split_to(length).freeze();
    if as_lines && !asked_head {
        let mut said = ParsedAnswerHeaders {
            version,
            said: ParsedHeaders::new(0, b"date"),
        };
        if let Some(read) = said.read_lines(&head, &places)? {
            let length = said.said.length;
            let mut answer = said.into_head(status, false)?;
            answer.passed = Some(Box::new(PassedAnswer {
                lines: HeaderLines::new(head, read.kept),
                length: length.filter(|_| matches!(answer.framing, Framing::Length(_))),
                header_length: read.header_length,
                coded: read.coded,
            }));
            return Ok(Parsed::Answer(answer));
        }
    }
    let mut said = ParsedAnswerHeaders {
        version,
        // A backend's Date is never passed on: each hop dates the answers it sends. Room is made for the two headers
        // the gateway adds to every answer it passes back (the request id and the serving version): grown for them,
        // the map would be allocated twice for each. (A compressed one adds two more, and grows.)
        said: ParsedHeaders::new(places.count() + 2, b"date"),
    };
    places.each(
        &head,
        || broken("a malformed answer head"),
        |name, value| said.note(name, value),
    )?;
    Ok(Parsed::Answer(said.into_head(status, asked_head)?))
}

/// An answer's headers, read.
struct ParsedAnswerHeaders {
    version: Version,
    said: ParsedHeaders,
}

impl ParsedAnswerHeaders {
    fn note(&mut self, name: &[u8], value: http1::FieldValue<'_>) -> io::Result<()> {
        self.said.note(name, value).map_err(broken_header)
    }

    /// Which headers of `head` at `places` go back as lines, and what the passthrough checks of them; `None` where
    /// they cannot be left as lines (more headers than are placed or kept, or a `Connection` that names one), and
    /// are read into a map instead.
    fn read_lines(&mut self, head: &[u8], places: &Places) -> io::Result<Option<LinesRead>> {
        let Some(all) = places.all(head) else {
            return Ok(None);
        };
        let mut read = LinesRead {
            kept: KeptLines::default(),
            header_length: None,
            coded: false,
        };
        let mut header_length = None;
        for (place, name, value) in all {
            let Some((name, _)) = self.read(name, value)? else {
                continue;
            };
            if name == INFERENCE_HEADER_CONTENT_LENGTH {
                header_length.get_or_insert_with(|| crate::codec::rest::length_value(value));
            } else {
                read.coded |= name == http::header::CONTENT_ENCODING;
            }
            if name != CONTENT_LENGTH && passes_back(&name) && !read.kept.keep(place, &name) {
                return Ok(None);
            }
        }
        read.header_length = header_length.flatten();
        Ok((!self.said.nominates).then_some(read))
    }

    /// Reads what one header says, as [`ParsedHeaders::read`], its faults as a broken answer.
    fn read(&mut self, name: &[u8], value: &[u8]) -> io::Result<Option<(http::HeaderName, http1::Said)>> {
        self.said.read(name, value).map_err(broken_header)
    }

    /// The head, its body framed as the headers say (RFC 9112 §6.3). A transfer coding other than `chunked` is one
    /// the gateway cannot undo, and `chunked` twice frames nothing: both are broken answers.
    fn into_head(self, status: StatusCode, asked_head: bool) -> io::Result<AnswerHead> {
        let ParsedAnswerHeaders { version, mut said } = self;
        let codings = said.codings;
        if codings.other {
            return Err(broken("an answer with a transfer coding other than chunked"));
        }
        if codings.chunked > 1 {
            return Err(broken("an answer chunked more than once"));
        }
        // Framed both ways, the answer may be smuggling another: the chunks frame it, and its connection goes.
        let framed_both_ways = codings.given && said.length.is_some();
        let framing = if asked_head || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
            Framing::Length(0)
        } else if codings.last_chunked {
            // A length beside the chunks says nothing true about the body.
            said.headers.remove(CONTENT_LENGTH);
            Framing::chunked()
        } else if codings.given {
            said.headers.remove(CONTENT_LENGTH);
            Framing::UntilClose
        } else {
            said.length.map_or(Framing::UntilClose, Framing::Length)
        };
        let close = said.close || framed_both_ways || (version == Version::HTTP_10 && !said.keep_alive);
        Ok(AnswerHead {
            status,
            version,
            reusable: !close && !matches!(framing, Framing::UntilClose),
            headers: said.headers,
            passed: None,
            framing,
        })
    }
}

/// Which of an answer's header lines go back, and what the passthrough checks of them.
struct LinesRead {
    kept: KeptLines,
    header_length: Option<u64>,
    coded: bool,
}

/// An answer header that cannot be read, as a broken answer.
fn broken_header(bad: BadHeader) -> io::Error {
    match bad {
        BadHeader::Name => broken("an answer header with an invalid name"),
        BadHeader::Length => broken("an answer with an invalid Content-Length"),
        BadHeader::TwoLengths => broken("an answer with two different Content-Length values"),
    }
}

/// A REST backend's answer body, read from the connection it came on; once it has been read to the end the
/// connection goes back to its thread's idle ones.
#[derive(Debug)]
pub struct BackendBody {
    framing: Framing,
    /// The answer's headers as lines in its head, when asked for.
    passed: Option<Box<PassedAnswer>>,
    /// Boxed: a connection moves with the request at every step.
    kept: Option<Box<PooledConnection>>,
    /// The endpoint's entry in each thread's table, through this thread's handle on it.
    token: ThreadArc<()>,
}

impl BackendBody {
    /// The answer's headers as lines, when they were asked for and could be.
    pub fn passed(&mut self) -> Option<&mut PassedAnswer> {
        self.passed.as_deref_mut()
    }

    /// Takes the answer's headers as lines, to be written.
    pub fn take_passed(&mut self) -> Option<Box<PassedAnswer>> {
        self.passed.take()
    }

    /// The next piece of the body from the connection.
    fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<io::Result<Bytes>>> {
        let Some(kept) = self.kept.as_deref_mut() else {
            return Poll::Ready(None);
        };
        loop {
            if let Some(data) = self
                .framing
                .take(&mut kept.read)
                .map_err(|error| broken(format!("an answer with {error}")))?
            {
                return Poll::Ready(Some(Ok(data)));
            }
            if self.framing.is_done() {
                return Poll::Ready(None);
            }
            let want = match self.framing {
                Framing::UntilClose => kept.read_size,
                _ => self.framing.want(kept.read_size.max(READ_FIRST)),
            };
            if ready!(kept.poll_fill(cx, want))? == 0 {
                return match self.framing {
                    Framing::UntilClose => {
                        self.framing = Framing::Length(0);
                        Poll::Ready(None)
                    }
                    Framing::Length(_) => {
                        Poll::Ready(Some(Err(closed("the connection closed before the answer's end"))))
                    }
                    Framing::Chunked(..) => Poll::Ready(Some(Err(closed(
                        "the connection closed before the answer's last chunk",
                    )))),
                };
            }
        }
    }
}

impl Body for BackendBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        let polled = this.poll_data(cx);
        if let Poll::Ready(Some(Err(_))) = &polled
            && let Some(kept) = &mut this.kept
        {
            kept.ended = true;
        }
        polled.map(|data| data.map(|data| data.map(Frame::data)))
    }

    fn is_end_stream(&self) -> bool {
        self.framing.is_done()
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(left) => SizeHint::with_exact(left),
            _ => SizeHint::default(),
        }
    }
}

impl Drop for BackendBody {
    fn drop(&mut self) {
        // An answer not read to its end leaves the connection mid-message: it is closed, not kept. So is one after
        // which the backend sent more than it was asked for.
        let Some(mut kept) = self.kept.take() else {
            return;
        };
        if kept.ended || !self.framing.is_done() || !kept.read.is_empty() || kept.thread != this_thread() {
            return;
        }
        kept.idle_since = Instant::now();
        super::super::with_endpoint(&self.token, move |endpoint| {
            if endpoint.idle.len() < MOST_IDLE {
                endpoint.idle.push(kept);
            }
        });
    }
}

/// Reads the answer head at the start of `bytes` both ways, its headers left as lines and read into a map, and checks
/// that they agree: the same status, framing and connection, the lengths and coding the passthrough checks, and the
/// lines writing what the map would once filtered as a passthrough filters it, with and without the gateway's own
/// values set. `false` when the answer is not read as lines (nor into a map).
#[cfg(any(test, feature = "fuzzing"))]
pub(super) fn lines_match_map(bytes: &[u8], asked_head: bool) -> bool {
    use crate::headers::{OIP_MODEL_VERSION, REQUEST_ID};
    use http::HeaderValue;
    // Past any interim answers, as the client reads them.
    let read = |as_lines| {
        let mut read = BytesMut::from(bytes);
        loop {
            match read_head(&mut read, asked_head, as_lines) {
                Ok(Parsed::Answer(answer)) => return Some(answer),
                Ok(Parsed::Interim) => {}
                _ => return None,
            }
        }
    };
    let (Some(as_lines), Some(as_map)) = (read(true), read(false)) else {
        return false;
    };
    let Some(mut passed) = as_lines.passed else {
        return false;
    };
    assert!(as_lines.headers.is_empty(), "a map beside the lines");
    assert_eq!(
        format!("{:?}", (as_lines.status, as_lines.framing, as_lines.reusable)),
        format!("{:?}", (as_map.status, as_map.framing, as_map.reusable))
    );
    let mut map = as_map.headers;
    let said = keep_passed_back(&mut map);
    // The lines leave the length out: the door writes the body's framing.
    map.remove(CONTENT_LENGTH);
    assert_eq!(
        (passed.length, passed.header_length, passed.coded),
        (said.length, said.header_length, said.coded)
    );
    let written = |lines: &HeaderLines| {
        let mut written = Vec::new();
        lines.each(|name, value| written.push((name.to_ascii_lowercase(), value.to_vec())));
        written.sort();
        written
    };
    let in_map = |map: &HeaderMap| {
        let mut pairs: Vec<_> = map
            .iter()
            .map(|(name, value)| (name.as_str().as_bytes().to_vec(), value.as_bytes().to_vec()))
            .collect();
        pairs.sort();
        pairs
    };
    assert_eq!(written(&passed.lines), in_map(&map));
    passed.lines.set_request_id(HeaderValue::from_static("gateway"));
    passed.lines.set_served_version(HeaderValue::from_static("2"));
    map.insert(REQUEST_ID, HeaderValue::from_static("gateway"));
    map.insert(OIP_MODEL_VERSION, HeaderValue::from_static("2"));
    assert_eq!(written(&passed.lines), in_map(&map));
    true
}
