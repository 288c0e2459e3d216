//! The backend side of a client's stream: a stream opened to one gRPC endpoint for a route, relayed back renamed;
//! or one request sent to a REST backend as a unary inference; each recorded in the stream metrics when it ends.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{Answers, MODEL_STREAM_INFER};
use crate::codec::{protobuf, splice};
use crate::config::StreamDialect;
use crate::dispatch::backend::{BackendClients, Replicas};
use crate::dispatch::fleet::Lease;
use crate::dispatch::{CallContext, call_infer};
use crate::error::{Error, Result};
use crate::guard::Admission;
use crate::protocol::ParamValue;
use crate::protocol::reserved::FINAL_RESPONSE;
use crate::routing::VersionRoute;
use crate::telemetry::metrics::{Metrics, StreamLeg, StreamResult};
use crate::upstream::grpc::StreamRequests;

/// A backend stream of a client's stream: where its requests go, and how many went.
pub(super) struct BackendLeg {
    pub(super) requests: StreamRequests,
    pub(super) sent: Arc<AtomicU64>,
}

/// What one backend stream (or one request sent to a REST backend) carried, recorded in the metrics when dropped:
/// a relay stopped because its client went away records a cancelled stream.
pub(super) struct LegRecord {
    /// The place among its model's calls under way the leg holds while it runs.
    pub(super) admission: Option<Admission>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) route: Arc<VersionRoute>,
    sent: Arc<AtomicU64>,
    pub(super) opened: Instant,
    pub(super) leg: StreamLeg,
}

impl LegRecord {
    pub(super) fn new(
        metrics: &Arc<Metrics>,
        route: &Arc<VersionRoute>,
        sent: Arc<AtomicU64>,
        result: Option<StreamResult>,
    ) -> LegRecord {
        LegRecord {
            admission: None,
            metrics: metrics.clone(),
            route: route.clone(),
            sent,
            opened: Instant::now(),
            leg: StreamLeg {
                result,
                messages_in: 0,
                messages_out: 0,
                first_response: None,
            },
        }
    }

    pub(super) fn holding(mut self, admission: Admission) -> LegRecord {
        self.admission = Some(admission);
        self
    }

    pub(super) fn responded(&mut self) {
        self.leg.messages_out += 1;
        if self.leg.first_response.is_none() {
            self.leg.first_response = Some(self.opened.elapsed());
        }
    }
}

impl Drop for LegRecord {
    fn drop(&mut self) {
        self.leg.messages_in = self.sent.load(Ordering::Relaxed);
        self.metrics
            .stream_leg(&self.route.model, &self.route.version, &self.leg);
    }
}

/// One request of a stream sent to a REST backend as a unary inference, its answer flagged final as Triton flags
/// the one response of a model that is not decoupled; a failure is the request's error response.
pub(super) async fn unary_over_rest(
    backend: Arc<BackendClients>,
    routed: crate::routing::Routed,
    request: crate::protocol::InferRequest,
    (deadline, context): (Duration, CallContext),
    answers: Answers,
    id: String,
    mut record: LegRecord,
) -> Result<()> {
    let replied = call_infer(&backend, &routed.route, request, &context, deadline, &routed.affinity).await;
    record.responded();
    match replied {
        Ok(replied) => {
            let mut response = replied.value;
            response
                .parameters
                .insert(FINAL_RESPONSE.to_owned(), ParamValue::Bool(true));
            answers
                .respond(splice::stream_response("", protobuf::encode_response(response).chunks))
                .await;
        }
        Err(error) => {
            answers.fail(&id, &error).await;
        }
    }
    Ok(())
}

/// A backend stream's responses onto the client's stream, renamed to the public names, until the backend ends it.
/// The lease keeps the stream counted on its endpoint; how the stream ended feeds the endpoint's outlier detection.
/// An MLServer backend's bare responses are wrapped as Triton's stream answers them, and the error that ends its
/// stream is the error response of the request that opened it (`first_id`), the client's stream going on.
pub(super) async fn relay(
    mut upstream: tonic::codec::Streaming<Bytes>,
    lease: Lease,
    backend: Arc<BackendClients>,
    route: Arc<VersionRoute>,
    (answers, first_id): (Answers, String),
    mut record: LegRecord,
) -> Result<()> {
    let dialect = backend.config.stream;
    let outcome = async {
        loop {
            let message = upstream.message().await.map_err(|status| {
                Error::from_upstream_grpc(status.code(), format!("backend {}: {}", backend.name, status.message()))
            })?;
            let Some(message) = message else { return Ok(()) };
            let renamed = match dialect {
                StreamDialect::Triton => splice::rename_stream_response(&message, &route.model, &route.version),
                StreamDialect::Mlserver => splice::rename(&message, &route.model, &route.version)
                    .map(|response| splice::stream_response("", response)),
            }
            .map_err(Error::into_upstream_protocol_error)?;
            record.responded();
            if !answers.respond(renamed).await {
                return Ok(());
            }
        }
    }
    .await;
    let failed = outcome.as_ref().err().is_some_and(Error::is_endpoint_failure);
    lease.observed(failed, &backend.fleet.policy);
    record.leg.result = Some(match &outcome {
        Ok(()) if answers.sender.is_closed() => StreamResult::Cancelled,
        Ok(()) => StreamResult::Ok,
        Err(_) => StreamResult::Error,
    });
    match outcome {
        Err(error) if dialect == StreamDialect::Mlserver => {
            answers.fail(&first_id, &error).await;
            Ok(())
        }
        outcome => outcome,
    }
}

/// Opens a backend stream for `routed` on an endpoint of its gRPC `backend`, `first` its first message, carrying
/// the client stream's deadline, compression and span; gives it with the place it holds at the endpoint.
pub(super) async fn open_leg(
    backend: &BackendClients,
    routed: &crate::routing::Routed,
    first: Vec<Bytes>,
    context: &CallContext,
) -> Result<(crate::upstream::grpc::UpstreamStream, Lease)> {
    let route = &routed.route;
    let lease = backend
        .fleet
        .lease(
            &backend.name,
            (&route.upstream_name, &route.upstream_version),
            &routed.affinity,
            &[],
            None,
        )
        .await?;
    let Replicas::Grpc { endpoints } = &backend.replicas else {
        return Err(Error::internal("a gRPC stream to a REST backend"));
    };
    let coding = context.compressed.filter(|_| backend.config.compression);
    let forward = context.trace.carried(&context.forward);
    let opened = endpoints[lease.index]
        .open_stream(MODEL_STREAM_INFER, first, context.deadline, &forward, coding)
        .await;
    match opened {
        Ok(upstream) => Ok((upstream, lease)),
        Err(error) => {
            lease.observed(error.is_endpoint_failure(), &backend.fleet.policy);
            Err(error)
        }
    }
}
