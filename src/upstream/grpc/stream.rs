//! Bidirectional gRPC streams to a backend, on the thread's HTTP/2 connection for streams (made with h2 itself:
//! hyper does not expose h2's budget for small DATA frames, and its default closes a connection whose stalled reader
//! holds many tiny messages).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue};
use http_body::{Body, Frame};

use super::{GrpcUpstream, frame};
use crate::codec::compression::Coding;
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::headers;
use crate::headers::GRPC_ENCODING;
use crate::upstream::Channel;

/// A stream opened to a backend: its messages go in through `requests`, the backend's come out of `answers`.
/// Dropping `requests` tells the backend the client has sent everything; dropping both resets its stream.
#[derive(Debug)]
pub struct UpstreamStream {
    pub requests: StreamRequests,
    pub answers: tonic::codec::Streaming<Bytes>,
    /// The backend's end-to-end metadata from its response headers.
    pub headers: HeaderMap,
}

/// Where a backend stream's messages are sent. A send waits for the backend's flow-control window, so a backend
/// that stops reading stalls the sender.
#[derive(Debug)]
pub struct StreamRequests {
    sending: h2::SendStream<Bytes>,
    coding: Option<Coding>,
}

impl StreamRequests {
    /// Sends one message; fails when the backend's stream is gone.
    pub async fn send(&mut self, message: Vec<Bytes>) -> Result<()> {
        for chunk in frame(message, self.coding)?
            .into_iter()
            .filter(|chunk| !chunk.is_empty())
        {
            // As hyper does: wait for some window, then hand h2 the whole chunk (already in memory, never copied),
            // which it sends as the window allows; the next chunk waits until this one is on its way.
            self.sending.reserve_capacity(chunk.len());
            match std::future::poll_fn(|cx| self.sending.poll_capacity(cx)).await {
                Some(Ok(_)) => self.sending.send_data(chunk, false).map_err(|_| ended())?,
                _ => return Err(ended()),
            }
        }
        Ok(())
    }

    /// Hands one message to h2 without waiting for the backend's window (see [`GrpcUpstream::open_stream`]).
    fn send_at_once(&mut self, message: Vec<Bytes>) -> Result<()> {
        super::hand_over(&mut self.sending, frame(message, self.coding)?, false).map_err(|_| ended())
    }
}

impl Drop for StreamRequests {
    fn drop(&mut self) {
        // The client has sent everything: half-close. A stream already reset refuses this, which is fine.
        let _ = self.sending.send_data(Bytes::new(), true);
    }
}

fn ended() -> Error {
    Error::new(
        ErrorKind::BadGateway,
        Origin::Upstream,
        "the backend's stream has ended",
    )
}

impl GrpcUpstream {
    /// Opens a bidirectional stream on `method` with `first` as its first message (sent before the answer's
    /// headers are awaited: a server may hold its headers until it has a message to answer). `deadline`, when
    /// given, is passed on as `grpc-timeout`; `coding` compresses the messages sent and asks for compressed ones.
    pub async fn open_stream(
        &self,
        method: &'static str,
        first: Vec<Bytes>,
        deadline: Option<Duration>,
        metadata: &HeaderMap,
        coding: Option<Coding>,
    ) -> Result<UpstreamStream> {
        let request = self.request(method, (), deadline, metadata, coding)?;
        let (mut connection, _) = self.connection(Channel::Streams).await?;
        let (response, sending) = connection
            .send_request(request, false)
            .map_err(|e| self.connection_failure(e, true))?;
        let mut requests = StreamRequests { sending, coding };
        // The first message goes to h2 whole, before the stream's head has left, so the two leave in one write: h2
        // holds it until the stream opens, then sends it as the window allows (it is in memory already, within the
        // size limit). It is also what a server may wait for before sending its own head.
        requests.send_at_once(first)?;
        // h2 assigns no window to a stream still waiting to be opened (under the backend's limit on concurrent
        // streams), nor later to what was reserved meanwhile: later messages wait until the stream is open. The
        // first may have left by now, so a failure here is not one to send again.
        connection
            .ready()
            .await
            .map_err(|e| self.connection_failure(e, false))?;
        let response = response.await.map_err(|e| self.connection_failure(e, false))?;
        self.check_status(&response)?;
        let (parts, body) = response.into_parts();
        let encoding = match parts.headers.get(GRPC_ENCODING).map(HeaderValue::as_bytes) {
            Some(b"gzip") => Some(tonic::codec::CompressionEncoding::Gzip),
            Some(b"deflate") => Some(tonic::codec::CompressionEncoding::Deflate),
            _ => None,
        };
        Ok(UpstreamStream {
            requests,
            answers: tonic::codec::Streaming::new_response(
                crate::codec::protobuf::RawDecoder,
                ReceivedBody::new(body),
                http::StatusCode::OK,
                encoding,
                Some(self.max_response_bytes),
            ),
            headers: headers::end_to_end(&parts.headers),
        })
    }
}

/// A backend stream's (or unary call's) answer as a body: its data as it arrives, its window given back as each
/// piece is taken (so what is unread is bounded by the window), then its trailers.
pub(super) struct ReceivedBody {
    receiving: h2::RecvStream,
    data_ended: bool,
}

impl ReceivedBody {
    pub(super) fn new(receiving: h2::RecvStream) -> Self {
        ReceivedBody {
            receiving,
            data_ended: false,
        }
    }
}

impl Body for ReceivedBody {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<std::result::Result<Frame<Bytes>, h2::Error>>> {
        let this = &mut *self;
        if !this.data_ended {
            match this.receiving.poll_data(cx) {
                Poll::Ready(Some(Ok(data))) => {
                    let _ = this.receiving.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Poll::Ready(Some(Err(error))) => return Poll::Ready(Some(Err(error))),
                Poll::Ready(None) => this.data_ended = true,
                Poll::Pending => return Poll::Pending,
            }
        }
        this.receiving.poll_trailers(cx).map(|trailers| match trailers {
            Ok(Some(trailers)) => Some(Ok(Frame::trailers(trailers))),
            Ok(None) => None,
            Err(error) => Some(Err(error)),
        })
    }

    fn is_end_stream(&self) -> bool {
        self.receiving.is_end_stream()
    }
}
