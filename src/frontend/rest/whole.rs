//! The REST door's passthrough of a request whose whole body is at hand: sent with its head in one write over the
//! thread's own pooled connection, its answer streamed back (renamed for aliased models).

use std::time::Instant;

use bytes::Bytes;
use http::HeaderValue;
use pingora::http::ResponseHeader;
use pingora::proxy::Session;

use super::answer::{Rename, client_gone, pingora_failure};
use super::{RestContext, RestFrontDoor};
use crate::codec::rest::INFERENCE_HEADER_CONTENT_LENGTH;
use crate::dispatch::Passthrough;
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::frontend::REQUEST_ID;
use crate::headers;

/// A proxied request whose declared body is at most this long is read whole and sent with its head in one write
/// over the thread's own pooled connection; a longer one (or one of unknown length) streams through pingora's proxy.
pub(super) const WHOLE_BODY_LIMIT: u64 = 256 * 1024;
/// Headers about the body that a proxied request carries as the client sent them (the body is not re-encoded).
pub(super) const AS_SENT: [http::header::HeaderName; 5] = [
    http::header::CONTENT_TYPE,
    http::header::CONTENT_ENCODING,
    http::header::ACCEPT,
    http::header::ACCEPT_ENCODING,
    http::header::HeaderName::from_static(INFERENCE_HEADER_CONTENT_LENGTH),
];
/// Headers about the body that a proxied answer carries as the backend sent them.
const ANSWER_AS_SENT: [http::header::HeaderName; 4] = [
    http::header::CONTENT_TYPE,
    http::header::CONTENT_ENCODING,
    http::header::CONTENT_LENGTH,
    http::header::HeaderName::from_static(INFERENCE_HEADER_CONTENT_LENGTH),
];
impl RestFrontDoor {
    /// Proxies a request whose whole body is at hand: sends it to the backend and streams the answer back as it
    /// comes, renaming the model when the route aliases it.
    pub(super) async fn forward_whole(
        &self,
        session: &mut Session,
        context: &mut RestContext,
        target: Passthrough,
        headers: &http::HeaderMap,
        body: Bytes,
    ) -> Result<()> {
        let until = Instant::now() + target.timeout;
        let send = context.dispatcher.passthrough_send(&target, headers, &body, until);
        let (response, lease) = tokio::select! {
            sent = send => sent?,
            () = client_gone(session) => {
                return Err(Error::new(
                    ErrorKind::Cancelled,
                    Origin::Client,
                    "the client closed the connection before the answer",
                ));
            }
        };
        context.endpoint = Some(lease.state.authority.as_str().into());
        context.lease = Some(lease);
        let (parts, mut answer) = response.into_parts();
        let mut head = ResponseHeader::build(parts.status, Some(parts.headers.len() + 2)).map_err(pingora_failure)?;
        for (name, value) in &headers::end_to_end(&parts.headers) {
            head.append_header(name, value).map_err(pingora_failure)?;
        }
        for name in ANSWER_AS_SENT {
            if let Some(value) = parts.headers.get(&name) {
                head.insert_header(name, value).map_err(pingora_failure)?;
            }
        }
        if let Some(id) = &context.request_id {
            head.insert_header(REQUEST_ID, id.clone()).map_err(pingora_failure)?;
        }
        head.insert_header(headers::OIP_MODEL_VERSION, target.version.as_str())
            .map_err(pingora_failure)?;
        let mut rename = match target.rename {
            Some((name, version)) => Rename::prepare(&mut head, name, version).map_err(pingora_failure)?,
            None => None,
        };
        let no_body = parts
            .headers
            .get(http::header::CONTENT_LENGTH)
            .is_some_and(|v| v.as_bytes() == b"0");
        session
            .write_response_header(Box::new(head), no_body && rename.is_none())
            .await
            .map_err(pingora_failure)?;
        if no_body && rename.is_none() {
            return Ok(());
        }
        let authority = context.endpoint.clone().unwrap_or_default();
        loop {
            let frame = match tokio::time::timeout_at(until.into(), http_body_util::BodyExt::frame(&mut answer)).await {
                Ok(Some(Ok(frame))) => frame,
                Ok(None) => break,
                Ok(Some(Err(error))) => {
                    return Err(broken_answer(format!(
                        "backend {authority} broke off its answer: {error}"
                    )));
                }
                Err(_) => {
                    return Err(broken_answer(format!(
                        "backend {authority} did not finish its answer in time"
                    )));
                }
            };
            let Ok(chunk) = frame.into_data() else { continue };
            let chunk = match &mut rename {
                Some(rename) => rename
                    .take(Some(chunk), false)
                    .map_err(|e| broken_answer(e.message().to_owned()))?,
                None => Some(chunk),
            };
            if let Some(chunk) = chunk {
                session
                    .write_response_body(Some(chunk), false)
                    .await
                    .map_err(pingora_failure)?;
            }
        }
        let last = match &mut rename {
            Some(rename) => rename
                .take(None, true)
                .map_err(|e| broken_answer(e.message().to_owned()))?,
            None => None,
        };
        session.write_response_body(last, true).await.map_err(pingora_failure)
    }
}

/// A proxied answer that failed after its head was sent.
fn broken_answer(message: String) -> Error {
    Error::new(ErrorKind::BadGateway, Origin::Upstream, message)
}

/// The Content-Type a proxied request goes to its backend with when the client sent none. tritonclient sends none;
/// KServe's server reads a body without one as binary and refuses it. The body's form is known from the binary
/// extension's header, so the type is said for it.
pub(super) fn missing_content_type(headers: &http::HeaderMap) -> Option<HeaderValue> {
    if headers.contains_key(http::header::CONTENT_TYPE) {
        return None;
    }
    Some(HeaderValue::from_static(
        if headers.contains_key(INFERENCE_HEADER_CONTENT_LENGTH) {
            "application/octet-stream"
        } else {
            "application/json"
        },
    ))
}
