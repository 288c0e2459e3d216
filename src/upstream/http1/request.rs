//! A request's writing on a backend connection: its head in the connection's own buffer, its body's buffers as they
//! are (one vectored write for both when the body is at hand), chunk-framed when its length is not known.

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes};
use http::header::{CONNECTION, CONTENT_LENGTH, HOST, TRANSFER_ENCODING, USER_AGENT};
use http::{HeaderValue, Method};
use hyper::body::Body;

use super::{Io, PooledConnection, Request};
use crate::body::OutBody;
use crate::codec::http1::GATHERED_BODY;

/// The most buffers one vectored write hands the kernel.
const MOST_SLICES: usize = 16;

impl PooledConnection {
    /// Writes the head of a request: its line, `host`, the headers of each map (a framing header among them left out:
    /// this hop sets its own), the gateway's name where the request names nobody, and the body's framing; then a
    /// small body at hand, so the two leave in one buffer. Gives how many of the body's chunks went with the head.
    pub(super) fn write_head(&mut self, request: &Request<'_>, framing: Sending) -> usize {
        let head = &mut self.head;
        head.clear();
        head.extend_from_slice(request.method.as_str().as_bytes());
        head.push(b' ');
        head.extend_from_slice(request.path.as_str().as_bytes());
        head.extend_from_slice(b" HTTP/1.1\r\nhost: ");
        head.extend_from_slice(request.host.as_bytes());
        head.extend_from_slice(b"\r\n");
        // The operator's headers (the last map) take the place of a client's of the same name: a backend reading the
        // first of two would otherwise read the client's. A passthrough's headers give way to both maps' (the try's
        // trace context in the first).
        let [client, added] = request.headers;
        let mut write = |name: &http::HeaderName, value: &HeaderValue| {
            head.extend_from_slice(name.as_str().as_bytes());
            head.extend_from_slice(b": ");
            head.extend_from_slice(value.as_bytes());
            head.extend_from_slice(b"\r\n");
        };
        if let Some(passed) = request.passed {
            passed.each(
                |name| {
                    (!client.is_empty() && client.contains_key(name)) || (!added.is_empty() && added.contains_key(name))
                },
                &mut write,
            );
        }
        for (index, headers) in [client, added].into_iter().enumerate() {
            for (name, value) in headers {
                if [&HOST, &CONTENT_LENGTH, &TRANSFER_ENCODING, &CONNECTION].contains(&name)
                    || (index == 0 && !added.is_empty() && added.contains_key(name))
                {
                    continue;
                }
                write(name, value);
            }
        }
        // A passthrough carries the client's `user-agent`, or none, as a proxy does; a request the gateway writes
        // (a translation, a health check, a metadata call) names the gateway where nobody else is named.
        if request.passed.is_none()
            && ![client, added]
                .iter()
                .any(|map| !map.is_empty() && map.contains_key(USER_AGENT))
        {
            head.extend_from_slice(b"user-agent: ");
            head.extend_from_slice(crate::headers::GATEWAY_AGENT.as_bytes());
            head.extend_from_slice(b"\r\n");
        }
        match framing {
            Sending::Length(length) => {
                head.extend_from_slice(b"content-length: ");
                head.extend_from_slice(itoa::Buffer::new().format(length).as_bytes());
                head.extend_from_slice(b"\r\n");
            }
            Sending::Chunked => head.extend_from_slice(b"transfer-encoding: chunked\r\n"),
            Sending::Nothing => {}
        }
        head.extend_from_slice(b"\r\n");
        match (&request.body, framing) {
            (OutBody::Chunks(body), Sending::Length(length)) if length <= GATHERED_BODY as u64 => {
                let chunks = body.chunks();
                for chunk in chunks {
                    head.extend_from_slice(chunk);
                }
                chunks.len()
            }
            _ => 0,
        }
    }
}

/// How a request's body is framed.
#[derive(Debug, Clone, Copy)]
pub(super) enum Sending {
    Length(u64),
    Chunked,
    /// No body, and a method that takes none.
    Nothing,
}

impl Sending {
    pub(super) fn of(method: &Method, body: &OutBody) -> Sending {
        match body.size_hint().exact() {
            Some(0) if matches!(*method, Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS) => {
                Sending::Nothing
            }
            Some(length) => Sending::Length(length),
            None => Sending::Chunked,
        }
    }
}

/// Where the writing of a request stands.
pub(super) struct Writing {
    pub(super) framing: Sending,
    /// Bytes of the head written.
    pub(super) head_at: usize,
    /// A body at hand: its next chunk to write, and how much of that is written.
    pub(super) chunk: usize,
    pub(super) chunk_at: usize,
    /// A streamed body: what is to be written of its current piece (a chunk with its framing when chunked).
    pub(super) piece: Vec<Bytes>,
    /// A streamed body has ended (its last chunk, when chunked, is in `piece`).
    pub(super) streamed_all: bool,
    /// Body bytes taken from a streamed body.
    pub(super) taken: u64,
    /// The whole request is written.
    pub(super) done: bool,
    /// Some of it reached the connection.
    pub(super) wrote: bool,
    /// A frame was taken from a streamed body: it cannot be sent again.
    pub(super) consumed: bool,
    /// The body itself failed (the client's went away or stalled): the request is abandoned.
    pub(super) body_failed: bool,
    /// Some of the answer has arrived.
    pub(super) answer_begun: bool,
    /// Writing failed; reported unless an answer arrives all the same.
    pub(super) failed: Option<io::Error>,
}

impl Writing {
    /// `gathered`: how many of the body's chunks went with the head.
    pub(super) fn new(framing: Sending, gathered: usize) -> Writing {
        Writing {
            framing,
            head_at: 0,
            chunk: gathered,
            chunk_at: 0,
            piece: Vec::new(),
            streamed_all: false,
            taken: 0,
            done: false,
            wrote: false,
            consumed: false,
            body_failed: false,
            answer_begun: false,
            failed: None,
        }
    }

    /// Writes what it can of the head and the body; ready once all is written and flushed.
    pub(super) fn poll_write(
        &mut self,
        cx: &mut Context<'_>,
        io: &mut Io,
        head: &[u8],
        body: &mut OutBody,
    ) -> Poll<io::Result<()>> {
        loop {
            let streamed = !matches!(body, OutBody::Chunks(_));
            let mut waiting = false;
            if streamed && self.piece.is_empty() && !self.streamed_all {
                match self.poll_piece(cx, body) {
                    Poll::Ready(Ok(())) => {}
                    Poll::Ready(Err(error)) => {
                        self.body_failed = true;
                        return Poll::Ready(Err(error));
                    }
                    Poll::Pending => waiting = true,
                }
            }
            let mut slices = [IoSlice::new(&[]); MOST_SLICES];
            let mut count = 0;
            if self.head_at < head.len() {
                slices[0] = IoSlice::new(&head[self.head_at..]);
                count = 1;
            }
            match body {
                OutBody::Chunks(chunks) => {
                    for (index, chunk) in chunks
                        .chunks()
                        .iter()
                        .enumerate()
                        .skip(self.chunk)
                        .take(MOST_SLICES - count)
                    {
                        let from = if index == self.chunk { self.chunk_at } else { 0 };
                        slices[count] = IoSlice::new(&chunk[from..]);
                        count += 1;
                    }
                }
                _ => {
                    for part in self.piece.iter().take(MOST_SLICES - count) {
                        slices[count] = IoSlice::new(part);
                        count += 1;
                    }
                }
            }
            if count == 0 {
                // What is written goes out (TLS holds it otherwise) before waiting on the body for more.
                ready!(io.poll_flush(cx))?;
                return if waiting { Poll::Pending } else { Poll::Ready(Ok(())) };
            }
            let written = ready!(io.poll_write_vectored(cx, &slices[..count]))?;
            if written == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.wrote = true;
            self.advance(written, head.len(), body);
        }
    }

    /// Takes the streamed body's next frame as the piece to write, framed as the request says.
    fn poll_piece(&mut self, cx: &mut Context<'_>, body: &mut OutBody) -> Poll<io::Result<()>> {
        loop {
            let frame = ready!(Pin::new(&mut *body).poll_frame(cx));
            self.consumed = true;
            let data = match frame {
                None => {
                    self.streamed_all = true;
                    return Poll::Ready(match self.framing {
                        Sending::Chunked => {
                            self.piece.push(Bytes::from_static(b"0\r\n\r\n"));
                            Ok(())
                        }
                        Sending::Length(length) if self.taken != length => Err(io::Error::other(format!(
                            "the request body ended after {} of its {length} bytes",
                            self.taken
                        ))),
                        _ => Ok(()),
                    });
                }
                Some(Err(error)) => return Poll::Ready(Err(io::Error::other(error))),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) if !data.is_empty() => data,
                    // Trailers stay on the client's hop.
                    _ => continue,
                },
            };
            self.taken += data.len() as u64;
            match self.framing {
                Sending::Chunked => {
                    self.piece.push(Bytes::from(format!("{:x}\r\n", data.len())));
                    self.piece.push(data);
                    self.piece.push(Bytes::from_static(b"\r\n"));
                }
                Sending::Length(length) if self.taken > length => {
                    return Poll::Ready(Err(io::Error::other(format!(
                        "the request body is longer than its {length} bytes"
                    ))));
                }
                Sending::Length(_) => self.piece.push(data),
                Sending::Nothing => {
                    return Poll::Ready(Err(io::Error::other("a request body where none was declared")));
                }
            }
            return Poll::Ready(Ok(()));
        }
    }

    /// Notes `written` more bytes written, head first.
    fn advance(&mut self, mut written: usize, head: usize, body: &OutBody) {
        let of_head = written.min(head - self.head_at);
        self.head_at += of_head;
        written -= of_head;
        match body {
            OutBody::Chunks(chunks) => {
                let chunks = chunks.chunks();
                while written > 0 {
                    let left = chunks[self.chunk].len() - self.chunk_at;
                    if written < left {
                        self.chunk_at += written;
                        return;
                    }
                    written -= left;
                    self.chunk += 1;
                    self.chunk_at = 0;
                }
            }
            _ => {
                while written > 0 {
                    let part = &mut self.piece[0];
                    if written < part.len() {
                        part.advance(written);
                        return;
                    }
                    written -= part.len();
                    self.piece.remove(0);
                }
            }
        }
    }
}
