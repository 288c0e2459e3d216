//! The endpoint picker's door (`oipgate epp`): Envoy's external processing service, through which a Gateway API
//! gateway's Envoy asks which endpoint of an inference pool serves each request, with the gRPC health services the
//! Gateway API Inference Extension's endpoint picker protocol names, on one port.

mod answer;
mod call;
mod read;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use hyper::server::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};

pub use call::{DESTINATION, LB_NAMESPACE, SERVED, SUBSET, SUBSET_NAMESPACE};

use crate::envoy_api::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use crate::envoy_api::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use crate::live::Gateway;

/// The health services of the endpoint picker protocol: the process is up; it can pick (its endpoints are known);
/// the ext_proc service itself (as readiness).
pub const LIVENESS: &str = "liveness";
pub const READINESS: &str = "readiness";
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// How often readiness is looked at again.
const HEALTH_REFRESH: Duration = Duration::from_secs(1);

/// The door's bounds.
#[derive(Debug, Clone, Copy)]
pub struct EppLimits {
    /// The largest message the proxy may send (one body chunk and its envelope).
    pub max_message_bytes: usize,
    pub max_concurrent_streams: u32,
    /// Endpoints named after the picked one, for the proxy's retries. Envoy's `ORIGINAL_DST` cluster takes one
    /// address only: 0 there.
    pub fallbacks: usize,
}

/// The ext_proc service: each call's answers read the proxy's messages and answer them in order.
#[derive(Debug, Clone)]
struct Picker {
    gateway: Arc<Gateway>,
    fallbacks: usize,
}

type Answers = Pin<Box<dyn futures_util::Stream<Item = Result<ProcessingResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Answers>, tonic::Status> {
        let inbound = request.into_inner();
        // Counted under way, so a drain waits for it.
        let active = self.gateway.begin();
        let call = call::Call::new(self.gateway.clone(), self.fallbacks);
        // The proxy's next message is read only when the answers before it are taken: a proxy that does not read
        // its answers is not read from, so a call's body is never held whole. No task or channel between them: the
        // answer stream itself reads the call.
        let state = (inbound, call, VecDeque::new(), active);
        let answers = futures_util::stream::unfold(state, |(mut inbound, mut call, mut pending, active)| async move {
            loop {
                if let Some(answer) = pending.pop_front() {
                    return Some((Ok(answer), (inbound, call, pending, active)));
                }
                let Ok(Some(message)) = inbound.message().await else {
                    return None;
                };
                let mut answered = Vec::new();
                call.on(message, &mut answered).await;
                pending.extend(answered);
            }
        });
        Ok(tonic::Response::new(Box::pin(answers)))
    }
}

/// Serves the ext_proc and health services on `seat` until `shutdown`, then lets the calls under way finish.
pub async fn serve(
    seat: super::DoorThread,
    gateway: Arc<Gateway>,
    limits: EppLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let (reporter, health) = tonic_health::server::health_reporter();
    // Answered from the first connection: alive, and not ready until the first look finds the endpoints known.
    reporter
        .set_service_status(LIVENESS, tonic_health::ServingStatus::Serving)
        .await;
    for service in [READINESS, EXT_PROC_SERVICE, ""] {
        reporter
            .set_service_status(service, tonic_health::ServingStatus::NotServing)
            .await;
    }
    let watched = gateway.clone();
    let health_task = tokio::spawn(async move {
        loop {
            let status = if watched.server_ready().await {
                tonic_health::ServingStatus::Serving
            } else {
                tonic_health::ServingStatus::NotServing
            };
            // The protocol's rule for the ext_proc service itself is readiness's: a proxy health-checking it sends
            // no call to a picker that cannot pick yet.
            for service in [READINESS, EXT_PROC_SERVICE, ""] {
                reporter.set_service_status(service, status).await;
            }
            tokio::time::sleep(HEALTH_REFRESH).await;
        }
    });
    let picker = ExternalProcessorServer::new(Picker {
        gateway,
        fallbacks: limits.fallbacks,
    })
    .max_decoding_message_size(limits.max_message_bytes)
    .max_encoding_message_size(limits.max_message_bytes);
    let routes = tonic::service::Routes::new(picker).add_service(health).prepare();
    let mut builder = http2::Builder::new(TokioExecutor::new());
    super::http2_limits(&mut builder, limits.max_concurrent_streams);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let (open, mut all_closed) = tokio::sync::mpsc::channel::<()>(1);
    super::accept_loop(seat, "epp", shutdown, |stream, _peer, occupied| {
        let _ = stream.set_nodelay(true);
        let routes = routes.clone();
        let service = hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
            let mut routes = routes.clone();
            tower_service::Service::call(&mut routes, request).map(|answer: Result<_, Infallible>| answer)
        });
        let builder = builder.clone();
        let mut stopped = stopped.clone();
        let open = open.clone();
        tokio::spawn(async move {
            let _held = (open, occupied);
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            let stop = async move {
                let _ = stopped.wait_for(|stop| *stop).await;
            };
            tokio::select! {
                _ = connection.as_mut() => {}
                () = stop => {
                    connection.as_mut().graceful_shutdown();
                    let _ = connection.await;
                }
            }
        });
    })
    .await;
    health_task.abort();
    let _ = stop.send(true);
    drop(open);
    let _ = tokio::time::timeout(super::DRAIN_TIMEOUT, all_closed.recv()).await;
}
