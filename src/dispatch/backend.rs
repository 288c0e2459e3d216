//! A backend's clients: one per endpoint over the backend's protocol (and TLS), the endpoints' shared state, the
//! carry-over of both when a configuration is rebuilt, and the attempt loop (retries within budget and deadline).

use std::borrow::Cow;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{CONNECT_TIMEOUT, MODEL_INFER};
use crate::codec::compression::Coding;
use crate::config::{Backend, BackendProtocol, Discovery, Endpoint};
use crate::dispatch::fleet::{EndpointState, Endpoints, Lease};
use crate::error::{Error, Result};
use crate::routing::Affinity;
use crate::routing::VersionRoute;
use crate::telemetry::metrics::{BackendMetrics, Metrics};
use crate::telemetry::traces::Trace;
use crate::tls::BackendMaterial;
use crate::upstream::BackendAnswer;
use crate::upstream::{EndpointTls, GrpcUpstream, RestUpstream};

/// A backend's replicas, spoken to over its protocol.
#[derive(Debug)]
pub(super) enum Replicas {
    Rest {
        endpoints: Vec<RestUpstream>,
        binary_data: bool,
    },
    Grpc {
        endpoints: Vec<GrpcUpstream>,
    },
}

/// One try of a call: the endpoint chosen (its index), the time left, and the end-to-end headers to send, which
/// carry the try's span when the call is traced.
#[derive(Debug)]
pub(super) struct Attempt<'a> {
    pub(super) index: usize,
    pub(super) left: Duration,
    pub(super) forward: Cow<'a, http::HeaderMap>,
}

/// Where the tries of one call go: the backend's names for the model and version, what ties the call to an
/// endpoint, when the tries must end, the end-to-end headers to send, and the span each try is a step of.
#[derive(Debug, Clone, Copy)]
pub(super) struct Tries<'t, 'a> {
    pub(super) upstream: (&'t str, &'t str),
    pub(super) affinity: &'t Affinity,
    pub(super) until: Instant,
    /// When the call began, when its caller read the clock for it: the first try's start (a retry reads it again).
    pub(super) began: Option<Instant>,
    pub(super) forward: &'a http::HeaderMap,
    pub(super) trace: &'t Trace,
}

#[derive(Debug)]
pub(super) struct BackendClients {
    pub(super) name: String,
    /// The configuration it was built from (its endpoints aside) and its TLS material, to tell on reload whether
    /// its connections can be kept.
    pub(super) config: Backend,
    pub(super) tls: Option<BackendMaterial>,
    /// The endpoints, in the order of `replicas` and `fleet.states`.
    pub(super) endpoints: Vec<Endpoint>,
    pub(super) replicas: Replicas,
    /// The replicas' state and the choice among them; index `i` is replica `i` of `replicas`.
    pub(super) fleet: Endpoints,
    pub(super) metrics: BackendMetrics,
}

impl BackendClients {
    /// The clients of `backend` at `endpoints`; an endpoint `reuse` has is taken over with its connections and state.
    pub(super) fn new(
        backend: &Backend,
        endpoints: &[Endpoint],
        tls: Option<BackendMaterial>,
        max_response: usize,
        reuse: Option<&BackendClients>,
        metrics: &Metrics,
    ) -> BackendClients {
        let server_name = tls.as_ref().and_then(|material| {
            material.server_name.clone().or_else(|| match &backend.discovery {
                Discovery::Dns { host, .. } => Some(host.clone()),
                Discovery::Static | Discovery::File { .. } => None,
            })
        });
        let endpoint_tls = tls.as_ref().map(|material| EndpointTls {
            material: material.clone(),
            server_name: server_name.clone(),
        });
        let previous = |endpoint: &Endpoint| {
            reuse.and_then(|old| old.endpoints.iter().position(|e| e == endpoint).map(|i| (old, i)))
        };
        // Configured headers are not about connections: a reload that changes them keeps the connections.
        let added = Arc::new(backend.headers.clone());
        let replicas = match backend.protocol {
            BackendProtocol::Rest => Replicas::Rest {
                endpoints: endpoints
                    .iter()
                    .map(|e| match previous(e) {
                        Some((old, i)) if let Replicas::Rest { endpoints: clients, .. } = &old.replicas => {
                            clients[i].clone()
                        }
                        _ => RestUpstream::new(e, CONNECT_TIMEOUT, max_response, endpoint_tls.as_ref()),
                    })
                    .map(|client| client.adding(&added))
                    .collect(),
                binary_data: backend.binary_data,
            },
            BackendProtocol::Grpc => Replicas::Grpc {
                endpoints: endpoints
                    .iter()
                    .map(|e| match previous(e) {
                        Some((old, i)) if let Replicas::Grpc { endpoints: clients } = &old.replicas => {
                            clients[i].clone()
                        }
                        _ => GrpcUpstream::new(e, CONNECT_TIMEOUT, max_response, endpoint_tls.as_ref()),
                    })
                    .map(|client| client.adding(&added))
                    .collect(),
            },
        };
        let states = endpoints
            .iter()
            .map(|e| match previous(e) {
                Some((old, i)) => old.fleet.states[i].clone(),
                None => {
                    let authority = e.to_string();
                    let gauge = metrics.endpoint_healthy(&backend.name, &authority);
                    Arc::new(EndpointState::new(authority, &backend.policy, gauge))
                }
            })
            .collect();
        BackendClients {
            name: backend.name.clone(),
            config: backend.clone(),
            tls,
            endpoints: endpoints.to_vec(),
            replicas,
            fleet: Endpoints::from_states(
                states,
                backend.policy.clone(),
                (backend.policy.lb == crate::config::LoadBalancing::LeastLoad)
                    .then(|| metrics.load_fallbacks(&backend.name)),
            ),
            metrics: metrics.backend(&backend.name),
        }
    }

    /// Whether clients built for `backend` with `tls` would connect the same way as these.
    pub(super) fn same_connections(&self, backend: &Backend, tls: Option<&BackendMaterial>) -> bool {
        let mut a = self.config.clone();
        let mut b = backend.clone();
        a.endpoints.clear();
        b.endpoints.clear();
        a == b && self.tls.as_ref() == tls
    }

    /// Runs `call` on a chosen endpoint, and on further endpoints while the call failed before reaching one, within
    /// the backend's retries and retry budget and the deadline; each try counted in flight and timed. Each try is a
    /// span of `trace`, carried to the backend in the try's `forward` headers.
    pub(super) async fn attempt<'a, T, F, Fut>(
        &self,
        upstream: (&str, &str),
        affinity: &Affinity,
        deadline: Duration,
        forward: &'a http::HeaderMap,
        trace: &Trace,
        mut call: F,
    ) -> Result<T>
    where
        F: FnMut(Attempt<'a>) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let began = Instant::now();
        let tries = Tries {
            upstream,
            affinity,
            until: began + deadline,
            began: Some(began),
            forward,
            trace,
        };
        let counted = |attempt| {
            let in_flight = self.metrics.call();
            let tried = call(attempt);
            async move {
                let _in_flight = in_flight;
                tried.await
            }
        };
        let (answer, _lease) = self.attempt_holding(tries, || true, counted, |_, _| false).await?;
        Ok(answer)
    }

    /// The one retry loop of backend calls. Runs `call` on an endpoint chosen for `tries.upstream`, and on further
    /// endpoints while it failed before reaching one and `resendable` says the request can still be sent whole,
    /// within the backend's retries, its retry budget and `tries.until`. Every outcome feeds the endpoint's outlier
    /// detection: an error by its kind, an answer by `judge`, which also notes the answer on the try's span and says
    /// whether it counts against the endpoint (a 5xx). Gives the answer with the place it holds at its endpoint.
    pub(super) async fn attempt_holding<'a, T, F, Fut>(
        &self,
        tries: Tries<'_, 'a>,
        resendable: impl Fn() -> bool,
        mut call: F,
        judge: impl Fn(&T, &Trace) -> bool,
    ) -> Result<(T, Lease)>
    where
        F: FnMut(Attempt<'a>) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let (model, version) = tries.upstream;
        let mut tried = Vec::new();
        let mut unreached: Option<Error> = None;
        loop {
            let lease = match self
                .fleet
                .lease(
                    &self.name,
                    (model, version),
                    tries.affinity,
                    &tried,
                    tries.began.filter(|_| tried.is_empty()),
                )
                .await
            {
                Ok(lease) => lease,
                // No other endpoint to try: the endpoint that could not be reached is the answer.
                Err(error) => return Err(unreached.unwrap_or(error)),
            };
            let span = self.try_span(tries.trace, lease.index, tried.len());
            let outcome = call(Attempt {
                index: lease.index,
                // The lease was taken a moment ago: its start is now, without reading the clock again.
                left: tries.until.saturating_duration_since(lease.started()),
                forward: span.carried(tries.forward),
            })
            .await;
            let error = match outcome {
                Ok(answer) => {
                    let failed = judge(&answer, &span);
                    lease.observed(failed, &self.fleet.policy);
                    return Ok((answer, lease));
                }
                Err(error) => error,
            };
            span.failed(&error);
            lease.observed(error.is_endpoint_failure(), &self.fleet.policy);
            tried.push(lease.index);
            let retry = error.is_unsent()
                && resendable()
                && Instant::now() < tries.until
                && tried.len() <= self.fleet.policy.retries as usize
                && self.fleet.has_untried(model, version, &tried)
                && self.fleet.take_retry();
            if !retry {
                return Err(error);
            }
            self.metrics.retried();
            unreached = Some(error);
        }
    }

    /// `ModelInfer` with `message` (already in the backend's names for the model) on an endpoint of this gRPC
    /// backend serving `route`, tried as [`Self::attempt`] tries; its answer as it came.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn model_infer(
        &self,
        route: &VersionRoute,
        affinity: &Affinity,
        deadline: Duration,
        forward: &http::HeaderMap,
        trace: &Trace,
        message: Vec<Bytes>,
        coding: Option<Coding>,
    ) -> Result<BackendAnswer<Bytes>> {
        let Replicas::Grpc { endpoints } = &self.replicas else {
            return Err(Error::internal(format!(
                "a gRPC inference for REST backend {}",
                self.name
            )));
        };
        let upstream = (route.upstream_name.as_str(), route.upstream_version.as_str());
        self.attempt(
            upstream,
            affinity,
            deadline,
            forward,
            trace,
            |Attempt { index, left, forward }| {
                let message = message.clone();
                async move {
                    endpoints[index]
                        .unary(MODEL_INFER, message, Some(left), &forward, coding)
                        .await
                }
            },
        )
        .await
    }

    /// The span of one try at endpoint `index`, the `retry`th after the first.
    pub(super) fn try_span(&self, trace: &Trace, index: usize, retry: usize) -> Trace {
        trace.child("backend attempt", opentelemetry::trace::SpanKind::Client, || {
            vec![
                opentelemetry::KeyValue::new("oip.backend", self.name.clone()),
                opentelemetry::KeyValue::new(
                    "server.address",
                    self.fleet
                        .states
                        .get(index)
                        .map(|state| state.authority.to_string())
                        .unwrap_or_default(),
                ),
                opentelemetry::KeyValue::new("oip.retry", i64::try_from(retry).unwrap_or(i64::MAX)),
            ]
        })
    }
}
