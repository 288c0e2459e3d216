//! The metrics listener: `GET /metrics` in Prometheus' text format, and the fleet status page (`GET /status`,
//! `GET /status.json`).

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

/// Serves `GET /metrics` (and `/`), and the fleet status page (`GET /status`, `GET /status.json`), on `listener`
/// until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    gateway: Arc<crate::process::live::Gateway>,
    shutdown: impl Future<Output = ()>,
) {
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => return,
        };
        let Ok((stream, _)) = accepted else { continue };
        let _ = stream.set_nodelay(true);
        let gateway = gateway.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request: Request<hyper::body::Incoming>| {
                let gateway = gateway.clone();
                async move { Ok::<_, Infallible>(answer(&gateway, &request).await) }
            });
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn answer<B>(gateway: &crate::process::live::Gateway, request: &Request<B>) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match (request.method(), request.uri().path()) {
        (&Method::GET, "/metrics" | "/") => (
            StatusCode::OK,
            "text/plain; version=0.0.4; charset=utf-8",
            Bytes::from(gateway.metrics().render()),
        ),
        (&Method::GET, "/status") => (
            StatusCode::OK,
            "text/html; charset=utf-8",
            Bytes::from_static(crate::process::status::PAGE.as_bytes()),
        ),
        (&Method::GET, "/status.json") => (
            StatusCode::OK,
            "application/json",
            Bytes::from(crate::process::status::json(gateway).await),
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
