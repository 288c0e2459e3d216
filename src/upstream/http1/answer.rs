//! A backend's answer read off its connection: the head with httparse (header values are the head's own bytes), the
//! body by its length, its chunks or the connection's end; and the connection given back once the body is read.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Instant;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Version};
use hyper::body::{Body, Frame, SizeHint};

use super::{Kept, MOST_IDLE, READ_FIRST, broken, closed, this_thread};
use crate::codec::chunked::{Chunk, Malformed};

/// The most bytes an answer's head (status line and headers) may take; a longer one is a broken answer.
pub(super) const MOST_HEAD: usize = 128 * 1024;

/// The most headers an answer may have (hyper's limit for a client).
pub(super) const MOST_HEADERS: usize = 100;

/// The most bytes of framing a chunked answer may send between two pieces of data (size lines with their extensions,
/// and the trailers after the last chunk, which are read and dropped: they are this hop's).
pub(super) const MOST_CHUNK_FRAMING: usize = 64 * 1024;

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
    /// The answer, its body read from `kept` (which goes back to the endpoint of `token` once the body is read).
    pub(super) fn into_response(self, kept: Box<Kept>, token: Arc<()>) -> http::Response<BackendBody> {
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

/// How many headers' places a head's read notes on the stack; a head with more is read a second time.
pub(super) const PLACED: usize = 16;

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
    let count = answer.headers.len();
    let base = read.as_ptr() as usize;
    let mut places: [_; PLACED] = std::array::from_fn(|_| (0..0, 0..0));
    for (place, header) in places.iter_mut().zip(answer.headers.iter()) {
        let at = |bytes: &[u8]| {
            let start = bytes.as_ptr() as usize - base;
            start..start + bytes.len()
        };
        *place = (at(header.name.as_bytes()), at(header.value));
    }
    let head = read.split_to(length).freeze();
    let mut said = Said::new(version, count);
    if count <= PLACED {
        for (name, value) in places.into_iter().take(count) {
            said.note(&head[name], head.slice(value))?;
        }
    } else {
        let mut slots = [const { std::mem::MaybeUninit::uninit() }; MOST_HEADERS];
        let mut again = httparse::Response::new(&mut []);
        httparse::ParserConfig::default()
            .parse_response_with_uninit_headers(&mut again, &head, &mut slots)
            .map_err(|error| broken(format!("a malformed answer head ({error})")))?;
        for header in again.headers.iter() {
            said.note(header.name.as_bytes(), head.slice_ref(header.value))?;
        }
    }
    Ok(Parsed::Answer(said.into_head(status, asked_head)))
}

/// What an answer's headers say of its framing and its connection, gathered with the headers.
struct Said {
    version: Version,
    headers: HeaderMap,
    length: Option<u64>,
    coded: bool,
    chunked: bool,
    close: bool,
}

impl Said {
    fn new(version: Version, count: usize) -> Said {
        Said {
            version,
            headers: HeaderMap::with_capacity(count),
            length: None,
            coded: false,
            chunked: false,
            close: version == Version::HTTP_10,
        }
    }

    fn note(&mut self, name: &[u8], value: Bytes) -> io::Result<()> {
        let name = HeaderName::from_bytes(name).map_err(|_| broken("an answer header with an invalid name"))?;
        let value = HeaderValue::from_maybe_shared(value)
            .map_err(|_| broken(format!("an invalid value of the answer's {name} header")))?;
        if name == CONTENT_LENGTH {
            let said =
                content_length(value.as_bytes()).ok_or_else(|| broken("an answer with an invalid Content-Length"))?;
            if self.length.is_some_and(|before| before != said) {
                return Err(broken("an answer with two different Content-Length values"));
            }
            self.length = Some(said);
        } else if name == TRANSFER_ENCODING {
            self.coded = true;
            self.chunked = value
                .as_bytes()
                .rsplit(|&byte| byte == b',')
                .next()
                .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if name == CONNECTION {
            for token in value.as_bytes().split(|&byte| byte == b',').map(<[u8]>::trim_ascii) {
                if token.eq_ignore_ascii_case(b"close") {
                    self.close = true;
                } else if token.eq_ignore_ascii_case(b"keep-alive") && self.version == Version::HTTP_10 {
                    self.close = false;
                }
            }
        }
        self.headers.append(name, value);
        Ok(())
    }

    /// The head, its body framed as the headers say (RFC 9112 §6.3).
    fn into_head(mut self, status: StatusCode, asked_head: bool) -> AnswerHead {
        let framing = if asked_head || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
            Framing::Length(0)
        } else if self.chunked {
            // A length beside the chunks says nothing true about the body.
            self.headers.remove(CONTENT_LENGTH);
            Framing::Chunked(Chunk::Start, 0)
        } else if self.coded {
            Framing::UntilClose
        } else {
            self.length.map_or(Framing::UntilClose, Framing::Length)
        };
        AnswerHead {
            status,
            version: self.version,
            reusable: !self.close && !matches!(framing, Framing::UntilClose),
            headers: self.headers,
            framing,
        }
    }
}

/// A Content-Length value: digits, or a list of the same digits repeated.
fn content_length(value: &[u8]) -> Option<u64> {
    let mut said = None;
    for item in value.split(|&byte| byte == b',').map(<[u8]>::trim_ascii) {
        if item.is_empty() || item.len() > 19 || !item.iter().all(u8::is_ascii_digit) {
            return None;
        }
        let length = item.iter().fold(0u64, |sum, digit| sum * 10 + u64::from(digit - b'0'));
        if said.is_some_and(|before| before != length) {
            return None;
        }
        said = Some(length);
    }
    said
}

/// How an answer's body is framed, and how much of it is left.
#[derive(Debug, Clone, Copy)]
pub(super) enum Framing {
    Length(u64),
    /// Where the chunks' reading stands, and the framing bytes read since the last data (bounded: a backend that
    /// sends extensions or trailers without end is refused).
    Chunked(Chunk, usize),
    /// Until the backend closes the connection.
    UntilClose,
}

impl Framing {
    fn is_done(&self) -> bool {
        matches!(self, Framing::Length(0) | Framing::Chunked(Chunk::Done, _))
    }
}

/// A REST backend's answer body, read from the connection it came on; once it has been read to the end the
/// connection goes back to its thread's idle ones.
#[derive(Debug)]
pub struct BackendBody {
    framing: Framing,
    /// Boxed: a connection moves with the request at every step.
    kept: Option<Box<Kept>>,
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
            match &mut self.framing {
                Framing::Length(0) | Framing::Chunked(Chunk::Done, _) => return Poll::Ready(None),
                Framing::Length(left) => {
                    if !kept.read.is_empty() {
                        let taken = kept.read.len().min(usize::try_from(*left).unwrap_or(usize::MAX));
                        *left -= taken as u64;
                        return Poll::Ready(Some(Ok(kept.read.split_to(taken).freeze())));
                    }
                    let want = usize::try_from(*left)
                        .unwrap_or(usize::MAX)
                        .min(kept.read_size.max(READ_FIRST));
                    if ready!(kept.poll_fill(cx, want))? == 0 {
                        return Poll::Ready(Some(Err(closed("the connection closed before the answer's end"))));
                    }
                }
                Framing::UntilClose => {
                    if !kept.read.is_empty() {
                        return Poll::Ready(Some(Ok(kept.read.split().freeze())));
                    }
                    if ready!(kept.poll_fill(cx, kept.read_size))? == 0 {
                        self.framing = Framing::Length(0);
                    }
                }
                Framing::Chunked(chunk, framing) => {
                    if let Some(data) = next_chunk(chunk, framing, &mut kept.read)? {
                        return Poll::Ready(Some(Ok(data)));
                    }
                    if *chunk == Chunk::Done {
                        continue;
                    }
                    let want = chunk
                        .data_left()
                        .map_or(READ_FIRST, |left| usize::try_from(left).unwrap_or(usize::MAX));
                    if ready!(kept.poll_fill(cx, want.min(kept.read_size.max(READ_FIRST))))? == 0 {
                        return Poll::Ready(Some(Err(closed(
                            "the connection closed before the answer's last chunk",
                        ))));
                    }
                }
            }
        }
    }
}

/// Reads what it can of a chunked body from `read`: a chunk's data when some is at hand, `None` when more bytes are
/// needed (or the body has ended: `chunk` is then `Done`). `framing` counts the framing bytes since the last data.
fn next_chunk(chunk: &mut Chunk, framing: &mut usize, read: &mut BytesMut) -> io::Result<Option<Bytes>> {
    loop {
        if let Some(left) = chunk.data_left() {
            if read.is_empty() {
                return Ok(None);
            }
            let taken = read.len().min(usize::try_from(left).unwrap_or(usize::MAX));
            chunk.took(taken as u64);
            *framing = 0;
            return Ok(Some(read.split_to(taken).freeze()));
        }
        if *chunk == Chunk::Done || read.is_empty() {
            return Ok(None);
        }
        let mut bytes = &read[..];
        chunk
            .frame(&mut bytes)
            .map_err(|Malformed| broken("an answer with malformed chunked framing"))?;
        let used = read.len() - bytes.len();
        read.advance(used);
        *framing += used;
        if *framing > MOST_CHUNK_FRAMING {
            return Err(broken(format!(
                "an answer with over {MOST_CHUNK_FRAMING} bytes of chunk extensions or trailers"
            )));
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
