//! The built-in Open Inference Protocol model server (`oipgate model-server`): REST and gRPC in front of a few
//! small models, for the demo, the tests and the benchmarks.

pub mod grpc;
pub mod models;
pub mod repository;
pub mod rest;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::codec::CompressionEncoding;

use crate::error::{Error, Result};
use crate::proto::grpc_inference_service_server::GrpcInferenceServiceServer;
use crate::protocol::ServerMetadata;
use repository::Repository;

/// Extensions the model server implements, as server metadata reports them.
pub const EXTENSIONS: [&str; 3] = ["binary_tensor_data", "model_repository", "statistics"];

/// How long in-flight requests get to finish after shutdown is asked for.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Request headers (gRPC metadata) starting with this are sent back in the answer, so a caller can see what reached
/// the backend through a proxy.
pub const ECHO_PREFIX: &str = "x-echo-";
/// Answer header listing the names of every header the request arrived with, when it carried an `x-echo-*` one.
pub const RECEIVED_HEADERS: &str = "x-echo-received";

/// Answer header naming the server that answered, when the request carried an `x-echo-*` header.
pub const ANSWERED_BY: &str = "x-echo-server";

/// What an answer echoes of its request's headers: `x-request-id`, every `x-echo-*`, and when there was one of those,
/// the names of all headers received in `x-echo-received` and the server's name in `x-echo-server`.
#[derive(Debug)]
enum Echo {
    Nothing,
    /// One request id and no `x-echo-*`, as a gateway sends every request: set on the answer as it is, without a map
    /// made and merged for it.
    RequestId(http::HeaderValue),
    Headers(http::HeaderMap),
}

impl Echo {
    /// What an answer to a request with `request` headers echoes, from the server named `server`.
    fn of(request: &http::HeaderMap, server: &str) -> Echo {
        let mut ids = request.get_all(crate::headers::REQUEST_ID).iter();
        let echoes = request.keys().any(|name| name.as_str().starts_with(ECHO_PREFIX));
        match (ids.next(), ids.next(), echoes) {
            (None, _, false) => Echo::Nothing,
            (Some(id), None, false) => Echo::RequestId(id.clone()),
            _ => Echo::Headers(echoed_headers(request, server)),
        }
    }

    /// Sets the echoed headers on an answer's, in place of any of the same names.
    fn onto(self, answer: &mut http::HeaderMap) {
        match self {
            Echo::Nothing => {}
            Echo::RequestId(id) => {
                answer.insert(crate::headers::REQUEST_ID, id);
            }
            Echo::Headers(echoed) => answer.extend(echoed),
        }
    }
}

fn echoed_headers(request: &http::HeaderMap, server: &str) -> http::HeaderMap {
    let mut echoed = http::HeaderMap::new();
    for (name, value) in request {
        if name.as_str().starts_with(ECHO_PREFIX) || name == crate::headers::REQUEST_ID {
            echoed.append(name, value.clone());
        }
    }
    if echoed.keys().any(|name| name.as_str().starts_with(ECHO_PREFIX)) {
        let mut names: Vec<&str> = request.keys().map(http::HeaderName::as_str).collect();
        names.sort_unstable();
        if let Ok(value) = http::HeaderValue::from_str(&names.join(",")) {
            echoed.insert(RECEIVED_HEADERS, value);
        }
        if let Ok(value) = http::HeaderValue::from_str(server) {
            echoed.insert(ANSWERED_BY, value);
        }
    }
    echoed
}

/// What to serve and where.
#[derive(Debug, Clone)]
pub struct ModelServerConfig {
    /// REST (HTTP/1.1 and h2c) address; `None` serves no REST.
    pub rest: Option<SocketAddr>,
    /// gRPC address; `None` serves no gRPC.
    pub grpc: Option<SocketAddr>,
    /// Model selection such as `add_sub:1,2 identity`; `None` serves every model.
    pub models: Option<String>,
    /// Reported in server metadata.
    pub name: String,
    /// Largest REST body or gRPC message accepted, in bytes.
    pub max_request_bytes: usize,
    /// The `slow` model's delay when a request sets no `delay_ms` parameter.
    pub slow_delay: Duration,
}

impl Default for ModelServerConfig {
    fn default() -> Self {
        ModelServerConfig {
            rest: None,
            grpc: None,
            models: None,
            name: "oipgate-model-server".to_owned(),
            max_request_bytes: 1 << 30,
            slow_delay: Duration::ZERO,
        }
    }
}

/// State shared by both protocols.
#[derive(Debug)]
pub struct ModelServerState {
    pub repository: Repository,
    pub metadata: ServerMetadata,
    pub max_request_bytes: usize,
    /// The W3C `traceparent` of the latest traced requests, oldest first, as a traced backend would join them.
    traceparents: std::sync::Mutex<std::collections::VecDeque<String>>,
}

/// Traced requests whose `traceparent` is kept.
const KEPT_TRACEPARENTS: usize = 1024;

impl ModelServerState {
    /// Keeps the request's `traceparent`, if it carries one.
    fn saw(&self, headers: &http::HeaderMap) {
        let Some(parent) = headers.get("traceparent").and_then(|v| v.to_str().ok()) else {
            return;
        };
        if let Ok(mut kept) = self.traceparents.lock() {
            if kept.len() == KEPT_TRACEPARENTS {
                kept.pop_front();
            }
            kept.push_back(parent.to_owned());
        }
    }

    /// The `traceparent` of the latest traced requests, oldest first.
    pub fn traceparents(&self) -> Vec<String> {
        self.traceparents
            .lock()
            .map(|kept| kept.iter().cloned().collect())
            .unwrap_or_default()
    }
}

/// A running model server: its bound addresses and the handle that stops it.
#[derive(Debug)]
pub struct RunningModelServer {
    pub rest_addr: Option<SocketAddr>,
    pub grpc_addr: Option<SocketAddr>,
    pub state: Arc<ModelServerState>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl RunningModelServer {
    /// The line printed at start, which tests and scripts read: `rest=ADDR grpc=ADDR` for what is served.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(addr) = self.rest_addr {
            parts.push(format!("rest={addr}"));
        }
        if let Some(addr) = self.grpc_addr {
            parts.push(format!("grpc={addr}"));
        }
        parts.join(" ")
    }

    /// Stops accepting, lets in-flight requests finish (up to a bound), and returns when both servers are done.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// Binds the listeners and starts serving; returns once both are accepting.
pub async fn start(config: ModelServerConfig) -> Result<RunningModelServer> {
    if config.rest.is_none() && config.grpc.is_none() {
        return Err(Error::invalid(
            "the model server needs a REST address, a gRPC address, or both",
        ));
    }
    let state = Arc::new(ModelServerState {
        repository: Repository::new(config.models.as_deref())?.with_slow_delay(config.slow_delay),
        metadata: ServerMetadata {
            name: config.name.clone(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            extensions: EXTENSIONS.iter().map(|e| (*e).to_owned()).collect(),
        },
        max_request_bytes: config.max_request_bytes,
        traceparents: std::sync::Mutex::default(),
    });
    let (shutdown, _) = watch::channel(false);
    let mut tasks = Vec::new();
    let mut rest_addr = None;
    let mut grpc_addr = None;
    if let Some(addr) = config.rest {
        let listener = bind(addr).await?;
        rest_addr = Some(listener.local_addr().map_err(|e| Error::internal(e.to_string()))?);
        tasks.push(tokio::spawn(serve_rest(listener, state.clone(), shutdown.subscribe())));
    }
    if let Some(addr) = config.grpc {
        let listener = bind(addr).await?;
        grpc_addr = Some(listener.local_addr().map_err(|e| Error::internal(e.to_string()))?);
        let service = GrpcInferenceServiceServer::new(grpc::GrpcModelServer { state: state.clone() })
            .accept_compressed(CompressionEncoding::Gzip)
            .accept_compressed(CompressionEncoding::Deflate)
            .send_compressed(CompressionEncoding::Gzip)
            .send_compressed(CompressionEncoding::Deflate)
            .max_decoding_message_size(config.max_request_bytes)
            .max_encoding_message_size(usize::MAX);
        let stop = stopped(shutdown.subscribe());
        // The builder's `tcp_nodelay` applies only to listeners tonic binds itself; without it, a small answer
        // after a large one waited for the peer's delayed acknowledgement (about 40 ms).
        let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        tasks.push(tokio::spawn(async move {
            // HTTP/2's default 64 KiB window made a large tensor wait on a window update every 64 KiB, so its
            // latency swung with scheduling; the gateway's own doors use the same windows.
            let served = tonic::transport::Server::builder()
                .initial_stream_window_size(8 << 20)
                .initial_connection_window_size(32 << 20)
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, stop)
                .await;
            if let Err(error) = served {
                eprintln!("model server: gRPC server stopped: {error}");
            }
        }));
    }
    Ok(RunningModelServer {
        rest_addr,
        grpc_addr,
        state,
        shutdown,
        tasks,
    })
}

async fn bind(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| Error::internal(format!("cannot listen on {addr}: {e}")))
}

/// Resolves when shutdown is asked for (or its sender is gone).
async fn stopped(mut signal: watch::Receiver<bool>) {
    let _ = signal.wait_for(|stop| *stop).await;
}

async fn serve_rest(listener: TcpListener, state: Arc<ModelServerState>, signal: watch::Receiver<bool>) {
    let builder = auto::Builder::new(TokioExecutor::new());
    let graceful = GracefulShutdown::new();
    let stop = stopped(signal);
    tokio::pin!(stop);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(error) => {
                        // Out of descriptors and the like: pause rather than spin.
                        eprintln!("model server: accept failed: {error}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let state = state.clone();
                let service = service_fn(move |request| rest::handle(state.clone(), request));
                let connection = builder.serve_connection(TokioIo::new(stream), service).into_owned();
                let connection = graceful.watch(connection);
                tokio::spawn(async move {
                    let _ = connection.await;
                });
            }
            () = &mut stop => break,
        }
    }
    drop(listener);
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, graceful.shutdown()).await;
}
