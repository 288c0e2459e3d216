//! The receivers the load harness's telemetry scenario (`scripts/bench_telemetry.py`) sends to: an OTLP/gRPC trace
//! collector (the collector's own service from opentelemetry-proto, which decodes every span) and a CloudEvents sink
//! that reads each event whole and answers 200, as KServe's message dumper does. Every second both counts go to
//! stderr.
//! `telemetry_sinks --otlp ADDR --events ADDR`; without arguments (as `cargo test` runs it) it starts both briefly,
//! sends each spans and an event, and checks they are counted.

#[path = "support/arguments.rs"]
mod arguments;
use arguments::argument;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};

type Failure = Box<dyn std::error::Error + Send + Sync>;

#[derive(Clone, Default)]
struct Collector(Arc<AtomicU64>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans: usize = request
            .into_inner()
            .resource_spans
            .iter()
            .flat_map(|resource| &resource.scope_spans)
            .map(|scope| scope.spans.len())
            .sum();
        self.0.fetch_add(spans as u64, Ordering::Relaxed);
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn main() -> Result<(), Failure> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let (Some(otlp), Some(events)) = (argument("--otlp"), argument("--events")) else {
        return runtime.block_on(checked());
    };
    runtime.block_on(async move {
        let otlp = tokio::net::TcpListener::bind(otlp).await?;
        let events = tokio::net::TcpListener::bind(events).await?;
        let (spans, received_events) = sinks(otlp, events)?;
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            eprintln!(
                "spans={} events={}",
                spans.load(Ordering::Relaxed),
                received_events.load(Ordering::Relaxed)
            );
        }
    })
}

/// Both sinks, briefly: three spans exported to the collector and one event posted to the sink, each counted.
async fn checked() -> Result<(), Failure> {
    use opentelemetry_proto::tonic::collector::trace::v1::trace_service_client::TraceServiceClient;
    use opentelemetry_proto::tonic::trace::v1::{ResourceSpans, ScopeSpans, Span};
    // Bound here and kept: a port found free and then bound again could be taken in between.
    let otlp_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let events_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let (otlp, events) = (otlp_listener.local_addr()?, events_listener.local_addr()?);
    let (spans, received_events) = sinks(otlp_listener, events_listener)?;
    let mut client = TraceServiceClient::connect(format!("http://{otlp}")).await?;
    client
        .export(ExportTraceServiceRequest {
            resource_spans: vec![ResourceSpans {
                scope_spans: vec![ScopeSpans {
                    spans: vec![Span::default(); 3],
                    ..Default::default()
                }],
                ..Default::default()
            }],
        })
        .await?;
    let mut stream = tokio::net::TcpStream::connect(events).await?;
    tokio::io::AsyncWriteExt::write_all(
        &mut stream,
        b"POST / HTTP/1.1\r\nhost: sink\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
    )
    .await?;
    let mut answer = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut stream, &mut answer).await?;
    if !answer.starts_with(b"HTTP/1.1 200") {
        return Err(format!("the sink answered {}", String::from_utf8_lossy(&answer)).into());
    }
    let (spans, received) = (spans.load(Ordering::Relaxed), received_events.load(Ordering::Relaxed));
    if (spans, received) != (3, 1) {
        return Err(format!("counted {spans} spans and {received} events, not 3 and 1").into());
    }
    Ok(())
}

/// The collector on `otlp` and the sink on `events`, serving on this runtime; their counts of spans and events.
fn sinks(
    otlp: tokio::net::TcpListener,
    events: tokio::net::TcpListener,
) -> Result<(Arc<AtomicU64>, Arc<AtomicU64>), Failure> {
    let spans = Collector::default();
    let received_events = Arc::new(AtomicU64::new(0));
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(spans.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(otlp)),
    );
    let counted = received_events.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = events.accept().await else { return };
            let counted = counted.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                    let counted = counted.clone();
                    async move {
                        let _ = request.into_body().collect().await;
                        counted.fetch_add(1, Ordering::Relaxed);
                        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::new())))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
                    .await;
            });
        }
    });
    Ok((spans.0, received_events))
}
