//! The metrics listener: `GET /metrics` in Prometheus' text format, and the fleet status page (`GET /status`,
//! `GET /status.json`).

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;

/// Serves `GET /metrics` (and `/`), and the fleet status page (`GET /status`, `GET /status.json`), at `seat` until
/// `shutdown` resolves: HTTP/1.1 (what Prometheus and browsers speak to it), each request head within
/// `header_timeout`, at most `[limits] max_connections` connections at once (the seat's cap).
pub async fn serve(
    seat: crate::frontend::DoorThread,
    gateway: Arc<crate::live::Gateway>,
    header_timeout: Duration,
    shutdown: impl Future<Output = ()>,
) {
    crate::frontend::accept_loop(seat, "metrics", shutdown, |stream, _peer, occupied| {
        let _ = stream.set_nodelay(true);
        let gateway = gateway.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request: Request<hyper::body::Incoming>| {
                let gateway = gateway.clone();
                async move { Ok::<_, Infallible>(answer(&gateway, &request).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(TokioIo::new(stream), service)
                .await;
            drop(occupied);
        });
    })
    .await;
}

async fn answer<B>(gateway: &crate::live::Gateway, request: &Request<B>) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match (request.method(), request.uri().path()) {
        (&Method::GET, "/metrics" | "/") => {
            gateway.dispatcher().guard().publish_under_way();
            (
                StatusCode::OK,
                "text/plain; version=0.0.4; charset=utf-8",
                Bytes::from(gateway.metrics().render()),
            )
        }
        (&Method::GET, "/status") => (
            StatusCode::OK,
            "text/html; charset=utf-8",
            Bytes::from_static(crate::app::status::PAGE.as_bytes()),
        ),
        (&Method::GET, "/status.json") => (
            StatusCode::OK,
            "application/json",
            Bytes::from(crate::app::status::json(gateway).await),
        ),
        (_, "/metrics" | "/" | "/status" | "/status.json") => (
            StatusCode::METHOD_NOT_ALLOWED,
            "application/json",
            Bytes::from_static(b"{\"error\":\"the metrics listener answers GET only\"}"),
        ),
        (_, path) => (
            StatusCode::NOT_FOUND,
            "application/json",
            Bytes::from(format!(
                "{{\"error\":\"no endpoint at {}; metrics are at /metrics, the fleet's status at /status\"}}",
                path.escape_default()
            )),
        ),
    };
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = status;
    if let Ok(value) = http::HeaderValue::from_str(content_type) {
        response.headers_mut().insert(http::header::CONTENT_TYPE, value);
    }
    response
}
