//! A backend's answer read off its connection: the head with httparse (header values are the head's own bytes), the
//! body by its length, its chunks or the connection's end; and the connection given back once the body is read.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Instant;

use bytes::{Buf, Bytes, BytesMut};
use http::header::CONTENT_LENGTH;
use http::{HeaderMap, StatusCode, Version};
use hyper::body::{Body, Frame, SizeHint};

use super::{MOST_IDLE, PooledConnection, READ_FIRST, broken, closed, this_thread};
use crate::codec::http1::{self, BadHeader, Framing, ParsedHeaders};

/// The most bytes an answer's head (status line and headers) may take; a longer one is a broken answer.
pub(super) const MOST_HEAD: usize = 128 * 1024;

/// The most headers an answer may have (hyper's limit for a client).
pub(super) const MOST_HEADERS: usize = 100;

/// An answer's head, read.
pub(super) struct AnswerHead {
    status: StatusCode,
    version: Version,
    headers: HeaderMap,
    framing: Framing,
    /// The connection may carry another request once the body is read.
    pub(super) reusable: bool,
}

impl AnswerHead {
    /// Its status, its body's framing and whether its connection may be kept.
    #[cfg(feature = "fuzzing")]
    pub(super) fn described(&self) -> (StatusCode, Framing, bool) {
        (self.status, self.framing, self.reusable)
    }

    /// The answer, its body read from `kept` (which goes back to the endpoint of `token` once the body is read).
    pub(super) fn into_response(self, kept: Box<PooledConnection>, token: Arc<()>) -> http::Response<BackendBody> {
        let mut response = http::Response::new(BackendBody {
            framing: self.framing,
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
/// head's own bytes, shared, not copied.
pub(super) fn read_head(read: &mut BytesMut, asked_head: bool) -> io::Result<Parsed> {
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
    fn note(&mut self, name: &[u8], value: http::HeaderValue) -> io::Result<()> {
        self.said.note(name, value).map_err(|bad| match bad {
            BadHeader::Name => broken("an answer header with an invalid name"),
            BadHeader::Length => broken("an answer with an invalid Content-Length"),
            BadHeader::TwoLengths => broken("an answer with two different Content-Length values"),
        })
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
            framing,
        })
    }
}

/// A REST backend's answer body, read from the connection it came on; once it has been read to the end the
/// connection goes back to its thread's idle ones.
#[derive(Debug)]
pub struct BackendBody {
    framing: Framing,
    /// Boxed: a connection moves with the request at every step.
    kept: Option<Box<PooledConnection>>,
    /// The endpoint's entry in each thread's table.
    token: Arc<()>,
}

impl BackendBody {
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
