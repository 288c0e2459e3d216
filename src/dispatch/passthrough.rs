//! REST inferences proxied to a REST backend unchanged but for their path: where one may go, and sending it (to
//! another endpoint while none could be reached, within the backend's retries and budget).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;

use super::Dispatcher;
use super::backend::{Attempt, Replicas, Tries};
use crate::body::{ChunksBody, OutBody, RelaySource, Relayed};
use crate::dispatch::fleet::Lease;
use crate::error::{Error, Result};
use crate::headers::PassedOn;
use crate::routing::Affinity;
use crate::routing::{Routed, VersionRoute};
use crate::telemetry::metrics::BackendMetrics;
use crate::telemetry::traces::Trace;
use crate::upstream::{BackendBody, Deadline};

/// A REST request proxied to a backend unchanged but for its path.
#[derive(Debug, Clone)]
pub struct Passthrough {
    /// The route: the public model and version, the backend, and the backend's own names.
    pub route: Arc<VersionRoute>,
    affinity: Affinity,
    /// The backend's path for the model and version.
    pub path: http::uri::PathAndQuery,
    /// Bound on the backend's answer.
    pub timeout: Duration,
    /// Whether the backend's model name or version differs from the public one (to be put back in the answer).
    pub aliased: bool,
    /// Whether the backend reads compressed request bodies (a compressed one goes to it as it came).
    pub compression: bool,
    /// The backend's metric handles, for the proxied call's in-flight count and latency.
    pub backend_metrics: BackendMetrics,
}

/// A proxied request's body: whole at hand, or relayed from the client as it arrives.
#[derive(Debug, Clone)]
pub enum Outgoing {
    Whole(Bytes),
    Relayed(Arc<RelaySource>),
}

impl Outgoing {
    fn body(&self) -> OutBody {
        match self {
            Outgoing::Whole(body) => ChunksBody::new(vec![body.clone()]).into(),
            Outgoing::Relayed(source) => OutBody::Relayed(Box::new(Relayed::new(source.clone()))),
        }
    }

    /// Whether another attempt can still send it all.
    fn resendable(&self) -> bool {
        match self {
            Outgoing::Whole(_) => true,
            Outgoing::Relayed(source) => source.untouched(),
        }
    }
}

impl Dispatcher {
    /// Where a REST client's inference can be proxied as it is: a REST backend that understands the body
    /// (binary-extension bodies only to backends that speak it). Aliased names are renamed on the way back.
    pub fn rest_passthrough(&self, routed: &Routed, binary_body: bool) -> Result<Option<Passthrough>> {
        let route = &routed.route;
        let backend = self.backend(route)?;
        let Replicas::Rest { binary_data, .. } = &backend.replicas else {
            return Ok(None);
        };
        if binary_body && !binary_data {
            return Ok(None);
        }
        let path = self
            .rest_paths
            .get(route.id)
            .cloned()
            .flatten()
            .ok_or_else(|| Error::internal("no REST path for a route"))?;
        Ok(Some(Passthrough {
            route: route.clone(),
            affinity: routed.affinity.clone(),
            path,
            timeout: route.timeout,
            aliased: route.upstream_name != route.model || route.upstream_version != route.version,
            compression: backend.config.compression,
            backend_metrics: backend.metrics.clone(),
        }))
    }

    /// Sends a proxied request to an endpoint of the backend, and to others while it could not reach one (within the
    /// backend's retries and budget, and while the body can still be sent whole), until `until`. Gives the answer's
    /// head with the place held at the endpoint that answered; an answer of 5xx counts against that endpoint.
    pub async fn passthrough_send(
        &self,
        target: &Passthrough,
        passed: &PassedOn<'_>,
        body: &Outgoing,
        deadline: Deadline,
        trace: &Trace,
    ) -> Result<(http::Response<BackendBody>, Lease)> {
        let backend = self.backend(&target.route)?;
        let Replicas::Rest { endpoints, .. } = &backend.replicas else {
            return Err(Error::internal("no REST client for a proxied request"));
        };
        // The tries' own headers are only the trace context each carries: the request's are written from where they
        // stand.
        let none = HeaderMap::new();
        let tries = Tries {
            upstream: (&target.route.upstream_name, &target.route.upstream_version),
            affinity: &target.affinity,
            until: deadline.until,
            began: Some(deadline.began()),
            forward: &none,
            trace,
        };
        backend
            .attempt_holding(
                tries,
                || body.resendable(),
                |Attempt { index, forward, .. }| async move {
                    let client = endpoints
                        .get(index)
                        .ok_or_else(|| Error::internal("no REST client for a proxied request"))?;
                    client
                        .forward(&target.path, &forward, Some(passed), body.body(), deadline)
                        .await
                },
                |response, span| {
                    span.set("http.response.status_code", i64::from(response.status().as_u16()));
                    response.status().is_server_error()
                },
            )
            .await
    }
}
