//! Triton's inference stream (ModelStreamInfer) through the gateway: each request of a client's stream is routed on
//! its own. To a gRPC backend it goes on a stream opened to one endpoint for the request's route (the first request
//! chooses the endpoint, by its sequence when it has one), passed through as bytes with the names spliced; to a REST
//! backend it is one unary inference, translated. Responses are merged onto the client's stream as they come; a
//! request that fails is one response carrying its error and its id, and the stream goes on.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::backend::{BackendClients, Replicas};
use super::fleet::Lease;
use super::{CallContext, Dispatcher, call_infer, decode_grpc_request};
use crate::codec::{protobuf, splice};
use crate::error::{Error, ErrorKind, Origin, Result};
use crate::protocol::reserved::FINAL_RESPONSE;
use crate::protocol::{ParamValue, Reserved};
use crate::routing::VersionRoute;
use crate::upstream::grpc::StreamRequests;

pub const MODEL_STREAM_INFER: &str = "/inference.GRPCInferenceService/ModelStreamInfer";

/// What a client's stream is sent: an encoded `ModelStreamInferResponse` as chunks, or the error that ends it.
pub type StreamAnswer = Result<Vec<Bytes>>;

impl Dispatcher {
    /// Carries one client stream: reads `requests` (encoded `ModelInferRequest`s) until they end, then waits for
    /// every response. Ends early, with the error sent last, when the client's stream fails or a backend's stream
    /// fails as a whole; a client that goes away (`answers` closed) stops everything under way, resetting the
    /// backends' streams.
    pub async fn infer_stream(
        self: Arc<Self>,
        mut requests: impl futures_util::Stream<Item = Result<Bytes>> + Unpin,
        context: CallContext,
        answers: mpsc::Sender<StreamAnswer>,
    ) {
        use futures_util::StreamExt;

        let mut legs: HashMap<usize, StreamRequests> = HashMap::new();
        let mut running: JoinSet<Result<()>> = JoinSet::new();
        let failed = loop {
            tokio::select! {
                next = requests.next() => match next {
                    Some(Ok(message)) => {
                        if let Err(error) = self.stream_request(message, &context, &mut legs, &mut running, &answers).await {
                            break Some(error);
                        }
                    }
                    Some(Err(error)) => break Some(error),
                    None => break None,
                },
                Some(done) = running.join_next() => {
                    if let Some(error) = finished(done) {
                        break Some(error);
                    }
                }
                () = answers.closed() => return,
            }
        };
        if let Some(error) = failed {
            let _ = answers.send(Err(error)).await;
            return;
        }
        // The client has sent everything: the backends' streams are told so, and their last responses awaited.
        drop(legs);
        loop {
            tokio::select! {
                done = running.join_next() => match done {
                    None => return,
                    Some(done) => {
                        if let Some(error) = finished(done) {
                            let _ = answers.send(Err(error)).await;
                            return;
                        }
                    }
                },
                () = answers.closed() => return,
            }
        }
    }

    /// Routes one request of a stream and sends it on; a request that cannot be routed or sent is answered with its
    /// error. An error returned ends the client's stream.
    async fn stream_request(
        &self,
        message: Bytes,
        context: &CallContext,
        legs: &mut HashMap<usize, StreamRequests>,
        running: &mut JoinSet<Result<()>>,
        answers: &mpsc::Sender<StreamAnswer>,
    ) -> Result<()> {
        // A message that is not a request ends the stream, as a malformed unary request fails its call.
        let fields = splice::model_fields(&message)?;
        let id = fields.id.to_owned();
        let sent = async {
            splice::refuse_shared_memory(&message)?;
            let reserved = Reserved::from_parameters(&splice::parameters(&message)?)?;
            let routed = self
                .route(fields.name, Some(fields.version), &context.forward, reserved.sequence)
                .0?;
            let route = routed.route;
            let backend = self
                .backends
                .get(route.backend)
                .cloned()
                .ok_or_else(|| Error::internal(format!("no backend {} for a route", route.backend)))?;
            match &backend.replicas {
                Replicas::Grpc { .. } => {
                    let renamed = splice::rename(&message, &route.upstream_name, &route.upstream_version)?;
                    if let Some(leg) = legs.get(&route.id) {
                        return leg.send(renamed).await;
                    }
                    let lease = backend
                        .fleet
                        .lease(
                            &backend.name,
                            &route.upstream_name,
                            &route.upstream_version,
                            &routed.affinity,
                            &[],
                        )
                        .await?;
                    let Replicas::Grpc { endpoints } = &backend.replicas else {
                        unreachable!("matched above")
                    };
                    let coding = context.compressed.filter(|_| backend.config.compression);
                    let opened = endpoints[lease.index]
                        .open_stream(MODEL_STREAM_INFER, renamed, context.deadline, &context.forward, coding)
                        .await;
                    let upstream = match opened {
                        Ok(upstream) => upstream,
                        Err(error) => {
                            lease.state.observed(error.is_endpoint_failure(), &backend.fleet.policy);
                            return Err(error);
                        }
                    };
                    legs.insert(route.id, upstream.requests);
                    running.spawn(relay(
                        upstream.answers,
                        lease,
                        backend.clone(),
                        route.clone(),
                        answers.clone(),
                    ));
                    Ok(())
                }
                Replicas::Rest { .. } => {
                    let request = decode_grpc_request(message.clone())?;
                    let deadline = self.deadline(context);
                    let context = context.clone();
                    let answers = answers.clone();
                    let affinity = routed.affinity.clone();
                    let request_id = id.clone();
                    running.spawn(async move {
                        let replied = call_infer(
                            &backend,
                            &route,
                            request,
                            &context.forward,
                            context.compressed,
                            deadline,
                            &affinity,
                        )
                        .await;
                        let answer = match replied {
                            Ok(replied) => {
                                let mut response = replied.value;
                                // As Triton flags the one response of a model that is not decoupled.
                                response
                                    .parameters
                                    .insert(FINAL_RESPONSE.to_owned(), ParamValue::Bool(true));
                                splice::stream_response("", protobuf::encode_response(response).chunks)
                            }
                            Err(error) => failed_response(&request_id, &error),
                        };
                        let _ = answers.send(Ok(answer)).await;
                        Ok(())
                    });
                    Ok(())
                }
            }
        };
        match sent.await {
            Ok(()) => Ok(()),
            Err(error) => answers
                .send(Ok(failed_response(&id, &error)))
                .await
                .map_err(|_| Error::new(ErrorKind::Cancelled, Origin::Client, "the client went away")),
        }
    }
}

/// A backend stream's responses onto the client's stream, renamed to the public names, until the backend ends it.
/// The lease keeps the stream counted on its endpoint; how the stream ended feeds the endpoint's outlier detection.
async fn relay(
    mut upstream: tonic::codec::Streaming<Bytes>,
    lease: Lease,
    backend: Arc<BackendClients>,
    route: Arc<VersionRoute>,
    answers: mpsc::Sender<StreamAnswer>,
) -> Result<()> {
    let outcome = async {
        loop {
            let message = upstream.message().await.map_err(|status| {
                Error::from_upstream_grpc(status.code(), format!("backend {}: {}", backend.name, status.message()))
            })?;
            let Some(message) = message else { return Ok(()) };
            let renamed = splice::rename_stream_response(&message, &route.model, &route.version)
                .map_err(Error::into_upstream_protocol_error)?;
            if answers.send(Ok(renamed)).await.is_err() {
                return Ok(());
            }
        }
    }
    .await;
    let failed = outcome.as_ref().err().is_some_and(Error::is_endpoint_failure);
    lease.state.observed(failed, &backend.fleet.policy);
    outcome
}

/// The error a finished task of a stream ends the stream with, if any.
fn finished(done: std::result::Result<Result<()>, tokio::task::JoinError>) -> Option<Error> {
    match done {
        Ok(Ok(())) => None,
        Ok(Err(error)) => Some(error),
        Err(error) => Some(Error::internal(format!("a stream's task failed: {error}"))),
    }
}

/// The response Triton gives a request of a stream that failed: its error message, and its id.
fn failed_response(id: &str, error: &Error) -> Vec<Bytes> {
    let response = crate::proto::ModelInferResponse {
        id: id.to_owned(),
        ..Default::default()
    };
    splice::stream_response(
        error.message(),
        vec![Bytes::from(prost::Message::encode_to_vec(&response))],
    )
}
