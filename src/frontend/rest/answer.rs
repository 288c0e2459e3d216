//! How the REST door answers: its own answers and errors written through pingora, the wait for a client to leave,
//! the lingering read of a refused body, and the renaming of a proxied answer's model name and version.

use bytes::{Bytes, BytesMut};
use http::{Method, StatusCode};
use pingora::http::ResponseHeader;
use pingora::proxy::Session;

use super::{LINGER, RestContext};
use crate::codec::rest::INFERENCE_HEADER_CONTENT_LENGTH;
use crate::codec::rest::{self, EncodedBody};
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::frontend::REQUEST_ID;

/// An aliased answer on its way through: its JSON header is held back until complete, then renamed.
#[derive(Debug)]
pub(super) struct Rename {
    pub(super) name: String,
    pub(super) version: String,
    /// The backend's JSON header length; `None` for a JSON-only answer of unknown length.
    pub(super) header_length: Option<usize>,
    /// The length announced downstream.
    pub(super) renamed_length: Option<usize>,
    pub(super) held: BytesMut,
    pub(super) done: bool,
}

impl Rename {
    /// Readies a proxied answer to have its model name and version restored: its lengths are fixed up in `answer`'s
    /// head. Only successful, uncompressed answers carry names to restore; for others, `None`.
    pub(super) fn prepare(
        answer: &mut ResponseHeader,
        name: String,
        version: String,
    ) -> pingora::Result<Option<Rename>> {
        if answer.status != StatusCode::OK || answer.headers.contains_key(http::header::CONTENT_ENCODING) {
            return Ok(None);
        }
        let number = |name: &str| {
            answer
                .headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<usize>().ok())
        };
        let content_length = number(http::header::CONTENT_LENGTH.as_str());
        let header_length = number(INFERENCE_HEADER_CONTENT_LENGTH).or(content_length);
        let renamed_length = header_length.map(|length| rest::rename::renamed_length(length, &name, &version));
        match (header_length, renamed_length) {
            (Some(old), Some(new)) => {
                if answer.headers.contains_key(INFERENCE_HEADER_CONTENT_LENGTH) {
                    answer.insert_header(INFERENCE_HEADER_CONTENT_LENGTH, new)?;
                }
                if let Some(total) = content_length {
                    answer.insert_header(http::header::CONTENT_LENGTH, total - old + new)?;
                }
            }
            _ => {
                answer.remove_header(&http::header::CONTENT_LENGTH);
            }
        }
        Ok(Some(Rename {
            name,
            version,
            header_length,
            renamed_length,
            held: BytesMut::new(),
            done: false,
        }))
    }

    /// Takes a body chunk; gives what can go downstream now.
    pub(super) fn take(
        &mut self,
        chunk: Option<Bytes>,
        end_of_stream: bool,
    ) -> std::result::Result<Option<Bytes>, Error> {
        if self.done {
            return Ok(chunk);
        }
        if let Some(chunk) = chunk {
            self.held.extend_from_slice(&chunk);
        }
        let complete = match self.header_length {
            Some(length) => self.held.len() >= length,
            None => end_of_stream,
        };
        if !complete {
            if end_of_stream {
                return Err(Error::new(
                    ErrorKind::BadGateway,
                    Origin::Upstream,
                    "backend's answer ended inside its JSON header",
                ));
            }
            return Ok(None);
        }
        let length = self.header_length.unwrap_or(self.held.len());
        let target = self
            .renamed_length
            .unwrap_or_else(|| rest::rename::renamed_length(length, &self.name, &self.version));
        // The JSON header is joined from the chunks it arrived in; so is whatever followed it in its last chunk
        // (one read's worth at most). Every later chunk, tensor bytes included, passes through uncopied.
        let held = self.held.split().freeze();
        let mut out = rest::rename::rename_header(&held[..length], &self.name, &self.version, target)
            .map_err(Error::into_upstream_protocol_error)?;
        out.extend_from_slice(&held[length..]);
        self.done = true;
        Ok(Some(Bytes::from(out)))
    }
}

/// Resolves when the client has closed its connection (HTTP/1.1) or stream (HTTP/2); the request body must have
/// been read.
pub(super) async fn client_gone(session: &mut Session) {
    if session.read_body_or_idle(true).await.is_err() {
        return;
    }
    // Only an error ends the wait; anything else means the client is still there.
    std::future::pending::<()>().await;
}

/// Reads and drops what is left of a refused body, for a bounded time, so a client still sending it gets to read the
/// answer instead of a reset connection (nginx's lingering close). Nothing is kept.
pub(super) async fn discard_body(session: &mut Session) {
    let drain = async { while let Ok(Some(_)) = session.read_request_body().await {} };
    let _ = tokio::time::timeout(LINGER, drain).await;
}

pub(super) fn health_status(healthy: bool) -> StatusCode {
    if healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

pub(super) fn pingora_failure(error: Box<pingora::Error>) -> Error {
    Error::internal(format!("could not write the answer: {error}"))
}

pub(super) async fn write(
    session: &mut Session,
    context: &RestContext,
    mut header: ResponseHeader,
    chunks: Vec<Bytes>,
) -> Result<()> {
    let length: usize = chunks.iter().map(Bytes::len).sum();
    for (name, value) in &context.reply_headers {
        header.append_header(name, value).map_err(pingora_failure)?;
    }
    header
        .insert_header(http::header::CONTENT_LENGTH, length)
        .map_err(pingora_failure)?;
    if let Some(id) = &context.request_id {
        header.insert_header(REQUEST_ID, id.clone()).map_err(pingora_failure)?;
    }
    session
        .write_response_header(Box::new(header), chunks.is_empty())
        .await
        .map_err(pingora_failure)?;
    let count = chunks.len();
    for (index, chunk) in chunks.into_iter().enumerate() {
        session
            .write_response_body(Some(chunk), index + 1 == count)
            .await
            .map_err(pingora_failure)?;
    }
    Ok(())
}

pub(super) async fn respond_json(
    session: &mut Session,
    context: &RestContext,
    status: StatusCode,
    body: Vec<u8>,
) -> Result<()> {
    let mut header = ResponseHeader::build(status, Some(4)).map_err(pingora_failure)?;
    header
        .insert_header(http::header::CONTENT_TYPE, "application/json")
        .map_err(pingora_failure)?;
    write(session, context, header, vec![Bytes::from(body)]).await
}

pub(super) async fn respond_encoded(session: &mut Session, context: &RestContext, body: EncodedBody) -> Result<()> {
    let mut header = ResponseHeader::build(StatusCode::OK, Some(5)).map_err(pingora_failure)?;
    header
        .insert_header(http::header::CONTENT_TYPE, body.content_type())
        .map_err(pingora_failure)?;
    if let Some(length) = body.header_length {
        header
            .insert_header(INFERENCE_HEADER_CONTENT_LENGTH, length)
            .map_err(pingora_failure)?;
    }
    write(session, context, header, body.chunks).await
}

/// The protocol's error answer: the error's status and `{"error": "<message>"}`.
pub(super) async fn respond_error(session: &mut Session, context: &RestContext, error: &Error) {
    let mut header = match ResponseHeader::build(error.http_status(), Some(5)) {
        Ok(header) => header,
        Err(_) => return,
    };
    let _ = header.insert_header(http::header::CONTENT_TYPE, "application/json");
    if error.kind() == ErrorKind::MethodNotAllowed {
        let allow = if session.req_header().method == Method::GET {
            "POST"
        } else {
            "GET"
        };
        let _ = header.insert_header(http::header::ALLOW, allow);
    }
    let _ = write(
        session,
        context,
        header,
        vec![Bytes::from(rest::encode_error(error.message()))],
    )
    .await;
}
