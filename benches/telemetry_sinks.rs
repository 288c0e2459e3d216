//! The receivers the load harness's telemetry scenario (`scripts/bench_telemetry.py`) sends to: an OTLP/gRPC trace
//! collector (the collector's own service from opentelemetry-proto, which decodes every span) and a CloudEvents sink
//! that reads each event whole and answers 200, as KServe's message dumper does. Every second both counts go to
//! stderr.
//! `telemetry_sinks --otlp ADDR --events ADDR`; without arguments (as `cargo test` runs it) it does nothing.

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
    let (Some(otlp), Some(events)) = (argument("--otlp"), argument("--events")) else {
        return Ok(());
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let spans = Collector::default();
        let received_events = Arc::new(AtomicU64::new(0));
        let otlp = tokio::net::TcpListener::bind(&otlp).await?;
        let events = tokio::net::TcpListener::bind(&events).await?;
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
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            eprintln!(
                "spans={} events={}",
                spans.0.load(Ordering::Relaxed),
                received_events.load(Ordering::Relaxed)
            );
        }
    })
}
